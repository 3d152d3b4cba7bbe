"""The Feishu/Lark custom bot target: its card, its signature, its size limit and its error codes.

The loopback robot (robots.FakeLark) checks the signature the way Lark's server does: from the timestamp and
sign in the body, keyed by "<ts>\\n<secret>".
"""

from __future__ import annotations

import json
import logging
import time

import pytest
from conftest import sample, wait_for
from helpers import scaled
from relay_helpers import am_alert, metrics, post, relay_doc, webhook
from robots import FakeDingTalk, FakeLark, FakeWeCom
from verl_exporter.relay.config import RelayConfigError, parse_config
from verl_exporter.relay.dispatch import ROBOT_BURSTS, RateLimiter
from verl_exporter.relay.format import LARK_MAX_BODY, format_messages
from verl_exporter.relay.payload import parse_alert, parse_payload
from verl_exporter.relay.preview import preview
from verl_exporter.relay.senders import RobotSender, lark_signed
from verl_exporter.relay.summary import summarise
from verl_exporter.relay.terminal import render

LTOKEN = "lark-hook-token-4b7e2a90"
LSECRET = "lark-signing-secret-c31d5f"
RUNBOOKS = "https://example.org/runbook"
ENV = {"DT_TOKEN": "dt", "DT_SECRET": "SECdt", "WECOM_KEY": "wk", "RELAY_TOKEN": "webhook-bearer-9e1f7d20",
       "LARK_TOKEN": LTOKEN, "LARK_SECRET": LSECRET}


def lark(url: str = "https://open.feishu.cn/open-apis/bot/v2/hook", **over):
    doc = {"targets": {"lark": {"type": "lark", "url": url, "token_env": "LARK_TOKEN", "secret_env": "LARK_SECRET",
                                **over}}, "routes": [{"targets": ["lark"]}], "runbook_urls": [RUNBOOKS]}
    return parse_config(doc, environ=ENV).targets["lark"]


def alert(severity="critical", status="firing", i=0, name="VerlGpuXid", **ann):
    return parse_alert("alert", am_alert(name=name, severity=severity, status=status, i=i, **ann), [])


# ---------------------------------------------------------------- format (pure)
def test_a_card_has_a_header_coloured_by_severity_the_run_summary_and_runbook_link():
    (msg,) = format_messages([alert()], lark())
    card = msg.payload["card"]
    assert msg.payload["msg_type"] == "interactive" and card["header"]["template"] == "red"
    assert card["header"]["title"]["content"].startswith("[verl] FIRING 1 critical: VerlGpuXid")
    text = msg.text
    assert "run ppo · rank 0" in text and "VerlGpuXid on rank 0" in text
    assert "[Runbook](https://example.org/runbook#verlgpuxid)" in text
    assert not text.startswith("####")  # the title is the header's, not repeated
    (warn,) = format_messages([alert("warning")], lark())
    (done,) = format_messages([alert(status="resolved")], lark())
    assert warn.payload["card"]["header"]["template"] == "orange"
    assert done.payload["card"]["header"]["template"] == "green"


def test_mentions_are_the_relays_only_and_an_alert_cannot_inject_one():
    target = lark(mention_userids=["ou_3f2a"], mention_all_severities=["critical"])
    (msg,) = format_messages([alert(summary='<at id=all></at> <at user_id="ou_x"></at>')], target)
    assert msg.text.count("<at ") == 2 and msg.text.endswith("<at id=ou_3f2a></at> <at id=all></at>")
    (quiet,) = format_messages([alert("warning")], target)
    assert "<at " not in quiet.text
    (text,) = format_messages([alert()], lark(format="text", mention_userids=["ou_3f2a"]))
    assert text.payload["msg_type"] == "text" and text.text.endswith('<at user_id="ou_3f2a"></at>')


