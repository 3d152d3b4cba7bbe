"""The relay's web side: the Alertmanager webhook, /healthz and /metrics; and the Relay that runs it all.

POST /alert/<receiver> answers fast and never waits on a robot: the alerts are queued, then 200.
  401 bearer token required and missing/wrong   413 body over max_body_bytes
  400 not a webhook payload (the message says what is wrong)   404 no route knows this receiver
  503 queue full or shutting down: Alertmanager retries the notification
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..core.auth import bearer_token_ok
from ..core.httpserver import HttpServer
from ..exposition.app import method_not_allowed, metrics_app
from ..exposition.selfmetrics import SelfMetric
from .actions import ActionRunner, evidence_alert
from .config import RelayConfig
from .dispatch import Dispatcher, Draining, QueueFull
from .metrics import RelayMetrics
from .payload import Alert, PayloadError, WebhookPayload, parse_payload
from .senders import Sender, scrub

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

Json = dict[str, Any]  # an answer's JSON body

REQUESTS = SelfMetric("verl_relay_requests_total")
TRUNCATED_ALERTS = SelfMetric("verl_relay_truncated_alerts_total")
REPAIRED_VALUES = SelfMetric("verl_relay_repaired_values_total")
REJECTED_PAYLOADS = SelfMetric("verl_relay_rejected_payloads_total")

log = logging.getLogger(__name__)

_PATH_RE = re.compile(r"^/alert/([A-Za-z0-9][A-Za-z0-9_.-]{0,127})/?$")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class RelayApp:
    """A WSGI app; knows the config (auth, limits, routes), the dispatcher and the metrics."""

    def __init__(self, config: RelayConfig, dispatcher: Dispatcher, metrics: RelayMetrics,
                 actions: ActionRunner | None = None):
        self.config = config
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.actions = actions
        self.draining = False
        self._metrics_app = metrics_app(metrics.registry())
        # Called with (receiver, payload) for each valid webhook before it is queued (the demo prints them).
        self.on_webhook: Callable[[str, WebhookPayload], None] | None = None

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/healthz":
            return method_not_allowed(environ, start_response) or self._health(start_response)
        if not path.startswith("/alert/"):
            return _json(start_response, 404, {"error": "not found: POST /alert/<receiver>, GET /metrics, /healthz"})
        code, body = self._webhook(environ, path, method)
        return _json(start_response, code, body, [("Allow", "POST")] if code == 405 else [])

    def _webhook(self, environ: WSGIEnvironment, path: str, method: str) -> tuple[int, Json]:
        m = _PATH_RE.match(path)
        receiver = m.group(1) if m else ""
        known = bool(receiver) and self.config.knows_receiver(receiver)
        label = self.metrics.receiver_label(receiver) if known else "unknown"
        try:
            code, body = self._handle(environ, receiver, known, method)
        except TimeoutError:  # the client stopped sending its body: a slow client, not a bug of the relay
            code, body = 408, {"error": "the body did not arrive in time"}
        except Exception:  # a bug must cost this request, counted and logged, not the caller's connection
            log.exception("webhook %s: internal error", label)
            code, body = 500, {"error": "internal error of the relay (logged)"}
        self.metrics.inc(REQUESTS, receiver=label, code=str(code))
        if code >= 400 and code != 503:
            detail = "; ".join(body.get("problems", [])[:3])
            log.warning("webhook %s: %d %s%s", label, code, body.get("error", ""), f": {detail}" if detail else "")
        return code, body

    def _handle(self, environ: WSGIEnvironment, receiver: str, known: bool, method: str) -> tuple[int, Json]:
        if method != "POST":
            return 405, {"error": "use POST"}
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            self._rejected("bad_length")
            return 400, {"error": "bad Content-Length"}
        if not self._authorized(environ):
            _discard(environ, length, self.config.max_body_bytes)
            return 401, {"error": "missing or wrong bearer token"}
        if not known:
            _discard(environ, length, self.config.max_body_bytes)
            return 404, {"error": "no route of the relay config takes this receiver"}
        if length > self.config.max_body_bytes:
            _discard(environ, length, 16 * self.config.max_body_bytes)
            self._rejected("too_large")
            return 413, {"error": f"body of {length} bytes is over max_body_bytes ({self.config.max_body_bytes})"}
        body = environ["wsgi.input"].read(length) if length > 0 else b""
        try:
            payload = parse_payload(body)
        except PayloadError as e:
            self._rejected(e.reason)
            return 400, {"error": "not an Alertmanager webhook payload (version 4)", "problems": e.problems}
        if self.draining:
            return 503, {"error": "the relay is shutting down; retry"}
        if payload.truncated_alerts:
            log.warning("webhook %s: Alertmanager truncated %d alert(s) of this group (max_alerts)", receiver,
                        payload.truncated_alerts)
            self.metrics.inc(TRUNCATED_ALERTS, payload.truncated_alerts,
                             receiver=self.metrics.receiver_label(receiver))
        if self.on_webhook is not None:
            try:
                self.on_webhook(receiver, payload)
            except Exception:  # an observer must never cost Alertmanager its answer
                log.exception("webhook %s: the on_webhook observer failed", receiver)
        if self.actions is not None:
            self.actions.consider(payload.alerts, receiver)
        try:
            queued = self.dispatcher.submit(receiver, list(payload.alerts), payload.truncated_alerts)
        except QueueFull as e:
            log.warning("webhook %s: the queue of target %s is full; answered 503 so Alertmanager retries",
                        receiver, e)
            return 503, {"error": f"the queue of target {e} is full; retry"}
        except Draining:
            return 503, {"error": "the relay is shutting down; retry"}
        if payload.repairs:  # values no message could show, repaired: every alert is still delivered
            for r in payload.repairs:
                self.metrics.inc(REPAIRED_VALUES, reason=r.reason)
            log.warning("webhook %s: %d value(s) repaired so that the alerts can be delivered: %s", receiver,
                        len(payload.repairs), "; ".join(map(str, payload.repairs[:3]))[:600])
        return 200, {"status": "queued", "alerts": len(payload.alerts), "targets": queued}

    def _rejected(self, reason: str) -> None:
        self.metrics.inc(REJECTED_PAYLOADS, reason=reason)

    def _authorized(self, environ: WSGIEnvironment) -> bool:
        token = self.config.bearer_token
        if token is None:
            return True
        return bearer_token_ok(environ.get("HTTP_AUTHORIZATION"), token.get_secret_value())

    def _health(self, start_response: StartResponse) -> list[bytes]:
        targets: dict[str, Json] = {}
        for name, w in self.dispatcher.workers.items():
            depth, oldest = w.state()
            targets[name] = {"type": w.target.type, "queue_depth": depth, "oldest_queued_seconds": round(oldest, 3),
                             "last_success_unix": w.last_success}
        healthy = not self.draining
        return _json(start_response, 200 if healthy else 503,
                     {"status": "ok" if healthy else "draining", "targets": targets})


def _discard(environ: WSGIEnvironment, length: int, cap: int) -> None:
    """Read (and drop) a refused body, up to cap, so the client can read our answer instead of a reset."""
    left = min(length, cap)
    stream = environ["wsgi.input"]
    with contextlib.suppress(TimeoutError):  # a client that stalls still gets the refusal
        while left > 0:
            chunk = stream.read(min(left, 65536))
            if not chunk:
                break
            left -= len(chunk)


def _json(start_response: StartResponse, code: int, body: Json,
          extra_headers: Sequence[tuple[str, str]] = ()) -> list[bytes]:
    data = json.dumps(body, sort_keys=True).encode()
    start_response(f"{code} {_REASONS.get(code, '')}",
                   [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *extra_headers])
    return [data]


def relay_loggers() -> list[logging.Logger]:
    """The relay package's logger and every relay module's own (getLogger(__name__)), also of the modules that
    have not logged yet: a logger's filter does not see what its children log, so the scrub filter goes on
    each of them."""
    package = __name__.rpartition(".")[0]
    names = {n for n in [*sys.modules, *logging.Logger.manager.loggerDict]
             if n == package or n.startswith(package + ".")}
    return [logging.getLogger(n) for n in sorted(names)]


class _ScrubFilter(logging.Filter):
    """Defence in depth: whatever reaches the relay's logger is scrubbed of every configured secret."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self._secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message, self._secrets)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:  # formatters reuse exc_text when it is set
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info), self._secrets)
        return True


