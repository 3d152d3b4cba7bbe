"""The two files the preflight writes and others read back, as hostile input: the result file the sidecar's
preflight collector exports, and each node's entry in the shared --manifests-dir. Anything but what the
preflight wrote is refused with a reason, never exported or compared as a guess, and never raises else."""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.sidecar.collectors.preflight import (
    CHECKS,
    RESULT_FORMAT,
    BadResult,
    PreflightCollector,
    parse_result,
)
from verl_exporter.tools.preflight.resume import BadNodeFile, NodeView, parse_node, read_nodes

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                       max_size=4), max_leaves=20)


def result(**changes):
    doc = {"format": RESULT_FORMAT, "format_version": 1, "timestamp": 1.7e9, "node": "n0", "passed": False,
           "checks": {"gpu": "fail", "disk": "pass", "paging": "skip"}, "findings": []}
    doc.update(changes)
    return json.dumps(doc).encode()


def test_a_result_file_the_preflight_writes_is_read_back():
    assert parse_result(result()) == {"timestamp": 1.7e9, "passed": False,
                                      "checks": {"gpu": "fail", "disk": "pass", "paging": "skip"}}


def test_the_collector_exports_the_result_and_counts_a_bad_file(tmp_path):
    from fake_pynvml import make_context

    path = tmp_path / "preflight.json"
    ctx = make_context(None, preflight_result=str(path))
    c = PreflightCollector(ctx)
    assert c.sample() == []  # no preflight yet: no series, no problem
    path.write_bytes(result())
    rows = {(name, tuple(labels.items())): v for name, labels, v in c.sample()}
    assert rows == {("verl_preflight_last_run_timestamp_seconds", ()): 1.7e9, ("verl_preflight_passed", ()): 0.0,
                    ("verl_preflight_check_passed", (("check", "gpu"),)): 0.0,
                    ("verl_preflight_check_passed", (("check", "disk"),)): 1.0}
    path.write_bytes(result(passed=True))  # says passed while a check failed
    assert c.sample() == []
    os.unlink(path)
    os.mkfifo(path)  # a FIFO must not block the sampler
    assert c.sample() == []


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_a_result_or_refused(raw):
    try:
        parsed = parse_result(raw)
    except BadResult:
        return
    assert set(parsed["checks"]) <= set(CHECKS) and parsed["passed"] == ("fail" not in parsed["checks"].values())


@FUZZ
@given(st.dictionaries(st.sampled_from(["format", "format_version", "timestamp", "passed", "checks"]), json_values))
def test_result_fields_of_any_type_are_refused_or_valid(changes):
    try:
        parsed = parse_result(result(**changes))
    except BadResult:
        return
    assert isinstance(parsed["timestamp"], float) and parsed["timestamp"] >= 0


def node(**changes):
    doc = NodeView("n1", 100, {"data.pt": (100, "a" * 64)}).as_dict()
    doc.update(changes)
    return json.dumps(doc).encode()


def test_a_node_entry_is_read_back_and_must_name_its_own_node():
    assert parse_node(node(), "n1").files == {"data.pt": (100, "a" * 64)}
    try:
        parse_node(node(), "n2")
    except BadNodeFile as e:
        assert "names node 'n1', not 'n2'" in str(e)
    else:
        raise AssertionError("a copied entry was accepted for another node")


@FUZZ
@given(st.dictionaries(st.sampled_from(["format", "format_version", "node", "step", "local_ok", "files"]),
                       json_values))
def test_node_entries_of_any_shape_are_refused_or_valid(changes):
    try:
        view = parse_node(node(**changes), "n1")
    except BadNodeFile:
        return
    assert view.step is None or (isinstance(view.step, int) and view.step >= 0)
    assert all(isinstance(size, int) and len(digest) == 64 for size, digest in view.files.values())


def test_a_folder_of_odd_entries_lists_each_problem(tmp_path):
    (tmp_path / "n1.json").write_bytes(node())
    (tmp_path / "n2.json").write_bytes(b"\xff\xfe")
    (tmp_path / "n3.json").mkdir()
    (tmp_path / ".n4.json.x1.tmp").write_bytes(b"half")  # a write in progress is not an entry
    (tmp_path / "notes.txt").write_text("hi")
    views, bad = read_nodes(tmp_path)
    assert list(views) == ["n1"]
    assert [line.split(": ", 1)[1] for line in bad] == ["not JSON (UnicodeDecodeError)", "Is a directory"]
