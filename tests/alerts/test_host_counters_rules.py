"""Host CPU and disk, end to end through the generated rules: the collectors' kernel counters, scraped as
Prometheus would, give the ratios through the recording rules, and VerlDiskSaturated judges the time between
scrapes too, not the sampler's last two seconds.

Each case drives the real collectors over fake /proc trees at the instants a sampler and a scraper would,
writes what they export as promtool input series, and runs promtool on the committed rule files.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, require_tool
from helpers import FIXTURES
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.render.rule_tests import expand
from verl_exporter.sidecar.collectors import Context
from verl_exporter.sidecar.collectors.cpu import CpuCollector
from verl_exporter.sidecar.collectors.disk import DiskCollector
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.spec import load_spec

pytestmark = pytest.mark.integration  # starts servers or programs

T0, T1 = FIXTURES / "proc_t0", FIXTURES / "proc_t1"
TARGET = {"job": "verl", "instance": "node0:9477", "run": "r1", "rank": "0"}
RULE_FILES = [str(REPO / "rules/verl-recording.yaml"), str(REPO / "rules/verl-alerts.yaml")]
DISK_LINE = "259       0 nvme0n1 {reads} 0 {reads} {read_ms} 0 0 0 0 0 {io_ms} {io_ms} 0 0 0 0 0 0\n"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def selector(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in {**TARGET, **labels}.items()) + "}"


def as_series(scrapes: list[list]) -> list[dict]:
    """promtool input series (one sample a minute) from what each scrape read of the collector."""
    values: dict[str, list[str]] = {}
    for minute, samples in enumerate(scrapes):
        for name, labels, value in samples:
            values.setdefault(selector(name, labels), ["_"] * len(scrapes))[minute] = repr(float(value))
    return [{"series": s, "values": " ".join(v)} for s, v in sorted(values.items())]


def promtool_test(tmp_path: Path, tests: list[dict]) -> subprocess.CompletedProcess:
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": RULE_FILES, "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run([require_tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True)


def context(procfs: Path) -> Context:
    spec = load_spec()
    return Context(spec=spec, self_metrics=SelfMetrics(spec), config=ServeConfig(procfs=str(procfs)), clock=Clock())


# ---------------------------------------------------------------------- the ratios, as the old gauges had them
def test_the_recorded_ratios_are_the_ones_the_collectors_used_to_compute(tmp_path):
    """The fixtures' two snapshots, 2 s apart, as a steady load: each minute the counters move by 30 times the
    fixture's step. The recorded ratios are then what the sampled gauges reported for that step (the numbers
    the collector tests checked before the counters)."""
    scrapes = []
    for procfs in (T0, T1):
        ctx = context(procfs)
        scrapes.append(list(CpuCollector(ctx).sample()) + list(DiskCollector(ctx).sample()))
    before = {(name, tuple(sorted(labels.items()))): value for name, labels, value in scrapes[0]}
    steady = []
    for k in range(11):
        steady.append([(name, labels, before[(name, tuple(sorted(labels.items())))] + 30 * k * (
            value - before[(name, tuple(sorted(labels.items())))])) for name, labels, value in scrapes[1]
            if (name, tuple(sorted(labels.items()))) in before])

    def near(name: str, value: float, **labels: str) -> dict:
        matchers = ", ".join(f'{k}="{v}"' for k, v in labels.items())
        return {"expr": f"abs({name}{{{matchers}}} - {value!r}) < bool 1e-9",
                "exp_samples": [{"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in {**TARGET, **labels}.items())
                                 + "}", "value": 1}]}

    nvme, sda = {"device": "nvme0n1"}, {"device": "sda"}
    cases = [
        # cpu: user +600, system +200, idle +1000, iowait +150, softirq +40, steal +10 = 2000 ticks;
        # busy = not idle, iowait or steal = 840 -> 0.42; iowait 150 / 2000
        near("instance:verl_host_cpu_utilization_ratio:rate5m", 0.42),
        near("instance:verl_host_cpu_iowait_ratio:rate5m", 0.075),
        # nvme0n1: io ms +1000 in 2000 ms: busy 0.5; weighted +3000: queue depth 1.5;
        # reads +100 taking +50 ms: 0.5 ms each; writes +40 taking +400 ms: 10 ms each
        near("instance_device:verl_host_disk_busy_ratio:rate5m", 0.5, **nvme),
        near("instance_device:verl_host_disk_queue_depth:rate5m", 1.5, **nvme),
        near("instance_device:verl_host_disk_await_seconds:rate5m", 0.0005, **nvme, op="read"),
        near("instance_device:verl_host_disk_await_seconds:rate5m", 0.010, **nvme, op="write"),
        # sda hangs: 32 requests in flight and nothing completes; await reads 0 rather than no value
        near("instance_device:verl_host_disk_queue_depth:rate5m", 32.0, **sda),
        near("instance_device:verl_host_disk_await_seconds:rate5m", 0.0, **sda, op="read"),
    ]
    run = promtool_test(tmp_path, [{
        "interval": "1m", "input_series": as_series(steady),
        "promql_expr_test": [{"eval_time": "10m", **case} for case in cases]}])
    assert run.returncode == 0, run.stdout + run.stderr


# ---------------------------------------------------------------------- VerlDiskSaturated
def disk_scrapes(tmp_path: Path, busy_seconds_before_each_scrape: float, minutes: int = 40) -> list[list]:
    """What Prometheus scrapes of the disk collector, once a minute, from a disk that is busy for the given
    seconds just before each scrape (a periodic flush) and idle otherwise. The sampler runs every 2 s, so
    the collector also sampled 2 s before each scrape."""
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    ctx = context(proc)
    collector = DiskCollector(ctx)
    busy_ms = int(busy_seconds_before_each_scrape * 1000)

    def sample_at(t: float) -> list:
        minute, into = divmod(t, 60.0)
        # busy in [60m - busy, 60m): I/O time done before t
        done = minute * busy_ms + max(0.0, into - (60.0 - busy_ms / 1000)) * 1000
        io_ms = int(done)
        (proc / "diskstats").write_text(DISK_LINE.format(reads=int(minute) * 10, read_ms=int(minute) * 10, io_ms=io_ms))
        ctx.clock.now = t
        return list(collector.sample())

    scrapes = []
    for m in range(1, minutes + 1):
        sample_at(m * 60.0 - 2.0)  # the sampler's sample before the scrape
        scrapes.append(sample_at(m * 60.0))
    return scrapes


def saturated_alert(value: float) -> dict:
    spec = load_spec()
    alert = next(a for a in spec.alerts() if a.alert == "VerlDiskSaturated")
    labels = {**TARGET, "device": "nvme0n1"}
    return {"exp_labels": {**labels, **alert.labels, "severity": alert.severity},
            "exp_annotations": {"summary": expand(alert.summary, value, labels),
                                "description": expand(alert.description, value, labels),
                                "runbook_url": f"{spec.rules.runbook_url}#{alert.alert.lower()}"}}


@pytest.mark.parametrize("busy, fires", [(4.0, False), (60.0, True)], ids=["flush-before-each-scrape", "saturated"])
def test_disk_saturated_judges_the_whole_interval_not_the_last_sample(tmp_path, busy, fires):
    """A disk busy 4 s a minute, always in the seconds before the scrape, was 100% busy in every 2 s sample a
    scrape saw (the old gauge paged on that); its I/O time counter says 7%. A disk busy all the time pages."""
    run = promtool_test(tmp_path, [{
        "interval": "1m", "input_series": as_series(disk_scrapes(tmp_path, busy)),
        "alert_rule_test": [{"eval_time": "38m", "alertname": "VerlDiskSaturated",
                             "exp_alerts": [saturated_alert(1.0)] if fires else []}]}])
    assert run.returncode == 0, run.stdout + run.stderr
