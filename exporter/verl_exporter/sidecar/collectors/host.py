"""Host load and memory from {procfs}/loadavg and meminfo; the trainer's resident memory via psutil. (CPU time
is the cpu collector's: a node-wide counter that one sidecar per node exports.)

The trainer's memory is the RSS of --trainer-pid plus all its descendants, summed (shared pages are counted
once per process, so this over-states what a kill would free). Listing the descendants means reading every
process's stat file (about 20 us each), so the list is refreshed every CHILDREN_REFRESH_S and a child started
in between counts from the next refresh. psutil reads the real /proc, not ctx.config.procfs.
Under Ray, verl's workers are children of the raylet, not of the driver, so only the driver's own tree counts.
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil

from .base import Collector, Context, Sample, register

_LOAD_PERIODS = ("1m", "5m", "15m")
_KIB = 1024
CHILDREN_REFRESH_S = 30.0


@register
class HostCollector(Collector):
    name = "host"
    description = "host load average and memory, and the trainer's resident memory"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self._trainer: psutil.Process | None = None
        self._children: list[psutil.Process] = []
        self._children_listed_at: float | None = None
        # Once the trainer is gone its pid may be reused by an unrelated process: never attach again.
        self._trainer_gone = False

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        for part in (self._load, self._memory, self._trainer_rss):
            try:
                out.extend(part())
            except OSError as e:  # one unreadable file loses only its own metrics
                self.ctx.self_metrics.problem(self.name, "read", f"{part.__name__.lstrip('_')}: {e!r}")
        return out

    # ------------------------------------------------------------------ load
    def _load(self) -> Iterator[Sample]:
        with open(f"{self.ctx.config.procfs}/loadavg", errors="replace") as f:  # a bad byte is a bad line
            fields = f.read().split()
        try:
            values = [float(v) for v in fields[:3]]
        except ValueError:
            values = []
        if len(values) != 3:
            self.ctx.self_metrics.problem(self.name, "parse", f"loadavg: unexpected content {fields[:3]}")
            return
        for period, value in zip(_LOAD_PERIODS, values, strict=True):
            yield "verl_host_load_average", {"period": period}, value

    # ------------------------------------------------------------------ memory
    def _memory(self) -> Iterator[Sample]:
        wanted: dict[str, int | None] = {"MemTotal:": None, "MemAvailable:": None}
        with open(f"{self.ctx.config.procfs}/meminfo", errors="replace") as f:  # a bad byte is a bad line
            for line in f:
                key, _, rest = line.partition(" ")
                if key in wanted:
                    try:
                        wanted[key] = int(rest.split()[0]) * _KIB  # the kernel's "kB" is KiB
                    except (ValueError, IndexError):
                        self.ctx.self_metrics.problem(self.name, "parse", f"meminfo: bad line {line.strip()!r}")
        total, available = wanted["MemTotal:"], wanted["MemAvailable:"]
        if total is not None:
            yield "verl_host_memory_total_bytes", {}, total
        if available is not None:  # MemAvailable exists since Linux 3.14
            yield "verl_host_memory_available_bytes", {}, available
            if total is not None:
                yield "verl_host_memory_used_bytes", {}, total - available

    # ------------------------------------------------------------------ trainer
    def _trainer_rss(self) -> Iterator[Sample]:
        pid = self.ctx.config.trainer_pid
        if pid is None or self._trainer_gone:
            return
        try:
            if self._trainer is None:
                self._trainer = psutil.Process(pid)
            # is_running() compares the creation time too, so a reused pid reads as gone.
            if not self._trainer.is_running() or self._trainer.status() == psutil.STATUS_ZOMBIE:
                raise psutil.NoSuchProcess(pid)
            rss = self._trainer.memory_info().rss
            now = self.ctx.clock()
            last = self._children_listed_at
            if last is None or not last <= now < last + CHILDREN_REFRESH_S:  # also when the clock stepped back
                self._children = self._trainer.children(recursive=True)
                self._children_listed_at = now
        except psutil.NoSuchProcess:
            # The trainer ended: its series disappears; not an error. Before it was ever seen, keep trying.
            self._trainer_gone = self._trainer is not None
            self._trainer, self._children = None, []
            return
        except psutil.AccessDenied as e:
            self.ctx.self_metrics.problem(self.name, "trainer", f"trainer pid {pid}: {e!r}")
            return
        for child in self._children:
            try:
                # is_running() guards against a dead child's pid being reused before the next listing.
                if child.is_running():
                    rss += child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # a child that exited since the listing
        yield "verl_trainer_resident_memory_bytes", {}, rss
