"""The sampler: collectors on their own threads; a scrape never waits for one, whatever it does."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import http_get, parse_metrics, sample, wait_for
from fake_pynvml import make_context
from helpers import scaled
from verl_exporter.sidecar import collectors
from verl_exporter.sidecar.collectors.base import Collector
from verl_exporter.sidecar.collectors.sampler import Sampler


class Hanging(Collector):
    """Like a stat() on a dead NFS mount: the second sample never returns."""

    name = "checkpoint"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls = 0
        self.release = threading.Event()

    def sample(self):
        self.calls += 1
        if self.calls > 1:
            self.release.wait(scaled(60))
        return [("verl_checkpoint_latest_step", {}, 7.0)]


class Steady(Collector):
    name = "host"

    def sample(self):
        return [("verl_host_load_average", {"period": "1m"}, 0.5)]


class Broken(Collector):
    name = "network"

    def sample(self):
        raise OSError("no /proc/net/dev")


def test_a_hung_collector_never_holds_up_a_scrape_and_its_staleness_shows():
    ctx = make_context(None)
    hung, steady = Hanging(ctx), Steady(ctx)
    sampler = Sampler([hung, steady, Broken(ctx)], ctx.spec, ctx.self_metrics, {"rank": "0"}, interval=0.05)
    sampler.start()
    try:
        wait_for(lambda: hung.calls >= 2, timeout=5)  # now stuck inside sample()
        stuck_since = ctx.self_metrics.value("verl_exporter_collector_last_success_timestamp_seconds",
                                             collector="checkpoint")
        wait_for(lambda: ctx.self_metrics.value("verl_exporter_collector_last_success_timestamp_seconds",
                                                collector="host") > stuck_since, timeout=5)  # the others go on
        started = time.perf_counter()
        text = sampler.render()
        # a scrape copies samples; it does not wait for them (the hung one never returns: any bound shows it)
        assert time.perf_counter() - started < scaled(0.5)
        m = parse_metrics(text)
        assert sample(m, "verl_checkpoint_latest_step", rank="0") == 7  # the last good sample is still served
        assert sample(m, "verl_host_load_average", period="1m") == 0.5
        steady_last = ctx.self_metrics.value("verl_exporter_collector_last_success_timestamp_seconds",
                                             collector="host")
        assert steady_last > stuck_since  # the others go on; the hung one's age grows
        assert ctx.self_metrics.value("verl_exporter_collector_success", collector="network") == 0
        assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="network") >= 1
    finally:
        hung.release.set()
        sampler.stop()


def test_samples_that_do_not_fit_the_spec_are_counted_not_served():
    ctx = make_context(None)

    class Wrong(Collector):
        name = "host"

        def sample(self):
            return [("verl_host_load_average", {"nope": "x"}, 1.0), ("verl_not_in_spec", {}, 1.0),
                    ("verl_host_memory_total_bytes", {}, 8.0)]

    sampler = Sampler([Wrong(ctx)], ctx.spec, ctx.self_metrics)
    assert sampler.run_once(sampler.collectors[0])
    m = parse_metrics(sampler.render())
    assert sample(m, "verl_host_memory_total_bytes") == 8
    assert sample(m, "verl_host_load_average") is None
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="host") == 2


def test_series_over_a_metrics_cap_are_dropped_and_counted():
    ctx = make_context(None)
    cap = ctx.spec["verl_host_network_bytes_total"].max_series

    class Many(Collector):
        name = "network"

        def sample(self):
            return [("verl_host_network_bytes_total", {"interface": f"eth{i}", "direction": "receive"}, 1.0)
                    for i in range(cap + 5)]

    sampler = Sampler([Many(ctx)], ctx.spec, ctx.self_metrics)
    sampler.run_once(sampler.collectors[0])
    m = parse_metrics(sampler.render())
    assert sum(1 for name, _ in m if name == "verl_host_network_bytes_total") == cap
    assert ctx.self_metrics.value("verl_exporter_series_dropped_total", reason="series_cap") == 5


def test_fast_exposition_matches_client_python():
    """exposition.py renders what client_python would, in both formats."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
    from verl_exporter.exposition.encode import safe_text
    from verl_exporter.exposition.families import family

    ctx = make_context(None)

    class Mixed(Collector):
        name = "host"

        def sample(self):
            return [("verl_host_load_average", {"period": 'a"b\\c\nd'}, float("nan")),
                    ("verl_host_pressure_stall_seconds_total", {"resource": "io", "kind": "some"}, 1e21),
                    ("verl_host_memory_total_bytes", {}, float("inf"))]

    const = {"run": "r", "rank": "1"}
    sampler = Sampler([Mixed(ctx)], ctx.spec, ctx.self_metrics, const)
    sampler.run_once(sampler.collectors[0])

    class AsFamilies:  # the same series as client_python's own metric families, control characters escaped
        def collect(self):
            return [family(metric, {tuple(safe_text(v) for v in key): value for key, value in rows.items()}, const)
                    for metric, rows in sampler.series()]

    registry = CollectorRegistry()
    registry.register(AsFamilies())
    assert sampler.render() == generate_latest(registry).decode()
    assert sampler.render(openmetrics=True) + "# EOF\n" == generate_openmetrics(registry).decode()
    assert 'period="a\\"b\\\\c\\\\x0ad"' in sampler.render()  # the newline garbles no legend


