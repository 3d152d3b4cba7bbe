"""Automated response: the control endpoint, the control file, Monitor.should_*(), verl's step boundary."""

from __future__ import annotations

import json
import math
import os
import time
import urllib.request

import pytest
from conftest import http_get, parse_metrics, sample, wait_for
from verl_exporter import Monitor
from verl_exporter.sidecar.control import ControlReader, ControlState
from verl_exporter.spec import load_spec
from verl_exporter.trainer.breaker import CircuitBreaker, Rule

TOKEN = "s3cr3t-control-token"


def post(url: str, token: str | None = None, body: bytes | None = b"{}", method: str = "POST"):
    req = urllib.request.Request(url, data=body, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"text": raw.decode()}


def test_state_and_reader(tmp_path):
    path = tmp_path / "c.json"
    clock = [1000.0]
    old = ControlState(str(path), clock=lambda: clock[0])
    old.request("stop", "from an earlier run")
    old.request("checkpoint")
    clock[0] = 2000.0
    reader = ControlReader(str(path), clock=lambda: clock[0])
    reader.poll()
    assert not reader.stop_requested and not reader.take_checkpoint_request()  # left by an earlier run
    state = ControlState(str(path), clock=lambda: 2001.0)
    state.request("checkpoint", "NaN")
    state.request("checkpoint", "NaN again")
    reader.poll()
    assert reader.take_checkpoint_request() and not reader.take_checkpoint_request()  # once per poll
    path.unlink()
    fresh = ControlState(str(path), clock=lambda: 2002.0)
    _, changed = fresh.request("stop", "critical")
    _, again = fresh.request("stop", "critical")
    assert changed and not again  # idempotent
    reader.poll()
    assert reader.stop_requested and reader.reason == "critical"


def test_control_endpoint_is_off_by_default(serve, tmp_path):
    side = serve("--checkpoint-dir", str(tmp_path))
    status, _ = post(side.url + "/control/stop", TOKEN)
    assert status == 404
    assert not (tmp_path / ".verl-exporter-control.json").exists()


def test_control_endpoint_needs_the_token_and_records_requests(serve, tmp_path):
    side = serve("--checkpoint-dir", str(tmp_path), "--control-token-env", "VERL_CTL",
                 env={"VERL_CTL": TOKEN})
    url = side.url + "/control/"
    assert post(url + "stop")[0] == 401
    assert post(url + "stop", "wrong")[0] == 401
    assert post(url + "reboot", TOKEN)[0] == 404
    assert post(url + "stop", TOKEN, b"not json")[0] == 400
    assert post(url + "stop", TOKEN, b"x" * 5000)[0] == 413
    assert http_get(url + "stop")[0] == 405
    status, body = post(url + "checkpoint", TOKEN, json.dumps({"reason": "VerlNonFiniteGradNorm"}).encode())
    assert status == 200 and body["applied"] and body["state"]["checkpoint_seq"] == 1
    assert post(url + "stop", TOKEN)[1]["applied"] is True
    assert post(url + "stop", TOKEN)[1]["applied"] is False
    state = json.loads((tmp_path / ".verl-exporter-control.json").read_text())
    assert state["stop"] is True and state["checkpoint_seq"] == 1
    m = side.metrics()
    assert sample(m, "verl_exporter_control_requests_total", action="stop", result="unauthorized") == 2
    assert sample(m, "verl_exporter_control_requests_total", action="stop", result="accepted") == 1
    assert sample(m, "verl_exporter_control_requests_total", action="stop", result="repeated") == 1
    out = side.stop()
    assert "stop requested" in out and TOKEN not in out


