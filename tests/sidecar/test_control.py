"""Automated response: the control endpoint, the control file, Monitor.should_*(), verl's step boundary."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from conftest import http_get, parse_metrics, sample, wait_for
from helpers import CONTROL_TOKEN as TOKEN
from helpers import control_post as post
from helpers import scaled
from verl_exporter import Monitor
from verl_exporter.sidecar.control import ControlReader, ControlState
from verl_exporter.spec import load_spec
from verl_exporter.trainer.breaker import CircuitBreaker, judged_alerts


def test_state_and_reader(tmp_path):
    path = tmp_path / "c.json"
    old = ControlState(str(path))
    old.request("stop", "from an earlier run")
    old.request("checkpoint")
    reader = ControlReader(str(path))
    reader.poll()
    assert not reader.stop_requested and not reader.take_checkpoint_request()  # left by an earlier run
    state = ControlState(str(path))
    state.request("checkpoint", "NaN")
    state.request("checkpoint", "NaN again")
    reader.poll()
    assert reader.take_checkpoint_request() and not reader.take_checkpoint_request()  # once per poll
    assert reader.reason == "NaN again"
    path.unlink()
    fresh = ControlState(str(path))
    first, again = fresh.request("stop", "critical"), fresh.request("stop", "again")
    assert first.applied and again.applied and first.id != again.id  # each request is a new one
    assert again.state["stop_seq"] == 2 and again.state["stop"] is True
    reader.poll()
    assert reader.stop_requested and reader.reason == "again"


@pytest.mark.integration
def test_control_endpoint_is_off_by_default(serve, tmp_path):
    side = serve("--checkpoint-dir", str(tmp_path))
    status, _ = post(side.url + "/control/stop", TOKEN)
    assert status == 404
    assert not (tmp_path / ".verl-exporter-control.json").exists()


@pytest.mark.integration
def test_control_endpoint_needs_the_token_and_records_requests(serve, tmp_path):
    side = serve("--checkpoint-dir", str(tmp_path), "--control-token-env", "VERL_CTL",
                 env={"VERL_CTL": TOKEN})
    url = side.url + "/control/"
    assert post(url + "stop")[0] == 401
    assert post(url + "stop", "wrong")[0] == 401
    assert post(url + "reboot", TOKEN)[0] == 404
    assert post(url + "stop", TOKEN, b"not json")[0] == 400
    assert post(url + "stop", TOKEN, b"x" * 5000)[0] == 413
    status, headers, _ = http_get(url + "stop")
    assert status == 405 and headers.get("Allow") == "POST"  # RFC 9110: a 405 says which methods are allowed
    status, body = post(url + "checkpoint", TOKEN, json.dumps({"reason": "VerlNonFiniteGradNorm"}).encode())
    assert status == 200 and body["applied"] and body["state"]["checkpoint_seq"] == 1
    first = post(url + "stop", TOKEN)[1]
    second = post(url + "stop", TOKEN)[1]
    assert first["applied"] is True and second["applied"] is True and first["id"] != second["id"]
    state = json.loads((tmp_path / ".verl-exporter-control.json").read_text())
    assert state["stop"] is True and state["checkpoint_seq"] == 1 and state["stop_seq"] == 2
    assert state["stop_id"] == second["id"] and state["checkpoint_reason"] == "VerlNonFiniteGradNorm"
    m = side.metrics()
    assert sample(m, "verl_exporter_control_requests_total", action="stop", result="unauthorized") == 2
    assert sample(m, "verl_exporter_control_requests_total", action="stop", result="accepted") == 2
    out = side.stop()
    assert "stop requested" in out and TOKEN not in out


@pytest.mark.integration
def test_missing_token_variable_is_a_clear_start_error(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "verl_exporter", "serve", "--listen", "127.0.0.1:0",
                        "--checkpoint-dir", str(tmp_path), "--control-token-env", "NOPE_NOT_SET"],
                       capture_output=True, text=True, timeout=scaled(30))
    assert p.returncode == 2 and "NOPE_NOT_SET is not set" in p.stderr


@pytest.mark.integration
def test_monitor_sees_requests_from_a_sidecar(serve, tmp_path):
    side = serve("--checkpoint-dir", str(tmp_path), "--control-token-env", "VERL_CTL", env={"VERL_CTL": TOKEN})
    seen = []
    m = Monitor(sidecar_file=str(tmp_path / "log.jsonl"), control_file=str(tmp_path / ".verl-exporter-control.json"),
                on_control=lambda action, reason: seen.append(action))
    try:
        assert not m.should_checkpoint() and not m.should_stop()
        post(side.url + "/control/checkpoint", TOKEN, json.dumps({"reason": "test"}).encode())
        assert wait_for(m.should_checkpoint, timeout=5)
        assert not m.should_checkpoint()  # once per request
        post(side.url + "/control/stop", TOKEN)
        wait_for(m.should_stop, timeout=5)
        assert m.should_stop() and seen == ["checkpoint", "stop"]
    finally:
        m.close()


@pytest.mark.integration
def test_monitor_hosts_its_own_control_endpoint():
    m = Monitor(listen="127.0.0.1:0", control_token=TOKEN)
    try:
        assert post(m.url + "/control/stop")[0] == 401
        assert post(m.url + "/control/stop", TOKEN)[0] == 200
        wait_for(m.should_stop, timeout=5)
    finally:
        m.close()


# ---------------------------------------------------------------------------- circuit breaker
def test_the_breaker_judges_every_critical_alert_a_trainer_can_see():
    judged, blind = judged_alerts(load_spec())
    names = {a.alert for a in judged}
    assert {"VerlNonFiniteGradNorm", "VerlNonFiniteLoss", "VerlRewardCollapse", "VerlAnswersCollapsed",
            "VerlNumericalCollapse", "VerlTrainingStalled"} <= names
    # what only the sidecar's collectors or Prometheus see, each with its reason
    assert {"VerlGPULost", "VerlGPUXidCritical", "VerlExporterDown", "VerlCheckpointCorrupt"} <= set(blind)
    assert "collector" in blind["VerlGPULost"] and "up" in blind["VerlExporterDown"]
    assert not names & set(blind)
    assert {a.alert for a in load_spec().alerts() if a.severity == "critical"} == names | set(blind)


def test_a_nan_trips_the_breaker_at_once_as_the_pack_pages_it(tmp_path):
    b = CircuitBreaker.from_spec(load_spec(), report_dir=str(tmp_path))
    for step in range(1, 20):
        assert b.observe(step, {"actor/grad_norm": 0.5, "actor/pg_loss": 0.1}, now=30.0 * step) == ([], None)
    anomalies, trip = b.observe(20, {"actor/grad_norm": None, "actor/pg_loss": 0.1}, now=600.0)
    assert trip is not None and trip.step == 20 and trip.alert == "VerlNonFiniteGradNorm"
    assert [(a.alert, a.kind) for a in anomalies] == [("VerlNonFiniteGradNorm", "nonfinite")]
    report = json.loads((tmp_path / "verl-exporter-diagnosis-step20.json").read_text())
    assert report["alert"] == "VerlNonFiniteGradNorm" and report["resources"]["process_rss_bytes"] > 0
    assert "VerlAnswersCollapsed" in report["judged"]
    assert b.observe(21, {"actor/grad_norm": math.inf}, now=630.0)[1] is None  # trips once


def test_consecutive_asks_for_more_steps_than_the_alert_does():
    b = CircuitBreaker.from_spec(load_spec(), consecutive=3)
    trips = [b.observe(step, {"actor/grad_norm": None}, now=30.0 * step)[1] for step in range(1, 5)]
    assert trips[:2] == [None, None] and trips[2].step == 3 and trips[3] is None
    b = CircuitBreaker.from_spec(load_spec(), consecutive=3)
    for step, grad in ((1, None), (2, 0.4), (3, None), (4, None)):  # a healthy step resets the count
        assert b.observe(step, {"actor/grad_norm": grad}, now=30.0 * step)[1] is None


def test_answers_collapsed_trips_once_its_hold_of_steps_is_met():
    """1-token answers with the entropy gone: the condition the rule judges, held over 3 steps (not minutes)."""
    b = CircuitBreaker.from_spec(load_spec())
    healthy = {"response_length/mean": 400.0, "actor/entropy": 0.6, "critic/score/mean": 0.3,
               "critic/score/min": -1.0, "timing_s/step": 60.0}
    for step in range(1, 31):
        assert b.observe(step, healthy, now=60.0 * step)[1] is None
    collapsed = {**healthy, "response_length/mean": 1.0, "actor/entropy": 0.001}
    trips = {step: b.observe(step, collapsed, now=60.0 * step)[1] for step in range(31, 45)}
    first = min(step for step, t in trips.items() if t is not None)
    assert first == 33 and trips[first].alert == "VerlAnswersCollapsed"  # the answer length held low 31, 32, 33


def test_a_stall_trips_on_the_clock_between_steps():
    b = CircuitBreaker.from_spec(load_spec())
    for step in range(1, 31):
        b.observe(step, {"timing_s/step": 60.0, "actor/grad_norm": 0.5}, now=60.0 * step)
    assert b.tick(now=1800.0 + 599) is None  # the longest step is 60 s: the floor of 600 s holds
    trip = b.tick(now=1800.0 + 601)
    assert trip is not None and trip.alert == "VerlTrainingStalled" and trip.step == 30
    assert trip.anomalies[0].value == pytest.approx(601.0)


def test_breaker_ignores_strings():
    b = CircuitBreaker.from_spec(load_spec())
    assert b.observe(1, {"actor/grad_norm": "n/a", "actor/pg_loss": "x"}) == ([], None)


@pytest.mark.integration
def test_monitor_breaker_requests_checkpoint_then_stop(tmp_path):
    m = Monitor(listen="127.0.0.1:0", breaker=True)
    try:
        for step in range(1, 4):
            m.log({"actor/grad_norm": math.nan, "actor/pg_loss": 0.1}, step=step)
        metrics = parse_metrics(http_get(m.url + "/metrics")[2].decode())  # the scrape drains the queue
        assert sample(metrics, "verl_exporter_breaker_trips_total") == 1
        # a NaN pages at once (the rule has no `for`), so the breaker trips on the first; later steps are judged
        assert sample(metrics, "verl_exporter_breaker_anomalies_total", alert="VerlNonFiniteGradNorm") == 3
        assert m.should_checkpoint() and m.should_stop()
        assert "circuit breaker tripped at step 1: VerlNonFiniteGradNorm" in m.control_reason
    finally:
        m.close()


# ---------------------------------------------------------------------------- verl's step boundary


class MiniTrainer:
    """verl's fit() loop reduced to what the hook relies on: a Tracking.log call per step, then global_steps += 1."""

    def __init__(self, steps: int, on_step=None):
        self.global_steps = 1
        self.total = steps
        self.saved: list[int] = []
        self.on_step = on_step or (lambda s: None)
        self.finished = False

    def _save_checkpoint(self):
        self.saved.append(self.global_steps)

    def fit(self):
        verl_tracking = pytest.importorskip("verl.utils.tracking")
        logger = verl_tracking.Tracking(project_name="p", experiment_name="e", default_backend=["file"])
        while self.global_steps <= self.total:
            self.on_step(self.global_steps)
            logger.log(data={"actor/grad_norm": 0.1}, step=self.global_steps)
            self.global_steps += 1
        self.finished = True


