"""The shared HTTP server under slow, stalled and many clients (the sidecar's and the relay's)."""

from __future__ import annotations

import contextlib
import socket
import threading
from http import HTTPStatus

import pytest
from conftest import http_get, wait_for
from helpers import scaled
from verl_exporter.core.httpserver import HttpServer, ListenError

pytestmark = pytest.mark.integration  # starts servers or programs

# How long a test waits for the server to act; never an assertion about speed.
PATIENCE_S = 20.0


def hello(environ, start_response):
    body = b"hello\n"
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


class Problems:
    def __init__(self):
        self.kinds: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str) -> None:
        with self._lock:
            self.kinds.append(kind)

    def count(self, kind: str) -> int:
        with self._lock:
            return self.kinds.count(kind)


@pytest.fixture
def server():
    started = []

    def start(app=hello, **kwargs):
        problems = Problems()
        srv = HttpServer(app, "127.0.0.1:0", on_problem=problems, **kwargs).start()
        started.append(srv)
        return srv, problems

    yield start
    for srv in started:
        srv.stop()


def connect(srv: HttpServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(PATIENCE_S))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closed the connection (EOF or reset) before PATIENCE_S passed."""
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_partial_headers_are_dropped_after_the_request_timeout(server):
    srv, problems = server(request_timeout=0.5, workers=4)
    socks = [connect(srv) for _ in range(10)]
    for sock in socks:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the headers
    assert all(closed_by_server(sock) for sock in socks)
    wait_for(lambda: problems.count("timeout") == 10, timeout=PATIENCE_S)
    assert http_get(srv.url + "/")[2] == b"hello\n"
    for sock in socks:
        sock.close()


def test_a_client_dripping_bytes_is_dropped_at_the_deadline(server):
    srv, problems = server(request_timeout=1.0, workers=2)
    sock = connect(srv)
    stop = threading.Event()

    def drip():  # each byte well inside the timeout: only a whole-request deadline ends this
        header = b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 10_000
        for i in range(len(header)):
            if stop.wait(0.05):
                return
            try:
                sock.send(header[i:i + 1])
            except OSError:
                return

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        assert closed_by_server(sock)
    finally:
        stop.set()
        t.join()
        sock.close()
    assert problems.count("timeout") == 1


def test_slow_clients_do_not_stop_others_being_served(server):
    srv, _ = server(request_timeout=60, workers=2)
    slow = [connect(srv) for _ in range(20)]  # more than the workers: a half-sent request holds none
    for sock in slow:
        sock.sendall(b"GET / HTTP/1.1\r\n")
    for _ in range(5):
        assert http_get(srv.url + "/")[0] == 200
    for sock in slow:
        sock.close()


def test_beyond_max_connections_a_connection_gets_503_not_a_thread(server):
    srv, problems = server(request_timeout=60, max_connections=2)
    held = [connect(srv) for _ in range(2)]
    for sock in held:
        sock.sendall(b"GET / HTTP/1.1\r\n")
    extra = connect(srv)  # accepted after the two above: the kernel's queue is first in, first out
    answer = extra.recv(4096)
    assert answer.startswith(b"HTTP/1.1 503 ")
    wait_for(lambda: problems.count("overload") == 1, timeout=PATIENCE_S)
    for sock in [*held, extra]:
        sock.close()


def test_the_listen_backlog_takes_a_burst_of_connections():
    # Bound but not serving yet: every connection must wait in the kernel's backlog (5 before).
    srv = HttpServer(hello, "127.0.0.1:0")
    socks = []
    try:
        for _ in range(64):
            s = socket.socket()
            s.settimeout(5)
            s.connect(("127.0.0.1", srv.port))  # times out once the backlog is full
            socks.append(s)
        srv.start()
        for s in socks:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert all(s.recv(4096).startswith(b"HTTP/1.0 200") for s in socks)
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_an_address_in_use_is_a_listen_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ListenError):
            HttpServer(hello, f"127.0.0.1:{taken.getsockname()[1]}")


def test_the_sidecar_counts_dropped_connections(tmp_path):
    from conftest import parse_metrics, sample
    from verl_exporter.sidecar.config import ServeConfig
    from verl_exporter.sidecar.sidecar import Sidecar

    side = Sidecar(ServeConfig(listen="127.0.0.1:0", collectors={"host": False}))
    side.start()
    try:
        side.server._httpd.request_timeout = 0.3
        sock = socket.create_connection(("127.0.0.1", side.server.port), timeout=scaled(PATIENCE_S))
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert closed_by_server(sock)
        sock.close()
        metrics = parse_metrics(http_get(side.server.url + "/metrics")[2].decode())
        assert sample(metrics, "verl_exporter_source_errors_total", component="http") == 1
    finally:
        side.stop()


def test_the_relay_counts_dropped_connections():
    from conftest import parse_metrics, sample
    from verl_exporter.relay.app import Relay
    from verl_exporter.relay.config import parse_config

    doc = {"targets": {"wecom": {"type": "wecom", "url": "http://127.0.0.1:9/", "token_env": "WECOM_KEY"}},
           "routes": [{"receivers": ["verl-critical"], "targets": ["wecom"]}]}
    relay = Relay(parse_config(doc, environ={"WECOM_KEY": "k"}), listen="127.0.0.1:0").start()
    try:
        relay._server._httpd.request_timeout = 0.3
        sock = socket.create_connection(("127.0.0.1", relay._server.port), timeout=scaled(PATIENCE_S))
        sock.sendall(b"POST /alert/verl-critical HTTP/1.1\r\n")
        assert closed_by_server(sock)
        sock.close()
        metrics = parse_metrics(http_get(relay.url + "/metrics")[2].decode())
        assert sample(metrics, "verl_relay_requests_total", receiver="unknown", code="408") == 1
        # the relay's /metrics negotiates like the sidecar's: q=0 means never
        assert "Content-Encoding" not in http_get(relay.url + "/metrics", headers={"Accept-Encoding": "gzip;q=0"})[1]
    finally:
        relay.stop(drain_seconds=0)


def test_a_client_that_stops_reading_the_answer_is_dropped(server):
    big = b"x" * (64 << 20)  # more than the kernel buffers of both ends hold

    def large(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(big)))])
        return [big]

    srv, problems = server(app=large, request_timeout=0.5)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(b"GET / HTTP/1.0\r\n\r\n")  # and never read
    wait_for(lambda: problems.count("timeout") == 1, timeout=PATIENCE_S)
    assert problems.kinds == ["timeout"]
    sock.close()


def test_an_app_that_raises_answers_500_and_is_counted(server):
    def broken(environ, start_response):
        raise RuntimeError("bug")

    srv, problems = server(app=broken)
    assert http_get(srv.url + "/")[0] == 500
    wait_for(lambda: problems.count("error") == 1, timeout=PATIENCE_S)
    assert http_get(srv.url + "/")[0] == 500  # and the server goes on


def _stalled_body_answer(port: int, path: str, headers: bytes = b"") -> bytes:
    """POST a Content-Length of 1000, send a few bytes of the body, then stall: the server's answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=scaled(PATIENCE_S))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: 1000\r\n\r\n{\"a\":" % (path.encode(), headers))
    answer = b""
    with contextlib.suppress(OSError):
        while data := sock.recv(65536):
            answer += data
    sock.close()
    return answer


