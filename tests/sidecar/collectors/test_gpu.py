"""The gpu collector and the shared NVML layer, on the fake pynvml: GPU selection, values and units,
NotSupported fields, lost GPUs, a missing driver, and a real sidecar serving it all to promtool."""

from __future__ import annotations

import ctypes.util
import dataclasses
import os
import subprocess

import pytest
from conftest import free_port, http_get, parse_metrics, require_tool, sample, wait_for
from fake_pynvml import (
    NVML_AGGREGATE_ECC,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_MEMORY_ERROR_TYPE_CORRECTED,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_VOLATILE_ECC,
    FakeGpu,
    FakeNvml,
    make_context,
    series_of,
    value,
)
from helpers import scaled
from verl_exporter.sidecar.collectors import REGISTRY, Unavailable
from verl_exporter.sidecar.collectors.gpu import FAST_FIELDS, GpuCollector
from verl_exporter.sidecar.collectors.gpu_processes import GpuProcessesCollector
from verl_exporter.sidecar.collectors.nvlink import NvlinkCollector
from verl_exporter.sidecar.collectors.nvml import GpuSelectionError
from verl_exporter.sidecar.collectors.sampler import Sampler
from verl_exporter.sidecar.collectors.xid import XidCollector


@pytest.fixture
def quick_xid(monkeypatch):
    """The XID thread waits 50 ms at a time instead of 500, so that closing it is quick."""
    from verl_exporter.sidecar.collectors import xid

    monkeypatch.setattr(xid, "WAIT_MS", 50)


def selected(fake: FakeNvml, **ctx) -> list[int]:
    """NVML indices the gpu collector picks for this context."""
    c = GpuCollector(make_context(fake, **ctx))
    try:
        return [st.gpu.index for st in c._states]
    finally:
        c.close()


def shuffled_node() -> FakeNvml:
    """4 GPUs whose NVML order is not their PCI bus order: PCI order is NVML 2, 0, 3, 1."""
    buses = {0: 0x41, 1: 0xC1, 2: 0x01, 3: 0x81}
    return FakeNvml([FakeGpu(uuid=f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}",
                             pci_bus_id=f"00000000:{buses[i]:02X}:00.0") for i in range(4)])


# ------------------------------------------------------------------------------------------- selection
def test_all_and_explicit_lists_of_indices_and_uuids():
    fake = shuffled_node()
    assert selected(fake, gpus="all") == [0, 1, 2, 3]
    assert selected(fake, gpus="3,1") == [3, 1]  # NVML indices, in the order given
    assert selected(fake, gpus="GPU-2222aaaa-0000-0000-0000-000000000002,0") == [2, 0]
    assert selected(fake, gpus="GPU-3333") == [3]  # a unique UUID prefix, as CUDA accepts


def test_a_gpu_that_is_not_here_is_a_clear_error():
    fake = shuffled_node()
    with pytest.raises(GpuSelectionError, match=r"UUID GPU-deadbeef is not here .*0=GPU-0000aaaa"):
        selected(fake, gpus="GPU-deadbeef")
    with pytest.raises(GpuSelectionError, match="NVML index 7 is not here"):
        selected(fake, gpus="0,7")
    assert fake.refcount == 0  # the failed collector released NVML


def test_auto_without_cuda_visible_devices_takes_the_local_rank_in_pci_order():
    fake = shuffled_node()
    assert selected(fake, gpus="auto") == [0, 1, 2, 3]  # no local rank: every GPU
    assert [selected(fake, gpus="auto", local_rank=r) for r in range(4)] == [[2], [0], [3], [1]]
    with pytest.raises(GpuSelectionError, match="local rank 4 but only 4"):
        selected(fake, gpus="auto", local_rank=4)


