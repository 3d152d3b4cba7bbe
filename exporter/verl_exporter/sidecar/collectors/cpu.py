"""Host CPU time by mode from {procfs}/stat, as the kernel counts it.

The aggregate ``cpu`` line of /proc/stat (all CPUs summed) is exported as verl_host_cpu_seconds_total{mode},
node_exporter's node_cpu_seconds_total without the cpu label. Ratios (utilisation, iowait) are rate()s over
the counter, in the generated recording rules, so that every second between two scrapes counts and not only
the sampler's last interval. guest and guest_nice are left out: the kernel already counts them in user and
nice. iowait may go backwards (proc(5)); like node_exporter, each mode is kept monotonic (a smaller reading
repeats the previous value), so that rate() does not take a small step back for a counter reset.

Node-wide, so one sidecar per node (local rank 0) exports it: eight copies per node made the utilisation
recordings the most expensive rule group at 256 ranks (bench/scale.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from .base import Collector, Context, Sample, register

# /proc/stat cpu columns: user nice system idle iowait irq softirq steal [guest guest_nice]
_CPU_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
# /proc/stat counts in USER_HZ ticks (100 on every Linux architecture that matters; node_exporter assumes it).
try:
    USER_HZ = os.sysconf("SC_CLK_TCK")
except (ValueError, OSError, AttributeError):
    USER_HZ = 100


@register
class CpuCollector(Collector):
    name = "cpu"
    description = "host CPU time by mode (all CPUs summed)"
    per_node = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self._cpu_ticks: dict[str, int] = {}  # the largest value seen per mode: what is exported

    def sample(self) -> list[Sample]:
        return list(self._cpu())

    def _cpu(self) -> Iterator[Sample]:
        current = self._read_cpu_line()
        if current is None:
            return
        for mode in _CPU_COLUMNS:
            ticks = max(current[mode], self._cpu_ticks.get(mode, 0))
            self._cpu_ticks[mode] = ticks
            yield "verl_host_cpu_seconds_total", {"mode": mode}, ticks / USER_HZ

    def _read_cpu_line(self) -> dict[str, int] | None:
        with open(f"{self.ctx.config.procfs}/stat", errors="replace") as f:  # a bad byte is a bad line
            for line in f:
                if line.startswith("cpu "):
                    fields = line.split()[1:]
                    try:
                        # Kernels before 2.6.11 lack steal: missing trailing columns read as 0.
                        values = [int(v) for v in fields[: len(_CPU_COLUMNS)]]
                    except ValueError:
                        break
                    values += [0] * (len(_CPU_COLUMNS) - len(values))
                    return dict(zip(_CPU_COLUMNS, values, strict=True))
        self.ctx.self_metrics.problem(self.name, "parse", "no readable aggregate cpu line in stat")
        return None
