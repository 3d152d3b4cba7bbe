"""Cost of escaping one alert value as it grows, as a ratio against a value ten times shorter.

    python bench/relay_escape.py [--chars N]

Every label and annotation of an alert is escaped before it is shown, on the worker thread that delivers the
target's messages. A value may be as long as the webhook body allows (1 MiB by default), so escaping must cost
linear time in its length: the ratio should stay near 10 (a quadratic pattern makes it near 100).
"""

from __future__ import annotations

import argparse
import time

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from verl_exporter.relay.format import escape  # noqa: E402

# Shapes that made a pattern backtrack: a long word, a long dotted name, digits and dots, a path of words.
SHAPES = {"word": "y", "dotted": "y.", "digits": "1.", "path": "ab-c/", "underscores": "_"}


def seconds(text: str, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        escape(text, multiline=True)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=100_000)
    args = parser.parse_args()
    for name, unit in SHAPES.items():
        short = seconds(unit * (args.chars // 10 // len(unit)) + " a.")
        long = seconds(unit * (args.chars // len(unit)) + " a.")
        print(f"{name:12s} {args.chars // 10:>8d} chars: {short * 1e3:8.2f} ms; {args.chars:>8d} chars: "
              f"{long * 1e3:8.2f} ms; ratio {long / short:6.1f}")


if __name__ == "__main__":
    main()