def test_auto_reads_cuda_visible_devices_as_pci_ordered_ordinals_and_uuids():
    fake = shuffled_node()
    env = {"CUDA_VISIBLE_DEVICES": "1,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert selected(fake, gpus="auto", environ=env) == [0, 3]  # CUDA ordinals 1, 2 = PCI positions 1, 2
    assert selected(fake, gpus="auto", environ=env, local_rank=1) == [3]
    by_uuid = {"CUDA_VISIBLE_DEVICES": "GPU-1111aaaa-0000-0000-0000-000000000001,GPU-0000"}
    assert selected(fake, gpus="auto", environ=by_uuid, local_rank=0) == [1]
    assert selected(fake, gpus="auto", environ=by_uuid, local_rank=1) == [0]
    # Ray shows each worker only its own GPU, while LOCAL_RANK may be anything
    assert selected(fake, gpus="auto", environ={"CUDA_VISIBLE_DEVICES": "3"}, local_rank=5) == [1]


def test_cuda_visible_devices_ends_at_the_first_invalid_entry_like_cuda():
    fake = shuffled_node()
    assert selected(fake, gpus="auto", environ={"CUDA_VISIBLE_DEVICES": "0,9,1"}) == [2]
    with pytest.raises(Unavailable, match="leaves no GPU visible"):
        selected(fake, gpus="auto", environ={"CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(Unavailable, match="leaves no GPU visible"):
        selected(fake, gpus="auto", environ={"CUDA_VISIBLE_DEVICES": "-1"})
    with pytest.raises(GpuSelectionError, match="names 2 GPU"):
        selected(fake, gpus="auto", environ={"CUDA_VISIBLE_DEVICES": "0,1"}, local_rank=2)


def test_mig_devices_in_cuda_visible_devices_resolve_to_their_gpu():
    fake = shuffled_node()
    fake.gpu(3).mig_uuids = ["MIG-7a1b2c3d-0000-1111-2222-333344445555"]
    new_style = {"CUDA_VISIBLE_DEVICES": "MIG-7a1b2c3d-0000-1111-2222-333344445555"}
    assert selected(fake, gpus="auto", environ=new_style) == [3]
    old_style = {"CUDA_VISIBLE_DEVICES": "MIG-GPU-1111aaaa-0000-0000-0000-000000000001/1/0"}
    assert selected(fake, gpus="auto", environ=old_style) == [1]


# ------------------------------------------------------------------------------------------- values
def test_values_and_units():
    fake = FakeNvml(2)
    g = fake.gpu(1)
    g.util_gpu, g.util_mem = 87, 40
    g.mem_total, g.mem_used, g.mem_reserved = 80 << 30, 60 << 30, 1 << 29
    g.power_mw, g.power_limit_mw, g.temperature = 612_345, 700_000, 71
    g.clocks_mhz = {1: 1980, 2: 2619}
    g.clock_reasons = 0x4 | 0x40  # sw power cap + hw thermal slowdown
    g.ecc = {(NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC): 3,
             (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC): 1}
    g.remapped_rows = (2, 1, 1, 0)
    g.pcie_replay = 17
    g.energy_mj = 123_456_789
    g.pcie_kbs = {0: 1000, 1: 2}
    c = GpuCollector(make_context(fake, gpu_pcie_throughput=True))
    c.sample_slow()
    s = c.sample()
    assert value(s, "verl_gpu_utilization_ratio", gpu=1) == 0.87
    assert value(s, "verl_gpu_memory_utilization_ratio", gpu=1) == 0.40
    assert value(s, "verl_gpu_memory_used_bytes", gpu=1) == 60 << 30  # v2: without the reserved part
    assert value(s, "verl_gpu_memory_total_bytes", gpu=1) == 80 << 30
    assert value(s, "verl_gpu_memory_reserved_bytes", gpu=1) == 1 << 29
    assert value(s, "verl_gpu_power_watts", gpu=1) == pytest.approx(612.345)
    assert value(s, "verl_gpu_power_limit_watts", gpu=1) == 700.0
    assert value(s, "verl_gpu_temperature_celsius", gpu=1) == 71
    assert value(s, "verl_gpu_clock_hertz", gpu=1, clock="sm") == 1980e6
    assert value(s, "verl_gpu_clock_hertz", gpu=1, clock="memory") == 2619e6
    active = {labels["reason"] for name, labels, v in s
              if name == "verl_gpu_clock_event_active" and labels["gpu"] == "1" and v == 1}
    assert active == {"sw_power_cap", "hw_thermal_slowdown"}
    assert sum(1 for name, labels, _ in s if name == "verl_gpu_clock_event_active" and labels["gpu"] == "1") == 9
    assert value(s, "verl_gpu_ecc_errors_total", gpu=1, error="corrected", counter="volatile") == 3
    assert value(s, "verl_gpu_ecc_errors_total", gpu=1, error="uncorrected", counter="aggregate") == 1
    assert value(s, "verl_gpu_ecc_errors_total", gpu=1, error="uncorrected", counter="volatile") == 0
    assert value(s, "verl_gpu_remapped_rows", gpu=1, cause="correctable") == 2
    assert value(s, "verl_gpu_remapped_rows", gpu=1, cause="uncorrectable") == 1
    assert value(s, "verl_gpu_row_remap_pending", gpu=1) == 1
    assert value(s, "verl_gpu_row_remap_failed", gpu=1) == 0
    assert value(s, "verl_gpu_pcie_replays_total", gpu=1) == 17
    assert value(s, "verl_gpu_energy_joules_total", gpu=1) == pytest.approx(123_456.789)
    assert value(s, "verl_gpu_pcie_throughput_bytes_per_second", gpu=1, direction="tx") == 1000 * 1024
    assert value(s, "verl_gpu_pcie_throughput_bytes_per_second", gpu=1, direction="rx") == 2 * 1024
    assert value(s, "verl_gpu_info", gpu=1, uuid=g.uuid, pci_bus_id=g.pci_bus_id, model="NVIDIA H200") == 1
    assert value(s, "verl_gpu_up", gpu=1) == 1
    c.close()


def test_costly_reads_stay_off_the_fast_path():
    fake = FakeNvml(1)
    c = GpuCollector(make_context(fake, gpu_pcie_throughput=False))
    for _ in range(3):
        c.sample()
    assert fake.count("nvmlDeviceGetTotalEnergyConsumption") == 0
    assert fake.count("nvmlDeviceGetFieldValues") == 0
    c.sample_slow()
    assert fake.count("nvmlDeviceGetTotalEnergyConsumption") == 1
    assert fake.count("nvmlDeviceGetPcieThroughput") == 0  # opt-in only
    assert "verl_gpu_pcie_throughput_bytes_per_second" not in series_of(c.sample(), 0)
    c.close()


# ------------------------------------------------------------------------------------------- NotSupported
def test_a_not_supported_field_is_absent_flagged_and_never_asked_again():
    fake = FakeNvml(2)
    fake.fail("nvmlDeviceGetPowerUsage", NVML_ERROR_NOT_SUPPORTED, gpu=1)
    fake.fail("nvmlDeviceGetTotalEccErrors", NVML_ERROR_NOT_SUPPORTED, gpu=1)
    c = GpuCollector(make_context(fake))
    for _ in range(4):
        s = c.sample()
    assert fake.count("nvmlDeviceGetPowerUsage", gpu=1) == 1
    assert fake.count("nvmlDeviceGetTotalEccErrors", gpu=1) == 2  # volatile and aggregate, once each
    assert fake.count("nvmlDeviceGetPowerUsage", gpu=0) == 4
    assert value(s, "verl_gpu_power_watts", gpu=1) is None
    assert "verl_gpu_ecc_errors_total" not in series_of(s, 1)
    assert value(s, "verl_gpu_power_watts", gpu=0) is not None
    assert value(s, "verl_gpu_field_supported", gpu=1, field="power") == 0
    assert value(s, "verl_gpu_field_supported", gpu=1, field="ecc_volatile") == 0
    assert value(s, "verl_gpu_field_supported", gpu=0, field="power") == 1
    assert {f for f in FAST_FIELDS if value(s, "verl_gpu_field_supported", gpu=1, field=f) == 0} == {
        "power", "ecc_volatile", "ecc_aggregate"}
    assert value(s, "verl_gpu_up", gpu=1) == 1  # NotSupported is not an error
    assert c.ctx.self_metrics.value("verl_exporter_source_errors_total", component="gpu") == 0
    c.close()


def test_memory_falls_back_to_v1_once_when_the_driver_lacks_v2():
    fake = FakeNvml(1)
    fake.gpu(0).mem_v2 = False
    c = GpuCollector(make_context(fake))
    s = c.sample()
    assert fake.count("nvmlDeviceGetMemoryInfo") == 2  # v2 refused, then v1
    s = c.sample()
    assert fake.count("nvmlDeviceGetMemoryInfo") == 3  # v1 only from then on
    g = fake.gpu(0)
    assert value(s, "verl_gpu_memory_used_bytes", gpu=0) == g.mem_used + g.mem_reserved  # v1's used
    assert value(s, "verl_gpu_memory_reserved_bytes", gpu=0) is None
    assert value(s, "verl_gpu_field_supported", gpu=0, field="memory_reserved") == 0
    assert value(s, "verl_gpu_field_supported", gpu=0, field="memory") == 1
    c.close()


def test_clock_reasons_fall_back_to_the_throttle_name_on_an_older_driver():
    fake = FakeNvml(1)
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.gpu(0).clock_reasons = 0x8
    c = GpuCollector(make_context(fake))
    c.sample()
    s = c.sample()
    assert fake.count("nvmlDeviceGetCurrentClocksEventReasons") == 1
    assert fake.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 2
    assert value(s, "verl_gpu_clock_event_active", gpu=0, reason="hw_slowdown") == 1
    assert value(s, "verl_gpu_field_supported", gpu=0, field="clock_events") == 1
    c.close()


def test_a_passing_error_skips_one_read_and_is_counted():
    fake = FakeNvml(1)
    fake.fail("nvmlDeviceGetTemperature", NVML_ERROR_TIMEOUT)
    c = GpuCollector(make_context(fake))
    s = c.sample()
    assert value(s, "verl_gpu_temperature_celsius", gpu=0) is None
    assert value(s, "verl_gpu_field_supported", gpu=0, field="temperature") == 1
    assert value(s, "verl_gpu_up", gpu=0) == 1
    assert c.ctx.self_metrics.value("verl_exporter_source_errors_total", component="gpu") == 1
    fake.clear_failures()
    assert value(c.sample(), "verl_gpu_temperature_celsius", gpu=0) == 33
    c.close()


# ------------------------------------------------------------------------------------------- lost GPU
def test_a_lost_gpu_is_down_alone_and_recovers_through_a_new_handle():
    fake = FakeNvml(2)
    c = GpuCollector(make_context(fake))
    c.sample_slow()
    assert value(c.sample(), "verl_gpu_energy_joules_total", gpu=0) is not None
    fake.lose(0)
    s = c.sample()  # never raises
    assert value(s, "verl_gpu_up", gpu=0) == 0
    assert series_of(s, 0) == {"verl_gpu_up", "verl_gpu_info"}  # nothing stale, the identity kept
    assert value(s, "verl_gpu_up", gpu=1) == 1 and value(s, "verl_gpu_power_watts", gpu=1) is not None
    c.sample_slow()
    assert series_of(c.sample(), 0) == {"verl_gpu_up", "verl_gpu_info"}
    lookups = fake.count("nvmlDeviceGetHandleByUUID", gpu=0)
    assert lookups >= 1  # retried on every sample

    fake.restore(0)  # handles taken before the loss stay dead: only a lookup by UUID brings it back
    s = c.sample()
    assert fake.count("nvmlDeviceGetHandleByUUID", gpu=0) == lookups + 1
    assert value(s, "verl_gpu_up", gpu=0) == 1
    assert value(s, "verl_gpu_power_watts", gpu=0) is not None
    assert value(s, "verl_gpu_energy_joules_total", gpu=0) is None  # until the next slow read
    c.sample_slow()
    assert value(c.sample(), "verl_gpu_energy_joules_total", gpu=0) is not None
    c.close()


# ------------------------------------------------------------------------------------------- NVML missing
@pytest.mark.parametrize(("code", "reason"), [
    (NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1\\) is not found"),
    (NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
])
def test_no_driver_means_unavailable_with_the_reason(code, reason):
    fake = FakeNvml(1)
    fake.init_error = code
    for cls in (GpuCollector, NvlinkCollector, XidCollector, GpuProcessesCollector):
        with pytest.raises(Unavailable, match=reason):
            cls(make_context(fake))


def test_a_missing_binding_means_unavailable():
    def loader():
        raise ImportError("No module named 'pynvml'")

    with pytest.raises(Unavailable, match="nvidia-ml-py"):
        GpuCollector(make_context(None, nvml_loader=loader))


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has an NVIDIA driver")
def test_the_real_binding_without_a_driver_is_unavailable():
    with pytest.raises(Unavailable, match="libnvidia-ml.so.1"):
        GpuCollector(make_context(None))


def test_nvml_is_initialised_once_and_shut_down_with_the_last_collector(quick_xid):
    fake = FakeNvml(2, nvlink_links=2)
    ctx = make_context(fake)
    collectors = [cls(ctx) for cls in (GpuCollector, NvlinkCollector, XidCollector, GpuProcessesCollector)]
    assert (fake.init_calls, fake.refcount) == (1, 1)
    for c in collectors[:-1]:
        c.close()
    assert fake.shutdown_calls == 0
    collectors[-1].close()
    assert (fake.shutdown_calls, fake.refcount) == (1, 0)


# ------------------------------------------------------------------------------------------- end to end
def test_eight_gpus_fit_the_spec_without_dropped_series():
    fake = FakeNvml(8, nvlink_links=18)
    ctx = make_context(fake, gpu_pcie_throughput=True)
    collectors = [GpuCollector(ctx), NvlinkCollector(ctx), GpuProcessesCollector(ctx)]
    sampler = Sampler(collectors, ctx.spec, ctx.self_metrics)
    try:
        assert all(sampler.run_once(c) for c in collectors)
        assert all(sampler.run_once(c, slow=False) for c in collectors)
        series = {metric.name: rows for metric, rows in sampler.series()}
        assert len(series["verl_gpu_clock_event_active"]) == 8 * 9
        assert len(series["verl_gpu_field_supported"]) == 8 * 15
        assert len(series["verl_gpu_nvlink_errors_total"]) == 8 * 4  # summed over links, per type
        assert len(series["verl_gpu_nvlink_link_up"]) == 8 * 18
    finally:
        sampler.stop()
    assert ctx.self_metrics.value("verl_exporter_series_dropped_total", reason="series_cap") == 0
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="gpu") == 0


@pytest.mark.integration
def test_a_sidecar_serves_the_gpu_series_over_http_and_promtool_accepts_them(monkeypatch, quick_xid):
    from verl_exporter.sidecar.config import ServeConfig
    from verl_exporter.sidecar.sidecar import Sidecar

    fake = FakeNvml(2, nvlink_links=4)
    fake.gpu(0).processes = [(os.getpid(), 3 << 30)]
    original = Sidecar.context
    monkeypatch.setattr(Sidecar, "context",
                        lambda self: dataclasses.replace(original(self), nvml_loader=lambda: fake))
    mine = {"gpu", "nvlink", "xid", "gpu_processes"}
    config = ServeConfig(listen=f"127.0.0.1:{free_port()}", run="e2e", rank=0, gpus="all", interval=0.1,
                         trainer_pid=os.getpid(), gpu_pcie_throughput=True,
                         collectors={name: name in mine for name in REGISTRY})
    sidecar = Sidecar(config).start()
    try:
        fake.inject_xid(1, 79)
        wanted = [("verl_gpu_up", {"gpu": "0"}), ("verl_gpu_power_watts", {"gpu": "1"}),
                  ("verl_gpu_energy_joules_total", {"gpu": "0"}),
                  ("verl_gpu_nvlink_link_up", {"gpu": "1", "link": "3"}),
                  ("verl_gpu_xid_errors_total", {"gpu": "1", "xid": "79"}),
                  ("verl_gpu_process_memory_bytes", {"gpu": "0", "role": "trainer"})]

        def scrape():
            status, _, body = http_get(sidecar.server.url + "/metrics")
            m = parse_metrics(body.decode()) if status == 200 else {}
            return body.decode() if all(sample(m, name, **labels) is not None for name, labels in wanted) else None

        text = wait_for(scrape, timeout=10)
    finally:
        sidecar.stop()
    m = parse_metrics(text)
    uuid = fake.gpu(0).uuid
    assert sample(m, "verl_gpu_info", gpu=0, uuid=uuid, pci_bus_id="00000000:18:00.0", model="NVIDIA H200") == 1
    assert sample(m, "verl_gpu_process_memory_bytes", gpu=0, role="trainer", run="e2e", rank=0) == 3 << 30
    assert sample(m, "verl_gpu_xid_errors_total", gpu=1, xid=79) == 1
    assert fake.refcount == 0  # every collector closed its session
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=scaled(30))
    assert result.returncode == 0, result.stdout + result.stderr
