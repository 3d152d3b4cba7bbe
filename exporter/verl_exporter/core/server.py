"""The HTTP side: /metrics (Prometheus text or OpenMetrics, as the scraper asks), /healthz and /.

The app knows no metric names: it serves a registry, asks a health callback, and times each scrape.
"""

from __future__ import annotations

import gzip
import html
import json
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from .exposition import choose_format, gzip_wanted
from .httpserver import HttpServer, ListenError, parse_listen
from .selfmetrics import SelfMetrics

__all__ = ["HttpServer", "ListenError", "SafeCollector", "health_handler", "make_app", "metrics_app", "parse_listen"]

log = logging.getLogger(__name__)

_INDEX = """<!doctype html><html><head><title>verl-exporter</title></head><body>
<h1>verl-exporter</h1><p>{summary}</p>
<ul><li><a href="metrics">/metrics</a></li><li><a href="healthz">/healthz</a></li></ul>
</body></html>
"""

# A health callback returns (healthy, details); details go into the JSON body of /healthz.
HealthFn = Callable[[], tuple[bool, dict]]


class SafeCollector:
    """Wraps a collector so that one failing collector costs its own series, never the whole scrape."""

    def __init__(self, collector, component: str, self_metrics: SelfMetrics):
        self._collector = collector
        self._component = component
        self._self = self_metrics

    def collect(self):
        try:
            families = list(self._collector.collect())
        except Exception as e:
            self._self.problem(self._component, "collect", f"collect failed: {e!r}")
            return []
        return families


def make_app(registry: CollectorRegistry, self_metrics: SelfMetrics, health: HealthFn, summary: str = "",
             handlers=(), renderers=()):
    """handlers: extra WSGI handlers (e.g. /control) that return None for paths they do not own.
    renderers: callables (openmetrics: bool) -> str whose exposition text is served after the registry's."""
    metrics = metrics_app(registry, renderers, self_metrics)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        for handler in handlers:
            body = handler(environ, start_response)
            if body is not None:
                return body
        if path == "/metrics":
            started = time.perf_counter()
            body = metrics(environ, start_response)
            self_metrics.set("verl_exporter_last_scrape_duration_seconds", time.perf_counter() - started)
            return body
        if path == "/healthz":
            return health_handler(path, health)(environ, start_response)
        if path == "/":
            body = _INDEX.format(summary=html.escape(summary)).encode()  # the run name is the user's text
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics or /healthz\n"]

    return app


def health_handler(path: str, health: HealthFn):
    """A WSGI handler for one health path: JSON details, 200 when healthy, 503 when not."""

    def handle(environ, start_response):
        if environ.get("PATH_INFO") != path:
            return None
        healthy, details = health()
        body = json.dumps({"status": "ok" if healthy else "failing", **details}, sort_keys=True).encode()
        start_response("200 OK" if healthy else "503 Service Unavailable",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return handle


def metrics_app(registry: CollectorRegistry, renderers=(), self_metrics: SelfMetrics | None = None):
    """/metrics: the registry through client_python's encoder, then the pre-rendered families.

    The format and gzip follow the scraper's Accept and Accept-Encoding, q-values included (q=0: never).
    """

    def app(environ, start_response):
        encoder, content_type = choose_format(environ.get("HTTP_ACCEPT"))
        openmetrics = content_type.startswith("application/openmetrics-text")
        body = encoder(registry)
        extra = []
        for render in renderers:
            try:
                extra.append(render(openmetrics))
            except Exception as e:  # one failing part costs its own series, never the scrape
                if self_metrics is not None:
                    self_metrics.problem("exposition", "render", f"rendering failed: {e!r}")
        tail = "".join(extra).encode()
        if openmetrics and body.endswith(b"# EOF\n"):
            body = body[: -len(b"# EOF\n")] + tail + b"# EOF\n"
        else:
            body += tail
        headers = [("Content-Type", content_type)]
        if gzip_wanted(environ.get("HTTP_ACCEPT_ENCODING")):
            # Level 1: a third of the CPU of the default 9 for a few percent more bytes on a LAN scrape.
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", headers)
        return [body]

    return app
