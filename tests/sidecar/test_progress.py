"""Progress supervision across restarts (sidecar/progress.py): the high-water mark, restarts, ETA."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.control import CONTROL_REQUESTS
from verl_exporter.sidecar.progress import MAX_STATE_BYTES, STATE_NAME, Progress, ProgressState
from verl_exporter.sidecar.sources.verl_file import SOURCE_RESETS, VerlFileFollower
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import load_spec

SPEC = load_spec()


def _parts():
    metrics = SelfMetrics(SPEC)
    return TrainingStore(SPEC, metrics), metrics


def _step(store, step, at):
    store.ingest(step, {"actor/grad_norm": 0.5}, at)


def test_step_going_back_is_a_restart_and_the_mark_survives_a_new_sidecar(tmp_path):
    store, metrics = _parts()
    p = Progress(str(tmp_path), store, metrics)
    for s in range(1, 11):
        _step(store, s, 100.0 + s)
        p.update()
    _step(store, 4, 200.0)  # the trainer came back from the checkpoint at step 4
    p.update()
    assert metrics.value("verl_run_max_step") == 10
    assert metrics.value("verl_run_restarts_total") == 1
    assert metrics.value("verl_run_restart_redone_steps") == 6
    store2, metrics2 = _parts()  # a new sidecar: nothing in memory, the same state folder
    Progress(str(tmp_path), store2, metrics2)
    assert (metrics2.value("verl_run_max_step"), metrics2.value("verl_run_restarts_total")) == (10, 1)


def test_a_new_trainer_pid_is_a_restart_and_a_new_high_step_ends_the_loop(tmp_path):
    store, metrics = _parts()
    Progress(str(tmp_path), store, metrics, trainer_pid=111)
    for pid in (222, 333, 444):
        store, metrics = _parts()
        p = Progress(str(tmp_path), store, metrics, trainer_pid=pid)
    assert metrics.value("verl_run_restarts_without_progress") == 3
    _step(store, 1, 10.0)
    p.update()
    assert metrics.value("verl_run_restarts_without_progress") == 0
    assert metrics.value("verl_run_restarts_total") == 3


def test_follower_resets_count_once_with_the_step_that_follows(tmp_path):
    store, metrics = _parts()
    p = Progress(str(tmp_path), store, metrics)
    _step(store, 8, 1.0)
    p.update()
    metrics.inc(SOURCE_RESETS, reason="truncated")
    p.update()
    _step(store, 5, 2.0)  # the first line of the rewritten log
    p.update()
    assert metrics.value("verl_run_restarts_total") == 1
    assert metrics.value("verl_run_restart_redone_steps") == 3


def test_eta_and_next_checkpoint_from_the_recent_step_time(tmp_path):
    store, metrics = _parts()
    p = Progress(str(tmp_path), store, metrics, planned_steps=100, save_freq=25, deadline=5000.0,
                 ckpt_to_keep=2, clock=lambda: 1000.0)
    for s in range(1, 11):
        _step(store, s, 10.0 * s)  # 10 s a step
        p.update()
    assert metrics.value("verl_run_eta_seconds") == 90 * 10
    assert metrics.value("verl_run_next_checkpoint_timestamp_seconds") == 1000 + 15 * 10
    assert metrics.value("verl_run_deadline_timestamp_seconds") == 5000
    assert metrics.value("verl_run_checkpoints_to_keep") == 2


def test_a_stop_accepted_by_the_control_endpoint_is_kept_until_the_trainer_restarts(tmp_path):
    store, metrics = _parts()
    p = Progress(str(tmp_path), store, metrics, trainer_pid=111, planned_steps=100)
    _step(store, 5, 1.0)
    p.update()
    assert metrics.value("verl_run_stop_requested") == 0
    metrics.inc(CONTROL_REQUESTS, action="checkpoint", result="accepted")
    metrics.inc(CONTROL_REQUESTS, action="stop", result="unreachable")  # the trainer can't see it
    p.update()
    assert metrics.value("verl_run_stop_requested") == 0
    metrics.inc(CONTROL_REQUESTS, action="stop", result="accepted")
    p.update()
    assert metrics.value("verl_run_stop_requested") == 1
    store, metrics = _parts()  # the sidecar restarted while the stopped trainer exits: the request is kept
    Progress(str(tmp_path), store, metrics, trainer_pid=111)
    assert metrics.value("verl_run_stop_requested") == 1
    store, metrics = _parts()  # a new trainer (resumed) was not asked to stop
    Progress(str(tmp_path), store, metrics, trainer_pid=222)
    assert metrics.value("verl_run_stop_requested") == 0


VAL = "val-core/openai/gsm8k/reward/mean@4"
GSM8K = ("core", "openai/gsm8k", "reward", "mean@4")


def _events(store) -> dict[str, dict[tuple[str, ...], float]]:
    return {m.name: rows for m, rows in store.series() if m.events}


def _follow(path, state_dir, now):
    """A sidecar's store, progress and follower over one log; the follower has read what the file holds."""
    store, metrics = _parts()
    p = Progress(str(state_dir), store, metrics)
    follower = VerlFileFollower(str(path), store, metrics, clock=lambda: now)
    follower.poll()
    p.update()
    return store, metrics, p, follower


