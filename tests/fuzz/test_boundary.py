"""What comes from outside is made safe where it enters; /metrics never goes down for one bad value.

A label value that UTF-8 cannot encode (a lone surrogate: a JSON \\ud800 escape, a name decoded from non-UTF-8
bytes) once made every scrape answer 500. Here: such values are escaped at the mapper and counted, each family
of /metrics is encoded on its own, and the HTTP side answers methods and framing it does not take with 4xx.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest
from conftest import http_get, parse_metrics, sample, wait_for
from helpers import scaled
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from verl_exporter.core.httpserver import HttpServer
from verl_exporter.exposition.app import make_app
from verl_exporter.exposition.encode import TextRenderer
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import MetricSpec, load_spec
from verl_exporter.trainer.monitor import Monitor

SPEC = load_spec()
ESCAPED = "verl_exporter_label_values_escaped_total"


def served(store: TrainingStore) -> dict:
    """The store's exposition as a scraper reads it: UTF-8 bytes, parsed by client_python."""
    return parse_metrics(store.render().encode().decode())


# ------------------------------------------------------------------ F1: the boundary
def test_a_label_value_utf8_cannot_encode_is_exported_escaped_and_counted():
    sm = SelfMetrics(SPEC)
    store = TrainingStore(SPEC, sm)
    store.ingest(2, {"timing_s/\ud800": 1.0, "actor/grad_norm": 0.5}, time.time())
    m = served(store)
    assert sample(m, "verl_timing_seconds", phase="\\ud800") == 1.0
    assert sample(m, "verl_actor_grad_norm") == 0.5  # the good key of the same line
    assert sm.value(ESCAPED, reason="not_utf8") == 1
    store.ingest(3, {"timing_s/\ud800": 2.0}, time.time())
    assert sm.value(ESCAPED, reason="not_utf8") == 2  # counted per value, as rejected values are


def test_control_characters_in_a_label_value_are_escaped_and_counted():
    sm = SelfMetrics(SPEC)
    store = TrainingStore(SPEC, sm)
    store.ingest(1, {"timing_s/a\x1b[2Jb\x00": 1.0, 'timing_s/q"u\\o': 2.0}, time.time())
    m = served(store)
    assert sample(m, "verl_timing_seconds", phase="a\\x1b[2Jb\\x00") == 1.0
    assert sample(m, "verl_timing_seconds", phase='q"u\\o') == 2.0  # what the exposition escapes stays as is
    assert sm.value(ESCAPED, reason="control_char") == 1


def test_an_escaped_label_value_over_the_length_limit_is_rejected_not_exported():
    sm = SelfMetrics(SPEC)
    store = TrainingStore(SPEC, sm)
    store.ingest(1, {"timing_s/" + "\ud800" * 100: 1.0}, time.time())  # 100 characters, 600 once escaped
    assert sample(served(store), "verl_timing_seconds") is None
    assert sm.value("verl_exporter_values_rejected_total", reason="label_too_long") == 1


def test_run_and_label_values_from_the_command_line_are_escaped_in_every_part_of_metrics():
    labels = {"run": os.fsdecode(b"run-\xfe"), "rank": "0"}  # argv is decoded with surrogateescape
    sm = SelfMetrics(SPEC, labels)
    store = TrainingStore(SPEC, sm, labels)
    store.ingest(1, {"actor/grad_norm": 0.5}, time.time())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(sm)
    app = make_app(registry, sm, lambda: (True, {}), summary=f"run={labels['run']}", renderers=[store.render])
    status, body = call(app, "/metrics")
    assert status.startswith("200")
    m = parse_metrics(body.decode())
    assert sample(m, "verl_actor_grad_norm", run="run-\\udcfe") == 0.5
    assert sample(m, "verl_exporter_build_info", run="run-\\udcfe") == 1
    status, body = call(app, "/")
    assert status.startswith("200") and b"run-\\udcfe" in body


def call(app, path: str, method: str = "GET", **environ) -> tuple[str, bytes]:
    got = {}

    def start_response(status, headers):
        got["status"], got["headers"] = status, dict(headers)

    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": method, **environ}, start_response))
    call.headers = got["headers"]
    return got["status"], body


