"""Relay formatting: grouping, mentions, colours, escaping of hostile alerts, byte limits and splitting,
templates; and the strict parsing of Alertmanager's webhook payload."""

from __future__ import annotations

import json
import re
import unicodedata
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
import yaml
from conftest import REPO
from helpers import robot_target
from verl_exporter.relay.config import RelayConfigError, Target, parse_config
from verl_exporter.relay.format import (
    DINGTALK_MAX_BODY,
    TemplateError,
    check_template,
    cut_utf8,
    escape,
    order,
    pack,
    render_message,
    safe_url,
)
from verl_exporter.relay.payload import Alert, PayloadError, parse_payload
from verl_exporter.spec import RulesConfig

T0 = datetime(2026, 3, 1, 10, 0, tzinfo=timezone.utc)
HOSTILE = "[x](http://evil) @all **b**"


def alert(name="VerlGpuXid", severity="critical", status="firing", i=0, summary="GPU raised XID 79",
          description="Drain the node.", **labels) -> Alert:
    lab = {"alertname": name, "severity": severity, "run": "ppo-7b", "rank": str(i), "instance": f"node{i}:9477",
           **labels}
    ann = {"summary": summary, "description": description,
           "runbook_url": RulesConfig().runbook_link(name)}
    ends = T0 + timedelta(minutes=12) if status == "resolved" else None
    return Alert(status, lab, ann, T0, ends, "http://prometheus:9090/graph", f"fp{name}{i}{status}")


def target(kind="dingtalk", fmt="markdown", **kw) -> Target:
    defaults = {"mention_mobiles": ("13800000000",)}
    if kind == "wecom":
        defaults["mention_userids"] = ("zhangsan",)
    return robot_target(kind, "http://127.0.0.1:1/x", "t", kind).model_copy(
        update={"format": fmt, **defaults, **kw})


# ---------------------------------------------------------------- grouping, title, order
def test_one_message_firing_first_most_severe_first_with_counts_in_the_title():
    alerts = [alert("VerlLowThroughput", "warning", "resolved"), alert("VerlHighKL", "warning"),
              alert("VerlGpuXid", "critical")]
    msg = render_message(alerts, target(), ZoneInfo("Asia/Shanghai"))
    title = msg.payload["markdown"]["title"]
    assert title == "[verl] FIRING 2 critical · RESOLVED 1: VerlGpuXid, VerlHighKL, VerlLowThroughput"
    text = msg.text
    assert text.index("VerlGpuXid") < text.index("VerlHighKL") < text.index("RESOLVED · WARNING")
    # run/rank/instance, summary, description, start time (in the configured zone), runbook link
    for part in ("run ppo-7b · rank 0 · instance node0:9477", "**GPU raised XID 79**", "Drain the node.",
                 "Since 2026-03-01 18:00:00 CST", "[Runbook](https://github.com/verl-exporter/"):
        assert part in text, part
    assert "2026-03-01 18:00:00 CST → 2026-03-01 18:12:00 CST (12m)" in text


# ---------------------------------------------------------------- mentions
def test_dingtalk_mentions_are_in_the_at_list_and_in_the_text_for_critical_only():
    msg = render_message([alert()], target())
    assert msg.payload["at"] == {"atMobiles": ["13800000000"], "isAtAll": False}
    assert msg.text.endswith("@13800000000")
    quiet = render_message([alert(severity="warning"), alert(status="resolved", i=1)], target())
    assert quiet.payload["at"] == {"atMobiles": [], "isAtAll": False}
    assert "@1380" not in quiet.text


def test_dingtalk_text_format_and_at_all():
    msg = render_message([alert()], target(fmt="text", mention_all_severities=("critical",)))
    assert msg.payload["msgtype"] == "text"
    assert msg.payload["at"] == {"atMobiles": ["13800000000"], "isAtAll": True}
    assert "@13800000000" in msg.payload["text"]["content"]


def test_wecom_markdown_colours_by_severity_and_userid_mentions_in_content():
    t = target("wecom", mention_mobiles=())
    msg = render_message([alert(), alert("VerlInfo", "info", i=1), alert("VerlOld", "warning", "resolved", i=2)], t)
    assert msg.payload["msgtype"] == "markdown"
    content = msg.payload["markdown"]["content"]
    assert '<font color="warning">**FIRING · CRITICAL · VerlGpuXid**</font>' in content
    assert '<font color="comment">**FIRING · INFO · VerlInfo**</font>' in content
    assert '<font color="info">**RESOLVED · WARNING · VerlOld**</font>' in content
    assert content.endswith("<@zhangsan>")


