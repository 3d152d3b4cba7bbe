"""The in-process Monitor: its own endpoint, or lines handed to a sidecar in verl's format."""

from __future__ import annotations

import json
import math
import threading

import pytest
from conftest import http_get, parse_metrics, sample, wait_for
from helpers import scaled
from verl_exporter import Monitor

pytestmark = pytest.mark.integration  # starts servers or programs


@pytest.fixture
def monitor():
    m = Monitor(listen="127.0.0.1:0", run="unit", rank=3)
    yield m
    m.close()


def scrape(m):
    status, _, body = http_get(m.url + "/metrics")
    assert status == 200
    return parse_metrics(body.decode())


def test_logged_values_are_on_the_endpoint_at_the_next_scrape(monitor):
    monitor.log({"actor/grad_norm": 0.25, "timing_s/gen": 4.0, "critic/score/mean": None}, step=12)
    m = scrape(monitor)  # no sleep: the scrape drains the queue first
    assert sample(m, "verl_actor_grad_norm", run="unit", rank="3") == 0.25
    assert sample(m, "verl_timing_seconds", phase="gen") == 4.0
    assert math.isnan(sample(m, "verl_critic_score", stat="mean"))
    assert sample(m, "verl_training_step") == 12
    assert sample(m, "verl_exporter_lines_parsed_total", source="monitor") == 1


def test_validation_keys_logged_in_process_are_evaluations_as_in_the_follower(monitor):
    """Issue 37: the in-process path counts evaluations through the same store as the file follower."""
    for step in (10, 20):
        monitor.log({"val-core/openai/gsm8k/reward/mean@4": 0.0, "actor/lr": 1.0}, step=step)
        monitor.log({"actor/lr": 1.0}, step=step + 1)
    m = scrape(monitor)
    labels = {"kind": "core", "data_source": "openai/gsm8k", "variable": "reward", "stat": "mean@4"}
    assert sample(m, "verl_validation_evaluations_total", **labels) == 2
    assert sample(m, "verl_validation_last_evaluation_step", **labels) == 20


def test_the_caller_may_mutate_its_dict_after_log(monitor):
    data = {"actor/lr": 1.0}
    monitor.log(data, step=1)
    data["actor/lr"] = 99.0
    assert sample(scrape(monitor), "verl_actor_learning_rate") == 1.0


def test_log_never_raises_on_bad_input(monitor):
    monitor.log(None, step=1)  # not a mapping
    monitor.log({"x": object(), "y": "text", "z": [1]}, step="nope")
    monitor.log({"actor/lr": 2.0}, step=2)
    m = scrape(monitor)
    assert sample(m, "verl_actor_learning_rate") == 2.0
    assert sample(m, "verl_exporter_values_rejected_total", reason="string") == 1
    assert sample(m, "verl_exporter_values_rejected_total", reason="bad_step") == 1


def test_a_full_queue_drops_the_oldest_and_counts_it():
    m = Monitor(listen="127.0.0.1:0", queue_size=4)
    try:
        with m._drain_lock:  # hold the worker off, as a slow scraper would
            for step in range(10):
                m.log({"actor/lr": float(step)}, step=step)
        metrics = scrape(m)
        assert sample(metrics, "verl_exporter_monitor_dropped_total") == 6
        assert sample(metrics, "verl_actor_learning_rate") == 9.0
    finally:
        m.close()


def test_log_does_not_wait_for_a_scrape_in_progress(monitor):
    # The store's lock is what a scrape holds; log() must complete while it is held.
    done = threading.Event()
    with monitor.sidecar.store._lock:
        t = threading.Thread(target=lambda: (monitor.log({"actor/lr": 1.0}, step=1), done.set()))
        t.start()
        assert done.wait(scaled(2)), "log() blocked on the scraper's lock"
    t.join()


def test_callback_shape(monitor):
    monitor.on_train_begin()
    monitor.on_batch_begin(5)
    monitor.on_batch_end(5, {"actor/pg_loss": -0.1})
    m = scrape(monitor)
    assert sample(m, "verl_actor_pg_loss") == -0.1 and sample(m, "verl_training_step") == 5


def test_sidecar_file_mode_writes_verl_format_with_null_for_nan(tmp_path):
    path = tmp_path / "handoff.jsonl"
    m = Monitor(sidecar_file=str(path))
    m.log({"actor/grad_norm": float("nan"), "actor/lr": 1e-6, "nested": {"a": float("inf")}}, step=1)
    m.log({"actor/grad_norm": 0.5}, step=2)
    m.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0] == {"step": 1, "data": {"actor/grad_norm": None, "actor/lr": 1e-6, "nested": {"a": None}}}
    assert rows[1]["step"] == 2


def test_sidecar_file_mode_feeds_a_real_sidecar(tmp_path, serve):
    path = tmp_path / "handoff.jsonl"
    side = serve("--verl-log", str(path), "--run", "handoff")
    m = Monitor(sidecar_file=str(path))
    try:
        m.log({"actor/grad_norm": 0.9}, step=41)
        wait_for(lambda: sample(side.metrics(), "verl_training_step") == 41, timeout=5)
        assert sample(side.metrics(), "verl_actor_grad_norm", run="handoff") == 0.9
    finally:
        m.close()


def test_exactly_one_target_is_required():
    with pytest.raises(ValueError):
        Monitor()
    with pytest.raises(ValueError):
        Monitor(listen="127.0.0.1:0", sidecar_file="x")
