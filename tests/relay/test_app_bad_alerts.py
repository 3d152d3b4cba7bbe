"""Alerts the formatter could not render must cost nothing but themselves: through the relay's real HTTP app
and loopback robots (tests/robots.py), a time out of range once shown in the configured zone, a lone surrogate,
a broken spool entry or a control endpoint that answers garbage; never a 500, never a good alert lost."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import http_get, parse_metrics, post_json, sample, wait_for
from helpers import scaled, stop_action
from robots import FakeDingTalk, FakeWeCom
from verl_exporter.relay.actions import ActionRunner
from verl_exporter.relay.app import Relay
from verl_exporter.relay.config import parse_config
from verl_exporter.relay.dispatch import SPOOL_PREFIX, Dispatcher, Queued
from verl_exporter.relay.journal import JOURNAL
from verl_exporter.relay.metrics import RelayMetrics
from verl_exporter.relay.payload import Alert

pytestmark = pytest.mark.integration  # loopback servers

TOKEN, WKEY = "dt-token-bad-alerts-31", "wecom-key-bad-alerts-47"
ENV = {"DT_TOKEN": TOKEN, "WECOM_KEY": WKEY}
FAR_FUTURE = "9999-12-31T23:00:00Z"  # fine in UTC, past datetime.max in +08:00


def relay_doc(dt: FakeDingTalk, wc: FakeWeCom, spool: Path | None = None) -> dict:
    doc = {"timezone": "Asia/Shanghai",
           "delivery": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.2, "max_retry_seconds": 5,
                        "request_timeout_seconds": 2, "drain_seconds": 2, "rate_window_seconds": 1.0},
           "targets": {"dingtalk": {"type": "dingtalk", "url": dt.url, "token_env": "DT_TOKEN"},
                       "wecom": {"type": "wecom", "url": wc.url, "token_env": "WECOM_KEY"}},
           "routes": [{"receivers": ["verl-critical"], "targets": ["dingtalk", "wecom"]}]}
    if spool is not None:
        doc["spool_dir"] = str(spool)
    return doc


def good_alert(i: int, **over) -> dict:
    start = (datetime.now(timezone.utc) - timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
    doc = {"status": "firing",
           "labels": {"alertname": "VerlGpuXid", "severity": "critical", "run": "ppo", "rank": str(i),
                      "instance": f"node{i:04d}:9477"},
           "annotations": {"summary": f"XID 79 on rank {i}", "description": "Drain the node."},
           "startsAt": start, "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus:9090/graph",
           "fingerprint": f"fp-good-{i}"}
    for key, value in over.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) else value
    return doc


def webhook(alerts: list[dict]) -> bytes:
    doc = {"version": "4", "groupKey": "{}:{}", "status": "firing", "receiver": "verl-critical",
           "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am:9093",
           "alerts": alerts}
    return json.dumps(doc).encode()  # ensure_ascii: a lone surrogate travels as its \\udXXX escape


def post(relay: Relay, body: bytes) -> tuple[int, dict]:
    return post_json(f"{relay.url}/alert/verl-critical", body)


def metrics(relay: Relay) -> dict:
    status, _, body = http_get(relay.url + "/metrics")
    assert status == 200
    return parse_metrics(body.decode())


def texts(robot) -> list[str]:
    return [m[m["msgtype"]].get("text", m[m["msgtype"]].get("content", "")) for m in list(robot.messages)]


def delivered(relay: Relay, target: str) -> float:
    return sample(metrics(relay), "verl_relay_alerts_total", target=target, result="delivered") or 0


def tracebacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info or r.exc_text]


@pytest.fixture
def robots():
    dt, wc = FakeDingTalk(TOKEN, window=1.0).start(), FakeWeCom(WKEY, window=1.0).start()
    yield dt, wc
    dt.stop()
    wc.stop()


@pytest.fixture
def start_relay():
    started = []

    def start(doc: dict) -> Relay:
        relay = Relay(parse_config(doc, environ=ENV), listen="127.0.0.1:0").start()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop(drain_seconds=0)


def assert_each_rank_once(robot, ranks) -> None:
    joined = texts(robot)
    for i in ranks:
        hits = [t for t in joined if f"node{i:04d}:9477" in t]
        assert len(hits) == 1, (i, joined)


# ---------------------------------------------------------------- F5: one bad alert, five good ones
BAD_ALERTS = {
    "far_future_start": lambda: good_alert(5, startsAt=FAR_FUTURE),
    "lone_surrogate_label": lambda: good_alert(5, labels={"run": "ppo-\ud800"}),
}


@pytest.mark.parametrize("spool", [False, True], ids=["no_spool", "spool"])
@pytest.mark.parametrize("bad", sorted(BAD_ALERTS))
def test_one_unrenderable_alert_costs_none_of_the_good_ones(bad, spool, robots, start_relay, tmp_path, caplog):
    dt, wc = robots
    relay = start_relay(relay_doc(dt, wc, tmp_path / "spool" if spool else None))
    caplog.set_level(logging.INFO, logger="verl_exporter.relay")
    body = webhook([good_alert(i) for i in range(5)] + [BAD_ALERTS[bad]()])  # the bad one queued last
    code, answer = post(relay, body)
    assert code == 200, answer
    for target in ("dingtalk", "wecom"):
        wait_for(lambda t=target: delivered(relay, t) == 6, timeout=10)
        assert (sample(metrics(relay), "verl_relay_alerts_total", target=target, result="failed") or 0) == 0
    for robot in (dt, wc):
        assert_each_rank_once(robot, range(6))  # the repaired one is delivered too
    reason = "time_out_of_range" if bad == "far_future_start" else "bad_unicode"
    assert sample(metrics(relay), "verl_relay_repaired_values_total", reason=reason) == 1
    repaired = [r.getMessage() for r in caplog.records if "alerts.5." in r.getMessage()]
    assert len(repaired) == 1, repaired  # one clear line naming the field
    assert not tracebacks(caplog)
    if bad == "far_future_start":  # shown clamped in the configured zone
        assert any("9999-12-30" in t and "CST" in t for t in texts(dt))


@pytest.mark.parametrize("field,value", [("startsAt", "9999-12-31T23:00:00-08:00"),
                                         ("startsAt", "0001-01-01T00:00:00+08:00"),
                                         ("endsAt", "9999-12-31T23:30:00-05:00"),
                                         ("labels", {"instance": "\udfff"}),
                                         ("annotations", {"summary": "x\ud83d"})])
def test_a_value_that_cannot_be_journaled_gets_no_500_and_leaves_no_orphan(field, value, robots, start_relay,
                                                                           tmp_path, caplog):
    dt, wc = robots
    spool = tmp_path / "spool"
    relay = start_relay(relay_doc(dt, wc, spool))
    code, answer = post(relay, webhook([good_alert(0), good_alert(1, **{field: value}), good_alert(2)]))
    assert code == 200, answer
    for target in ("dingtalk", "wecom"):
        wait_for(lambda t=target: delivered(relay, t) == 3, timeout=10)
    assert not tracebacks(caplog)
    relay.stop(drain_seconds=1)
    # a restart on the same spool has nothing left to send: no entry was orphaned in the journal
    before = len(dt.messages), len(wc.messages)
    again = start_relay(relay_doc(dt, wc, spool))
    time.sleep(scaled(0.5))  # room for a resend that must not happen
    assert (len(dt.messages), len(wc.messages)) == before
    assert _journal_adds(spool) == []
    again.stop(drain_seconds=0)


def _journal_adds(spool: Path) -> list[dict]:
    path = spool / JOURNAL
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []
    done = {n for rec in lines for n in rec.get("done", [])}
    return [rec for rec in lines if "add" in rec and rec["add"] not in done]


# ---------------------------------------------------------------- the same pattern in the spool replay
def test_a_spool_with_an_unrenderable_and_a_broken_entry_resends_every_good_alert(robots, start_relay, tmp_path,
                                                                                  caplog):
    """What an earlier relay wrote: a time it stored in UTC that overflows in +08:00, an entry whose target is
    not even a name; the good entries around them are all sent."""
    dt, wc = robots
    spool = tmp_path / "spool"
    spool.mkdir()
    entries = [{"target": "dingtalk", "receiver": "verl-critical", "alert": good_alert(i)} for i in range(5)]
    entries.append({"target": "dingtalk", "receiver": "verl-critical",
                    "alert": good_alert(5, startsAt="9999-12-31T23:00:00.000000Z")})
    entries.append({"target": ["dingtalk"], "receiver": "verl-critical", "alert": good_alert(6)})
    (spool / f"{SPOOL_PREFIX}20260101T000000000000-1.json").write_text(
        json.dumps({"version": 1, "alerts": entries}), encoding="utf-8")
    relay = start_relay(relay_doc(dt, wc, spool))
    wait_for(lambda: delivered(relay, "dingtalk") == 6, timeout=10)
    assert_each_rank_once(dt, range(6))
    assert sample(metrics(relay), "verl_relay_alerts_total", target="", result="failed") == 1  # the broken one
    assert not tracebacks(caplog)


# ---------------------------------------------------------------- defence in depth: the worker isolates
def test_the_worker_drops_only_the_alert_it_cannot_render_and_delivers_the_rest(robots, start_relay, caplog):
    """Should an alert the formatter fails on ever reach a queue (built in-process, not parsed), packing
    the batch fails: only that alert is dropped and counted, with one line; the good ones all go out."""
    dt, wc = robots
    relay = start_relay(relay_doc(dt, wc))
    now = datetime.now(timezone.utc)

    def alert(i: int, start: datetime) -> Alert:
        return Alert("firing", {"alertname": "VerlGpuXid", "severity": "critical", "rank": str(i),
                                "instance": f"node{i:04d}:9477"}, {"summary": f"rank {i}"}, start, None, "",
                     f"fp-{i}")

    bad = alert(3, datetime(9999, 12, 31, 23, tzinfo=timezone.utc))
    # offered straight to the worker (the webhook would not accept it), in one call: packed as one batch
    relay.dispatcher.workers["dingtalk"].offer(
        [Queued(a, "verl-critical", time.monotonic()) for a in [alert(i, now) for i in range(3)] + [bad]
         + [alert(i, now) for i in range(4, 6)]])
    wait_for(lambda: (sample(metrics(relay), "verl_relay_alerts_total", target="dingtalk", result="unrenderable")
                      or 0) == 1 and delivered(relay, "dingtalk") == 5, timeout=10)
    assert_each_rank_once(dt, [0, 1, 2, 4, 5])
    assert not any("node0003" in t for t in texts(dt))
    assert (sample(metrics(relay), "verl_relay_alerts_total", target="dingtalk", result="failed") or 0) == 0
    lines = [r for r in caplog.records if "cannot be formatted" in r.getMessage()]
    assert len(lines) == 1 and "VerlGpuXid" in lines[0].getMessage() and not lines[0].exc_info


# ---------------------------------------------------------------- the actions queue
class GarbageServer:
    """Answers every connection with a line that is not HTTP (http.client raises BadStatusLine)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.hits = 0
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.recv(65536)
            conn.sendall(b"garbage\r\n\r\n")
            conn.close()


