"""`verl-exporter calibrate` on the healthy public runs of tests/data/real_runs, then every run of the corpus
backtested with the defaults and with the proposal: false alerts on the healthy runs, and, on the faulty ones,
whether each expected alert still fires and how late. The README's figures come from this script.

    python bench/calibrate_real_runs.py [--margin 0.2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
import yaml  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.spec.overrides import apply_overrides  # noqa: E402
from verl_exporter.tools import calibrate as cb  # noqa: E402
from verl_exporter.tools import replay as rp  # noqa: E402
from verl_exporter.tools.backtest import timeline  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "real_runs"


def first_steps(spec, run: dict) -> dict[str, int]:
    lines = rp.read_jsonl(CORPUS / run["file"])
    samples = rp.replay(lines, spec, run=run["name"])
    fired = cb.evaluate_runs(spec, [cb.Run(run["name"], samples)])[run["name"]]
    out: dict[str, int] = {}
    for e in timeline(samples, fired):
        out.setdefault(e["alert"], e["step"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--margin", type=float, default=cb.MARGIN)
    args = parser.parse_args()
    runs = yaml.safe_load((CORPUS / "corpus.yaml").read_text())["runs"]
    spec = load_spec()
    healthy = [str(CORPUS / r["file"]) for r in runs if r["verdict"] == "healthy"]
    result, replayed = cb.calibrate(healthy, spec, margin=args.margin)
    cb.verify(result, spec, replayed)
    cb.report(result)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(cb.render_overrides(result))
    print(f"\nproposal: {f.name}\n")
    after = apply_overrides(spec, cb.proposal_overrides(result))
    print("| run | verdict | defaults: alerts (first step) | calibrated: alerts (first step) | expected alerts |")
    print("|---|---|---|---|---|")
    totals = {"false_before": 0, "false_after": 0, "missed_before": 0, "missed_after": 0}
    for run in runs:
        known = set(run["expect_alerts"]) | set(run["allow_alerts"])
        cells = []
        for name, s in (("before", spec), ("after", after)):
            fired = first_steps(s, run)
            false = sorted(set(fired) - set(run["expect_alerts"])) if run["verdict"] == "healthy" else \
                sorted(set(fired) - known)
            missed = sorted(set(run["expect_alerts"]) - set(fired))
            totals[f"false_{name}"] += len(false)
            totals[f"missed_{name}"] += len(missed)
            cells.append(", ".join(f"{a} {st}" for a, st in sorted(fired.items(), key=lambda x: x[1])) or "none")
            if missed:
                cells[-1] += f" (missed: {', '.join(missed)})"
        expected = ", ".join(run["expect_alerts"]) or "-"
        print(f"| {run['name']} | {run['verdict']} | {cells[0]} | {cells[1]} | {expected} |")
    print(f"\nalerts on healthy runs (allowed ones included) / outside the allow-list on faulty runs: "
          f"{totals['false_before']} -> {totals['false_after']}; expected alerts missed: "
          f"{totals['missed_before']} -> {totals['missed_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
