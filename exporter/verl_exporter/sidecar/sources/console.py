"""verl console logs read as verl file-logger records (``{"step": N, "data": {...}}`` per line).

verl's console logger prints one line per step, ``step:N - key:value - key:value ...``. What real logs
add around that, and what this handles:
- a Ray prefix (``(TaskRunner pid=123)``, ``(main_task pid=9, ip=10.0.0.1)``) and ANSI colours;
- one ``- key:value`` per line after a bare ``step:N`` (newer verl with a pretty console);
- values as numpy reprs (``np.float64(0.1)``), ``nan``/``inf`` (written as null, like verl's orjson);
- carriage returns from progress bars, and notebooks (.ipynb: their cells' outputs are read);
- several runs in one file (a step that does not go up starts a new run): pick one with ``--run``;
- lines cut short (wandb's output.log keeps 4096 characters of a line): the cut-off last value is dropped.

Unknown keys are kept as they are: nothing a run logged is dropped. ``scripts/verl_console_to_jsonl.py``
writes the JSONL; ``verl-exporter backtest`` reads console logs through this module too.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
from collections.abc import Iterable
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RAY_PREFIX = re.compile(r"^\s*\([\w.-]+ pid=\d+(?:, ip=[\d.:a-fA-F]+)?\)\s?")
STEP = re.compile(r"^\s*step:([0-9]{1,30})(?=\s|$)(.*)$")  # ASCII digits, far below int()'s digit limit
CONTINUATION = re.compile(r"^\s*-\s+(\S.*)$")
SEPARATOR = re.compile(r"\s+-\s+")
PAIR = re.compile(r"^([^\s:]+):(\S+)$")
WRAPPED = re.compile(r"^(?:(?:np|numpy)\.\w+|tensor)\(([^()]+)\)$")  # np.float64(0.1), np.int64(3), tensor(0.1)
UNCLOSED = re.compile(r"^(?:(?:np|numpy)\.\w*|tensor)\([^)]*$")  # np.float64(-0.22  <- the line ended here
CUT_LINE_CHARS = 4096  # wandb's console capture keeps this much of a line
NON_FINITE = {"nan", "-nan", "inf", "+inf", "-inf", "infinity", "-infinity"}
# A number as Python prints one (int() and float() also read "1_000" and other scripts' digits).
INTEGER = re.compile(r"[+-]?[0-9]+")
FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


Record = tuple[int, dict[str, Any]]  # (step, data) as verl's file logger writes it


class ConsoleLogError(ValueError):
    """The input holds no usable step lines, or the run asked for does not exist."""


def value_of(text: str) -> bool | int | float | str | None:
    """The JSON value verl's file logger would have written for one printed value."""
    inner = WRAPPED.match(text)
    if inner:
        text = inner.group(1)
    if text in ("True", "False"):  # a Python bool, printed as such; the file logger writes true / false
        return text == "True"
    if text.lower() in NON_FINITE:
        return None
    if INTEGER.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python reads: no number, but not a NaN either
            return text
    if not FLOAT.fullmatch(text):
        return text  # not a number: kept as printed, never dropped
    number = float(text)
    return number if math.isfinite(number) else None  # 1e999 reads as Inf, as json reads it


def _pairs(body: str) -> Iterable[tuple[str, str]]:
    for piece in SEPARATOR.split(" " + body.strip()):
        piece = piece.strip()
        if not piece:
            continue
        match = PAIR.match(piece)
        if match:
            yield match.group(1), match.group(2)


def clean_lines(text: str) -> Iterable[tuple[str, bool]]:
    """The log's lines without colours, carriage-return overwrites and Ray prefixes, each with whether it
    was cut at wandb's line limit."""
    for raw in ANSI.sub("", text).replace("\r", "\n").split("\n"):
        yield RAY_PREFIX.sub("", raw), len(raw) == CUT_LINE_CHARS


def parse_records(text: str, dropped: list[str] | None = None) -> list[Record]:
    """Every step record in the order printed: (step, data). Cut-off values go to ``dropped``."""
    records: list[Record] = []
    current: dict[str, Any] | None = None
    for line, cut in clean_lines(text):
        step = STEP.match(line)
        more = CONTINUATION.match(line) if current is not None and not step else None
        pairs = list(_pairs(step.group(2) if step else more.group(1) if more else ""))
        ours = bool(step or pairs)
        if pairs and (cut or UNCLOSED.match(pairs[-1][1])):
            # The line ended inside its last value: its digits may be missing, so it is not kept.
            if dropped is not None:
                dropped.append(pairs[-1][0])
            pairs.pop()
        if step:
            current = {}
            records.append((int(step.group(1)), current))
        elif not ours:
            if line.strip():
                current = None  # any other output ends a one-key-per-line record
            continue
        if current is None:  # never: pairs come with a step line or with its record's continuation
            continue
        for key, value in pairs:
            current[key] = value_of(value)
    return records


def split_runs(records: list[Record]) -> list[list[Record]]:
    """A step that does not go up means a restarted or second run."""
    runs: list[list[Record]] = []
    for record in records:
        if not runs or record[0] <= runs[-1][-1][0]:
            runs.append([])
        runs[-1].append(record)
    return runs


def read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    if path.endswith((".ipynb", ".ipynb.gz")):
        text = notebook_output(text)
    return text


def notebook_output(text: str) -> str:
    """The text the notebook's cells printed, in cell order."""
    try:
        cells = json.loads(text)["cells"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConsoleLogError(f"not a readable notebook: {e}") from None
    out = []
    for cell in cells:
        for output in cell.get("outputs", []):
            chunk = output.get("text", "")
            out.append("".join(chunk) if isinstance(chunk, list) else str(chunk))
    return "\n".join(out)


def describe(runs: list[list[Record]]) -> str:
    return "; ".join(f"run {i}: steps {r[0][0]}-{r[-1][0]} ({len(r)} lines)" for i, r in enumerate(runs, 1))


def convert(text: str, run: int | None = None, dropped: list[str] | None = None) -> list[Record]:
    """The step records of one run. Raises ConsoleLogError with what the file holds when it cannot choose."""
    runs = split_runs(parse_records(text, dropped))
    if not runs:
        raise ConsoleLogError("no verl step lines (step:N - key:value ...) found")
    if run is None:
        if len(runs) > 1:
            raise ConsoleLogError(f"{len(runs)} runs in this log, pick one with --run: {describe(runs)}")
        run = 1
    if not 1 <= run <= len(runs):
        raise ConsoleLogError(f"no run {run}: {describe(runs)}")
    return runs[run - 1]


def to_jsonl(records: Iterable[Record]) -> str:
    # Compact like orjson; None already stands for NaN/Inf, so allow_nan=False guards the format.
    return "".join(json.dumps({"step": s, "data": d}, separators=(",", ":"), allow_nan=False) + "\n"
                   for s, d in records)