def test_evaluations_survive_a_sidecar_restart_and_the_recovered_tail_counts_none_twice(tmp_path):
    """Issue 37: the evaluation counter goes on across a sidecar restart; a counter back at what the recovered
    tail holds would read as new evaluations to increase()."""
    log = tmp_path / "run.jsonl"

    def write(steps, mode="ab"):
        with open(log, mode) as f:
            for s in steps:
                data = {"actor/grad_norm": 0.4, **({VAL: 0.0} if s % 10 == 0 else {})}
                f.write(json.dumps({"step": s, "data": data}).encode() + b"\n")

    write(range(1, 31), "wb")
    store, _, p, follower = _follow(log, tmp_path / "state", now=1000.0)
    write(range(31, 41))  # steps 31-40, seen live
    follower.poll()
    p.stop()
    assert _events(store)["verl_validation_evaluations_total"] == {GSM8K: 4}
    store, metrics, p, follower = _follow(log, tmp_path / "state", now=2000.0)  # a new sidecar, the same log
    events = _events(store)
    assert events["verl_validation_evaluations_total"] == {GSM8K: 4}
    assert events["verl_validation_last_evaluation_step"] == {GSM8K: 40}
    write(range(41, 51))
    follower.poll()
    assert _events(store)["verl_validation_evaluations_total"] == {GSM8K: 5}
    assert metrics.value("verl_exporter_source_errors_total", component="progress") == 0


def test_a_broken_state_file_starts_again(tmp_path):
    (tmp_path / STATE_NAME).write_text("{not json")
    store, metrics = _parts()
    p = Progress(str(tmp_path), store, metrics)
    _step(store, 3, 1.0)
    p.update()
    assert json.loads((tmp_path / STATE_NAME).read_text())["max_step"] == 3


def _write(path, steps):
    with open(path, "wb", buffering=0) as f:  # as verl's FileLogger: a restart truncates the file
        for s in steps:
            f.write(json.dumps({"step": s, "data": {"actor/grad_norm": 0.4}}).encode() + b"\n")


def _wait(fn, want, timeout=10.0):
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if fn() == want:
            return
        time.sleep(0.05)
    assert fn() == want


def _sidecar(log, state, **flags):
    from verl_exporter.sidecar.collectors import REGISTRY
    from verl_exporter.sidecar.config import build_config
    from verl_exporter.sidecar.sidecar import Sidecar

    config = build_config({}, {"listen": "127.0.0.1:0", "verl_log": str(log), "state_dir": str(state),
                               "poll_interval": 0.05, "collectors": {n: False for n in REGISTRY}, **flags})
    return Sidecar(config).start()