# ------------------------------------------------------------------ F1: each family on its own
BAD_FAMILY = '# HELP bad_one x\n# TYPE bad_one gauge\nbad_one{l="\ud800"} 1\n'
GOOD_FAMILY = "# HELP good_one y\n# TYPE good_one gauge\ngood_one 2\n"


class _Collector:
    def __init__(self, label: str):
        self.label = label

    def collect(self):
        bad = GaugeMetricFamily("bad_registry", "x", labels=["l"])
        bad.add_metric([self.label], 1)
        good = GaugeMetricFamily("good_registry", "y")
        good.add_metric([], 3)
        return [bad, good]


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text; version=1.0.0"])
def test_one_family_that_cannot_be_encoded_costs_only_itself(accept, caplog):
    sm = SelfMetrics(SPEC)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector("\udcff"))
    registry.register(sm)
    app = make_app(registry, sm, lambda: (True, {}),
                   renderers=[lambda om: BAD_FAMILY + GOOD_FAMILY, lambda om: GOOD_FAMILY.replace("good", "next")])
    with caplog.at_level(logging.WARNING):
        status, body = call(app, "/metrics", HTTP_ACCEPT=accept)
    assert status.startswith("200")
    text = body.decode()
    assert text.count("# EOF") == (1 if accept else 0)
    m = parse_metrics(text) if not accept else None
    if m is not None:
        assert sample(m, "good_one") == 2 and sample(m, "next_one") == 2 and sample(m, "good_registry") == 3
        assert sample(m, "bad_one") is None and sample(m, "bad_registry") is None
        assert sample(m, "verl_exporter_build_info") == 1
    else:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"good_one", "next_one", "good_registry"} <= names
    assert sm.value("verl_exporter_source_errors_total", component="exposition") == 2
    assert "# HELP" not in caplog.text  # never a whole /metrics body in the log


def test_a_renderer_that_raises_costs_only_its_own_part():
    sm = SelfMetrics(SPEC)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(sm)

    def broken(openmetrics):
        raise RuntimeError("x" * 100_000)

    app = make_app(registry, sm, lambda: (True, {}), renderers=[broken, lambda om: GOOD_FAMILY])
    status, body = call(app, "/metrics")
    assert status.startswith("200") and sample(parse_metrics(body.decode()), "good_one") == 2


def test_a_series_whose_value_is_not_a_number_costs_only_its_family():
    failed = []
    renderer = TextRenderer(on_error=lambda name, e: failed.append(name))
    gauge = MetricSpec.model_construct(name="g", type="gauge", help="h", layer="data", labels=("l",))
    other = MetricSpec.model_construct(name="o", type="gauge", help="h", layer="data")
    text = renderer.render([(gauge, {("a",): "not a number"}), (other, {(): 1.0})])
    m = parse_metrics(text)
    assert sample(m, "o") == 1.0 and sample(m, "g") is None
    assert failed == ["g"]


# ------------------------------------------------------------------ F13: one line for ordinary bad input
def test_expected_problems_log_one_line_and_bugs_their_traceback(caplog):
    sm = SelfMetrics(SPEC)
    with caplog.at_level(logging.WARNING):
        try:
            raise TimeoutError("the request did not arrive in time")
        except TimeoutError:
            sm.problem("http", "timeout", "a client did not send its request")
        try:
            raise ValueError("bad value")
        except ValueError:
            sm.problem("store", "value", "a bad value", expected=True)
        try:
            {}["missing"]
        except KeyError:
            sm.problem("store", "bug", "a bug")
    records = {r.getMessage(): r for r in caplog.records}
    assert records["http: a client did not send its request"].exc_info is None
    assert records["store: a bad value"].exc_info is None
    assert records["store: a bug"].exc_info is not None  # a genuine bug keeps its traceback
    assert sm.value("verl_exporter_source_errors_total", component="http") == 1


def test_a_problem_message_is_one_bounded_line_that_logging_can_write(caplog):
    sm = SelfMetrics(SPEC)
    with caplog.at_level(logging.WARNING):
        sm.problem("exposition", "render", "failed: " + "\ud800\n" * 50_000)
    (record,) = caplog.records
    message = record.getMessage()
    assert len(message) < 1000 and "\n" not in message
    message.encode()  # a lone surrogate would make the log handler fail ("--- Logging error ---")


