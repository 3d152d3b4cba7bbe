"""How `verl-exporter backtest` scales with the length of a run: the same simulated PPO run (one step a minute)
at N and 4N steps, each measured in its own process: seconds (replay, promtool evaluation) and peak memory
(the Python process, the largest promtool child). Linear scaling shows as time ratios near 4 (a little more
once the long run is evaluated in chunks, each with its warm-up) and a promtool peak that stops growing once a
run is longer than one chunk. --single also evaluates the long run in one promtool call (the way it was done
before chunking) as a baseline.

    python bench/backtest_scale.py [--steps 4000] [--chunk-minutes 10080] [--single]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.tools import replay as rp  # noqa: E402
from verl_exporter.tools.backtest import _render_rules_into  # noqa: E402


def measure(steps: int, chunk_minutes: int) -> dict:
    """One backtest of a `steps`-step run, in this process: its times and peak memory."""
    spec = load_spec()
    with tempfile.TemporaryDirectory() as tmp:
        rules = _render_rules_into(spec, tmp)
        log = Path(tmp) / "run.jsonl"
        rp.write_jsonl(rp.simulate("ppo", steps=steps), log)
        t0 = time.perf_counter()
        lines, _ = rp.read_run(log, max_steps=0)
        samples = rp.replay(lines, spec, period_s=60.0)
        t1 = time.perf_counter()
        fired = rp.evaluate(samples, rules, chunk_minutes=chunk_minutes)
        t2 = time.perf_counter()
    return {"steps": steps, "replay_s": t1 - t0, "evaluate_s": t2 - t1, "alerts": len(fired),
            "python_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "promtool_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def in_child(steps: int, chunk_minutes: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--measure", str(steps), "--chunk-minutes", str(chunk_minutes)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4000, help="the short run's steps (the long one has 4x)")
    ap.add_argument("--chunk-minutes", type=int, default=rp.CHUNK_MINUTES, help="promtool chunk length")
    ap.add_argument("--single", action="store_true", help="also the long run in one promtool call (baseline)")
    ap.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.chunk_minutes)))
        return 0
    rows = [("short", in_child(args.steps, args.chunk_minutes)), ("long (4x)", in_child(4 * args.steps,
                                                                                       args.chunk_minutes))]
    if args.single:
        rows.append(("long, one promtool call", in_child(4 * args.steps, 10**9)))
    print("| run | steps | replay s | evaluate s | Python peak MB | promtool peak MB | alert starts |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['steps']} | {r['replay_s']:.1f} | {r['evaluate_s']:.1f} | {r['python_mb']:.0f} | "
              f"{r['promtool_mb']:.0f} | {r['alerts']} |")
    short, long_ = rows[0][1], rows[1][1]
    print(f"\nlong/short: replay x{long_['replay_s'] / short['replay_s']:.2f}, evaluate "
          f"x{long_['evaluate_s'] / short['evaluate_s']:.2f}, "
          f"promtool peak x{long_['promtool_mb'] / short['promtool_mb']:.2f}"
          f" (4x the steps; warm-up of each chunk: {_warmup()} minutes)")
    if args.single:
        single = rows[2][1]
        print(f"chunked/one call on the long run: evaluate x{long_['evaluate_s'] / single['evaluate_s']:.2f}, "
              f"promtool peak x{long_['promtool_mb'] / single['promtool_mb']:.2f}")
    return 0


def _warmup() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        rules = Path(_render_rules_into(load_spec(), tmp))
        return rp.warmup_minutes((rules / n).read_text() for n in ("verl-recording.yaml", "verl-alerts.yaml"))


if __name__ == "__main__":
    sys.exit(main())