@pytest.mark.integration
@pytest.mark.parametrize("path", ["/alert/verl-critical", "/alert/no-such-receiver"])
def test_the_relay_answers_408_to_a_body_that_stalls(path, caplog):
    """A client that stops halfway through its body is a slow client (408, counted), not a relay bug
    (it was a 500 with a traceback logged each time)."""
    from conftest import parse_metrics, sample
    from verl_exporter.relay.app import Relay
    from verl_exporter.relay.config import parse_config

    doc = {"targets": {"wecom": {"type": "wecom", "url": "http://127.0.0.1:9/", "token_env": "WECOM_KEY"}},
           "routes": [{"receivers": ["verl-critical"], "targets": ["wecom"]}]}
    relay = Relay(parse_config(doc, environ={"WECOM_KEY": "k"}), listen="127.0.0.1:0").start()
    try:
        relay._server._httpd.request_timeout = 0.3
        answer = _stalled_body_answer(relay._server.port, path)
        code = "408" if path.endswith("verl-critical") else "404"  # an unknown receiver's refusal stands
        status = answer.split(b"\r\n", 1)[0]
        assert status.split(b" ", 2)[1:] == [code.encode(), HTTPStatus(int(code)).phrase.encode()], answer[:200]
        metrics = parse_metrics(http_get(relay.url + "/metrics")[2].decode())
        receiver = "verl-critical" if code == "408" else "unknown"
        assert sample(metrics, "verl_relay_requests_total", receiver=receiver, code=code) == 1
        assert not [r for r in caplog.records if r.exc_info], "a slow client logged a traceback"
    finally:
        relay.stop(drain_seconds=0)


