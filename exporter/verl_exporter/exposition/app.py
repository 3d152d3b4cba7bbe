"""The HTTP side: /metrics (Prometheus text or OpenMetrics, as the scraper asks), /healthz and /.

The app knows no metric names: it serves a registry, asks a health callback, and times each scrape. Each
family of /metrics is encoded on its own, so one that cannot be (a label value UTF-8 cannot encode) costs
only itself, counted, never the scrape. These paths take GET and HEAD; other methods get 405.
"""

from __future__ import annotations

import gzip
import html
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ..core.httpserver import HttpServer, ListenError, parse_listen
from ..exposition.selfmetrics import SelfMetric
from .encode import choose_format, gzip_wanted
from .selfmetrics import SelfMetrics, describe

LAST_SCRAPE_DURATION_SECONDS = SelfMetric("verl_exporter_last_scrape_duration_seconds")

__all__ = ["HttpServer", "ListenError", "SafeCollector", "health_handler", "make_app", "method_not_allowed",
           "metrics_app", "parse_listen"]

log = logging.getLogger(__name__)

_INDEX = """<!doctype html><html><head><title>verl-exporter</title></head><body>
<h1>verl-exporter</h1><p>{summary}</p>
<ul><li><a href="metrics">/metrics</a></li><li><a href="healthz">/healthz</a></li></ul>
</body></html>
"""

# A health callback returns (healthy, details); details go into the JSON body of /healthz.
HealthFn = Callable[[], tuple[bool, dict[str, Any]]]
ProblemFn = Callable[[str], None]

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

    App = Callable[[WSGIEnvironment, StartResponse], list[bytes]]  # a WSGI app of this package
    Handler = Callable[[WSGIEnvironment, StartResponse], list[bytes] | None]  # None: not its path
    Renderer = Callable[[bool], str]  # (openmetrics) -> exposition text
_READ_METHODS = ("GET", "HEAD")
_EOF = b"# EOF\n"


def method_not_allowed(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes] | None:
    """405 for a method other than GET/HEAD on a read-only path, or None when the method is one of them."""
    if environ.get("REQUEST_METHOD", "GET") in _READ_METHODS:
        return None
    body = b"method not allowed: use GET or HEAD\n"
    start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", ", ".join(_READ_METHODS)),
                                              ("Content-Length", str(len(body)))])
    return [body]


