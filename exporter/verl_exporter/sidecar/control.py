"""Automated response: requests to checkpoint or stop a run, from an alert (via the relay) or a person.

Off by default. When enabled with a token, the rank-0 sidecar (or an in-process Monitor) accepts
``POST /control/checkpoint`` and ``POST /control/stop`` with ``Authorization: Bearer <token>`` and records the
request in a small JSON control file. The training process reads that file at its step boundaries
(``Monitor.should_checkpoint()`` / ``should_stop()``, or the verl callback in ``verl_callback.py``):

    {"version": 2, "checkpoint_seq": 3, "checkpoint_id": "9f2c...", "checkpoint_time": 1796000000.0,
     "stop": true, "stop_seq": 1, "stop_id": "41ab...", "stop_time": 1796000100.0,
     "stop_reason": "VerlNonFiniteGradNorm", "reason": "VerlNonFiniteGradNorm"}

Every request gets a new id (and its action's seq goes up), a stop too: the file lives in the checkpoint
directory, which a resumed run keeps, so after run 1 was stopped it still says ``stop: true``; a stop asked of
run 2 must still be a new request. A reader remembers the ids in the file when it starts (requests made for an
earlier run) and acts once on every other id it sees; clocks play no part, so a sidecar on a host whose clock
is off neither stops a resumed run at its start nor goes unheard. (Only when the file cannot be read at the
reader's start does it fall back to the request times.) Every request is counted and logged.

The sidecar and the trainer often run as different users (the container image runs as uid 10001), so the
file is written world-readable by default (``--control-file-mode``, 0644): it holds no secret, only requests,
and only the token holder can make the sidecar write it (so the mode may never let others write it). The
sidecar does not know the trainer's uid; the mode says who the reader is: others (0644), the file's group
(0640) or the sidecar's own uid (0600). The folders it makes for the file let that reader pass (0755, 0750,
0700) whatever the umask, and it answers ``applied: true`` only when the file has that mode and every folder it
made still lets the reader pass; otherwise ``applied: false`` with why (the relay counts that as failed).
Folders it did not make belong to the trainer or the operator and are not judged, only warned about once.
A trainer that cannot read the file logs why, counts it, and tries again at every step, so a fixed
permission still delivers the request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..core.atomicfile import make_dirs, write_atomic
from ..core.auth import bearer_token_ok
from ..exposition.selfmetrics import SelfMetric, SelfMetrics

CONTROL_REQUESTS = SelfMetric("verl_exporter_control_requests_total")

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

    from ..exposition.app import Handler
    from .forensics import Forensics

log = logging.getLogger(__name__)

ACTIONS = ("checkpoint", "stop")
Doc = dict[str, Any]  # a control file's JSON document
Signature = tuple[int, int, int]  # (inode, mtime_ns, size) of a control file: changes with every write
MAX_BODY = 4096
CONTROL_FILE_NAME = ".verl-exporter-control.json"
DEFAULT_FILE_MODE = 0o644  # readable by a trainer running under another uid; see the module docstring
FORMAT_VERSION = 2  # 2: every request has an id (version 1 files, without ids, are still read)
MAX_FILE_BYTES = 65536  # the sidecar writes a few hundred bytes; anything bigger is not its file


def parse_file_mode(text: str | int) -> int:
    """An octal permission like "0640" or "640": the sidecar reads and writes it (u+rw), nobody else writes."""
    try:
        mode = text if isinstance(text, int) else int(str(text), 8)
    except ValueError:
        raise ValueError(f"not an octal file mode: {text!r} (for example 0644)") from None
    if not 0 <= mode <= 0o777 or not mode & 0o600 == 0o600:
        raise ValueError(f"file mode {text!r} must be within 0777 and let the owner read and write (0600)")
    if mode & 0o022:  # whoever could write the file could stop the run without the token
        raise ValueError(f"file mode {text!r} lets others write the control file; only the sidecar may (0644)")
    return mode


def folder_mode(file_mode: int) -> int:
    """The mode of a folder made for a file of file_mode: who may read the file may pass (r-x), none write."""
    readers = file_mode & 0o044
    return 0o700 | readers | readers >> 2


def _reader_of(file_mode: int) -> str:
    return "others" if file_mode & 0o004 else "group" if file_mode & 0o040 else "owner"


_WHO = {"others": "a trainer under another uid", "group": "a trainer in the file's group",
        "owner": "a trainer under this uid"}


def _passes(st: os.stat_result, reader: str, gid: int) -> bool:
    """Can a reader of that class pass through (search) a folder with this stat?"""
    if reader == "others":
        return bool(st.st_mode & 0o001)
    if reader == "group":
        return bool(st.st_mode & 0o001 or st.st_mode & 0o010 and st.st_gid == gid)
    return True  # the sidecar's own uid: it has just written the file there


def default_control_file(checkpoint_dir: str | None) -> str | None:
    return str(Path(checkpoint_dir) / CONTROL_FILE_NAME) if checkpoint_dir else None


def read_token(env: str | None = None, file: str | None = None) -> str | None:
    """The control token from an environment variable or a file; never logged."""
    if env:
        value = os.environ.get(env, "")
        if not value:
            raise ValueError(f"the control token variable {env} is not set or empty")
        return value
    if file:
        try:
            value = Path(file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ValueError(f"cannot read the control token file {file}: {e.strerror}") from None
        except UnicodeDecodeError:  # its message would quote a byte of the secret
            raise ValueError(f"the control token file {file} is not UTF-8 text") from None
        if not value:
            raise ValueError(f"the control token file {file} is empty")
        return value
    return None


def one_line(text: str, limit: int = 200) -> str:
    """The reason as one line of printable text: a newline in it would forge lines in the log."""
    return "".join(c if c.isprintable() else " " for c in text[:limit])


def read_control_file(path: Path) -> tuple[Signature, Doc]:
    """(signature, document) of a control file; raises OSError, ValueError or RecursionError."""
    # O_NONBLOCK: a FIFO put there must not block the trainer's step (or the sidecar) in open()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file")
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"over {MAX_FILE_BYTES} bytes, not a control file")
    doc = json.loads(raw)
    # Every write is a new file renamed into place: a new inode even when two writes share an mtime tick
    # (coarse timestamps on NFS), so the signature changes with every request.
    return (st.st_ino, st.st_mtime_ns, st.st_size), doc if isinstance(doc, dict) else {}


class Recorded(NamedTuple):
    state: Doc  # the control file as written
    applied: bool  # written, and readable by the reader the file mode names
    problem: str  # why not applied ("" when applied)
    id: str  # the request's id


class ControlState:
    """The writer side: applies requests to the control file, atomically (write a temp file, rename)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time, mode: int = DEFAULT_FILE_MODE):
        self.path = Path(path)
        self.mode = parse_file_mode(mode)
        self._clock = clock
        self._lock = threading.Lock()
        self._made: list[Path] = []  # folders this sidecar made for the file
        self._warned = False

    def read(self) -> Doc:
        try:
            return read_control_file(self.path)[1]
        except (OSError, ValueError, RecursionError):  # unreadable or not ours: start again from scratch
            return {}

    def request(self, action: str, reason: str = "") -> Recorded:
        """Record one request under a new id; every request is new, a repeated stop too (see the docstring)."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}")
        with self._lock:
            state = {"checkpoint_seq": 0, "stop": False, **self.read(), "version": FORMAT_VERSION}
            request_id = uuid.uuid4().hex
            state[f"{action}_seq"] = _int(state.get(f"{action}_seq")) + 1
            state[f"{action}_id"] = request_id
            state[f"{action}_time"] = self._clock()
            state[f"{action}_reason"] = state["reason"] = one_line(reason)
            if action == "stop":
                state["stop"] = True
            self._write(state)
            problem = self._unreachable()
            return Recorded(state, not problem, problem, request_id)

    def _write(self, state: Doc) -> None:
        self._made += make_dirs(self.path.parent, folder_mode(self.mode))
        write_atomic(self.path, json.dumps(state, sort_keys=True), mode=self.mode)

    def _unreachable(self) -> str:
        """Why the reader the mode names cannot read the file just written; "" when it can."""
        reader = _reader_of(self.mode)
        st = os.stat(self.path)
        if st.st_mode & 0o777 != self.mode:  # a file system that ignores chmod (some network mounts)
            return (f"the control file {self.path} has mode {oct(st.st_mode & 0o777)}, not {oct(self.mode)} (does "
                    f"this file system ignore chmod?): {_WHO[reader]} may not read it")
        for folder in self._made:
            if not _passes(os.stat(folder), reader, st.st_gid):
                return (f"the folder {folder}, made for the control file, has mode "
                        f"{oct(os.stat(folder).st_mode & 0o777)}: {_WHO[reader]} cannot pass it; make it "
                        f"{oct(folder_mode(self.mode))}")
        self._warn_about_others_folders(reader, st.st_gid)
        return ""

    def _warn_about_others_folders(self, reader: str, gid: int) -> None:
        """A folder it did not make (an older sidecar's, the trainer's) may still keep the reader out: say so once.

        Not a reason to answer "not applied": its owner may be the trainer, which passes whatever the mode.
        """
        if reader == "owner" or self._warned:
            return
        for folder in Path(os.path.abspath(self.path)).parents:
            with contextlib.suppress(OSError):
                st = os.stat(folder)
                if folder not in self._made and st.st_uid == os.geteuid() and not _passes(st, reader, gid):
                    self._warned = True
                    log.warning("control: %s (owned by this sidecar's uid) has mode %s: %s cannot reach %s; "
                                "open it (%s), or use --control-file-mode 0600 when the trainer runs as this uid",
                                folder, oct(st.st_mode & 0o777), _WHO[reader], self.path,
                                "o+x" if reader == "others" else "g+x, with the file's group")
                    return


def _int(value: Any) -> int:
    try:
        return max(int(value), 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def _identity(doc: Doc, action: str) -> str | None:
    """The id of the latest request of action in a control file; None when there was none.

    A version 1 file (an older sidecar) has no ids: its seq and time stand for one.
    """
    ident = doc.get(f"{action}_id")
    if ident is not None:
        return str(ident)[:64]
    if action == "checkpoint":
        seq = _int(doc.get("checkpoint_seq"))
        return f"v1:{seq}@{doc.get('checkpoint_time')}" if seq else None
    return f"v1@{doc.get('stop_time')}" if doc.get("stop") else None


def _request_time(doc: Doc, action: str) -> float:
    try:
        return float(doc.get(f"{action}_time") or 0)
    except (TypeError, ValueError, OverflowError):
        return 0.0


class ControlReader:
    """The training side: cheap to ask every step (a stat, a read only when the file changed).

    The requests in the file when the reader starts were made for an earlier run: it acts once on each
    request id it has not seen (see the module docstring). Start it before the run's first step.

    A file it cannot read (permissions, a broken mount) is counted in ``read_failures``, logged (the first
    time with what to do, later ones at most every ten minutes) and retried at the next poll; ``on_error``,
    when given, is called with the message (the Monitor counts it in its self-metrics).
    """

    LOG_EVERY_S = 600.0

    def __init__(self, path: str, clock: Callable[[], float] = time.time,
                 on_error: Callable[[str], None] | None = None):
        self.path = Path(path)
        self._clock = clock
        self._started = clock()
        self._seen_file: Signature | None = None
        self._pending_checkpoint = False
        self._stop = False
        self.reason = ""
        self.read_failures = 0
        self._on_error = on_error
        self._last_logged: float | None = None
        # action -> id of the last request seen; None until the file was read (at the start, or later)
        self._seen: dict[str, str | None] | None = None
        try:
            signature, doc = read_control_file(self.path)
        except FileNotFoundError:
            self._seen = dict.fromkeys(ACTIONS)  # no file: every request to come is new
        except (OSError, ValueError, RecursionError):
            pass  # judged at the first poll that can read it (and counted there)
        else:
            self._seen_file = signature
            self._seen = {a: _identity(doc, a) for a in ACTIONS}

    def poll(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return  # no request yet
        except OSError as e:
            self._failed(e)
            return
        if (st.st_ino, st.st_mtime_ns, st.st_size) == self._seen_file:
            return
        try:
            signature, doc = read_control_file(self.path)
        except FileNotFoundError:
            return  # removed since the stat
        except (OSError, ValueError, RecursionError) as e:
            self._failed(e)  # not remembered as seen: the next poll reads it again
            return
        self._seen_file = signature
        if self._seen is None:
            # Unreadable when this reader started: the request times are all there is to tell this run's from
            # an earlier one's.
            self._seen = {a: _identity(doc, a) if _request_time(doc, a) < self._started else None for a in ACTIONS}
        for action in ACTIONS:
            ident = _identity(doc, action)
            if ident is None or ident == self._seen[action]:
                continue
            self._seen[action] = ident
            if action == "checkpoint":
                self._pending_checkpoint = True
            elif self._stop:
                continue  # already stopping: the first stop's reason stays
            else:
                self._stop = True
            self.reason = one_line(str(doc.get(f"{action}_reason", doc.get("reason", ""))))

    def _failed(self, error: Exception) -> None:
        self.read_failures += 1
        if isinstance(error, PermissionError):
            why = ("permission denied: the sidecar writes it as another user; give the trainer read access "
                   "(--control-file-mode, a shared group, or a control directory both can use)")
        else:
            why = getattr(error, "strerror", None) or type(error).__name__
        message = f"cannot read the control file {self.path}: {why}; checkpoint/stop requests are not seen"
        now = self._clock()
        if self._last_logged is None or now - self._last_logged >= self.LOG_EVERY_S:
            first = self._last_logged is None  # the traceback once; repeats are one line
            self._last_logged = now
            log.warning("verl-exporter: %s (%d failed reads so far)", message, self.read_failures,
                        exc_info=error if first else None)
        if self._on_error is not None:
            with contextlib.suppress(Exception):  # a counter must never break the trainer's step
                self._on_error(message)

    def take_checkpoint_request(self) -> bool:
        """True once per checkpoint request (edge-triggered; requests between two takes count as one)."""
        pending, self._pending_checkpoint = self._pending_checkpoint, False
        return pending

    @property
    def stop_requested(self) -> bool:
        return self._stop


PATH_PREFIX = "/control/"  # served outside the /metrics slots (core/httpserver.py slow_paths): captures take long
FORENSICS = "forensics"  # not a request for the trainer: the sidecar captures stacks itself (sidecar/forensics.py)


def make_control_app(state: ControlState, token: str, self_metrics: SelfMetrics,
                     forensics: Forensics | None = None) -> Handler:
    """WSGI handler for /control/<action>; returns None for paths it does not own. ``forensics``: the
    sidecar's Forensics when --forensics-dir is set (POST /control/forensics captures stacks now)."""
    known = (*ACTIONS, FORENSICS)

    def handle(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes] | None:
        path = environ.get("PATH_INFO", "")
        if not path.startswith(PATH_PREFIX):
            return None
        action = path[len(PATH_PREFIX):]

        def reply(code: str, body: dict[str, Any], result: str,
                  extra_headers: Sequence[tuple[str, str]] = ()) -> list[bytes]:
            self_metrics.inc(CONTROL_REQUESTS, action=action if action in known else "other",
                             result=result)
            data = json.dumps(body).encode()
            start_response(code, [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                                  *extra_headers])
            return [data]

        if environ.get("REQUEST_METHOD") != "POST":
            return reply("405 Method Not Allowed", {"error": "use POST"}, "bad_request", [("Allow", "POST")])
        if action not in known:
            return reply("404 Not Found", {"error": f"unknown action; use one of {list(known)}"}, "bad_request")
        if not bearer_token_ok(environ.get("HTTP_AUTHORIZATION"), token):
            return reply("401 Unauthorized", {"error": "missing or wrong bearer token"}, "unauthorized")
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            return reply("413 Payload Too Large", {"error": f"body over {MAX_BODY} bytes"}, "bad_request")
        reason = ""
        if length:
            try:
                body = json.loads(environ["wsgi.input"].read(length) or b"{}")
                reason = one_line(str(body.get("reason", ""))) if isinstance(body, dict) else ""
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
                return reply("400 Bad Request", {"error": "the body must be JSON"}, "bad_request")
            except TimeoutError:  # the client stopped sending its body
                return reply("408 Request Timeout", {"error": "the body did not arrive in time"}, "bad_request")
        if action == FORENSICS:
            if forensics is None:
                return reply("404 Not Found", {"error": "stack capture is off on this sidecar (--forensics-dir)"},
                             "bad_request")
            doc = forensics.requested(reason)
            answer = {"action": action, "applied": doc["path"] is not None, "path": doc["path"],
                      "verdict": doc["verdict"], "processes": len(doc["processes"])}
            if doc["path"] is None:
                return reply("200 OK", {**answer, "error": "the capture could not be written"}, "failed")
            return reply("200 OK", answer, "accepted")
        try:
            recorded = state.request(action, reason)
        except OSError as e:
            return reply("503 Service Unavailable", {"error": f"cannot write the control file: {e.strerror}"},
                         "failed")
        answer = {"action": action, "applied": recorded.applied, "id": recorded.id, "state": recorded.state}
        if not recorded.applied:
            # 200: recorded, and asking again would not help; the relay counts applied: false as failed
            self_metrics.problem("control", "unreachable", f"{action} requested but not applied: {recorded.problem}")
            return reply("200 OK", {**answer, "error": recorded.problem}, "unreachable")
        log.warning("control: %s requested%s (applied), request %s", action, f" because {reason}" if reason else "",
                    recorded.id)
        return reply("200 OK", answer, "accepted")

    return handle
