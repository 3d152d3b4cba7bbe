"""The spec: the packaged one is valid, and each kind of bad spec fails naming the entry and the problem."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError
from verl_exporter.spec import SpecError, load_spec, parse_spec


def good_doc() -> dict:
    return {
        "version": 1,
        "target_labels": ["run", "rank"],
        "metrics": [
            {"name": "verl_x_seconds", "type": "gauge", "unit": "seconds", "help": "X.", "layer": "compute",
             "labels": ["phase"], "source": [{"match": "timing_s/{phase}"}]},
            {"name": "verl_y", "type": "gauge", "help": "Y.", "layer": "data", "field": "step"},
            {"name": "verl_nf_total", "type": "counter", "help": "NF.", "layer": "fault",
             "labels": ["metric"], "field": "nonfinite"},
            {"name": "verl_ts_timestamp_seconds", "type": "gauge", "unit": "seconds", "help": "T.",
             "layer": "data", "field": "step_time"},
        ],
    }


def test_packaged_spec_loads_and_every_name_is_unique():
    spec = load_spec()
    names = [m.name for m in spec.metrics]
    assert len(names) == len(set(names)) > 50
    assert spec["verl_training_step"].field == "step"


def test_good_doc_parses():
    spec = parse_spec(good_doc())
    m = spec["verl_x_seconds"]
    assert m.labels == ("phase",) and m.source[0].compiled.fullmatch("timing_s/gen")


def test_an_events_entry_has_the_labels_and_the_cap_of_the_metric_it_watches():
    doc = good_doc()
    doc["metrics"][0]["max_series"] = 7
    spec = parse_spec(_events()(doc))
    assert [m.name for m in spec.events()] == ["verl_e_total"]
    assert spec["verl_e_total"].max_series == 7 and str(spec["verl_e_total"].events) == "count of verl_x_seconds"


def test_the_spec_is_immutable_and_a_copy_is_indexed_by_its_own_metrics():
    """Spec caches its index by name: a model_copy with other metrics must not answer from the original's."""
    spec = parse_spec(good_doc())
    metric = spec["verl_x_seconds"]  # fills the cache
    with pytest.raises(ValidationError):
        metric.help = "Changed."
    changed = metric.model_copy(update={"help": "Changed."})
    copied = spec.model_copy(update={"metrics": tuple(changed if m is metric else m for m in spec.metrics)})
    assert copied["verl_x_seconds"].help == "Changed." and spec["verl_x_seconds"].help == "X."


def _mutate(path, value):
    def apply(doc):
        target = doc
        for step in path[:-1]:
            target = target[step]
        if value is DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return doc
    return apply


def _events(of="verl_x_seconds", labels=("phase",), record="count", name="verl_e_total", type="counter", **more):
    """A mutation adding an `events:` entry."""
    entry = {"name": name, "type": type, "help": "E.", "layer": "data", "labels": list(labels),
             "events": {"of": of, "record": record}, **more}
    return lambda d: {**d, "metrics": d["metrics"] + [entry]}


DELETE = object()
ONE_FEED = "exactly one of source, field, collector, instrumented_by"
M0 = ("metrics", 0)

