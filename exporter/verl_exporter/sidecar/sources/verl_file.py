"""Follow verl's file logger: one JSON object per line, ``{"step": N, "data": {...}}``.

What the follower copes with, because verl and real file systems do it:
- the file does not exist yet (the sidecar starts before the trainer): wait, healthy;
- verl opens it with "wb", so a restarted or resumed run truncates it: detected by the size going below
  our offset, or, when it regrew past our offset between polls, by its first bytes or the bytes just before
  our offset changing;
- rotation or replacement (a new inode at the path): the old file is read to its end, then the new one
  from its start;
- a partial last line still being written: kept until its newline arrives;
- malformed lines, non-object lines, very long lines: rejected and counted by reason, memory bounded;
- a sidecar restart: the latest values are recovered from the file's tail (not replayed from step 0), and
  the step time of recovered lines is the file's mtime (never later than now: clocks of a shared file
  system drift), so a dead trainer does not look freshly alive. The NaN counter is the number of NaNs in
  the file followed, rebuilt from the whole file after a restart (only lines that can hold a NaN are
  parsed), so that Prometheus sees the same count again rather than a reset that looks like new NaNs.

The count is a function of the file's bytes alone: the live follower and the recount cut lines with one
``LineSplitter`` and read them with one ``parse_line``, and the recount skips only lines that provably
hold no NaN/Inf (``may_be_nonfinite``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ...exposition.selfmetrics import SelfMetric, SelfMetrics
from ..store import TrainingStore

SOURCE_UP = SelfMetric("verl_exporter_source_up")
LINES_PARSED = SelfMetric("verl_exporter_lines_parsed_total")
SOURCE_RESETS = SelfMetric("verl_exporter_source_resets_total")
LINES_REJECTED = SelfMetric("verl_exporter_lines_rejected_total")

SOURCE = "file"
COMPONENT = "verl_file"
DEFAULT_POLL_S = 0.1
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
DEFAULT_RECOVER_BYTES = 8 * 1024 * 1024
_CHUNK = 1024 * 1024
_HEAD = 256  # bytes of the file's start kept to recognise a truncate-and-rewrite
_MARK = 64  # and of the bytes just before where we stopped, for a rewrite that starts alike
# What a line whose data holds a NaN or Inf contains: null (orjson), NaN or Infinity (json; -Infinity too),
# or a float literal that overflows (json reads it as Inf). A literal overflows only if it reaches 1.8e308: with
# an exponent of at most 2 digits (at most e+99) its integer part then has at least 309 - 99 = 210 digits.
# So: an exponent of 3 or more digits, or a run of 210 digits. Digits are mapped to 0 and E to e first, so
# that one literal-prefixed regex and one substring search find them (a regex on raw digits is 10x slower).
_NUMBER_SHAPE = bytes.maketrans(b"123456789E", b"000000000e")
_LONG_EXPONENT = re.compile(rb"e\+?000")
_LONG_MANTISSA = b"0" * 210


class Rejected(NamedTuple):
    """Why a line is not a logged step: a reason of verl_exporter_lines_rejected_total, and a detail to log."""

    reason: str
    detail: str


def parse_line(line: bytes) -> Mapping[str, Any] | Rejected | None:
    """The one reading of a log line, for the live follower and the recount alike: the logged object (its
    ``data`` a mapping), why it is rejected, or None for a blank line.

    The log is UTF-8 (orjson writes nothing else): json.loads(bytes) would guess UTF-16 from NUL bytes, and
    the recount's byte search could not see a null in such a line. A key holding a lone surrogate (the JSON
    escape "\\ud800" is valid) is kept as it is: the store escapes and counts it where it enters, as it does
    for the Monitor's keys.
    """
    if not line.strip():
        return None
    try:
        text = line.decode("utf-8-sig")  # a byte-order mark, as json.loads(bytes) allowed
    except UnicodeDecodeError as e:
        return Rejected("malformed_json", f"not UTF-8 (byte {e.start + 1} of the line)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Rejected("malformed_json", f"not JSON ({e.msg} at character {e.pos + 1})")
    except ValueError:
        return Rejected("malformed_json", "an integer of more digits than Python reads")
    except RecursionError:
        return Rejected("too_deep", "nested thousands deep")
    if not isinstance(obj, Mapping):
        return Rejected("not_an_object", "not a JSON object")
    data = obj.get("data")
    if not isinstance(data, Mapping):
        return Rejected("no_data", 'no "data" object')
    return obj


def may_be_nonfinite(line: bytes) -> bool:
    """False only for a line whose data cannot hold a NaN or Inf once parsed (see _NUMBER_SHAPE's comment)."""
    if b"null" in line or b"NaN" in line or b"Infinity" in line:
        return True
    shape = line.translate(_NUMBER_SHAPE)
    return _LONG_MANTISSA in shape or _LONG_EXPONENT.search(shape) is not None


class LineSplitter:
    """Where the log's lines start and end, for the live follower and the recount alike.

    A line (without its newline) longer than max_line is too long: it is reported once, as soon as its
    length passes max_line (its newline may never come), and its bytes are dropped up to its newline.
    A partial last line is kept until its newline arrives. Memory: at most max_line bytes.
    """

    def __init__(self, max_line: int):
        self.max_line = max_line
        self._buf = bytearray()
        self._skipping = False  # inside a line longer than max_line

    def reset(self, skipping: bool = False) -> None:
        """Start afresh at the start of a line, or (skipping) inside a line already known to be too long."""
        self._buf.clear()
        self._skipping = skipping

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, chunk: bytes) -> tuple[list[bytes], int]:
        """The complete lines this chunk ends, in order, and how many lines it showed to be too long."""
        pieces = chunk.split(b"\n")
        rest = pieces.pop()
        too_long = 0
        if pieces:
            if self._skipping:  # the end of a too-long line, already reported
                del pieces[0]
            elif self._buf:
                self._buf += pieces[0]
                pieces[0] = bytes(self._buf)
            self._buf.clear()
            self._skipping = False
            lines = [p for p in pieces if len(p) <= self.max_line]
            too_long += len(pieces) - len(lines)
        else:
            lines = []
        if not self._skipping:
            if len(self._buf) + len(rest) > self.max_line:
                too_long += 1
                self._buf.clear()
                self._skipping = True
            else:
                self._buf += rest
        return lines, too_long


