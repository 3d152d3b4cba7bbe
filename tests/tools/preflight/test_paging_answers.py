"""The preflight's hostile inputs that are answers or logs: the relay's /healthz and Prometheus' API answers
(any JSON, any status) and the kernel log's records (any text) give findings, never a traceback."""

from __future__ import annotations

import json
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.spec import load_spec
from verl_exporter.tools.preflight import gpus, paging
from verl_exporter.tools.preflight.report import Finding, Options

SPEC = load_spec()
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=20)
# answers shaped like the real ones, with any value anywhere, so the parsing goes deep before it meets the odd part
PROM_LIKE = st.fixed_dictionaries({"data": st.fixed_dictionaries({
    "groups": st.lists(st.fixed_dictionaries({"rules": st.lists(JSON | st.fixed_dictionaries({"name": JSON}))}) | JSON),
    "activeTargets": st.lists(st.fixed_dictionaries({"labels": JSON, "health": JSON, "scrapeUrl": JSON}) | JSON) | JSON,
})})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(code=st.sampled_from([200, 404, 500, 503]), body=JSON | PROM_LIKE)
def test_any_answer_of_the_relay_or_prometheus_is_a_finding(code, body):
    o = Options(spec=SPEC, node="node-a", relay_url="http://relay", prometheus_url="http://prom")
    with mock.patch.object(paging, "_get", return_value=(code, body)):
        findings = paging.check(o)
    assert findings and all(isinstance(f, Finding) and f.check == "paging" for f in findings)


def test_an_answer_nested_deeper_than_the_decoder_goes_is_no_answer():
    deep = b"[" * 100_000 + b"]" * 100_000

    class Answer:
        status = 200

        def read(self, n):
            return deep

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    o = Options(spec=SPEC, node="node-a", relay_url="http://relay", prometheus_url="http://prom")
    with mock.patch.object(paging.urllib.request, "urlopen", return_value=Answer()):
        findings = paging.check(o)
    assert [f.ok for f in findings] == [False, False]
    assert "does not answer" in findings[0].line and "does not answer" in findings[1].line


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=400) | st.lists(
    st.tuples(st.text("0123456789-,", max_size=30), st.sampled_from(["NVRM: Xid (PCI:0000:28:00): 79, x", "Xid",
                                                                        "NVRM: Xid (PCI:zz): 9" + "9" * 5000])),
    max_size=5).map(lambda rs: "\n".join(f"{h};{m}" for h, m in rs)))
def test_any_kernel_log_gives_xid_findings_without_raising(tmp_path_factory, text):
    root = tmp_path_factory.mktemp("kmsg")
    (root / "uptime").write_text("100000.0 1.0\n")
    (root / "kmsg").write_text(text, encoding="utf-8", errors="surrogateescape")
    o = Options(spec=SPEC, node="node-a", procfs=str(root), kmsg=str(root / "kmsg"))
    findings = gpus._xids(o, {})
    assert all(isinstance(f, Finding) for f in findings)
    for f in findings:  # a finding quotes at most a bounded part of a record
        assert len(f.line) < 1000, json.dumps(f.line)[:200]