def test_wecom_switches_to_text_when_mobiles_or_all_must_ring():
    msg = render_message([alert()], target("wecom", mention_all_severities=("critical",)))
    assert msg.kind == "text" and msg.payload["msgtype"] == "text"
    inner = msg.payload["text"]
    assert inner["mentioned_list"] == ["zhangsan", "@all"]
    assert inner["mentioned_mobile_list"] == ["13800000000"]
    # a warning does not ring anybody, so WeCom keeps markdown
    calm = render_message([alert(severity="warning")], target("wecom"))
    assert calm.kind == "markdown" and "<@" not in calm.text


# ---------------------------------------------------------------- escaping
@pytest.mark.parametrize("kind,fmt", [("dingtalk", "markdown"), ("dingtalk", "text"), ("wecom", "markdown"),
                                      ("wecom", "text")])
def test_hostile_labels_and_annotations_cannot_inject_markup_links_or_mentions(kind, fmt):
    evil = Alert("firing", {"alertname": HOSTILE, "severity": "warning", "run": HOSTILE, "rank": "<@zhangsan>",
                            "instance": "`code` # head > quote | t"},
                 {"summary": HOSTILE, "description": f"{HOSTILE}\n# heading\n<@lisi> @13900000000",
                  "runbook_url": "javascript:alert(1)"},
                 T0, None, "", "evil")
    msg = render_message([evil], target(kind, fmt))
    text = msg.text + json.dumps(msg.payload.get("markdown", {}).get("title", ""), ensure_ascii=False)
    for bad in ("[x]", "](", "http://evil", "@all", "**b**", "<@", "`code`", "\n# heading", "@1390",
                "javascript:"):
        assert bad not in text, (bad, text)
    assert "x" in text and "evil" in text  # still readable
    # nobody is mentioned by a warning, whatever its text says
    if kind == "dingtalk":
        assert msg.payload["at"] == {"atMobiles": [], "isAtAll": False}
    else:
        assert "mentioned_list" not in msg.payload.get("text", {})


def test_escape_and_safe_url_units():
    assert escape("node_1 __b__ _i_") == "node_1 ＿＿b＿＿ ＿i＿"
    assert escape("a\u202eb\x07c\nd") == "abc d"
    assert escape("see https://x.io/a") == "see https：//x·io/a"  # nor linked as a bare host name
    assert safe_url("https://x.io/a) [y](http://evil") == "https://x.io/a%29%20%5By%5D%28http://evil"
    assert safe_url("ftp://x") == "" and safe_url("javascript:alert(1)") == ""


def _texts(alert_: Alert, **kw) -> list[str]:
    """The text of the message in every robot kind and format."""
    return [render_message([alert_], target(kind, fmt, **kw), ZoneInfo("Asia/Shanghai")).text
            for kind in ("dingtalk", "wecom") for fmt in ("markdown", "text")]


def test_bare_host_names_are_not_left_for_the_clients_to_link():
    hostile = alert(summary="log in at www.evil.example/login or evil.example, 203.0.113.9/x, 203.0.113.9:80/y",
                    description="mirror: xn--80ak6aa92e.com/a\nsee config.yaml", instance="gpu-7.cluster.example:9477")
    for text in _texts(hostile):
        for linkable in ("www.evil.example", "evil.example", "203.0.113.9/x", "203.0.113.9:80/y", "xn--80ak6aa92e.com",
                         "cluster.example"):
            assert linkable not in text, (linkable, text)
        assert "www·evil·example/login" in text and "gpu-7·cluster·example:9477" in text  # still readable
    # what is not a host name stays as it is: versions, numbers, keys, an address with a port but no path
    plain = "trainer.save_freq v1.2.3 ratio 0.8 1.5x node0:9477 10.0.0.1:9477 e.g. done."
    assert escape(plain) == plain


def test_format_characters_and_lone_surrogates_are_dropped():
    hidden = "\u061c\u00ad\u2066\u2069\u200e\u180e\ufeff\U000e0041\ud800"
    sneaky = alert(summary=f"ok{hidden}ay", description=f"line{hidden}", rank=f"0{hidden}")
    for text in _texts(sneaky):
        assert not any(unicodedata.category(c) in ("Cf", "Cs") for c in text), ascii(text)
        assert "okay" in text
    assert escape("a\u061cb") == "ab"


def test_setext_underlines_and_rules_cannot_make_headings():
    sneaky = alert(description="URGENT: rotate the keys\n===\nat evil\n---\n- - -\n==", summary="---")
    for text in _texts(sneaky, mention_mobiles=()):
        lines = [line.strip() for line in text.splitlines()]
        assert not any(re.fullmatch(r"[-=\s]+", line) for line in lines if line), text
    assert escape("a\n===\n- x", multiline=True) == "a\n＝＝＝\n- x"  # a list item is left alone


RUNBOOK = RulesConfig().runbook_url  # the generated rules' runbook page


