"""Older verl key schemes (and the forks pinned to them) produce the same verl_* series as today's keys.

Each scheme is a verl log written with the keys of that time, read by the real file follower into the real
store; its series (names, labels, values) must equal those of the same run logged with verl 0.9.1's keys.
"""

from __future__ import annotations

import json

import pytest
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.sources.verl_file import VerlFileFollower
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import SpecError, load_spec, parse_spec

# One step of a run as verl 0.9.1 logs it, and the same step in each older key scheme: {old key: today's key}.
# Values are given in today's units; SCALE says how an older key's unit differs.
TODAY = {
    "actor/entropy": 0.81, "actor/entropy_loss": 0.81,
    "actor/reward_kl_penalty": 0.012, "actor/reward_kl_penalty_coeff": 0.001,
    "perf/mfu/actor": 0.31, "perf/mfu/critic": 0.22,
    "timing_s/gen": 18.5, "timing_s/update_actor": 9.25, "timing_s/step": 31.0,
    "timing_per_token_ms/gen": 0.125, "timing_per_token_ms/update_actor": 0.0625,
    "val-core/openai/gsm8k/reward/mean@1": 0.62,
    "critic/score/mean": 0.5, "response_length/mean": 212.0,
}
COMMON = {"critic/score/mean": "critic/score/mean", "response_length/mean": "response_length/mean"}
SCHEMES = {
    # verl until 17 Jan 2025: timing/ in seconds, timing_per_token/ in seconds per token, test_score/
    "verl-2024": {
        "actor/entropy_loss": "actor/entropy", "critic/kl": "actor/reward_kl_penalty",
        "critic/kl_coeff": "actor/reward_kl_penalty_coeff",
        "timing/gen": "timing_s/gen", "timing/update_actor": "timing_s/update_actor", "timing/step": "timing_s/step",
        "timing_per_token/gen": "timing_per_token_ms/gen",
        "timing_per_token/update_actor": "timing_per_token_ms/update_actor",
        "test_score/openai/gsm8k": "val-core/openai/gsm8k/reward/mean@1",
    },
    # verl 17-21 Jan 2025
    "verl-jan-2025": {
        "actor/entropy_loss": "actor/entropy", "critic/kl": "actor/reward_kl_penalty",
        "critic/kl_coeff": "actor/reward_kl_penalty_coeff", "mfu/actor": "perf/mfu/actor",
        "mfu/critic": "perf/mfu/critic",
        "timing(s)/gen": "timing_s/gen", "timing(s)/update_actor": "timing_s/update_actor",
        "timing(s)/step": "timing_s/step",
        "timing_per_token(ms)/gen": "timing_per_token_ms/gen",
        "timing_per_token(ms)/update_actor": "timing_per_token_ms/update_actor",
        "val/test_score/openai/gsm8k": "val-core/openai/gsm8k/reward/mean@1",
    },
    # verl of late Jan-Mar 2025, vendored by TinyZero, Logic-RL, Search-R1 and SimpleRL-Zoo
    "verl-early-2025": {
        "actor/entropy_loss": "actor/entropy", "critic/kl": "actor/reward_kl_penalty",
        "critic/kl_coeff": "actor/reward_kl_penalty_coeff", "mfu/actor": "perf/mfu/actor",
        "mfu/critic": "perf/mfu/critic",
        "timing_s/gen": "timing_s/gen", "timing_s/update_actor": "timing_s/update_actor",
        "timing_s/step": "timing_s/step",
        "timing_per_token_ms/gen": "timing_per_token_ms/gen",
        "timing_per_token_ms/update_actor": "timing_per_token_ms/update_actor",
        "val/test_score/openai/gsm8k": "val-core/openai/gsm8k/reward/mean@1",
    },
}
# the older key's value = today's value * SCALE (timing_per_token/ was seconds per token, today milliseconds)
SCALE = {"timing_per_token/": 1e-3}


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def _series(tmp_path, name: str, steps: list[dict]) -> dict:
    """Write a verl log, follow it with the real follower and return every series the store exports."""
    spec = load_spec()
    sm = SelfMetrics(spec)
    store = TrainingStore(spec, sm)
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(b"".join(json.dumps({"step": i + 1, "data": d}).encode() + b"\n" for i, d in enumerate(steps)))
    VerlFileFollower(str(path), store, sm, clock=Clock()).poll()
    assert store.step == len(steps)
    seen = spec.with_field("step_time").name  # when the line was read (file mtime here), not from its keys
    return {(metric.name, labels): value for metric, rows in store.series() for labels, value in rows.items()
            if metric.name != seen}