def test_a_control_endpoint_that_answers_garbage_does_not_stop_later_actions():
    server = GarbageServer()
    metrics = RelayMetrics()
    act = stop_action(server.url, "tok", 0.0)
    runner = ActionRunner((act,), metrics, attempts=1, sleep=lambda s: None)
    now = datetime.now(timezone.utc)
    for i in range(3):
        runner.consider([Alert("firing", {"alertname": "VerlNumericalCollapse"}, {}, now, None, "", f"fp{i}")])
    wait_for(lambda: metrics.value("verl_relay_actions_total", action="stop", result="failed") == 3, timeout=10)
    assert server.hits == 3
    server.sock.close()


# ---------------------------------------------------------------- relay --preview formats the same way
def test_preview_shows_a_payload_with_values_no_zone_can_show(tmp_path):
    config = tmp_path / "relay.yaml"
    config.write_text(json.dumps({"timezone": "Asia/Shanghai",
                                  "targets": {"dt": {"type": "dingtalk", "token_env": "VERL_PREVIEW_UNSET"}},
                                  "routes": [{"targets": ["dt"]}]}))
    alert = tmp_path / "alert.json"
    alert.write_bytes(webhook([good_alert(0), good_alert(1, startsAt=FAR_FUTURE),
                               good_alert(2, labels={"run": "\udfff"})]))
    proc = subprocess.run([sys.executable, "-m", "verl_exporter", "relay", "--config", str(config),
                           "--preview", str(alert)], capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "repaired alerts.1.startsAt: 9999-12-31T23:00:00+00:00 cannot be shown" in proc.stdout
    assert "repaired alerts.2.labels.run: a lone surrogate" in proc.stdout
    assert all(f"node{i:04d}:9477" in proc.stdout for i in range(3))


# ---------------------------------------------------------------- the journal keeps no orphan, whatever fails
def test_a_webhook_that_fails_midway_leaves_nothing_pending_in_the_journal(tmp_path, monkeypatch):
    """Should journaling fail after some of a webhook's alerts were written (a bug: the caller answers 500 and
    Alertmanager sends the webhook again), those are settled, not resent by the next start as well."""
    config = parse_config({"spool_dir": str(tmp_path), "targets": {"dt": {"type": "dingtalk", "token_env": "T"}},
                           "routes": [{"targets": ["dt"]}]}, environ={"T": "t"})
    dispatcher = Dispatcher(config, RelayMetrics())
    dispatcher.load_spool()
    real_add, calls = dispatcher.journal.add, []

    def add(*args):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real_add(*args)

    monkeypatch.setattr(dispatcher.journal, "add", add)
    now = datetime.now(timezone.utc)
    alerts = [Alert("firing", {"alertname": "VerlX", "rank": str(i)}, {}, now, None, "", f"fp{i}") for i in range(5)]
    with pytest.raises(RuntimeError):
        dispatcher.submit("verl-critical", alerts)
    assert len(calls) == 3 and _journal_adds(tmp_path) == []


def test_preview_refuses_a_payload_over_the_body_limit_without_reading_it_all(tmp_path):
    # Before, --preview read any file whole (/dev/zero: memory without bound); the live relay answers 413.
    config = tmp_path / "relay.yaml"
    config.write_text(json.dumps({"max_body_bytes": 4096, "targets": {"dt": {"type": "dingtalk",
                                                                           "token_env": "VERL_PREVIEW_UNSET"}},
                                  "routes": [{"targets": ["dt"]}]}))
    big = tmp_path / "big.json"
    big.write_bytes(webhook([good_alert(i) for i in range(50)]))
    assert big.stat().st_size > 4096
    proc = subprocess.run([sys.executable, "-m", "verl_exporter", "relay", "--config", str(config),
                           "--preview", str(big)], capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "larger than max_body_bytes (4096)" in proc.stderr