@pytest.mark.integration
def test_step_control_saves_and_stops_at_the_step_boundary(tmp_path, monkeypatch):
    from verl_exporter.trainer.verl_callback import install_step_control

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "log.jsonl"))
    path = tmp_path / "control.json"
    state = ControlState(str(path))

    def on_step(step):
        if step == 3:
            state.request("checkpoint", "VerlNonFiniteGradNorm")
        if step == 6:
            time.sleep(0.01)  # a distinct mtime for the file
            state.request("stop", "VerlNonFiniteGradNorm")

    class Trainer(MiniTrainer):
        pass

    control = install_step_control(Trainer, str(path))
    t = Trainer(20, on_step)
    assert t.fit() is None
    assert t.saved == [3, 6] and control.stopped_at == 6
    assert not t.finished and t.global_steps == 6
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(lines) == 6  # step 6 was logged before the stop


@pytest.mark.integration
def test_controlled_callback_hooks_verls_v1_trainer_not_the_legacy_loop(tmp_path, monkeypatch):
    omegaconf = pytest.importorskip("omegaconf")
    pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="needs verl[verl-core]")
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    monkeypatch.delenv("VERL_EXPORTER_CONTROL_FILE", raising=False)
    config = omegaconf.OmegaConf.create({"trainer": {
        "checkpoint_callback_class": "verl_exporter.trainer.verl_callback.ControlledCheckpointCallback",
        "default_local_dir": str(tmp_path)}})
    cb = build_checkpoint_callback(config)
    assert cb.control is not None
    assert str(cb.control.reader.path) == str(tmp_path / ".verl-exporter-control.json")
    assert getattr(PPOTrainer.fit, "_verl_exporter_wrapped", False)  # the loop verl 0.9.1 runs
    assert not getattr(RayPPOTrainer.fit, "_verl_exporter_wrapped", False)  # never builds the callback


