"""What the relay must remember across a restart, even a ``kill -9``: the alerts it accepted and has not yet
delivered, and when it last sent to each robot (the robots count 20 messages a minute across our restarts).

One append-only file in spool_dir, ``relay-journal.jsonl`` (mode 0600), one JSON object a line:

    {"add": 7, "target": "dt", "receiver": "verl-critical", "alert": {...}}   accepted (before the 200)
    {"done": [7, 8]}                                                          delivered, given up or replaced
    {"try": 3, "target": "dt", "at": 1767225600.5}                            an attempt (wall clock); written
                                                                              before it (its latest possible
                                                                              time) and again after it
    {"full": "dt", "at": 1767225600.5}                                        the robot said "too fast"

A line is written with one write(2) before the relay acts on it, so it survives the process being killed
(a power loss may cost the last seconds: no fsync per line, which would slow every webhook). The file is
rewritten compactly (atomically) at start, when nothing is pending and it has grown, and at shutdown.

One relay per spool_dir: the relay holds an exclusive lock (flock) on ``relay.lock`` there for its whole
life, with its pid in the file. A second relay on the same directory would append to a journal the first
one replaces by rename at shutdown, and what it accepted would be lost at its next crash; it refuses to start
instead. The kernel drops the lock with the process, so a relay killed with -9 never blocks the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..core.atomicfile import remove_stale_temps, write_atomic
from ..exposition.selfmetrics import SelfMetric
from .metrics import RelayMetrics

SPOOL_ERRORS = SelfMetric("verl_relay_spool_errors_total")

log = logging.getLogger(__name__)

JOURNAL = "relay-journal.jsonl"
LOCK = "relay.lock"
LOCK_WAIT_SECONDS = 1.0
# Attempts remembered per target: more than any robot allows in one window.
KEEP_TRIES = 100
COMPACT_LINES = 1000


class SpoolError(RuntimeError):
    """spool_dir cannot be used: the relay must not run believing it keeps alerts across a restart."""


def check_spool_dir(path: Path) -> str | None:
    """Why `path` cannot be the spool directory (None: it can): a regular file, or not writable."""
    if path.exists() and not path.is_dir():
        return f"spool_dir {str(path)!r} is not a directory"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"spool_dir {str(path)!r}: {str(existing)!r} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"spool_dir {str(path)!r}: {str(existing)!r} is not writable by this user"
    return None


class SpoolLock:
    """The exclusive lock on spool_dir/relay.lock, held from acquire() to release() (or the process's end)."""

    def __init__(self, spool_dir: Path):
        self.dir = spool_dir
        self.path = spool_dir / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; SpoolError naming the directory (and the holder's pid) when another relay has it."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:  # a --check-config looking at it holds it for an instant
                    time.sleep(0.05)
                    continue
                holder = _pid_in(fd)
                os.close(fd)
                raise SpoolError(_in_use(self.dir, holder)) from None
            except OSError:
                os.close(fd)
                raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Let the next relay have the directory. The file stays: removing it would let a relay that opened it
        just before lock a file no other relay sees."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _pid_in(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode("ascii").strip())
    return None


def _in_use(path: Path, pid: int | None) -> str:
    who = f"another relay (pid {pid})" if pid else "another relay"
    return (f"spool_dir {str(path)!r} is in use by {who}: two relays on one spool_dir lose alerts; give each "
            "relay its own spool_dir")


def spool_holder(spool_dir: Path) -> int | None:
    """The pid of the relay that holds spool_dir's lock (0 when it is held by a relay that wrote no pid),
    None when it is free. Tries the lock and lets it go at once: for --check-config."""
    try:
        fd = os.open(spool_dir / LOCK, os.O_RDONLY)
    except OSError:
        return None  # no lock file (or unreadable: starting will say why): nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid_in(fd) or 0
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def spool_in_use(spool_dir: Path) -> str | None:
    """Why spool_dir cannot be used now because a relay holds it (None: free)."""
    pid = spool_holder(spool_dir)
    return None if pid is None else _in_use(spool_dir, pid)


class Numbered(Protocol):
    """A queued item, told its journal id."""

    jid: int | None


@dataclass
class Entry:
    target: str
    receiver: str
    alert: dict[str, Any]


CLOCK_SLACK_S = 60.0  # a recorded attempt may lie this far ahead of the clock (a clock stepped back a little)


def _id(value: Any) -> int:
    """A journal id as the relay writes it: a JSON integer, 0 to 2**53 (not a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        raise ValueError("not a journal id")
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not a name")
    return value


def _time(value: Any, latest: float) -> float:
    """A recorded wall time: a finite number from 0 to latest."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= latest:
        raise ValueError("not a time")  # NaN fails the comparison too
    return float(value)


class Journal:
    def __init__(self, spool_dir: Path, metrics: RelayMetrics, window: float):
        self.path = spool_dir / JOURNAL
        self.metrics = metrics
        self.window = window
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._next = 1
        self._live: dict[int, str] = {}  # id -> its add line, for compaction
        self._tries: dict[str, deque[tuple[int, float]]] = {}  # target -> (try id, wall time)
        self._full: dict[str, float] = {}
        self._lines = 0
        self._failing = False
        self._logged_traceback = False
        self._torn = False
        self._closed = False  # after shutdown: a send still stuck in flight must not write any more
        self.lock = SpoolLock(spool_dir)

    # ---- start
    def acquire(self) -> None:
        """Take spool_dir for this relay (before anything in it is read); SpoolError when another has it."""
        self.lock.acquire()

    def recover(self) -> tuple[list[Entry], dict[str, list[float]]]:
        """The entries still pending in the journal, and each target's recent attempt times (wall clock)."""
        entries: dict[int, Entry] = {}
        tries: dict[int, tuple[str, float]] = {}
        remove_stale_temps(self.path)  # a rewrite cut short by a kill
        lines: list[str] = []
        try:
            if stat.S_ISREG(os.stat(self.path).st_mode):
                with open(self.path, encoding="utf-8") as f:
                    lines = f.readlines()
            else:  # a FIFO would block the start in open(), a folder the journal's rewrite: set it aside
                aside = self.path.with_name(self.path.name + ".bad")
                self._error("read", f"{self.path.name} is not a regular file; renamed to {aside.name}")
                os.replace(self.path, aside)
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError) as e:
            self._error("read", f"cannot read {self.path.name} ({e})")
            lines = []
        bad = 0
        latest = time.time() + CLOCK_SLACK_S  # an attempt "in the future" would hold the robot's window for ever
        for line in lines:
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not an object")
                if "add" in rec:
                    entries[_id(rec["add"])] = Entry(_name(rec["target"]), _name(rec.get("receiver", "")),
                                                     rec["alert"])
                elif "done" in rec:
                    if not isinstance(rec["done"], list):  # a string would be read digit by digit
                        raise ValueError("done is not a list")
                    for i in list(map(_id, rec["done"])):
                        entries.pop(i, None)
                elif "try" in rec:
                    tries[_id(rec["try"])] = (_name(rec["target"]), _time(rec["at"], latest))
                elif "full" in rec:
                    name = _name(rec["full"])
                    self._full[name] = max(_time(rec["at"], latest), self._full.get(name, 0.0))
                else:
                    raise ValueError("no known record")
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                bad += 1  # a line cut by a full disk or a crash, or one no relay wrote: the rest is still good
        if bad:
            self._error("read", f"{bad} unreadable line(s) in {self.path.name} skipped")
        self._next = max([*entries, *tries, 0]) + 1
        for n in sorted(tries):
            target, at = tries[n]
            self._tries.setdefault(target, deque(maxlen=KEEP_TRIES)).append((n, at))
        sent = {t: sorted(at for _, at in v) for t, v in self._tries.items()}
        return list(entries.values()), sent

    def full_since(self) -> dict[str, float]:
        """Targets whose robot said "too fast", and when (wall clock)."""
        return dict(self._full)

    def restart(self, pending: Sequence[tuple[str, str, dict[str, Any], Numbered]]) -> None:
        """Rewrite the journal with exactly `pending` [(target, receiver, alert dict, queued)], giving each
        queued item its id (``.jid``), and keep appending to it. OSError when it cannot be written."""
        with self._lock:
            self._close()
            self._live = {}
            lines = []
            for target, receiver, alert, queued in pending:
                n, line = self._add_line(target, receiver, alert)
                queued.jid = n
                self._live[n] = line
                lines.append(line)
            self._write_compact(lines)

    # ---- while running
    def add(self, target: str, receiver: str, alert: dict[str, Any]) -> int | None:
        with self._lock:
            n, line = self._add_line(target, receiver, alert)
            if self._append(line):
                self._live[n] = line
                return n
            return None

    def done(self, ids: Iterable[int | None]) -> None:
        settled = [n for n in ids if n is not None]
        if not settled:
            return
        with self._lock:
            for n in settled:
                self._live.pop(n, None)
            self._append(json.dumps({"done": settled}) + "\n")
            if self._lines > COMPACT_LINES and 4 * len(self._live) < self._lines:  # mostly settled lines
                try:
                    self._write_compact(list(self._live.values()))
                except OSError as e:
                    self._error("write", f"cannot compact {self.path.name}: {e.strerror}")

    def attempt(self, target: str, at: float, n: int | None = None) -> int:
        """Record an attempt at wall time `at` (again with its id `n` once it is over); its id."""
        with self._lock:
            if n is None:
                n, self._next = self._next, self._next + 1
            tries = self._tries.setdefault(target, deque(maxlen=KEEP_TRIES))
            if tries and tries[-1][0] == n:
                tries.pop()
            tries.append((n, at))
            self._append(json.dumps({"try": n, "target": target, "at": at}) + "\n")
            return n

    def saturated(self, target: str, at: float) -> None:
        with self._lock:
            self._full[target] = at
            self._append(json.dumps({"full": target, "at": at}) + "\n")

    def close(self, keep_pending: bool) -> None:
        """At shutdown: rewrite it with the attempt history (and the pending alerts unless they were spooled
        elsewhere); if that fails the journal stays as it is, which loses nothing."""
        with self._lock:
            lines = list(self._live.values()) if keep_pending else []
            try:
                self._write_compact(lines)
            except OSError as e:
                self._error("write", f"cannot compact {self.path.name} at shutdown: {e.strerror}")
            self._close()
            self._closed = True
            self.lock.release()

    # ---- internals (under the lock)
    def _add_line(self, target: str, receiver: str, alert: dict[str, Any]) -> tuple[int, str]:
        n, self._next = self._next, self._next + 1
        return n, json.dumps({"add": n, "target": target, "receiver": receiver, "alert": alert},
                             ensure_ascii=False) + "\n"

    def _history_lines(self) -> list[str]:
        horizon = time.time() - 2 * self.window  # older attempts no longer limit anything
        lines = [json.dumps({"try": n, "target": t, "at": at}) + "\n"
                 for t, tries in self._tries.items() for n, at in tries if at > horizon]
        lines += [json.dumps({"full": t, "at": at}) + "\n" for t, at in self._full.items() if at > horizon]
        return lines

    def _write_compact(self, pending_lines: list[str]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lines = self._history_lines() + pending_lines
        write_atomic(self.path, "".join(lines), mode=0o600)  # only its owner may read the alerts
        self._close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._lines, self._torn = len(lines), False

    def _append(self, line: str) -> bool:
        if self._closed:
            return False
        if self._fd is None:
            self._error("write", f"{self.path.name} is not open: accepted alerts are not kept across a crash")
            return False
        try:
            data = (b"\n" if self._torn else b"") + line.encode("utf-8")
            written = os.write(self._fd, data)
            self._torn = written != len(data)  # a cut line: start the next on a line of its own
            if self._torn:
                raise OSError(28, "short write (disk full?)")
        except OSError as e:
            self._torn = True
            self._error("write", f"cannot append to {self.path.name} ({e.strerror}): accepted alerts are not "
                                 "kept across a crash until it works again")
            return False
        self._lines += 1
        if self._failing:
            self._failing = False
            log.warning("the journal %s is written again", self.path.name)
        return True

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _error(self, operation: str, message: str) -> None:
        self.metrics.inc(SPOOL_ERRORS, operation=operation)
        if not self._failing:  # once per failing spell, not once per webhook; the traceback the first time
            log.error("%s", message, exc_info=None if self._logged_traceback else sys.exc_info()[1])
            self._logged_traceback = True
        self._failing = operation == "write"