class VerlFileFollower:
    def __init__(self, path: str, store: TrainingStore, self_metrics: SelfMetrics,
                 poll_interval: float = DEFAULT_POLL_S, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 recover_bytes: int = DEFAULT_RECOVER_BYTES, clock: Callable[[], float] = time.time,
                 chunk_bytes: int = _CHUNK):
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
        self._chunk = chunk_bytes
        self._head = b""
        self._mark = b""  # the last bytes read, up to _MARK: they must still be there, before our offset
        self._lines = LineSplitter(max_line_bytes)
        self._first_open = True
        self._state = "waiting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Set once the first poll is done: a restarted sidecar has then recovered the latest values and the
        # NaN count, and may serve (serving before would show a NaN counter that went back to nothing).
        self.recovered = threading.Event()
        self._self.set(SOURCE_UP, 1, source=SOURCE)
        self._self.inc(LINES_PARSED, 0, source=SOURCE)

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
        self._self.set(SOURCE_UP, 0, source=SOURCE)
        self._self.problem(COMPONENT, kind, message)

    def _ok(self, state: str = "ok") -> None:
        self._state = state
        self._self.set(SOURCE_UP, 1, source=SOURCE)

    # ------------------------------------------------------------------ one poll
    def poll(self) -> None:
        """Read whatever is new. Called every poll_interval by the thread; tests call it directly."""
        failure = None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._fd is not None:  # rotated away: finish what the old file holds, then wait
                with contextlib.suppress(OSError):
                    self._finish()
                self._close()
            self._ok("waiting")
            return
        except OSError as e:  # logged below, outside this block: one line, not a traceback
            failure = f"cannot stat {self.path}: {e.strerror}"
        if failure:
            self._fail("stat", failure)
            return
        if not stat.S_ISREG(st.st_mode):
            self._close()
            self._fail("not_a_file", f"{self.path} is not a regular file")
            return
        try:
            self._follow(st)
        except OSError as e:  # e.g. an NFS hiccup: drop the handle, reopen on the next poll
            self._close()
            failure = f"cannot read {self.path}: {e.strerror}"
        if failure:
            self._fail("read", failure)
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
        self._check_truncated(os.fstat(self._open_fd()).st_size)
        self._read_available()

    def _check_truncated(self, size: int) -> None:
        if size < self._offset or not self._same_head(size) or not self._same_mark():
            self._reset("truncated")

    def _open(self, ident: tuple[int, int], size: int) -> None:
        self._fd = os.open(self.path, os.O_RDONLY)
        self._ident = ident
        self._offset = 0
        self._lines.reset()
        self._head = os.pread(self._fd, _HEAD, 0)
        if self._first_open and size > self._recover:
            # Sidecar restart on a long run: only the tail matters for the latest values.
            self._offset, skipping = self._tail_start(size - self._recover, size)
            self._lines.reset(skipping)
        self._mark = os.pread(self._fd, min(_MARK, self._offset), self._offset - min(_MARK, self._offset))
        self._store.reset_nonfinite()  # the count is per file: a restart rebuilds the same number
        if self._offset:
            self._count_nonfinite_before(self._offset)

    def _tail_start(self, start: int, size: int) -> tuple[int, bool]:
        """Where the recovered tail starts: after the first newline from start on, or (no newline there)
        inside a line already too long, skipped to its end; a partial last line short enough is read whole.
        The lines before it are the recount's, so that both together read the file as a live follower."""
        window = os.pread(self._open_fd(), self._max_line + 1, start - 1)
        nl = window.find(b"\n")
        if nl >= 0:
            return start + nl, False
        if start - 1 + len(window) >= size:  # the partial last line: how long is it so far?
            before = max(0, start - 1 - self._max_line)
            line_start = before + os.pread(self._open_fd(), start - 1 - before, before).rfind(b"\n") + 1
            if (line_start > before or before == 0) and size - line_start <= self._max_line:
                return line_start, False
        return start, True

    def _open_fd(self) -> int:
        """The followed file's descriptor, in the methods that run while it is open."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not open")
        return self._fd

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
        current = os.pread(self._open_fd(), _HEAD, 0)
        if not current.startswith(self._head):
            return False
        self._head = current  # grows to _HEAD bytes as the first line is written
        return True

    def _same_mark(self) -> bool:
        """False when the bytes just before our offset are not the ones we read there: the file was rewritten
        with a start like the old one's (a resumed run's first line may be) and regrew past our offset."""
        if self._offset <= _HEAD:  # the head covers them
            return True
        return os.pread(self._open_fd(), len(self._mark), self._offset - len(self._mark)) == self._mark

    def _count_nonfinite_before(self, end: int) -> None:
        """Count the NaNs of the lines before the recovered tail, as the live follower counted them: the same
        splitter and parser; lines that cannot hold a NaN are not parsed (the bulk of a restart's time)."""
        lines = LineSplitter(self._max_line)
        offset = 0
        while offset < end:
            chunk = os.pread(self._open_fd(), min(self._chunk, end - offset), offset)
            if not chunk:
                return
            offset += len(chunk)
            for line in filter(may_be_nonfinite, lines.feed(chunk)[0]):
                obj = parse_line(line)
                if isinstance(obj, Mapping):  # a rejected line was counted as such when it was written
                    self._store.count_nonfinite(obj["data"])

    def _reset(self, reason: str) -> None:
        self._self.inc(SOURCE_RESETS, reason=reason)
        self._store.reset_nonfinite()
        self._offset = 0
        self._mark = b""
        self._lines.reset()
        if self._fd is not None:
            self._head = os.pread(self._fd, _HEAD, 0)

    def _read_available(self, seen_at: float | None = None) -> None:
        if self._fd is None:
            return
        while True:
            chunk = os.pread(self._fd, self._chunk, self._offset)
            if not chunk:
                return
            self._offset += len(chunk)
            self._mark = chunk[-_MARK:] if len(chunk) >= _MARK else (self._mark + chunk)[-_MARK:]
            lines, too_long = self._lines.feed(chunk)
            for _ in range(too_long):
                self._reject(Rejected("too_long", f"longer than {self._max_line} bytes"))
            for line in lines:
                self._line(line, seen_at)
            if len(chunk) < self._chunk:
                return

    # ------------------------------------------------------------------ lines
    def _line(self, line: bytes, seen_at: float | None) -> None:
        obj = parse_line(line)
        if obj is None:
            return
        if isinstance(obj, Rejected):
            self._reject(obj)
            return
        try:
            self._store.ingest(obj.get("step"), obj["data"], seen_at if seen_at is not None else self._clock())
        except Exception as e:  # a bug must cost this one line, not the rest of the read; its traceback is logged
            self._self.problem(COMPONENT, "ingest", f"could not ingest a line of {self.path}: {e!r}")
            bug = True
        else:
            bug = False
        if bug:
            self._reject(Rejected("unexpected", "could not ingest it (see the error logged)"))
            return
        self._self.inc(LINES_PARSED, source=SOURCE)

    def _reject(self, rejected: Rejected) -> None:
        """Count a bad line and log one line about it (never its content: it may hold anything)."""
        self._self.inc(LINES_REJECTED, source=SOURCE, reason=rejected.reason)
        self._self.problem(COMPONENT, rejected.reason,
                           f"rejected a line of {self.path}: {rejected.reason}: {rejected.detail}", count=False)