@pytest.mark.integration
def test_a_client_timeout_is_counted_and_logged_without_a_traceback(caplog):
    sm = SelfMetrics(SPEC)
    srv = HttpServer(lambda e, s: [], "127.0.0.1:0", request_timeout=0.3,
                     on_problem=lambda kind, message: sm.problem("http", kind, message)).start()
    try:
        with caplog.at_level(logging.WARNING), \
                socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(10)) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            wait_for(lambda: sm.value("verl_exporter_source_errors_total", component="http") == 1, timeout=10)
    finally:
        srv.stop()
    (record,) = [r for r in caplog.records if r.name.endswith("selfmetrics")]
    assert record.exc_info is None and "did not send its request" in record.getMessage()


# ------------------------------------------------------------------ F12: methods and framing
@pytest.fixture
def sidecar_app():
    sm = SelfMetrics(SPEC)
    store = TrainingStore(SPEC, sm)
    store.ingest(1, {"actor/grad_norm": 0.5}, time.time())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(sm)
    app = make_app(registry, sm, lambda: (True, {"step": 1}), renderers=[store.render])
    srv = HttpServer(app, "127.0.0.1:0", request_timeout=5,
                     on_problem=lambda kind, message: sm.problem("http", kind, message)).start()
    yield srv, sm
    srv.stop()