@pytest.mark.integration
def test_real_sidecar_restarted_run_crash_loop_and_early_end(tmp_path):
    log, state = tmp_path / "run.jsonl", tmp_path / "state"
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    side = _sidecar(log, state, trainer_pid=trainer.pid, planned_steps=100)
    try:
        m = side.self_metrics.value
        _write(log, range(1, 21))
        _wait(lambda: m("verl_run_max_step"), 20)
        _write(log, [12])  # restarted from the checkpoint at step 12
        _wait(lambda: m("verl_run_restarts_total"), 1)
        _wait(lambda: m("verl_run_restart_redone_steps"), 8)
        for n in (2, 3):  # dies again before passing step 20
            _write(log, [12 + n])
            _wait(lambda: m("verl_run_restarts_without_progress"), n)
        trainer.kill()
        trainer.wait()
        _wait(lambda: m("verl_run_trainer_running"), 0)
        with urllib.request.urlopen(side.server.url + "/metrics") as r:
            body = r.read().decode()
        assert "verl_run_max_step 20.0" in body and "verl_run_restarts_without_progress 3.0" in body
    finally:
        side.stop()
        trainer.kill()
    side = _sidecar(log, state)  # the sidecar restarted: the same log, the mark and the counts kept
    try:
        m = side.self_metrics.value
        assert (m("verl_run_max_step"), m("verl_run_restarts_total")) == (20, 3)
        _write(log, [14])  # the trainer restarted while no sidecar watched: a new file
        _wait(lambda: m("verl_run_restarts_total"), 4)
    finally:
        side.stop()


def test_the_serve_flags_reach_the_config():
    from verl_exporter.cli import build_parser
    from verl_exporter.sidecar.config import build_config, flag_values

    args = build_parser().parse_args(["serve", "--state-dir", "s", "--planned-steps", "500", "--save-freq", "50",
                                      "--max-ckpt-to-keep", "2", "--deadline", "1700000000"])
    c = build_config({}, flag_values(vars(args)))
    assert (c.state_dir, c.planned_steps, c.save_freq, c.max_ckpt_to_keep, c.deadline) == ("s", 500, 50, 2, 1.7e9)


@pytest.mark.integration
def test_real_sidecar_a_stop_through_the_control_endpoint_is_a_stop_request(tmp_path, monkeypatch):
    from helpers import CONTROL_TOKEN as TOKEN
    from helpers import control_post as post

    monkeypatch.setenv("VERL_CTL", TOKEN)
    log = tmp_path / "run.jsonl"
    side = _sidecar(log, tmp_path / "state", planned_steps=100, control_file=str(tmp_path / "control.json"),
                    control_token_env="VERL_CTL")
    try:
        m = side.self_metrics.value
        _write(log, range(1, 6))
        _wait(lambda: m("verl_run_max_step"), 5)
        assert m("verl_run_stop_requested") == 0
        status, answer = post(side.server.url + "/control/stop", TOKEN, b'{"reason": "VerlRewardCollapse"}')
        assert status == 200 and answer["applied"]
        _wait(lambda: m("verl_run_stop_requested"), 1)
    finally:
        side.stop()


# A state file is read back as hostile input: each wrong field costs only itself, the sidecar always starts.
EVENT = {"metric": "verl_validation_evaluations_total", "labels": list(("core", "openai/gsm8k", "reward", "mean@4")),
         "count": 3, "step": 30.0, "time": 1000.0, "mark": 30.0}