def test_a_summary_of_31_warnings_and_1_critical_is_red_and_mentions():
    members = [alert("warning", i=i) for i in range(31)] + [alert("critical", i=31)]
    summary, merged = summarise(members)
    assert merged == 32
    (msg,) = format_messages(summary, lark(mention_userids=["ou_3f2a"]))
    assert msg.payload["card"]["header"]["template"] == "red"
    assert "critical" in msg.payload["card"]["header"]["title"]["content"]
    assert msg.text.endswith("<at id=ou_3f2a></at>")
    quiet, _ = summarise([alert("warning", i=i) for i in range(32)])  # all warnings: no one is rung
    (msg,) = format_messages(quiet, lark(mention_userids=["ou_3f2a"]))
    assert "<at " not in msg.text and msg.payload["card"]["header"]["template"] != "red"


def test_a_fleet_wide_page_is_split_under_20_kb_even_once_signed():
    alerts = [alert(i=i, description="x" * 300) for i in range(400)]
    messages = format_messages(alerts, lark())
    assert len(messages) > 1 and sum(m.alerts for m in messages) == 400
    for m in messages:
        assert len(m.body) <= LARK_MAX_BODY
        assert len(lark_signed(m.body, LSECRET, int(time.time()))) <= 20 * 1024
    summary, _ = summarise([alert(i=i, name="VerlExporterDown") for i in range(4096)])
    (one,) = format_messages(summary, lark())  # 4,096 ranks down: one summary card
    assert "4,096 alerts" in one.text and len(one.body) <= LARK_MAX_BODY


def test_config_keeps_the_token_out_of_the_url_and_refuses_mobiles():
    for over, needle in [({"url": "https://open.feishu.cn/open-apis/bot/v2/hook/abc"}, "must end in /hook"),
                         ({"mention_mobiles": ["13800000000"]}, "cannot mention by mobile")]:
        with pytest.raises(RelayConfigError) as e:
            lark(**over)
        assert needle in str(e.value) and LTOKEN not in str(e.value) and LSECRET not in str(e.value)
    larksuite = lark("https://open.larksuite.com/open-apis/bot/v2/hook")
    assert RobotSender(larksuite).url() == f"https://open.larksuite.com/open-apis/bot/v2/hook/{LTOKEN}"


def test_the_console_and_preview_show_the_card_as_lark_would():
    target = parse_config({"targets": {"c": {"type": "console", "style": "lark", "mention_userids": ["ou_1"]}},
                           "routes": [{"targets": ["c"]}], "runbook_urls": [RUNBOOKS]}).targets["c"]
    (msg,) = format_messages([alert()], target.as_robot())
    shown = render(msg.payload, "lark")
    assert "Lark robot · card (red) · [verl] FIRING 1 critical: VerlGpuXid" in shown
    assert "rings @ou_1" in shown and "<at" not in shown and "Runbook (https://example.org/runbook" in shown


def test_preview_shows_the_lark_card_without_its_secrets():
    doc = {"targets": {"lark": {"type": "lark", "token_env": "LARK_TOKEN", "secret_env": "LARK_SECRET"}},
           "routes": [{"targets": ["lark"]}], "runbook_urls": [RUNBOOKS]}
    config = parse_config(doc, environ={}, secrets_needed=False)
    lines: list[str] = []
    payload = parse_payload(json.dumps(webhook("verl-critical", [am_alert(), am_alert(severity="warning", i=1)])))
    assert preview(config, payload, out=lines.append) == 0
    out = "\n".join(lines)
    assert "target lark (lark, markdown): 2 alert(s) in 1 message(s)" in out
    assert "╭─ Lark robot · card (red) · [verl] FIRING 2 critical" in out and "[Runbook]" not in out
    assert "│ FIRING · WARNING · VerlGpuXid" in out
    lines.clear()
    assert preview(config, payload, out=lines.append, body=True) == 0
    (body,) = [ln for ln in lines if ln.startswith("{")]
    assert json.loads(body)["msg_type"] == "interactive" and "sign" not in body  # signed only when sent


def test_a_lark_bot_gets_at_most_5_messages_a_second_within_its_minute():
    now = [0.0]
    limiter = RateLimiter(20, 60.0, clock=lambda: now[0], burst=ROBOT_BURSTS["lark"])
    for _ in range(5):
        assert limiter.delay() == 0
        limiter.record()
    assert limiter.delay() == 1.0  # a sixth within the second would get 11232
    for step in range(15):
        now[0] = 1.0 + step
        assert limiter.delay() == 0
        limiter.record()
    now[0] = 30.0
    assert limiter.delay() == 30.0  # 20 in the minute: the minute's limit still holds


