"""--engines-from reads the prometheus.yml verl writes: only host:port targets reach the file_sd entry.

A target that is not a host:port string (null, a number, a URL, one with whitespace or a newline, a port out of
range) is left out and counted; the others are written. Any document, and any mutation of verl's file, leaves
the entry either absent or made of valid targets only.
"""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.engines_sd import EnginesSd, engine_file_sd, is_target
from verl_exporter.spec import load_spec

SPEC = load_spec()
GOOD = ["127.0.0.1:8000", "node-3.cluster.example:30001", "[::1]:8000", "[fe80::1%eth0]:9", "h:65535"]
BAD = [None, 5, 5.5, True, [], {}, "", "127.0.0.1", "http://127.0.0.1:8000", "127.0.0.1:8000/metrics",
       "a b:80", " h:80", "h:80\n", "h:80\nx: 1", "h:0", "h:65536", "h:99999999999", "h:-1", "h:8x", ":80",
       "h::80", "[::1:80", "h\t:80", "h:80\x00", "a" * 300 + ":80", "héllo:80", "-h:80"]


def doc(targets) -> dict:
    return {"scrape_configs": [{"job_name": "rollout", "static_configs": [{"targets": targets}]}]}


@pytest.mark.parametrize("target", GOOD)
def test_a_host_port_target_is_kept(target):
    assert is_target(target)
    assert engine_file_sd(doc([target]), "r", "vllm")[0]["targets"] == [target]


@pytest.mark.parametrize("target", BAD)
def test_a_target_that_is_no_host_port_is_left_out(target):
    assert not is_target(target)
    assert engine_file_sd(doc([target, "127.0.0.1:8000"]), "r", "vllm")[0]["targets"] == ["127.0.0.1:8000"]
    assert engine_file_sd(doc([target]), "r", "vllm") == []


def test_the_left_out_targets_are_counted_and_the_good_ones_written(tmp_path):
    sm = SelfMetrics(SPEC)
    source, out = tmp_path / "prometheus.yml", tmp_path / "file_sd"
    source.write_text(yaml.safe_dump(doc(["127.0.0.1:8000", None, 5, "http://x:1", "h:80\nx"])))
    sd = EnginesSd(str(source), str(out), "r", "vllm", sm.problem)
    assert sd.update() is True
    assert json.loads((out / "rollout-r.json").read_text())[0]["targets"] == ["127.0.0.1:8000"]
    assert sm.value("verl_exporter_source_errors_total", component="engines_sd") == 1


targets = st.one_of(st.sampled_from(GOOD + BAD), st.text(max_size=20), st.integers(), st.none(),
                    st.builds(lambda h, p: f"{h}:{p}", st.text(max_size=8), st.integers(-5, 70000)))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8), targets),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                               st.sampled_from(["scrape_configs", "job_name", "static_configs", "targets", "x"]),
                               inner, max_size=3), max_leaves=12)
documents = st.one_of(json_values, st.lists(targets, max_size=6).map(doc),
                      st.builds(lambda t, j: {"scrape_configs": [{"job_name": j, "static_configs": [{"targets": t}]}]},
                                st.lists(targets, max_size=6), st.sampled_from(["rollout", "ray", 5])))


@settings(max_examples=300, deadline=None)
@given(documents)
def test_any_document_gives_an_entry_of_valid_targets_only(document):
    for entry in engine_file_sd(document, "r", "sglang"):
        assert entry["targets"] and all(is_target(t) for t in entry["targets"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 200), st.binary(max_size=3)), min_size=1, max_size=4))
def test_any_mutation_of_verls_file_is_read_without_raising(tmp_path, edits):
    raw = bytearray(yaml.safe_dump(doc(GOOD)).encode())
    for at, new in edits:
        raw[at % len(raw):at % len(raw) + 1] = new
    (tmp_path / "prometheus.yml").write_bytes(bytes(raw))
    sd = EnginesSd(str(tmp_path / "prometheus.yml"), str(tmp_path / "sd"), "r", "vllm", SelfMetrics(SPEC).problem)
    if sd.update():
        written = json.loads((tmp_path / "sd" / "rollout-r.json").read_text())
        assert all(is_target(t) for t in written[0]["targets"])


def test_a_fifo_or_folder_as_verls_file_never_blocks_the_sidecar(tmp_path):
    """update() runs at the sidecar's start: opening a FIFO there blocked it before it ever served /metrics."""
    import os
    import threading

    source = tmp_path / "prometheus.yml"
    sm = SelfMetrics(SPEC)
    sd = EnginesSd(str(source), str(tmp_path / "sd"), "r", "vllm", sm.problem)
    for make in (os.mkfifo, os.mkdir):
        make(source)
        done: list[bool] = []
        reader = threading.Thread(target=lambda out=done: out.append(sd.update()), daemon=True)
        reader.start()
        reader.join(timeout=5)
        blocked = reader.is_alive()
        if blocked:  # let the blocked open() go before failing
            os.close(os.open(source, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(timeout=5)
        assert not blocked and done == [False]
        os.rmdir(source) if source.is_dir() else source.unlink()
    assert sm.value("verl_exporter_source_errors_total", component="engines_sd") == 2
    assert not (tmp_path / "sd").exists()
