"""The relay's automated response (relay/actions.py) and its robot sender against misbehaving servers:
redirects are never followed (the bearer token stays with the sidecar), an answer must say `applied`, no
backoff after the last attempt, and the cooldown history stays bounded."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import wait_for
from helpers import config_action, robot_target, stop_action
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.relay.actions import MAX_COOLDOWN_KEYS, ActionRunner, evidence_alert
from verl_exporter.relay.format import DINGTALK_MAX_BODY, format_messages
from verl_exporter.relay.metrics import RelayMetrics
from verl_exporter.relay.payload import Alert
from verl_exporter.relay.senders import RobotSender

pytestmark = pytest.mark.integration  # starts servers or programs

TOKEN = "control-token-3b9e51"


class Server:
    """A loopback HTTP server answering every request with (status, headers, body); records requests."""

    def __init__(self, status=200, body=b"{}", headers=None):
        self.status, self.body, self.headers = status, body, dict(headers or {})
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                server.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                        "body": self.rfile.read(length)})
                self.send_response(server.status)
                for k, v in server.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                self.wfile.write(server.body)

            do_GET = do_POST = _answer  # noqa: N815 (http.server's naming)

            def log_message(self, *args):
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_port}"

    def stop(self):
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def servers():
    started = []

    def start(*args, **kw) -> Server:
        started.append(Server(*args, **kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def alert(name="VerlNumericalCollapse", fingerprint="fp-1") -> Alert:
    return Alert(status="firing", labels={"alertname": name}, annotations={},
                 starts_at=datetime.now(timezone.utc), ends_at=None, fingerprint=fingerprint)


def runner(url: str, metrics: RelayMetrics, **kw) -> ActionRunner:
    act = stop_action(url, TOKEN, kw.pop("cooldown_seconds", 1800.0))
    return ActionRunner((act,), metrics, timeout=2, **kw)


def result(metrics: RelayMetrics, name: str) -> float:
    return metrics.value("verl_relay_actions_total", action="stop", result=name)


def test_an_action_never_follows_a_redirect_with_the_token(servers, caplog):
    elsewhere = servers(200, b'{"applied": true}')
    sidecar = servers(302, b"", {"Location": elsewhere.url + "/control/stop"})
    metrics = RelayMetrics()
    runner(sidecar.url, metrics).consider([alert()])
    wait_for(lambda: result(metrics, "refused") == 1, timeout=5)
    assert sidecar.requests[0]["headers"]["Authorization"] == f"Bearer {TOKEN}"
    assert elsewhere.requests == []  # neither the request nor the token went on
    assert result(metrics, "done") == 0
    assert "redirect" in caplog.text and TOKEN not in caplog.text


def test_an_answer_without_applied_is_a_failure(servers, caplog):
    not_a_sidecar = servers(200, b'{"status": "ok"}')
    metrics = RelayMetrics()
    runner(not_a_sidecar.url, metrics).consider([alert()])
    wait_for(lambda: result(metrics, "failed") == 1, timeout=5)
    assert result(metrics, "done") == 0 and "NOT requested" in caplog.text


def test_an_applied_answer_is_done(servers):
    sidecar = servers(200, b'{"action": "stop", "applied": true, "id": "a1", "state": {}}')
    metrics = RelayMetrics()
    runner(sidecar.url, metrics).consider([alert()])
    wait_for(lambda: result(metrics, "done") == 1, timeout=5)
    assert json.loads(sidecar.requests[0]["body"]) == {"reason": "VerlNumericalCollapse"}


def test_an_answer_that_was_not_applied_is_a_failure_not_done(servers, caplog):
    # the sidecar recorded the request where the trainer cannot read it (or, before request ids, an older
    # sidecar that took a stop for "already requested" and wrote nothing)
    sidecar = servers(200, b'{"action": "stop", "applied": false, "error": "the trainer cannot reach it\\n"}')
    metrics = RelayMetrics()
    runner(sidecar.url, metrics).consider([alert()])
    wait_for(lambda: result(metrics, "failed") == 1, timeout=5)
    assert len(sidecar.requests) == 1  # not retried: asking again would not make the file readable
    assert result(metrics, "done") == 0
    assert "NOT applied" in caplog.text and "the trainer cannot reach it" in caplog.text


def test_no_backoff_after_the_last_failed_attempt(servers):
    down = servers(503, b"")
    metrics = RelayMetrics()
    slept: list[float] = []
    runner(down.url, metrics, attempts=3, sleep=slept.append).consider([alert()])
    wait_for(lambda: result(metrics, "failed") == 1, timeout=5)
    assert len(down.requests) == 3
    assert len(slept) == 2 and slept == sorted(slept)  # between attempts only, growing


def test_the_cooldown_history_stays_bounded(servers):
    sidecar = servers(200, b'{"applied": true}')
    now = [0.0]
    metrics = RelayMetrics()
    r = runner(sidecar.url, metrics, clock=lambda: now[0], cooldown_seconds=60.0)
    r.consider([alert(fingerprint=f"fp-{i}") for i in range(MAX_COOLDOWN_KEYS + 500)])
    assert len(r._last) == MAX_COOLDOWN_KEYS  # a flood of distinct alerts: the oldest are forgotten
    r.consider([alert(fingerprint="fp-late")])
    assert result(metrics, "cooldown") == 0
    r.consider([alert(fingerprint="fp-late")])
    assert result(metrics, "cooldown") == 1  # within its cooldown: remembered
    now[0] = 61.0
    r.consider([alert(fingerprint="fp-after")])
    assert list(r._last) == [(0, "fp-after")]  # every expired entry is gone


def test_the_robot_sender_does_not_follow_a_redirect(servers):
    elsewhere = servers(200, b'{"errcode": 0, "errmsg": "ok"}')
    robot = servers(302, b"", {"Location": elsewhere.url + "/robot/send"})
    target = robot_target("dingtalk", robot.url + "/robot/send", "dt-token-1", "dt")
    result = RobotSender(target, timeout=2).send(b'{"msgtype": "text", "text": {"content": "x"}}')
    assert (result.ok, result.retryable, result.errcode) == (False, False, "http_302")
    assert elsewhere.requests == []


def test_a_forensics_answer_becomes_a_page_the_robot_can_show(servers):
    """The sidecar's verdict is node data: escaped like any alert text, and within the robot's limits."""
    verdict = "rank 7 is in reward_fn → compute_score (my_reward.py) [x](http://evil.example) " + "x" * 5000
    answer = {"applied": True, "verdict": verdict, "path": "/var/lib/forensics/capture-1.json", "processes": 8}
    sidecar = servers(body=json.dumps(answer).encode())
    pages = []
    metrics = RelayMetrics()
    act = config_action({"alertname": "VerlTrainingStalled"}, "forensics", sidecar.url, TOKEN)
    ActionRunner((act,), metrics, timeout=2, on_evidence=lambda *a: pages.append(a)).consider(
        [alert("VerlTrainingStalled")], "training-critical")
    wait_for(lambda: pages, timeout=5)
    receiver, asked, got = pages[0]
    assert receiver == "training-critical" and asked.name == "VerlTrainingStalled" and got == answer
    assert sidecar.requests[0]["path"] == "/control/forensics"
    notice = metrics.spec.notice("VerlHangForensics")  # its severity and texts are the spec's
    page = evidence_alert(asked, got, metrics.spec)
    assert (page.name, page.severity) == (notice.alert, notice.severity) and page.annotations["description"] == verdict
    assert page.annotations["summary"] == notice.texts({"alert": "VerlTrainingStalled", "processes": 8, "instance": "?",
                                                        "path": "/var/lib/forensics/capture-1.json"})["summary"]
    assert "{" not in page.annotations["summary"]  # the relay fills every placeholder the spec's text has
    [message] = format_messages([page], robot_target("dingtalk", "http://x", "t", "dt"))
    text = json.loads(message.body)["markdown"]["text"]
    assert "rank 7 is in reward_fn → compute_score" in text and "capture-1·json" in text
    assert "[x](http" not in text and len(message.body) <= DINGTALK_MAX_BODY


answer_scalars = st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats() | st.text(max_size=30)
answer_values = st.recursive(answer_scalars, lambda inner: st.lists(inner, max_size=3)
                             | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=10)
answer_bodies = (st.dictionaries(st.sampled_from(["applied", "verdict", "path", "processes", "error", "id"]),
                                 answer_values, max_size=6).map(lambda d: json.dumps(d).encode())
                 | st.binary(max_size=100)
                 | st.sampled_from([b"[" * 5000, b"{}" * 3, json.dumps("x" * 70_000).encode()]))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(status=st.sampled_from([200, 202, 400, 401, 500, 503]), body=answer_bodies)
def test_any_sidecar_answer_is_done_failed_or_refused(servers, status, body):
    sidecar = servers(status, body)  # stopped with the others at the test's end
    act = config_action({"alertname": "VerlTrainingStalled"}, "forensics", sidecar.url, TOKEN)
    runner = ActionRunner((act,), RelayMetrics(), timeout=2, attempts=1)
    result, answer = runner._call(act, "VerlTrainingStalled")
    assert result in {"done", "failed", "refused"}
    if result == "done":
        page = evidence_alert(alert("VerlTrainingStalled"), answer)
        [message] = format_messages([page], robot_target("dingtalk", "http://x", "t", "dt"))
        assert len(message.body) <= DINGTALK_MAX_BODY
