"""Posting one message to a robot, and what its answer means.

A sender makes exactly one HTTP request per ``send`` and classifies the answer: delivered, worth retrying
(network errors, HTTP 5xx/429, the robots' "too fast" and "busy" codes), or not (a bad signature or keyword,
a body over the limit, an unknown token: sending it again cannot help); Lark gives its codes with HTTP 400
too. The retry loop itself lives with the delivery worker, which also owns the rate limit every attempt
counts against.

Nothing a sender returns or logs holds the token or the signing secret: every detail passes ``scrub``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.client
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, quote_plus, urlencode

from ..exposition.selfmetrics import one_line
from .config import TOKEN_PARAM, Target
from .nofollow import OPENER

# errcodes worth another try: the robot is busy or we were too fast; the message itself is fine.
RETRYABLE_ERRCODES = {
    "dingtalk": {130101: "sent too fast (over 20 messages a minute)", -1: "system busy"},
    "wecom": {45009: "rate limit (over 20 messages a minute)", 45033: "too many concurrent calls",
              -1: "system busy"},
    "lark": {11232: "frequency limited (over 100 messages a minute or 5 a second)"},
}
# errcodes that only a change of config or of the message can fix; named in the log.
KNOWN_ERRCODES = {
    "dingtalk": {310000: "keyword, signature or IP check failed (sign not match / keywords not in content)",
                 460101: "message too big (over 20,000 bytes)", 300001: "invalid access_token",
                 400013: "robot disabled", 410100: "robot sent too fast too long: blocked"},
    "wecom": {40058: "content too long", 93000: "invalid webhook key", 40008: "invalid message type",
              40035: "invalid parameter"},
    # Lark answers {"code": ..., "msg": ...}, with HTTP 200 or 400 (custom bot guide, "Common errors")
    "lark": {19021: "signature invalid, or the timestamp over an hour from the robot's clock",
             19022: "IP not allowed", 19024: "keyword not in the message", 9499: "bad request (body over 20 KB or "
             "malformed)", 19001: "invalid webhook token"},
}
RATE_LIMIT_ERRCODES = {"dingtalk": {130101}, "wecom": {45009}, "lark": {11232}}


def scrub(text: str, secrets: Iterable[str]) -> str:
    """text with every secret (raw or URL-encoded) replaced by <secret>."""
    for value in secrets:
        if not value:
            continue
        for form in {value, quote(value, safe=""), quote_plus(value)}:
            text = text.replace(form, "<secret>")
    return text


def dingtalk_sign(secret: str, timestamp_ms: int) -> str:
    """base64(HMAC-SHA256(key=secret, msg="<ts>\\n<secret>")), before URL encoding."""
    digest = hmac.new(secret.encode("utf-8"), f"{timestamp_ms}\n{secret}".encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def lark_sign(secret: str, timestamp_s: int) -> str:
    """base64(HMAC-SHA256(key="<ts>\\n<secret>", msg=b"")): Lark keys the HMAC with the string and signs
    nothing (https://open.feishu.cn/document/client-docs/bot-v3/add-custom-bot, "Signature verification")."""
    digest = hmac.new(f"{timestamp_s}\n{secret}".encode(), b"", hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def lark_signed(body: bytes, secret: str, timestamp_s: int) -> bytes:
    """The body with the timestamp (seconds) and signature Lark expects beside msg_type."""
    doc = {"timestamp": str(timestamp_s), "sign": lark_sign(secret, timestamp_s), **json.loads(body)}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class SendResult:
    ok: bool
    retryable: bool
    errcode: str  # "0", the robot's errcode, "http_<status>", "network" or "bad_response": a bounded label
    detail: str  # one scrubbed sentence for the log
    rate_limited: bool = False  # the robot says we were too fast: back off for a whole window


class Sender(Protocol):
    """Anything that can make one delivery attempt of a message body."""

    target: Target

    def send(self, body: bytes) -> SendResult: ...


class RobotSender:
    """One HTTP POST per call to a DingTalk, WeCom or Lark robot; never raises for network or HTTP errors."""

    def __init__(self, target: Target, timeout: float = 10.0, clock: Callable[[], float] = time.time):
        self.target = target
        self.timeout = timeout
        self.clock = clock
        self._secrets = target.secrets()

    def url(self) -> str:
        """The request URL: the token, and for a signed DingTalk robot a fresh timestamp and signature."""
        if self.target.type == "lark":  # the token is the webhook's last path segment
            return f"{self.target.url.rstrip('/')}/{quote(self.target.token.get_secret_value(), safe='')}"
        params = {TOKEN_PARAM[self.target.type]: self.target.token.get_secret_value()}
        if self.target.type == "dingtalk" and self.target.secret is not None:
            ts = int(self.clock() * 1000)
            params["timestamp"] = str(ts)
            params["sign"] = dingtalk_sign(self.target.secret.get_secret_value(), ts)
        sep = "&" if "?" in self.target.url else "?"
        return f"{self.target.url}{sep}{urlencode(params)}"

    def send(self, body: bytes) -> SendResult:
        if self.target.type == "lark" and self.target.secret is not None:  # Lark signs in the body
            body = lark_signed(body, self.target.secret.get_secret_value(), int(self.clock()))
        request = urllib.request.Request(self.url(), data=body, method="POST",
                                         headers={"Content-Type": "application/json; charset=utf-8"})
        try:
            with OPENER.open(request, timeout=self.timeout) as resp:
                status, raw = resp.status, resp.read(65536)
        except urllib.error.HTTPError as e:
            status, raw = e.code, b""
            if self.target.type == "lark" and e.code == 400:  # Lark's errors (the rate limit too) come as 400
                with contextlib.suppress(OSError, http.client.HTTPException):  # cut off: a plain HTTP 400
                    raw = e.read(65536)
            e.close()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout, dropped connection
            reason = getattr(e, "reason", None) or e
            return SendResult(False, True, "network", self._scrub(f"network error: {type(e).__name__}: {reason}"))
        if status >= 500 or status == 429:
            return SendResult(False, True, f"http_{status}", f"HTTP {status} from the robot")
        if status == 400 and raw:
            result = self._classify(raw)
            if result.errcode != "bad_response":
                return result
        if status >= 400:
            return SendResult(False, False, f"http_{status}", f"HTTP {status} from the robot")
        if status >= 300:  # the URL is wrong (or hijacked): never follow, never count as delivered
            return SendResult(False, False, f"http_{status}", f"HTTP {status} from the robot (redirect not followed)")
        return self._classify(raw)

    def _classify(self, raw: bytes) -> SendResult:
        """The robot's answer, outside input: JSON with an integer errcode (code for Lark), or a bad answer,
        retried as any other. An errcode the relay does not know is counted as "other" (a bounded label)."""
        kind = self.target.type
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, an int of 4,300+ digits, nested past the decoder
            doc = None
        if isinstance(doc, dict) and kind == "lark":  # {"code", "msg"}; older deployments {"StatusCode", ...}
            errcode, errmsg = doc.get("code", doc.get("StatusCode")), doc.get("msg", doc.get("StatusMessage", ""))
        elif isinstance(doc, dict):
            errcode, errmsg = doc.get("errcode"), doc.get("errmsg", "")
        else:
            errcode = errmsg = None
        # an errcode is a JSON integer: not a bool, a float (0.5 is no success, 1e999 no int), a string or null
        if isinstance(errcode, bool) or not isinstance(errcode, int) or abs(errcode) >= 2**63:
            return SendResult(False, True, "bad_response", "the robot's answer is not JSON with an integer errcode")
        if errcode == 0:
            return SendResult(True, False, "0", "ok")
        retryable = errcode in RETRYABLE_ERRCODES[kind]
        known = retryable or errcode in KNOWN_ERRCODES[kind]
        meaning = RETRYABLE_ERRCODES[kind].get(errcode) or KNOWN_ERRCODES[kind].get(errcode, "unknown errcode")
        said = one_line(errmsg if isinstance(errmsg, str) else json.dumps(errmsg)[:400], 200)
        return SendResult(False, retryable, str(errcode) if known else "other",
                          self._scrub(f"errcode {errcode} ({meaning}): {said}"),
                          rate_limited=errcode in RATE_LIMIT_ERRCODES[kind])

    def _scrub(self, text: str) -> str:
        return scrub(text, self._secrets)


class ConsoleSender:
    """A console target: writes each message as its robot would show it (or its exact body), sends nothing.

    ``write`` receives the finished text (one message, framed); by default it goes to the target's file, or
    to standard output. Formatting happened before, exactly as for the robot, so a preview is the real thing.
    """

    def __init__(self, target: Target, write: Callable[[str], None] | None = None, width: int | None = None):
        self.target = target
        self._write = write
        self._width = width

    def text(self, body: bytes) -> str:
        from . import terminal

        if self.target.show == "body":
            return body.decode("utf-8")
        return terminal.render(json.loads(body), self.target.robot, color=self._color(), width=self._width_now())

    def send(self, body: bytes) -> SendResult:
        try:
            text = self.text(body)
            if self._write is not None:
                self._write(text)
            elif self.target.file is not None:
                with open(self.target.file, "a", encoding="utf-8") as f:
                    f.write(text + "\n")
            else:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
        except (OSError, ValueError) as e:
            return SendResult(False, False, "console", f"cannot write the message: {type(e).__name__}: {e}")
        return SendResult(True, False, "0", "ok")

    def _color(self) -> bool:
        if self.target.color != "auto":
            return self.target.color == "always"
        if self._write is not None or self.target.file is not None or os.environ.get("NO_COLOR"):
            return False
        return sys.stdout.isatty()

    def _width_now(self) -> int:
        if self._width is not None:
            return self._width
        return min(shutil.get_terminal_size((100, 24)).columns, 120)


def make_sender(target: Target, timeout: float = 10.0) -> Sender:
    """The sender a target needs: HTTP to its robot, or the console."""
    return ConsoleSender(target) if target.type == "console" else RobotSender(target, timeout)
