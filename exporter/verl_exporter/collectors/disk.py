"""Block device load from {procfs}/diskstats (psutil lacks the weighted time and the in-flight count).

Columns after ``major minor name`` (Documentation/admin-guide/iostats.rst): 1 reads completed, 2 reads merged,
3 sectors read, 4 ms reading, 5 writes completed, 6 writes merged, 7 sectors written, 8 ms writing,
9 I/Os in flight, 10 ms doing I/O, 11 weighted ms doing I/O; Linux 4.18 adds 4 discard columns and 5.5 two
flush columns, which are not used. A sector here is always 512 bytes, whatever the device's block size.

Per whole device (partitions, loop, ram, zram, floppy and optical drives skipped; dm-* and md* kept), over the
period since the previous sample:
  busy ratio   = delta ms doing I/O / delta wall ms, capped at 1 (the two clocks are read at different instants)
  queue depth  = delta weighted ms / delta wall ms (node-mixin's "saturation")
  await        = delta ms reading (writing) / delta reads (writes) completed, in seconds; 0 when none completed
                 in the period, so that the series does not blink in and out on an idle disk
and the byte counters (sectors x 512) from the first sample on. The first sample only sets the baseline for
the ratios. A column that went backwards (a device re-created under the same name, or a 32-bit counter that
wrapped) skips that device's ratios for one period; a period of zero or less (the clock stepped back) skips
all of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from .base import Collector, Context, Sample, register

# Partitions and pseudo devices, after node_exporter's default --collector.diskstats.device-exclude.
IGNORED_DEVICES = re.compile(r"^(z?ram\d+|loop\d+|fd\d+|sr\d+|(h|s|v|xv)d[a-z]+\d+|nvme\d+n\d+p\d+|mmcblk\d+p\d+)$")

# Indices into the stat columns (after major, minor, name).
_READS, _SECTORS_READ, _MS_READING = 0, 2, 3
_WRITES, _SECTORS_WRITTEN, _MS_WRITING = 4, 6, 7
_MS_IO, _WEIGHTED_MS = 9, 10
_COLUMNS_USED = 11
_SECTOR_BYTES = 512


@register
class DiskCollector(Collector):
    name = "disk"
    per_node = True
    description = "per-device busy ratio, queue depth, await and bytes from /proc/diskstats"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        # device -> its columns at the previous sample; rebuilt from each read, so a vanished device is forgotten
        self._previous: dict[str, list[int]] = {}
        self._previous_time: float | None = None

    def sample(self) -> list[Sample]:
        now = self.ctx.clock()
        current = self._read()
        previous, previous_time = self._previous, self._previous_time
        self._previous, self._previous_time = current, now
        period_ms = (now - previous_time) * 1000.0 if previous_time is not None else 0.0
        out: list[Sample] = []
        for device, columns in current.items():
            out.append(("verl_host_disk_bytes_total", {"device": device, "op": "read"},
                        columns[_SECTORS_READ] * _SECTOR_BYTES))
            out.append(("verl_host_disk_bytes_total", {"device": device, "op": "write"},
                        columns[_SECTORS_WRITTEN] * _SECTOR_BYTES))
            before = previous.get(device)
            if before is not None and period_ms > 0:
                out.extend(self._ratios(device, before, columns, period_ms))
        return out

    @staticmethod
    def _ratios(device: str, before: list[int], after: list[int], period_ms: float) -> Iterator[Sample]:
        delta = [a - b for a, b in zip(after, before, strict=True)]
        if any(d < 0 for d in delta):
            return
        labels = {"device": device}
        yield "verl_host_disk_busy_ratio", labels, min(1.0, delta[_MS_IO] / period_ms)
        yield "verl_host_disk_queue_depth", labels, delta[_WEIGHTED_MS] / period_ms
        for op, ops, ms in (("read", _READS, _MS_READING), ("write", _WRITES, _MS_WRITING)):
            await_s = delta[ms] / delta[ops] / 1000.0 if delta[ops] else 0.0
            yield "verl_host_disk_await_seconds", {"device": device, "op": op}, await_s

    def _read(self) -> dict[str, list[int]]:
        devices: dict[str, list[int]] = {}
        with open(f"{self.ctx.procfs}/diskstats") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3 or IGNORED_DEVICES.match(fields[2]):
                    continue
                try:
                    columns = [int(v) for v in fields[3:3 + _COLUMNS_USED]]
                    if len(columns) < _COLUMNS_USED:
                        raise ValueError(f"{len(columns)} stat columns, need {_COLUMNS_USED}")
                except ValueError as e:  # one bad line loses only its own device
                    self.ctx.self_metrics.problem(self.name, "parse", f"diskstats: bad line {line.strip()!r}: {e}")
                    continue
                devices[fields[2]] = columns
        return devices
