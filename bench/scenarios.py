"""Every replay-engine scenario (healthy runs and injected faults) through the generated rules: alerts fired,
first step, delay in steps after the fault's first line, minutes firing; totals of false alarms on the
healthy runs. The same runs as tests/tools/test_replay_scenarios.py.

    python bench/scenarios.py
"""

from __future__ import annotations

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from verl_exporter.tools import replay as rp  # noqa: E402


def main() -> int:
    print("| run | fault at step | alert (severity) | first step | delay (steps) | minutes after the fault | "
          "minutes firing |")
    print("|---|---|---|---|---|---|---|")
    false = {"critical": 0, "warning": 0}
    for profile, fault, at, tail_s in rp.SCENARIOS:
        lines = rp.simulate(profile, rp.Fault(fault, at) if fault else None)
        samples = rp.replay(lines, tail_s=tail_s)
        minutes: dict[str, int] = {}
        fired = rp.evaluate(samples, paths.REPO / "rules", minutes_firing=minutes)
        name = f"{profile} {fault or 'healthy'} ({len(lines)} steps)"
        onset = next((end for step, end in samples.step_end_s if step == at), None) if fault else None
        if fault == "hang":
            onset = samples.step_end_s[-1][1]
        if not fired:
            print(f"| {name} | {at or '-'} | none | | | | |")
        seen = set()
        for f in fired:
            if f.alert in seen:
                continue
            seen.add(f.alert)
            step = rp.step_at(samples, f.minute)
            if fault is None:
                false[f.severity] = false.get(f.severity, 0) + 1
            delay = step - at if fault and step is not None else ""
            after = f"{f.minute - onset / 60:.0f}" if onset is not None else ""
            print(f"| {name} | {at or '-'} | {f.alert} ({f.severity}) | {step} | {delay} | {after} | "
                  f"{minutes.get(f.alert, '')} |")
    print(f"\nhealthy runs: {false['critical']} critical, {false['warning']} warning alerts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
