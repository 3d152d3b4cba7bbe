"""Shared test helpers: real programs are required in CI and skipped (with the reason) elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import hypothesis
import pytest
from helpers import (  # noqa: F401 - tests import them from here too
    REPO,
    TIMEOUT_FACTOR_ENV,
    free_port,
    scaled,
    timeout_factor,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families
from verl_exporter.core.shutdown import stop_process

pytest_plugins = ["unit_guard", "pytester"]  # unit_guard: the unit tier starts no process, opens no socket

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Hypothesis' deadline (200 ms an example) and its too-slow check are claims about speed that a loaded machine
# fails; the fuzz tests' own settings keep them off too.
hypothesis.settings.register_profile("suite", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("suite")


def pytest_report_header(config):
    setting = os.environ.get(TIMEOUT_FACTOR_ENV)
    how = f"{TIMEOUT_FACTOR_ENV}={setting}" if setting else "the load per core now; set it to fix it"
    return f"waits: deadlines x {timeout_factor():.2f} ({how})"


def compressed_rule_files(root: Path) -> list[Path]:
    """The generated rule files with every group on the server's evaluation interval: tests run the run's
    clock in seconds, and a group's own `interval: 1m` would leave them waiting a real minute."""
    import yaml

    out = []
    for name in ("verl-recording.yaml", "verl-alerts.yaml"):
        doc = yaml.safe_load((REPO / "rules" / name).read_text())
        for group in doc["groups"]:
            group.pop("interval", None)
        (root / name).write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(root / name)
    return out


def require_tool(name: str) -> str:
    """The path of a program the test needs: a missing one fails in CI, and is a skip elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian: apt-get install prometheus prometheus-alertmanager)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def post_json(url: str, data: bytes | None, headers: dict | None = None, method: str = "POST",
              timeout: float = 5.0) -> tuple[int, dict]:
    """(status, the JSON answer) of one request with a body, 4xx and 5xx included (the relay's webhook); the
    timeout, like every wait of the suite, times helpers.timeout_factor()."""
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=scaled(timeout)) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def http_get(url: str, headers: dict | None = None, timeout: float = 5.0) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=scaled(timeout)) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label pairs): value} from Prometheus text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels) -> float | None:
    """The value of the one sample with this name whose labels include these pairs."""
    want = {k: str(v) for k, v in labels.items()}
    hits = [v for (n, lab), v in samples.items() if n == name and want.items() <= dict(lab).items()]
    assert len(hits) <= 1, f"{name}{labels} is ambiguous: {hits}"
    return hits[0] if hits else None


class Proc:
    """A real program a test started, its output in a log file that is shown when it dies early."""

    def __init__(self, name: str, argv: list[str], log: Path | None = None, env: dict | None = None):
        self.name = name
        if log is None:
            fd, path = tempfile.mkstemp(prefix=f"verl-exporter-test-{name}-", suffix=".log")
            os.close(fd)
            log = Path(path)
        self.log = log
        self.out = log.open("wb")
        self.p = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def alive(self) -> bool:
        if self.p.poll() is not None:
            raise AssertionError(f"{self.name} exited: {self.log.read_text(errors='replace')[-3000:]}")
        return True

    def stop(self) -> None:
        stop_process(self.p)
        self.out.close()


def ready(url: str, proc: Proc) -> bool:
    """True once the program answers 200 at url; fails the test at once when it has exited."""
    proc.alive()
    try:
        return http_get(url, timeout=1)[0] == 200
    except OSError:
        return False


def am_post_alerts(api: str, alerts: list[dict]) -> None:
    """Post alerts to a real Alertmanager's API v2, as Prometheus does."""
    req = urllib.request.Request(api + "/api/v2/alerts", data=json.dumps(alerts).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(10)) as resp:
        assert resp.status == 200


class ServeProcess:
    """A real `verl-exporter serve` subprocess on a free loopback port."""

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "verl_exporter", "serve", "--listen", f"127.0.0.1:{self.port}", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        wait_for(self._up, timeout=20)

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"serve exited: {self.proc.stdout.read().decode()}")
        try:
            return http_get(self.url + "/healthz", timeout=1)[0] in (200, 503)
        except OSError:
            return False

    def metrics(self) -> dict:
        status, _, body = http_get(self.url + "/metrics")
        assert status == 200
        return parse_metrics(body.decode())

    def text(self) -> str:
        return http_get(self.url + "/metrics")[2].decode()

    def stop(self) -> str:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=scaled(10))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out.decode()


@pytest.fixture
def serve():
    started = []

    def start(*args, env=None):
        p = ServeProcess(*args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.stop()


@pytest.fixture
def start_relay():
    """start(relay config doc, environ=relay_helpers.ENV, **Relay options) -> a started Relay on a free port."""
    from relay_helpers import ENV
    from verl_exporter.relay.app import Relay
    from verl_exporter.relay.config import parse_config

    started = []

    def start(doc: dict, environ: dict | None = None, **kw) -> Relay:
        relay = Relay(parse_config(doc, environ=environ or ENV), listen="127.0.0.1:0", **kw).start()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop(drain_seconds=0)
