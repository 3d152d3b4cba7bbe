"""InfiniBand and RoCE ports from {sysfs}/class/infiniband/<device>/ports/<n>/ (the kernel's
Documentation/ABI/stable/sysfs-class-infiniband).

Each port directory holds:
  state        "4: ACTIVE"  (1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER)
  phys_state   "5: LinkUp"  (1 Sleep, 2 Polling, 3 Disabled, 4 PortConfigurationTraining, 5 LinkUp,
                             6 LinkErrorRecovery, 7 Phy Test)
  rate         "200 Gb/sec (4X HDR)", "2.5 Gb/sec (1X SDR)"; Gb here is 10^9 bits
  link_layer   "InfiniBand" or "Ethernet" (RoCE)
  counters/    the IBA PortCounters (symbol_error, link_downed, port_rcv_data, ...); a device without a
               performance agent answers "N/A (no PMA)", which is read as "this counter is absent"
  hw_counters/ driver counters (mlx5: out_of_buffer, np_cnp_sent, ...), present on some devices only

port_rcv_data and port_xmit_data (and their *_64 forms) count 4-octet words, "divided by 4 unconditionally"
in the ABI's words: read_ports() multiplies them by 4, so every counter it returns is in bytes, packets or
events. Counters wrap (32-bit on old HCAs) and restart from 0 when the driver reloads: both are resets to
rate(), and the reader returns what it read.

read_ports() is pure (it only reads files) and never raises for what it finds: a missing, unreadable or
non-numeric file is a Problem on its port, and the values it could read are kept. The fabric collector
exports what it returns (port_samples); each Problem counts once in verl_exporter_source_errors_total
{component="fabric"} per sample.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .base import Collector, Context, Sample, Unavailable, register

INFINIBAND_CLASS = Path("class") / "infiniband"

# Bounds on what one node may show, so that a hostile or odd tree cannot make the reader slow or the
# series unbounded: devices x ports, counter files per directory, bytes per file.
MAX_DEVICES = 32
MAX_PORTS_PER_DEVICE = 8
MAX_COUNTER_FILES = 256
MAX_FILE_BYTES = 256

STATE_ACTIVE = 4
PHYS_STATE_LINK_UP = 5
DATA_WORD_BYTES = 4
DATA_COUNTERS = frozenset({"port_rcv_data", "port_xmit_data", "port_rcv_data_64", "port_xmit_data_64"})
NO_PMA = "N/A (no PMA)"

# All but _RATE are whole-string matches (fullmatch). Device and counter names become label values.
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_ENUM = re.compile(r"([0-9]{1,3}): *([!-~][ -~]{0,63})")  # "4: ACTIVE"
_RATE = re.compile(r"([0-9]{1,6}(?:\.[0-9]{1,6})?) Gb/sec(?: |\Z)")  # "200 Gb/sec (4X HDR)"
_PORT_NUMBER = re.compile(r"[0-9]{1,3}")
_COUNTER = re.compile(r"[0-9]{1,20}")
_U64 = 1 << 64
GBIT = 10**9


@dataclass(frozen=True)
class Problem:
    """One file of a port that could not be used: where (relative to the port directory) and why."""

    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


@dataclass
class Port:
    """One port as read at one moment. None where the file was missing or unreadable (see problems)."""

    device: str  # e.g. mlx5_0
    port: int  # 1-based, as the kernel numbers them
    state: str | None = None  # ACTIVE, DOWN, ...
    state_code: int | None = None  # 4 for ACTIVE
    phys_state: str | None = None  # LinkUp, Polling, Disabled, ...
    phys_state_code: int | None = None  # 5 for LinkUp
    rate_bits_per_second: float | None = None
    link_layer: str | None = None  # InfiniBand | Ethernet
    counters: dict[str, int] = field(default_factory=dict)  # counters/<name>, *_data in bytes
    hw_counters: dict[str, int] = field(default_factory=dict)  # hw_counters/<name>
    problems: list[Problem] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state_code == STATE_ACTIVE

    @property
    def link_up(self) -> bool:
        return self.phys_state_code == PHYS_STATE_LINK_UP


def infiniband_dir(sysfs_root: Path) -> Path:
    return Path(sysfs_root) / INFINIBAND_CLASS


def read_ports(sysfs_root: Path) -> list[Port]:
    """Every port of every RDMA device under ``sysfs_root`` (normally /sys), sorted by device and port.

    No infiniband class directory (no RDMA driver loaded) is no ports. Devices past MAX_DEVICES and ports past
    MAX_PORTS_PER_DEVICE are left out (in name order); names that are not plain device names are skipped.
    """
    base = infiniband_dir(sysfs_root)
    devices = sorted(n for n in _listdir(base) if _NAME.fullmatch(n))[:MAX_DEVICES]
    out: list[Port] = []
    for device in devices:
        numbers = sorted(int(n) for n in _listdir(base / device / "ports") if _PORT_NUMBER.fullmatch(n))
        for number in numbers[:MAX_PORTS_PER_DEVICE]:
            out.append(read_port(base / device / "ports" / str(number), device, number))
    return out


def _read_enum(directory: Path, name: str, problems: list[Problem]) -> tuple[int | None, str | None]:
    """(code, name) of a sysfs 'N: NAME' file such as state; (None, None) when missing or garbled."""
    text = _read(directory, name, problems)
    if text is None:
        return None, None
    parsed = _enum(text)
    if parsed is None:
        problems.append(Problem(name, f"not 'N: NAME': {text[:40]!r}"))
        return None, None
    return parsed


def read_port(directory: Path, device: str, number: int) -> Port:
    port = Port(device=device, port=number)
    problems = port.problems
    port.state_code, port.state = _read_enum(directory, "state", problems)
    port.phys_state_code, port.phys_state = _read_enum(directory, "phys_state", problems)
    text = _read(directory, "rate", problems)
    if text is not None:
        match = _RATE.match(text)
        if match is None:
            problems.append(Problem("rate", f"not 'N Gb/sec': {text[:40]!r}"))
        else:
            port.rate_bits_per_second = float(match.group(1)) * GBIT
    text = _read(directory, "link_layer", problems)
    if text is not None:
        if _NAME.fullmatch(text):
            port.link_layer = text
        else:
            problems.append(Problem("link_layer", f"not a name: {text[:40]!r}"))
    port.counters = _counters(directory, "counters", problems)
    port.hw_counters = _counters(directory, "hw_counters", problems, optional=True)
    return port


def _counters(directory: Path, sub: str, problems: list[Problem], optional: bool = False) -> dict[str, int]:
    folder = directory / sub
    if optional and not folder.is_dir():
        return {}
    names = _listdir(folder, problems, sub)
    out: dict[str, int] = {}
    for name in sorted(names)[:MAX_COUNTER_FILES]:
        if not _NAME.fullmatch(name) or (folder / name).is_dir():
            continue
        relative = f"{sub}/{name}"
        text = _read(directory, relative, problems)
        if text is None or text == NO_PMA:
            continue
        if not _COUNTER.fullmatch(text) or int(text) >= _U64:
            problems.append(Problem(relative, f"not a counter: {text[:40]!r}"))
            continue
        value = int(text)
        out[name] = value * DATA_WORD_BYTES if sub == "counters" and name in DATA_COUNTERS else value
    return out


def _enum(text: str) -> tuple[int, str] | None:
    match = _ENUM.fullmatch(text)
    return (int(match.group(1)), match.group(2).strip()) if match else None


def _read(directory: Path, relative: str, problems: list[Problem]) -> str | None:
    """The file's text, stripped; None (and a Problem) when it is missing, unreadable or not text."""
    try:
        # O_NONBLOCK: a FIFO planted in a fake tree must not hang the sampler (sysfs files ignore the flag)
        fd = os.open(directory / relative, os.O_RDONLY | os.O_NONBLOCK)
        try:
            raw = os.read(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:  # absent, EACCES, or EINVAL/EOPNOTSUPP from a driver that has no such counter
        problems.append(Problem(relative, os.strerror(e.errno) if e.errno else type(e).__name__))
        return None
    if len(raw) > MAX_FILE_BYTES:
        problems.append(Problem(relative, f"over {MAX_FILE_BYTES} bytes"))
        return None
    try:
        return raw.decode("ascii").strip()
    except UnicodeDecodeError:
        problems.append(Problem(relative, "not ASCII text"))
        return None


def _listdir(folder: Path, problems: list[Problem] | None = None, relative: str = "") -> list[str]:
    try:
        return os.listdir(folder)
    except OSError as e:
        if problems is not None:
            problems.append(Problem(relative, os.strerror(e.errno) if e.errno else type(e).__name__))
        return []


# ---------------------------------------------------------------------------------------------- the collector
# (label value, counters/ file): the IBA error counters a bad cable, transceiver or switch port raises.
ERROR_COUNTERS = (
    ("symbol", "symbol_error"),
    ("receive", "port_rcv_errors"),
    ("receive_remote_physical", "port_rcv_remote_physical_errors"),
    ("transmit_discards", "port_xmit_discards"),
    ("local_link_integrity", "local_link_integrity_errors"),
    ("excessive_buffer_overrun", "excessive_buffer_overrun_errors"),
)
# (metric, counters/ file) for the link's own events
LINK_COUNTERS = (
    ("verl_fabric_port_link_downed_total", "link_downed"),
    ("verl_fabric_port_link_error_recovery_total", "link_error_recovery"),
    ("verl_fabric_port_transmit_wait_total", "port_xmit_wait"),
)
# (metric, {direction: counters/ file})
DIRECTION_COUNTERS = (
    ("verl_fabric_port_data_bytes_total", {"receive": "port_rcv_data", "transmit": "port_xmit_data"}),
    ("verl_fabric_port_packets_total", {"receive": "port_rcv_packets", "transmit": "port_xmit_packets"}),
)
# hw_counters/ kept (mlx5's names; other drivers have other sets): RoCE drops, retransmissions and congestion
# notifications. An allow-list, so that the counter label stays bounded whatever the driver shows.
HW_EVENTS = ("out_of_buffer", "out_of_sequence", "packet_seq_err", "local_ack_timeout_err", "rnr_nak_retry_err",
             "implied_nak_seq_err", "np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets")
BITS_PER_BYTE = 8


@register
class FabricCollector(Collector):
    name = "fabric"
    per_node = True
    description = "InfiniBand and RoCE ports from sysfs: state, rate, error, data and packet counters"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        directory = infiniband_dir(Path(ctx.config.sysfs_root))
        if not directory.is_dir():
            raise Unavailable(f"{directory} is absent (no RDMA driver loaded)")

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        for port in read_ports(Path(self.ctx.config.sysfs_root)):
            for problem in port.problems:  # a file it could not use loses only its own series
                self.ctx.self_metrics.problem(self.name, "port", f"{port.device} port {port.port}: {problem}",
                                              expected=True)
            out.extend(port_samples(port))
        return out


def port_samples(port: Port) -> list[Sample]:
    """The series of one port, from what was read (a value that could not be read has no series)."""
    labels = {"device": port.device, "port": str(port.port)}
    out: list[Sample] = []
    if port.state_code is not None:
        out.append(("verl_fabric_port_active", labels, float(port.active)))
    if port.phys_state_code is not None:
        out.append(("verl_fabric_port_link_up", labels, float(port.link_up)))
    if port.rate_bits_per_second is not None:
        out.append(("verl_fabric_port_rate_bytes_per_second", labels, port.rate_bits_per_second / BITS_PER_BYTE))
    if port.link_layer is not None:
        out.append(("verl_fabric_port_info", {**labels, "link_layer": port.link_layer}, 1.0))
    counters = port.counters
    for kind, file in ERROR_COUNTERS:
        if file in counters:
            out.append(("verl_fabric_port_errors_total", {**labels, "type": kind}, counters[file]))
    for metric, file in LINK_COUNTERS:
        if file in counters:
            out.append((metric, labels, counters[file]))
    for metric, files in DIRECTION_COUNTERS:
        for direction, file in files.items():
            if file in counters:
                out.append((metric, {**labels, "direction": direction}, counters[file]))
    for counter in HW_EVENTS:
        if counter in port.hw_counters:
            out.append(("verl_fabric_port_hw_events_total", {**labels, "counter": counter}, port.hw_counters[counter]))
    return out
