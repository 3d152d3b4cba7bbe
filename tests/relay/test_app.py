"""The relay end to end against loopback robots (tests/robots.py): config, signing, retries, rate limits and
merging, bad input, secrets, spooling, metrics, the CLI, and a real Alertmanager in front of it."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from conftest import (
    REPO,
    Proc,
    am_post_alerts,
    free_port,
    http_get,
    parse_metrics,
    ready,
    require_tool,
    sample,
    wait_for,
)
from helpers import scaled
from pydantic import SecretStr
from relay_helpers import (
    ENV,
    MOBILE,
    SECRET,
    TOKEN,
    WEBHOOK,
    WINDOW,
    WKEY,
    am_alert,
    metrics,
    post,
    relay_doc,
    webhook,
)
from robots import FakeDingTalk, FakeLark, FakeWeCom
from verl_exporter.relay import app as relay_app
from verl_exporter.relay.config import RelayConfigError, Secret, load_config, parse_config
from verl_exporter.relay.journal import check_spool_dir
from verl_exporter.relay.payload import parse_payload
from verl_exporter.spec import load_spec

pytestmark = pytest.mark.integration  # starts servers or programs

LTOKEN, LSECRET = "lark-hook-token-e2e-81c0", "lark-signing-secret-e2e-4d2f"
SECRETS = (TOKEN, SECRET, WKEY, WEBHOOK)


# ---------------------------------------------------------------- helpers
def wait_metric(relay, name: str, value: float, timeout: float = 5, **labels) -> dict:
    """Wait until a relay counter reaches value (the worker counts once the robot's answer is back)."""
    return wait_for(lambda: sample(m := metrics(relay), name, **labels) == value and m, timeout=timeout)


def texts(robot) -> list[str]:
    out = []
    for m in list(robot.messages):
        inner = m[m["msgtype"]]
        out.append(inner.get("text", inner.get("content", "")))
    return out


@pytest.fixture
def robots():
    dt = FakeDingTalk(TOKEN, SECRET, window=WINDOW).start()
    wc = FakeWeCom(WKEY, window=WINDOW).start()
    yield dt, wc
    dt.stop()
    wc.stop()


# ---------------------------------------------------------------- config
def test_config_reports_every_problem_at_once_naming_target_and_route(tmp_path):
    doc = {
        "listen": "nowhere", "max_body_bytes": 10, "colour": "red", "timezone": "Mars/Olympus",
        "targets": {
            "dt": {"type": "dingtalk", "token_env": "NOT_SET_ANYWHERE", "rate_per_minute": 40,
                   "mention_userids": ["bob"], "url": f"https://oapi.dingtalk.com/robot/send?access_token={TOKEN}"},
            "wc": {"type": "wecom", "token_file": str(tmp_path / "missing-key"), "format": "html",
                   "mention_all_severities": ["urgent"], "secret_env": "DT_SECRET", "template": "nope.j2"},
            "odd": {"type": "slack", "token_env": "DT_TOKEN"},
        },
        "routes": [{"receivers": ["verl-critical"], "targets": ["dt", "ghost"]},
                   {"matchers": {"severity": {"regex": "("}, "bad-label": "x"}, "targets": ["wc"], "continue": "yes"},
                   {"receivers": ["verl-info"]}],
    }
    with pytest.raises(RelayConfigError) as e:
        parse_config(doc, base_dir=tmp_path, environ=ENV)
    expected = [  # each with its key path; the robot-only / console-only keys of a target type are unknown keys
        "listen: must be HOST:PORT", "max_body_bytes: Input should be greater than or equal to 1024",
        "colour: unknown key", "timezone: 'Mars/Olympus' is not a known IANA zone",
        "targets.dt.token_env: environment variable NOT_SET_ANYWHERE is not set",
        "targets.dt.rate_per_minute: 40 is over the robots' limit of 20",
        "targets.dt.mention_userids: unknown key",
        "targets.dt.url: must not carry access_token",
        "targets.wc.token_file: cannot read", "targets.wc.format: Input should be 'markdown' or 'text'",
        "targets.wc.mention_all_severities.0: Input should be 'critical'", "targets.wc.secret_env: unknown key",
        "targets.wc.template: cannot read", "targets.odd: type must be one of ['dingtalk', 'wecom', 'lark', 'console']",
        "routes.0: unknown target(s) ['ghost']", "routes.1.matchers.severity: regex does not compile",
        "routes.1.matchers.bad-label: the name 'bad-label': not a label name",
        "routes.1.continue: must be true or false",
        "routes.2.targets: missing",
    ]
    for want in expected:
        assert any(want in p for p in e.value.problems), (want, e.value.problems)
    assert len(e.value.problems) == len(expected), e.value.problems
    assert TOKEN not in str(e.value) and SECRET not in str(e.value)  # not even the token pasted into url


def test_secrets_load_from_env_or_file_and_never_print(tmp_path):
    (tmp_path / "key").write_text(WKEY + "\n")
    doc = {"targets": {"w": {"type": "wecom", "token_file": "key"}}, "routes": [{"targets": ["w"]}]}
    config = parse_config(doc, base_dir=tmp_path, environ={})
    token = config.targets["w"].token
    assert token.get_secret_value() == WKEY and token.source == f"file {tmp_path / 'key'}"
    assert isinstance(token, SecretStr)  # the library's secret type: pydantic never dumps it either
    assert str(token) == repr(token) == f"{token}" == "<secret>"
    assert WKEY not in repr(config) and "<secret>" in repr(config)
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(Secret("x"))


def test_an_unknown_key_deep_in_the_file_is_named_with_its_line(tmp_path):
    (tmp_path / "relay.yaml").write_text(
        "targets:\n"
        "  dt:\n"
        "    type: dingtalk\n"
        "    token_env: DT_TOKEN\n"
        "routes:\n"
        "  - targets: [dt]\n"
        "    matchers: {severity: critical}\n"
        "    continu: true\n")
    with pytest.raises(RelayConfigError) as e:
        load_config(tmp_path / "relay.yaml", environ=ENV)
    assert e.value.problems == [f"{tmp_path / 'relay.yaml'}:8: routes.0.continu: unknown key"]


def test_every_problem_of_a_file_is_listed_in_file_order_with_its_line(tmp_path):
    (tmp_path / "relay.yaml").write_text(
        "delivery:\n"
        "  max_attempts: 0\n"
        "targets:\n"
        "  dt: {type: dingtalk, token_env: DT_TOKEN, rate_per_minute: 30}\n"
        "routes:\n"
        "  - targets: [dt, ghost]\n")
    with pytest.raises(RelayConfigError) as e:
        load_config(tmp_path / "relay.yaml", environ=ENV)
    path = tmp_path / "relay.yaml"
    assert [p.split(": ", 2)[:2] for p in e.value.problems] == [
        [f"{path}:2", "delivery.max_attempts"], [f"{path}:4", "targets.dt.rate_per_minute"], [f"{path}:6", "routes.0"]]
    assert str(path) in str(e.value) and "3 problem(s)" in str(e.value)


def test_a_secret_never_shows_in_the_loaded_config_nor_in_a_problem(tmp_path):
    doc = {"bearer_token_env": "RELAY_TOKEN",
           "targets": {"dt": {"type": "dingtalk", "token_env": "DT_TOKEN", "secret_env": "DT_SECRET"},
                       "wc": {"type": "wecom", "token_env": "WECOM_KEY"}},
           "routes": [{"targets": ["dt", "wc"]}]}
    config = parse_config(doc, environ=ENV)
    for text in (repr(config), str(config), repr(config.targets["dt"]), repr(config.bearer_token)):
        assert not any(secret in text for secret in SECRETS), text
    assert config.targets["dt"].secret.get_secret_value() == SECRET  # still there for the sender
    # a secret pasted where its variable's name or its file goes, or into the URL: refused without echoing it
    (tmp_path / "empty").write_text("\n")
    bad = {"bearer_token_env": WEBHOOK,
           "targets": {"dt": {"type": "dingtalk", "token_env": TOKEN, "secret_file": str(tmp_path / "empty"),
                              "url": f"https://oapi.dingtalk.com/robot/send?access_token={TOKEN}&sign={SECRET}"},
                       "wc": {"type": "wecom", "token_file": str(tmp_path / WKEY)}},
           "routes": [{"targets": ["dt", "wc"]}]}
    with pytest.raises(RelayConfigError) as e:
        parse_config(bad, environ=ENV)
    text = "\n".join([str(e.value), repr(e.value), *e.value.problems])
    assert "bearer_token_env: must be the name of an environment variable" in text
    assert "targets.dt.token_env: must be the name of an environment variable" in text
    assert "targets.dt.url: must not carry access_token" in text and "is empty" in text
    for secret in (TOKEN, SECRET, WEBHOOK):
        assert secret not in text, secret


def test_example_config_loads_and_takes_every_alertmanager_receiver(tmp_path):
    (tmp_path / "wecom-key").write_text(WKEY)
    text = (REPO / "alertmanager/relay.example.yaml").read_text()
    text = text.replace("/etc/verl-relay/wecom-key", str(tmp_path / "wecom-key"))
    (tmp_path / "relay.yaml").write_text(text)
    config = load_config(tmp_path / "relay.yaml", environ={"VERL_DINGTALK_TOKEN": TOKEN,
                                                           "VERL_DINGTALK_SECRET": SECRET})
    assert set(config.targets) == {"dingtalk-oncall", "wecom-oncall"}
    am = yaml.safe_load((REPO / "alertmanager/alertmanager.yml").read_text())
    receivers = [r["name"] for r in am["receivers"]]
    missing = [r for r in receivers if not config.knows_receiver(r)]
    assert not missing, f"relay.example.yaml has no route for Alertmanager receiver(s) {missing}"
    crit = {"alertname": "X", "severity": "critical"}
    assert config.targets_for("verl-critical", crit) == ["dingtalk-oncall", "wecom-oncall"]
    assert config.targets_for("verl-warning", {"alertname": "X", "severity": "warning"}) == ["dingtalk-oncall"]
    assert config.targets_for("verl-info", {"alertname": "X", "severity": "info"}) == []


def test_routes_in_order_with_matchers_regex_and_continue(robots):
    dt, wc = robots
    doc = relay_doc(dt, wc, routes=[
        {"matchers": {"alertname": {"regex": "VerlGpu.*"}}, "targets": ["wecom"], "continue": True},
        {"matchers": {"severity": "critical"}, "targets": ["dingtalk"]},
        {"matchers": {"severity": "critical"}, "targets": ["wecom"]},  # never reached: the one above stops
    ])
    config = parse_config(doc, environ=ENV)
    assert config.targets_for("any", {"alertname": "VerlGpuXid", "severity": "critical"}) == ["wecom", "dingtalk"]
    assert config.targets_for("any", {"alertname": "VerlKL", "severity": "critical"}) == ["dingtalk"]
    assert config.targets_for("any", {"alertname": "VerlGpuXidButLonger", "severity": "info"}) == ["wecom"]
    assert config.targets_for("any", {"alertname": "VerlKL", "severity": "info"}) == []
    assert config.knows_receiver("whatever")  # a route without receivers takes any receiver


# ---------------------------------------------------------------- delivery
def test_delivery_is_signed_verified_by_the_robot_and_never_blocks_the_webhook(robots, start_relay):
    dt, wc = robots
    dt.delay = wc.delay = scaled(3.0)  # slow robots: the webhook must not wait for them
    relay = start_relay(relay_doc(dt, wc))
    code, body = post(relay, "verl-critical", webhook("verl-critical", [am_alert()]))
    assert (code, body["targets"]) == (200, {"dingtalk": 1, "wecom": 1})
    assert not dt.requests and not wc.requests  # answered while both robots still sat on theirs
    wait_for(lambda: dt.messages and wc.messages, timeout=15)
    (request,) = dt.requests
    assert request["errcode"] == 0  # the fake checked access_token, timestamp (within 1 h) and signature
    assert request["query"]["access_token"] == TOKEN and request["query"]["sign"]
    (msg,) = dt.messages
    assert msg["msgtype"] == "markdown" and "VerlGpuXid on rank 0" in msg["markdown"]["text"]
    assert msg["at"]["atMobiles"] == [MOBILE] and f"@{MOBILE}" in msg["markdown"]["text"]
    assert wc.requests[0]["query"]["key"] == WKEY
    assert "<@zhangsan>" in wc.messages[0]["markdown"]["content"]


def test_retries_after_http_500_and_a_dropped_connection(robots, start_relay):
    dt, wc = robots
    dt.fail_next(2, "500")
    dt.fail_next(1, "drop")
    relay = start_relay(relay_doc(dt, wc))
    assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning")]))[0] == 200
    m = wait_metric(relay, "verl_relay_messages_total", 1, target="dingtalk", result="sent")
    assert dt.errcodes() == [500, 500, "dropped", 0]
    assert sample(m, "verl_relay_messages_total", target="dingtalk", result="retried") == 3
    assert sample(m, "verl_relay_messages_total", target="dingtalk", result="sent") == 1
    assert sample(m, "verl_relay_robot_errors_total", target="dingtalk", errcode="http_500") == 2
    assert sample(m, "verl_relay_robot_errors_total", target="dingtalk", errcode="network") == 1
    assert sample(m, "verl_relay_alerts_total", target="dingtalk", result="delivered") == 1


@pytest.mark.parametrize("kind,errcode", [("dingtalk", 130101), ("wecom", 45009)])
def test_rate_limit_errcodes_are_retried_after_a_window(kind, errcode, start_relay):
    # The robot is stricter than the relay's own limit (someone else shares it): 1 message per window.
    dt = FakeDingTalk(TOKEN, SECRET, limit=1, window=0.5).start()
    wc = FakeWeCom(WKEY, limit=1, window=0.5).start()
    robot = dt if kind == "dingtalk" else wc
    try:
        doc = relay_doc(dt, wc, delivery={"rate_window_seconds": 0.5},
                        routes=[{"receivers": ["verl-warning"], "targets": [kind]}])
        relay = start_relay(doc)
        for i in range(2):
            assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=i)]))[0] == 200
            wait_for(lambda i=i: len(robot.requests) > i, timeout=5)
        wait_for(lambda: len(robot.messages) == 2, timeout=5)
        assert robot.errcodes() == [0, errcode, 0]
        m = metrics(relay)
        assert sample(m, "verl_relay_robot_errors_total", target=kind, errcode=str(errcode)) == 1
        assert sample(m, "verl_relay_messages_total", target=kind, result="retried") == 1
    finally:
        dt.stop()
        wc.stop()


