"""Resource collectors, one per file, each registered by name when its module is imported (node_exporter's
layout: a collector's file calls register, and the package imports every file).

A collector samples on its own thread at the sampler's cadence; a scrape only reads the latest samples.
Adding a collector touches one file, and the import below: define the class with @register, and import its
module here. REGISTRY then names it, and the CLI has its --collector.<name> flag.
"""

from __future__ import annotations

from . import (  # noqa: F401
    checkpoint,
    cpu,
    disk,
    fabric,
    filesystem,
    gpu,
    gpu_processes,
    host,
    network,
    nvlink,
    preflight,
    pressure,
    xid,
)
from .base import REGISTRY, Collector, Context, Sample, Unavailable, register

__all__ = ["REGISTRY", "Collector", "Context", "Sample", "Unavailable", "register"]
