"""Fleet-sized groups: every rank of a 4,096-rank run down is one robot message, not a 413 on every retry.

The generated alertmanager.yml groups by alertname, job and run, so VerlExporterDown on every rank is one
group. Each webhook carries at most max_alerts of it (the payload's truncatedAlerts counts the rest), chosen
so that a full webhook of the pack's largest alert stays under half the relay's max_body_bytes; the relay
turns a large group of one alertname into one summary message (relay/summary.py) that names the alert, the
count and the ranks, and says how many Alertmanager left out.
"""

from __future__ import annotations

import json
import urllib.request
from datetime import datetime, timedelta, timezone
from urllib.parse import quote_plus, urlsplit

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
from helpers import robot_target, scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from robots import FakeDingTalk, FakeWeCom
from verl_exporter.relay.config import MiB, Target, parse_config
from verl_exporter.relay.format import DINGTALK_MAX_BODY, WECOM_MAX_CONTENT, format_messages
from verl_exporter.relay.payload import Alert, parse_alert
from verl_exporter.relay.summary import COUNT, SUMMARY_MIN, compact, summarise, weight
from verl_exporter.spec import RulesConfig

AM_CONFIG = REPO / "alertmanager" / "alertmanager.yml"
TOKEN, SECRET, WKEY = "dt-token-fleet-3c8a", "SECdt-secret-fleet-71fe", "wecom-key-fleet-2d90"
RANKS = 4096


def webhook_configs(config: dict) -> list[dict]:
    return [h for r in config["receivers"] for h in r.get("webhook_configs", [])]


