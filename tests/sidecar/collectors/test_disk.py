"""The disk collector: node_exporter's counters from /proc/diskstats, skipped devices, resets, the real /proc."""

from __future__ import annotations

import time

import pytest
from helpers import FIXTURES, configure
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.collectors import Context
from verl_exporter.sidecar.collectors.disk import IGNORED_DEVICES, DiskCollector
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.spec import load_spec

T0, T1 = FIXTURES / "proc_t0", FIXTURES / "proc_t1"


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ctx():
    spec = load_spec()
    return Context(spec=spec, self_metrics=SelfMetrics(spec), config=ServeConfig(procfs=str(T0)), clock=FakeClock())


def by_series(samples) -> dict[tuple, float]:
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in samples}


def get(samples, name, **labels):
    return by_series(samples).get((name, tuple(sorted(labels.items()))))


def devices(samples, name="verl_host_disk_bytes_total") -> set[str]:
    return {labels["device"] for n, labels, _ in samples if n == name}


def test_counters_from_the_first_sample(ctx):
    first = by_series(DiskCollector(ctx).sample())

    def v(name, **labels):
        return first[(name, tuple(sorted(labels.items())))]

    # nvme0n1 at t0: reads 1000 (80000 sectors, 2000 ms), writes 500 (40000 sectors, 3000 ms), io 4000 ms,
    # weighted 5000 ms. Counters in base units from the first sample on: no baseline to wait for.
    assert v("verl_host_disk_io_time_seconds_total", device="nvme0n1") == 4.0
    assert v("verl_host_disk_io_time_weighted_seconds_total", device="nvme0n1") == 5.0
    assert v("verl_host_disk_operations_completed_total", device="nvme0n1", op="read") == 1000
    assert v("verl_host_disk_operations_completed_total", device="nvme0n1", op="write") == 500
    assert v("verl_host_disk_operation_time_seconds_total", device="nvme0n1", op="read") == 2.0
    assert v("verl_host_disk_operation_time_seconds_total", device="nvme0n1", op="write") == 3.0
    assert v("verl_host_disk_bytes_total", device="nvme0n1", op="read") == 80000 * 512
    assert v("verl_host_disk_bytes_total", device="nvme0n1", op="write") == 40000 * 512
    assert {n for n, _ in first} == {
        "verl_host_disk_io_time_seconds_total", "verl_host_disk_io_time_weighted_seconds_total",
        "verl_host_disk_operations_completed_total", "verl_host_disk_operation_time_seconds_total",
        "verl_host_disk_bytes_total"}
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="disk") == 0


def test_partitions_and_pseudo_devices_are_skipped(ctx):
    first = list(DiskCollector(ctx).sample())
    # loop0, loop1, ram0, sr0, zram0 and the partitions nvme0n1p1, sda1, vda1, mmcblk0p1 are in the file too
    assert devices(first) == {"nvme0n1", "sda", "vda", "vdb", "dm-0", "mmcblk0"}


@pytest.mark.parametrize("name, ignored", [
    ("sda", False), ("sdaa", False), ("sda1", True), ("sdaa12", True), ("xvda", False), ("xvda1", True),
    ("hdb2", True), ("nvme0n1", False), ("nvme10n2p3", True), ("mmcblk0", False), ("mmcblk0p1", True),
    ("dm-0", False), ("md127", False), ("loop7", True), ("ram15", True), ("zram0", True), ("sr0", True),
    ("fd0", True), ("nbd0", False),
])
def test_ignore_pattern(name, ignored):
    assert bool(IGNORED_DEVICES.match(name)) is ignored


def test_counters_are_exported_as_the_kernel_has_them_resets_included(ctx):
    c = DiskCollector(ctx)
    c.sample()
    configure(ctx, procfs=str(T1))
    second = list(c.sample())
    # dm-0 was re-created between t0 and t1: its counters restart, and are exported so (rate() takes the
    # drop for a reset, as for node_exporter's); a vanished device (vdb) is simply gone.
    assert get(second, "verl_host_disk_operations_completed_total", device="dm-0", op="read") == 12
    assert get(second, "verl_host_disk_bytes_total", device="dm-0", op="read") == 96 * 512
    assert "vdb" not in devices(second)
    # sda is hung: I/O in flight, nothing completes; its I/O time still grows.
    assert get(second, "verl_host_disk_io_time_seconds_total", device="sda") == 102.01
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="disk") == 0


def test_a_bad_line_loses_only_its_device(ctx, tmp_path):
    text = (T0 / "diskstats").read_text()
    (tmp_path / "diskstats").write_text(text + "   8      16 sdb 1 2 x 4 5 6 7 8 9 10 11\n   8      32 sdc 1 2\n")
    configure(ctx, procfs=str(tmp_path))
    first = list(DiskCollector(ctx).sample())
    assert devices(first) == {"nvme0n1", "sda", "vda", "vdb", "dm-0", "mmcblk0"}
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="disk") == 2


def test_linux_5_4_format_with_15_columns(ctx):
    configure(ctx, procfs=str(FIXTURES / "proc_old"))
    first = by_series(DiskCollector(ctx).sample())
    # sda 4100 250 329000 5200 900 120 88000 1400 0 6000 6600
    assert first == {
        ("verl_host_disk_io_time_seconds_total", (("device", "sda"),)): 6.0,
        ("verl_host_disk_io_time_weighted_seconds_total", (("device", "sda"),)): 6.6,
        ("verl_host_disk_operations_completed_total", (("device", "sda"), ("op", "read"))): 4100,
        ("verl_host_disk_operations_completed_total", (("device", "sda"), ("op", "write"))): 900,
        ("verl_host_disk_operation_time_seconds_total", (("device", "sda"), ("op", "read"))): 5.2,
        ("verl_host_disk_operation_time_seconds_total", (("device", "sda"), ("op", "write"))): 1.4,
        ("verl_host_disk_bytes_total", (("device", "sda"), ("op", "read"))): 329000 * 512,
        ("verl_host_disk_bytes_total", (("device", "sda"), ("op", "write"))): 88000 * 512,
    }


def test_real_proc_values_are_sane():
    spec = load_spec()
    ctx = Context(spec=spec, self_metrics=SelfMetrics(spec))
    c = DiskCollector(ctx)
    first = by_series(c.sample())
    time.sleep(0.2)
    second = by_series(c.sample())
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="disk") == 0
    for (name, labels), value in second.items():
        assert not IGNORED_DEVICES.match(dict(labels)["device"])
        assert value >= 0, (name, labels, value)
        if (name, labels) in first:  # a device that was there before: its counters did not go back
            assert value >= first[(name, labels)], (name, labels)
