"""Circuit breaker cost per step, as a ratio against 100 bare prometheus_client Gauge.set calls.

    python bench/breaker.py [--steps N]

The breaker runs on the Monitor's worker thread, once per logged step, judging every critical alert of the
spec a trainer can see (NaN/Inf, the reward collapse, collapsed answers, numerical collapse, the stall) with
the step-domain detectors they read. "Cheap enough to run every step" means: well under what exporting the
same step to Prometheus by hand would cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from prometheus_client import CollectorRegistry, Gauge  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.tools.demo import demo_lines  # noqa: E402
from verl_exporter.trainer.breaker import CircuitBreaker  # noqa: E402


def per_call_us(fn, n: int, repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        fn(n)
        runs.append((time.perf_counter_ns() - t) / n / 1000)
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20000)
    args = p.parse_args()
    steps = [json.loads(line)["data"] for line in demo_lines()]
    data = [{k: v for k, v in d.items() if isinstance(v, (int, float)) or v is None} for d in steps]
    breaker = CircuitBreaker.from_spec(load_spec(), consecutive=10**9)  # never trips: steady state
    alerts = breaker.alerts  # judged with the step-domain detectors of the signals they read

    def observe(n):
        for i in range(n):
            breaker.observe(i, data[i % 229])  # healthy steps only (the fault starts at 230)

    registry = CollectorRegistry()
    gauges = [Gauge(f"g{i}", "x", registry=registry) for i in range(100)]

    def gauge_loop(n):
        for _ in range(n):
            for g in gauges:
                g.set(1.0)

    b = per_call_us(observe, args.steps)
    g = per_call_us(gauge_loop, max(args.steps // 10, 100))
    print(f"critical alerts judged: {len(alerts)} ({', '.join(a.alert for a in alerts)}); "
          f"detectors: {len(breaker.detectors.detectors)}")
    print(f"breaker.observe per step: {b:.2f} us; 100 x Gauge.set: {g:.2f} us; ratio {b / g:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
