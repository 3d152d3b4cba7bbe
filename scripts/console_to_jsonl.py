#!/usr/bin/env python3
"""Convert verl console output (``step:N - key:value - ...`` lines, e.g. a committed training log, a notebook's
output or a wandb ``output.log``) into file-logger JSONL, for ``verl-exporter backtest`` and test fixtures.

    python scripts/console_to_jsonl.py train.log > run.jsonl

Keys are kept as logged (older verl names included); values wrapped as ``np.float64(x)`` are unwrapped;
non-numeric values are dropped; NaN/Inf become null, as verl's file logger writes them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "exporter"))

from verl_exporter.replay import NotAVerlLog, read_jsonl  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        lines = read_jsonl(argv[0])
    except (OSError, NotAVerlLog) as e:
        print(f"console_to_jsonl: {e}", file=sys.stderr)
        return 2
    for line in lines:
        sys.stdout.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