class Collects(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class SafeCollector:
    """Wraps a collector so that one failing collector costs its own series, never the whole scrape."""

    def __init__(self, collector: Collects, component: str, self_metrics: SelfMetrics):
        self._collector = collector
        self._component = component
        self._self = self_metrics

    def collect(self) -> list[Metric]:
        try:
            families = list(self._collector.collect())
        except Exception as e:
            self._self.problem(self._component, "collect", f"collect failed: {e!r}")
            return []
        return families


def make_app(registry: CollectorRegistry, self_metrics: SelfMetrics, health: HealthFn, summary: str = "",
             handlers: Sequence[Handler] = (), renderers: Sequence[Renderer] = ()) -> App:
    """handlers: extra WSGI handlers (e.g. /control) that return None for paths they do not own.
    renderers: callables (openmetrics: bool) -> str whose exposition text is served after the registry's."""
    metrics = metrics_app(registry, renderers, self_metrics)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        for handler in handlers:
            body = handler(environ, start_response)
            if body is not None:
                return body
        if path == "/metrics":
            started = time.perf_counter()
            answer = metrics(environ, start_response)
            self_metrics.set(LAST_SCRAPE_DURATION_SECONDS, time.perf_counter() - started)
            return answer
        if path == "/healthz":
            return _health(health, environ, start_response)
        if path == "/":
            if refused := method_not_allowed(environ, start_response):
                return refused
            # The run name is the user's text: escaped for HTML, and for UTF-8 (argv may hold lone surrogates).
            index = _INDEX.format(summary=html.escape(summary)).encode("utf-8", "backslashreplace")
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [index]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics or /healthz\n"]

    return app


def health_handler(path: str, health: HealthFn) -> Handler:
    """A WSGI handler for one health path: JSON details, 200 when healthy, 503 when not."""

    def handle(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes] | None:
        return _health(health, environ, start_response) if environ.get("PATH_INFO") == path else None

    return handle


def _health(health: HealthFn, environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
    if refused := method_not_allowed(environ, start_response):
        return refused
    healthy, details = health()
    body = json.dumps({"status": "ok" if healthy else "failing", **details}, sort_keys=True).encode()
    start_response("200 OK" if healthy else "503 Service Unavailable",
                   [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def metrics_app(registry: CollectorRegistry, renderers: Sequence[Renderer] = (),
                self_metrics: SelfMetrics | None = None) -> App:
    """/metrics: the registry through client_python's encoder, then the pre-rendered families.

    The format and gzip follow the scraper's Accept and Accept-Encoding, q-values included (q=0: never).
    Only GET and HEAD (the server sends HEAD's headers alone); other methods get 405.
    """

    def problem(message: str) -> None:
        if self_metrics is not None:
            self_metrics.problem("exposition", "render", message, expected=True)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        if refused := method_not_allowed(environ, start_response):
            return refused
        encoder, content_type = choose_format(environ.get("HTTP_ACCEPT"))
        openmetrics = content_type.startswith("application/openmetrics-text")
        parts = [_encode_registry(encoder, registry, problem)]
        for render in renderers:
            try:
                text = render(openmetrics)
            except Exception as e:  # one failing part costs its own series, never the scrape
                if self_metrics is not None:
                    self_metrics.problem("exposition", "render", f"rendering failed: {describe(e)}")
                continue
            parts.append(_encode_text(text, problem))
        if openmetrics:
            parts.append(_EOF)
        body = b"".join(parts)
        headers = [("Content-Type", content_type)]
        if gzip_wanted(environ.get("HTTP_ACCEPT_ENCODING")):
            # Level 1: a third of the CPU of the default 9 for a few percent more bytes on a LAN scrape.
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", headers)
        return [body]

    return app


class _Families(Collector):
    """A registry of given families, for client_python's encoder."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _strip_eof(body: bytes) -> bytes:
    return body[: -len(_EOF)] if body.endswith(_EOF) else body


def _encode_registry(encoder: Callable[[Collector], bytes], registry: Collector, problem: ProblemFn) -> bytes:
    """The registry's families without OpenMetrics' # EOF; family by family when the whole fails to encode."""
    try:
        return _strip_eof(encoder(registry))
    except Exception as e:
        first = e
    try:
        families = list(registry.collect())
    except Exception as e:  # a collector not wrapped in a SafeCollector: its part is lost, not the scrape
        problem(f"collecting the registry failed: {describe(e)}")
        return b""
    out: list[bytes] = []
    for fam in families:
        try:
            out.append(_strip_eof(encoder(_Families([fam]))))
        except Exception as e:
            problem(f"family {fam.name} left out of /metrics: {describe(e)}")
    if len(out) == len(families):  # the whole failed but no family alone: a failure of its own, counted
        problem(f"the registry failed to encode: {describe(first)}")
    return b"".join(out)


def _encode_text(text: str, problem: ProblemFn) -> bytes:
    """UTF-8 of pre-rendered exposition text; a family that cannot be encoded is left out on its own."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        pass
    out: list[bytes] = []
    for family in _split_families(text):
        try:
            out.append(family.encode())
        except UnicodeEncodeError as e:
            name = family.split(" ", 3)[2] if family.startswith("# HELP ") else "?"
            problem(f"family {name.encode('ascii', 'backslashreplace').decode()} left out of /metrics: {e.reason}")
    return b"".join(out)


def _split_families(text: str) -> list[str]:
    """Exposition text cut before each "# HELP" line (a label value cannot start a line: newlines are escaped)."""
    starts = [0] + [m.start() + 1 for m in re.finditer("\n# HELP ", text)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
