"""Property-based fuzzing of the relay's webhook parser and of the webhook handler in front of it.

Invariants: parse_payload raises nothing but PayloadError (with a known reason); the handler answers every
body with 200, 400, 413 or 503 (never 500), and counts each 400 / 413 once in verl_relay_rejected_payloads_total;
end to end, every alert of an accepted webhook reaches the robot exactly once, whatever its values.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
import string
from collections import Counter
from datetime import datetime

import pytest
from conftest import post_json, wait_for
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from robots import FakeDingTalk
from verl_exporter.relay.app import Relay, RelayApp
from verl_exporter.relay.config import parse_config
from verl_exporter.relay.dispatch import Dispatcher
from verl_exporter.relay.metrics import RelayMetrics
from verl_exporter.relay.payload import (
    EARLIEST,
    LATEST,
    MAX_TRUNCATED_ALERTS,
    REASONS,
    REPAIRS,
    ZERO_TIME,
    PayloadError,
    parse_payload,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=20)
times = st.one_of(st.sampled_from(["2026-01-02T03:04:05Z", "2026-01-02T03:04:05.123456789+08:00",
                                   "0001-01-01T00:00:00Z", "2026-13-40T99:99:99Z", ""]), json_values)
label_maps = st.one_of(st.dictionaries(st.sampled_from(["alertname", "severity", "rank", "x"]),
                                       st.one_of(st.text(max_size=10), json_values), max_size=4), json_values)
alerts = st.fixed_dictionaries(
    {}, optional={"status": st.one_of(st.sampled_from(["firing", "resolved", "pending"]), json_values),
                  "labels": label_maps, "annotations": label_maps, "startsAt": times, "endsAt": times,
                  "generatorURL": st.one_of(st.text(max_size=10), json_values),
                  "fingerprint": st.one_of(st.text(max_size=10), json_values)})
payloads = st.fixed_dictionaries(
    {}, optional={"version": st.one_of(st.just("4"), json_values),
                  "status": st.one_of(st.sampled_from(["firing", "resolved"]), json_values),
                  "receiver": st.one_of(st.just("verl-warning"), json_values),
                  "groupKey": st.one_of(st.text(max_size=10), json_values),
                  "truncatedAlerts": st.one_of(st.integers(-2, 5), json_values),
                  "groupLabels": label_maps, "commonLabels": label_maps, "commonAnnotations": label_maps,
                  "alerts": st.one_of(st.lists(st.one_of(alerts, json_values), max_size=4), json_values)})


def nested(depth: int, opener: str) -> bytes:
    closer = {"[": "]", "{\"a\":": "}"}[opener]
    return ('{"version": "4", "alerts": ' + opener * depth + "1" + closer * depth + "}").encode()


bodies = st.one_of(
    st.binary(max_size=300),
    st.text(alphabet=string.printable + "{}[]\":,\u00e9\ud7ff", max_size=300).map(lambda t: t.encode("utf-8")),
    json_values.map(lambda v: json.dumps(v).encode()),
    payloads.map(lambda v: json.dumps(v).encode()),
    # cut or spliced valid JSON
    st.tuples(payloads, st.integers(0, 400)).map(lambda t: json.dumps(t[0]).encode()[:t[1]]),
    st.tuples(st.integers(0, 30_000), st.sampled_from(["[", "{\"a\":"])).map(lambda t: nested(*t)),
    st.integers(4000, 6000).map(lambda n: b'{"truncatedAlerts": ' + b"7" * n + b"}"),
)


@FUZZ
@given(bodies)
def test_the_parser_raises_only_its_own_clear_error(body):
    try:
        payload = parse_payload(body)
    except PayloadError as e:
        assert e.reason in REASONS
        assert e.problems and all(isinstance(p, str) and p for p in e.problems)
        assert sum(len(p) for p in e.problems) < 10_000  # a huge body never makes a huge answer
    else:
        assert payload.alerts and all(a.labels.get("alertname") for a in payload.alerts)


def _app() -> RelayApp:
    config = parse_config({"targets": {"dt": {"type": "dingtalk", "url": "http://127.0.0.1:9/robot/send",
                                              "token_env": "T"}},
                           "routes": [{"receivers": ["verl-warning"], "targets": ["dt"]}],
                           "max_body_bytes": 1024 * 1024, "delivery": {"queue_max_alerts": 100_000}},
                          environ={"T": "token-1"})
    metrics = RelayMetrics()
    # the workers are never started: accepted alerts only queue, nothing is sent
    return RelayApp(config, Dispatcher(config, metrics), metrics)


APP = _app()


def _post(app: RelayApp, body: bytes) -> int:
    got = []
    environ = {"PATH_INFO": "/alert/verl-warning", "REQUEST_METHOD": "POST", "CONTENT_LENGTH": str(len(body)),
               "wsgi.input": io.BytesIO(body)}
    answer = b"".join(app(environ, lambda status, headers: got.append(status)))
    json.loads(answer)  # every answer is JSON
    return int(got[0].split()[0])


@FUZZ
@given(bodies)
def test_the_webhook_answers_every_body_and_counts_every_rejection(body):
    def rejected() -> float:
        return sum(APP.metrics.value("verl_relay_rejected_payloads_total", reason=r) for r in REASONS)

    before = rejected()
    code = _post(APP, body)
    assert code in (200, 400, 413, 503)
    assert rejected() - before == (1 if code in (400, 413) else 0)


# ---------------------------------------------------------------- end to end: HTTP app, journal, loopback robot
# Arbitrary webhooks through the real relay (timezone Asia/Shanghai, a journal in spool_dir) to a loopback
# robot: alerts with times no zone can show, lone surrogates, huge strings; broken alerts of odd types.
# Never a 500; a broken body is answered 400 and counted; every alert of an accepted webhook reaches the
# robot exactly once (each carries a unique marker in its name), repaired values counted by reason, and the
# relay logs no traceback for any of it.
# No shrinking: each step would post and wait for the robot again (minutes); the failing case is printed as is.
HTTP_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck),
                     phases=[Phase.explicit, Phase.reuse, Phase.generate])
WINDOW = 0.5  # the robot's "minute", so that 100 examples take seconds
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
plain = st.text(alphabet=st.characters(blacklist_characters="⟦⟧"), max_size=20)  # Hypothesis leaves out Cs
texts = st.one_of(plain, st.tuples(plain, SURROGATES, plain).map("".join))
huge = st.integers(10_000, 60_000).map(lambda n: "y" * n)


def _rfc3339(t: datetime, offset_minutes: int, frac: str) -> str:
    sign, minutes = ("-" if offset_minutes < 0 else "+"), abs(offset_minutes)
    zone_ = "Z" if offset_minutes == 0 else f"{sign}{minutes // 60:02d}:{minutes % 60:02d}"
    return t.replace(microsecond=0).isoformat() + frac + zone_


times = st.one_of(
    st.sampled_from(["9999-12-31T23:00:00Z", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999999-23:59",
                     "0001-01-01T00:00:00+23:59", "2026-03-01T10:00:00.123456789+08:00"]),
    st.builds(_rfc3339, st.datetimes(datetime(1, 1, 1), datetime(9999, 12, 31, 23, 59, 59)),
              st.integers(-(24 * 60 - 1), 24 * 60 - 1), st.sampled_from(["", ".5", ".123456789"])))
good_alerts = st.fixed_dictionaries({
    "status": st.sampled_from(["firing", "resolved"]),
    "suffix": texts,  # the alertname is a marker, then this
    "severity": st.one_of(st.sampled_from(["critical", "warning", "info"]), texts),
    "labels": st.dictionaries(texts.map(lambda k: "x_" + k), texts, max_size=3),
    "annotations": st.fixed_dictionaries({}, optional={"summary": texts, "description": st.one_of(texts, huge),
                                                       "runbook_url": texts}),
    "startsAt": times,
    "endsAt": st.one_of(st.just("0001-01-01T00:00:00Z"), times),
})
BREAKS = {"labels": [1], "startsAt": 5, "status": "pending", "annotations": {"summary": 3}, "endsAt": 7,
          "fingerprint": ["x"]}
broken_alerts = st.one_of(st.tuples(good_alerts, st.sampled_from(sorted(BREAKS))), json_values)
webhooks = st.tuples(st.lists(st.one_of(good_alerts.map(lambda a: ("good", a)),
                                        broken_alerts.map(lambda a: ("broken", a))), min_size=1, max_size=4),
                     st.sampled_from(["ok", "ok", "ok", "ok", "bad_version", "bad_alerts"]))
MARKER = re.compile(r"⟦(\d+)⟧")
_markers = itertools.count()


def _count_surrogates(value) -> int:
    if isinstance(value, str):
        return int(any(0xD800 <= ord(c) <= 0xDFFF for c in value))
    if isinstance(value, dict):
        return sum(_count_surrogates(k) + _count_surrogates(v) for k, v in value.items())
    return sum(map(_count_surrogates, value)) if isinstance(value, list) else 0


def _clamped(text: str, is_end: bool) -> int:
    t = datetime.fromisoformat(re.sub(r"\.(\d+)", lambda m: "." + m.group(1)[:6].ljust(6, "0"),
                                      text.replace("Z", "+00:00")))
    if is_end and t <= ZERO_TIME:
        return 0  # still firing
    return int(not EARLIEST <= t <= LATEST)


def _alert_doc(kind: str, a) -> tuple[dict | object, int | None, Counter]:
    """The webhook form of a generated alert, its marker (None for a broken one), the repairs it needs."""
    if kind == "broken":
        if isinstance(a, tuple):  # a good alert with one field of the wrong type
            doc, _, _ = _alert_doc("good", a[0])
            return {**doc, a[1]: BREAKS[a[1]]}, None, Counter()
        return a, None, Counter()
    n = next(_markers)
    labels = {**a["labels"], "alertname": f"⟦{n}⟧{a['suffix']}", "severity": a["severity"]}
    doc = {"status": a["status"], "labels": labels, "annotations": a["annotations"], "startsAt": a["startsAt"],
           "endsAt": a["endsAt"], "generatorURL": "http://prometheus:9090/graph", "fingerprint": f"fuzz-{n}"}
    want = Counter(bad_unicode=_count_surrogates(doc),
                   time_out_of_range=_clamped(a["startsAt"], False) + _clamped(a["endsAt"], True))
    return doc, n, want


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    robot = FakeDingTalk("fuzz-token", window=WINDOW, limit=20).start()
    config = parse_config({
        "timezone": "Asia/Shanghai", "spool_dir": str(tmp_path_factory.mktemp("spool")),
        "delivery": {"rate_window_seconds": WINDOW, "initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.1,
                     "request_timeout_seconds": 2, "drain_seconds": 1},
        "targets": {"dt": {"type": "dingtalk", "url": robot.url, "token_env": "T"}},
        "routes": [{"receivers": ["verl-warning"], "targets": ["dt"]}]}, environ={"T": "fuzz-token"})
    relay = Relay(config, listen="127.0.0.1:0").start()
    tracebacks = _Tracebacks()
    logging.getLogger("verl_exporter.relay").addHandler(tracebacks)
    yield relay, robot, set(), tracebacks.records
    logging.getLogger("verl_exporter.relay").removeHandler(tracebacks)
    relay.stop(drain_seconds=0)
    robot.stop()


class _Tracebacks(logging.Handler):
    """The relay's log records that carry a traceback: bad input must get one clear line instead."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.levelno >= logging.INFO:
            self.records.append(record.getMessage())


