"""The fabric check: every InfiniBand/RoCE port (the sidecar's sysfs reader, sidecar/collectors/fabric.py)
is ACTIVE and LinkUp at its rate, and no error counter rises over a short sample (knob fabric_sample, or
--fabric-sample)."""

from __future__ import annotations

from pathlib import Path

from ...sidecar.collectors.fabric import ERROR_COUNTERS as COLLECTED_ERRORS
from ...sidecar.collectors.fabric import GBIT, Port, infiniband_dir, read_ports
from ...spec.rules import duration_seconds
from .report import Finding, Options

CHECK = "fabric"
# Counters that only rise when something is wrong: the collector's error counters and the link's own events
# (its alerts judge the same files); data, packet and wait counters rise in health.
ERROR_COUNTERS = (*(file for _, file in COLLECTED_ERRORS), "link_downed", "link_error_recovery")
ERROR_HW_COUNTERS = ("out_of_buffer", "packet_seq_err", "local_ack_timeout_err")


def _name(p: Port) -> str:
    return f"{p.device} port {p.port}"


def _errors(p: Port) -> dict[str, int]:
    out = {k: v for k, v in p.counters.items() if k in ERROR_COUNTERS}
    out.update({f"hw_counters/{k}": v for k, v in p.hw_counters.items() if k in ERROR_HW_COUNTERS})
    return out


def check(o: Options) -> list[Finding]:
    root = Path(o.sysfs_root)
    if not infiniband_dir(root).is_dir():
        if o.ports:
            return [Finding(CHECK, False, f"no InfiniBand/RoCE device: {infiniband_dir(root)} does not exist, "
                                          f"--ports expects {o.ports}; load the RDMA driver (modprobe mlx5_ib) "
                                          "or --skip fabric")]
        return [Finding(CHECK, True, f"no InfiniBand/RoCE device ({infiniband_dir(root)} absent, none expected)")]
    ports = read_ports(root)
    out: list[Finding] = []
    if o.ports is not None and len(ports) != o.ports:
        out.append(Finding(CHECK, False, f"{len(ports)} port(s) in sysfs, --ports expects {o.ports}: a HCA is "
                                         "missing or its driver did not load (ibstat; dmesg | grep mlx5)"))
    fastest: dict[str | None, float] = {}
    for p in ports:
        if p.rate_bits_per_second is not None:
            fastest[p.link_layer] = max(fastest.get(p.link_layer, 0.0), p.rate_bits_per_second)
    for p in ports:
        if p.problems:
            out.append(Finding(CHECK, False, f"{_name(p)}: unreadable sysfs file(s): "
                                             f"{'; '.join(str(x) for x in p.problems[:4])}"
                                             + (f" (+{len(p.problems) - 4} more)" if len(p.problems) > 4 else "")
                                             + "; check the driver (mlx5_ib) and the sysfs mount"))
        if p.state_code is not None and not p.active or p.phys_state_code is not None and not p.link_up:
            out.append(Finding(CHECK, False, f"{_name(p)} is {p.state or '?'} / {p.phys_state or '?'}, not ACTIVE / "
                                             "LinkUp: check its cable and switch port (ibstat), or drain the node"))
        want = o.port_rate_gbps * GBIT if o.port_rate_gbps else fastest.get(p.link_layer)
        if p.rate_bits_per_second is not None and want and p.rate_bits_per_second < want:
            out.append(Finding(CHECK, False, f"{_name(p)} runs at {p.rate_bits_per_second / GBIT:g} Gb/s, below "
                                             f"{want / GBIT:g} Gb/s: a degraded link; reseat or replace the cable"))
    sample_s = o.fabric_sample_s if o.fabric_sample_s is not None else duration_seconds(o.knobs.fabric_sample)
    if ports and sample_s > 0:
        before = {(p.device, p.port): _errors(p) for p in ports}
        o.sleep(sample_s)
        for p in read_ports(root):
            old = before.get((p.device, p.port), {})
            rising = {k: v - old[k] for k, v in _errors(p).items() if k in old and v > old[k]}
            if rising:
                what = ", ".join(f"{k} +{d}" for k, d in sorted(rising.items()))
                out.append(Finding(CHECK, False, f"{_name(p)}: error counters rose in {sample_s:g} s ({what}); "
                                                 "a bad cable, transceiver or switch port: drain the node or fix "
                                                 "the link"))
    if all(f.ok for f in out):
        out.insert(0, Finding(CHECK, True, f"{len(ports)} port(s) ACTIVE and LinkUp at their rate"
                              + (f", no error counter rising over {sample_s:g} s" if sample_s > 0 else "")))
    return out