def _old_line(scheme: dict[str, str], today: dict[str, float]) -> dict[str, float]:
    out = {}
    for old, new in {**scheme, **COMMON}.items():
        scale = next((s for prefix, s in SCALE.items() if old.startswith(prefix)), 1.0)
        out[old] = today[new] * scale
    return out


def _today_line(scheme: dict[str, str], i: int) -> dict[str, float]:
    """Today's keys for what the scheme logs (0.9.1 logs actor/entropy_loss next to actor/entropy)."""
    keys = set(scheme.values()) | set(COMMON.values())
    if "actor/entropy" in keys:
        keys.add("actor/entropy_loss")
    return {k: TODAY[k] * (1 + i / 10) for k in keys}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_older_key_scheme_gives_the_same_series_as_today(tmp_path, scheme):
    steps = [_today_line(SCHEMES[scheme], i) for i in range(3)]
    today = _series(tmp_path, "today", steps)
    older = _series(tmp_path, scheme, [_old_line(SCHEMES[scheme], s) for s in steps])
    assert set(older) == set(today)
    for key, value in today.items():
        assert older[key] == pytest.approx(value, rel=1e-12), key
    assert not any(name.startswith("verl_unmapped_") for name, _ in older)


def test_old_keys_feed_the_metrics_todays_rules_read(tmp_path):
    series = _series(tmp_path, "old", [_old_line(SCHEMES["verl-2024"], TODAY)])
    assert series[("verl_actor_entropy", ())] == 0.81  # VerlEntropyCollapse
    assert series[("verl_timing_seconds", ("gen",))] == 18.5  # VerlRolloutSlow
    assert series[("verl_timing_per_token_seconds", ("gen",))] == pytest.approx(0.125e-3)
    assert series[("verl_validation_score", ("core", "openai/gsm8k", "reward", "mean@1"))] == 0.62


def test_entropy_loss_stands_in_for_entropy_only_when_entropy_is_absent(tmp_path):
    series = _series(tmp_path, "both", [{"actor/entropy": 0.5, "actor/entropy_loss": 0.9}])
    assert series[("verl_actor_entropy", ())] == 0.5
    assert series[("verl_actor_entropy_loss", ())] == 0.9
    series = _series(tmp_path, "old", [{"actor/entropy_loss": 0.9}])
    assert series[("verl_actor_entropy", ())] == 0.9
    assert series[("verl_actor_entropy_loss", ())] == 0.9


def test_a_bad_stand_in_value_is_rejected_once_and_a_null_counts_for_both_metrics():
    spec = load_spec()
    sm = SelfMetrics(spec)
    store = TrainingStore(spec, sm)
    store.ingest(1, {"actor/entropy_loss": "oops"}, seen_at=1.0)
    assert sm.value("verl_exporter_values_rejected_total", reason="string") == 1
    assert store.value("verl_actor_entropy") is None
    store.ingest(2, {"actor/entropy_loss": None}, seen_at=2.0)
    assert store.nonfinite_counts() == {"verl_actor_entropy_loss": 1.0, "verl_actor_entropy": 1.0}


def test_when_absent_needs_a_literal_key():
    doc = {"version": 1, "metrics": [
        {"name": "verl_a", "type": "gauge", "help": "a.", "layer": "data", "labels": ["x"],
         "source": [{"match": "a/{x}", "when_absent": "b"}]},
        {"name": "verl_b", "type": "gauge", "help": "b.", "layer": "data",
         "source": [{"match": "b", "when_absent": 3}]},
    ]}
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    text = str(e.value)
    assert "'when_absent' needs a literal 'match' key" in text
    assert "metrics.1.source.0.when_absent: Input should be a valid string" in text
