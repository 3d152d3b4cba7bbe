"""Follow verl's file logger: one JSON object per line, ``{"step": N, "data": {...}}``.

What the follower copes with, because verl and real file systems do it:
- the file does not exist yet (the sidecar starts before the trainer): wait, healthy;
- verl opens it with "wb", so a restarted or resumed run truncates it: detected by the size going below
  our offset, or by the first bytes of the file changing when it regrew past our offset between polls;
- rotation or replacement (a new inode at the path): the old file is read to its end, then the new one
  from its start;
- a partial last line still being written: kept until its newline arrives;
- malformed lines, non-object lines, very long lines: rejected and counted by reason, memory bounded;
- a sidecar restart: the latest values are recovered from the file's tail (not replayed from step 0), and
  the step time of recovered lines is the file's mtime (never later than now: clocks of a shared file
  system drift), so a dead trainer does not look freshly alive. The NaN counter is the number of NaNs in
  the file followed, rebuilt from the whole file after a restart (only lines that can hold a NaN are
  parsed), so that Prometheus sees the same count again rather than a reset that looks like new NaNs.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Mapping

from ...core.selfmetrics import SelfMetrics
from ..store import TrainingStore

SOURCE = "file"
COMPONENT = "verl_file"
DEFAULT_POLL_S = 0.1
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
DEFAULT_RECOVER_BYTES = 8 * 1024 * 1024
_CHUNK = 1024 * 1024
_HEAD = 256  # bytes of the file's start kept to recognise a truncate-and-rewrite
# What a line holding a NaN or Inf contains: null (orjson), NaN or Infinity (json), or a float literal
# with a 3-digit exponent (1e999 reads as Inf). Substring searches: several times faster than a regex.
_NONFINITE_WORDS = (b"null", b"NaN", b"Infinity")
_ZERO_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_HUGE_EXPONENTS = (b"0e000", b"0e+000", b"0E000", b"0E+000")


class VerlFileFollower:
    def __init__(self, path: str, store: TrainingStore, self_metrics: SelfMetrics,
                 poll_interval: float = DEFAULT_POLL_S, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 recover_bytes: int = DEFAULT_RECOVER_BYTES, clock=time.time):
        self.path = path
        self._store = store
        self._self = self_metrics
        self._poll = poll_interval
        self._max_line = max_line_bytes
        self._recover = recover_bytes
        self._clock = clock
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        self._offset = 0
        self._head = b""
        self._buf = bytearray()
        self._skipping = False  # inside a line longer than max_line_bytes
        self._first_open = True
        self._state = "waiting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Set once the first poll is done: a restarted sidecar has then recovered the latest values and the
        # NaN count, and may serve (serving before would show a NaN counter that went back to nothing).
        self.recovered = threading.Event()
        self._self.set("verl_exporter_source_up", 1, source=SOURCE)
        self._self.inc("verl_exporter_lines_parsed_total", 0, source=SOURCE)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VerlFileFollower:
        self._thread = threading.Thread(target=self._run, name="verl-file-follower", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self._close()

    def status(self) -> str:
        """ok | waiting (no file yet) | error: <reason> — for /healthz."""
        return self._state

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as e:  # never let the thread die: count, log, go on
                self._fail("unexpected", f"unexpected error following {self.path}: {e!r}")
            self.recovered.set()
            self._stop.wait(self._poll)

    def _fail(self, kind: str, message: str) -> None:
        self._state = f"error: {message}"
        self._self.set("verl_exporter_source_up", 0, source=SOURCE)
        self._self.problem(COMPONENT, kind, message)

    def _ok(self, state: str = "ok") -> None:
        self._state = state
        self._self.set("verl_exporter_source_up", 1, source=SOURCE)

    # ------------------------------------------------------------------ one poll
    def poll(self) -> None:
        """Read whatever is new. Called every poll_interval by the thread; tests call it directly."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._fd is not None:  # rotated away: finish what the old file holds, then wait
                with contextlib.suppress(OSError):
                    self._finish()
                self._close()
            self._ok("waiting")
            return
        except OSError as e:
            self._fail("stat", f"cannot stat {self.path}: {e.strerror}")
            return
        if not stat.S_ISREG(st.st_mode):
            self._close()
            self._fail("not_a_file", f"{self.path} is not a regular file")
            return
        try:
            self._follow(st)
        except OSError as e:  # e.g. an NFS hiccup: drop the handle, reopen on the next poll
            self._close()
            self._fail("read", f"cannot read {self.path}: {e.strerror}")
            return
        self._ok()

    def _follow(self, st: os.stat_result) -> None:
        ident = (st.st_dev, st.st_ino)
        if self._fd is not None and ident != self._ident:
            self._finish()
            self._close()
            self._reset("replaced")
        if self._fd is None:
            self._open(ident, st.st_size)
        self._check_truncated(st.st_size)
        recovering = self._first_open
        self._first_open = False
        # A file written on a host whose clock runs ahead must not make the recovered step look recent.
        self._read_available(seen_at=min(st.st_mtime, self._clock()) if recovering else None)

    def _finish(self) -> None:
        """Read the rest of a file that was rotated away (it may have been rewritten first)."""
        self._check_truncated(os.fstat(self._fd).st_size)
        self._read_available()

    def _check_truncated(self, size: int) -> None:
        if size < self._offset or not self._same_head(size):
            self._reset("truncated")

    def _open(self, ident: tuple[int, int], size: int) -> None:
        self._fd = os.open(self.path, os.O_RDONLY)
        self._ident = ident
        self._offset = 0
        self._buf.clear()
        self._skipping = False
        self._head = os.pread(self._fd, _HEAD, 0)
        if self._first_open and size > self._recover:
            # Sidecar restart on a long run: only the tail matters for the latest values. It starts
            # after the first newline of its window (a line longer than max_line_bytes is skipped).
            start = size - self._recover
            window = os.pread(self._fd, self._max_line + 1, start - 1)
            nl = window.find(b"\n")
            if nl < 0:
                self._offset, self._skipping = start, True
            else:
                self._offset = start + nl
        self._store.reset_nonfinite()  # the count is per file: a restart rebuilds the same number
        if self._offset:
            self._count_nonfinite_before(self._offset)

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = None
        self._ident = None

    def _same_head(self, size: int) -> bool:
        """False when the start of the file changed since we read it: truncated and rewritten (also to
        exactly the size we had read, so this reads the head on every poll: 256 bytes)."""
        if size == 0:
            return True
        current = os.pread(self._fd, _HEAD, 0)
        if not current.startswith(self._head):
            return False
        self._head = current  # grows to _HEAD bytes as the first line is written
        return True

    def _count_nonfinite_before(self, end: int) -> None:
        """Count the NaNs of the lines before the recovered tail."""
        pending = b""
        offset = 0
        while offset < end:
            chunk = os.pread(self._fd, min(_CHUNK, end - offset), offset)
            if not chunk:
                return
            offset += len(chunk)
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            if len(pending) > self._max_line:
                pending = b""  # a line too long to be parsed: its rest is skipped like any part
            for piece in lines:
                if len(piece) <= self._max_line and _may_be_nonfinite(piece):
                    self._count_line(piece)

    def _count_line(self, line: bytes) -> None:
        try:
            obj = json.loads(line)
            if isinstance(obj, Mapping) and isinstance(obj.get("data"), Mapping):
                self._store.count_nonfinite(obj["data"])
        except (ValueError, RecursionError):
            pass  # the live follower rejected (and counted) it when it was written

    def _reset(self, reason: str) -> None:
        self._self.inc("verl_exporter_source_resets_total", reason=reason)
        self._store.reset_nonfinite()
        self._offset = 0
        self._buf.clear()
        self._skipping = False
        if self._fd is not None:
            self._head = os.pread(self._fd, _HEAD, 0)

    def _read_available(self, seen_at: float | None = None) -> None:
        if self._fd is None:
            return
        while True:
            chunk = os.pread(self._fd, _CHUNK, self._offset)
            if not chunk:
                return
            self._offset += len(chunk)
            self._feed(chunk, seen_at)
            if len(chunk) < _CHUNK:
                return

    # ------------------------------------------------------------------ lines
    def _feed(self, chunk: bytes, seen_at: float | None) -> None:
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                rest = chunk[start:]
                if self._skipping:
                    return
                if len(self._buf) + len(rest) > self._max_line:
                    self._reject("too_long")
                    self._buf.clear()
                    self._skipping = True
                else:
                    self._buf += rest
                return
            piece = chunk[start:nl]
            start = nl + 1
            if self._skipping:
                self._skipping = False
                self._buf.clear()
                continue
            if self._buf:
                self._buf += piece
                line = bytes(self._buf)
                self._buf.clear()
            else:
                line = piece
            if len(line) > self._max_line:
                self._reject("too_long")
                continue
            self._line(line, seen_at)

    def _line(self, line: bytes, seen_at: float | None) -> None:
        if not line.strip():
            return
        try:
            obj = json.loads(line)
        except ValueError:  # also UnicodeDecodeError and an integer over Python's digit limit
            self._reject("malformed_json")
            return
        except RecursionError:  # nested thousands deep
            self._reject("too_deep")
            return
        if not isinstance(obj, Mapping):
            self._reject("not_an_object")
            return
        data = obj.get("data")
        if not isinstance(data, Mapping):
            self._reject("no_data")
            return
        try:
            self._store.ingest(obj.get("step"), data, seen_at if seen_at is not None else self._clock())
        except Exception as e:  # a bug must cost this one line, not the rest of the read
            self._self.problem(COMPONENT, "ingest", f"could not ingest a line of {self.path}: {e!r}")
            self._reject("unexpected")
            return
        self._self.inc("verl_exporter_lines_parsed_total", source=SOURCE)

    def _reject(self, reason: str) -> None:
        self._self.inc("verl_exporter_lines_rejected_total", source=SOURCE, reason=reason)
        self._self.problem(COMPONENT, reason, f"rejected a line of {self.path}: {reason}", count=False)


def _may_be_nonfinite(line: bytes) -> bool:
    if any(word in line for word in _NONFINITE_WORDS):
        return True
    zeroed = line.translate(_ZERO_DIGITS)
    return any(pattern in zeroed for pattern in _HUGE_EXPONENTS)
