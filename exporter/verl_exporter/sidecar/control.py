"""Automated response: requests to checkpoint or stop a run, from an alert (via the relay) or a person.

Off by default. When enabled with a token, the rank-0 sidecar (or an in-process Monitor) accepts
``POST /control/checkpoint`` and ``POST /control/stop`` with ``Authorization: Bearer <token>`` and records the
request in a small JSON control file. The training process reads that file at its step boundaries
(``Monitor.should_checkpoint()`` / ``should_stop()``, or the verl callback in ``verl_callback.py``):

    {"version": 1, "checkpoint_seq": 3, "checkpoint_time": 1796000000.0,
     "stop": true, "stop_time": 1796000100.0, "reason": "VerlNonFiniteGradNorm"}

A reader ignores requests older than its own start, so a file left by a previous run never stops a new
one. A stop request is idempotent: asking again changes nothing. Every request is counted and logged.

The sidecar and the trainer often run as different users (the container image runs as uid 10001), so the
file is written world-readable by default (``--control-file-mode``, 0644): it holds no secret, only requests,
and only the token holder can make the sidecar write it. A trainer that cannot read it logs why, counts it,
and tries again at every step, so a fixed permission still delivers the request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

from ..core.atomicfile import write_atomic
from ..core.auth import bearer_token_ok

log = logging.getLogger(__name__)

ACTIONS = ("checkpoint", "stop")
MAX_BODY = 4096
CONTROL_FILE_NAME = ".verl-exporter-control.json"
DEFAULT_FILE_MODE = 0o644  # readable by a trainer running under another uid; see the module docstring


def parse_file_mode(text: str | int) -> int:
    """An octal permission like "0640" or "640" (the sidecar must be able to write the file: u+w)."""
    try:
        mode = text if isinstance(text, int) else int(str(text), 8)
    except ValueError:
        raise ValueError(f"not an octal file mode: {text!r} (for example 0644)") from None
    if not 0 <= mode <= 0o777 or not mode & 0o600 == 0o600:
        raise ValueError(f"file mode {text!r} must be within 0777 and let the owner read and write (0600)")
    return mode


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


class ControlState:
    """The writer side: applies requests to the control file, atomically (write a temp file, rename)."""

    def __init__(self, path: str, clock=time.time, mode: int = DEFAULT_FILE_MODE):
        self.path = Path(path)
        self.mode = mode
        self._clock = clock
        self._lock = threading.Lock()

    def read(self) -> dict:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}

    def request(self, action: str, reason: str = "") -> tuple[dict, bool]:
        """Apply one request; returns (new state, changed). A repeated stop does not change anything."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}")
        with self._lock:
            state = {"version": 1, "checkpoint_seq": 0, "stop": False, **self.read()}
            now = self._clock()
            if action == "checkpoint":
                state["checkpoint_seq"] = int(state.get("checkpoint_seq", 0)) + 1
                state["checkpoint_time"] = now
                changed = True
            else:
                changed = not state.get("stop")
                if changed:
                    state["stop"] = True
                    state["stop_time"] = now
            if changed:
                state["reason"] = one_line(reason)
                self._write(state)
            return state, changed

    def _write(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(state, sort_keys=True), mode=self.mode)


class ControlReader:
    """The training side: cheap to ask every step (a stat, a read only when the file changed).

    A file it cannot read (permissions, a broken mount) is counted in ``read_failures``, logged (the first
    time with what to do, later ones at most every ten minutes) and retried at the next poll; ``on_error``,
    when given, is called with the message (the Monitor counts it in its self-metrics).
    """

    LOG_EVERY_S = 600.0

    def __init__(self, path: str, clock=time.time, on_error=None):
        self.path = Path(path)
        self._clock = clock
        self._started = clock()
        self._seen_file: tuple | None = None
        self._seen_seq: int | None = None
        self._pending_checkpoints = 0
        self._stop = False
        self.reason = ""
        self.read_failures = 0
        self._on_error = on_error
        self._last_logged: float | None = None

    def poll(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return  # no request yet
        except OSError as e:
            self._failed(e)
            return
        # Every write is a new file renamed into place: a new inode even when two writes share an mtime tick
        # (coarse timestamps on NFS), so no request is missed.
        signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if signature == self._seen_file:
            return
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the trainer's step in read()
            self._failed(OSError(0, "not a regular file"))
            return
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            self._failed(e)  # not remembered as seen: the next poll reads it again
            return
        self._seen_file = signature
        if not isinstance(doc, dict):
            return
        seq = int(doc.get("checkpoint_seq", 0) or 0)
        if self._seen_seq is None:
            # First look: requests made before this process started belong to an earlier run.
            fresh = float(doc.get("checkpoint_time", 0) or 0) >= self._started
            self._seen_seq = seq - (1 if fresh and seq else 0)
        if seq > self._seen_seq:
            self._pending_checkpoints += seq - self._seen_seq
            self._seen_seq = seq
            self.reason = str(doc.get("reason", ""))
        if doc.get("stop") and float(doc.get("stop_time", 0) or 0) >= self._started and not self._stop:
            self._stop = True
            self.reason = str(doc.get("reason", ""))

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
        """True once per checkpoint request (edge-triggered)."""
        if self._pending_checkpoints:
            self._pending_checkpoints = 0
            return True
        return False

    @property
    def stop_requested(self) -> bool:
        return self._stop


def make_control_app(state: ControlState, token: str, self_metrics):
    """WSGI handler for /control/<action>; returns None for paths it does not own."""

    def handle(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/control/"):
            return None
        action = path[len("/control/"):]

        def reply(code: str, body: dict, result: str):
            self_metrics.inc("verl_exporter_control_requests_total", action=action if action in ACTIONS else "other",
                             result=result)
            data = json.dumps(body).encode()
            start_response(code, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
            return [data]

        if environ.get("REQUEST_METHOD") != "POST":
            return reply("405 Method Not Allowed", {"error": "use POST"}, "bad_request")
        if action not in ACTIONS:
            return reply("404 Not Found", {"error": f"unknown action; use one of {list(ACTIONS)}"}, "bad_request")
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
            except ValueError:
                return reply("400 Bad Request", {"error": "the body must be JSON"}, "bad_request")
        try:
            new_state, changed = state.request(action, reason)
        except OSError as e:
            return reply("503 Service Unavailable", {"error": f"cannot write the control file: {e.strerror}"},
                         "failed")
        log.warning("control: %s requested%s (%s)", action, f" because {reason}" if reason else "",
                    "applied" if changed else "already requested")
        return reply("200 OK", {"action": action, "applied": changed, "state": new_state},
                     "accepted" if changed else "repeated")

    return handle