BAD_CASES = [
    # (id, mutation, fragment the message must contain)
    ("not a mapping", lambda d: ["x"], "must be a mapping"),
    ("bad version", _mutate(("version",), 2), "version: must be 1, got 2"),
    ("unknown top key", _mutate(("extra",), 1), "extra: unknown key"),
    ("empty metrics", _mutate(("metrics",), []), "metrics: List should have at least 1 item"),
    ("missing help", _mutate((*M0, "help"), DELETE), "metrics.0.help: Field required"),
    ("empty help", _mutate((*M0, "help"), "  "), "metrics.0.help: must be a non-empty sentence"),
    ("bad type", _mutate((*M0, "type"), "summary"), "metrics.0.type: must be one of"),
    ("bad layer", _mutate((*M0, "layer"), "gpu"), "metrics.0.layer: must be one of"),
    ("unknown entry key", _mutate((*M0, "colour"), "red"), "metrics.0.colour: unknown key"),
    ("name without prefix", _mutate((*M0, "name"), "x_seconds"), "prefix verl_"),
    ("upper-case name", _mutate((*M0, "name"), "verl_X_seconds"), "must match"),
    ("unit not in name", _mutate((*M0, "unit"), "bytes"), "does not end in _bytes"),
    ("unknown unit", _mutate((*M0, "unit"), "gigabytes"), "metrics.0.unit: must be one of '', 'seconds'"),
    ("counter without _total", _mutate(("metrics", 2, "name"), "verl_nf"), "must end in _total"),
    ("gauge with _total", _mutate(("metrics", 1, "name"), "verl_y_total"), "only counters end in _total"),
    ("reserved unmapped prefix", _mutate(("metrics", 1, "name"), "verl_unmapped_y"), "reserved for unmapped"),
    ("bad label name", _mutate((*M0, "labels"), ["0phase"]), "metrics.0.labels.0: must be a label name"),
    ("reserved label", _mutate(("metrics", 2, "labels"), ["le"]), "reserved"),
    ("target label as label", _mutate(("metrics", 2, "labels"), ["rank"]), "reserved"),
    ("placeholder not declared", _mutate((*M0, "labels"), []), "gives labels ['phase'] but the metric declares []"),
    ("declared label not captured", _mutate((*M0, "labels"), ["phase", "stat"]), "declares ['phase', 'stat']"),
    ("two kinds of source", _mutate((*M0, "field"), "step"), ONE_FEED),
    ("no source at all", _mutate((*M0, "source"), DELETE), ONE_FEED),
    ("unknown instrumenting part", _mutate(("metrics", 1), {"name": "verl_y", "type": "gauge", "help": "Y.",
                                                             "layer": "exporter", "instrumented_by": "sidecar"}),
     "metrics.1.instrumented_by: must be one of 'exporter', 'detector' or 'relay'"),
    ("the sidecar's health named as a collector", _mutate(("metrics", 1), {
        "name": "verl_y", "type": "gauge", "help": "Y.", "layer": "exporter", "collector": "exporter"}),
     "metrics.1.collector: exporter is not a collector: write instrumented_by: exporter"),
    ("match and regex", _mutate((*M0, "source"), [{"match": "a/{phase}", "regex": "a/(?P<phase>.+)"}]),
     "exactly one of 'match' or 'regex'"),
    ("regex does not compile", _mutate((*M0, "source"), [{"regex": "a/(?P<phase>.+"}]), "does not compile"),
    # a placeholder given twice compiles to a regex with one group twice: reported, not a re.error traceback
    ("placeholder twice", _mutate((*M0, "source"), [{"match": "timing_s/{phase}/{phase}"}]),
     "metrics.0.source.0: match 'timing_s/{phase}/{phase}' does not compile: redefinition of group name"),
    ("regex without group", _mutate((*M0, "source"), [{"regex": "a/b", "labels": {"phase": "x"}}]),
     "has no named group"),
    ("unknown convert", _mutate((*M0, "source"), [{"match": "a/{phase}", "convert": "gb_to_bytes"}]),
     "convert: must be one of 'gib_to_bytes'"),
    ("zero scale", _mutate((*M0, "source"), [{"match": "a/{phase}", "scale": 0}]), "non-zero number"),
    ("convert and scale", _mutate((*M0, "source"), [{"match": "a/{phase}", "scale": 2, "convert": "ms_to_seconds"}]),
     "not both"),
    ("values for unknown placeholder", _mutate((*M0, "source"), [{"match": "a/{phase}", "values": {"x": ["a"]}}]),
     "does not capture"),
    ("unknown source key", _mutate((*M0, "source"), [{"match": "a/{phase}", "drop": True}]),
     "metrics.0.source.0.drop: unknown key"),
    ("unknown field", _mutate(("metrics", 1, "field"), "epoch"), "metrics.1.field: must be one of"),
    ("bad max_series", _mutate((*M0, "max_series"), 0),
     "metrics.0.max_series: Input should be greater than or equal to 1"),
    ("alerts not a list", _mutate((*M0, "alerts"), {"expr": "x"}), "metrics.0.alerts: Input should be a valid list"),
    ("duplicate name", lambda d: {**d, "metrics": d["metrics"] + [copy.deepcopy(d["metrics"][1])]},
     "declared twice"),
    ("one literal key feeds two metrics", lambda d: {**d, "metrics": d["metrics"] + [
        {"name": "verl_a", "type": "gauge", "help": "A.", "layer": "data", "source": [{"match": "k/a"}]},
        {"name": "verl_b", "type": "gauge", "help": "B.", "layer": "data", "source": [{"match": "k/a"}]}]},
     "already feeds 'verl_a'"),
    ("skip_when_zero names no metric", _mutate((*M0, "detect"), [
        {"signal": "x", "labels": {"phase": "gen"}, "skip_when_zero": "verl_nope"}]),
     "metrics.0.detect.0.skip_when_zero: 'verl_nope' is not a metric of the spec"),
    ("timestamp counter", lambda d: {**d, "metrics": d["metrics"] + [
        {"name": "verl_t_timestamp_seconds_total", "type": "counter", "unit": "seconds", "help": "T.",
         "layer": "data", "collector": "x"}]}, "must be a gauge"),
    ("events of an unknown metric", _events("verl_nope"), "metrics.4.events.of: 'verl_nope' is not a metric of the "
     "spec fed by verl keys"),
    ("events of a metric no key feeds", _events("verl_y"), "'verl_y' is not a metric of the spec fed by verl keys"),
    ("events with other labels", _events(labels=["stat"]), "metrics.4.events.of: its labels ['stat'] must be those "
     "of verl_x_seconds"),
    ("events with their own cap", _events(max_series=5), "its max_series 5 must be that of verl_x_seconds (64)"),
    ("a count of events as a gauge", _events(type="gauge", name="verl_e"), "metrics.4: events of "
     "record 'count' are a counter, not a gauge"),
    ("an unknown record", _events(record="rate"), "metrics.4.events.record: must be one of"),
    ("the same events twice", lambda d: _events(name="verl_f_total")(_events()(d)), "the count of verl_x_seconds's "
     "events is already 'verl_e_total'"),
]


