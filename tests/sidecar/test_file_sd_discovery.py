"""Multi-node discovery (file_sd self-registration), the per-node launcher, and /healthz as liveness."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import free_port, http_get, parse_metrics, sample, wait_for
from helpers import scaled
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.sidecar.file_sd import FileSdRegistration
from verl_exporter.sidecar.node import split_rank0_only
from verl_exporter.sidecar.sidecar import Sidecar


def test_registration_is_atomic_refreshed_and_removed(tmp_path):
    reg = FileSdRegistration(str(tmp_path / "sd"), "node-7.cluster", 9479, refresh=0.05).start()
    doc = json.loads(reg.path.read_text())
    assert reg.path.name == "verl-node-7.cluster-9479.json"
    assert doc == [{"targets": ["node-7.cluster:9479"], "labels": {}}]
    first = reg.path.stat().st_mtime_ns
    wait_for(lambda: reg.path.stat().st_mtime_ns != first, timeout=5)  # the heartbeat
    assert [p.name for p in reg.path.parent.iterdir()] == [reg.path.name]  # no temp files left behind
    reg.stop()
    assert not reg.path.exists()


def test_registration_folders_made_under_umask_077_let_prometheus_in(tmp_path):
    old = os.umask(0o077)  # Prometheus runs as another user: the folders it made must let it read the file
    try:
        reg = FileSdRegistration(str(tmp_path / "sd" / "verl"), "node-7", 9479)
        reg.write()
    finally:
        os.umask(old)
    modes = [oct(p.stat().st_mode & 0o777) for p in (tmp_path / "sd", tmp_path / "sd" / "verl", reg.path)]
    assert modes == ["0o755", "0o755", "0o644"]


def test_many_writers_share_a_directory_without_clashing(tmp_path):
    regs = [FileSdRegistration(str(tmp_path), "h", 9000 + i, refresh=0.01).start() for i in range(16)]
    wait_for(lambda: len(list(tmp_path.glob("verl-*.json"))) == 16, timeout=5)
    docs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("verl-*.json"))]
    assert len(docs) == 16 and all(d[0]["targets"][0].startswith("h:90") for d in docs)
    for r in regs:
        r.stop()
    assert not list(tmp_path.iterdir())


@pytest.mark.integration
def test_promtool_accepts_a_registration_as_file_sd(tmp_path):
    from conftest import require_tool

    promtool = require_tool("promtool")
    reg = FileSdRegistration(str(tmp_path / "sd"), "10-0-0-7", 9477)
    reg.write()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"scrape_configs:\n  - job_name: verl\n    file_sd_configs:\n"
                      f"      - files: ['{tmp_path / 'sd'}/verl-*.json']\n")
    run = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.integration
def test_serve_registers_and_deregisters(tmp_path, serve):
    sd = tmp_path / "sd"
    side = serve("--file-sd", str(sd), "--advertise", "trainer-3")
    files = list(sd.glob("verl-*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())[0]["targets"] == [f"trainer-3:{side.port}"]
    side.stop()
    assert not list(sd.glob("verl-*.json"))


def test_split_rank0_only_flags():
    common, rank0 = split_rank0_only(["--run", "x", "--verl-log", "/l.jsonl", "--checkpoint-verify",
                                      "--checkpoint-dir=/c", "--interval", "1"])
    assert common == ["--run", "x", "--interval", "1"]
    assert rank0 == ["--verl-log", "/l.jsonl", "--checkpoint-verify", "--checkpoint-dir=/c"]


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free now."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


@pytest.mark.integration
def test_node_runs_a_sidecar_per_local_rank_and_restarts_one_that_dies(tmp_path):
    port = free_port_pair()
    log = tmp_path / "verl.jsonl"
    log.write_text(json.dumps({"step": 4, "data": {"actor/lr": 1.0}}) + "\n")
    sd = tmp_path / "sd"
    proc = subprocess.Popen([sys.executable, "-m", "verl_exporter", "node", "--ranks", "2", "--rank-offset", "8",
                             "--listen", f"127.0.0.1:{port}", "--", "--run", "n1", "--verl-log", str(log),
                             "--file-sd", str(sd), "--advertise", "127.0.0.1", "--no-collector.gpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]

        def up(url):
            try:
                return http_get(url + "/healthz", timeout=1)[0] == 200
            except OSError:
                return False

        wait_for(lambda: all(up(u) for u in urls), timeout=30)
        m0, m1 = (parse_metrics(http_get(u + "/metrics")[2].decode()) for u in urls)
        assert sample(m0, "verl_exporter_build_info", rank="8", run="n1") == 1
        assert sample(m1, "verl_exporter_build_info", rank="9", run="n1") == 1
        wait_for(lambda: sample(parse_metrics(http_get(urls[0] + "/metrics")[2].decode()), "verl_training_step") == 4,
                 timeout=10)
        assert sample(m1, "verl_training_step") is None  # the driver's log goes to local rank 0 only
        assert len(list(sd.glob("verl-*.json"))) == 2
        # kill local rank 1 the hard way: the supervisor starts it again
        pid = json.loads(http_get(urls[1] + "/healthz")[2])["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: up(urls[1]) and json.loads(http_get(urls[1] + "/healthz")[2])["pid"] != pid, timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=scaled(30))[0].decode()
    assert proc.returncode == 0, out
    assert "local rank 1 exited" in out
    assert not list(sd.glob("verl-*.json"))  # a clean stop deregisters every rank, the restarted one too


@pytest.mark.integration
def test_node_rejects_per_child_flags():
    p = subprocess.run([sys.executable, "-m", "verl_exporter", "node", "--ranks", "2", "--", "--rank", "3"],
                       capture_output=True, text=True, timeout=scaled(30))
    assert p.returncode == 2 and "--rank is set per child" in p.stderr


# ---------------------------------------------------------------------------- liveness
def sidecar(**kw) -> Sidecar:
    return Sidecar(ServeConfig(listen="127.0.0.1:0", collectors={"gpu": False}, **kw))


def test_liveness_is_the_critical_stall_alert_judged_on_the_store():
    """--healthz-hang: /healthz fails while VerlTrainingStalled holds on this sidecar's store (its knobs, the
    overrides file, the deprecated flags: tests/spec/kinds/test_stall.py)."""
    s = sidecar(healthz_hang=True)
    [stalled] = s.hang_alerts
    for step in range(1, 16):
        s.store.ingest(step, {"timing_s/step": 30.0}, 1000.0 + 30 * step)  # a step every 30 s
    limit = max(stalled.factor * 30, stalled.at_least)
    assert s.trainer_liveness(now=1450 + limit)[0]
    alive, why = s.trainer_liveness(now=1450 + limit + 1)
    assert not alive and why == f"no new step for {limit + 1:.0f} s (limit {limit:.0f} s): {stalled.alert} holds"
    off = sidecar()
    off.store.ingest(1, {}, 0.0)
    assert off.health()[0]  # not asked: /healthz never judges the trainer


@pytest.mark.integration
def test_healthz_reports_a_hang_and_a_gone_trainer(tmp_path, serve):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    log = tmp_path / "verl.jsonl"
    log.write_text("".join(json.dumps({"step": s, "data": {}}) + "\n" for s in range(1, 3)))
    # an hour-old log: recovered steps are that old, past VerlTrainingStalled's limit before a baseline (30 min)
    os.utime(log, (time.time() - 3600, time.time() - 3600))
    side = serve("--verl-log", str(log), "--healthz-hang", "--trainer-pid", str(child.pid))
    wait_for(lambda: http_get(side.url + "/healthz")[0] == 503, timeout=10)
    body = json.loads(http_get(side.url + "/healthz")[2])
    assert "no new step" in body["trainer"]
    assert http_get(side.url + "/healthz/sidecar")[0] == 200  # the sidecar itself is fine
    with open(log, "a") as f:
        f.write(json.dumps({"step": 3, "data": {}}) + "\n")
    wait_for(lambda: http_get(side.url + "/healthz")[0] == 200, timeout=10)
    child.kill()
    child.wait()
    status, _, body = http_get(side.url + "/healthz")
    assert status == 503 and "is gone" in json.loads(body)["trainer"]


@pytest.mark.parametrize("flag", ["--hang-factor=-1", "--hang-min-seconds=-5"])
@pytest.mark.integration
def test_bad_liveness_flags(flag):
    p = subprocess.run([sys.executable, "-m", "verl_exporter", "serve", "--listen", "127.0.0.1:0", flag],
                       capture_output=True, text=True, timeout=scaled(30))
    assert p.returncode == 2 and "Input should be greater than or equal to 0" in p.stderr


def test_node_wide_collectors_run_on_local_rank_0_only():
    from fake_pynvml import make_context
    from verl_exporter.sidecar.collectors.sampler import build_collectors

    node_wide = {"cpu", "disk", "network", "pressure"}
    on_rank0 = {c.name for c in build_collectors({}, make_context(None, local_rank=0))}
    on_rank3 = {c.name for c in build_collectors({}, make_context(None, local_rank=3))}
    forced = {c.name for c in build_collectors({"disk": True}, make_context(None, local_rank=3))}
    assert {"cpu", "disk", "network"} <= on_rank0  # (pressure too where the kernel has PSI)
    assert not node_wide & on_rank3 and "host" in on_rank3  # host keeps the rank's own trainer RSS
    assert "disk" in forced