def test_control_file_is_readable_by_a_trainer_under_another_uid_by_default(tmp_path):
    path = tmp_path / "control.json"
    ControlState(str(path)).request("stop", "x")
    assert path.stat().st_mode & 0o777 == 0o644
    ControlState(str(path), mode=0o640).request("checkpoint", "x")
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("text, expected", [("0644", 0o644), ("640", 0o640), (0o600, 0o600)])
def test_parse_file_mode(text, expected):
    from verl_exporter.sidecar.control import parse_file_mode

    assert parse_file_mode(text) == expected


@pytest.mark.parametrize("text", ["rw-r--r--", "0444", "1777", "9"])
def test_parse_file_mode_rejects_what_the_sidecar_could_not_write(text):
    from verl_exporter.sidecar.control import parse_file_mode

    with pytest.raises(ValueError, match="mode"):
        parse_file_mode(text)


def test_config_takes_the_mode_from_yaml_as_written():
    import yaml
    from verl_exporter.sidecar.config import ConfigError, build_config

    values = yaml.safe_load("control_file_mode: 0640")  # YAML 1.1 reads an unquoted 0640 as the integer 416
    assert build_config(values, {}).control_file_mode == "0640"
    assert build_config({}, {"control_file_mode": "600"}).control_file_mode == "600"
    with pytest.raises(ConfigError, match="control_file_mode"):
        build_config(yaml.safe_load("control_file_mode: 0400"), {})


