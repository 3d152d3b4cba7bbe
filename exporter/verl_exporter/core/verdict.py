"""One verdict across ranks from their stack captures (and NCCL Flight Recorder dumps where they exist).

A hung collective looks alike on every rank but the one that never entered it: group the ranks by the innermost
Python frames of their main thread and name the odd ones out, e.g. ``ranks 0-6 wait in all_reduce
(torch/distributed/distributed_c10d.py); rank 7 is in reward_fn → compute_score (reward.py)``.

A capture is the JSON document the sidecar writes (sidecar/forensics.py): ``processes``, each with its ``rank``
(from the process's RANK, else None), ``pid`` and py-spy's ``threads`` (``py-spy dump --json``: frames innermost
first; native frames carry their library as ``module``). Pure functions: the sidecar, the CLI and the tests call
them on documents.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .atomicfile import glob_escape
from .models import FileError, read_json

# Where a rank that waits for its peers sits: torch.distributed's Python layer (every collective, barrier and
# Work.wait passes through it) and the p2p helpers.
_WAITING_FILES = ("torch/distributed/",)
MAX_VERDICT_CHARS = 600  # a robot message line, not a report: the full stacks stay in the files

Doc = dict[str, Any]  # a JSON object as read: a capture, a process, a thread, a frame, a dump
MAX_LABEL_CHARS = 64  # a rank, host or run name; a longer one is not one the sidecar wrote
MAX_NUMBER_DIGITS = 20  # a rank read as a number: int() of thousands of digits raises (or takes quadratic time)


# ---------------------------------------------------------------- what a capture may hold
# Capture files are read back from a shared folder, py-spy's answers from the processes: anything may stand
# where a list, an object or a name belongs. Each wrong part is left out; the rest of the verdict stands.
def _text(value: Any) -> str | None:
    """A name (rank, host, run) as text, or None: only a short string or an integer is a name."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = value if isinstance(value, str) else str(value) if abs(value) < 10**MAX_NUMBER_DIGITS else ""
    return text if 0 < len(text) <= MAX_LABEL_CHARS and text.isprintable() else None


def _dicts(value: Any) -> list[Doc]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _process(process: Any) -> Doc | None:
    """A captured process with only what the verdict reads, each of the right kind; None when not an object."""
    if not isinstance(process, dict):
        return None
    threads = [{**t, "frames": _dicts(t.get("frames"))} for t in _dicts(process.get("threads"))]
    return {**process, "rank": _text(process.get("rank")), "pid": _text(process.get("pid")), "threads": threads}


