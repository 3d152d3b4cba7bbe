"""Every run of the real-run corpus (tests/data/real_runs) through the generated rules: per run, each alert's
starts, first step and share of the run's minutes firing; totals over the healthy runs (critical pages, warning
starts per 12 hours of run) and the delay in steps of the first expected alert on the faulty runs. The
README's real-run table; run it on an older checkout for the figures of older rules.

    python bench/real_runs.py
"""

from __future__ import annotations

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from collections import Counter  # noqa: E402

import yaml  # noqa: E402
from verl_exporter.tools import replay as rp  # noqa: E402

CORPUS = paths.REPO / "tests" / "data" / "real_runs"


def main() -> int:
    runs = yaml.safe_load((CORPUS / "corpus.yaml").read_text())["runs"]
    print("| run | verdict | steps | hours | alert (severity): starts, first step, % of minutes firing |")
    print("|---|---|---|---|---|")
    hours = critical = warnings = 0.0
    delays = []
    for run in runs:
        samples = rp.replay(rp.read_jsonl(CORPUS / run["file"]))
        minutes: dict[str, int] = {}
        fired = rp.evaluate(samples, paths.REPO / "rules", minutes_firing=minutes)
        total_min = max(1.0, samples.step_end_s[-1][1] / 60)
        span = max([total_min, *minutes.values()])  # the evaluation runs a little past the last step
        starts = Counter(f.alert for f in fired)
        first = {}
        for f in fired:
            first.setdefault(f.alert, (rp.step_at(samples, f.minute), f.severity))
        cells = [f"{a} ({sev}): {starts[a]}, {step}, {100 * minutes.get(a, 0) / span:.1f} %"
                 for a, (step, sev) in first.items()]
        if run["verdict"] == "healthy":
            hours += total_min / 60
            critical += sum(n for a, n in starts.items() if first[a][1] == "critical")
            warnings += sum(n for a, n in starts.items() if first[a][1] != "critical"
                            and a not in run["allow_alerts"])
        else:
            got = [first[a][0] for a in run["expect_alerts"] if a in first and first[a][0] is not None]
            delays.append((run["name"], min(got) - run["fault_step"] if got else None))
        print(f"| {run['name']} | {run['verdict']} | {run['steps']} | {total_min / 60:.1f} | "
              f"{'; '.join(cells) or 'none'} |")
    print(f"\nhealthy runs: {hours:.0f} h; {critical:.0f} critical starts; {warnings:.0f} warning starts outside "
          f"their allow-lists ({12 * warnings / max(hours, 1e-9):.2f} per 12 h)")
    print("faulty runs, first expected alert after the fault (steps): "
          + ", ".join(f"{n} {'missed' if d is None else d}" for n, d in delays))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