@pytest.mark.parametrize("case", ["bad_signature", "stale_timestamp", "too_big", "wecom_too_long", "wrong_key"])
def test_permanent_errors_are_not_retried_and_are_logged_without_secrets(case, start_relay, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    # a robot whose clock is two hours ahead sees the relay's timestamp as stale
    clock = (lambda: time.time() + 7200) if case == "stale_timestamp" else time.time
    dt = FakeDingTalk(TOKEN, SECRET, max_body=300 if case == "too_big" else 20000, clock=clock).start()
    wc = FakeWeCom(WKEY).start()
    if case == "wecom_too_long":
        wc.LIMITS = {"markdown": 50, "text": 50}  # stricter than the relay's splitting assumes
    env = {"bad_signature": {**ENV, "DT_SECRET": "SECa-wrong-secret-1234"},
           "wrong_key": {**ENV, "WECOM_KEY": "SECa-wrong-secret-1234"}}.get(case, ENV)
    kind, errcode = {"bad_signature": ("dingtalk", 310000), "stale_timestamp": ("dingtalk", 310000),
                     "too_big": ("dingtalk", 460101), "wecom_too_long": ("wecom", 40058),
                     "wrong_key": ("wecom", 93000)}[case]
    robot = dt if kind == "dingtalk" else wc
    try:
        relay = start_relay(relay_doc(dt, wc, routes=[{"receivers": ["verl-warning"], "targets": [kind]}]),
                            environ=env)
        assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning")]))[0] == 200
        wait_for(lambda: sample(metrics(relay), "verl_relay_messages_total", target=kind, result="failed"), 5)
        time.sleep(scaled(0.3))  # room for a retry that must not happen
        assert robot.errcodes() == [errcode]  # exactly one request
        m = metrics(relay)
        assert sample(m, "verl_relay_alerts_total", target=kind, result="failed") == 1
        assert sample(m, "verl_relay_robot_errors_total", target=kind, errcode=str(errcode)) == 1
        assert sample(m, "verl_relay_messages_total", target=kind, result="retried") is None
        assert f"errcode {errcode}" in caplog.text and "NOT delivered" in caplog.text and "VerlGpuXid" in caplog.text
        if case == "stale_timestamp":
            assert "timestamp is out of date" in caplog.text
        out, err = capfd.readouterr()
        for secret in (*SECRETS, "SECa-wrong-secret-1234"):
            assert secret not in caplog.text + out + err
    finally:
        dt.stop()
        wc.stop()


def test_secrets_never_reach_logs_metrics_health_or_answers(robots, start_relay, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    dt, wc = robots
    closed = f"http://127.0.0.1:{free_port()}/robot/send"  # nothing listens: network errors, retried, given up
    doc = relay_doc(dt, wc, delivery={"max_attempts": 2})
    doc["targets"]["wecom"]["url"] = closed.replace("/robot/send", "/cgi-bin/webhook/send")
    relay = start_relay(doc)
    logging.getLogger("verl_exporter.relay").warning("a careless line with %s and %s", TOKEN, WKEY)
    logging_modules = [p.stem for p in Path(relay_app.__file__).parent.glob("*.py")
                       if "getLogger(__name__)" in p.read_text(encoding="utf-8")]
    assert {"app", "dispatch", "journal", "actions"} <= set(logging_modules)
    for module in logging_modules:  # each module logs under its own name; each is scrubbed
        logging.getLogger(f"verl_exporter.relay.{module}").warning("careless in %s: %s", module, SECRET)
    try:
        raise RuntimeError(f"a careless exception about {SECRET}")
    except RuntimeError:
        logging.getLogger("verl_exporter.relay").exception("and a traceback")
    answers = [post(relay, "verl-critical", webhook("verl-critical", [am_alert()])),
               post(relay, "verl-critical", b"{}", token="wrong"), post(relay, "nobody", b"{}"),
               post(relay, "verl-critical", b"[1")]
    wait_for(lambda: dt.messages and sample(metrics(relay), "verl_relay_alerts_total", target="wecom",
                                            result="failed"), timeout=5)
    seen = [caplog.text, *capfd.readouterr(), json.dumps(answers), http_get(relay.url + "/metrics")[2].decode(),
            http_get(relay.url + "/healthz")[2].decode(), repr(relay.config)]
    assert "a careless line with <secret> and <secret>" in caplog.text  # the relay's logger scrubs
    assert "a careless exception about <secret>" in caplog.text
    assert caplog.text.count("careless in ") == len(logging_modules)
    assert caplog.text.count(": <secret>") >= len(logging_modules)
    assert "network error" in caplog.text
    for secret in SECRETS:
        assert not any(secret in s for s in seen), secret


def test_bad_input_gets_the_right_4xx_and_the_relay_keeps_serving(robots, start_relay, caplog):
    dt, wc = robots
    relay = start_relay(relay_doc(dt, wc, max_body_bytes=4096))
    good = webhook("verl-warning", [am_alert(severity="warning")])
    missing = webhook("verl-warning", [{"labels": {"alertname": "X"}}])
    cases = [
        ("malformed JSON", "verl-warning", b'{"version": "4", ', WEBHOOK, 400, "not JSON"),
        ("missing fields", "verl-warning", missing, WEBHOOK, 400, "alerts.0.status: Field required"),
        ("oversize body", "verl-warning", b" " * 5000, WEBHOOK, 413, "over max_body_bytes"),
        ("no token", "verl-warning", good, None, 401, "bearer token"),
        ("wrong token", "verl-warning", good, "guess", 401, "bearer token"),
        ("unknown receiver", "verl-nobody", good, WEBHOOK, 404, "no route"),
        ("bad receiver name", "..%2f..", good, WEBHOOK, 404, "no route"),
    ]
    for name, receiver, body, token, code, words in cases:
        got, answer = post(relay, receiver, body, token=token)
        assert got == code, (name, answer)
        assert words in json.dumps(answer), (name, answer)
    assert post(relay, "verl-warning", b"", method="GET")[0] == 405
    # a 405 names what is allowed; /healthz is read-only, like the sidecar's
    for path, method, allowed in [("/alert/verl-warning", "GET", "POST"), ("/healthz", "POST", "GET, HEAD"),
                                  ("/healthz", "DELETE", "GET, HEAD")]:
        req = urllib.request.Request(relay.url + path, data=b"" if method == "POST" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=scaled(5))
        assert (refused.value.code, refused.value.headers.get("Allow")) == (405, allowed), (path, method)
    assert post(relay, "verl-warning", good)[0] == 200
    wait_for(lambda: dt.messages, timeout=5)
    m = metrics(relay)
    assert sample(m, "verl_relay_requests_total", receiver="verl-warning", code="400") == 2
    assert sample(m, "verl_relay_requests_total", receiver="verl-warning", code="413") == 1
    assert sample(m, "verl_relay_requests_total", receiver="verl-warning", code="401") == 2
    assert sample(m, "verl_relay_requests_total", receiver="unknown", code="404") == 2
    assert sample(m, "verl_relay_requests_total", receiver="verl-warning", code="200") == 1
    assert "alerts.0.status: Field required" in caplog.text  # 4xx are logged with the reason


def test_deeply_nested_json_gets_400_counted_with_its_reason(robots, start_relay):
    dt, wc = robots
    relay = start_relay(relay_doc(dt, wc, max_body_bytes=4 * 1024 * 1024))
    deep = b'{"version": "4", "alerts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    code, answer = post(relay, "verl-warning", deep)
    assert code == 400 and "nested too deeply" in json.dumps(answer), answer
    huge_int = b'{"version": ' + b"9" * 5000 + b"}"  # over Python's integer digit limit: a ValueError
    code, answer = post(relay, "verl-warning", huge_int)
    assert code == 400 and "not JSON" in json.dumps(answer), answer
    m = metrics(relay)
    assert sample(m, "verl_relay_rejected_payloads_total", reason="too_deep") == 1
    assert sample(m, "verl_relay_rejected_payloads_total", reason="not_json") == 1
    assert sample(m, "verl_relay_requests_total", receiver="verl-warning", code="400") == 2
    assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning")]))[0] == 200


def test_unrouted_alerts_are_accepted_and_counted(robots, start_relay):
    dt, wc = robots
    relay = start_relay(relay_doc(dt, wc))
    code, body = post(relay, "verl-info", webhook("verl-info", [am_alert(severity="info"),
                                                                 am_alert(severity="info", i=1)]))
    assert (code, body["targets"]) == (200, {})
    assert sample(metrics(relay), "verl_relay_alerts_total", target="", result="unrouted") == 2


def test_queue_full_answers_503_so_alertmanager_retries(robots, start_relay):
    dt, wc = robots
    dt.delay = 1.0
    relay = start_relay(relay_doc(dt, wc, delivery={"queue_max_alerts": 5}))
    assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=i)
                                                                for i in range(5)]))[0] == 200
    code, body = post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=i)
                                                                      for i in range(5, 11)]))
    assert code == 503 and "full" in body["error"]
    health = json.loads(http_get(relay.url + "/healthz")[2])
    assert health["status"] == "ok" and health["targets"]["dingtalk"]["queue_depth"] == 5


