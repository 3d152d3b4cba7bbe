"""Fake /sys/class/infiniband trees, laid out as the kernel's Documentation/ABI/stable/sysfs-class-infiniband
describes them: <root>/class/infiniband/<device>/ports/<n>/{state, phys_state, rate, link_layer, counters/,
hw_counters/}. Shared by the fabric collector's tests and the pre-flight's."""

from __future__ import annotations

from pathlib import Path

# A healthy ConnectX-7 port on InfiniBand (NDR) and a ConnectX-6 Dx port on RoCE, as their drivers show them.
IB_COUNTERS = {
    "symbol_error": 0, "link_downed": 0, "link_error_recovery": 0, "port_rcv_errors": 0,
    "port_rcv_remote_physical_errors": 0, "port_xmit_discards": 0, "port_xmit_constraint_errors": 0,
    "port_rcv_constraint_errors": 0, "local_link_integrity_errors": 0, "excessive_buffer_overrun_errors": 0,
    "VL15_dropped": 0, "port_xmit_wait": 1200, "port_rcv_data": 250_000_000, "port_xmit_data": 260_000_000,
    "port_rcv_packets": 1_000_000, "port_xmit_packets": 1_100_000, "unicast_rcv_packets": 999_000,
    "unicast_xmit_packets": 1_099_000, "multicast_rcv_packets": 1000, "multicast_xmit_packets": 1000,
}
ROCE_HW_COUNTERS = {
    "out_of_buffer": 0, "out_of_sequence": 0, "packet_seq_err": 0, "local_ack_timeout_err": 0,
    "np_cnp_sent": 10, "rp_cnp_handled": 12, "np_ecn_marked_roce_packets": 10, "rx_write_requests": 5000,
    "lifespan": 10,
}


def write_port(root: Path, device: str = "mlx5_0", port: int = 1, *, state: str | None = "4: ACTIVE",
               phys_state: str | None = "5: LinkUp", rate: str | None = "400 Gb/sec (4X NDR)",
               link_layer: str | None = "InfiniBand", counters: dict[str, object] | None = None,
               hw_counters: dict[str, object] | None = None) -> Path:
    """One port directory under root (a fake /sys); a None file is left out. Returns the port directory."""
    directory = Path(root) / "class" / "infiniband" / device / "ports" / str(port)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (("state", state), ("phys_state", phys_state), ("rate", rate), ("link_layer", link_layer)):
        if text is not None:
            (directory / name).write_text(f"{text}\n")
    write_counters(directory, "counters", IB_COUNTERS if counters is None else counters)
    if hw_counters is not None:
        write_counters(directory, "hw_counters", hw_counters)
    return directory


def write_counters(directory: Path, sub: str, values: dict[str, object]) -> None:
    (directory / sub).mkdir(exist_ok=True)
    for name, value in values.items():
        data = value if isinstance(value, bytes) else f"{value}\n".encode()
        (directory / sub / name).write_bytes(data)


def healthy_node(root: Path) -> Path:
    """An IB HCA with one port and a RoCE NIC with two, all up at their rates."""
    write_port(root, "mlx5_0", 1)
    for port in (1, 2):
        write_port(root, "mlx5_1", port, rate="100 Gb/sec (2X HDR)", link_layer="Ethernet",
                   hw_counters=ROCE_HW_COUNTERS)
    return Path(root)