def _read_as_nobody(reader: ControlReader, conn) -> None:
    """In a child process: drop to uid/gid 65534 and ask the ControlReader (started before the request) what it
    sees."""
    os.setgid(65534)
    os.setuid(65534)
    reader.poll()
    conn.send((reader.stop_requested, reader.read_failures))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to switch users")
@pytest.mark.parametrize("mode, seen", [(0o644, True), (0o600, False)])
@pytest.mark.integration
def test_a_trainer_under_another_uid_reads_the_request_or_counts_why_not(mode, seen):
    import multiprocessing
    import shutil
    import tempfile

    folder = tempfile.mkdtemp()
    try:
        os.chmod(folder, 0o755)
        path = os.path.join(folder, "control.json")
        reader = ControlReader(path)
        ControlState(path, mode=mode).request("stop", "VerlHang")
        parent, child = multiprocessing.Pipe()
        proc = multiprocessing.get_context("fork").Process(target=_read_as_nobody, args=(reader, child))
        proc.start()
        proc.join(scaled(20))
        stop_seen, failures = parent.recv()
        assert (stop_seen, failures) == (seen, 0 if seen else 1)
    finally:
        shutil.rmtree(folder)


def deny_opening(monkeypatch, path) -> None:
    """os.open of path fails as for a file another user owns with mode 0600 (root is never denied)."""
    real_open = os.open

    def denied(p, *a, **k):
        if str(p) == str(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *a, **k)

    monkeypatch.setattr(os, "open", denied)


def test_an_unreadable_control_file_is_counted_logged_and_retried(tmp_path, monkeypatch, caplog):
    path = tmp_path / "control.json"
    errors = []
    reader = ControlReader(str(path), on_error=errors.append)
    ControlState(str(path)).request("checkpoint", "x")
    deny_opening(monkeypatch, path)
    with caplog.at_level("WARNING", logger="verl_exporter"):
        reader.poll()
        reader.poll()
    assert reader.read_failures == 2 and len(errors) == 2
    logged = [r for r in caplog.records if "failed reads" in r.getMessage()]
    assert "permission denied" in errors[0] and len(logged) == 1  # logged once, counted each time
    assert not reader.take_checkpoint_request()
    monkeypatch.undo()
    reader.poll()  # the same, unchanged file: read again now that it can be
    assert reader.take_checkpoint_request()