def test_missing_token_variable_is_a_clear_start_error(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "verl_exporter", "serve", "--listen", "127.0.0.1:0",
                        "--checkpoint-dir", str(tmp_path), "--control-token-env", "NOPE_NOT_SET"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "NOPE_NOT_SET is not set" in p.stderr


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


def test_monitor_hosts_its_own_control_endpoint():
    m = Monitor(listen="127.0.0.1:0", control_token=TOKEN)
    try:
        assert post(m.url + "/control/stop")[0] == 401
        assert post(m.url + "/control/stop", TOKEN)[0] == 200
        wait_for(m.should_stop, timeout=5)
    finally:
        m.close()


# ---------------------------------------------------------------------------- circuit breaker
def test_rules_come_from_the_critical_alerts_of_the_spec():
    rules = {(r.key, r.kind) for r in CircuitBreaker.from_spec(load_spec()).rules}
    assert {("actor/grad_norm", "nonfinite"), ("actor/pg_loss", "nonfinite")} <= rules
    detector = {(r.key, r.kind, r.source) for r in CircuitBreaker.from_spec(load_spec()).detector_rules}
    assert ("score", "detector", "VerlRewardCollapse") in detector


def test_breaker_trips_after_consecutive_critical_anomalies(tmp_path):
    b = CircuitBreaker([Rule("actor/grad_norm", "nonfinite"), Rule("loss", "zscore", k=4)], window=20,
                       min_samples=5, consecutive=3, report_dir=str(tmp_path))
    for step in range(20):
        assert b.observe(step, {"actor/grad_norm": 0.5, "loss": 1.0 + 0.01 * (step % 3)}) == ([], None)
    assert b.observe(20, {"actor/grad_norm": None})[1] is None
    assert b.observe(21, {"actor/grad_norm": 0.4})[1] is None  # a healthy step resets the streak
    b.observe(22, {"actor/grad_norm": float("nan")})
    b.observe(23, {"loss": 50.0})
    anomalies, trip = b.observe(24, {"actor/grad_norm": float("inf"), "loss": 60.0})
    assert trip is not None and trip.step == 24 and len(anomalies) == 2
    z = next(a for a in anomalies if a.kind == "zscore")
    assert z.z > 4 and z.mean == pytest.approx(1.0, abs=0.2)
    report = json.loads((tmp_path / "verl-exporter-diagnosis-step24.json").read_text())
    assert [s["step"] for s in report["streak"]] == [22, 23, 24]
    assert report["resources"]["process_rss_bytes"] > 0
    assert b.observe(25, {"actor/grad_norm": None})[1] is None  # trips once


def test_breaker_ignores_strings_and_waits_for_its_window():
    b = CircuitBreaker([Rule("x", "zscore", k=3)], window=10, min_samples=5, consecutive=1)
    assert b.observe(1, {"x": 100.0})[0] == []  # too few samples to judge
    assert b.observe(2, {"x": "n/a"})[0] == []


def test_monitor_breaker_requests_checkpoint_then_stop(tmp_path):
    m = Monitor(listen="127.0.0.1:0", breaker=True)
    try:
        for step in range(1, 4):
            m.log({"actor/grad_norm": math.nan, "actor/pg_loss": 0.1}, step=step)
        metrics = parse_metrics(http_get(m.url + "/metrics")[2].decode())  # the scrape drains the queue
        assert sample(metrics, "verl_exporter_breaker_trips_total") == 1
        assert sample(metrics, "verl_exporter_breaker_anomalies_total", key="actor/grad_norm", kind="nonfinite") == 3
        assert m.should_checkpoint() and m.should_stop()
        assert "circuit breaker tripped at step 3" in m.control_reason
    finally:
        m.close()


# ---------------------------------------------------------------------------- verl's step boundary
verl_tracking = pytest.importorskip("verl.utils.tracking")


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
        logger = verl_tracking.Tracking(project_name="p", experiment_name="e", default_backend=["file"])
        while self.global_steps <= self.total:
            self.on_step(self.global_steps)
            logger.log(data={"actor/grad_norm": 0.1}, step=self.global_steps)
            self.global_steps += 1
        self.finished = True


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


def _read_as_nobody(path: str, conn) -> None:
    """In a child process: drop to uid/gid 65534 and ask a ControlReader what it sees."""
    os.setgid(65534)
    os.setuid(65534)
    reader = ControlReader(path, clock=lambda: 0.0)
    reader.poll()
    conn.send((reader.stop_requested, reader.read_failures))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to switch users")
@pytest.mark.parametrize("mode, seen", [(0o644, True), (0o600, False)])
def test_a_trainer_under_another_uid_reads_the_request_or_counts_why_not(mode, seen):
    import multiprocessing
    import shutil
    import tempfile

    folder = tempfile.mkdtemp()
    try:
        os.chmod(folder, 0o755)
        path = os.path.join(folder, "control.json")
        ControlState(path, mode=mode).request("stop", "VerlHang")
        parent, child = multiprocessing.Pipe()
        proc = multiprocessing.get_context("fork").Process(target=_read_as_nobody, args=(path, child))
        proc.start()
        proc.join(20)
        stop_seen, failures = parent.recv()
        assert (stop_seen, failures) == (seen, 0 if seen else 1)
    finally:
        shutil.rmtree(folder)


def test_an_unreadable_control_file_is_counted_logged_and_retried(tmp_path, monkeypatch, caplog):
    from pathlib import Path

    path = tmp_path / "control.json"
    ControlState(str(path)).request("checkpoint", "x")
    errors = []
    reader = ControlReader(str(path), clock=lambda: 0.0, on_error=errors.append)
    real_read = Path.read_text

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)
    with caplog.at_level("WARNING", logger="verl_exporter"):
        reader.poll()
        reader.poll()
    assert reader.read_failures == 2 and len(errors) == 2
    assert "permission denied" in errors[0] and len(caplog.records) == 1  # logged once, counted each time
    assert not reader.take_checkpoint_request()
    monkeypatch.setattr(Path, "read_text", real_read)
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
