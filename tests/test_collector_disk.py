"""The disk collector: ratios from two /proc/diskstats snapshots, skipped devices, resets, the real /proc."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from verl_exporter.collectors import Context
from verl_exporter.collectors.disk import IGNORED_DEVICES, DiskCollector
from verl_exporter.selfmetrics import SelfMetrics
from verl_exporter.spec import load_spec

FIXTURES = Path(__file__).parent / "fixtures"
T0, T1 = FIXTURES / "proc_t0", FIXTURES / "proc_t1"


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ctx():
    spec = load_spec()
    return Context(spec=spec, self_metrics=SelfMetrics(spec), procfs=str(T0), clock=FakeClock())


def by_series(samples) -> dict[tuple, float]:
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in samples}


def get(samples, name, **labels):
    return by_series(samples).get((name, tuple(sorted(labels.items()))))


def devices(samples, name="verl_host_disk_bytes_total") -> set[str]:
    return {labels["device"] for n, labels, _ in samples if n == name}


def two_snapshots(ctx):
    c = DiskCollector(ctx)
    first = list(c.sample())
    ctx.procfs, ctx.clock.now = str(T1), ctx.clock.now + 2.0  # 2000 ms of wall time
    return c, first, list(c.sample())


def test_first_sample_is_a_baseline_with_byte_counters_only(ctx):
    first = list(DiskCollector(ctx).sample())
    assert {n for n, _, _ in first} == {"verl_host_disk_bytes_total"}
    # nvme0n1 at t0: 80000 sectors read, 40000 written, 512 bytes each
    assert get(first, "verl_host_disk_bytes_total", device="nvme0n1", op="read") == 80000 * 512
    assert get(first, "verl_host_disk_bytes_total", device="nvme0n1", op="write") == 40000 * 512


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


def test_ratios_over_the_period(ctx):
    _, _, second = two_snapshots(ctx)
    s = by_series(second)

    def v(name, **labels):
        return s[(name, tuple(sorted(labels.items())))]

    # nvme0n1: io ms 4000 -> 5000 over 2000 ms wall: busy 0.5; weighted 5000 -> 8000: queue depth 1.5;
    # reads 1000 -> 1100 taking 2000 -> 2050 ms: 50 ms / 100 = 0.5 ms; writes 500 -> 540, 3000 -> 3400 ms: 10 ms.
    assert v("verl_host_disk_busy_ratio", device="nvme0n1") == pytest.approx(0.5)
    assert v("verl_host_disk_queue_depth", device="nvme0n1") == pytest.approx(1.5)
    assert v("verl_host_disk_await_seconds", device="nvme0n1", op="read") == pytest.approx(0.0005)
    assert v("verl_host_disk_await_seconds", device="nvme0n1", op="write") == pytest.approx(0.010)
    assert v("verl_host_disk_bytes_total", device="nvme0n1", op="read") == 88192 * 512
    assert v("verl_host_disk_bytes_total", device="nvme0n1", op="write") == 48192 * 512
    # sda is hung: io ms +2010 in 2000 ms (clock skew) caps at 1; weighted +64000 / 2000 = 32 in flight;
    # nothing completed, so await is 0 rather than absent.
    assert v("verl_host_disk_busy_ratio", device="sda") == 1.0
    assert v("verl_host_disk_queue_depth", device="sda") == pytest.approx(32.0)
    assert v("verl_host_disk_await_seconds", device="sda", op="read") == 0.0
    assert v("verl_host_disk_await_seconds", device="sda", op="write") == 0.0
    # vda: io +30 ms: 0.015; weighted +25: 0.0125; no reads: 0; writes +10 taking +25 ms: 2.5 ms.
    assert v("verl_host_disk_busy_ratio", device="vda") == pytest.approx(0.015)
    assert v("verl_host_disk_queue_depth", device="vda") == pytest.approx(0.0125)
    assert v("verl_host_disk_await_seconds", device="vda", op="read") == 0.0
    assert v("verl_host_disk_await_seconds", device="vda", op="write") == pytest.approx(0.0025)
    # mmcblk0 did nothing.
    assert v("verl_host_disk_busy_ratio", device="mmcblk0") == 0.0
    assert v("verl_host_disk_queue_depth", device="mmcblk0") == 0.0


def test_a_counter_reset_skips_that_device_for_one_period(ctx, tmp_path):
    c, _, second = two_snapshots(ctx)
    # dm-0 was re-created between t0 and t1: its columns went backwards. No ratios, but the new byte counter.
    assert "dm-0" not in devices(second, "verl_host_disk_busy_ratio")
    assert "dm-0" not in devices(second, "verl_host_disk_await_seconds")
    assert get(second, "verl_host_disk_bytes_total", device="dm-0", op="read") == 96 * 512
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="disk") == 0
    # One period later dm-0 is measured from its new baseline: io ms 4 -> 1004 over 2000 ms = 0.5.
    shutil.copytree(T1, tmp_path / "t2")
    stats = tmp_path / "t2" / "diskstats"
    stats.write_text(stats.read_text().replace(" dm-0 12 0 96 3 0 0 0 0 0 4 3 ", " dm-0 22 0 176 13 0 0 0 0 0 1004 3 "))
    ctx.procfs, ctx.clock.now = str(tmp_path / "t2"), ctx.clock.now + 2.0
    third = list(c.sample())
    assert get(third, "verl_host_disk_busy_ratio", device="dm-0") == pytest.approx(0.5)
    # reads 12 -> 22 taking 3 -> 13 ms: 1 ms each
    assert get(third, "verl_host_disk_await_seconds", device="dm-0", op="read") == pytest.approx(0.001)


def test_a_vanished_device_is_forgotten(ctx):
    c, first, second = two_snapshots(ctx)
    assert "vdb" in devices(first)
    assert "vdb" not in devices(second)
    assert set(c._previous) == devices(second)  # no state kept for a device that is gone


def test_a_clock_that_steps_back_skips_the_ratios(ctx):
    c = DiskCollector(ctx)
    c.sample()
    ctx.procfs, ctx.clock.now = str(T1), ctx.clock.now - 5.0
    second = list(c.sample())
    assert {n for n, _, _ in second} == {"verl_host_disk_bytes_total"}


def test_a_bad_line_loses_only_its_device(ctx, tmp_path):
    text = (T0 / "diskstats").read_text()
    (tmp_path / "diskstats").write_text(text + "   8      16 sdb 1 2 x 4 5 6 7 8 9 10 11\n   8      32 sdc 1 2\n")
    ctx.procfs = str(tmp_path)
    first = list(DiskCollector(ctx).sample())
    assert devices(first) == {"nvme0n1", "sda", "vda", "vdb", "dm-0", "mmcblk0"}
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="disk") == 2


def test_linux_5_4_format_with_15_columns(ctx):
    ctx.procfs = str(FIXTURES / "proc_old")
    first = list(DiskCollector(ctx).sample())
    assert by_series(first) == {
        ("verl_host_disk_bytes_total", (("device", "sda"), ("op", "read"))): 329000 * 512,
        ("verl_host_disk_bytes_total", (("device", "sda"), ("op", "write"))): 88000 * 512,
    }


def test_real_proc_values_are_sane():
    spec = load_spec()
    ctx = Context(spec=spec, self_metrics=SelfMetrics(spec))
    c = DiskCollector(ctx)
    first = list(c.sample())
    time.sleep(0.2)
    second = list(c.sample())
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="disk") == 0
    for name, labels, value in first + second:
        assert not IGNORED_DEVICES.match(labels["device"])
        assert value >= 0, (name, labels, value)
        if name == "verl_host_disk_busy_ratio":
            assert value <= 1.0
    assert devices(second, "verl_host_disk_busy_ratio") == devices(second)
