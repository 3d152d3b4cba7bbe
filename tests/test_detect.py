"""The step-domain detector (verl_exporter.core.detect): baselines in steps, trend-robust, recovered after a restart,
shared by the sidecar's store and the circuit breaker."""

from __future__ import annotations

import random

import pytest
from verl_exporter.core.detect import Detectors, SignalDetector, SignalSpec
from verl_exporter.core.selfmetrics import SelfMetrics
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import SpecError, load_spec, parse_spec
from verl_exporter.trainer.breaker import CircuitBreaker

SPEC = load_spec()


def rising(n: int, seed: int = 1, noise: float = 0.03) -> list[float]:
    """A healthy learning curve: rising 0.005 per step with batch noise."""
    rng = random.Random(seed)
    return [0.1 + 0.005 * i + rng.gauss(0, noise) for i in range(n)]


def feed(det: SignalDetector, values, start: int = 1) -> list[dict]:
    return [dict(det.observe(start + i, v)) for i, v in enumerate(values)]


def test_nothing_is_judged_before_min_steps_distinct_steps():
    det = SignalDetector(SignalSpec("x", "m", min_steps=10))
    for step in range(1, 11):
        stats = det.observe(step, 1.0)
        det.observe(step, 99.0)  # a repeated step (duplicate line) is not a new step
        assert "zscore" not in stats
    assert det.observe(11, 1.0)["zscore"] == pytest.approx(0.0)
    assert list(det.values).count(99.0) == 0


def test_a_rising_learning_curve_is_a_trend_not_a_deviation():
    det = SignalDetector(SignalSpec("score", "m", floor=0.01, rel_floor=0))
    stats = feed(det, rising(300))
    assert max(s.get("sustained_drop_zscore", 0) for s in stats) < 4
    assert max(s.get("sustained_rise_zscore", 0) for s in stats) < 4


def test_a_fall_while_the_curve_still_rises_is_caught_within_hold_steps():
    """Issue 11: mean score 0.6 -> 0.02 within a few steps, an hour into a healthy run still rising."""
    det = SignalDetector(SignalSpec("score", "m", floor=0.01, rel_floor=0, hold=3))
    feed(det, rising(100))
    after = feed(det, [0.02, 0.03, 0.02, 0.01], start=101)
    assert "sustained_drop_zscore" in after[2] and after[2]["sustained_drop_zscore"] > 5
    assert after[0]["zscore"] < -5


def test_one_bad_batch_is_not_sustained():
    """Issue 11: a one-step dip (-0.47 against -0.30...-0.38) must not count as a collapse."""
    rng = random.Random(3)
    det = SignalDetector(SignalSpec("score", "m", floor=0.01, rel_floor=0, hold=3))
    values = [-0.34 + rng.uniform(-0.04, 0.04) for _ in range(40)]
    values[30] = -0.47
    stats = feed(det, values)
    assert stats[30]["zscore"] < -2
    assert max(s.get("sustained_drop_zscore", 0) for s in stats) < 4


def test_level_peak_and_floor_follow_the_running_median():
    det = SignalDetector(SignalSpec("e", "m", level_steps=5))
    stats = feed(det, [1.0] * 12 + [3.0] * 6 + [0.5] * 6)
    assert stats[17]["level"] == 3.0 and stats[-1]["peak_level"] == 3.0
    assert stats[-1]["floor_level"] == 0.5 and stats[-1]["level"] == 0.5


def test_slope_per_second_uses_the_runs_step_time():
    det = Detectors(SPEC.signals(), SPEC)
    gib = 1024**3
    for step in range(1, 40):
        det.observe(step, {"perf/max_memory_reserved_gb": 40 + 0.15 * step, "timing_s/step": 60.0})
    slope = det.by_name["memory_reserved"].stats["slope_per_second"]
    assert slope * 3600 == pytest.approx(9 * gib, rel=0.01)  # 0.15 GiB a 1-minute step = 9 GiB/h


def test_store_exports_detector_gauges_and_recovers_them_from_the_tail():
    lines = [(step, {"critic/score/mean": v, "timing_s/step": 30.0}) for step, v in enumerate(rising(60), 1)]

    def store():
        return TrainingStore(SPEC, SelfMetrics(SPEC), {"run": "r", "rank": "0"})

    live = store()
    for i, (step, data) in enumerate(lines):
        live.ingest(step, data, 1000.0 + 30 * i)
    rows = {m.name: r for m, r in live.series()}
    assert rows["verl_detector_steps"][("score",)] == 30
    assert "verl_detector_sustained_drop_zscore" in rows
    # A restarted sidecar reads the file's tail (all at the file's mtime) and rebuilds the same window.
    restarted = store()
    for step, data in lines[-35:]:
        restarted.ingest(step, data, 5000.0)
    again = {m.name: r for m, r in restarted.series()}
    for name in ("verl_detector_zscore", "verl_detector_sustained_drop_zscore", "verl_detector_spread"):
        assert again[name][("score",)] == pytest.approx(rows[name][("score",)])


def test_no_detector_gauge_before_ten_steps_in_the_store():
    s = TrainingStore(SPEC, SelfMetrics(SPEC))
    for step in range(1, 10):
        s.ingest(step, {"critic/score/mean": 0.5, "timing_s/step": 10.0}, float(step))
    names = {m.name for m, rows in s.series() if rows}
    assert "verl_detector_zscore" not in names and "verl_detector_steps" in names


def test_min_steps_below_ten_is_refused():
    doc = {"version": 1, "metrics": [{"name": "verl_x", "type": "gauge", "help": "x.", "layer": "data",
                                      "source": [{"match": "x"}], "detect": [{"signal": "x", "min_steps": 5}]}]}
    with pytest.raises(SpecError, match="detect.0.min_steps: Input should be greater than or equal to 10"):
        parse_spec(doc)


def test_breaker_uses_the_same_detectors_and_needs_two_signals_for_a_collapse():
    def run(collapse_length: bool) -> list:
        b = CircuitBreaker.from_spec(SPEC, consecutive=1)
        rng = random.Random(5)
        hits = []
        for step in range(1, 80):
            score = 0.2 + 0.004 * step + rng.gauss(0, 0.02)
            length = 500 + rng.gauss(0, 10)
            if step >= 60:
                score = 0.01
                length = 5 if collapse_length else length
            anomalies, _ = b.observe(step, {"critic/score/mean": score, "response_length/mean": length})
            hits += [(step, a.rule) for a in anomalies if a.kind == "detector"]
        return hits

    assert run(collapse_length=False) == []
    hits = run(collapse_length=True)
    assert hits and hits[0] == (62, "VerlRewardCollapse")


def test_a_rank_that_logs_no_signal_exports_no_detector_series():
    # Every rank but the driver has no training data: 15 signals x 4,096 ranks must not cost 61 k series.
    s = TrainingStore(SPEC, SelfMetrics(SPEC))
    assert not [m.name for m, rows in s.series() if m.name.startswith("verl_detector_") and rows]
    s.ingest(1, {"critic/score/mean": 0.5}, 1.0)
    exported = {m.name: rows for m, rows in s.series() if m.name.startswith("verl_detector_") and rows}
    assert exported == {"verl_detector_steps": {("score",): 1.0}}