def largest_pack_alert() -> int:
    """Bytes of the pack's largest alert as Alertmanager posts it: its annotations, long label values, and
    the generatorURL Prometheus builds from the rule's expression."""
    sizes = []
    for path in sorted((REPO / "rules").glob("*.yaml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" not in rule:
                    continue
                labels = {"alertname": rule["alert"], "job": "verl", "instance": "node-0123.cluster.example:9477",
                          "run": "ppo-qwen2.5-7b-2026-01-01", "rank": "4095", **rule.get("labels", {})}
                annotations = {k: v.replace("{{ $labels.instance }}", labels["instance"]).replace(
                    "{{ $value }}", "1.2345678901234567e+308") for k, v in rule.get("annotations", {}).items()}
                sizes.append(len(json.dumps({
                    "status": "firing", "labels": labels, "annotations": annotations,
                    "startsAt": "2026-01-01T00:00:00.123456789Z", "endsAt": "0001-01-01T00:00:00Z",
                    "generatorURL": "http://prometheus-0.example:9090/graph?g0.expr=" + quote_plus(rule["expr"])
                                    + "&g0.tab=1", "fingerprint": "0123456789abcdef"})))
    assert len(sizes) > 40
    return max(sizes)


def test_every_webhook_of_the_generated_config_is_bounded_well_under_the_relays_body_limit():
    config = yaml.safe_load(AM_CONFIG.read_text())
    hooks = webhook_configs(config)
    assert hooks and all("max_alerts" in h for h in hooks), "a webhook without max_alerts can exceed the body limit"
    biggest = max(h["max_alerts"] for h in hooks)
    default_limit = parse_config({"targets": {"c": {"type": "console"}}, "routes": [{"targets": ["c"]}]}).max_body_bytes
    assert default_limit == MiB
    assert biggest * largest_pack_alert() + 4096 <= default_limit // 2, (biggest, largest_pack_alert())


def test_the_overrides_knob_sets_max_alerts(tmp_path):
    from verl_exporter.cli import main

    (tmp_path / "o.yaml").write_text("version: 1\nglobal: {max_alerts: 50}\n")
    assert main(["generate", "--overrides", str(tmp_path / "o.yaml"), "--out", str(tmp_path / "out")]) == 0
    config = yaml.safe_load((tmp_path / "out" / "alertmanager" / "alertmanager.yml").read_text())
    assert {h["max_alerts"] for h in webhook_configs(config)} == {50}


# ---------------------------------------------------------------- the summary
def down(i: int, status: str = "firing", run: str = "ppo", **labels) -> Alert:
    start = datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=i)
    return Alert(status, {"alertname": "VerlExporterDown", "severity": "critical", "job": "verl", "run": run,
                          "rank": str(i), "instance": f"node{i}:9477", **labels},
                 {"summary": "A verl-exporter sidecar cannot be scraped.",
                  "description": f"Prometheus has failed to scrape node{i}:9477 for 5 minutes.",
                  "runbook_url": "https://example.org/runbook.md#verlexporterdown"},
                 start, start + timedelta(hours=1) if status == "resolved" else None, "", f"fp{i}")


def robot(kind: str) -> Target:
    return robot_target(kind, "https://robot.invalid", "x")


@pytest.mark.parametrize("kind", ["dingtalk", "wecom"])
def test_4096_ranks_down_are_one_message_naming_the_alert_the_count_and_the_ranks(kind):
    alerts, merged = summarise([down(i) for i in range(RANKS)])
    assert merged == RANKS and len(alerts) == 1 and weight(alerts[0]) == RANKS
    (message,) = format_messages(alerts, robot(kind))
    text = message.text
    assert "VerlExporterDown" in text and "4,096 alerts" in text and "FIRING 4096" in text
    assert "ranks 0–4095 （4,096）" in text and "instances node{0–4095}:9477" in text
    assert "ppo" in text  # the run they share
    if kind == "wecom":
        assert len(message.payload["markdown"]["content"].encode()) <= WECOM_MAX_CONTENT["markdown"]
    else:
        assert len(message.body) <= DINGTALK_MAX_BODY


def test_a_summary_says_how_many_alertmanager_left_out_and_survives_the_journal():
    alerts, merged = summarise([down(i) for i in range(200)], truncated=3896)
    (summary,) = alerts
    assert merged == 200 and weight(summary) == 4096
    assert "and 3,896 more ranks" in summary.annotations["description"]
    problems: list[str] = []
    again = parse_alert("spooled", json.loads(json.dumps(summary.to_dict())), problems)
    assert not problems and weight(again) == 4096 and again.key == summary.key
    # the next notification of the same group replaces a summary still queued: same identity
    assert summarise([down(i) for i in range(300)])[0][0].key == summary.key


def test_gaps_other_alertnames_and_small_groups():
    ranks = [i for i in range(64) if i not in (7, 40, 41)]
    other = [Alert("firing", {"alertname": "VerlGPULost", "severity": "critical", "rank": "3"}, {},
                   datetime(2026, 1, 1, tzinfo=timezone.utc), None, "", "gpu3")]
    alerts, merged = summarise([down(i) for i in ranks] + other)
    assert merged == len(ranks) and len(alerts) == 2 and alerts[1] is other[0]
    assert "ranks 0–6,8–39,42–63 (61)" in alerts[0].annotations["description"]
    few = [down(i) for i in range(SUMMARY_MIN - 1)]
    assert summarise(few) == (few, 0)  # a handful is listed alert by alert, as before
    resolved, _ = summarise([down(i) for i in range(40)] + [down(i, "resolved") for i in range(40, 80)])
    assert [a.status for a in resolved] == ["firing", "resolved"]
    assert resolved[1].ends_at is not None and resolved[0].ends_at is None


def test_compact_lists_stay_short_whatever_the_values():
    scattered = [str(i) for i in range(0, 20000, 3)]
    text = compact(scattered)
    assert len(text) < 200 and text.endswith("more") and text.startswith("0,3,6")
    assert compact(["ppo-a", "ppo-b"]) == "ppo-a, ppo-b"
    assert compact([f"node{i:03d}" for i in (1, 2, 3, 10)]) == "node{001–003,010}"


def test_preview_shows_the_summary_the_live_relay_would_post():
    from verl_exporter.relay.payload import parse_payload
    from verl_exporter.relay.preview import preview

    config = parse_config({"targets": {"c": {"type": "console", "style": "wecom"}}, "routes": [{"targets": ["c"]}]})
    body = {"version": "4", "status": "firing", "receiver": "verl-critical", "truncatedAlerts": 3896,
            "alerts": [down(i).to_dict() for i in range(200)]}
    lines: list[str] = []
    assert preview(config, parse_payload(json.dumps(body)), out=lines.append) == 0
    text = "\n".join(lines)
    assert "200 alert(s) in 1 message(s)" in text and "4,096 alerts of VerlExporterDown" in text
    assert "3,896 more ranks" in text


@pytest.mark.integration
def test_a_truncated_group_takes_one_queue_slot_one_journal_line_and_one_message(tmp_path):
    from verl_exporter.relay.app import Relay

    dt = FakeDingTalk(TOKEN, SECRET).start()
    relay = Relay(parse_config({
        "listen": "127.0.0.1:0", "spool_dir": str(tmp_path / "spool"), "delivery": {"queue_max_alerts": 10},
        "targets": {"dt": {"type": "dingtalk", "url": dt.url, "token_env": "DT_TOKEN", "secret_env": "DT_SECRET"}},
        "routes": [{"targets": ["dt"]}]}, environ={"DT_TOKEN": TOKEN, "DT_SECRET": SECRET})).start()
    try:
        dt.fail_next(1)  # the first attempt fails: the summary is in the journal meanwhile
        body = {"version": "4", "status": "firing", "receiver": "verl-critical", "truncatedAlerts": 3896,
                "alerts": [down(i).to_dict() for i in range(200)]}
        req = urllib.request.Request(relay.url + "/alert/verl-critical", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=scaled(10)) as resp:  # 200 alerts into a queue of 10: one summary
            assert resp.status == 200 and json.loads(resp.read())["targets"] == {"dt": 1}
        adds = [line for line in (tmp_path / "spool" / "relay-journal.jsonl").read_text().splitlines()
                if '"add"' in line]
        assert len(adds) == 1 and '"verl_relay_alerts": "4096"' in adds[0]
        wait_for(lambda: dt.messages, timeout=20)
        (message,) = dt.messages
        assert "and 3,896 more ranks" in message["markdown"]["text"]
        m = parse_metrics(http_get(relay.url + "/metrics")[2].decode())
        assert sample(m, "verl_relay_truncated_alerts_total", receiver="verl-critical") == 3896
        assert sample(m, "verl_relay_alerts_total", target="dt", result="summarised") == 200
        wait_for(lambda: sample(parse_metrics(http_get(relay.url + "/metrics")[2].decode()), "verl_relay_alerts_total",
                                target="dt", result="delivered") == 1)
    finally:
        relay.stop(drain_seconds=1)
        dt.stop()


# ---------------------------------------------------------------- through a real Alertmanager
@pytest.mark.integration
def test_4096_ranks_down_through_a_real_alertmanager_reach_both_robots_as_one_message(tmp_path):
    from verl_exporter.relay.app import Relay

    binary = require_tool("prometheus-alertmanager")
    dt = FakeDingTalk(TOKEN, SECRET).start()
    wc = FakeWeCom(WKEY).start()
    relay = proc = None
    try:
        relay = Relay(parse_config({
            "listen": "127.0.0.1:0",
            "targets": {"dt": {"type": "dingtalk", "url": dt.url, "token_env": "DT_TOKEN", "secret_env": "DT_SECRET"},
                        "wc": {"type": "wecom", "url": wc.url, "token_env": "WECOM_KEY"}},
            "routes": [{"targets": ["dt", "wc"]}],
        }, environ={"DT_TOKEN": TOKEN, "DT_SECRET": SECRET, "WECOM_KEY": WKEY})).start()
        am = yaml.safe_load(AM_CONFIG.read_text())  # the generated config, max_alerts as generated
        max_alerts = {h["max_alerts"] for h in webhook_configs(am)}.pop() if all(
            "max_alerts" in h for h in webhook_configs(am)) else None
        am["route"]["group_wait"] = am["route"]["group_interval"] = "1s"
        for hook in webhook_configs(am):
            hook["url"] = relay.url + urlsplit(hook["url"]).path
        (tmp_path / "am.yml").write_text(yaml.safe_dump(am))
        port = free_port()
        api = f"http://127.0.0.1:{port}"
        proc = Proc("alertmanager", [binary, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path}",
                                     f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="])
        wait_for(lambda: ready(f"{api}/-/ready", proc), timeout=30)
        expr = quote_plus('up{job="verl"} == 0')
        am_post_alerts(api, [{
            "labels": {"alertname": "VerlExporterDown", "severity": "critical", "job": "verl", "run": "ppo",
                       "rank": str(i), "instance": f"node{i}:9477"},
            "annotations": {"summary": "A verl-exporter sidecar cannot be scraped.",
                            "description": f"Prometheus has failed to scrape node{i}:9477 for 5 minutes: that "
                                           "rank is unmonitored.",
                            "runbook_url": RulesConfig().runbook_link("VerlExporterDown")},
            "generatorURL": f"http://prometheus:9090/graph?g0.expr={expr}&g0.tab=1"} for i in range(RANKS)])

        def got(robot):
            return [m for m in robot.messages if "VerlExporterDown" in json.dumps(m, ensure_ascii=False)]

        wait_for(lambda: got(dt) and got(wc), timeout=60)
        for r in (dt, wc):
            (message,) = got(r)  # one message, not one per rank
            text = json.dumps(message, ensure_ascii=False)
            assert "4,096 alerts of VerlExporterDown" in text
            assert f"and {RANKS - max_alerts:,} more ranks" in text
        m = parse_metrics(http_get(relay.url + "/metrics")[2].decode())
        assert sample(m, "verl_relay_requests_total", receiver="verl-critical", code="413") is None
        assert sample(m, "verl_relay_truncated_alerts_total", receiver="verl-critical") >= RANKS - max_alerts
        assert sample(m, "verl_relay_alerts_total", target="dt", result="summarised") >= max_alerts
    finally:
        if proc is not None:
            proc.stop()
        if relay is not None:
            relay.stop(drain_seconds=1)
        dt.stop()
        wc.stop()


def test_a_label_with_thousands_of_digits_is_listed_as_text_not_converted():
    # int() refuses more than 4,300 digits: one such label lost the whole webhook (500 on every retry)
    long = "7" * 4400
    ordinary = [Alert("firing", {"alertname": "VerlGPULost", "severity": "critical", "rank": str(i)}, {},
                      datetime(2026, 1, 1, tzinfo=timezone.utc), None, "", f"gpu{i}") for i in range(3)]
    alerts, merged = summarise(ordinary + [down(i, shard=f"m{long}{i}") for i in range(SUMMARY_MIN)])
    assert merged == SUMMARY_MIN and alerts[:3] == ordinary
    assert "shards m7777" in alerts[3].annotations["description"]
    for message in format_messages(alerts, robot("wecom")):
        assert len(message.payload["markdown"]["content"].encode()) <= WECOM_MAX_CONTENT["markdown"]
    for digits in (long, "0" * 5000 + "1"):
        assert compact([digits, digits + "0", "a" + digits]).endswith("+2 more")
    assert compact([str(10**19 + i) for i in range(3)]) == "10000000000000000000–10000000000000000002"
    assert compact(["9" * 21, "9" * 21 + "0"]) == "999999999999999999999, 9999999999999999999990"  # text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(st.sampled_from("0123456789a:{}–,"), max_size=60), min_size=1, max_size=40))
def test_compact_takes_any_values(values):
    text = compact(sorted(set(values)))
    assert len(text) <= 2 * 160 + 100


def test_a_summary_of_mixed_severities_takes_the_highest():
    members = [down(i, severity="warning") for i in range(SUMMARY_MIN - 1)] + [down(99, severity="critical")]
    (summary,), _ = summarise(members)
    assert summary.labels["severity"] == "critical"
    info = [down(i, severity="info") for i in range(SUMMARY_MIN)] + [down(99, severity="warning")]
    assert summarise(info)[0][0].labels["severity"] == "warning"
    odd = [down(i, severity="whatever") for i in range(SUMMARY_MIN)]
    assert summarise(odd)[0][0].labels["severity"] == "whatever"  # one shared value is kept as it is
    unknown = [down(i, severity=s) for i, s in enumerate(["bogus", "warning"] * (SUMMARY_MIN // 2))]
    assert summarise(unknown)[0][0].labels["severity"] == "warning"


def test_the_count_of_a_summary_read_back_is_bounded():
    for count, want in (("1" * 4000, 1), ("9" * 10, 1), ("-5", 1), ("٣", 1), ("12", 12), ("0", 1)):
        forged = Alert("firing", {"alertname": "A"}, {COUNT: count}, datetime(2026, 1, 1, tzinfo=timezone.utc),
                       None, "", "summary-0123")
        assert weight(forged) == want