@pytest.mark.integration
def test_the_sidecar_control_endpoint_answers_408_to_a_body_that_stalls(tmp_path, caplog):
    from conftest import parse_metrics, sample
    from verl_exporter.sidecar.config import ServeConfig
    from verl_exporter.sidecar.sidecar import Sidecar

    side = Sidecar(ServeConfig(listen="127.0.0.1:0", collectors={"host": False}), control_token="tok",
                   control_file=str(tmp_path / "control.json"))
    side.start()
    try:
        side.server._httpd.request_timeout = 0.3
        answer = _stalled_body_answer(side.server.port, "/control/stop", b"Authorization: Bearer tok\r\n")
        assert answer.split(b"\r\n", 1)[0].split()[1] == b"408", answer[:200]
        assert not (tmp_path / "control.json").exists()  # nothing was requested
        metrics = parse_metrics(http_get(side.server.url + "/metrics")[2].decode())
        assert sample(metrics, "verl_exporter_control_requests_total", action="stop", result="bad_request") == 1
        assert not [r for r in caplog.records if r.exc_info], "a slow client logged a traceback"
    finally:
        side.stop()


def test_requests_on_a_slow_path_never_hold_the_slots_metrics_needs(server):
    """Slow requests (a stack capture) run in slots of their own: with the lane full and its queue full too (the
    next one refused at once), /metrics is still answered."""
    from verl_exporter.core.httpserver import SLOW_WAITING

    release, entered = threading.Event(), []

    def app(environ, start_response):
        if environ["PATH_INFO"].startswith("/slow/"):
            entered.append(1)
            release.wait(scaled(PATIENCE_S))
        return hello(environ, start_response)

    srv, problems = server(app, workers=2, slow_paths=("/slow/",), slow_workers=1)
    answers: list[int] = []

    def slow_request():
        answers.append(http_get(srv.url + "/slow/x", timeout=PATIENCE_S)[0])

    clients = [threading.Thread(target=slow_request) for _ in range(1 + SLOW_WAITING + 1)]
    try:
        for c in clients:
            c.start()
        wait_for(lambda: 503 in answers, timeout=PATIENCE_S)  # the lane holds all it may: one more is refused
        assert len(entered) == 1 and problems.count("overload") == 1
        for _ in range(3):  # more than the app's 2 slots
            assert http_get(srv.url + "/metrics", timeout=PATIENCE_S)[0] == 200
    finally:
        release.set()
        for c in clients:
            c.join()
    assert sorted(answers) == [200] * (1 + SLOW_WAITING) + [503]


def _server_connections(port: int) -> int:
    import psutil

    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_a_scrape_is_answered_while_twelve_forensics_requests_wait_on_a_capture(tmp_path):
    """The issue's case: one capture in progress (py-spy held until the test lets it go), 12 requests waiting
    for it, more than the server's 8 app slots; a scrape answers before the capture ends, and every request
    gets that one capture."""
    import subprocess

    from conftest import post_json
    from verl_exporter.core.httpserver import WORKERS
    from verl_exporter.sidecar.config import ServeConfig
    from verl_exporter.sidecar.sidecar import Sidecar

    started, release = tmp_path / "started", tmp_path / "release"
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!/bin/sh\ntouch {started}\nwhile [ ! -e {release} ]; do sleep 0.05; done\necho '[]'\n")
    fake.chmod(0o755)
    trainer = subprocess.Popen(["sleep", "120"])
    side = Sidecar(ServeConfig(listen="127.0.0.1:0", collectors={"host": False}, trainer_pid=trainer.pid,
                               forensics_dir=str(tmp_path / "forensics"), forensics_py_spy=str(fake),
                               forensics_native=False, forensics_timeout=scaled(PATIENCE_S * 3)),
                   control_token="tok", control_file=str(tmp_path / "control.json"))
    side.start()
    answers: list[tuple[int, dict]] = []
    waiting = WORKERS + 4

    def ask():
        answers.append(post_json(side.server.url + "/control/forensics", b"{}", {"Authorization": "Bearer tok"},
                                 timeout=PATIENCE_S * 3))

    clients = [threading.Thread(target=ask) for _ in range(waiting)]
    try:
        for c in clients:
            c.start()
        wait_for(started.exists, timeout=PATIENCE_S)
        wait_for(lambda: _server_connections(side.server.port) >= waiting, timeout=PATIENCE_S)
        scraped: list[int] = []
        scrape = threading.Thread(target=lambda: scraped.append(http_get(side.server.url + "/metrics",
                                                                          timeout=PATIENCE_S * 3)[0]))
        scrape.start()
        wait_for(lambda: scraped, timeout=PATIENCE_S)  # answered with the capture still held
        assert scraped == [200] and not release.exists() and not answers
    finally:
        release.touch()
        for c in clients:
            c.join()
        side.stop()
        trainer.kill()
        trainer.wait()
    assert [status for status, _ in answers] == [200] * waiting
    assert len({a["path"] for _, a in answers}) == 1 and all(a["applied"] for _, a in answers)
