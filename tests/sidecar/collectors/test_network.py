"""The network collector: per-interface counters from /proc/net/dev, virtual interfaces skipped, the cap."""

from __future__ import annotations

import pytest
from helpers import FIXTURES, configure
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.collectors import Context
from verl_exporter.sidecar.collectors.network import MAX_INTERFACES, VIRTUAL_INTERFACES, NetworkCollector
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.spec import load_spec

HEADER = (FIXTURES / "proc_t0" / "net" / "dev").read_text().splitlines(keepends=True)[:2]


@pytest.fixture
def ctx():
    spec = load_spec()
    return Context(spec=spec, self_metrics=SelfMetrics(spec), config=ServeConfig(procfs=str(FIXTURES / "proc_t0")))


def by_series(samples) -> dict[tuple, float]:
    return {(name.removeprefix("verl_host_network_"), labels["interface"], labels["direction"]): value
            for name, labels, value in samples}


def interfaces(samples) -> list[str]:
    return list(dict.fromkeys(labels["interface"] for _, labels, _ in samples))


def write_dev(tmp_path, lines: list[str]) -> str:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "dev").write_text("".join(HEADER + lines))
    return str(tmp_path)


def test_counters_per_interface_and_direction(ctx):
    got = by_series(NetworkCollector(ctx).sample())
    assert got[("bytes_total", "eth0", "receive")] == 851732821
    assert got[("errors_total", "eth0", "receive")] == 3
    assert got[("drops_total", "eth0", "receive")] == 7
    assert got[("bytes_total", "eth0", "transmit")] == 1203938
    assert got[("errors_total", "eth0", "transmit")] == 1
    assert got[("drops_total", "eth0", "transmit")] == 2
    # a number wider than its column runs into the colon's space: 987654321012 received bytes on ib0
    assert got[("bytes_total", "ib0", "receive")] == 987654321012
    assert got[("bytes_total", "ib0", "transmit")] == 123456789012
    assert got[("drops_total", "ib0", "receive")] == 12
    assert len(got) == 3 * 3 * 2  # eth0, ib0, ifb0 x bytes, errors, drops x receive, transmit


def test_loopback_and_container_interfaces_are_skipped(ctx):
    # lo, docker0, veth1a2b3c4, cali4e2b8a9c1d7, flannel.1, cni0 and br-3f2a1b4c5d6e are in the file too
    assert interfaces(NetworkCollector(ctx).sample()) == ["eth0", "ib0", "ifb0"]


@pytest.mark.parametrize("name, virtual", [
    ("veth0a1b2c", True), ("cali123abc", True), ("flannel.1", True), ("cni0", True), ("docker0", True),
    ("br-0123456789ab", True), ("eth0", False), ("ens5f0np0", False), ("ib0", False), ("bond0", False),
    ("br0", False),  # a host bridge someone configured on purpose stays
])
def test_virtual_pattern(name, virtual):
    assert bool(VIRTUAL_INTERFACES.match(name)) is virtual


def test_at_most_32_interfaces_and_the_rest_counted(ctx, tmp_path):
    lines = [f"{'eth' + str(i):>6}: {i} 1 0 0 0 0 0 0 {i} 1 0 0 0 0 0 0\n" for i in range(40)]
    configure(ctx, procfs=write_dev(tmp_path, lines))
    got = NetworkCollector(ctx).sample()
    assert interfaces(got) == [f"eth{i}" for i in range(MAX_INTERFACES)]
    assert ctx.self_metrics.value("verl_exporter_series_dropped_total", reason="series_cap") == 40 - MAX_INTERFACES


def test_old_kernel_format_and_a_bad_line(ctx, tmp_path):
    configure(ctx, procfs=write_dev(tmp_path, [
        "  eth0:1234 10 1 2 0 0 0 0 5678 9 3 4 0 0 0 0\n",  # no space after the colon
        "  eth1: 1 2 3\n",  # truncated
        "garbage\n",
        "  eth2: 7 1 0 0 0 0 0 0 8 1 0 0 0 0 0 0\n",
    ]))
    got = by_series(NetworkCollector(ctx).sample())
    assert got[("bytes_total", "eth0", "receive")] == 1234
    assert got[("drops_total", "eth0", "transmit")] == 4
    assert got[("bytes_total", "eth2", "transmit")] == 8
    assert {i for _, i, _ in got} == {"eth0", "eth2"}
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="network") == 2


def test_real_proc():
    spec = load_spec()
    ctx = Context(spec=spec, self_metrics=SelfMetrics(spec))
    got = NetworkCollector(ctx).sample()
    assert "lo" not in interfaces(got)
    assert len(interfaces(got)) <= MAX_INTERFACES
    assert all(value >= 0 for _, _, value in got)
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="network") == 0