def raw(srv: HttpServer, request: bytes) -> bytes:
    """The whole answer to one request, read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(10)) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def split(answer: bytes) -> tuple[int, dict, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/"])
@pytest.mark.integration
def test_head_sends_the_headers_of_get_and_no_body(sidecar_app, path):
    srv, _ = sidecar_app
    code, get_headers, get_body = split(raw(srv, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()))
    assert code == 200 and get_body
    code, headers, body = split(raw(srv, f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()))
    assert code == 200 and body == b""
    assert headers["content-type"] == get_headers["content-type"]
    assert int(headers["content-length"]) > 0


@pytest.mark.parametrize("method", ["PUT", "DELETE", "TRACE", "POST", "PATCH", "OPTIONS"])
@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/"])
@pytest.mark.integration
def test_other_methods_answer_405_with_allow(sidecar_app, method, path):
    srv, _ = sidecar_app
    code, headers, _ = split(raw(srv, f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()))
    assert code == 405
    assert headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize("framing", [
    b"Content-Length: 2\r\nContent-Length: 20\r\n",
    b"Content-Length: 2\r\nContent-Length: 2\r\n",
    b"Content-Length: 2, 2\r\n",
    b"Content-Length: -1\r\n",
    b"Content-Length: +2\r\n",
    b"Content-Length: \xb2\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n",
])
@pytest.mark.integration
def test_ambiguous_request_framing_is_refused_with_400(sidecar_app, framing):
    srv, sm = sidecar_app
    code, _, _ = split(raw(srv, b"POST /metrics HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n{}"))
    assert code == 400
    assert sm.value("verl_exporter_source_errors_total", component="http") == 1
    code, _, body = split(raw(srv, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert code == 200 and sample(parse_metrics(body.decode()), "verl_actor_grad_norm") == 0.5


@pytest.mark.integration
def test_a_transfer_encoding_the_server_does_not_read_answers_501(sidecar_app):
    srv, _ = sidecar_app
    code, _, _ = split(raw(srv, b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"))
    assert code == 501


@pytest.mark.integration
def test_the_control_endpoint_still_takes_a_post_with_one_content_length(tmp_path):
    mon = Monitor(listen="127.0.0.1:0", control_token="t0ken", control_file=str(tmp_path / "control.json"))
    try:
        body = b'{"reason": "test"}'
        code, _, answer = split(raw(mon.sidecar.server, b"POST /control/checkpoint HTTP/1.1\r\nHost: x\r\n"
                                    b"Authorization: Bearer t0ken\r\nContent-Type: application/json\r\n"
                                    b"Content-Length: %d\r\n\r\n" % len(body) + body))
        assert code == 200 and b'"applied": true' in answer
        wait_for(mon.should_checkpoint, timeout=10)
        assert mon.control_reason == "test"
    finally:
        mon.close()


# ------------------------------------------------------------------ in-process and real-process paths
@pytest.mark.integration
def test_monitor_log_with_a_name_from_non_utf8_bytes_keeps_every_series(tmp_path):
    mon = Monitor(listen="127.0.0.1:0", run=os.fsdecode(b"run-\xfe"), rank=0)
    try:
        source = os.fsdecode(b"gsm8k-\xff")  # a data-source name from a non-UTF-8 file name
        mon.log({f"val-core/{source}/reward/mean@1": 0.5, "actor/grad_norm": 0.25}, step=1)
        status, _, body = http_get(mon.url + "/metrics")
        assert status == 200
        m = parse_metrics(body.decode())
        assert sample(m, "verl_validation_score", data_source="gsm8k-\\udcff", run="run-\\udcfe") == 0.5
        assert sample(m, "verl_actor_grad_norm") == 0.25
        assert sample(m, ESCAPED, reason="not_utf8") == 1
        assert http_get(mon.url + "/")[0] == 200
        assert http_get(mon.url + "/healthz")[0] == 200
    finally:
        mon.close()


def test_monitor_writing_a_sidecar_file_keeps_the_good_keys_of_a_bad_call(tmp_path):
    path = tmp_path / "m.jsonl"
    mon = Monitor(sidecar_file=str(path))
    try:
        class Odd:
            def __float__(self):
                raise ZeroDivisionError

        cycle: dict = {}
        cycle["self"] = cycle
        mon.log({"actor/grad_norm": 0.5, (1, 2): 1.0, "odd": Odd(), "deep": cycle, "big": 10**400,
                 "nan": float("nan")}, step=1)
        mon.drain()
    finally:
        mon.close()
    import json
    (line,) = path.read_text().splitlines()
    doc = json.loads(line)
    assert doc["step"] == 1 and doc["data"]["actor/grad_norm"] == 0.5 and doc["data"]["(1, 2)"] == 1.0
    assert doc["data"]["nan"] is None


@pytest.mark.integration
def test_a_line_with_a_lone_surrogate_does_not_take_the_scrape_down(tmp_path, serve):
    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 1, "data": {"actor/grad_norm": 0.5}}\n')
    side = serve("--verl-log", str(log))
    wait_for(lambda: sample(side.metrics(), "verl_training_step") == 1, timeout=10)
    with log.open("a") as fh:
        fh.write('{"step": 2, "data": {"timing_s/\\ud800": 1.0}}\n')
    wait_for(lambda: sample(side.metrics(), "verl_training_step") == 2, timeout=10)
    m = side.metrics()  # asserts 200
    assert sample(m, "verl_actor_grad_norm") == 0.5
    assert sample(m, "verl_timing_seconds", phase="\\ud800") == 1.0
    assert sample(m, ESCAPED, reason="not_utf8") == 1
    out = side.stop()
    assert "# HELP" not in out and "Traceback" not in out
    again = serve("--verl-log", str(log))  # a restart recovers the tail: the same line is read back
    wait_for(lambda: sample(again.metrics(), "verl_training_step") == 2, timeout=10)
    assert sample(again.metrics(), "verl_timing_seconds", phase="\\ud800") == 1.0


# ------------------------------------------------------------------ numbers beyond a float's range
def test_an_integer_beyond_a_float_costs_only_itself_in_the_store_and_the_detectors():
    sm = SelfMetrics(SPEC)
    store = TrainingStore(SPEC, sm)
    huge = 10**400  # Monitor.log() takes Python ints; float() of this one raises OverflowError
    for step in range(1, 4):
        store.ingest(step, {"actor/grad_norm": huge, "timing_s/step": huge, "actor/lr": step + 0.5}, time.time())
    assert store.value("verl_actor_learning_rate") == 3.5
    assert sm.value("verl_exporter_values_rejected_total", reason="out_of_range") == 6
    assert sm.snapshot()["verl_exporter_source_errors_total"] == {}  # no failure of the store or detectors


def test_the_breaker_judges_the_other_keys_of_a_step_with_a_huge_integer():
    from verl_exporter.trainer.breaker import CircuitBreaker

    breaker = CircuitBreaker.from_spec(SPEC)
    anomalies, _ = breaker.observe(1, {"actor/grad_norm": 10**400, "actor/pg_loss": float("nan")})
    assert [(a.alert, a.kind) for a in anomalies] == [("VerlNonFiniteLoss", "nonfinite")]
