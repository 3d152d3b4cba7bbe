"""Extrapolate rule-group evaluation time from two runs of bench/scale.py at different rank counts.

    python bench/scale_fit.py SMALL.json LARGE.json [--to 4096]

bench/scale.py alone extrapolates from one run, assuming each group's time grows in proportion to all head
series. That over-states groups whose rules read series that do not grow with ranks (rank 0's training series)
and mixes in the fixed cost of an evaluation. Here each group's time is fitted, per engine, as a + b * ranks
through the two measured points (the median evaluation, and the max), and read at --to ranks. The ratio of
the large run to the small one shows how each group actually grew.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def groups(run: dict, engine: str) -> dict[str, tuple[float, float]]:
    """{group short name: (median s, max s)} of one engine in one run."""
    if engine == "prometheus":
        return {name.removeprefix("verl-exporter."): (g["median_s"], g["max_s"])
                for name, g in run["prometheus"]["groups"].items() if g.get("n")}
    vm = run.get("victoriametrics") or {}
    return {name: (g["0.5"], g["1"]) for name, g in (vm.get("groups") or {}).items() if g}


def fit(n1: int, t1: float, n2: int, t2: float, target: int) -> float:
    """The straight line through (n1, t1) and (n2, t2), read at target; never below the larger measurement."""
    slope = (t2 - t1) / (n2 - n1)
    return max(t2, t2 + slope * (target - n2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("small", help="scale.py --json of the smaller fleet")
    parser.add_argument("large", help="scale.py --json of the larger fleet")
    parser.add_argument("--to", type=int, default=4096, help="ranks to extrapolate to (default 4096)")
    args = parser.parse_args(argv)
    a, b = (json.loads(Path(p).read_text()) for p in (args.small, args.large))
    n1, n2 = a["env"]["ranks"], b["env"]["ranks"]
    if n1 >= n2:
        parser.error(f"the first run must have fewer ranks ({n1} >= {n2})")
    print(f"two-point fit per group, {n1} and {n2} ranks measured, read at {args.to} ranks (goal: worst < 1 s)")
    worst = {}
    for engine in ("prometheus", "victoriametrics"):
        g1, g2 = groups(a, engine), groups(b, engine)
        common = sorted(set(g1) & set(g2))
        if not common:
            continue
        print(f"\n{engine}")
        print(f"  {'group':<12} {'median ' + str(n1):>12} {'median ' + str(n2):>12} {'growth':>7} "
              f"{'median ' + str(args.to):>13} {'max ' + str(n2):>10} {'max ' + str(args.to):>10}")
        for name in common:
            (m1, x1), (m2, x2) = g1[name], g2[name]
            med, mx = fit(n1, m1, n2, m2, args.to), fit(n1, x1, n2, x2, args.to)
            worst[engine] = max(worst.get(engine, (0.0, "")), (med, name))
            print(f"  {name:<12} {m1 * 1000:>9.1f} ms {m2 * 1000:>9.1f} ms {m2 / m1 if m1 else float('nan'):>6.1f}x "
                  f"{med * 1000:>10.0f} ms {x2 * 1000:>7.0f} ms {mx * 1000:>7.0f} ms")
    print()
    for engine, (med, name) in worst.items():
        print(f"{engine}: worst group at {args.to} ranks by median: {name} {med * 1000:.0f} ms "
              f"({'PASS' if med < 1 else 'FAIL'} < 1 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
