"""Loopback stand-ins for the DingTalk, WeCom and Feishu/Lark group robot APIs, strict where the real ones are.

DingTalk: access_token, signature (HMAC-SHA256 of "<ts>\\n<secret>") and a timestamp within one hour
(errcode 310000 otherwise), at most `limit` messages per `window` seconds (130101 beyond), a body of at most
20,000 bytes (460101). WeCom: the key (93000), content of at most 4096 bytes (markdown) / 2048 (text)
(40058), `limit` per `window` (45009). Both record what they accept and can be told to answer the next N
requests with HTTP 500 or by dropping the connection. Lark: the token as the webhook's last path segment,
the signature in the body (HMAC-SHA256 keyed by "<ts>\\n<secret>" over nothing, the timestamp in seconds
within one hour: code 19021), a body of at most 20 KB (9499), `limit` per `window` (11232, with HTTP 400
as Lark answers it); it answers {"code", "msg"}. `window` is configurable so tests need not wait a
real minute.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class FakeRobot:
    path = "/"
    rate_errcode = 0

    def __init__(self, limit: int = 20, window: float = 60.0, clock=time.time):
        self.limit, self.window, self.clock = limit, window, clock
        self.messages: list[dict] = []  # accepted payloads, in order
        self.accepted_times: list[float] = []  # clock() of each accepted message
        self.requests: list[dict] = []  # every request: {"query", "body", "errcode" or "http"}
        self.rate_rejections = 0
        self.delay = 0.0  # seconds to sit on each request before answering (a slow robot)
        self.arrived = 0  # requests received, counted before the delay
        self._accepted_at: deque[float] = deque()
        self._faults: deque[str] = deque()
        self._lock = threading.Lock()
        robot = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with robot._lock:
                    robot.arrived += 1
                if robot.delay:
                    time.sleep(robot.delay)
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                with robot._lock:
                    fault = robot._faults.popleft() if robot._faults else None
                    record = {"path": parts.path, "query": query, "body": body}
                    robot.requests.append(record)
                    if fault == "drop":
                        record["http"] = "dropped"
                        self.close_connection = True
                        return
                    if fault == "500":
                        record["http"] = 500
                        status, answer = 500, {"errmsg": "internal error"}
                    elif parts.path != robot.path:
                        record["http"] = 404
                        status, answer = 404, {"errmsg": "not found"}
                    else:
                        errcode, errmsg = robot.check(query, body)
                        record["errcode"] = errcode
                        status, answer = robot.answer(errcode, errmsg)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}{self.path}"

    def start(self) -> FakeRobot:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def heal(self) -> None:
        """Forget the faults still pending."""
        with self._lock:
            self._faults.clear()

    def fail_next(self, n: int, mode: str = "500") -> None:
        """The next n requests get HTTP 500 ("500") or a closed connection without an answer ("drop")."""
        assert mode in ("500", "drop")
        with self._lock:
            self._faults.extend([mode] * n)

    def _rate_ok(self) -> bool:
        now = self.clock()
        while self._accepted_at and self._accepted_at[0] <= now - self.window:
            self._accepted_at.popleft()
        if len(self._accepted_at) >= self.limit:
            self.rate_rejections += 1
            return False
        return True

    def _accept(self, payload: dict) -> tuple[int, str]:
        self._accepted_at.append(self.clock())
        self.accepted_times.append(self.clock())
        self.messages.append(payload)
        return 0, "ok"

    def check(self, query: dict, body: bytes) -> tuple[int, str]:
        raise NotImplementedError

    def answer(self, errcode: int, errmsg: str) -> tuple[int, dict]:
        return 200, {"errcode": errcode, "errmsg": errmsg}

    def errcodes(self) -> list:
        with self._lock:
            return [r.get("errcode", r.get("http")) for r in self.requests]


def dingtalk_sign(secret: str, timestamp_ms: str) -> str:
    digest = hmac.new(secret.encode(), f"{timestamp_ms}\n{secret}".encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


class FakeDingTalk(FakeRobot):
    path = "/robot/send"

    def __init__(self, token: str, secret: str | None = None, max_body: int = 20000, keywords=(), **kw):
        super().__init__(**kw)
        self.token, self.secret, self.max_body, self.keywords = token, secret, max_body, tuple(keywords)

    def check(self, query: dict, body: bytes) -> tuple[int, str]:
        if query.get("access_token") != self.token:
            return 300001, "token is not exist"
        if self.secret is not None:
            ts, sign = query.get("timestamp", ""), query.get("sign", "")
            if not ts.isdigit() or abs(self.clock() * 1000 - int(ts)) > 3600 * 1000:
                return 310000, "timestamp is out of date or invalid"
            if not hmac.compare_digest(sign, dingtalk_sign(self.secret, ts)):
                return 310000, "sign not match"
        if len(body) > self.max_body:
            return 460101, "message too big"
        try:
            payload = json.loads(body)
            kind = payload["msgtype"]
            inner = payload[kind]
            text = inner["text"] if kind == "markdown" else inner["content"]
            if kind == "markdown" and not inner["title"]:
                raise KeyError("title")
        except (ValueError, KeyError, TypeError):
            return 40035, "invalid parameter"
        if self.keywords and not any(k in text for k in self.keywords):
            return 310000, "keywords not in content"
        if not self._rate_ok():
            return 130101, "send too fast, exceed 20 times per minute"
        return self._accept(payload)


class FakeWeCom(FakeRobot):
    path = "/cgi-bin/webhook/send"
    LIMITS = {"markdown": 4096, "text": 2048}

    def __init__(self, key: str, **kw):
        super().__init__(**kw)
        self.key = key

    def check(self, query: dict, body: bytes) -> tuple[int, str]:
        if query.get("key") != self.key:
            return 93000, "invalid webhook url"
        try:
            payload = json.loads(body)
            kind = payload["msgtype"]
            content = payload[kind]["content"]
            limit = self.LIMITS[kind]
        except (ValueError, KeyError, TypeError):
            return 40035, "invalid parameter"
        if len(content.encode("utf-8")) > limit:
            return 40058, f"content exceed max length {limit}"
        if not self._rate_ok():
            return 45009, "api freq out of limit"
        return self._accept(payload)


def lark_sign(secret: str, timestamp_s: str) -> str:
    return base64.b64encode(hmac.new(f"{timestamp_s}\n{secret}".encode(), b"", hashlib.sha256).digest()).decode()


class FakeLark(FakeRobot):
    HOOK = "/open-apis/bot/v2/hook"

    def __init__(self, token: str, secret: str | None = None, max_body: int = 20 * 1024, **kw):
        super().__init__(**kw)
        self.token, self.secret, self.max_body = token, secret, max_body
        self.path = f"{self.HOOK}/{token}"

    @property
    def hook(self) -> str:
        """The webhook without its token, as a target's `url`."""
        return self.url.removesuffix(f"/{self.token}")

    def answer(self, errcode: int, errmsg: str) -> tuple[int, dict]:
        return (200 if errcode in (0, 19021, 19024) else 400), {"code": errcode, "msg": errmsg, "data": {}}

    def check(self, query: dict, body: bytes) -> tuple[int, str]:
        if len(body) > self.max_body:
            return 9499, "Bad Request"
        try:
            payload = json.loads(body)
            kind = payload["msg_type"]
            if kind == "interactive":
                card = payload["card"]
                text = "\n".join(e["content"] for e in card["elements"])
                if not card["header"]["title"]["content"]:
                    raise KeyError("title")
            else:
                text = payload["content"]["text"]
            assert isinstance(text, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            return 9499, "Bad Request"
        if self.secret is not None:
            ts, sign = str(payload.get("timestamp", "")), str(payload.get("sign", ""))
            if not ts.isdigit() or abs(self.clock() - int(ts)) > 3600:
                return 19021, "sign match fail or timestamp is not within one hour from current time"
            if not hmac.compare_digest(sign, lark_sign(self.secret, ts)):
                return 19021, "sign match fail or timestamp is not within one hour from current time"
        if not self._rate_ok():
            return 11232, "frequency limited psm"
        payload.pop("timestamp", None)
        payload.pop("sign", None)
        return self._accept(payload)