def test_a_newer_state_of_a_queued_alert_replaces_it(robots, start_relay):
    dt, wc = robots
    dt.delay = 0.5
    relay = start_relay(relay_doc(dt, wc))
    # the first webhook occupies the robot; the next two queue up behind it
    post(relay, "verl-warning", webhook("verl-warning", [am_alert("VerlFirst", "warning")]))
    wait_for(lambda: dt.arrived, timeout=5)
    post(relay, "verl-warning", webhook("verl-warning", [am_alert("VerlFlap", "warning")]))
    post(relay, "verl-warning", webhook("verl-warning", [am_alert("VerlFlap", "warning", status="resolved")],
                                        status="resolved"))
    wait_for(lambda: len(dt.messages) == 2, timeout=5)
    second = texts(dt)[1]
    assert "RESOLVED · WARNING · VerlFlap" in second and "FIRING" not in second
    assert sample(metrics(relay), "verl_relay_alerts_total", target="dingtalk", result="superseded") == 1


# ---------------------------------------------------------------- shutdown and spool
def test_shutdown_spools_what_is_left_and_the_next_start_resends_it(robots, start_relay, tmp_path):
    dt, wc = robots
    dt.fail_next(100000, "500")  # the robot is down
    doc = relay_doc(dt, wc, spool_dir=str(tmp_path / "spool"))
    relay = start_relay(doc)
    alerts = [am_alert(severity="warning", i=i) for i in range(3)]
    assert post(relay, "verl-warning", webhook("verl-warning", alerts))[0] == 200
    wait_for(lambda: len(dt.requests) >= 2, timeout=5)
    assert relay.stop(drain_seconds=0.3) == {"dingtalk": 3}
    (spool,) = (tmp_path / "spool").glob("relay-spool-*.json")
    text = spool.read_text()
    assert not any(s in text for s in SECRETS)
    saved = json.loads(text)["alerts"]
    assert sorted(e["alert"]["labels"]["rank"] for e in saved) == ["0", "1", "2"]
    assert {e["target"] for e in saved} == {"dingtalk"} and {e["receiver"] for e in saved} == {"verl-warning"}
    assert sample(metrics_of(relay), "verl_relay_alerts_total", target="dingtalk", result="spooled") == 3

    dt.heal()
    again = start_relay(doc)
    wait_metric(again, "verl_relay_alerts_total", 3, target="dingtalk", result="delivered")
    assert sorted(re.findall(r"node(\d{4}):9477", texts(dt)[0])) == ["0000", "0001", "0002"]
    assert not list((tmp_path / "spool").glob("relay-spool-*"))