def _runbook_link(url: str, runbook_urls=None, fmt="markdown") -> tuple[bool, str]:
    doc = {"targets": {"dt": {"type": "dingtalk", "token_env": "T", "format": fmt}}, "routes": [{"targets": ["dt"]}]}
    if runbook_urls is not None:
        doc["runbook_urls"] = runbook_urls
    t = parse_config(doc, environ={"T": "t"}).targets["dt"]
    a = Alert("firing", {"alertname": "VerlX", "severity": "warning"}, {"runbook_url": url}, T0, None, "", "x")
    text = render_message([a], t).text
    return (f"[Runbook]({url})" in text if fmt == "markdown" else f"Runbook: {url}" in text), text


def test_a_runbook_is_a_link_only_where_the_operator_configured():
    # the default: the generated rules' runbook, and every runbook_url the generated rules write
    rules = yaml.safe_load((REPO / "rules" / "verl-alerts.yaml").read_text(encoding="utf-8"))
    urls = {r["annotations"]["runbook_url"] for g in rules["groups"] for r in g["rules"]
            if "runbook_url" in r.get("annotations", {})}
    assert urls and all(_runbook_link(u)[0] for u in urls)
    for fmt in ("markdown", "text"):
        linked, text = _runbook_link("https://evil.example/runbook.md#verlx", fmt=fmt)
        assert not linked and "https://evil" not in text and "evil.example" not in text
        assert "Runbook (not a configured address, not linked): https：//evil·example/runbook·md" in text
    wiki = ["https://wiki.corp.example/verl/"]
    assert _runbook_link("https://wiki.corp.example/verl/gpu#xid", wiki)[0]
    assert _runbook_link("https://WIKI.corp.example/verl", wiki)[0]
    for off in ("https://wiki.corp.example.evil.io/verl/x", "https://wiki.corp.example/verlx",
                "https://wiki.corp.example/verl/../admin", "https://wiki.corp.example/verl/%2e%2e/admin",
                "https://user@wiki.corp.example/verl/x", "http://wiki.corp.example/verl/x",
                "https://wiki.corp.example:8443/verl/x", RUNBOOK + "#verlx"):
        assert not _runbook_link(off, wiki)[0], off
    with pytest.raises(RelayConfigError, match="runbook_urls.0"):
        parse_config({"targets": {"dt": {"type": "dingtalk", "token_env": "T"}}, "routes": [{"targets": ["dt"]}],
                      "runbook_urls": ["javascript:alert(1)"]}, environ={"T": "t"})


# ---------------------------------------------------------------- sizes and splitting
CHINESE = "显存不足导致训练进程崩溃，请检查批大小与序列长度。"


def _listed(messages) -> list[int]:
    return [int(n) for m in messages for n in re.findall(r"node(\d+):9477", m.text)]


@pytest.mark.parametrize("kind,fmt,limit", [("dingtalk", "markdown", DINGTALK_MAX_BODY),
                                            ("wecom", "markdown", 4096), ("wecom", "text", 2048)])
def test_many_alerts_are_split_within_byte_limits_and_none_is_lost(kind, fmt, limit):
    alerts = [alert(f"VerlOom{i % 7}", "warning", i=i, summary=CHINESE, description=CHINESE * 3)
              for i in range(300)]
    messages, rest = [], order(alerts)
    while rest:  # as the dispatcher sends a long queue: the longest run that fits, then the next
        msg, used = pack(rest, target(kind, fmt))
        messages.append(msg)
        rest = rest[used:]
    assert len(messages) > 1
    for m in messages:
        size = len(m.body) if kind == "dingtalk" else len(m.payload[m.payload["msgtype"]]["content"].encode())
        assert size <= limit
        m.body.decode("utf-8")  # whole characters only
    assert sorted(_listed(messages)) == list(range(300))  # each alert exactly once


def test_a_group_that_fits_is_listed_in_full_and_a_larger_one_one_line_each():
    few = [alert(i=i) for i in range(3)]
    msg, used = pack(few, target())
    assert used == 3 and "Drain the node." in msg.text
    many = [alert(i=i, description=CHINESE * 10) for i in range(60)]
    msg, used = pack(many, target())
    assert used == 60 and CHINESE * 2 not in msg.text and msg.text.count("\n- ") == 60


def test_one_huge_alert_is_shortened_to_fit_without_cutting_a_character():
    huge = alert(summary=CHINESE * 100, description=CHINESE * 2000, run="运行" * 500)
    for kind, fmt in (("dingtalk", "markdown"), ("wecom", "markdown"), ("wecom", "text")):
        msg, used = pack([huge], target(kind, fmt))
        assert used == 1
        content = msg.body.decode("utf-8")
        assert "VerlGpuXid" in content
        if kind == "dingtalk":
            assert len(msg.body) <= DINGTALK_MAX_BODY
            assert msg.text.endswith("@13800000000")  # the mention survives the cut
        else:
            assert len(msg.payload[msg.payload["msgtype"]]["content"].encode()) <= (4096 if fmt == "markdown" else 2048)


