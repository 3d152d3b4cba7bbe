"""Block device counters from {procfs}/diskstats (psutil lacks the weighted I/O time).

Columns after ``major minor name`` (Documentation/admin-guide/iostats.rst): 1 reads completed, 2 reads merged,
3 sectors read, 4 ms reading, 5 writes completed, 6 writes merged, 7 sectors written, 8 ms writing,
9 I/Os in flight, 10 ms doing I/O, 11 weighted ms doing I/O; Linux 4.18 adds 4 discard columns and 5.5 two
flush columns, which are not used. A sector here is always 512 bytes, whatever the device's block size.

Per whole device (partitions, loop, ram, zram, floppy and optical drives skipped; dm-* and md* kept), the
kernel's counters as they are, in base units, with node_exporter's meaning (node_disk_*):
  verl_host_disk_io_time_seconds_total           ms doing I/O / 1000          node_disk_io_time_seconds_total
  verl_host_disk_io_time_weighted_seconds_total  weighted ms / 1000           node_disk_io_time_weighted_seconds_total
  verl_host_disk_operations_completed_total{op}  reads (writes) completed     node_disk_{reads,writes}_completed_total
  verl_host_disk_operation_time_seconds_total{op} ms reading (writing) / 1000 node_disk_{read,write}_time_seconds_total
  verl_host_disk_bytes_total{op}                 sectors read (written) x 512 node_disk_{read,written}_bytes_total
The busy ratio, queue depth and await are rate()s of these, in the generated recording rules: over the whole
scrape interval, where a ratio computed here would only see the sampler's last interval. A counter that goes
back (a device re-created under the same name, a 32-bit counter that wrapped) is a reset to rate().
"""

from __future__ import annotations

import re

from .base import Collector, Sample, register

# Partitions and pseudo devices, after node_exporter's default --collector.diskstats.device-exclude.
IGNORED_DEVICES = re.compile(r"^(z?ram\d+|loop\d+|fd\d+|sr\d+|(h|s|v|xv)d[a-z]+\d+|nvme\d+n\d+p\d+|mmcblk\d+p\d+)$")

# Indices into the stat columns (after major, minor, name).
_READS, _SECTORS_READ, _MS_READING = 0, 2, 3
_WRITES, _SECTORS_WRITTEN, _MS_WRITING = 4, 6, 7
_MS_IO, _WEIGHTED_MS = 9, 10
_COLUMNS_USED = 11
_SECTOR_BYTES = 512
_MS_PER_S = 1000.0
_BY_OP = (("read", _READS, _SECTORS_READ, _MS_READING), ("write", _WRITES, _SECTORS_WRITTEN, _MS_WRITING))


@register
class DiskCollector(Collector):
    name = "disk"
    per_node = True
    description = "per-device I/O time, weighted I/O time, operations and bytes from /proc/diskstats"

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        for device, columns in self._read().items():
            labels = {"device": device}
            out.append(("verl_host_disk_io_time_seconds_total", labels, columns[_MS_IO] / _MS_PER_S))
            out.append(("verl_host_disk_io_time_weighted_seconds_total", labels, columns[_WEIGHTED_MS] / _MS_PER_S))
            for op, ops, sectors, ms in _BY_OP:
                by_op = {"device": device, "op": op}
                out.append(("verl_host_disk_operations_completed_total", by_op, columns[ops]))
                out.append(("verl_host_disk_operation_time_seconds_total", by_op, columns[ms] / _MS_PER_S))
                out.append(("verl_host_disk_bytes_total", by_op, columns[sectors] * _SECTOR_BYTES))
        return out

    def _read(self) -> dict[str, list[int]]:
        devices: dict[str, list[int]] = {}
        with open(f"{self.ctx.config.procfs}/diskstats", errors="replace") as f:  # a bad byte is a bad line
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
