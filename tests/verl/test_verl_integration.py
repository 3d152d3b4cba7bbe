"""The real verl package writes its file log; a real sidecar follows it; we read /metrics over HTTP."""

from __future__ import annotations

import math

import pytest
from conftest import IN_CI, sample, wait_for

pytestmark = pytest.mark.integration  # starts servers or programs


def tracking_class():
    try:
        from verl.utils.tracking import Tracking
    except ImportError as e:  # verl is in the test extra; CI installs it
        if IN_CI:
            pytest.fail(f"verl is not installed: {e}")
        pytest.skip(f"verl is not installed: {e}")
    return Tracking


def test_real_verl_file_logger_to_metrics(tmp_path, serve, monkeypatch):
    Tracking = tracking_class()
    log = tmp_path / "verl.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(log))
    side = serve("--verl-log", str(log), "--run", "verl-it", "--rank", "0")

    tracker = Tracking(project_name="it", experiment_name="exp", default_backend=["file"])
    tracker.log({"actor/grad_norm": 0.42, "timing_s/gen": 18.2, "critic/score/mean": 0.6,
                 "perf/max_memory_allocated_gb": 1.5, "response_length/clip_ratio": 0.05,
                 "val-core/openai/gsm8k/reward/mean@4": 0.7}, step=1)
    tracker.log({"actor/grad_norm": float("nan"), "actor/pg_loss": float("inf"), "timing_s/gen": 17.0}, step=2)

    wait_for(lambda: sample(side.metrics(), "verl_training_step") == 2, timeout=5)
    assert b'"actor/grad_norm":null' in log.read_bytes()  # what verl really writes for NaN
    m = side.metrics()
    assert math.isnan(sample(m, "verl_actor_grad_norm", run="verl-it", rank="0"))
    assert math.isnan(sample(m, "verl_actor_pg_loss"))  # verl writes Inf as null too
    assert sample(m, "verl_training_nonfinite_values_total", metric="verl_actor_grad_norm") == 1
    assert sample(m, "verl_timing_seconds", phase="gen") == 17.0
    assert sample(m, "verl_critic_score", stat="mean") == 0.6
    assert sample(m, "verl_perf_max_memory_allocated_bytes") == 1.5 * 1024**3
    assert sample(m, "verl_validation_score", kind="core", data_source="openai/gsm8k", stat="mean@4") == 0.7

    # A restarted run: verl opens the same path with "wb" and truncates it.
    tracker.finish()
    restarted = Tracking(project_name="it", experiment_name="exp", default_backend=["file"])
    restarted.log({"actor/grad_norm": 0.3}, step=1)
    wait_for(lambda: sample(side.metrics(), "verl_training_step") == 1, timeout=5)
    m = side.metrics()
    assert sample(m, "verl_actor_grad_norm") == 0.3
    assert sample(m, "verl_exporter_source_resets_total", reason="truncated") == 1
    assert sample(m, "verl_exporter_lines_rejected_total") is None
    restarted.finish()
