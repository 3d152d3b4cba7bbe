"""Step-domain detectors and the replay engine: per-step cost, and backtest speed.

    python bench/detector.py [--steps N]

* the detectors' cost per logged step (every signal of the spec), in the sidecar's store and in the circuit
  breaker, as a ratio against the store's own ingestion of the same step (measured in the same run);
* backtest speed (steps/s) of the replay engine + promtool over the simulated profiles.
"""

from __future__ import annotations

import argparse
import statistics
import time

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from verl_exporter.core.detect import Detectors  # noqa: E402
from verl_exporter.exposition.selfmetrics import SelfMetrics  # noqa: E402
from verl_exporter.sidecar.store import TrainingStore  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.tools import replay as rp  # noqa: E402
from verl_exporter.trainer.breaker import CircuitBreaker  # noqa: E402


def per_step_us(fn, lines: list[dict], repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        fn(lines)
        runs.append((time.perf_counter_ns() - t) / len(lines) / 1000)
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--no-backtest", action="store_true")
    args = p.parse_args()
    spec = load_spec()
    lines = rp.simulate("grpo", steps=args.steps)

    def detectors(ls):
        d = Detectors.from_spec(spec)
        for ln in ls:
            d.observe(ln["step"], ln["data"])

    class NoDetectors:
        def observe(self, *a):
            return False

        def rows(self):
            return {}

    def store(with_detectors: bool):
        def run(ls):
            s = TrainingStore(spec, SelfMetrics(spec))
            if not with_detectors:
                s.detectors = NoDetectors()
            for i, ln in enumerate(ls):
                s.ingest(ln["step"], ln["data"], float(i))
        return run

    def breaker(ls):
        b = CircuitBreaker.from_spec(spec, consecutive=10**9)
        for ln in ls:
            b.observe(ln["step"], ln["data"])

    det = per_step_us(detectors, lines)
    bare = per_step_us(store(False), lines)
    full = per_step_us(store(True), lines)
    brk = per_step_us(breaker, lines)
    n = len(spec.signals())
    print(f"detectors, {n} signals: {det:.0f} us/step ({det / n:.1f} us per signal)")
    print(f"store.ingest without detectors: {bare:.0f} us/step; with: {full:.0f} us/step "
          f"(ratio {full / bare:.2f}; a 5 s step = {full / 5e6 * 100:.4f} % of a core)")
    print(f"circuit breaker (spec rules + detectors): {brk:.0f} us/step (ratio to bare ingest {brk / bare:.2f})")
    if not args.no_backtest:
        for profile in ("ppo", "grpo", "agentic"):
            ls = rp.simulate(profile)
            t = time.perf_counter()
            samples = rp.replay(ls)
            t1 = time.perf_counter()
            rp.evaluate(samples, paths.REPO / "rules")
            t2 = time.perf_counter()
            print(f"backtest {profile}: {len(ls)} steps, {samples.length} min: replay {len(ls) / (t1 - t):.0f} "
                  f"steps/s, with promtool {len(ls) / (t2 - t):.1f} steps/s ({samples.length / (t2 - t):.0f} "
                  "simulated minutes/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