def crash(relay) -> None:
    """Stop a relay the way kill -9 does: no drain, no spool, nothing written at exit."""
    relay._stopped.set()
    for w in relay.dispatcher.workers.values():
        w.stop_now()
    relay._server.stop()
    if relay.dispatcher.journal is not None:  # the kernel drops a killed process's lock on spool_dir
        relay.dispatcher.journal.lock.release()


def test_a_relay_killed_after_loading_the_spool_loses_nothing(robots, start_relay, tmp_path):
    dt, wc = robots
    dt.fail_next(100000, "500")
    doc = relay_doc(dt, wc, spool_dir=str(tmp_path / "spool"))
    first = start_relay(doc)
    assert post(first, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=i)
                                                                for i in range(3)]))[0] == 200
    assert first.stop(drain_seconds=0.2) == {"dingtalk": 3}
    second = start_relay(doc)  # loads the spool; the robot still fails
    wait_for(lambda: dt.arrived >= 3, timeout=5)
    crash(second)
    dt.heal()
    third = start_relay(doc)
    wait_metric(third, "verl_relay_alerts_total", 3, target="dingtalk", result="delivered")
    assert sorted(re.findall(r"node(\d{4}):9477", " ".join(texts(dt)))) == ["0000", "0001", "0002"]
    third.stop(drain_seconds=1)
    assert not list((tmp_path / "spool").glob("relay-spool-*")) and not list((tmp_path / "spool").glob("*.tmp"))