@pytest.mark.parametrize("case_id,mutate,fragment", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_spec_is_rejected_with_a_message_naming_the_problem(case_id, mutate, fragment):
    doc = mutate(copy.deepcopy(good_doc()))
    with pytest.raises(SpecError) as err:
        parse_spec(doc, origin="test.yaml")
    assert fragment in str(err.value), str(err.value)
    assert str(err.value).startswith("test.yaml:")


def test_problems_of_several_entries_are_reported_together():
    doc = good_doc()
    doc["metrics"][0]["type"] = "histogram"
    doc["metrics"][1]["layer"] = "nowhere"
    with pytest.raises(SpecError) as err:
        parse_spec(doc)
    assert len(err.value.problems) == 2
    assert "metrics.0.type: must be one of" in err.value.problems[0]
    assert "metrics.1.layer: must be one of" in err.value.problems[1]


SPEC_FILE = """\
version: 1
metrics:
  - name: verl_a
    type: gauge
    help: A.
    layer: data
    field: step
    alerts:
      - alert: VerlA
        kind: threshold
        severity: warning
        threshold: 1
        summary: S.
        description: D.
        colour: red
  - name: verl_b
    type: histogram
    help: B.
    layer: data
    field: step_time
    panels:
      - {dashboard: training, title: B, query: "rate(<metric>[5m])"}
  - name: verl_c
    type: gauge
    help: C.
    layer: data
    collector: x
    detect:
      - {signal: c, window: 5, export: [steps]}
"""


def test_an_unknown_key_in_an_alert_is_reported_with_its_line_and_every_entrys_problems_at_once(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC_FILE)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.problems == [
        f"{path}:15: metrics.0.alerts.0.colour: unknown key",
        f"{path}:17: metrics.1.type: must be one of 'gauge' or 'counter', got 'histogram'",
        f"{path}:22: metrics.1.panels.0: the query must use <sel> so the dashboard's job/run/rank variables "
        "apply; rate() in a panel must use [$__rate_interval]",
        f"{path}:29: metrics.2.detect.0.window: Input should be greater than or equal to 10",
    ]


def test_problems_across_entries_come_together_with_their_lines(tmp_path):
    text = SPEC_FILE.replace("        colour: red\n", "        inhibits: [VerlNone]\n").replace(
        "type: histogram", "type: gauge").replace("<metric>[5m]", "<metric>{<sel>}[$__rate_interval]").replace(
        "window: 5", "window: 30").replace("field: step_time", "field: step")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.problems == [
        f"{path}:15: metrics.0.alerts.0.inhibits.0: inhibits unknown alert 'VerlNone'",
        f"{path}:20: metrics.1.field: field 'step' already feeds 'verl_a'",
        f"{path}:29: metrics.2.detect.0.export: exports steps but verl_detector_steps is not declared "
        "(instrumented_by: detector)",
    ]


def test_every_collector_the_spec_names_exists_and_every_collector_has_metrics():
    """collector: names a Collector (the sidecar's registered ones and the Monitor's torch); the parts that set
    metrics from their own code say instrumented_by: and every such part has entries."""
    from verl_exporter.sidecar.collectors import REGISTRY
    from verl_exporter.spec import INSTRUMENTED_BY
    from verl_exporter.trainer.torch_helpers import TorchCollector

    spec = load_spec()
    assert {m.collector for m in spec.metrics if m.collector} == {*REGISTRY, TorchCollector.name}
    assert {m.instrumented_by for m in spec.metrics if m.instrumented_by} == set(INSTRUMENTED_BY)


def test_spec_file_errors_are_clear(tmp_path):
    with pytest.raises(SpecError, match="cannot read it"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("metrics: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


@pytest.mark.integration
def test_spec_command_prints_a_table_and_json(tmp_path):
    table = subprocess.run([sys.executable, "-m", "verl_exporter", "spec"], capture_output=True, text=True,
                           check=True).stdout
    assert "verl_timing_seconds" in table and "timing_s/{phase}" in table
    out = subprocess.run([sys.executable, "-m", "verl_exporter", "spec", "--json"], capture_output=True,
                         text=True, check=True).stdout
    doc = json.loads(out)
    by_name = {m["name"]: m for m in doc["metrics"]}
    assert by_name["verl_perf_max_memory_allocated_bytes"]["source"][0]["scale"] == 1024**3
    assert by_name["verl_timing_per_token_seconds"]["source"][0]["scale"] == pytest.approx(1e-3)


@pytest.mark.integration
def test_spec_command_rejects_a_bad_spec_file(tmp_path):
    doc = good_doc()
    doc["metrics"][0]["unit"] = "bytes"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([sys.executable, "-m", "verl_exporter", "spec", "--spec", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert re.search(rf"{re.escape(str(path))}:\d+: metrics.0.unit: unit 'bytes' but the name does not end in _bytes",
                     proc.stderr), proc.stderr
