"""Linux pressure stall information (PSI) from {procfs}/pressure/{cpu,io,memory}.

Each file has a ``some`` line and, except for cpu before Linux 5.13, a ``full`` line:
``some avg10=0.12 avg60=0.05 avg300=0.01 total=12345`` where total is the stalled time in microseconds.
Only ``total`` is exported (as seconds): the avg* fields are the kernel's own moving averages, and
rate() over the counter gives the same figure at any window. Whatever lines exist are emitted.

Unavailable when the kernel has no PSI (no /proc/pressure, before Linux 4.20) or has it switched off
(booted with psi=0: the files exist but reading them fails with EOPNOTSUPP).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

from .base import Collector, Context, Sample, Unavailable, register

RESOURCES = ("cpu", "io", "memory")
_KINDS = ("some", "full")
_US_PER_S = 1e6


@register
class PressureCollector(Collector):
    name = "pressure"
    per_node = True
    description = "Linux PSI stall time by resource (cpu, io, memory) and kind (some, full)"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        directory = f"{ctx.config.procfs}/pressure"
        if not os.path.isdir(directory):
            raise Unavailable(f"{directory} is absent (kernel without PSI, before Linux 4.20)")
        # Resources this kernel has (irq and others may come later; the spec's resource label keeps to these).
        self._resources = [r for r in RESOURCES if os.path.exists(f"{directory}/{r}")]
        if not self._resources:
            raise Unavailable(f"{directory} has none of {', '.join(RESOURCES)}")
        try:
            with open(f"{directory}/{self._resources[0]}", errors="replace") as f:  # a bad byte is a bad line
                f.read()
        except OSError as e:
            if e.errno == errno.EOPNOTSUPP:
                raise Unavailable("PSI is switched off in this kernel (psi=0)") from e
            raise

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        for resource in self._resources:
            try:
                # errors="replace": a bad byte is a bad line
                with open(f"{self.ctx.config.procfs}/pressure/{resource}", errors="replace") as f:
                    lines = f.readlines()
            except OSError as e:  # one unreadable file loses only its own series
                self.ctx.self_metrics.problem(self.name, "read", f"{resource}: {e!r}")
                continue
            out.extend(self._parse(resource, lines))
        return out

    def _parse(self, resource: str, lines: list[str]) -> Iterator[Sample]:
        for line in lines:
            kind, _, rest = line.strip().partition(" ")
            if not kind:
                continue
            fields = dict(pair.partition("=")[::2] for pair in rest.split())
            try:
                if kind not in _KINDS:
                    raise ValueError(f"unknown kind {kind!r}")
                total_us = int(fields["total"])
            except (KeyError, ValueError) as e:
                self.ctx.self_metrics.problem(self.name, "parse", f"{resource}: bad line {line.strip()!r}: {e!r}")
                continue
            yield "verl_host_pressure_stall_seconds_total", {"resource": resource, "kind": kind}, total_us / _US_PER_S