def test_alerts_accepted_before_a_kill_are_sent_by_the_next_start(robots, start_relay, tmp_path):
    dt, wc = robots
    dt.fail_next(100000, "500")
    doc = relay_doc(dt, wc, spool_dir=str(tmp_path / "spool"))
    first = start_relay(doc)
    assert post(first, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=7)]))[0] == 200
    crash(first)
    dt.heal()
    again = start_relay(doc)
    wait_metric(again, "verl_relay_alerts_total", 1, target="dingtalk", result="delivered")
    assert "node0007" in texts(dt)[0]


def test_the_rate_limit_holds_across_a_restart(start_relay, tmp_path):
    minute = 4.0
    dt = FakeDingTalk(TOKEN, SECRET, window=minute).start()
    wc = FakeWeCom(WKEY, window=minute).start()
    try:
        doc = relay_doc(dt, wc, spool_dir=str(tmp_path / "spool"), delivery={"rate_window_seconds": minute})
        for run, count in enumerate((15, 10)):
            relay = start_relay(doc)
            worker = relay.dispatcher.workers["dingtalk"]
            for i in range(count):  # one message each while the rate allows
                post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=run * 100 + i)]))
                wait_for(lambda w=worker: not w.state()[0], timeout=3 * minute)
            relay.stop(drain_seconds=3 * minute)
        assert dt.rate_rejections == 0, dt.errcodes()
        times = dt.accepted_times
        assert len(times) > 20 and all(b - a >= minute * 0.999 for a, b in zip(times, times[20:], strict=False))
        assert sum(len(re.findall(r"node\d{4}:9477", t)) for t in texts(dt)) == 25
    finally:
        dt.stop()
        wc.stop()


