"""Hang forensics: the trainer's Python stacks captured when the run stalls, kept in a bounded directory.

Off unless ``--forensics-dir DIR`` is given: a stack capture attaches to the trainer with ptrace (py-spy) and
can read what the process holds. When on, the sidecar captures

- when the spec's stall alerts (those judged between steps: VerlTrainingStalled, VerlTrainingStalledRelative)
  hold on its own store: the same ``judge`` of the same declaration the rules render, fed the last step time
  and the step-time signal's detector statistics; once per stall (a new step re-arms it);
- when asked: ``POST /control/forensics`` with the control token (the relay's ``forensics`` action).

It captures the trainer's process tree (``--trainer-pid`` and its descendants) and this node's Ray workers
(``ray::...`` processes, found by command line as the gpu_processes collector finds them) with
``py-spy dump --json`` (``--native`` first where enabled, without when that fails), writes one JSON file per
capture (0600; a folder it makes is 0700, an existing one keeps its mode) and names a verdict across the
captured ranks (core/verdict.py).

The folder may be shared (one verdict across nodes): each sidecar marks its files' names with its own tag
(``capture-<UTC time>+<host>[-rank<r>].json``) and prunes only those, oldest first in the order it wrote them
(names and mtimes follow a clock that can step back); the capture it answers with is never the one removed.

A process that cannot be captured is counted by reason, with what to do, never raised.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from ..core.atomicfile import glob_escape, make_dirs, write_atomic
from ..core.verdict import flight_recorder_verdict, read_flight_recorder, verdict
from ..exposition.selfmetrics import SelfMetric, SelfMetrics
from .collectors.gpu_processes import looks_like_ray_worker

if TYPE_CHECKING:
    from ..spec import Spec
    from ..spec.kinds import Alert
    from .store import TrainingStore

FORENSICS_CAPTURES = SelfMetric("verl_exporter_forensics_captures_total")
FORENSICS_FAILURES = SelfMetric("verl_exporter_forensics_failures_total")
FORENSICS_LAST_CAPTURE_TIMESTAMP_SECONDS = SelfMetric("verl_exporter_forensics_last_capture_timestamp_seconds")

log = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700
DEFAULT_MAX_FILES = 20
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 20.0
MIN_REQUEST_GAP_S = 10.0  # requests closer than this get the latest capture: a capture pauses the trainer
PARALLEL_DUMPS = 4  # py-spy processes at once (each mostly waits on the target's memory reads)
MAX_PROCESSES = 64  # a node's trainer tree and Ray workers; more is not a trainer
MAX_OUTPUT_BYTES = 4 * 1024 * 1024  # one process's py-spy JSON
HINTS = {
    "no_binary": "install py-spy (pip install 'verl-exporter[forensics]') or point --forensics-py-spy at it",
    "permission": "ptrace was refused: run the sidecar as the trainer's user or root with CAP_SYS_PTRACE, "
                  "set /proc/sys/kernel/yama/ptrace_scope to 0 or 1, and on Kubernetes put the sidecar in the "
                  "trainer's pod with shareProcessNamespace: true and securityContext.capabilities.add: "
                  "[SYS_PTRACE]",
    "no_process": "the process is gone, or not in this sidecar's pid namespace (Kubernetes: shareProcessNamespace)",
    "timeout": "py-spy did not answer in time (a process in uninterruptible I/O?); raise --forensics-timeout",
    "failed": "py-spy could not read the process (not a Python process, or an unsupported Python)",
}
_PERMISSION = ("permission denied", "operation not permitted", "os error 1)", "os error 13)", "ptrace")
_NO_PROCESS = ("no such process", "failed to get process executable name", "os error 3)",
               "check that the process is running")


def classify(error_text: str) -> str:
    """The bounded reason of a py-spy failure, from its error text."""
    text = error_text.lower()
    if any(s in text for s in _PERMISSION):
        return "permission"
    if any(s in text for s in _NO_PROCESS):
        return "no_process"
    return "failed"


@dataclass(frozen=True)
class ForensicsSettings:
    directory: str
    py_spy: str = "py-spy"  # a name on PATH or a path
    native: bool = True
    max_files: int = DEFAULT_MAX_FILES
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    flight_recorder: str | None = None  # the path prefix of Flight Recorder JSON dumps, one per rank


def _rank_of(proc: psutil.Process) -> str | None:
    try:
        rank = proc.environ().get("RANK")
    except (psutil.Error, OSError):
        return None
    return rank if rank and rank.isdigit() else None


def targets(trainer_pid: int | None) -> list[psutil.Process | _Gone]:
    """The trainer's process tree and this node's Ray workers, the trainer first, at most MAX_PROCESSES."""
    found: dict[int, psutil.Process | None] = {}
    if trainer_pid is not None:
        try:
            root = psutil.Process(trainer_pid)
            found[root.pid] = root
            found.update((c.pid, c) for c in root.children(recursive=True))
        except (psutil.Error, OSError):
            found[trainer_pid] = None  # captured anyway: its failure says why (gone, another namespace)
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if proc.pid not in found and looks_like_ray_worker(proc.info["name"] or "", proc.info["cmdline"] or []):
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    found.pop(os.getpid(), None)  # a sidecar started by the trainer is in its tree: it does not dump itself
    return [p if p is not None else _Gone(pid) for pid, p in list(found.items())[:MAX_PROCESSES]]


def find_py_spy(name: str = "py-spy") -> str | None:
    """py-spy on PATH, else beside this Python (pip installs it into the environment's bin/); None if absent."""
    found = shutil.which(name) or (shutil.which(name, path=os.path.dirname(sys.executable)) if os.sep not in name
                                   else None)
    return found if found and os.access(found, os.X_OK) else None


class _Gone:
    """A pid that psutil cannot open: py-spy is still asked, so that the failure names the reason."""

    def __init__(self, pid: int):
        self.pid = pid


class Forensics:
    def __init__(self, settings: ForensicsSettings, self_metrics: SelfMetrics, trainer_pid: int | None = None,
                 labels: dict[str, str] | None = None, clock: Callable[[], float] = time.time):
        self.settings = settings
        self.dir = Path(settings.directory)
        self._self = self_metrics
        self._trainer_pid = trainer_pid
        self._labels = dict(labels or {})
        self._clock = clock
        self._lock = threading.RLock()  # one capture at a time: a stall and a request may coincide
        self.last: dict[str, Any] | None = None  # {time, path, verdict, trigger} of the latest capture
        self._last_doc: dict[str, Any] | None = None
        self._done_at = float("-inf")  # when the latest capture ended
        self._tag = owner_tag(socket.gethostname(), self._labels.get("rank"))
        self._written: list[Path] = []  # this process's captures, oldest first: their real order
        for trigger in ("stall", "request"):
            self_metrics.inc(FORENSICS_CAPTURES, 0, trigger=trigger)
        for reason in (*HINTS, "write"):
            self_metrics.inc(FORENSICS_FAILURES, 0, reason=reason)

    # ------------------------------------------------------------------ one process
    def _binary(self) -> str | None:
        return find_py_spy(self.settings.py_spy)

    def dump(self, binary: str, pid: int) -> dict[str, Any]:
        """One process's py-spy threads, or its error and reason."""
        started = time.perf_counter()
        tries = (["--native"], []) if self.settings.native else ([],)
        error = ""
        for extra in tries:
            cmd = [binary, "dump", "--json", *extra, "--pid", str(pid)]
            try:
                done = subprocess.run(cmd, capture_output=True, timeout=self.settings.timeout_s, check=False)
            except subprocess.TimeoutExpired:
                return {"pid": pid, "reason": "timeout", "error": f"py-spy took over {self.settings.timeout_s} s"}
            except OSError as e:  # removed or not executable since the check
                return {"pid": pid, "reason": "no_binary", "error": f"cannot run {binary}: {e.strerror}"}
            if done.returncode == 0 and len(done.stdout) <= MAX_OUTPUT_BYTES:
                entry = parse_dump(pid, done.stdout)
                if "reason" in entry:
                    error = entry["error"]
                    continue
                return {**entry, "native": bool(extra), "ms": round((time.perf_counter() - started) * 1000, 1)}
            error = _first_line(done.stderr) or f"py-spy exited {done.returncode}"
            if classify(error) != "failed":
                break  # without --native it would fail the same way
        return {"pid": pid, "reason": classify(error), "error": error}

    # ------------------------------------------------------------------ one capture
    def capture(self, trigger: str, reason: str = "", step: Any = None) -> dict[str, Any]:
        """Capture every target, write the file, count; returns the capture document (with ``path``)."""
        with self._lock:
            now = self._clock()
            binary = self._binary()
            def one(proc: psutil.Process | _Gone) -> dict[str, Any]:
                if binary is None:
                    entry = {"pid": proc.pid, "reason": "no_binary",
                             "error": f"py-spy not found ({self.settings.py_spy})"}
                else:
                    entry = self.dump(binary, proc.pid)
                return {**entry, **_describe(proc)}

            # a few at a time: a native dump of a torch rank takes seconds, and a node has 8 ranks or more
            with ThreadPoolExecutor(PARALLEL_DUMPS, thread_name_prefix="verl-forensics-dump") as pool:
                processes = list(pool.map(one, targets(self._trainer_pid)))
            for p in processes:
                if "reason" in p:
                    self._self.inc(FORENSICS_FAILURES, reason=p["reason"])
                    p["hint"] = HINTS[p["reason"]]
            doc = {"version": 1, "time": now, "trigger": trigger, "reason": reason, "step": step,
                   "host": socket.gethostname(), "run": self._labels.get("run"), "rank": self._labels.get("rank"),
                   "processes": processes}
            doc["verdict"] = verdict(processes) if processes else "no process to capture (set --trainer-pid)"
            if self.settings.flight_recorder:
                doc["flight_recorder"] = flight_recorder_verdict(read_flight_recorder(self.settings.flight_recorder))
                if doc["flight_recorder"]:
                    doc["verdict"] += f"; {doc['flight_recorder']}"
            failures = sorted({p["reason"] for p in processes if "reason" in p})
            if failures:
                log.warning("forensics: %d of %d process(es) not captured (%s): %s", sum("reason" in p for p in
                            processes), len(processes), ", ".join(failures), HINTS[failures[0]])
            doc["path"] = self._write(doc, now)
            if doc["path"]:
                self._self.inc(FORENSICS_CAPTURES, trigger=trigger)
                self._self.set(FORENSICS_LAST_CAPTURE_TIMESTAMP_SECONDS, now)
                log.warning("forensics: stacks of %d process(es) in %s: %s", len(processes), doc["path"],
                            doc["verdict"])
            self.last = {"time": now, "trigger": trigger, "path": doc["path"], "verdict": doc["verdict"]}
            self._last_doc = doc
            self._done_at = self._clock()
            return doc

    def requested(self, reason: str = "") -> dict[str, Any]:
        """A capture asked for (POST /control/forensics): the one running or just ended when the request came
        (within MIN_REQUEST_GAP_S of its end), else a new one. A capture pauses the trainer: requests that queue
        behind one (the relay's retries, two HA relays) get it rather than a capture each."""
        arrived = self._clock()
        with self._lock:
            last = self._last_doc
            if (last is not None and last["path"] and arrived - self._done_at < MIN_REQUEST_GAP_S
                    and os.path.lexists(last["path"])):  # never an answer that names a file gone since
                return last
            return self.capture("request", reason)

    def _write(self, doc: dict[str, Any], now: float) -> str | None:
        stamp = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}-{int(now * 1000) % 1000:03d}"
        path = self.dir / f"capture-{stamp}+{self._tag}.json"  # "+": never in a tag, nor escaped in a page
        try:
            make_dirs(self.dir, DIR_MODE)  # the folders it makes; an existing one is not its to chmod
            n = 0
            while os.path.lexists(path):  # the same millisecond again (a clock stepped back): a name of its own
                n += 1
                path = self.dir / f"capture-{stamp}-{n}+{self._tag}.json"
            write_atomic(path, json.dumps({**doc, "path": str(path)}, default=str), mode=FILE_MODE)
        except OSError as e:
            self._self.inc(FORENSICS_FAILURES, reason="write")
            self._self.problem("forensics", "write", f"cannot write {path}: {e.strerror or e}")
            return None
        self._written.append(path)
        self._prune()
        return str(path)

    def _prune(self) -> None:
        """Keep this sidecar's newest captures within the count and byte caps; the newest (the one just written,
        being answered) is kept whatever its size. Files without this sidecar's tag are never touched."""
        mine = set(self._written)
        # an earlier process's captures (same tag) are older than all of this one's: by mtime among themselves
        try:
            earlier = [p for p in self.dir.glob(f"capture-*+{glob_escape(self._tag)}.json") if p not in mine]
        except OSError:
            earlier = []
        earlier.sort(key=_mtime, reverse=True)
        total = 0
        for i, f in enumerate([*reversed(self._written), *earlier]):
            try:
                st = f.lstat()
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):  # gone, or a link or folder: not a capture of ours
                if f in mine:
                    self._written.remove(f)
                continue
            total += st.st_size
            if i > 0 and (i >= self.settings.max_files or total > self.settings.max_bytes):
                try:
                    f.unlink()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self._self.problem("forensics", "prune", f"cannot remove {f}: {e.strerror or e}")
                    continue
                if f in mine:
                    self._written.remove(f)


