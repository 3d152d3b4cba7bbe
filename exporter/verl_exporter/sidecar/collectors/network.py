"""Network bytes, errors and drops per interface from {procfs}/net/dev.

/proc/net/dev shows the interfaces of the reader's network namespace: in a container, the container's own.
Loopback is skipped, and so are the per-pod virtual interfaces that container hosts create by the hundred
(VIRTUAL_INTERFACES); at most MAX_INTERFACES are kept, in the kernel's order, and the rest are counted in
verl_exporter_series_dropped_total{reason="series_cap"}.
"""

from __future__ import annotations

import re

from ...exposition.selfmetrics import SelfMetric
from .base import Collector, Sample, register

SERIES_DROPPED = SelfMetric("verl_exporter_series_dropped_total")

# veth* (container pairs), cali* (Calico), flannel* (flannel.1), cni* (cni0), docker* (docker0), br-* (compose
# bridges): one or more per pod or network, so they would swamp the cap and tell nothing about training.
VIRTUAL_INTERFACES = re.compile(r"^(veth|cali|flannel|cni|docker|br-)")
MAX_INTERFACES = 32  # x 2 directions = the spec's default max_series of 64

# Columns after "name:": receive bytes packets errs drop fifo frame compressed multicast, then transmit
# bytes packets errs drop fifo colls carrier compressed.
_RECEIVE, _TRANSMIT = 0, 8
_BYTES, _ERRORS, _DROPS = 0, 2, 3
_COLUMNS = 16
_METRICS = (("verl_host_network_bytes_total", _BYTES), ("verl_host_network_errors_total", _ERRORS),
            ("verl_host_network_drops_total", _DROPS))


@register
class NetworkCollector(Collector):
    name = "network"
    per_node = True
    description = "network bytes, errors and drops per interface (loopback and container veths excluded)"

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        kept = dropped = 0
        with open(f"{self.ctx.config.procfs}/net/dev", errors="replace") as f:  # a bad byte is a bad line
            lines = f.readlines()[2:]  # two header lines
        for line in lines:
            # Old kernels print "eth0:123" with no space after the colon.
            interface, sep, rest = line.partition(":")
            interface = interface.strip()
            if not sep:
                if line.strip():
                    self.ctx.self_metrics.problem(self.name, "parse", f"net/dev: bad line {line.strip()!r}")
                continue
            if interface == "lo" or VIRTUAL_INTERFACES.match(interface):
                continue
            try:
                columns = [int(v) for v in rest.split()]
                if len(columns) < _COLUMNS:
                    raise ValueError(f"{len(columns)} columns, need {_COLUMNS}")
            except ValueError as e:  # one bad line loses only its own interface
                self.ctx.self_metrics.problem(self.name, "parse", f"net/dev: bad line {line.strip()!r}: {e}")
                continue
            if kept >= MAX_INTERFACES:
                dropped += 1
                continue
            kept += 1
            for direction, base in (("receive", _RECEIVE), ("transmit", _TRANSMIT)):
                labels = {"interface": interface, "direction": direction}
                for metric, column in _METRICS:
                    out.append((metric, labels, columns[base + column]))
        if dropped:
            self.ctx.self_metrics.inc(SERIES_DROPPED, dropped, reason="series_cap")
        return out
