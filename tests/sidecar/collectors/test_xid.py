"""The xid collector on the fake pynvml: counts per GPU and code from the event thread, timestamps, close()."""

from __future__ import annotations

import time

import pytest
from conftest import wait_for
from fake_pynvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, FakeNvml, make_context, value
from helpers import scaled
from verl_exporter.sidecar.collectors import Unavailable
from verl_exporter.sidecar.collectors import xid as xid_module
from verl_exporter.sidecar.collectors.xid import XidCollector


@pytest.fixture(autouse=True)
def quick_wait(monkeypatch):
    monkeypatch.setattr(xid_module, "WAIT_MS", 50)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def counted(c: XidCollector, total: float):
    """Poll until the thread has counted ``total`` XIDs in all; the samples then."""
    def done():
        s = c.sample()
        return s if sum(v for name, _, v in s if name == "verl_gpu_xid_errors_total") >= total else None

    return wait_for(done, timeout=5, interval=0.01)


def test_xids_are_counted_per_gpu_and_code_and_a_repeat_counts_again():
    fake = FakeNvml(2)
    clock = Clock()
    c = XidCollector(make_context(fake, clock=clock))
    try:
        assert c.sample() == []
        fake.inject_xid(1, 79)
        counted(c, 1)
        clock.now += 60
        fake.inject_xid(1, 79)
        fake.inject_xid(0, 13)
        s = counted(c, 3)
        assert value(s, "verl_gpu_xid_errors_total", gpu=1, xid=79) == 2
        assert value(s, "verl_gpu_xid_errors_total", gpu=0, xid=13) == 1
        assert value(s, "verl_gpu_xid_errors_total", gpu=0, xid=79) is None
        assert value(s, "verl_gpu_last_xid_timestamp_seconds", gpu=1) == clock.now
        assert value(s, "verl_gpu_last_xid_timestamp_seconds", gpu=0) == clock.now
    finally:
        c.close()


def test_waiting_without_events_is_not_an_error():
    fake = FakeNvml(1)
    c = XidCollector(make_context(fake))
    try:
        wait_for(lambda: fake.count("nvmlEventSetWait_v2") >= 3, timeout=5, interval=0.01)  # 3 timeouts
        assert c.sample() == []
        assert c.ctx.self_metrics.value("verl_exporter_source_errors_total", component="xid") == 0
    finally:
        c.close()


def test_a_gpu_without_xid_events_is_skipped_quietly():
    fake = FakeNvml(2)
    fake.gpu(0).xid_supported = False
    c = XidCollector(make_context(fake))
    try:
        fake.inject_xid(0, 31)  # nobody listens on GPU 0
        fake.inject_xid(1, 31)
        s = counted(c, 1)
        assert value(s, "verl_gpu_xid_errors_total", gpu=1, xid=31) == 1
        assert value(s, "verl_gpu_xid_errors_total", gpu=0, xid=31) is None
        assert c.ctx.self_metrics.value("verl_exporter_source_errors_total", component="xid") == 0
    finally:
        c.close()


def test_no_gpu_with_xid_events_means_unavailable_and_nothing_held():
    fake = FakeNvml(2)
    fake.fail("nvmlDeviceRegisterEvents", NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(Unavailable, match="XID events"):
        XidCollector(make_context(fake))
    assert all(s.freed for s in fake.event_sets)
    assert fake.refcount == 0


def test_an_event_of_a_gpu_that_no_longer_answers_still_counts_on_a_single_gpu_rank():
    fake = FakeNvml(1)
    c = XidCollector(make_context(fake))
    try:
        fake.fail("nvmlDeviceGetUUID", NVML_ERROR_GPU_IS_LOST)  # XID 79: fallen off the bus
        fake.inject_xid(0, 79)
        assert value(counted(c, 1), "verl_gpu_xid_errors_total", gpu=0, xid=79) == 1
    finally:
        c.close()


def test_the_event_device_is_mapped_to_its_gpu_by_uuid():
    fake = FakeNvml(4)
    c = XidCollector(make_context(fake, gpus="3,1"))
    try:
        fake.inject_xid(3, 48)
        fake.inject_xid(1, 94)
        s = counted(c, 2)
        assert value(s, "verl_gpu_xid_errors_total", gpu=3, xid=48) == 1
        assert value(s, "verl_gpu_xid_errors_total", gpu=1, xid=94) == 1
    finally:
        c.close()


def test_close_stops_the_thread_promptly_and_frees_the_set():
    fake = FakeNvml(1)
    c = XidCollector(make_context(fake))
    thread = c._thread
    assert thread.is_alive()
    started = time.monotonic()
    c.close()
    assert time.monotonic() - started < scaled(3.0)  # the event wait times out every 0.5 s; a hang would not
    assert not thread.is_alive()
    assert fake.event_sets[0].freed and fake.refcount == 0
    c.close()  # twice is harmless
    assert fake.shutdown_calls == 1
