"""The GPU check, through the sidecar's own NVML collectors (gpu, nvlink): one sample now, judged by the
alerts the spec declares on those collectors' metrics, so a pre-flight fails on what would page in training.

- every threshold alert on a gpu/nvlink metric (GPU lost, row remap pending or failed, NVLink down) is judged
  on each GPU's sample;
- uncorrectable ECC and throttling at idle are judged on the series VerlGPUUncorrectableECC and
  VerlGPUThermalThrottling select (their label matchers, read from their expressions);
- a critical XID (the code set VerlGPUXidCritical selects, codes.critical_xids, overrides included) in the kernel
  log within the knob xid_lookback fails.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ...exposition.selfmetrics import SelfMetrics
from ...sidecar.collectors import Context, Unavailable
from ...sidecar.collectors.gpu import GpuCollector
from ...sidecar.collectors.nvlink import NvlinkCollector
from ...sidecar.config import ServeConfig
from ...spec import Spec
from ...spec.rules import duration_seconds
from .report import Finding, Options

CHECK = "gpu"
GPU_COLLECTORS = ("gpu", "nvlink")
ANY_SERIES_ALERTS = ("VerlGPUUncorrectableECC", "VerlGPUThermalThrottling")  # fail when a selected series > 0
XID_ALERT = "VerlGPUXidCritical"
_SELECTOR = re.compile(r"<metric>\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|=)\s*"([^"]*)"')
# the kernel's XID line: "NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus."
_XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)\b")
_KMSG_MAX_BYTES = 16 << 20  # the kernel's ring buffer is far smaller; bounds a hostile file


def matchers(spec: Spec, alert_name: str) -> tuple[str, dict[str, set[str]]]:
    """(metric, {label: allowed values}) of the first selector of the alert's expression."""
    alert = next(a for a in spec.alerts() if a.alert == alert_name)
    m = _SELECTOR.search(getattr(alert, "expr", ""))
    if m is None:
        raise ValueError(f"{alert_name} selects no <metric>{{...}} series")
    return alert.metric, {k: set(v.split("|")) for k, _, v in _MATCHER.findall(m.group(1))}


def critical_xids(spec: Spec) -> set[str]:
    """The XIDs VerlGPUXidCritical pages on: the code set(s) it reads, as its spec (overrides applied) binds them."""
    alert = next(a for a in spec.alerts() if a.alert == XID_ALERT)
    return {str(c) for codes in alert.code_values().values() for c in codes}


class _GpuView:
    """One GPU's sample as the threshold alerts' judge() reads it (spec/kinds/base.py StepView)."""

    def __init__(self, rows: list[tuple[str, dict[str, str], float]], now: float):
        self.rows, self.now, self.last_step_at = rows, now, None

    def value(self, metric: str, labels: dict[str, str]) -> float | None:
        return next((v for name, lab, v in self.rows if name == metric and labels.items() <= lab.items()), None)

    def stat(self, signal: str, stat: str) -> float | None:
        return None


def _action(alert: Any) -> str:
    return alert.runbook.get("action", "see the runbook").rstrip(".")


