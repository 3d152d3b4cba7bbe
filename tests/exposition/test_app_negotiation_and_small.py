"""Content negotiation with q-values, the index page, control reasons in the log, the node's restart backoff,
the one shutdown helper."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import signal
from pathlib import Path

import pytest
import verl_exporter
from helpers import scaled
from prometheus_client import CollectorRegistry, Gauge
from verl_exporter.core.shutdown import SIGNALS, stop_event
from verl_exporter.exposition.app import metrics_app
from verl_exporter.sidecar import node
from verl_exporter.sidecar.control import ControlState, make_control_app

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;"
                     "q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


def scrape(accept: str | None = None, accept_encoding: str | None = None) -> tuple[dict, bytes]:
    registry = CollectorRegistry()
    Gauge("demo_value", "a value", registry=registry).set(1)
    environ = {"PATH_INFO": "/metrics", "REQUEST_METHOD": "GET"}
    if accept is not None:
        environ["HTTP_ACCEPT"] = accept
    if accept_encoding is not None:
        environ["HTTP_ACCEPT_ENCODING"] = accept_encoding
    got = {}

    def start_response(status, headers):
        got.update(headers)

    body = b"".join(metrics_app(registry)(environ, start_response))
    return got, body


@pytest.mark.parametrize(("accept", "openmetrics"), [
    (PROMETHEUS_ACCEPT, True),
    ("application/openmetrics-text; version=1.0.0", True),
    ("application/openmetrics-text;version=1.0.0;q=0, text/plain;version=0.0.4", False),
    ("application/openmetrics-text;version=1.0.0;q=0", False),
    ("text/plain;version=0.0.4;q=1, application/openmetrics-text;version=1.0.0;q=0.5", False),
    ("application/openmetrics-text;version=1.0.0;q=bogus", False),
    (None, False),
])
def test_the_format_follows_the_accept_q_values(accept, openmetrics):
    headers, body = scrape(accept=accept)
    assert headers["Content-Type"].startswith("application/openmetrics-text") is openmetrics
    assert body.rstrip().endswith(b"# EOF") is openmetrics


@pytest.mark.parametrize(("accept_encoding", "gzipped"), [
    ("gzip", True),
    ("deflate, gzip;q=0.5", True),
    ("gzip;q=0", False),
    ("gzip;q=0, *", False),
    ("*", True),
    ("*;q=0", False),
    ("identity", False),
    (None, False),
])
def test_gzip_follows_the_accept_encoding_q_values(accept_encoding, gzipped):
    headers, body = scrape(accept_encoding=accept_encoding)
    assert (headers.get("Content-Encoding") == "gzip") is gzipped
    text = gzip.decompress(body) if gzipped else body
    assert b"demo_value 1.0" in text


@pytest.mark.integration
def test_the_index_page_escapes_the_run_name_and_shows_no_none():
    from conftest import http_get
    from verl_exporter.sidecar.config import ServeConfig
    from verl_exporter.sidecar.sidecar import Sidecar

    side = Sidecar(ServeConfig(listen="127.0.0.1:0", run="<script>alert(1)</script>", collectors={"host": False}))
    side.start()
    try:
        body = http_get(side.server.url + "/")[2].decode()
    finally:
        side.stop()
    assert "<script>" not in body and "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "rank=-" in body and "None" not in body


def test_a_control_reason_cannot_forge_log_lines(tmp_path, caplog):
    state = ControlState(str(tmp_path / "control.json"))
    app = make_control_app(state, "tok", _NoMetrics())
    body = json.dumps({"reason": "ok\n2026-01-01 WARNING verl_exporter: forged\r\x1b[2J"}).encode()
    environ = {"PATH_INFO": "/control/stop", "REQUEST_METHOD": "POST", "HTTP_AUTHORIZATION": "Bearer tok",
               "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)}
    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        app(environ, lambda *_: None)
    messages = [r.getMessage() for r in caplog.records if "control" in r.getMessage()]
    assert messages and all(m.isprintable() for m in messages), messages
    stored = json.loads((tmp_path / "control.json").read_text())["reason"]
    assert stored.isprintable() and "forged" in stored
    # the training side's API is cleaned the same way
    state.request("checkpoint", "a\nb")
    assert json.loads((tmp_path / "control.json").read_text())["reason"] == "a b"


class _NoMetrics:
    def inc(self, *args, **kwargs):
        pass


class _FakePopen:
    def __init__(self, argv):
        self.returncode = 1

    def poll(self):
        return self.returncode


def test_the_restart_backoff_starts_afresh_after_a_healthy_run(monkeypatch):
    monkeypatch.setattr(node.subprocess, "Popen", _FakePopen)
    now = [0.0]
    sup = node.Supervisor([["serve"]], backoff=1.0, clock=lambda: now[0])
    pauses = []
    for _ in range(4):  # crashes right after each start: 1, 2, 4, 8 s
        sup.start(0)
        now[0] += 1
        pauses.append(sup.exited(0))
        now[0] += pauses[-1]
    assert pauses == [1.0, 2.0, 4.0, 8.0]
    sup.start(0)
    now[0] += node.HEALTHY_RUN_S  # a long healthy run, then a crash
    assert sup.exited(0) == 1.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_one_shutdown_helper_stops_serve_relay_demo_and_node(sig):
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        done = stop_event()
        os.kill(os.getpid(), sig)
        assert done.wait(scaled(5))
        sup = node.Supervisor([["serve"]])
        assert stop_event(sup.stopping) is sup.stopping  # node's supervisor loop waits on its own event
        os.kill(os.getpid(), sig)
        assert sup.stopping.wait(scaled(5))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    package = Path(verl_exporter.__file__).resolve().parent
    sources = {str(p.relative_to(package)): p.read_text(encoding="utf-8") for p in package.rglob("*.py")}
    # the commands that run until stopped wait on the helper; nothing else installs a signal handler
    assert all(("stop_event(" in sources[name] or "stopping(" in sources[name])
               for name in ("cli.py", "tools/demo.py", "tools/demo_stack.py", "sidecar/node.py", "relay/cli.py"))
    assert [name for name, text in sources.items() if "signal.signal(" in text] == ["core/shutdown.py"]
