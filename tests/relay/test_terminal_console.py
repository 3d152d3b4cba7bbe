"""The relay's console target and `relay --preview`: messages exactly as the robot target formats them, shown
as the group chat shows them, and nothing sent."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import wait_for
from helpers import scaled
from relay_helpers import am_alert, post, webhook
from robots import FakeDingTalk
from verl_exporter.relay.app import Relay
from verl_exporter.relay.config import RelayConfigError, parse_config
from verl_exporter.relay.format import pack
from verl_exporter.relay.payload import parse_payload
from verl_exporter.relay.senders import ConsoleSender, make_sender
from verl_exporter.relay.terminal import color_code, render, wrap

ANSI = re.compile(r"\x1b\[[0-9;]*m")
TOKEN, SECRET = "dt-console-token-1", "SECconsolesecret"
ROBOT_SETTINGS = {"mention_mobiles": ["13800000000"], "mention_all_severities": ["critical"]}


def console_doc(**console) -> dict:
    return {"targets": {"preview": {"type": "console", **console}}, "routes": [{"targets": ["preview"]}],
            "runbook_urls": ["https://example.org/runbook"]}  # where am_alert's runbooks point


# ---------------------------------------------------------------- config
def test_a_console_target_needs_no_endpoint_and_formats_as_its_style():
    config = parse_config(console_doc(style="wecom", mention_userids=["zhangsan"]), environ={})
    t = config.targets["preview"]
    assert (t.type, t.robot, t.show, t.color, t.file) == ("console", "wecom", "rendered", "auto", None)
    assert t.as_robot().type == "wecom" and t.secrets() == []
    assert isinstance(make_sender(t), ConsoleSender)
    assert parse_config(console_doc(), environ={}).targets["preview"].robot == "dingtalk"  # the default style


def test_console_settings_are_checked_and_robot_only_keys_refused(tmp_path):
    with pytest.raises(RelayConfigError) as e:
        parse_config(console_doc(style="slack", show="html", color="sometimes", token_env="X", url="http://x/y",
                                 mention_userids=["zhangsan"], file=str(tmp_path)), environ={})
    text = str(e.value)
    for part in ("targets.preview.style: Input should be 'dingtalk', 'wecom' or 'lark'",
                 "targets.preview.show: Input should be 'rendered' or 'body'", "targets.preview.color: Input should be",
                 "targets.preview.token_env: unknown key", "targets.preview.url: unknown key", "is a directory"):
        assert part in text, part
    with pytest.raises(RelayConfigError) as e:  # console-only keys on a robot
        parse_config({"targets": {"dt": {"type": "dingtalk", "token_env": "T", "style": "wecom", "file": "x"}},
                      "routes": [{"targets": ["dt"]}]}, environ={"T": "t"})
    assert e.value.problems == ["relay config: targets.dt.style: unknown key",
                                "relay config: targets.dt.file: unknown key"]
    with pytest.raises(RelayConfigError, match="mention_userids is for WeCom"):  # a DingTalk-style console
        parse_config(console_doc(mention_userids=["zhangsan"]), environ={})


# ---------------------------------------------------------------- exactly the robot's message
@pytest.mark.integration
def test_a_console_target_writes_the_very_body_the_robot_gets(tmp_path):
    """The same alerts through a DingTalk target (to a stand-in robot) and a console target with the same
    settings (show: body, to a file): the robot received exactly what the console shows."""
    robot = FakeDingTalk(TOKEN, SECRET).start()
    out = tmp_path / "console.jsonl"
    relay = None
    try:
        relay = Relay(parse_config({
            "targets": {
                "dt": {"type": "dingtalk", "url": robot.url, "token_env": "T", "secret_env": "S", **ROBOT_SETTINGS},
                "console": {"type": "console", "show": "body", "file": str(out), **ROBOT_SETTINGS}},
            "routes": [{"targets": ["dt", "console"]}],
        }, environ={"T": TOKEN, "S": SECRET}), listen="127.0.0.1:0").start()
        alerts = [am_alert("VerlNonFiniteGradNorm"), am_alert("VerlGradNormSpike", "warning", i=1)]
        assert post(relay, "training-critical", webhook("training-critical", alerts), token=None)[0] == 200
        wait_for(lambda: robot.messages and out.exists() and out.read_text().strip(), timeout=10)
        shown = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        assert shown == list(robot.messages)
        text = shown[0]["markdown"]["text"]
        assert "VerlNonFiniteGradNorm" in text and "VerlGradNormSpike" in text and "@13800000000" in text
        assert shown[0]["at"] == {"atMobiles": ["13800000000"], "isAtAll": True}
    finally:
        if relay is not None:
            relay.stop(drain_seconds=1)
        robot.stop()


def test_console_and_robot_targets_pack_identically():
    console = parse_config(console_doc(style="wecom", mention_userids=["lisi"]), environ={}).targets["preview"]
    wecom = parse_config({"targets": {"w": {"type": "wecom", "token_env": "K", "mention_userids": ["lisi"]}},
                          "routes": [{"targets": ["w"]}], "runbook_urls": ["https://example.org/runbook"]},
                         environ={"K": "k"}).targets["w"]
    payload = parse_payload(json.dumps(webhook("x", [am_alert(i=i) for i in range(40)])))
    a, n_a = pack(list(payload.alerts), console.as_robot())
    b, n_b = pack(list(payload.alerts), wecom)
    assert (a.body, n_a) == (b.body, n_b)


# ---------------------------------------------------------------- shown as the chat shows it
def dingtalk_payload() -> dict:
    payload = parse_payload(json.dumps(webhook("x", [am_alert("VerlNonFiniteGradNorm", summary="NaN [x](y)")])))
    target = parse_config(console_doc(**ROBOT_SETTINGS), environ={}).targets["preview"].as_robot()
    return pack(list(payload.alerts), target)[0].payload


def test_rendering_shows_the_chat_lines_without_markup():
    text = render(dingtalk_payload(), "dingtalk", color=False, width=100)
    lines = text.splitlines()
    assert lines[0].startswith("╭─ DingTalk robot · markdown · notification: [verl] FIRING 1 critical")
    assert "│ [verl] FIRING 1 critical: VerlNonFiniteGradNorm" in lines
    assert "│ FIRING · CRITICAL · VerlNonFiniteGradNorm" in lines
    assert any(line.startswith("│ Since ") and "Runbook (https://example.org/runbook#verlnonfinitegradnorm)" in line
               for line in lines)
    assert "│ @13800000000" in lines and "│ rings @all" in lines
    assert not ANSI.search(text) and "**" not in text and "<font" not in text and "####" not in text
    # an alert's own markdown stays neutralised, as the formatter made it
    assert "NaN ［x］（y）" in text


def test_rendering_in_colour_and_wrapped():
    text = render(dingtalk_payload(), "dingtalk", color=True, width=40)
    assert "\x1b[31m" in text and "\x1b[1m" in text  # the critical colour (#D93025) and bold
    for line in text.splitlines():  # a URL longer than a line gets one of its own, uncut (still clickable)
        plain = ANSI.sub("", line)
        assert len(plain) <= 40 or " " not in plain.strip("│ ").strip(), line
    assert "│ (https://example.org/runbook#verlnonfinitegradnorm)" in ANSI.sub("", text)
    assert ANSI.sub("", text).count("VerlNonFiniteGradNorm") == 3  # title, heading, alert line: none lost
    assert color_code("#188038") == "32" and color_code("warning") == "31" and color_code("bogus") is None
    assert wrap("\x1b[1m" + "word " * 30 + "\x1b[0m", 20)[1].startswith("\x1b[1m")  # bold carried over


def test_wecom_text_messages_show_their_mentions():
    payload = {"msgtype": "text", "text": {"content": "[verl] FIRING 1 critical: X\n\nline",
                                           "mentioned_list": ["zhangsan", "@all"],
                                           "mentioned_mobile_list": ["13800000000"]}}
    lines = render(payload, "wecom").splitlines()
    assert lines[0] == "╭─ WeCom robot · text"
    assert "│ rings @13800000000 @zhangsan @all" in lines


def test_console_sender_writes_to_a_callback_or_stdout(capsys):
    target = parse_config(console_doc(), environ={}).targets["preview"]
    got = []
    body = json.dumps(dingtalk_payload()).encode()
    assert ConsoleSender(target, write=got.append, width=80).send(body).ok
    assert got and got[0].startswith("╭─ DingTalk robot")
    assert ConsoleSender(target).send(body).ok
    assert "FIRING · CRITICAL · VerlNonFiniteGradNorm" in capsys.readouterr().out
    assert not ConsoleSender(target, write=got.append).send(b"not json").ok


# ---------------------------------------------------------------- relay --preview
def preview_files(tmp_path, receiver="training-critical"):
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({
        "targets": {"oncall": {"type": "dingtalk", "token_env": "VERL_PREVIEW_UNSET_TOKEN", **ROBOT_SETTINGS},
                    "team": {"type": "wecom", "token_file": str(tmp_path / "missing-key")},
                    "console": {"type": "console", "style": "wecom"}},
        "routes": [{"matchers": {"severity": "critical"}, "targets": ["oncall", "console"]},
                   {"targets": ["team"]}],
        "actions": [{"matchers": {"alertname": "VerlNonFiniteGradNorm"}, "action": "checkpoint",
                     "url": "http://127.0.0.1:9477", "token_env": "VERL_PREVIEW_UNSET_CTL"}],
    }))
    alert = tmp_path / "alert.json"
    alert.write_text(json.dumps(webhook(receiver, [am_alert("VerlNonFiniteGradNorm"),
                                                   am_alert("VerlGradNormSpike", "warning")])))
    return config, alert


def relay_cli(*args):
    return subprocess.run([sys.executable, "-m", "verl_exporter", "relay", *args], capture_output=True, text=True,
                          timeout=scaled(60))


@pytest.mark.integration
def test_preview_routes_and_renders_without_secrets_and_sends_nothing(tmp_path):
    config, alert = preview_files(tmp_path)
    proc = relay_cli("--config", str(config), "--preview", str(alert))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "receiver training-critical: 2 alert(s) (2 firing); nothing is sent" in out
    assert "target oncall (dingtalk, markdown): 1 alert(s) in 1 message(s)" in out
    assert "target console (console as wecom, markdown): 1 alert(s) in 1 message(s)" in out
    assert "target team (wecom, markdown): 1 alert(s) in 1 message(s)" in out
    assert "╭─ DingTalk robot · markdown · notification: [verl] FIRING 1 critical: VerlNonFiniteGradNorm" in out
    assert "│ FIRING · WARNING · VerlGradNormSpike" in out
    assert "action: would ask http://127.0.0.1:9477/control/checkpoint because of VerlNonFiniteGradNorm" in out
    assert not ANSI.search(out)
    # --body: the exact JSON bodies, one per message
    proc = relay_cli("--config", str(config), "--preview", str(alert), "--body")
    bodies = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [b["msgtype"] for b in bodies] == ["markdown"] * 3
    assert bodies[0]["at"]["atMobiles"] == ["13800000000"]


@pytest.mark.integration
def test_preview_body_is_what_the_robot_sender_would_post(tmp_path):
    config, alert = preview_files(tmp_path)
    from verl_exporter.relay.config import load_config
    from verl_exporter.relay.format import format_messages

    cfg = load_config(config, secrets_needed=False)
    payload = parse_payload(alert.read_bytes())
    oncall = [a for a in payload.alerts if a.severity == "critical"]
    expected = format_messages(oncall, cfg.targets["oncall"])[0].body
    proc = relay_cli("--config", str(config), "--preview", str(alert), "--body")
    assert expected.decode() in proc.stdout.splitlines()  # the live path posts Message.body as it is


@pytest.mark.integration
def test_preview_problems_are_named(tmp_path):
    config, _ = preview_files(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "3"}')
    proc = relay_cli("--config", str(config), "--preview", str(bad))
    assert proc.returncode == 2 and "is not an Alertmanager webhook payload" in proc.stderr
    assert 'version: must be "4"' in proc.stderr
    proc = relay_cli("--config", str(config), "--preview", str(tmp_path / "absent.json"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr


@pytest.mark.integration
def test_preview_of_a_receiver_no_route_takes(tmp_path):
    config, alert = preview_files(tmp_path)
    doc = yaml.safe_load(config.read_text())
    doc["routes"] = [{"receivers": ["training-critical"], "targets": ["oncall"]}]
    config.write_text(yaml.safe_dump(doc))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(webhook("infra-warning", [am_alert()])))
    proc = relay_cli("--config", str(config), "--preview", str(other))
    assert proc.returncode == 1
    assert "no route of the relay config takes receiver 'infra-warning'" in proc.stdout


@pytest.mark.integration
def test_check_config_describes_a_console_target(tmp_path):
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump(console_doc(style="wecom", file="previews.log")))
    proc = relay_cli("--config", str(config), "--check-config")
    assert proc.returncode == 0, proc.stderr
    assert f"target preview: console as wecom markdown (rendered), to {tmp_path / 'previews.log'}" in proc.stdout
