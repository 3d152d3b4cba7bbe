"""Property-based fuzzing of what enters the sidecar from outside: Monitor.log() keys and values, and raw HTTP.

Invariants after every call or request: nothing raises into the caller; /metrics answers 200 and parses with
client_python's parser; the bad input is counted; the good keys of the same call are still exported; the
sidecar logs no bug (no "could not store", "answering a request failed", "left out of /metrics").
"""

from __future__ import annotations

import logging
import socket
import tempfile
import time
from pathlib import Path

import pytest
from conftest import http_get, parse_metrics, sample
from helpers import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.sources.verl_file import VerlFileFollower
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import load_spec
from verl_exporter.trainer.monitor import Monitor

pytestmark = pytest.mark.integration  # starts servers or programs

SPEC = load_spec()
GOOD = "actor/lr"  # verl_actor_learning_rate: each call carries a value of its own under this key
TOKEN = "fuzz-token"


class Odd:
    """A value whose __float__ raises what no one expects."""

    def __float__(self):
        raise ZeroDivisionError("odd")


class BadKey:
    """A key whose str() raises."""

    def __hash__(self):
        return 1

    def __eq__(self, other):
        return self is other

    def __str__(self):
        raise RuntimeError("no str")


# Any character: lone surrogates, control characters, quotes and backslashes included; "/" ends a label.
text = st.text(st.characters(categories=["Cs", "Cc", "Cf", "L", "N", "P", "S", "Zs"], exclude_characters="/"),
               max_size=12)
str_keys = st.one_of(
    st.builds(lambda t: f"timing_s/{t}", text.filter(bool)),
    st.builds(lambda t: f"val-core/{t}/reward/mean@1", text.filter(bool)),
    st.builds(lambda p, t: p + t, st.sampled_from(["actor/", "critic/", "custom/", "", "response_length/"]), text),
    st.text(max_size=300),
    # keys the detectors, the breaker and the conditional sources read
    st.sampled_from(["actor/grad_norm", "actor/pg_loss", "actor/entropy", "timing_s/step", "critic/score/mean",
                     "response_length/mean", "actor/lr", "perf/throughput", "critic/vf_loss", "actor/kl_loss",
                     "timing_s/gen", "timing_s/update_actor", "fully_async/count/dropped_stale_samples",
                     "rollout_corr/k3_kl", "training/rollout_actor_probs_pearson_corr"]),
)
keys = st.one_of(str_keys, st.integers(), st.tuples(st.integers(), st.text(max_size=3)), st.none(),
                 st.binary(max_size=4), st.builds(BadKey))
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**400), 10**400),
                    st.booleans(), st.none())
odd_values = st.one_of(st.text(max_size=5), st.binary(max_size=3), st.builds(Odd), st.builds(object),
                       st.lists(st.floats(), max_size=2), st.tuples(st.integers()))
values = st.recursive(st.one_of(numbers, odd_values),
                      lambda inner: st.dictionaries(keys, inner, max_size=3), max_leaves=6)
calls = st.dictionaries(keys, values, max_size=6)


def not_a_number(value) -> bool:
    """A top-level value that can never be exported (the store must count it as rejected)."""
    return isinstance(value, (str, bytes, list, tuple, Odd)) or type(value) is object


class Bugs(logging.Handler):
    """Collects the sidecar's log records that would mean a bug, not bad input."""

    SIGNS = ("could not store", "could not publish", "answering a request failed", "left out of /metrics",
             "the detectors could not", "the breaker could not", "rendering failed")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if record.exc_info or any(sign in message for sign in self.SIGNS):
            self.records.append(message)


@pytest.fixture(scope="module")
def monitor():
    bugs = Bugs()
    logging.getLogger("verl_exporter").addHandler(bugs)
    with tempfile.TemporaryDirectory() as tmp:
        mon = Monitor(listen="127.0.0.1:0", run="fuzz", rank=0, control_token=TOKEN, breaker=True,
                      control_file=str(Path(tmp) / "control.json"))
        mon.bugs = bugs
        mon.calls = 0
        try:
            yield mon
        finally:
            mon.close()
            logging.getLogger("verl_exporter").removeHandler(bugs)


def scrape(mon: Monitor) -> dict:
    status, _, body = http_get(mon.url + "/metrics")
    assert status == 200
    text = body.decode()
    assert list(text_string_to_metric_families(text))
    return parse_metrics(text)


def rejected(samples: dict) -> float:
    return sum(v for (name, _), v in samples.items() if name == "verl_exporter_values_rejected_total")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls)