def test_two_requests_within_one_mtime_tick_are_both_seen(tmp_path):
    path = tmp_path / "control.json"
    state = ControlState(str(path))
    reader = ControlReader(str(path), clock=lambda: 0.0)
    state.request("checkpoint", "x")
    reader.poll()
    assert reader.take_checkpoint_request()
    before = path.stat()
    state.request("stop", "y")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # a coarse clock: the same mtime
    reader.poll()
    assert reader.stop_requested


def test_a_fifo_as_the_control_file_never_blocks_the_trainer(tmp_path):
    path = tmp_path / "control.json"
    os.mkfifo(path)  # nobody writes it: reading would block the step for ever
    reader = ControlReader(str(path), clock=lambda: 0.0)
    reader.poll()
    assert reader.read_failures == 1 and not reader.stop_requested


# ---------------------------------------------------------------------------- requests have identity
def _reasoned(reason: str) -> bytes:
    return json.dumps({"reason": reason}).encode()


@pytest.mark.integration
def test_a_resumed_run_ignores_the_stop_that_ended_run_1_and_obeys_a_new_one(serve, tmp_path):
    side = serve("--checkpoint-dir", str(tmp_path), "--control-token-env", "VERL_CTL", env={"VERL_CTL": TOKEN})
    path = str(tmp_path / ".verl-exporter-control.json")
    run1 = ControlReader(path)
    assert post(side.url + "/control/checkpoint", TOKEN, _reasoned("VerlHang"))[1]["applied"] is True
    assert post(side.url + "/control/stop", TOKEN, _reasoned("VerlHang"))[1]["applied"] is True
    run1.poll()
    assert run1.take_checkpoint_request() and run1.stop_requested  # run 1 saves and stops
    # run 2 resumes from the same checkpoint directory: the file still says stop
    run2 = ControlReader(path)
    monitor2 = Monitor(sidecar_file=str(tmp_path / "log.jsonl"), control_file=path)
    try:
        run2.poll()
        time.sleep(scaled(1.0))  # room for the Monitor's worker (it polls every 0.2 s) to take what it must not
        assert not run2.stop_requested and not run2.take_checkpoint_request()
        assert not monitor2.should_stop() and not monitor2.should_checkpoint()
        # an alert asks run 2 to stop: a new request, applied, seen by run 2's readers
        status, body = post(side.url + "/control/stop", TOKEN, _reasoned("VerlNumericalCollapse"))
        assert status == 200 and body["applied"] is True and body["id"] == body["state"]["stop_id"]
        run2.poll()
        assert run2.stop_requested and run2.reason == "VerlNumericalCollapse"
        assert wait_for(monitor2.should_stop, timeout=5) and monitor2.control_reason == "VerlNumericalCollapse"
        assert not run2.take_checkpoint_request()  # the old checkpoint request stays old
        status, body = post(side.url + "/control/checkpoint", TOKEN, _reasoned("VerlNumericalCollapse"))
        run2.poll()
        assert run2.take_checkpoint_request() and wait_for(monitor2.should_checkpoint, timeout=5)
    finally:
        monitor2.close()
    m = side.metrics()
    assert sample(m, "verl_exporter_control_requests_total", action="stop", result="accepted") == 2


def test_a_request_is_new_or_stale_by_its_id_whatever_the_clocks_say(tmp_path):
    path = str(tmp_path / "c.json")
    ahead = ControlState(path, clock=lambda: 5000.0)  # the sidecar's clock runs ahead of the trainer's
    ahead.request("checkpoint", "run 1")
    ahead.request("stop", "run 1")
    run2 = ControlReader(path, clock=lambda: 1000.0)
    run2.poll()
    assert not run2.stop_requested and not run2.take_checkpoint_request()  # made before run 2 started
    behind = ControlState(path, clock=lambda: 10.0)  # a sidecar on a host whose clock is behind
    behind.request("checkpoint", "run 2")
    run2.poll()
    assert run2.take_checkpoint_request() and not run2.stop_requested
    assert behind.request("stop", "run 2").applied
    run2.poll()
    assert run2.stop_requested and run2.reason == "run 2"


