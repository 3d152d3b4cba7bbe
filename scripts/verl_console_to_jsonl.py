#!/usr/bin/env python3
"""Convert a verl console log into verl file-logger JSONL (``{"step": N, "data": {...}}`` per line).

    python scripts/verl_console_to_jsonl.py train.log -o run.jsonl [--run N] [--list]

What it copes with (Ray prefixes, ANSI colours, one key per line, numpy reprs, nan/inf, notebooks, several
runs in one file, lines cut at 4096 characters) is described in ``verl_exporter.sidecar.sources.console``.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "exporter"))

from verl_exporter.sidecar.sources.console import (  # noqa: E402
    ConsoleLogError,
    convert,
    describe,
    parse_records,
    read_text,
    split_runs,
    to_jsonl,
)


def write(path: str, out: str) -> None:
    if path == "-":
        sys.stdout.write(out)
    elif path.endswith(".gz"):
        # No name or time in the header: the same input gives the same bytes, so a regenerated corpus is stable.
        with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as fh:
            fh.write(out.encode())
    else:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("log", help="console log (.log/.txt/.ipynb, optionally .gz), or - for stdin")
    ap.add_argument("-o", "--output", default="-", help="JSONL to write (.gz compresses); default stdout")
    ap.add_argument("--run", type=int, help="which run (1-based) when the log holds several")
    ap.add_argument("--list", action="store_true", help="list the runs found and exit")
    ap.add_argument("--first-step", type=int, help="drop steps before this one")
    ap.add_argument("--last-step", type=int, help="drop steps after this one")
    args = ap.parse_args(argv)
    try:
        text = read_text(args.log)
        if args.list:
            runs = split_runs(parse_records(text))
            print(describe(runs) if runs else "no verl step lines found")
            return 0
        dropped: list[str] = []
        records = convert(text, args.run, dropped)
    except (OSError, ConsoleLogError) as e:
        print(f"error: {args.log}: {e}", file=sys.stderr)
        return 1
    records = [(s, d) for s, d in records
               if (args.first_step is None or s >= args.first_step)
               and (args.last_step is None or s <= args.last_step)]
    if not records:
        print(f"error: {args.log}: no steps left in the range asked for", file=sys.stderr)
        return 1
    if dropped:
        print(f"note: {args.log}: dropped {len(dropped)} cut-off value(s) at the end of cut lines", file=sys.stderr)
    out = to_jsonl(records)
    try:
        write(args.output, out)
    except OSError as e:
        print(f"error: cannot write {args.output}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
