"""The circuit breaker against the alert pack on every replay scenario and every run of the real-run corpus:
the pack's first critical page (promtool over the generated rules), the breaker's trip (the same lines on the
same clock), the lag in steps. The README's table.

    python bench/breaker_agreement.py
"""

from __future__ import annotations

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.tools import agreement as ag  # noqa: E402
from verl_exporter.tools import replay as rp  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "real_runs"
RULES = Path(__file__).resolve().parent.parent / "rules"


def main() -> int:
    spec = load_spec()
    runs = [(f"{p} {f or 'healthy'}" + (f" @{at}" if f else ""), rp.simulate(p, rp.Fault(f, at) if f else None), tail)
            for p, f, at, tail in rp.SCENARIOS]
    for run in yaml.safe_load((CORPUS / "corpus.yaml").read_text())["runs"]:
        runs.append((f"real {run['name']} ({run['verdict']})", rp.read_jsonl(CORPUS / run["file"]), 0))
    print("| run | pack's first critical page (step) | breaker trip (step) | lag (steps) | agree |")
    print("|---|---|---|---|---|")
    bad = 0
    for name, lines, tail in runs:
        samples = rp.replay(lines, tail_s=tail)
        a = ag.agreement(lines, samples, rp.evaluate(samples, RULES), spec)
        bad += not a.agrees
        page = f"{a.page} ({a.page_step})" if a.page else "none"
        trip = f"{a.trip} ({a.trip_step})" if a.trip else "none"
        print(f"| {name} | {page} | {trip} | {'' if a.lag is None else a.lag} | {'yes' if a.agrees else 'NO'} |")
    print(f"\n{len(runs) - bad} of {len(runs)} runs agree (trip iff a critical page, at most "
          f"{ag.MAX_LAG_STEPS} steps after it)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