def owner_tag(host: str, rank: str | None) -> str:
    """This sidecar's mark in its capture files' names: which files of a shared folder are its own to prune."""
    tag = host if rank is None else f"{host}-rank{rank}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", tag)[:100] or "_"


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return float("-inf")


def parse_dump(pid: int, stdout: bytes) -> dict[str, Any]:
    """One process's entry from py-spy's JSON: its threads (dicts, frames a list of dicts), or why not."""
    try:
        threads = json.loads(stdout)
    except (ValueError, RecursionError):
        threads = None
    if not isinstance(threads, list):
        return {"pid": pid, "reason": "failed", "error": "py-spy wrote no JSON list of threads"}
    kept = [t for t in threads if isinstance(t, dict)]
    for t in kept:
        frames = t.get("frames")
        t["frames"] = [f for f in frames if isinstance(f, dict)] if isinstance(frames, list) else []
    return {"pid": pid, "threads": kept}


def _first_line(raw: bytes) -> str:
    lines = raw.decode("utf-8", "replace").strip().splitlines()
    return lines[0][:300] if lines else ""


def _describe(proc: psutil.Process | _Gone) -> dict[str, Any]:
    """The rank (from RANK), and the command line (clipped) of a captured process."""
    if not isinstance(proc, psutil.Process):
        return {"rank": None}
    try:
        cmdline = " ".join(proc.cmdline())[:300]
    except (psutil.Error, OSError):
        cmdline = ""
    return {"rank": _rank_of(proc), "cmdline": cmdline}