def check(o: Options) -> list[Finding]:
    ctx = Context(spec=o.spec, self_metrics=SelfMetrics(o.spec), config=ServeConfig(procfs=o.procfs, gpus="all"),
                  environ={}, nvml_loader=o.nvml_loader, clock=o.clock)
    try:
        gpu = GpuCollector(ctx)
    except Unavailable as e:
        return [Finding(CHECK, False, f"NVML is not usable: {e}; run on a GPU node with the NVIDIA driver "
                                      "(and nvidia-ml-py), or --skip gpu on a CPU node")]
    try:
        rows = list(gpu.sample())
        counted = gpu.nvml.nvmlDeviceGetCount()
        found = len(gpu.session.gpus)
        labels = {g.label: g for g in gpu.session.gpus}
        try:
            nvlink = NvlinkCollector(ctx)
        except Unavailable:
            nvlink = None
        if nvlink is not None:
            rows += list(nvlink.sample())
            nvlink.close()
    finally:
        gpu.close()
    out: list[Finding] = []
    if found < counted:
        out.append(Finding(CHECK, False, f"{counted - found} of the {counted} GPUs NVML counts do not answer (lost); "
                                         "drain the node (nvidia-smi; dmesg | grep -i xid)"))
    if o.gpus is not None and found != o.gpus and not (found < counted == o.gpus):  # lost: said above
        out.append(Finding(CHECK, False, f"{found} GPU(s) answer, --gpus expects {o.gpus}; a GPU is missing or "
                                         "the node is not the one meant: drain it or fix --gpus"))
    by_gpu = {g: [r for r in rows if r[1].get("gpu") == g] for g in labels}
    gpu_metrics = {m.name for m in o.spec.metrics if m.collector in GPU_COLLECTORS}
    thresholds = [a for a in o.spec.alerts() if a.metric in gpu_metrics and a.kind == "threshold"
                  and a.severity in ("critical", "warning")]
    for g, gpu_rows in by_gpu.items():
        view = _GpuView(gpu_rows, o.clock())
        for a in thresholds:
            value = a.judge(view)
            if value is not None:
                out.append(Finding(CHECK, False, f"GPU {g}: {a.summary.rstrip('.')} ({a.alert}, value {value:g}); "
                                                 f"{_action(a)}"))
        for name in ANY_SERIES_ALERTS:
            metric, want = matchers(o.spec, name)
            which = [k for k, vals in want.items() if len(vals) > 1]  # e.g. reason: name it; else the count
            hits = sorted({", ".join(lab[k] for k in which) if which else f"{v:g}"
                           for m, lab, v in gpu_rows if m == metric and v > 0
                           and all(lab.get(k) in vals for k, vals in want.items())})
            if hits:
                a = next(x for x in o.spec.alerts() if x.alert == name)
                out.append(Finding(CHECK, False, f"GPU {g}: {a.summary.rstrip('.')} ({name}: {', '.join(hits)}); "
                                                 f"{_action(a)}"))
    out += _xids(o, {_bus_device(g.pci_bus_id): g.label for g in labels.values()})
    if all(f.ok for f in out):
        links = sum(1 for m, _, v in rows if m == "verl_gpu_nvlink_link_up" and v == 1)
        out.insert(0, Finding(CHECK, True, f"{found} GPU(s) answer" + (" (as --gpus expects)" if o.gpus else "")
                              + "; no lost GPU, row remap, uncorrectable ECC or throttling; "
                              + f"{links} NVLink link(s) up"))
    return out


def _xids(o: Options, pci_to_gpu: dict[tuple[int, int] | None, str]) -> list[Finding]:
    """A critical XID in the kernel log (/dev/kmsg records: 'prio,seq,usec,flags;text') within xid_lookback."""
    codes = critical_xids(o.spec)
    lookback = duration_seconds(o.knobs.xid_lookback)
    try:
        with open(os.path.join(o.procfs, "uptime"), encoding="ascii") as f:
            uptime = float(f.read(256).split()[0])
        text = _read_kmsg(o.kmsg)
    except (OSError, ValueError, IndexError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return [Finding(CHECK, True, f"XID history not read ({o.kmsg}: {why}); run as root to check the last "
                                     f"{o.knobs.xid_lookback} for critical XIDs")]
    out = []
    seen: set[tuple[str, str]] = set()
    for record in text.splitlines():
        head, sep, message = record.partition(";")
        parts = head.split(",")
        m = _XID_LINE.search(message)
        if not sep or len(parts) < 3 or m is None or m.group(2) not in codes:
            continue
        try:
            age = uptime - int(parts[2]) / 1e6
        except ValueError:
            continue
        pci, code = m.group(1).lower(), m.group(2)
        if age > lookback or (pci, code) in seen:
            continue
        seen.add((pci, code))
        gpu = pci_to_gpu.get(_bus_device(pci))
        where = f"GPU {gpu} (PCI {pci})" if gpu else f"PCI {pci}"
        a = next(x for x in o.spec.alerts() if x.alert == XID_ALERT)
        out.append(Finding(CHECK, False, f"{where}: critical XID {code} {age / 3600:.1f} h ago (within "
                                         f"{o.knobs.xid_lookback}); {_action(a)}"))
    return out


def _bus_device(pci: str) -> tuple[int, int] | None:
    """(bus, device) of a PCI address: NVML writes 00000000:3B:00.0, the kernel's XID line 0000:3b:00."""
    m = re.search(r"([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.[0-9a-fA-F]+)?$", pci.strip())
    return (int(m.group(1), 16), int(m.group(2), 16)) if m else None


def _read_kmsg(path: str) -> str:
    """Every record of /dev/kmsg (one per read, until EAGAIN), or the whole of a plain file (tests)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    chunks: list[bytes] = []
    total = 0
    try:
        while total < _KMSG_MAX_BYTES:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break  # /dev/kmsg: no more records
            except OSError as e:
                if e.errno == 32:  # EPIPE: records overwritten while read; go on with the next
                    continue
                raise
            if not chunk:
                break
            chunks.append(chunk if chunk.endswith(b"\n") else chunk + b"\n")
            total += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")