# ---------------------------------------------------------------- against the loopback robot
def doc_for(robot: FakeLark, **over) -> dict:
    dt, wc = FakeDingTalk("dt"), FakeWeCom("wk")  # never started: routes only reach lark
    doc = relay_doc(dt, wc, **over)
    doc["targets"]["lark"] = {"type": "lark", "url": robot.hook, "token_env": "LARK_TOKEN",
                              "secret_env": "LARK_SECRET"}
    doc["routes"] = [{"targets": ["lark"]}]
    return doc


@pytest.mark.integration
def test_delivery_is_signed_and_verified_by_the_robot(start_relay):
    robot = FakeLark(LTOKEN, LSECRET).start()
    try:
        relay = start_relay(doc_for(robot), environ=ENV)
        assert post(relay, "verl-critical", webhook("verl-critical", [am_alert()]))[0] == 200
        wait_for(lambda: robot.messages, timeout=5)
        assert robot.errcodes() == [0]
        sent = json.loads(robot.requests[0]["body"])
        assert sent["timestamp"].isdigit() and sent["sign"] and sent["msg_type"] == "interactive"
        assert LTOKEN not in json.dumps(sample(metrics(relay), "verl_relay_alerts_total", target="lark",
                                               result="delivered"))
    finally:
        robot.stop()


@pytest.mark.integration
@pytest.mark.parametrize("case", ["bad_signature", "stale_timestamp", "too_big"])
def test_permanent_errors_are_not_retried_and_logged_without_secrets(case, start_relay, caplog, capfd):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    clock = (lambda: time.time() + 7200) if case == "stale_timestamp" else time.time
    robot = FakeLark(LTOKEN, LSECRET, max_body=300 if case == "too_big" else 20 * 1024, clock=clock).start()
    env = {**ENV, "LARK_SECRET": "a-wrong-secret-1234"} if case == "bad_signature" else ENV
    errcode = 9499 if case == "too_big" else 19021
    try:
        relay = start_relay(doc_for(robot), environ=env)
        assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning")]))[0] == 200
        wait_for(lambda: sample(metrics(relay), "verl_relay_messages_total", target="lark", result="failed"), 5)
        time.sleep(scaled(0.3))  # room for a retry that must not happen
        assert robot.errcodes() == [errcode]
        assert sample(metrics(relay), "verl_relay_robot_errors_total", target="lark", errcode=str(errcode)) == 1
        assert f"errcode {errcode}" in caplog.text and "NOT delivered" in caplog.text
        out, err = capfd.readouterr()
        for secret in (LTOKEN, LSECRET, "a-wrong-secret-1234"):
            assert secret not in caplog.text + out + err
    finally:
        robot.stop()


@pytest.mark.integration
def test_the_rate_limit_code_is_retried_after_a_window(start_relay):  # noqa: F811
    robot = FakeLark(LTOKEN, LSECRET, limit=1, window=0.5).start()  # someone else shares the bot
    try:
        relay = start_relay(doc_for(robot, delivery={"rate_window_seconds": 0.5}), environ=ENV)
        for i in range(2):
            assert post(relay, "verl-warning", webhook("verl-warning", [am_alert(severity="warning", i=i)]))[0] == 200
            wait_for(lambda i=i: len(robot.requests) > i, timeout=5)
        wait_for(lambda: len(robot.messages) == 2, timeout=5)
        assert robot.errcodes() == [0, 11232, 0]
        assert sample(metrics(relay), "verl_relay_messages_total", target="lark", result="retried") == 1
    finally:
        robot.stop()


@pytest.mark.integration
def test_retries_after_http_500_and_a_dropped_connection(start_relay):  # noqa: F811
    robot = FakeLark(LTOKEN, LSECRET).start()
    try:
        robot.fail_next(1, "500")
        robot.fail_next(1, "drop")
        relay = start_relay(doc_for(robot), environ=ENV)
        assert post(relay, "verl-critical", webhook("verl-critical", [am_alert()]))[0] == 200
        wait_for(lambda: robot.messages, timeout=5)
        assert robot.errcodes() == [500, "dropped", 0]
    finally:
        robot.stop()