def test_a_control_file_made_again_from_scratch_still_delivers(tmp_path):
    path = tmp_path / "c.json"
    ControlState(str(path)).request("checkpoint", "run 1")  # checkpoint_seq 1, left by run 1
    reader = ControlReader(str(path))
    path.unlink()  # a person clears it; a new sidecar starts counting again
    ControlState(str(path)).request("checkpoint", "run 2")  # checkpoint_seq 1 again, but a new request
    reader.poll()
    assert reader.take_checkpoint_request() and reader.reason == "run 2"


def test_a_reader_that_could_not_read_the_file_at_its_start_judges_old_requests_by_time(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    ControlState(str(path), clock=lambda: 100.0).request("stop", "run 1")
    deny_opening(monkeypatch, path)
    reader = ControlReader(str(path), clock=lambda: 200.0)
    reader.poll()
    assert reader.read_failures == 1
    monkeypatch.undo()  # the permission is fixed
    reader.poll()
    assert not reader.stop_requested  # older than this reader
    ControlState(str(path), clock=lambda: 300.0).request("stop", "run 2")
    reader.poll()
    assert reader.stop_requested and reader.reason == "run 2"


@pytest.mark.integration
def test_step_control_of_a_resumed_run_stops_only_on_a_new_request(tmp_path, monkeypatch):
    from verl_exporter.trainer.verl_callback import install_step_control

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "log.jsonl"))
    path = tmp_path / "control.json"
    ControlState(str(path)).request("stop", "run 1")  # what stopped run 1

    class Trainer(MiniTrainer):
        pass

    control = install_step_control(Trainer, str(path))
    t = Trainer(5)
    t.fit()
    assert t.finished and t.saved == [] and control.stopped_at is None  # run 2 went on
    control = install_step_control(Trainer, str(path))  # run 3, stopped at its step 4
    t = Trainer(20, lambda step: step == 4 and ControlState(str(path)).request("stop", "VerlHang"))
    t.fit()
    assert control.stopped_at == 4 and t.saved == [4] and not t.finished


# ---------------------------------------------------------------------------- who can read the control file
def _spawn_read_as_nobody(reader: ControlReader) -> tuple[bool, int]:
    import multiprocessing

    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_read_as_nobody, args=(reader, child))
    proc.start()
    proc.join(scaled(20))
    return parent.recv()


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to switch users")