def _http_post(relay: Relay, body: bytes) -> tuple[int, dict]:
    return post_json(f"{relay.url}/alert/verl-warning", body, timeout=10)


def _delivered(robot) -> Counter:
    """How many messages name each marker."""
    out: Counter = Counter()
    for m in list(robot.messages):
        out.update({int(n) for n in MARKER.findall(m[m["msgtype"]]["text"])})
    return out


@pytest.mark.integration
@HTTP_FUZZ
@given(st.lists(webhooks, min_size=1, max_size=3))
@example([([("good", {"status": "firing", "suffix": "", "severity": "critical", "labels": {},
                      "annotations": {"summary": "XID 79"}, "startsAt": "2026-03-01T10:00:00Z",
                      "endsAt": "0001-01-01T00:00:00Z"})] * 5
           + [("good", {"status": "firing", "suffix": "", "severity": "critical", "labels": {"x_run": "\ud800"},
                        "annotations": {}, "startsAt": "9999-12-31T23:00:00Z", "endsAt": "0001-01-01T00:00:00Z"})],
           "ok")])  # issue 22's F5: five good critical alerts queued ahead of one that overflows in +08:00
def test_arbitrary_webhooks_never_500_and_every_accepted_alert_arrives_once(live, hooks):
    relay, robot, expected, tracebacks = live
    m = relay.metrics
    for alerts, envelope in hooks:
        docs, markers, want = [], [], Counter()
        for kind, a in alerts:
            doc, n, repairs = _alert_doc(kind, a)
            docs.append(doc)
            markers += [n] if n is not None else []
            want += repairs
        broken = envelope != "ok" or len(markers) < len(docs)
        body = {"version": "5" if envelope == "bad_version" else "4", "status": "firing", "receiver": "verl-warning",
                "groupKey": "{}:{}", "alerts": {"0": docs} if envelope == "bad_alerts" else docs}
        repaired = {r: m.value("verl_relay_repaired_values_total", reason=r) for r in REPAIRS}
        rejected = m.value("verl_relay_rejected_payloads_total", reason="not_webhook")
        code, answer = _http_post(relay, json.dumps(body).encode())  # ensure_ascii: surrogates as \udXXX
        assert code == (400 if broken else 200), (code, answer)
        if broken:
            assert m.value("verl_relay_rejected_payloads_total", reason="not_webhook") == rejected + 1
            assert answer["problems"]
            continue
        expected.update(markers)
        for r in REPAIRS:
            assert m.value("verl_relay_repaired_values_total", reason=r) - repaired[r] == want[r], r
    wait_for(lambda: expected <= set(_delivered(robot)), timeout=30)
    got = _delivered(robot)
    assert set(got) <= expected  # nothing of a refused webhook
    assert all(got[n] == 1 for n in expected), {n: got[n] for n in expected if got[n] != 1}
    assert m.value("verl_relay_alerts_total", target="dt", result="failed") == 0
    assert m.value("verl_relay_alerts_total", target="dt", result="unrenderable") == 0
    assert not tracebacks


def _truncated(n) -> bytes:
    return json.dumps({"version": "4", "status": "firing", "receiver": "r", "truncatedAlerts": n,
                       "alerts": [{"status": "firing", "labels": {"alertname": "A"},
                                   "startsAt": "2026-01-02T03:04:05Z"}]}).encode()


@pytest.mark.parametrize("n", [10**30, MAX_TRUNCATED_ALERTS + 1, -1, 1.5, "5", True])
def test_a_truncated_count_no_alertmanager_sends_is_refused(n):
    with pytest.raises(PayloadError) as e:
        parse_payload(_truncated(n))
    assert any("truncatedAlerts" in p for p in e.value.problems)


def test_a_fleet_sized_truncated_count_is_taken():
    assert parse_payload(_truncated(MAX_TRUNCATED_ALERTS)).truncated_alerts == MAX_TRUNCATED_ALERTS
