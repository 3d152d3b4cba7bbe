"""The alerts that hold in steps, replayed at 5-s, 60-s and 10-minute steps (tests/step_hold_cases.py): steps and
minutes from the fault's first line to the page. Give --rules the rules of another checkout to compare (e.g.
the rules before the holds moved from minutes to steps).

    python bench/step_holds.py [--rules DIR]
"""

from __future__ import annotations

import argparse

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from step_hold_cases import CASES, STEP_TIMES, steps_to_page  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", default=str(paths.REPO / "rules"), help="the generated rules to replay")
    args = ap.parse_args(argv)
    print("| alert | " + " | ".join(f"{s:g}-s steps" for s in STEP_TIMES) + " |")
    print("|---|" + "---|" * len(STEP_TIMES))
    for alert in sorted(CASES):
        cells = []
        for step_s in STEP_TIMES:
            steps, minutes = steps_to_page(alert, step_s, args.rules)
            cells.append("no page" if steps is None else f"{steps} steps ({minutes:.1f} min)")
        print(f"| {alert} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
