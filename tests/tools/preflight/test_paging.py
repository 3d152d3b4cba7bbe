"""The preflight's paging check against a real Prometheus: the pack's rules loaded and the run's targets up
pass; a Prometheus without the rules, or a relay that does not answer, fail with the line that says so."""

from __future__ import annotations

import contextlib
import subprocess
import time

import pytest
import yaml
from conftest import REPO, require_tool
from helpers import free_port, scaled
from verl_exporter.spec import load_spec
from verl_exporter.tools.preflight import paging
from verl_exporter.tools.preflight.report import Options

pytestmark = pytest.mark.integration
SPEC = load_spec()


@contextlib.contextmanager
def prometheus(tmp_path, rules: bool):
    """A real Prometheus scraping itself as job "verl", with or without the pack's rule files."""
    port = free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "verl", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]}
    if rules:
        config["rule_files"] = [str(REPO / "rules" / "verl-recording.yaml"), str(REPO / "rules" / "verl-alerts.yaml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = subprocess.Popen([require_tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        prom.terminate()
        prom.wait(timeout=scaled(30))


def until_passes(o: Options, timeout: float = 60.0) -> list:
    """The check's findings once they pass (Prometheus starting, its first scrape), or the last ones."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        findings = paging.check(o)
        if all(f.ok for f in findings) or time.monotonic() > deadline:
            return findings
        time.sleep(0.5)


def test_prometheus_with_the_rules_and_the_targets_up_passes(tmp_path):
    with prometheus(tmp_path, rules=True) as url:
        findings = until_passes(Options(spec=SPEC, prometheus_url=url))
    assert [f.line for f in findings] == [f"Prometheus at {url} has the pack's alert rules and 1 target(s) with "
                                          'job="verl" up']


def test_prometheus_without_the_rules_or_a_silent_relay_fails(tmp_path):
    with prometheus(tmp_path, rules=False) as url:
        until_passes(Options(spec=SPEC, prometheus_url=url), timeout=0)  # started
        deadline = time.monotonic() + scaled(60)
        while True:
            lines = [f.line for f in paging.check(Options(spec=SPEC, prometheus_url=url)) if not f.ok]
            if lines and "alert rules" in lines[0] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert lines[0].startswith(f"Prometheus at {url} lacks {len(list(SPEC.alerts()))} of the pack's alert rules")
    silent = f"http://127.0.0.1:{free_port()}"
    (line,) = [f.line for f in paging.check(Options(spec=SPEC, relay_url=silent))]
    assert line.startswith(f"the relay at {silent} does not answer (URLError")
