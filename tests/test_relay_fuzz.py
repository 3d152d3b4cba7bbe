"""Property-based fuzzing of the relay's webhook parser and of the webhook handler in front of it.

Invariants: parse_payload raises nothing but PayloadError (with a known reason); the handler answers every
body with 200, 400, 413 or 503 (never 500), and counts each 400 / 413 once in verl_relay_rejected_payloads_total.
"""

from __future__ import annotations

import io
import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.relay.app import RelayApp
from verl_exporter.relay.config import parse_config
from verl_exporter.relay.dispatch import Dispatcher
from verl_exporter.relay.metrics import RelayMetrics
from verl_exporter.relay.payload import REASONS, PayloadError, parse_payload

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