def _time(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else 0.0


def _capture(doc: Doc) -> Doc:
    processes = [p for p in map(_process, doc.get("processes") or []) if p] \
        if isinstance(doc.get("processes"), list) else []
    return {**doc, "host": _text(doc.get("host")), "run": _text(doc.get("run")), "rank": _text(doc.get("rank")),
            "time": _time(doc.get("time")), "processes": processes}


def python_frames(thread: Doc) -> list[Doc]:
    """A py-spy thread's Python frames, innermost first (native frames, from --native, have a module)."""
    return [f for f in thread.get("frames") or [] if isinstance(f, dict) and f.get("module") is None]


def main_thread(threads: list[Doc]) -> Doc | None:
    """The thread a hang is judged on: MainThread when py-spy names it, else the first with Python frames."""
    with_frames = [t for t in threads if isinstance(t, dict) and python_frames(t)]
    for t in with_frames:
        if t.get("thread_name") == "MainThread":
            return t
    return with_frames[0] if with_frames else None


def _module_path(frame: Doc) -> str:
    """A frame's file as a module path: py-spy shortens by the target's sys.path, which may leave
    site-packages/ in front (it varies with the install); the verdict must read the same everywhere."""
    path = str(frame.get("short_filename") or frame.get("filename") or "?")
    return re.sub(r"^.*?(?:site|dist)-packages/", "", path)


def where(process: Doc, depth: int = 2) -> tuple[str, str] | None:
    """(the group key, its words) of one captured process: its innermost Python function and file, with its caller
    for context; None when it has no Python stack."""
    thread = main_thread(process.get("threads") or [])
    if thread is None:
        return None
    frames = python_frames(thread)
    inner = frames[0]
    path = _module_path(inner)
    name = str(inner.get("name") or "?")
    waiting = any(w in path for w in _WAITING_FILES)
    if waiting:  # the torch frames under the collective say nothing more: name the collective and its caller
        outer = next((f for f in frames if not any(w in _module_path(f) for w in _WAITING_FILES)), None)
        caller = f", called from {outer.get('name')} ({_module_path(outer)})" if outer else ""
        return f"wait:{name}:{path}", f"wait in {name} ({path}){caller}"
    chain = " → ".join(reversed([str(f.get("name") or "?") for f in frames[:depth]]))
    return f"in:{name}:{path}", f"in {chain} ({path})"


def _label(process: Doc) -> str:
    rank = process.get("rank")
    return str(rank) if rank is not None else f"pid {process.get('pid')}"


def ranges(labels: Iterable[str]) -> str:
    """'0-6, 9' from ranks 0..6 and 9 (labels that are not numbers follow, as they are)."""
    labels = list(labels)  # read twice below

    def number(x: str) -> bool:
        return x.isascii() and x.isdigit() and len(x) <= MAX_NUMBER_DIGITS

    numbers = sorted({int(x) for x in labels if number(str(x))})
    others = sorted({x for x in labels if not number(str(x))})
    parts: list[tuple[int, int]] = []
    for n in numbers:
        if parts and parts[-1][1] == n - 1:
            parts[-1] = (parts[-1][0], n)
        else:
            parts.append((n, n))
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in parts]
    return ", ".join(text + others)


def verdict(processes: list[Doc]) -> str:
    """One line: the ranks grouped by where they are, the biggest group first, then the odd ones out."""
    groups: dict[str, tuple[str, list[str]]] = {}
    failed: list[str] = []
    processes = [p for p in map(_process, processes) if p]
    if any(p.get("rank") is not None for p in processes):  # a launcher or a Ray helper is in the file, not here
        processes = [p for p in processes if p.get("rank") is not None]
    for p in processes:
        found = where(p)
        if found is None:
            failed.append(_label(p))
            continue
        key, words = found
        groups.setdefault(key, (words, []))[1].append(_label(p))
    if not groups:
        return f"no Python stack captured ({len(processes)} process(es); see the capture's errors)"
    # the biggest group first; between equals, the ranks that wait for the others before the odd one
    ordered = sorted(groups.values(), key=lambda g: (-len(g[1]), not g[0].startswith("wait"), g[0]))
    parts = []
    for words, labels in ordered:
        numbered = [x for x in labels if x.isdigit()]
        noun = "rank" if len(labels) == 1 and numbered else "ranks" if numbered else "process" \
            if len(labels) == 1 else "processes"
        verb = ("is " if len(labels) == 1 else "are ") if words.startswith("in ") else ""
        if not verb and len(labels) == 1:
            words = "waits" + words[len("wait"):]
        parts.append(f"{noun} {ranges(labels)} {verb}{words}")
    if len(ordered) == 1 and len(ordered[0][1]) > 1:
        parts[0] = "all " + parts[0]
    if failed:
        parts.append(f"no stack from {ranges(failed)}")
    text = "; ".join(parts)
    return text if len(text) <= MAX_VERDICT_CHARS else text[:MAX_VERDICT_CHARS - 1] + "…"


def merge(captures: Iterable[Doc]) -> list[Doc]:
    """The processes of several sidecars' captures (one per host or rank): the latest capture of each source
    counts, and a rank seen in two counts once (its latest)."""
    latest: dict[tuple[object, object, object], Doc] = {}
    for c in map(_capture, captures):
        source = (c["host"], c["run"], c["rank"])
        if source not in latest or c["time"] > latest[source]["time"]:
            latest[source] = c
    by_rank: dict[object, Doc] = {}
    for c in sorted(latest.values(), key=lambda c: c["time"]):
        for p in c["processes"]:
            key = p.get("rank") if p.get("rank") is not None else (c.get("host"), p.get("pid"))
            by_rank[key] = p
    return list(by_rank.values())