@pytest.fixture
def open_folder():
    """A folder any uid may pass through (pytest's tmp_path is 0700), removed afterwards."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o755)
    yield Path(folder)
    shutil.rmtree(folder)


def _modes(root, path) -> list[str]:
    out = []
    while path != root:
        out.append(oct(path.stat().st_mode & 0o777))
        path = path.parent
    return out


@pytest.mark.integration
@pytest.mark.parametrize("mode, folders", [("0644", "0o755"), ("0640", "0o750"), ("0600", "0o700")])
def test_a_sidecar_under_umask_077_makes_folders_the_trainer_can_pass(serve, open_folder, mode, folders):
    ckpt = open_folder / "new" / "ckpt"  # neither exists yet: the sidecar makes both
    old = os.umask(0o077)
    try:
        side = serve("--checkpoint-dir", str(ckpt), "--control-token-env", "VERL_CTL",
                     "--control-file-mode", mode, env={"VERL_CTL": TOKEN})
    finally:
        os.umask(old)
    control = ckpt / ".verl-exporter-control.json"
    reader = ControlReader(str(control))  # the trainer, started before the request
    status, body = post(side.url + "/control/stop", TOKEN, _reasoned("VerlHang"))
    assert status == 200 and body["applied"] is True
    assert _modes(open_folder, control) == [oct(int(mode, 8)), folders, folders]
    if os.geteuid() == 0 and mode == "0644":  # a trainer under another uid reads it
        assert _spawn_read_as_nobody(reader) == (True, 0)


@needs_root
@pytest.mark.integration
def test_a_file_another_uid_cannot_reach_is_not_reported_applied(open_folder, monkeypatch):
    """The sidecar made the folder but it could not be opened up (a mount that ignores chmod)."""
    from verl_exporter.exposition.selfmetrics import SelfMetrics
    from verl_exporter.sidecar.control import make_control_app

    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    reader = ControlReader(str(open_folder / "made" / "control.json"))
    old = os.umask(0o077)
    try:
        state = ControlState(str(open_folder / "made" / "control.json"))
        metrics = SelfMetrics(load_spec())
        app = make_control_app(state, TOKEN, metrics)
        answers = []
        body = app({"PATH_INFO": "/control/stop", "REQUEST_METHOD": "POST", "HTTP_AUTHORIZATION": f"Bearer {TOKEN}",
                    "CONTENT_LENGTH": "0"}, lambda status, headers: answers.append(status))
    finally:
        os.umask(old)
    answer = json.loads(b"".join(body))
    assert answers == ["200 OK"] and answer["applied"] is False
    assert "made" in answer["error"] and "0o700" in answer["error"]
    assert metrics.value("verl_exporter_control_requests_total", action="stop", result="unreachable") == 1
    assert _spawn_read_as_nobody(reader) == (False, 1)  # it really is not


@pytest.mark.parametrize("text", ["0646", "0664", "0666", "0622"])
def test_parse_file_mode_rejects_a_file_others_could_write(text):
    from verl_exporter.sidecar.control import parse_file_mode

    with pytest.raises(ValueError, match="write"):
        parse_file_mode(text)


@pytest.mark.integration
def test_a_monitors_own_control_file_is_for_itself_only_and_applied(caplog):
    m = Monitor(listen="127.0.0.1:0", control_token=TOKEN)
    try:
        with caplog.at_level("WARNING", logger="verl_exporter"):
            status, body = post(m.url + "/control/checkpoint", TOKEN)
        assert status == 200 and body["applied"] is True
        assert os.stat(m.sidecar.control.path).st_mode & 0o777 == 0o600  # in a 0700 temporary folder
        assert not [r for r in caplog.records if "cannot reach" in r.getMessage()]
        assert wait_for(m.should_checkpoint, timeout=5)
    finally:
        m.close()


def test_a_version_1_file_of_an_older_sidecar_is_still_understood(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"version": 1, "checkpoint_seq": 2, "checkpoint_time": 100.0, "stop": True,
                                "stop_time": 100.0, "reason": "run 1"}))
    reader = ControlReader(str(path))
    reader.poll()
    assert not reader.stop_requested and not reader.take_checkpoint_request()  # run 1's
    path.write_text(json.dumps({"version": 1, "checkpoint_seq": 3, "checkpoint_time": 200.0, "stop": True,
                                "stop_time": 100.0, "reason": "NaN"}))
    reader.poll()
    assert reader.take_checkpoint_request() and reader.reason == "NaN" and not reader.stop_requested
    # and the other way round: an older trainer's reader (stop_time after its start) sees a new stop
    assert ControlState(str(path)).request("stop", "x").state["stop_time"] > 100.0


@pytest.mark.parametrize("body", [b"[" * 1500 + b"]" * 1500, b'{"reason": ' + b"[" * 1500 + b"]" * 1500 + b"}"])
@pytest.mark.parametrize("action", ["checkpoint", "stop", "forensics"])
def test_a_body_nested_past_the_json_decoder_is_a_counted_400(tmp_path, action, body):
    """It was a RecursionError: 500 with a traceback in the log, and the request counted nowhere."""
    import io

    from verl_exporter.exposition.selfmetrics import SelfMetrics
    from verl_exporter.sidecar.control import MAX_BODY, make_control_app

    assert len(body) <= MAX_BODY  # within the size the endpoint reads: only the nesting is wrong
    metrics = SelfMetrics(load_spec())
    app = make_control_app(ControlState(str(tmp_path / "control.json")), TOKEN, metrics)
    answers: list[str] = []
    out = app({"PATH_INFO": f"/control/{action}", "REQUEST_METHOD": "POST", "HTTP_AUTHORIZATION": f"Bearer {TOKEN}",
               "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)},
              lambda status, headers: answers.append(status))
    assert answers == ["400 Bad Request"] and "JSON" in json.loads(b"".join(out))["error"]
    assert metrics.value("verl_exporter_control_requests_total", action=action, result="bad_request") == 1
    assert not (tmp_path / "control.json").exists()
