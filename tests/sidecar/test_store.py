"""The training store: values, NaN, non-numeric values, caps on cardinality, exposition."""

from __future__ import annotations

import math

import pytest
from conftest import parse_metrics, sample
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.store import TrainingStore, as_number
from verl_exporter.spec import load_spec


@pytest.fixture
def parts():
    spec = load_spec()
    sm = SelfMetrics(spec, {"run": "r", "rank": "0"})
    store = TrainingStore(spec, sm, {"run": "r", "rank": "0"}, max_unmapped=3)
    registry = CollectorRegistry()
    registry.register(Rendered(store))
    registry.register(sm)
    return store, sm, registry


class Rendered:
    """What a scrape shows of the store: its own text exposition (store.render()), read back by client_python."""

    def __init__(self, store: TrainingStore):
        self.store = store

    def collect(self):
        return text_string_to_metric_families(self.store.render())


def scrape(registry):
    return parse_metrics(generate_latest(registry).decode())


@pytest.mark.parametrize("raw,expected", [
    (1, 1.0), (2.5, 2.5), (True, 1.0), (False, 0.0), ("0.5", "string"), ([1, 2], "list"), ({"a": 1}, "too_deep"),
    (object(), "other"),
])
def test_as_number(raw, expected):
    assert as_number(raw) == expected


def test_null_is_nan_and_counted(parts):
    store, sm, registry = parts
    store.ingest(1, {"actor/grad_norm": 0.5}, 100.0)
    store.ingest(2, {"actor/grad_norm": None, "critic/score/mean": float("inf")}, 101.0)
    m = scrape(registry)
    assert math.isnan(sample(m, "verl_actor_grad_norm"))
    assert sample(m, "verl_critic_score", stat="mean") == math.inf
    assert sample(m, "verl_training_nonfinite_values_total", metric="verl_actor_grad_norm") == 1
    assert sample(m, "verl_training_nonfinite_values_total", metric="verl_critic_score") == 1
    assert sample(m, "verl_training_step") == 2
    assert sample(m, "verl_training_last_step_timestamp_seconds") == 101.0
    # A later finite value replaces the NaN; the counter keeps the history.
    store.ingest(3, {"actor/grad_norm": 0.4}, 102.0)
    m = scrape(registry)
    assert sample(m, "verl_actor_grad_norm") == 0.4
    assert sample(m, "verl_training_nonfinite_values_total", metric="verl_actor_grad_norm") == 1


def test_units_are_converted_and_constant_labels_added(parts):
    store, _, registry = parts
    store.ingest(1, {"perf/max_memory_allocated_gb": 2, "timing_per_token_ms/gen": 5}, 1.0)
    m = scrape(registry)
    assert sample(m, "verl_perf_max_memory_allocated_bytes", run="r", rank="0") == 2 * 1024**3
    assert sample(m, "verl_timing_per_token_seconds", phase="gen") == pytest.approx(0.005)


def test_non_numeric_values_are_counted_not_exported(parts):
    store, sm, registry = parts
    store.ingest(1, {"note": "hello", "hist": [1, 2], "actor/lr": 1e-6}, 1.0)
    assert sm.value("verl_exporter_values_rejected_total", reason="string") == 1
    assert sm.value("verl_exporter_values_rejected_total", reason="list") == 1
    assert sample(scrape(registry), "verl_actor_learning_rate") == 1e-6


def test_nested_dicts_are_flattened(parts):
    store, _, registry = parts
    store.ingest(1, {"timing_s": {"gen": 3.0}, "actor": {"grad_norm": 0.2}}, 1.0)
    m = scrape(registry)
    assert sample(m, "verl_timing_seconds", phase="gen") == 3.0
    assert sample(m, "verl_actor_grad_norm") == 0.2


