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

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .atomicfile import glob_escape

# Where a rank that waits for its peers sits: torch.distributed's Python layer (every collective, barrier and
# Work.wait passes through it) and the p2p helpers.
_WAITING_FILES = ("torch/distributed/",)
MAX_VERDICT_CHARS = 600  # a robot message line, not a report: the full stacks stay in the files

Doc = dict[str, Any]  # a JSON object as read: a capture, a process, a thread, a frame, a dump


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
    numbers = sorted({int(x) for x in labels if str(x).isdigit()})
    others = sorted({x for x in labels if not str(x).isdigit()})
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
    for c in captures:
        source = (c.get("host"), c.get("run"), c.get("rank"))
        if source not in latest or float(c.get("time") or 0) > float(latest[source].get("time") or 0):
            latest[source] = c
    by_rank: dict[object, Doc] = {}
    for c in sorted(latest.values(), key=lambda c: float(c.get("time") or 0)):
        for p in c.get("processes") or []:
            key = p.get("rank") if p.get("rank") is not None else (c.get("host"), p.get("pid"))
            by_rank[key] = p
    return list(by_rank.values())


def read_captures(paths: Iterable[str]) -> list[Doc]:
    """Every capture document in these files or folders (a shared forensics directory); unreadable files skipped."""
    out = []
    for path in paths:
        p = Path(path)
        for f in sorted(p.glob("capture-*.json")) if p.is_dir() else [p]:
            try:
                doc = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict):
                out.append(doc)
    return out


# ---------------------------------------------------------------- NCCL Flight Recorder
MAX_DUMP_BYTES = 64 * 1024 * 1024
def read_flight_recorder(prefix: str) -> dict[int, Doc]:
    """{rank: dump} of the JSON dumps at a path prefix (``<prefix><rank>``, as torch names them). Pickle dumps
    are not loaded: unpickling a file runs what it says."""
    p = Path(prefix)
    out: dict[int, Doc] = {}
    for f in sorted(p.parent.glob(glob_escape(p.name) + "*")):
        digits = re.search(r"(\d+)(\.json)?$", f.name)
        if not digits or not f.is_file():
            continue
        try:
            doc = json.loads(f.read_bytes()[:MAX_DUMP_BYTES])
        except (OSError, ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            continue
        if isinstance(doc, dict):
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
        listed = dump.get("entries")
        entries = [(seq, e) for e in listed if (seq := _seq(e)) is not None] if isinstance(listed, list) else []
        if not entries:
            continue
        seq, last = max(entries, key=lambda pair: pair[0])
        reached[rank] = (seq, str(last.get("profiling_name", "?"))[:100])
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