def hang_alerts(spec: Spec) -> list[Alert]:
    """The alerts that call the trainer hung: the critical ones judged between steps (VerlTrainingStalled), with
    their knobs as the overrides file sets them. They page, the breaker's tick trips on them, and /healthz fails
    while one holds (--healthz-hang). The forensics trigger judges every alert judged between steps, the
    warning too: the stacks are freshest before the page."""
    return [a for a in spec.alerts() if a.judged_between_steps and a.severity == "critical"]


class StallWatch:
    """Judges the spec's between-steps alerts (stalls) on the store every ``interval`` s; captures once per
    stall, at the first alert whose condition holds (before its ``for``: the evidence is freshest then)."""

    def __init__(self, spec: Spec, store: TrainingStore, forensics: Forensics, interval: float = 1.0,
                 clock: Callable[[], float] = time.time):
        self.alerts = [a for a in spec.alerts() if a.judged_between_steps]
        self._store = store
        self._forensics = forensics
        self._interval = interval
        self._clock = clock
        self._captured_for: float | None = None  # the last step time a capture was made for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verl-forensics", daemon=True)

    def check(self, now: float | None = None) -> dict[str, Any] | None:
        """Capture if a stall alert holds now and this stall has no capture yet; returns the capture."""
        view = self._store.view(self._clock() if now is None else now)
        step_at = view.last_step_at
        if step_at is None or step_at == self._captured_for:
            return None
        for alert in self.alerts:
            value = alert.judge(view)
            if value is not None:
                self._captured_for = step_at
                return self._forensics.capture("stall", f"{alert.alert}: no step for {value:.0f} s",
                                               self._store.step)
        return None

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.check()
            except Exception:  # a bug here must cost the capture, never the sidecar
                log.exception("forensics: the stall check failed")