def test_unmapped_keys_are_exported_up_to_the_cap(parts):
    store, sm, registry = parts
    store.ingest(1, {f"custom/k{i}": i for i in range(5)}, 1.0)
    m = scrape(registry)
    names = {n for (n, _) in m if n.startswith("verl_unmapped_")}
    assert names == {"verl_unmapped_custom_k0", "verl_unmapped_custom_k1", "verl_unmapped_custom_k2"}
    assert sm.value("verl_exporter_series_dropped_total", reason="unmapped_cap") == 2
    assert sm.value("verl_exporter_unmapped_series") == 3
    assert sm.value("verl_exporter_unmapped_values_total") == 5
    # Known unmapped names keep updating once the cap is reached.
    store.ingest(2, {"custom/k0": 42}, 2.0)
    assert store.value("verl_unmapped_custom_k0") == 42


def test_name_clash_between_unmapped_keys_keeps_the_first(parts):
    store, sm, _ = parts
    store.ingest(1, {"a/b": 1, "a.b": 2}, 1.0)
    assert store.value("verl_unmapped_a_b") == 1
    assert sm.value("verl_exporter_series_dropped_total", reason="name_clash") == 1


def test_free_form_labels_are_capped_by_max_series(parts):
    store, sm, registry = parts
    cap = load_spec()["verl_validation_score"].max_series
    store.ingest(1, {f"val-core/ds{i}/reward/mean@4": 0.5 for i in range(cap + 7)}, 1.0)
    m = scrape(registry)
    got = [k for k in m if k[0] == "verl_validation_score"]
    assert len(got) == cap
    assert sm.value("verl_exporter_series_dropped_total", reason="series_cap") == 7


def test_bad_step_is_counted_and_the_data_kept(parts):
    store, sm, registry = parts
    store.ingest("seven", {"actor/lr": 1.0}, 1.0)
    assert store.step is None
    assert sm.value("verl_exporter_values_rejected_total", reason="bad_step") == 1
    assert sample(scrape(registry), "verl_actor_learning_rate") == 1.0


def test_exposition_passes_the_client_parser_with_every_metric_kind(parts):
    store, _, registry = parts
    store.ingest(1, {"actor/grad_norm": None, "custom/x": 1, "timing_s/gen": 2}, 1.0)
    text = generate_latest(registry).decode()
    assert "# TYPE verl_training_nonfinite_values_total counter" in text
    assert "# HELP verl_unmapped_custom_x Unmapped verl key 'custom/x'" in text


def test_non_string_keys_are_exported_under_their_text(parts):
    store, _, _ = parts
    store.ingest(1, {7: 1.5, ("a", "b"): 2.0}, 1.0)
    assert store.value("verl_unmapped_7") == 1.5
    assert store.value("verl_unmapped_a_b") == 2.0


@pytest.mark.parametrize("step", [-5, 2.5, 1e308, float("nan"), 10**400, True, "3"],
                         ids=["negative", "fraction", "1e308", "nan", "400_digits", "bool", "string"])
def test_a_step_that_is_not_a_non_negative_integer_is_rejected(parts, step):
    store, sm, _ = parts
    store.ingest(4, {"actor/lr": 1.0}, 100.0)
    store.ingest(step, {"actor/lr": 2.0}, 200.0)
    assert store.step == 4 and store.step_time == 100.0
    assert sm.value("verl_exporter_values_rejected_total", reason="bad_step") == 1
    assert store.value("verl_actor_learning_rate") == 2.0


def test_huge_unknown_keys_and_label_values_are_rejected_and_counted(parts):
    store, sm, registry = parts
    for i in range(20):
        store.ingest(i, {f"k{i}" + "x" * 1_000_000: 1.0, "val-core/" + "d" * 5000 + "/reward/mean@1": 0.5,
                         "actor/lr": 0.1}, float(i))
    text = generate_latest(registry).decode()
    assert len(text) < 20_000
    assert sm.value("verl_exporter_values_rejected_total", reason="key_too_long") == 40
    assert store.value("verl_actor_learning_rate") == 0.1
    store.ingest(21, {"val-core/" + "d" * 200 + "/reward/mean@1": 0.5}, 21.0)
    assert sm.value("verl_exporter_values_rejected_total", reason="label_too_long") == 1


