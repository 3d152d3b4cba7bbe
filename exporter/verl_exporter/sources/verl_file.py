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
  the step time of recovered lines is the file's mtime, so a dead trainer does not look freshly alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Mapping

from ..selfmetrics import SelfMetrics
from ..store import TrainingStore

SOURCE = "file"
COMPONENT = "verl_file"
DEFAULT_POLL_S = 0.1
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
DEFAULT_RECOVER_BYTES = 8 * 1024 * 1024
_CHUNK = 1024 * 1024
_HEAD = 256  # bytes of the file's start kept to recognise a truncate-and-rewrite


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
                self._read_available()
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
            self._read_available()
            self._close()
            self._reset("replaced")
        if self._fd is None:
            self._open(ident, st.st_size)
        if st.st_size < self._offset or not self._same_head(st.st_size):
            self._reset("truncated")
        recovering = self._first_open
        self._first_open = False
        self._read_available(seen_at=st.st_mtime if recovering else None)

    def _open(self, ident: tuple[int, int], size: int) -> None:
        self._fd = os.open(self.path, os.O_RDONLY)
        self._ident = ident
        self._offset = 0
        self._buf.clear()
        self._skipping = False
        self._head = os.pread(self._fd, _HEAD, 0)
        if self._first_open and size > self._recover:
            # Sidecar restart on a long run: only the tail matters for the latest values.
            self._offset = size - self._recover
            self._skipping = True  # the first (partial) line of the tail is not a whole line

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = None
        self._ident = None

    def _same_head(self, size: int) -> bool:
        """False when the start of the file changed since we read it: truncated and rewritten."""
        if size <= self._offset:
            return True
        current = os.pread(self._fd, _HEAD, 0)
        if not current.startswith(self._head):
            return False
        self._head = current  # grows to _HEAD bytes as the first line is written
        return True

    def _reset(self, reason: str) -> None:
        self._self.inc("verl_exporter_source_resets_total", reason=reason)
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
        except ValueError:  # also UnicodeDecodeError
            self._reject("malformed_json")
            return
        if not isinstance(obj, Mapping):
            self._reject("not_an_object")
            return
        data = obj.get("data")
        if not isinstance(data, Mapping):
            self._reject("no_data")
            return
        self._store.ingest(obj.get("step"), data, seen_at if seen_at is not None else self._clock())
        self._self.inc("verl_exporter_lines_parsed_total", source=SOURCE)

    def _reject(self, reason: str) -> None:
        self._self.inc("verl_exporter_lines_rejected_total", source=SOURCE, reason=reason)
        self._self.problem(COMPONENT, reason, f"rejected a line of {self.path}: {reason}", count=False)