def test_a_verbose_custom_template_is_cut_at_a_character_bound():
    t = target("wecom", "text", mention_mobiles=(), mention_userids=(),
               template="{% for a in alerts %}{{ '中' * 5000 }}{% endfor %}")
    msg, used = pack([alert()], t)
    content = msg.payload["text"]["content"]
    assert len(content.encode()) <= 2048 and content.endswith("…") and set(content[:-1]) == {"中"}


def test_cut_utf8_never_splits_a_character():
    assert cut_utf8("中文", 4) == "中"
    assert cut_utf8("中文", 6) == "中文"
    assert cut_utf8("a中", 3) == "a"


# ---------------------------------------------------------------- templates
def test_a_custom_template_replaces_the_listing_but_not_the_mentions():
    t = target(template="ALERTS {{ alerts | length }}: {% for a in alerts %}{{ a.name }} {% endfor %}")
    msg = render_message([alert(summary=HOSTILE), alert(HOSTILE, i=1)], t)
    assert msg.text.startswith("ALERTS 2: ")
    assert "@all" not in msg.text and "[x]" not in msg.text  # values are escaped before a template sees them
    assert msg.text.endswith("@13800000000")


def test_check_template_reports_a_broken_template():
    check_template("{{ title }}{% for a in alerts %}{{ a.name }}{% endfor %}")
    with pytest.raises(TemplateError, match="does not render"):
        check_template("{{ alerts[0].no_such_field }}")
    with pytest.raises(TemplateError):
        check_template("{% for a in alerts %}")


# ---------------------------------------------------------------- the webhook payload
def am_payload(**over) -> dict:
    doc = {"version": "4", "groupKey": "{}:{alertname=\"VerlGpuXid\"}", "truncatedAlerts": 0, "status": "firing",
           "receiver": "verl-critical", "groupLabels": {"alertname": "VerlGpuXid"},
           "commonLabels": {"alertname": "VerlGpuXid"}, "commonAnnotations": {}, "externalURL": "http://am:9093",
           "alerts": [{"status": "firing", "labels": {"alertname": "VerlGpuXid", "severity": "critical"},
                       "annotations": {"summary": "s"}, "startsAt": "2026-03-01T10:00:00.123456789Z",
                       "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://p/graph",
                       "fingerprint": "c0ffee"}]}
    doc.update(over)
    return doc


def test_payload_parses_alertmanagers_form():
    p = parse_payload(json.dumps(am_payload()).encode())
    assert p.receiver == "verl-critical" and p.status == "firing" and p.external_url == "http://am:9093"
    (a,) = p.alerts
    assert a.starts_at == datetime(2026, 3, 1, 10, 0, 0, 123456, tzinfo=timezone.utc)
    assert a.ends_at is None and a.fingerprint == "c0ffee"
    assert parse_payload(json.dumps({"version": "4", "status": "firing", "receiver": "r",
                                     "alerts": [a.to_dict()], "extraFieldFromTheFuture": 1})).alerts == (a,)


@pytest.mark.parametrize("body,expected", [
    (b"{not json", ["not JSON"]),
    (b"[]", ["must be a JSON object"]),
    (json.dumps(am_payload(version="3")).encode(), ["version: must be \"4\""]),
    (json.dumps({"version": "4"}).encode(), ["status: Field required", "receiver: Field required",
                                             "alerts: Field required"]),
    (json.dumps(am_payload(alerts=[])).encode(), ["alerts: List should have at least 1 item"]),
    (json.dumps(am_payload(alerts=[{"status": "burning", "labels": {"severity": 3}, "startsAt": "yesterday"}]))
     .encode(), ["alerts.0.status: Input should be 'firing' or 'resolved'",
                 "alerts.0.labels.severity: Input should be a valid string",
                 "alerts.0.startsAt: not an RFC 3339 time"]),
    (json.dumps(am_payload(alerts=[{"status": "firing", "labels": {"severity": "info"}, "startsAt": 5}])).encode(),
     ["alerts.0.labels: has no alertname", "alerts.0.startsAt: Input should be a valid datetime"]),
    (json.dumps(am_payload(alerts=[{"status": "firing", "labels": {"alertname": "A"}}, 7])).encode(),
     ["alerts.0.startsAt: Field required", "alerts.1: must be an object, got int"]),
])
def test_payload_problems_are_all_named(body, expected):
    with pytest.raises(PayloadError) as e:
        parse_payload(body)
    for want in expected:
        assert any(want in p for p in e.value.problems), (want, e.value.problems)