def test_the_longest_accepted_names_keep_a_scrape_bounded(parts):
    # Every cap at its limit: max_unmapped series of the longest key, and a free-form label family full.
    store, _, registry = parts
    from verl_exporter.sidecar.mapper import MAX_KEY_LENGTH, MAX_LABEL_LENGTH

    for i in range(1000):
        name = f"{i:04d}" + "u" * (MAX_KEY_LENGTH - 4)
        label = f"{i:04d}" + "d" * (MAX_LABEL_LENGTH - 4)
        store.ingest(i, {name: 1.0, f"val-core/{label}/reward/mean@1": 0.5}, float(i))
    text = generate_latest(registry).decode()
    # ~45 KB for the validation family at its cap, and as much for each of its three evaluation-event families
    assert len(text) < 250_000


# ---------------------------------------------------------------------------------------------- evaluation events
VAL = "val-core/openai/gsm8k/reward/mean@4"
GSM8K = {"kind": "core", "data_source": "openai/gsm8k", "variable": "reward", "stat": "mean@4"}


def evaluations(registry, **labels):
    m = scrape(registry)
    return (sample(m, "verl_validation_evaluations_total", **labels),
            sample(m, "verl_validation_last_evaluation_step", **labels),
            sample(m, "verl_validation_last_evaluation_timestamp_seconds", **labels))


def test_each_step_a_validation_key_arrives_at_is_an_evaluation_even_with_the_value_unchanged(parts):
    """Issue 37: a score that falls and repeats exactly the same value is a gauge that does not move; the
    counter shows both evaluations."""
    store, _, registry = parts
    store.ingest(5, {"actor/lr": 1.0}, 50.0)
    assert sample(scrape(registry), "verl_validation_evaluations_total", **GSM8K) is None  # none yet
    store.ingest(10, {VAL: 0.0, "actor/lr": 1.0}, 100.0)
    store.ingest(11, {"actor/lr": 1.0}, 110.0)
    store.ingest(20, {VAL: 0.0}, 200.0)
    assert evaluations(registry, **GSM8K) == (2, 20, 200.0)
    store.ingest(21, {VAL: None}, 210.0)  # a NaN score is still an evaluation (NaN is the nonfinite alerts')
    assert evaluations(registry, **GSM8K)[0] == 3


def test_a_repeated_line_counts_once_and_a_resumed_run_counts_its_evaluations_again(parts):
    store, _, registry = parts
    store.ingest(10, {VAL: 0.5}, 100.0)
    store.ingest(10, {VAL: 0.5}, 101.0)  # the same step again (a duplicate line)
    store.ingest(20, {VAL: 0.5}, 200.0)
    assert evaluations(registry, **GSM8K) == (2, 20, 200.0)
    store.ingest(15, {"actor/lr": 1.0}, 300.0)  # resumed from the checkpoint at step 14
    assert evaluations(registry, **GSM8K) == (2, 20, 200.0)  # the last evaluation stays what it was
    store.ingest(20, {VAL: 0.4}, 400.0)  # step 20 evaluated again, by the resumed run
    assert evaluations(registry, **GSM8K) == (3, 20, 400.0)


def test_evaluation_events_have_the_series_of_the_scores_and_their_cap(parts):
    store, sm, registry = parts
    cap = load_spec()["verl_validation_score"].max_series
    store.ingest(1, {f"val-core/ds{i}/reward/mean@4": 0.5 for i in range(cap + 7)}, 1.0)
    store.ingest(2, {"val-aux/ds0/reward/std@4": 0.1, "val/test_score/old": 0.2}, 2.0)  # over the cap: dropped
    m = scrape(registry)
    scores = {k[1] for k in m if k[0] == "verl_validation_score"}
    for name in ("verl_validation_evaluations_total", "verl_validation_last_evaluation_step",
                 "verl_validation_last_evaluation_timestamp_seconds"):
        assert {k[1] for k in m if k[0] == name} == scores
    assert sm.value("verl_exporter_series_dropped_total", reason="series_cap") == 9