def test_spool_files_are_private_and_a_full_disk_leaves_no_temporary_file(robots, start_relay, tmp_path,
                                                                         monkeypatch):
    dt, wc = robots
    dt.fail_next(100000, "500")
    doc = relay_doc(dt, wc, spool_dir=str(tmp_path / "spool"))
    relay = start_relay(doc)
    post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning")]))
    assert relay.stop(drain_seconds=0.2) == {"dingtalk": 1}
    files = list((tmp_path / "spool").iterdir())
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files), files

    relay = start_relay(doc)
    post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=1)]))
    real_write = os.write

    def full_disk(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    relay.stop(drain_seconds=0.2)
    monkeypatch.undo()
    assert not list((tmp_path / "spool").glob("*.tmp"))
    assert sample(metrics_of(relay), "verl_relay_spool_errors_total", operation="write") >= 1
    dt.heal()
    again = start_relay(doc)  # the journal kept both alerts
    wait_metric(again, "verl_relay_alerts_total", 2, target="dingtalk", result="delivered")


def test_a_spool_dir_that_is_a_file_fails_the_config_check(robots, tmp_path):
    dt, wc = robots
    (tmp_path / "spool").write_text("")
    with pytest.raises(RelayConfigError, match="spool_dir: .* is not a directory"):
        parse_config(relay_doc(dt, wc, spool_dir=str(tmp_path / "spool")), environ=ENV)
    assert "is not a directory" in check_spool_dir(tmp_path / "spool" / "below")  # what --check-config adds
    assert check_spool_dir(tmp_path / "new" / "spool") is None


def metrics_of(relay) -> dict:
    """The metrics of a relay that no longer serves HTTP."""
    from prometheus_client import generate_latest

    return parse_metrics(generate_latest(relay.metrics.registry()).decode())


def test_shutdown_drains_the_queue_before_exiting(robots, start_relay, tmp_path):
    dt, wc = robots
    dt.delay = 0.05
    relay = start_relay(relay_doc(dt, wc, spool_dir=str(tmp_path)))
    for i in range(30):
        assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=i)]))[0] == 200
    assert relay.stop(drain_seconds=5) == {}
    listed = [n for t in texts(dt) for n in re.findall(r"node(\d{4}):9477", t)]
    assert sorted(listed) == [f"{i:04d}" for i in range(30)]
    assert not list(tmp_path.glob("relay-spool-*"))