BAD_FIELDS = [
    ("restarts", None), ("restarts", -3), ("restarts", "2"), ("restarts", 1.5), ("restarts", True),
    ("restarts_without_progress", [1]), ("redone_steps", {"a": 1}), ("redone_steps", -1.0),
    ("max_step", "abc"), ("max_step", [1]), ("max_step", float("inf")), ("max_step", float("nan")),
    ("max_step", -5), ("max_step", 2.5), ("last_step", "x"), ("trainer_pid", "12"), ("trainer_pid", -1),
    ("stop_requested", "yes"), ("awaiting_resume", 1), ("unknown_key", 1),
    ("events", {"a": 1}), ("events", [1]), ("events", [{**EVENT, "count": 0}]), ("events", [{**EVENT, "count": 2.5}]),
    ("events", [{**EVENT, "step": -1}]), ("events", [{**EVENT, "time": float("nan")}]),
    ("events", [{**EVENT, "mark": float("inf")}]), ("events", [{**EVENT, "labels": ["x" * 129] * 4}]),
    ("events", [{**EVENT, "labels": "core"}]), ("events", [{**EVENT, "labels": ["a\udcff"] * 4}]),
    ("events", [{**EVENT, "extra": 1}]), ("events", [EVENT] * 1001),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_a_wrong_field_in_the_state_file_is_dropped_and_counted_the_rest_is_kept(tmp_path, field, value):
    good = {"max_step": 40.0, "restarts": 2, "restarts_without_progress": 1, "last_step": 30.0}
    doc = {**good, field: value}
    (tmp_path / STATE_NAME).write_text(json.dumps(doc))  # NaN and Infinity as Python's json writes them
    store, metrics = _parts()
    p = Progress(str(tmp_path), store, metrics, trainer_pid=7)
    kept = {k: v for k, v in good.items() if k != field}
    for name, metric in (("max_step", "verl_run_max_step"), ("restarts", "verl_run_restarts_total"),
                         ("restarts_without_progress", "verl_run_restarts_without_progress")):
        assert metrics.value(metric) == kept.get(name, 0)
    assert metrics.value("verl_exporter_source_errors_total", component="progress") == 1
    assert not _events(store)["verl_validation_evaluations_total"]
    _step(store, 50, 1.0)
    p.update()
    saved = json.loads((tmp_path / STATE_NAME).read_text())
    assert saved["max_step"] == 50 and saved.get(field) != value


@pytest.mark.parametrize("entry", [
    {**EVENT, "metric": "verl_no_such_metric"}, {**EVENT, "metric": "verl_actor_grad_norm"},
    {**EVENT, "labels": ["core", "gsm8k"]}, {**EVENT, "labels": ["core", "a\nb", "reward", "mean@4"]},
    {**EVENT, "mark": 31.0},
], ids=["unknown-metric", "not-watched", "labels-short", "control-char", "mark-past-step"])
def test_an_evaluation_record_that_fits_no_series_is_left_out_and_counted(tmp_path, entry):
    entry = {**entry, "metric": entry["metric"].replace("verl_validation_evaluations_total", "verl_validation_score")}
    good = {**EVENT, "metric": "verl_validation_score", "labels": ["core", "ok", "reward", "mean@4"]}
    (tmp_path / STATE_NAME).write_text(json.dumps({"max_step": 40.0, "events": [entry, good]}))
    store, metrics = _parts()
    Progress(str(tmp_path), store, metrics)
    assert _events(store)["verl_validation_evaluations_total"] == {("core", "ok", "reward", "mean@4"): 3}
    assert metrics.value("verl_exporter_source_errors_total", component="progress") == 1
    assert metrics.value("verl_run_max_step") == 40


@pytest.mark.parametrize("text", ["1e400", "[1, 2]", "null", '"text"', "[" * 100000 + "]" * 100000,
                                  '{"max_step": 1e400}', '{"max_step": ' + "9" * 5000 + "}", "\x00\xff"])
def test_a_state_file_that_is_no_state_is_set_aside_and_the_sidecar_starts(tmp_path, text):
    (tmp_path / STATE_NAME).write_bytes(text.encode("utf-8", "surrogateescape"))
    store, metrics = _parts()
    p = Progress(str(tmp_path), store, metrics)
    assert metrics.value("verl_exporter_source_errors_total", component="progress") >= 1
    assert metrics.value("verl_run_max_step") == 0
    assert (tmp_path / (STATE_NAME + ".rejected")).read_bytes() == text.encode("utf-8", "surrogateescape")
    _step(store, 3, 1.0)
    p.update()
    assert json.loads((tmp_path / STATE_NAME).read_text())["max_step"] == 3


def test_a_state_file_larger_than_any_state_is_not_read_whole(tmp_path):
    (tmp_path / STATE_NAME).write_text('{"max_step": 4, "pad": "' + "x" * MAX_STATE_BYTES + '"}')
    store, metrics = _parts()
    Progress(str(tmp_path), store, metrics)
    assert metrics.value("verl_exporter_source_errors_total", component="progress") == 1
    assert metrics.value("verl_run_max_step") == 0


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
FIELDS = sorted(ProgressState.model_fields)
GOOD_STATE = json.dumps({"last_step": 30.0, "max_step": 40.0, "restarts": 2, "restarts_without_progress": 1,
                         "redone_steps": 3.0, "trainer_pid": 7, "stop_requested": True,
                         "events": [{**EVENT, "metric": "verl_validation_score"}]}).encode()


def _starts_and_keeps_going(tmp_path, raw: bytes) -> None:
    (tmp_path / STATE_NAME).write_bytes(raw)
    store, metrics = _parts()
    p = Progress(str(tmp_path), store, metrics, trainer_pid=7)
    exported = {name: v for name, series in metrics.snapshot().items() for v in series.values()}
    assert all(math.isfinite(v) and v >= 0 for v in exported.values())
    counted = [v for rows in _events(store).values() for v in rows.values()]
    assert all(math.isfinite(v) and v >= 0 for v in counted)
    store.render()  # whatever labels were restored can be exposed
    _step(store, 41, 1.0)
    p.update()
    store, again = _parts()  # what the sidecar wrote back is read without a problem
    Progress(str(tmp_path), store, again, trainer_pid=7)
    assert again.value("verl_exporter_source_errors_total", component="progress") == 0
    assert again.value("verl_run_max_step") >= 41


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=8))
def test_any_json_object_as_the_state_file_starts_the_sidecar(tmp_path, doc):
    _starts_and_keeps_going(tmp_path, json.dumps(doc).encode())