def test_monitor_log_takes_any_keys_and_values_and_keeps_the_good_ones(monitor, data):
    monitor.bugs.records.clear()
    before = rejected(scrape(monitor))
    monitor.calls += 1
    good = monitor.calls + 0.5
    data = {**data, GOOD: good}
    monitor.log(data, step=monitor.calls)  # never raises
    m = scrape(monitor)
    assert sample(m, "verl_actor_learning_rate") == good  # the good key of the same call
    assert sample(m, "verl_exporter_lines_parsed_total", source="monitor") == monitor.calls
    assert rejected(m) - before >= sum(not_a_number(v) for v in data.values())
    assert not monitor.bugs.records, monitor.bugs.records


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls)
def test_monitor_writing_the_sidecar_file_keeps_the_good_keys_of_any_call(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.jsonl"
        mon = Monitor(sidecar_file=str(path))
        mon.log({**data, GOOD: 0.25}, step=3)
        mon.log({GOOD: 0.75}, step=4)
        mon.close()
        sm = SelfMetrics(SPEC)
        store = TrainingStore(SPEC, sm)
        VerlFileFollower(str(path), store, sm).poll()
        registry = CollectorRegistry()
        registry.register(sm)
        text = (store.render() + generate_latest(registry).decode()).encode().decode()
        m = parse_metrics(text)
        assert sample(m, "verl_exporter_lines_parsed_total", source="file") == 2  # both lines written whole
        assert store.value("verl_actor_learning_rate") == 0.75 and store.step == 4


def test_the_escaped_label_of_a_fuzzed_key_is_counted(monitor):
    """The cheap deterministic twin of the property above for the counting of escapes."""
    before = sample(scrape(monitor), "verl_exporter_label_values_escaped_total", reason="control_char") or 0
    monitor.log({"timing_s/a\tb": 1.0, GOOD: 9.5}, step=10**6)
    m = scrape(monitor)
    assert sample(m, "verl_timing_seconds", phase="a\\x09b") == 1.0
    assert sample(m, "verl_exporter_label_values_escaped_total", reason="control_char") == before + 1


# ------------------------------------------------------------------ raw HTTP
methods = st.one_of(st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "TRACE", "OPTIONS", "PATCH", "get"]),
                    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=8))
paths = st.one_of(st.sampled_from(["/metrics", "/healthz", "/healthz/sidecar", "/", "/control/checkpoint",
                                   "/control/stop", "/control/", "/nope", "*", "http://x/metrics"]),
                  st.builds(lambda t: "/" + t, st.text(max_size=20)))
header_names = st.one_of(st.sampled_from(["Content-Length", "Transfer-Encoding", "Accept", "Accept-Encoding",
                                          "Authorization", "Host", "Expect", "Connection"]),
                         st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
                                 min_size=1, max_size=10))
header_values = st.one_of(st.sampled_from(["0", "5", "2, 2", "-1", "chunked", "gzip", "*/*",
                                           "application/openmetrics-text; version=1.0.0; q=0.5",
                                           f"Bearer {TOKEN}", "100-continue"]),
                          st.binary(max_size=20).map(lambda b: b.decode("latin-1")))
requests = st.builds(
    lambda method, path, version, headers, body: (
        method.encode("latin-1", "replace"), f"{method} {path} {version}\r\n".encode("utf-8", "surrogatepass")
        + b"".join(f"{n}: {v}\r\n".encode("latin-1", "replace") for n, v in headers) + b"\r\n" + body),
    methods, paths, st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/x", ""]),
    st.lists(st.tuples(header_names, header_values), max_size=5), st.binary(max_size=40))


def exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=scaled(20)) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:  # refused with the body unread: what came before the reset counts
            pass
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_any_http_request_gets_an_answer_and_metrics_keep_serving(monitor, request):
    method, raw = request
    monitor.bugs.records.clear()
    monitor.calls += 1
    monitor.log({GOOD: monitor.calls + 0.5}, step=monitor.calls)
    answer = exchange(monitor.sidecar.server.port, raw)
    if answer:  # a request line of blanks is closed without an answer
        status_line = answer.split(b"\r\n", 1)[0].split()
        assert status_line[0].startswith(b"HTTP/") and status_line[1].isdigit(), answer[:200]
        code = int(status_line[1])
        assert code != 500 and (code < 500 or code in (501, 503, 505)), answer[:300]
        if method == b"HEAD" and code == 200:
            assert answer.partition(b"\r\n\r\n")[2] == b""
    m = scrape(monitor)
    assert sample(m, "verl_actor_learning_rate") == monitor.calls + 0.5
    assert not monitor.bugs.records, monitor.bugs.records
    time.sleep(0)  # let the connection's thread finish before the next example counts anything
