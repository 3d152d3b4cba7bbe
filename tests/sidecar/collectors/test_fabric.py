"""The fabric collector and its sysfs reader: InfiniBand and RoCE ports, a port going down, counters that
reset, half-missing and garbage files (never fatal, always counted)."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import parse_metrics, sample
from fabric_tree import IB_COUNTERS, ROCE_HW_COUNTERS, healthy_node, write_counters, write_port
from helpers import configure
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.collectors import Context, Unavailable
from verl_exporter.sidecar.collectors.fabric import (
    ERROR_COUNTERS,
    HW_EVENTS,
    MAX_PORTS_PER_DEVICE,
    FabricCollector,
    Port,
    Problem,
    port_samples,
    read_ports,
)
from verl_exporter.sidecar.collectors.sampler import Sampler
from verl_exporter.spec import load_spec

SPEC = load_spec()


def test_reads_ib_and_roce_ports(tmp_path):
    healthy_node(tmp_path)
    ib, roce1, roce2 = read_ports(tmp_path)
    assert (ib.device, ib.port, roce1.device, roce1.port, roce2.port) == ("mlx5_0", 1, "mlx5_1", 1, 2)
    assert (ib.state, ib.state_code, ib.phys_state, ib.phys_state_code) == ("ACTIVE", 4, "LinkUp", 5)
    assert ib.active and ib.link_up
    assert ib.rate_bits_per_second == 400e9
    assert (ib.link_layer, roce1.link_layer) == ("InfiniBand", "Ethernet")
    assert roce1.rate_bits_per_second == 100e9
    # port_*_data count 4-octet words: the reader returns bytes
    assert ib.counters["port_rcv_data"] == 4 * IB_COUNTERS["port_rcv_data"]
    assert ib.counters["port_xmit_data"] == 4 * IB_COUNTERS["port_xmit_data"]
    assert ib.counters["port_rcv_packets"] == IB_COUNTERS["port_rcv_packets"]
    assert ib.counters["port_xmit_wait"] == 1200
    assert ib.hw_counters == {}
    assert roce1.hw_counters == ROCE_HW_COUNTERS
    assert [p.problems for p in (ib, roce1, roce2)] == [[], [], []]


def test_no_rdma_driver_is_no_ports(tmp_path):
    assert read_ports(tmp_path) == []
    assert read_ports(tmp_path / "absent") == []


def test_a_port_going_down(tmp_path):
    directory = write_port(tmp_path)
    (directory / "state").write_text("1: DOWN\n")
    (directory / "phys_state").write_text("3: Disabled\n")
    (directory / "rate").write_text("10 Gb/sec (4X)\n")  # what a down port reports: the lowest rate
    (port,) = read_ports(tmp_path)
    assert (port.state, port.state_code, port.phys_state, port.phys_state_code) == ("DOWN", 1, "Disabled", 3)
    assert not port.active and not port.link_up
    assert port.rate_bits_per_second == 10e9
    assert port.problems == []


def test_rates_of_every_generation(tmp_path):
    for port, text in enumerate(("2.5 Gb/sec (1X SDR)", "56 Gb/sec (4X FDR)", "14.0625 Gb/sec (1X FDR)",
                                 "800 Gb/sec (8X XDR)", "25 Gb/sec"), start=1):
        write_port(tmp_path, port=port, rate=text)
    assert [p.rate_bits_per_second for p in read_ports(tmp_path)] == [2.5e9, 56e9, 14.0625e9, 800e9, 25e9]


def test_half_missing_files_are_problems_and_the_rest_is_kept(tmp_path):
    directory = write_port(tmp_path, state=None, rate=None, counters={"symbol_error": 3, "link_downed": "x1"})
    (port,) = read_ports(tmp_path)
    assert port.state is None and port.state_code is None and port.rate_bits_per_second is None
    assert port.phys_state == "LinkUp" and port.link_layer == "InfiniBand"
    assert port.counters == {"symbol_error": 3}
    assert {p.file for p in port.problems} == {"state", "rate", "counters/link_downed"}
    (directory / "counters" / "symbol_error").unlink()
    (directory / "counters" / "link_downed").unlink()
    (directory / "counters").rmdir()
    (port,) = read_ports(tmp_path)
    assert port.counters == {} and "counters" in {p.file for p in port.problems}


def test_no_pma_is_an_absent_counter_not_a_problem(tmp_path):
    write_port(tmp_path, device="rxe0", counters={"symbol_error": "N/A (no PMA)", "port_rcv_packets": 7})
    (port,) = read_ports(tmp_path)
    assert port.counters == {"port_rcv_packets": 7}
    assert port.problems == []


@pytest.mark.parametrize("text", ["-1", "1e3", "0x10", "12 34", "", "18446744073709551616", "٣", "1.5",
                                  "a" * 300])
def test_non_counters_are_problems(tmp_path, text):
    write_port(tmp_path, counters={"symbol_error": text, "link_downed": 2})
    (port,) = read_ports(tmp_path)
    assert port.counters == {"link_downed": 2}
    assert [p.file for p in port.problems] == ["counters/symbol_error"]


def test_largest_counter_is_read(tmp_path):
    write_port(tmp_path, counters={"port_xmit_wait": 2**64 - 1})
    (port,) = read_ports(tmp_path)
    assert port.counters == {"port_xmit_wait": 2**64 - 1}


@pytest.mark.parametrize("file, text", [("state", "ACTIVE"), ("state", "4"), ("phys_state", "LinkUp: 5"),
                                        ("rate", "fast"), ("rate", "Gb/sec"), ("link_layer", "Infini Band")])
def test_garbage_in_a_port_file_is_a_problem(tmp_path, file, text):
    directory = write_port(tmp_path)
    (directory / file).write_text(text)
    (port,) = read_ports(tmp_path)
    assert [p.file for p in port.problems] == [file]
    assert port.counters["port_rcv_packets"] == IB_COUNTERS["port_rcv_packets"]


def test_unreadable_file_is_a_problem(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    directory = write_port(tmp_path)
    (directory / "counters" / "symbol_error").chmod(0)
    (port,) = read_ports(tmp_path)
    assert port.problems == [Problem("counters/symbol_error", "Permission denied")]
    assert "symbol_error" not in port.counters


def test_a_directory_or_a_fifo_for_a_file_is_a_problem(tmp_path):
    directory = write_port(tmp_path)
    (directory / "state").unlink()
    (directory / "state").mkdir()
    (directory / "rate").unlink()
    os.mkfifo(directory / "rate")  # nothing writes to it: a blocking open would hang here
    (port,) = read_ports(tmp_path)
    assert [p.file for p in port.problems] == ["state", "rate"]
    assert port.phys_state == "LinkUp"


def test_odd_names_and_too_many_ports_are_left_out(tmp_path):
    for port in range(1, MAX_PORTS_PER_DEVICE + 3):
        write_port(tmp_path, port=port)
    write_port(tmp_path, device="bad device")
    (tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "x").mkdir()
    write_counters(tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1", "counters", {"odd name": 1})
    ports = read_ports(tmp_path)
    assert [(p.device, p.port) for p in ports] == [("mlx5_0", n) for n in range(1, MAX_PORTS_PER_DEVICE + 1)]
    assert "odd name" not in ports[0].counters


def test_counters_that_reset_are_read_as_they_are(tmp_path):
    # a driver reload restarts every counter from 0; a 32-bit counter wraps: both are resets to rate()
    directory = write_port(tmp_path, counters={"port_xmit_data": 2**32 - 1, "link_downed": 5})
    assert read_ports(tmp_path)[0].counters == {"port_xmit_data": 4 * (2**32 - 1), "link_downed": 5}
    write_counters(directory, "counters", {"port_xmit_data": 3, "link_downed": 0})
    assert read_ports(tmp_path)[0].counters == {"port_xmit_data": 12, "link_downed": 0}


_TEXT = st.one_of(st.binary(max_size=300), st.text(max_size=80).map(str.encode),
                  st.integers(min_value=-2, max_value=2**65).map(lambda n: f"{n}\n".encode()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.dictionaries(st.sampled_from(["state", "phys_state", "rate", "link_layer",
                                              "counters/symbol_error", "counters/port_rcv_data",
                                              "hw_counters/out_of_buffer"]), _TEXT, max_size=7))
def test_any_content_is_a_value_or_a_problem(tmp_path_factory, files):
    root = tmp_path_factory.mktemp("sys")
    directory = write_port(root, state=None, phys_state=None, rate=None, link_layer=None, counters={},
                           hw_counters={})
    for name, data in files.items():
        (directory / name).write_bytes(data)
    (port,) = read_ports(root)
    assert isinstance(port, Port)
    troubled = {p.file for p in port.problems}
    for name, attribute in (("state", "state"), ("phys_state", "phys_state"), ("rate", "rate_bits_per_second"),
                            ("link_layer", "link_layer")):  # a missing one is a problem too
        assert (getattr(port, attribute) is None) == (name in troubled)
    for name in ("counters/symbol_error", "counters/port_rcv_data", "hw_counters/out_of_buffer"):
        sub, counter = name.split("/")
        value = (port.counters if sub == "counters" else port.hw_counters).get(counter)
        if name in files:
            assert (value is None) == (name in troubled or files[name].strip() == b"N/A (no PMA)")
            assert value is None or 0 <= value < 4 * 2**64
        else:
            assert value is None and name not in troubled
    for metric, labels, number in port_samples(port):
        assert set(labels) == set(SPEC[metric].labels) and 0 <= number < 4 * 2**64


# ---------------------------------------------------------------------------------------------- the collector
def collector_ctx(root):
    spec = load_spec()
    ctx = Context(spec=spec, self_metrics=SelfMetrics(spec))
    configure(ctx, sysfs_root=str(root))
    return ctx


def errors(ctx) -> float:
    return ctx.self_metrics.value("verl_exporter_source_errors_total", component="fabric")


def by_series(samples) -> dict[tuple, float]:
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in samples}


def one(samples, name, **labels) -> float:
    return by_series(samples)[(name, tuple(sorted(labels.items())))]


def test_no_infiniband_class_is_unavailable(tmp_path):
    with pytest.raises(Unavailable, match="no RDMA driver"):
        FabricCollector(collector_ctx(tmp_path))


def test_exports_ib_and_roce_ports_in_base_units(tmp_path):
    ctx = collector_ctx(healthy_node(tmp_path))
    got = FabricCollector(ctx).sample()
    ib = {"device": "mlx5_0", "port": "1"}
    roce = {"device": "mlx5_1", "port": "2"}
    assert one(got, "verl_fabric_port_active", **ib) == 1 and one(got, "verl_fabric_port_link_up", **ib) == 1
    assert one(got, "verl_fabric_port_rate_bytes_per_second", **ib) == 400e9 / 8
    assert one(got, "verl_fabric_port_rate_bytes_per_second", **roce) == 100e9 / 8
    assert one(got, "verl_fabric_port_info", **ib, link_layer="InfiniBand") == 1
    assert one(got, "verl_fabric_port_info", **roce, link_layer="Ethernet") == 1
    assert one(got, "verl_fabric_port_data_bytes_total", **ib, direction="receive") == 4 * 250_000_000
    assert one(got, "verl_fabric_port_data_bytes_total", **ib, direction="transmit") == 4 * 260_000_000
    assert one(got, "verl_fabric_port_packets_total", **ib, direction="transmit") == 1_100_000
    assert one(got, "verl_fabric_port_transmit_wait_total", **ib) == 1200
    assert one(got, "verl_fabric_port_link_downed_total", **ib) == 0
    assert {labels["type"] for name, labels, _ in got if name == "verl_fabric_port_errors_total"} == \
        {kind for kind, _ in ERROR_COUNTERS}
    assert one(got, "verl_fabric_port_hw_events_total", **roce, counter="np_cnp_sent") == 10
    # hw_counters outside the allow-list (lifespan, rx_write_requests) stay out: the label stays bounded
    assert {labels["counter"] for name, labels, _ in got if name == "verl_fabric_port_hw_events_total"} <= \
        set(HW_EVENTS)
    assert not any(name == "verl_fabric_port_hw_events_total" and labels["device"] == "mlx5_0"
                   for name, labels, _ in got)
    assert errors(ctx) == 0


def test_every_exported_metric_is_declared_with_its_labels(tmp_path):
    spec = load_spec()
    got = FabricCollector(collector_ctx(healthy_node(tmp_path))).sample()
    for name, labels, _ in got:
        assert spec[name].collector == "fabric"
        assert set(labels) == set(spec[name].labels), name
    declared = {m.name for m in spec.metrics if m.collector == "fabric"}
    assert {name for name, _, _ in got} == declared


def test_the_spec_help_names_every_label_value():
    spec = load_spec()
    errors_help = spec["verl_fabric_port_errors_total"].help
    assert all(kind in errors_help for kind, _ in ERROR_COUNTERS)
    assert all(counter in spec["verl_fabric_port_hw_events_total"].help for counter in HW_EVENTS)


def test_port_going_down_then_counters_reset_on_driver_reload(tmp_path):
    directory = write_port(tmp_path, counters={**IB_COUNTERS, "link_downed": 2, "port_xmit_data": 2**32 - 1})
    ctx = collector_ctx(tmp_path)
    c = FabricCollector(ctx)
    labels = {"device": "mlx5_0", "port": "1"}
    assert one(c.sample(), "verl_fabric_port_active", **labels) == 1
    (directory / "state").write_text("1: DOWN\n")
    (directory / "phys_state").write_text("2: Polling\n")
    got = c.sample()
    assert one(got, "verl_fabric_port_active", **labels) == 0
    assert one(got, "verl_fabric_port_link_up", **labels) == 0
    # the driver reloads: every counter restarts from 0; the collector exports what it reads (a reset to rate())
    write_counters(directory, "counters", {"link_downed": 0, "port_xmit_data": 1})
    got = c.sample()
    assert one(got, "verl_fabric_port_link_downed_total", **labels) == 0
    assert one(got, "verl_fabric_port_data_bytes_total", **labels, direction="transmit") == 4
    assert errors(ctx) == 0


def test_half_missing_and_garbage_files_are_counted_never_fatal(tmp_path):
    write_port(tmp_path, "mlx5_0", 1, state=None, rate="fast", counters={"symbol_error": "lots", "link_downed": 1})
    write_port(tmp_path, "mlx5_1", 1)
    ctx = collector_ctx(tmp_path)
    got = FabricCollector(ctx).sample()
    names = {name for name, labels, _ in got if labels["device"] == "mlx5_0"}
    assert "verl_fabric_port_active" not in names and "verl_fabric_port_rate_bytes_per_second" not in names
    assert "verl_fabric_port_link_up" in names and "verl_fabric_port_link_downed_total" in names
    assert "verl_fabric_port_errors_total" not in names
    assert errors(ctx) == 3  # state missing, rate garbage, symbol_error garbage
    assert one(got, "verl_fabric_port_active", device="mlx5_1", port="1") == 1


def test_the_tree_vanishing_after_start_is_no_series(tmp_path):
    ctx = collector_ctx(healthy_node(tmp_path))
    c = FabricCollector(ctx)
    shutil.rmtree(tmp_path / "class")
    assert c.sample() == []
    assert errors(ctx) == 0


def test_real_sysfs():
    spec = load_spec()
    ctx = Context(spec=spec, self_metrics=SelfMetrics(spec))
    try:
        c = FabricCollector(ctx)
    except Unavailable as e:
        pytest.skip(f"no RDMA device here: {e}")
    got = c.sample()
    assert all(value >= 0 for _, _, value in got)


def test_served_through_the_sampler_with_the_run_labels(tmp_path):
    ctx = collector_ctx(healthy_node(tmp_path))
    sampler = Sampler([FabricCollector(ctx)], ctx.spec, ctx.self_metrics, {"run": "r1", "rank": "0"})
    assert sampler.run_once(sampler.collectors[0])
    m = parse_metrics(sampler.render())
    assert sample(m, "verl_fabric_port_rate_bytes_per_second", device="mlx5_0", port="1", run="r1") == 5e10
    assert sample(m, "verl_fabric_port_data_bytes_total", device="mlx5_1", port="2", direction="transmit") == \
        4 * IB_COUNTERS["port_xmit_data"]
    assert sample(m, "verl_fabric_port_info", device="mlx5_1", port="1", link_layer="Ethernet") == 1