def read_captures(paths: Iterable[str], errors: list[str] | None = None) -> list[Doc]:
    """Every capture document in these files or folders (a shared forensics directory); a file that cannot be
    one (unreadable, too large, not JSON, nested past the decoder, not an object) is skipped with one line in
    errors."""
    out = []
    for path in paths:
        p = Path(path)
        for f in sorted(p.glob("capture-*.json")) if p.is_dir() else [p]:
            doc = _read(f, errors)
            if doc is not None:
                out.append(doc)
    return out


def _read(path: Path, errors: list[str] | None) -> Doc | None:
    try:
        doc = read_json(path, MAX_DUMP_BYTES)
    except FileNotFoundError:
        problems = ["no such file"]
    except FileError as e:
        problems = e.problems
    else:
        if isinstance(doc, dict):
            return doc
        problems = ["not a JSON object"]
    if errors is not None:
        errors.append(f"{path}: {'; '.join(problems)}")
    return None


# ---------------------------------------------------------------- NCCL Flight Recorder
MAX_DUMP_BYTES = 64 * 1024 * 1024


def read_flight_recorder(prefix: str, errors: list[str] | None = None) -> dict[int, Doc]:
    """{rank: dump} of the JSON dumps at a path prefix (``<prefix><rank>``, as torch names them). Pickle dumps
    are not loaded: unpickling a file runs what it says. A file that is no dump is skipped (a line in errors)."""
    p = Path(prefix)
    out: dict[int, Doc] = {}
    for f in sorted(p.parent.glob(glob_escape(p.name) + "*")):
        digits = re.search(r"(?<!\d)(\d{1,9})(\.json)?$", f.name)
        if not digits or not f.is_file():
            continue
        doc = _read(f, errors)
        if doc is not None:
            out[int(digits.group(1))] = doc
    return out


def _seq(entry: object) -> int | None:
    """An entry's collective_seq_id: a JSON integer torch wrote (0 to 2**63); None for anything else."""
    value = entry.get("collective_seq_id") if isinstance(entry, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else None


def flight_recorder_verdict(dumps: dict[int, Doc]) -> str | None:
    """Where the ranks' collective sequences diverge, from Flight Recorder dumps ({rank: dump}).

    A dump (torch's ``_dump_fr_trace_json``; the buffer is on with TORCH_FR_BUFFER_SIZE, formerly
    TORCH_NCCL_TRACE_BUFFER_SIZE) holds ``entries``: each collective with ``pg_id``, ``collective_seq_id``,
    ``profiling_name`` (nccl:all_reduce, gloo:all_reduce) and ``state``. The rank whose latest entered collective
    is behind the others' is the one that never entered the next one; None when every rank reached the same
    sequence number (or there is nothing to compare).
    """
    reached: dict[int, tuple[int, str]] = {}
    for rank, dump in dumps.items():
        entries = [e for e in _dicts(dump.get("entries")) if _seq(e) is not None]
        if not entries:
            continue
        last = max(entries, key=lambda e: _seq(e) or 0)
        reached[rank] = (_seq(last) or 0, str(last.get("profiling_name", "?"))[:MAX_LABEL_CHARS])
    if len(reached) < 2:
        return None
    top = max(seq for seq, _ in reached.values())
    behind = sorted(r for r, (seq, _) in reached.items() if seq < top)
    if not behind:
        return None
    ahead = sorted(r for r, (seq, _) in reached.items() if seq == top)
    name = next(n for seq, n in reached.values() if seq == top)
    last_behind = ", ".join(f"{r} at #{reached[r][0]}" for r in behind[:8])
    noun = "rank" if len(behind) == 1 else "ranks"
    return (f"Flight Recorder: ranks {ranges(map(str, ahead))} entered collective #{top} ({name}); "
            f"{noun} {ranges(map(str, behind))} never did (last: {last_behind})")
