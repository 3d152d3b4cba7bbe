"""The corpus of real public verl runs (tests/data/real_runs): every entry is what corpus.yaml says it is, and
reads through the real file follower without losing a value."""

from __future__ import annotations

import gzip
import json
import math
import statistics

import pytest
import yaml
from conftest import REPO
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.mapper import KeyMapper, unmapped_name
from verl_exporter.sidecar.sources.verl_file import VerlFileFollower
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import load_spec

CORPUS = REPO / "tests" / "data" / "real_runs"
ENTRIES = yaml.safe_load((CORPUS / "corpus.yaml").read_text())["runs"]
FIELDS = {"name", "file", "source", "licence", "what", "key_scheme", "verdict", "fault_step", "fault", "why",
          "expect_alerts", "allow_alerts", "gaps", "steps", "first_step", "last_step", "median_step_seconds"}


def raw_bytes(entry) -> bytes:
    data = (CORPUS / entry["file"]).read_bytes()
    return gzip.decompress(data) if entry["file"].endswith(".gz") else data


def records(entry) -> list[dict]:
    return [json.loads(line) for line in raw_bytes(entry).decode().splitlines()]


def test_every_file_is_listed_once_and_every_listed_file_exists():
    listed = [e["file"] for e in ENTRIES]
    assert len(listed) == len(set(listed)) and len({e["name"] for e in ENTRIES}) == len(ENTRIES)
    on_disk = {p.name for p in CORPUS.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz"))}
    assert on_disk == set(listed)


def test_the_corpus_holds_healthy_and_faulty_runs_and_every_run_is_in_sources_md():
    assert {e["verdict"] for e in ENTRIES} == {"healthy", "faulty"}
    sources = (CORPUS / "SOURCES.md").read_text()
    for e in ENTRIES:
        assert f"`{e['name']}`" in sources and e["source"]["commit"] in sources


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["name"] for e in ENTRIES])
def test_entry_is_what_corpus_yaml_says(entry):
    assert set(entry) == FIELDS | ({"max_delay_steps"} if entry["verdict"] == "faulty" else set())
    assert entry["verdict"] in ("healthy", "faulty")
    assert (entry["fault_step"] is None) == (entry["verdict"] == "healthy") == (entry["fault"] is None)
    if entry["verdict"] == "faulty":
        assert entry["expect_alerts"], "a faulty run names the alerts it should raise"
    alerts = {a.alert for a in load_spec().alerts()}
    assert set(entry["expect_alerts"] + entry["allow_alerts"]) <= alerts
    assert not set(entry["expect_alerts"]) & set(entry["allow_alerts"])
    assert set(entry["source"]) == {"repo", "path", "commit"} and len(entry["source"]["commit"]) == 40
    # Big files are stored compressed (the converter writes .gz with a fixed header).
    if not entry["file"].endswith(".gz"):
        assert (CORPUS / entry["file"]).stat().st_size <= 200_000


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["name"] for e in ENTRIES])
def test_steps_strictly_increase_and_match_the_entry(entry):
    recs = records(entry)
    steps = [r["step"] for r in recs]
    assert all(type(s) is int for s in steps)
    assert all(a < b for a, b in zip(steps, steps[1:], strict=False))
    assert len(steps) >= 20
    assert (len(steps), steps[0], steps[-1]) == (entry["steps"], entry["first_step"], entry["last_step"])
    if entry["fault_step"] is not None:
        assert steps[0] <= entry["fault_step"] <= steps[-1]
    times = [r["data"].get("timing_s/step", r["data"].get("timing/step")) for r in recs]
    times = [t for t in times if isinstance(t, (int, float))]
    median = round(statistics.median(times), 1) if times else None
    assert median == entry["median_step_seconds"]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["name"] for e in ENTRIES])
def test_follower_reads_every_line_and_keeps_every_latest_value(entry, tmp_path):
    spec = load_spec()
    sm = SelfMetrics(spec)
    store = TrainingStore(spec, sm, max_unmapped=10_000)  # the cap is a runtime guard; here every key must land
    path = tmp_path / "run.jsonl"
    path.write_bytes(raw_bytes(entry))
    VerlFileFollower(str(path), store, sm, recover_bytes=1 << 30, clock=lambda: 1000.0).poll()

    recs = records(entry)
    assert sm.value("verl_exporter_lines_parsed_total", source="file") == len(recs)
    assert sm.snapshot().get("verl_exporter_lines_rejected_total", {}) == {}
    assert sm.snapshot().get("verl_exporter_values_rejected_total", {}) == {}
    assert store.step == recs[-1]["step"]

    latest: dict[str, float | None] = {}
    for r in recs:
        latest.update(r["data"])
    mapper = KeyMapper(spec)
    # A key that shares its series with another key (a later alias) may be overwritten: compare only keys that
    # are the last writer of their series.
    owner: dict[tuple, str] = {}
    for r in recs:
        for key in r["data"]:
            resolved = mapper.resolve(key)
            owner[(resolved.metric.name, resolved.label_values) if resolved else (unmapped_name(key),)] = key
    missing = []
    for (name, *labels), key in owner.items():
        resolved = mapper.resolve(key)
        if resolved:
            got = store.value(name, **dict(zip(resolved.metric.labels, labels[0], strict=True)))
            want = latest[key] * resolved.scale if latest[key] is not None else None
        else:
            got, want = store.value(name), latest[key]
        want = float(want) if isinstance(want, bool) else want  # a JSON bool is exported as 1 / 0
        if not (got == pytest.approx(want) if want is not None else got is not None and math.isnan(got)):
            missing.append((key, want, got))
    assert missing == []
