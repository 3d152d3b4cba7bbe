"""The fabric collector and its sysfs reader: InfiniBand and RoCE ports, a port going down, counters that
reset, half-missing and garbage files (never fatal, always counted)."""

from __future__ import annotations

import os

import pytest
from fabric_tree import IB_COUNTERS, ROCE_HW_COUNTERS, healthy_node, write_counters, write_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.sidecar.collectors.fabric import MAX_PORTS_PER_DEVICE, Port, Problem, read_ports


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
