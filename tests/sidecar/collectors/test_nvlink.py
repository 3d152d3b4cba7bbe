"""The nvlink collector on the fake pynvml: absent NVLink, link states, per-link errors, data counters."""

from __future__ import annotations

from fake_pynvml import (
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_NVLINK_ERROR_DL_CRC_DATA,
    NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_NVLINK_ERROR_DL_RECOVERY,
    NVML_NVLINK_ERROR_DL_REPLAY,
    FakeNvml,
    make_context,
    series_of,
    value,
)
from verl_exporter.sidecar.collectors.nvlink import NvlinkCollector


def test_a_gpu_without_nvlink_has_exactly_the_supported_0_series_and_is_asked_once():
    fake = FakeNvml(1)  # like the single-GPU H200 VM: every NVLink call says NotSupported
    c = NvlinkCollector(make_context(fake))
    for _ in range(3):
        s = c.sample()
    assert s == [("verl_gpu_nvlink_supported", {"gpu": "0"}, 0.0)]
    assert fake.count("nvmlDeviceGetNvLinkState") == 1
    assert fake.count("nvmlDeviceGetFieldValues") == 0
    assert fake.count("nvmlDeviceGetNvLinkErrorCounter") == 0
    c.close()


def test_link_states_per_link_errors_per_type_and_data_bytes():
    fake = FakeNvml(2, nvlink_links=4)
    g = fake.gpu(1)
    g.nvlink_states[2] = 0
    g.nvlink_errors = {(1, NVML_NVLINK_ERROR_DL_CRC_FLIT): 5, (1, NVML_NVLINK_ERROR_DL_CRC_DATA): 6,
                       (3, NVML_NVLINK_ERROR_DL_REPLAY): 7, (0, NVML_NVLINK_ERROR_DL_RECOVERY): 8}
    g.nvlink_tx_kib = [100, 200, 0, 300]
    g.nvlink_rx_kib = [1, 2, 3, 4]
    c = NvlinkCollector(make_context(fake))
    s = c.sample()
    assert value(s, "verl_gpu_nvlink_supported", gpu=1) == 1
    assert [value(s, "verl_gpu_nvlink_link_up", gpu=1, link=k) for k in range(4)] == [1, 1, 0, 1]
    assert value(s, "verl_gpu_nvlink_links_down", gpu=1) == 1 and value(s, "verl_gpu_nvlink_links_down", gpu=0) == 0
    g.nvlink_errors[(2, NVML_NVLINK_ERROR_DL_REPLAY)] = 3
    s = c.sample()
    # summed over the links, one series per type: 4 per GPU whatever the number of links
    assert value(s, "verl_gpu_nvlink_errors_total", gpu=1, type="crc_flit") == 5
    assert value(s, "verl_gpu_nvlink_errors_total", gpu=1, type="crc_data") == 6
    assert value(s, "verl_gpu_nvlink_errors_total", gpu=1, type="replay") == 7 + 3
    assert value(s, "verl_gpu_nvlink_errors_total", gpu=1, type="recovery") == 8
    assert sum(1 for name, labels, _ in s if name == "verl_gpu_nvlink_errors_total" and labels["gpu"] == "1") == 4
    assert value(s, "verl_gpu_nvlink_data_bytes_total", gpu=1, direction="tx") == 600 * 1024
    assert value(s, "verl_gpu_nvlink_data_bytes_total", gpu=1, direction="rx") == 10 * 1024
    assert value(s, "verl_gpu_nvlink_data_bytes_total", gpu=0, direction="tx") == 0
    assert fake.count("nvmlDeviceGetFieldValues", gpu=1) == 2  # one batch per GPU and sample
    c.close()


def test_links_are_discovered_once_up_to_the_first_refused_link():
    fake = FakeNvml(1, nvlink_links=6)
    c = NvlinkCollector(make_context(fake))
    c.sample()
    assert fake.count("nvmlDeviceGetNvLinkState") == 7 + 6  # 6 links + the refused 7th, then one sample
    s = c.sample()
    assert fake.count("nvmlDeviceGetNvLinkState") == 13 + 6
    assert sorted(int(labels["link"]) for name, labels, _ in s if name == "verl_gpu_nvlink_link_up") == list(range(6))
    c.close()


def test_data_counters_fall_back_to_per_link_sums_when_all_links_scope_is_refused():
    fake = FakeNvml(1, nvlink_links=3)
    fake.nvlink_scope_all = False
    g = fake.gpu(0)
    g.nvlink_tx_kib, g.nvlink_rx_kib = [1, 2, 4], [8, 16, 32]
    c = NvlinkCollector(make_context(fake))
    s = c.sample()
    assert value(s, "verl_gpu_nvlink_data_bytes_total", gpu=0, direction="tx") == 7 * 1024
    assert value(s, "verl_gpu_nvlink_data_bytes_total", gpu=0, direction="rx") == 56 * 1024
    assert fake.count("nvmlDeviceGetFieldValues") == 2  # the refused all-links batch, then per link
    c.sample()
    assert fake.count("nvmlDeviceGetFieldValues") == 3  # per link from then on: one batch a sample
    c.close()


def test_an_error_counter_nvml_refuses_is_absent_and_not_asked_again():
    fake = FakeNvml(1, nvlink_links=2)
    fake.fail("nvmlDeviceGetNvLinkErrorCounter", NVML_ERROR_NOT_SUPPORTED)
    c = NvlinkCollector(make_context(fake))
    c.sample()
    s = c.sample()
    assert fake.count("nvmlDeviceGetNvLinkErrorCounter") == 2 * 4  # asked once per link and type
    assert "verl_gpu_nvlink_errors_total" not in series_of(s, 0)
    assert value(s, "verl_gpu_nvlink_link_up", gpu=0, link=1) == 1
    assert c.ctx.self_metrics.value("verl_exporter_source_errors_total", component="nvlink") == 0
    c.close()


def test_a_passing_failure_of_the_batch_is_counted_and_retried():
    fake = FakeNvml(1, nvlink_links=2)
    fake.fail("nvmlDeviceGetFieldValues", NVML_ERROR_TIMEOUT)
    c = NvlinkCollector(make_context(fake))
    s = c.sample()
    assert value(s, "verl_gpu_nvlink_data_bytes_total", gpu=0, direction="tx") is None
    assert c.ctx.self_metrics.value("verl_exporter_source_errors_total", component="nvlink") == 1
    fake.clear_failures()
    assert value(c.sample(), "verl_gpu_nvlink_data_bytes_total", gpu=0, direction="tx") == 0
    c.close()


def test_a_lost_gpu_has_no_nvlink_series_until_it_is_back():
    fake = FakeNvml(2, nvlink_links=2)
    c = NvlinkCollector(make_context(fake))
    c.sample()
    fake.lose(1)
    s = c.sample()
    assert series_of(s, 1) == set()
    assert value(s, "verl_gpu_nvlink_supported", gpu=0) == 1
    fake.restore(1)
    assert value(c.sample(), "verl_gpu_nvlink_link_up", gpu=1, link=1) == 1
    c.close()


def test_links_down_follows_the_link_states():
    # The alert reads this one series per GPU instead of a fleet's per-link series (18 per H200).
    fake = FakeNvml(1, nvlink_links=4)
    g = fake.gpu(0)
    g.nvlink_states[0] = 0
    g.nvlink_states[3] = 0
    c = NvlinkCollector(make_context(fake))
    assert value(c.sample(), "verl_gpu_nvlink_links_down", gpu=0) == 2
    g.nvlink_states = [1] * 4
    assert value(c.sample(), "verl_gpu_nvlink_links_down", gpu=0) == 0
