"""One relay per spool_dir: a second `verl-exporter relay` on the same spool_dir refuses to start.

Two relays appending to one journal lose alerts: the first one's shutdown rewrites the journal by rename,
the second keeps appending to the unlinked file, and after the second crashes the alerts it answered 200 for
are gone. The relay holds an exclusive lock (flock) on ``spool_dir/relay.lock`` for its whole life; the
lock goes with the process, so a relay killed with -9 does not block the next one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import REPO, free_port, http_get, wait_for
from helpers import scaled
from robots import FakeDingTalk

TOKEN, SECRET = "dt-token-lock-5b1e", "SECdt-secret-lock-0c9d"
ENV = {**os.environ, "DT_TOKEN": TOKEN, "DT_SECRET": SECRET,
       "PYTHONPATH": os.pathsep.join([str(REPO / "exporter"), os.environ.get("PYTHONPATH", "")])}


def _config(tmp_path: Path, robot: FakeDingTalk, spool: Path, name: str) -> tuple[Path, str]:
    port = free_port()
    doc = {"listen": f"127.0.0.1:{port}", "spool_dir": str(spool),
           "delivery": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.1, "max_attempts": 1000,
                        "max_retry_seconds": 60, "request_timeout_seconds": 1, "drain_seconds": 0.2},
           "targets": {"dt": {"type": "dingtalk", "url": robot.url, "token_env": "DT_TOKEN",
                              "secret_env": "DT_SECRET"}},
           "routes": [{"targets": ["dt"]}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, f"http://127.0.0.1:{port}"


def _relay(config: Path, log: Path, *extra: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "verl_exporter", "relay", "--config", str(config), *extra],
                                env=ENV, stdout=out, stderr=subprocess.STDOUT)


def _up(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, "the relay exited"
    try:
        return http_get(url + "/healthz", timeout=1)[0] == 200
    except OSError:
        return False


def _post(url: str, i: int) -> int:
    alert = {"status": "firing", "labels": {"alertname": "VerlLockTest", "severity": "critical",
                                            "instance": f"node{i:04d}:9477"},
             "annotations": {"summary": f"alert {i}"}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": f"fp{i}"}
    body = json.dumps({"version": "4", "status": "firing", "receiver": "verl-critical", "alerts": [alert]})
    req = urllib.request.Request(url + "/alert/verl-critical", data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(5)) as resp:
        return resp.status


@pytest.mark.integration
def test_a_second_relay_on_the_same_spool_dir_refuses_to_start_and_nothing_accepted_is_lost(tmp_path):
    robot = FakeDingTalk(TOKEN, SECRET).start()
    spool = tmp_path / "spool"
    one_cfg, one_url = _config(tmp_path, robot, spool, "one")
    two_cfg, two_url = _config(tmp_path, robot, spool, "two")
    one = _relay(one_cfg, tmp_path / "one.log")
    two = None
    try:
        wait_for(lambda: _up(one_url, one), timeout=20)
        two = _relay(two_cfg, tmp_path / "two.log")
        assert two.wait(timeout=scaled(20)) == 2, "a second relay on the same spool_dir must not run"
        said = (tmp_path / "two.log").read_text()
        assert str(spool) in said and f"pid {one.pid}" in said, said

        # --check-config says so too, and does not keep the lock: the first relay is untouched
        check = subprocess.run([sys.executable, "-m", "verl_exporter", "relay", "--config", str(two_cfg),
                                "--check-config"], env=ENV, capture_output=True, text=True, timeout=scaled(30))
        assert check.returncode == 0, check.stderr  # a note: also how one checks the running relay's config
        assert str(spool) in check.stderr and f"pid {one.pid}" in check.stderr, check.stderr
        assert _up(one_url, one)

        # what the first accepted while the robot is down survives its kill -9, and the lock goes with it
        robot.fail_next(10_000)
        assert _post(one_url, 1) == 200
        one.send_signal(signal.SIGKILL)
        one.wait(timeout=scaled(10))
        robot.heal()
        two = _relay(two_cfg, tmp_path / "two-again.log")
        wait_for(lambda: _up(two_url, two), timeout=20)
        wait_for(lambda: any("node0001" in json.dumps(m, ensure_ascii=False) for m in robot.messages), timeout=20)
        two.send_signal(signal.SIGTERM)
        assert two.wait(timeout=scaled(20)) == 0, (tmp_path / "two-again.log").read_text()[-2000:]
    finally:
        for p in (one, two):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        robot.stop()


def test_the_lock_refuses_a_second_holder_in_one_process_and_is_free_after_release(tmp_path):
    from verl_exporter.relay.journal import SpoolError, SpoolLock, spool_holder

    first = SpoolLock(tmp_path)
    first.acquire()
    assert spool_holder(tmp_path) == os.getpid()
    with pytest.raises(SpoolError, match=f"pid {os.getpid()}") as e:
        SpoolLock(tmp_path).acquire()
    assert str(tmp_path) in str(e.value)
    first.release()
    assert spool_holder(tmp_path) is None
    again = SpoolLock(tmp_path)
    again.acquire()
    again.release()
    assert spool_holder(tmp_path / "not-there") is None  # a spool_dir not yet made is free


@pytest.mark.integration
def test_a_relay_that_cannot_listen_frees_its_spool_dir_and_keeps_the_spooled_alerts(tmp_path):
    # Before, the lock stayed held after a failed start: a retry in the same process was refused as a second relay.
    import socket

    from verl_exporter.core.httpserver import ListenError
    from verl_exporter.relay.app import Relay
    from verl_exporter.relay.config import parse_config
    from verl_exporter.relay.journal import spool_holder

    robot = FakeDingTalk(TOKEN, SECRET, window=60.0).start()
    doc = {"spool_dir": str(tmp_path), "delivery": {"drain_seconds": 0.2},
           "targets": {"dt": {"type": "dingtalk", "url": robot.url, "token_env": "DT_TOKEN",
                              "secret_env": "DT_SECRET"}},
           "routes": [{"targets": ["dt"]}]}
    spooled = {"version": 1, "written_at": "2026-12-01T00:00:00+00:00", "alerts": [{
        "target": "dt", "receiver": "verl-critical", "alert": {
            "status": "firing", "labels": {"alertname": "VerlExporterDown", "severity": "critical", "run": "r"},
            "annotations": {"summary": "down"}, "startsAt": "2026-12-01T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "", "fingerprint": "f1"}}]}
    (tmp_path / "relay-spool-20261201T000000000000-1.json").write_text(json.dumps(spooled))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        with pytest.raises(ListenError):
            Relay(parse_config(doc, environ=ENV), listen=f"127.0.0.1:{busy.getsockname()[1]}").start()
        assert spool_holder(tmp_path) is None
        relay = Relay(parse_config(doc, environ=ENV), listen="127.0.0.1:0").start()  # the retry may have it
        try:
            wait_for(lambda: robot.messages, timeout=10)  # the spooled alert survived the failed start
            assert "VerlExporterDown" in json.dumps(robot.messages[0])
        finally:
            relay.stop(0.2)
    finally:
        busy.close()
        robot.stop()
