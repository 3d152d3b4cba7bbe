"""Resource collectors, one per file, each registered here by name (node_exporter's layout).

A collector samples on its own thread at the sampler's cadence; a scrape only reads the latest samples.
Adding a collector touches one file: define the class with @register, and import the module in
``_MODULES`` below so that the registry sees it.
"""

from __future__ import annotations

import importlib

from .base import REGISTRY, Collector, Context, Sample, Unavailable, register

__all__ = ["REGISTRY", "Collector", "Context", "Sample", "Unavailable", "register", "load_all"]

# Modules imported lazily by load_all(), so that importing the package starts and imports nothing heavy.
_MODULES = ("gpu", "nvlink", "xid", "gpu_processes", "host", "pressure", "disk", "filesystem", "network",
            "checkpoint")


def load_all() -> dict[str, type[Collector]]:
    """Import every collector module (a missing one is skipped) and return the registry."""
    for name in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    return REGISTRY