class Relay:
    """The whole relay: spool reload, workers, HTTP server; stop() drains and spools."""

    def __init__(self, config: RelayConfig, listen: str | None = None, senders: dict[str, Sender] | None = None,
                 metrics: RelayMetrics | None = None):
        self.config = config
        self.metrics = metrics or RelayMetrics()
        self.dispatcher = Dispatcher(config, self.metrics, senders)
        self.actions = ActionRunner(config.actions, self.metrics, on_evidence=self._evidence)
        self.app = RelayApp(config, self.dispatcher, self.metrics, self.actions)
        self._listen = listen or config.listen
        self._filter = _ScrubFilter(config.secrets())
        self._scrubbed: list[logging.Logger] = []
        self._server: HttpServer | None = None
        self._stopped = threading.Event()

    def _evidence(self, receiver: str, alert: Alert, answer: Json) -> None:
        """Page a forensics action's answer: the verdict and where the dumps are, as an alert of its own."""
        try:
            self.dispatcher.submit(receiver, [evidence_alert(alert, answer, self.metrics.spec)])
        except (QueueFull, Draining) as e:
            log.warning("action: the forensics verdict for %s was not queued (%s)", alert.name[:100], e)

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return self._server.url

    def start(self) -> Relay:
        self._scrubbed = relay_loggers()  # every relay module is imported by now
        for logger in self._scrubbed:
            logger.addFilter(self._filter)
        self.dispatcher.load_spool()
        self.dispatcher.start()
        try:
            self._server = HttpServer(self.app, self._listen, on_problem=self._http_problem).start()
        except BaseException:
            # Nothing was accepted yet: what the spool held is spooled again, and spool_dir (its lock) is free
            # for the next try, in this process or another.
            self.dispatcher.spool(self.dispatcher.drain(0))
            for logger in self._scrubbed:
                logger.removeFilter(self._filter)
            raise
        log.info("relay listening on %s; targets: %s", self._server.url,
                 ", ".join(f"{n} ({t.type})" for n, t in self.config.targets.items()))
        return self

    def _http_problem(self, kind: str, message: str) -> None:
        """A connection the server dropped: counted as the answer a client would have had (408 or 503)."""
        code = {"timeout": "408", "overload": "503", "bad_request": "400"}.get(kind)
        if code is not None:
            self.metrics.inc(REQUESTS, receiver="unknown", code=code)
        log.debug("http: %s", message)

    def stop(self, drain_seconds: float | None = None) -> dict[str, int]:
        """Answer 503 to new webhooks, drain, spool the rest, stop serving. {target: alerts left over}."""
        if self._stopped.is_set():
            return {}
        self._stopped.set()
        self.app.draining = True
        seconds = self.config.delivery.drain_seconds if drain_seconds is None else drain_seconds
        left = self.dispatcher.drain(seconds)
        self.dispatcher.spool(left)
        if self._server is not None:
            self._server.stop()
        for logger in self._scrubbed:
            logger.removeFilter(self._filter)
        return {t: len(items) for t, items in left.items()}