def test_dropped_series_are_counted_once_per_sample_not_per_scrape():
    ctx = make_context(None)
    cap = ctx.spec["verl_host_network_bytes_total"].max_series

    class Many(Collector):
        name = "network"

        def sample(self):
            return [("verl_host_network_bytes_total", {"interface": f"eth{i}", "direction": "receive"}, 1.0)
                    for i in range(cap + 5)]

    sampler = Sampler([Many(ctx)], ctx.spec, ctx.self_metrics)
    sampler.run_once(sampler.collectors[0])
    for _ in range(3):  # three scrapes (or two HA Prometheus servers) of one sample
        sampler.render()
    assert ctx.self_metrics.value("verl_exporter_series_dropped_total", reason="series_cap") == 5
    sampler.run_once(sampler.collectors[0])
    assert ctx.self_metrics.value("verl_exporter_series_dropped_total", reason="series_cap") == 10


@pytest.mark.integration
def test_importing_the_package_registers_every_collector_once():
    """node_exporter's layout: each collector file registers itself, the package imports every file; there is
    no second list of modules to keep in step."""
    code = "import verl_exporter.sidecar.collectors as c; print(' '.join(sorted(c.REGISTRY)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    folder = Path(collectors.__file__).parent
    registering = sorted(p.stem for p in folder.glob("*.py") if "\n@register\n" in p.read_text(encoding="utf-8"))
    assert out == sorted(collectors.REGISTRY) == sorted(cls.name for cls in collectors.REGISTRY.values())
    assert len(out) == len(registering) == 13, (out, registering)
    assert not hasattr(collectors, "load_all")


class SlowFirst(Collector):
    """A first sample that takes a while (NVML's first init, a checkpoint's first walk); hangs when told to."""

    name = "host"

    def __init__(self, ctx, delay: float, hang: threading.Event | None = None):
        super().__init__(ctx)
        self.delay, self.hang = delay, hang

    def sample(self):
        time.sleep(self.delay)
        if self.hang is not None:
            self.hang.wait(scaled(60))
        return [("verl_host_load_average", {"period": "1m"}, 0.5)]


def _sidecar_with(collector_factory):
    from verl_exporter.sidecar.config import build_config
    from verl_exporter.sidecar.sidecar import Sidecar

    config = build_config({}, {"listen": "127.0.0.1:0", "run": "r", "rank": 0,
                               "collectors": {name: False for name in collectors.REGISTRY}}, origin="test")
    sidecar = Sidecar(config)
    sidecar.sampler.add(collector_factory(sidecar.context()))
    return sidecar


@pytest.mark.integration
def test_a_started_sidecar_answers_its_first_scrape_with_its_collectors_series():
    """A first scrape without a collector's series reads as a gap (and an absent() alert's clock starting)."""
    sidecar = _sidecar_with(lambda ctx: SlowFirst(ctx, delay=0.5)).start()
    try:
        _, _, body = http_get(sidecar.server.url + "/metrics")
        assert sample(parse_metrics(body.decode()), "verl_host_load_average", period="1m") == 0.5
    finally:
        sidecar.stop()


@pytest.mark.integration
def test_a_collector_stuck_on_its_first_sample_delays_serving_only_a_bounded_time(monkeypatch):
    from verl_exporter.sidecar import sidecar as sidecar_module

    monkeypatch.setattr(sidecar_module, "FIRST_SAMPLE_WAIT_S", 0.3)
    hang = threading.Event()
    sidecar = _sidecar_with(lambda ctx: SlowFirst(ctx, delay=0.0, hang=hang))
    started = time.monotonic()
    sidecar.start()
    try:
        assert time.monotonic() - started < scaled(5)  # FIRST_SAMPLE_WAIT_S, not the hung sample's 60 s
        status, _, body = http_get(sidecar.server.url + "/metrics")
        assert status == 200 and b"verl_exporter_build_info" in body and b"verl_host_load_average" not in body
    finally:
        hang.set()
        sidecar.stop()


def test_a_sample_whose_value_is_not_a_number_is_counted_and_costs_only_itself():
    # Before, the value reached the renderer, which left the whole family out of /metrics without a count.
    ctx = make_context(None)

    class Odd(Collector):
        name = "host"

        def sample(self):
            return [("verl_host_load_average", {"period": "1m"}, "high"), ("verl_host_load_average", {"period": "5m"},
                                                                           0.5),
                    ("verl_host_memory_total_bytes", {}, 8)]

    sampler = Sampler([Odd(ctx)], ctx.spec, ctx.self_metrics)
    assert sampler.run_once(sampler.collectors[0])
    m = parse_metrics(sampler.render())
    assert sample(m, "verl_host_load_average", period="5m") == 0.5
    assert sample(m, "verl_host_load_average", period="1m") is None
    assert sample(m, "verl_host_memory_total_bytes") == 8
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="host") == 1