# ---------------------------------------------------------------- metrics
def test_metrics_are_declared_in_the_spec_and_count_what_happened(robots, start_relay):
    dt, wc = robots
    relay = start_relay(relay_doc(dt, wc))
    post(relay, "verl-critical", webhook("verl-critical", [am_alert(), am_alert(i=1)]))
    for target in ("dingtalk", "wecom"):
        wait_metric(relay, "verl_relay_messages_total", 1, target=target, result="sent")
    status, _, body = http_get(relay.url + "/metrics")
    text = body.decode()
    for m in load_spec().instrumented("relay"):
        assert f"# HELP {m.name} {m.help}" in text, m.name
    exported = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP")}
    assert exported == {m.name for m in load_spec().instrumented("relay")}  # nothing named only in code
    m = parse_metrics(text)
    assert sample(m, "verl_relay_requests_total", receiver="verl-critical", code="200") == 1
    for target in ("dingtalk", "wecom"):
        assert sample(m, "verl_relay_messages_total", target=target, result="sent") == 1
        assert sample(m, "verl_relay_alerts_total", target=target, result="delivered") == 2
        assert sample(m, "verl_relay_queue_depth", target=target) == 0
        assert sample(m, "verl_relay_send_duration_seconds_total", target=target) > 0


# ---------------------------------------------------------------- burst
def test_a_burst_of_1000_alerts_in_one_minute_is_merged_and_nothing_is_lost(start_relay):
    """1,000 alerts in one (simulated) minute to one robot that allows 20 messages a minute."""
    minute = 3.0  # long enough for the 1,000 webhooks to arrive within one window
    dt = FakeDingTalk(TOKEN, SECRET, window=minute).start()
    wc = FakeWeCom(WKEY, window=minute).start()
    try:
        _burst(dt, wc, start_relay(relay_doc(dt, wc, delivery={"rate_window_seconds": minute})), minute)
    finally:
        dt.stop()
        wc.stop()


def _burst(dt, wc, relay, minute: float) -> None:
    started = time.monotonic()

    def send(i):
        return post(relay, "verl-warning", webhook("verl-warning", [am_alert(f"VerlBurst{i % 10}", "warning", i=i)]))

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(send, range(1000)))
    posted = time.monotonic() - started
    assert {c for c, _ in codes} == {200}

    def delivered():
        return {int(n) for t in texts(dt) for n in re.findall(r"node(\d{4}):9477", t)}

    wait_for(lambda: len(delivered()) == 1000, timeout=30)
    took = time.monotonic() - started
    # the worker counts a message once the robot's answer is in, a moment after the robot recorded it
    m = wait_metric(relay, "verl_relay_alerts_total", 1000, target="dingtalk", result="delivered")
    assert sample(m, "verl_relay_alerts_total", target="dingtalk", result="failed") is None
    assert dt.rate_rejections == 0  # the relay's own limit kept it under the robot's
    assert sum(len(re.findall(r"node\d{4}:9477", t)) for t in texts(dt)) == 1000  # each alert exactly once
    # never more than 20 messages in any window
    times = dt.accepted_times
    assert all(b - a >= minute * 0.999 for a, b in zip(times, times[20:], strict=False))
    print(f"\nburst: 1000 alerts posted in {posted:.2f}s, delivered in {len(dt.messages)} messages "
          f"after {took:.2f}s (window {minute}s = one simulated minute)")
    # Merged: at most 20 messages for each window the posting spanned, plus one window to drain the rest (40
    # when the 1,000 arrive within one window; a loaded machine may take longer to post them).
    assert len(dt.messages) <= 20 * (math.ceil(posted / minute) + 1)


# ---------------------------------------------------------------- the command line
def test_cli_checks_config_and_sigterm_spools_without_leaking_secrets(robots, tmp_path):
    dt, wc = robots
    dt.fail_next(100000, "drop")
    doc = relay_doc(dt, wc, spool_dir=str(tmp_path / "spool"), listen=f"127.0.0.1:{free_port()}")
    doc["delivery"]["drain_seconds"] = 0.5
    (tmp_path / "relay.yaml").write_text(yaml.safe_dump(doc))
    env = {**os.environ, **ENV}
    cmd = [sys.executable, "-m", "verl_exporter.relay", "--config", str(tmp_path / "relay.yaml")]
    check = subprocess.run([*cmd, "--check-config"], env=env, capture_output=True, text=True, timeout=scaled(30))
    assert check.returncode == 0 and "config ok" in check.stdout and "token from env DT_TOKEN" in check.stdout
    bad = subprocess.run(cmd, env={k: v for k, v in env.items() if k != "DT_TOKEN"}, capture_output=True,
                         text=True, timeout=scaled(30))
    assert bad.returncode == 2 and "targets.dingtalk.token_env: environment variable DT_TOKEN is not set" in bad.stderr

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://{doc['listen']}"
        wait_for(lambda: _up(url, proc), timeout=20)
        relay = type("R", (), {"url": url})
        assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning")]))[0] == 200
        wait_for(lambda: dt.requests, timeout=5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=scaled(20))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "spooled 1 undelivered alert(s)" in out
    assert len(list((tmp_path / "spool").glob("relay-spool-*.json"))) == 1
    assert not any(s in out + check.stdout + bad.stderr for s in SECRETS)