# evaluation records whose every field may be anything, or one of the values near a bound
edge = st.sampled_from([0, -1, 1, 2**53, 2**53 + 1, 0.5, float("inf"), float("nan"), -0.0, 1e308, "1", None, True])
labels = st.lists(st.sampled_from(["core", "openai/gsm8k", "reward", "mean@4", "", "x" * 128, "x" * 129, "\udcff",
                                   "\x00", "a\nb", "\u00e9"]), max_size=6)
event_entries = st.fixed_dictionaries(
    {"metric": st.sampled_from(["verl_validation_score", "verl_actor_grad_norm", "x", 1]),
     "labels": labels | json_values, "count": edge | json_values, "step": edge, "time": edge, "mark": edge},
    optional={"extra": json_values})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(event_entries, max_size=5), st.booleans())
def test_any_evaluation_records_in_the_state_file_start_the_sidecar(tmp_path, entries, with_good):
    good = [{**EVENT, "metric": "verl_validation_score"}] if with_good else []
    _starts_and_keeps_going(tmp_path, json.dumps({"max_step": 40.0, "events": entries + good}).encode())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, len(GOOD_STATE) - 1), st.binary(max_size=3)), min_size=1, max_size=4))
def test_any_byte_mutation_of_a_state_file_starts_the_sidecar(tmp_path, edits):
    raw = bytearray(GOOD_STATE)
    for at, new in edits:
        raw[at:at + 1] = new
    _starts_and_keeps_going(tmp_path, bytes(raw))