def _up(url: str, proc) -> bool:
    if proc.poll() is not None:
        raise AssertionError(proc.stdout.read())
    try:
        return http_get(url + "/healthz", timeout=1)[0] == 200
    except OSError:
        return False


# ---------------------------------------------------------------- a real Alertmanager
def test_end_to_end_with_the_real_alertmanager(robots, start_relay, tmp_path):
    binary = require_tool("prometheus-alertmanager")
    dt, wc = robots
    lark = FakeLark(LTOKEN, LSECRET).start()
    doc = relay_doc(dt, wc)
    doc["targets"]["lark"] = {"type": "lark", "url": lark.hook, "token_env": "LARK_TOKEN",
                              "secret_env": "LARK_SECRET", "mention_userids": ["ou_5d1e"]}
    doc["routes"][0]["targets"].append("lark")
    relay = start_relay(doc, environ={**ENV, "LARK_TOKEN": LTOKEN, "LARK_SECRET": LSECRET})
    (tmp_path / "relay-token").write_text(WEBHOOK)
    am = yaml.safe_load((REPO / "alertmanager/alertmanager.yml").read_text())

    def shorten(route, top=True):
        # notify within a second; child routes inherit the root's timers
        if top:
            route["group_wait"], route["group_interval"] = "1s", "1s"
        else:
            route.pop("group_wait", None)
            route.pop("group_interval", None)
        for child in route.get("routes", []):
            shorten(child, top=False)

    shorten(am["route"])
    for receiver in am["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = relay.url + urlsplit(hook["url"]).path
            hook["http_config"] = {"authorization": {"credentials_file": str(tmp_path / "relay-token")}}
    (tmp_path / "am.yml").write_text(yaml.safe_dump(am))
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    proc = Proc("alertmanager", [binary, f"--config.file={tmp_path / 'am.yml'}",
                                 f"--storage.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--cluster.listen-address="])
    try:
        wait_for(lambda: ready(api + "/-/ready", proc), timeout=20)
        now = datetime.now(timezone.utc)
        labels = {"alertname": "VerlGpuXid", "severity": "critical", "job": "verl", "run": "e2e", "rank": "3",
                  "instance": "node3:9477"}
        alert = {"labels": labels, "generatorURL": "http://prometheus:9090/graph",
                 "annotations": {"summary": "GPU 3 raised XID 79 (fell off the bus)",
                                 "description": "Drain node3 and reboot it.",
                                 "runbook_url": "https://example.org/runbook#verlgpuxid"},
                 "startsAt": now.isoformat(), "endsAt": (now + timedelta(hours=1)).isoformat()}
        am_post_alerts(api, [alert])
        wait_for(lambda: dt.messages and wc.messages and lark.messages, timeout=15)
        card = lark.messages[0]["card"]  # signed, verified by the loopback robot
        assert card["header"]["template"] == "red" and "VerlGpuXid" in card["header"]["title"]["content"]
        assert "run e2e · rank 3 · instance node3:9477" in card["elements"][0]["content"]
        assert card["elements"][0]["content"].endswith("<at id=ou_5d1e></at>")
        fired = dt.messages[0]
        assert "FIRING · CRITICAL · VerlGpuXid" in fired["markdown"]["text"]
        assert "GPU 3 raised XID 79 （fell off the bus）" in fired["markdown"]["text"]
        assert "run e2e · rank 3 · instance node3:9477" in fired["markdown"]["text"]
        assert fired["at"]["atMobiles"] == [MOBILE] and f"@{MOBILE}" in fired["markdown"]["text"]
        assert "<@zhangsan>" in wc.messages[0]["markdown"]["content"]

        am_post_alerts(api, [{**alert, "endsAt": (datetime.now(timezone.utc) - timedelta(seconds=1)).isoformat()}])
        wait_for(lambda: any("RESOLVED · CRITICAL · VerlGpuXid" in t for t in texts(dt)), timeout=15)
        resolved = next(m for m in dt.messages if "RESOLVED" in m["markdown"]["text"])
        assert resolved["at"] == {"atMobiles": [], "isAtAll": False}  # nobody is woken for a resolution
        assert all(r.get("errcode") == 0 for r in dt.requests)
        wait_for(lambda: len(lark.messages) == 2, timeout=15)
        assert lark.messages[1]["card"]["header"]["template"] == "green" and lark.errcodes() == [0, 0]
        m = metrics(relay)
        assert sample(m, "verl_relay_requests_total", receiver="verl-critical", code="200") >= 2
    finally:
        proc.stop()
        lark.stop()


def test_payload_round_trips_through_the_spool_form():
    p = parse_payload(json.dumps(webhook("r", [am_alert(status="resolved")])))
    again = parse_payload(json.dumps(webhook("r", [a.to_dict() for a in p.alerts])))
    assert again.alerts == p.alerts

