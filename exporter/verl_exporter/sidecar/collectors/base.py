"""What a collector is, and the registry that the CLI builds its --collector.<name> flags from."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...exposition.selfmetrics import SelfMetrics
from ...spec import Spec

# (metric name from the spec, {label: value}, value)
Sample = tuple[str, dict[str, str], float]

REGISTRY: dict[str, type[Collector]] = {}


class Unavailable(Exception):
    """Raised by a collector's constructor when its source is absent here (no NVML, no /proc/pressure).

    The sidecar then runs without it and says so once in its log; this is not an error.
    """


@dataclass
class Context:
    """Everything a collector may need, injected so that tests can point it at fakes."""

    spec: Spec
    self_metrics: SelfMetrics
    procfs: str = "/proc"
    gpus: str = "auto"  # auto (this rank's GPUs) | all | comma-separated indices or UUIDs
    local_rank: int | None = None
    trainer_pid: int | None = None
    checkpoint_dir: str | None = None
    watch_paths: tuple[str, ...] = ()
    gpu_pcie_throughput: bool = False
    checkpoint_grace_s: float = 900.0
    checkpoint_verify: bool = False
    preflight_result: str | None = None  # the file `verl-exporter preflight --state-dir` writes
    environ: dict[str, str] = field(default_factory=dict)
    nvml_loader: Callable[[], Any] | None = None  # returns the pynvml module (tests pass a fake)
    clock: Callable[[], float] = time.time


class Collector:
    """Subclass, set ``name`` (and ``default_enabled``), decorate with @register.

    ``sample()`` runs every interval, ``sample_slow()`` on the slow cadence (costly reads); both return the
    samples of that moment, and may raise: the sampler counts the failure and keeps the last good samples of
    other collectors untouched.
    """

    name: ClassVar[str] = ""
    default_enabled: ClassVar[bool] = True
    description: ClassVar[str] = ""
    # Node-wide sources (disks, NICs, PSI) run on local rank 0 only unless switched on explicitly:
    # eight sidecars of one node would otherwise export the same series eight times.
    per_node: ClassVar[bool] = False

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def sample(self) -> Iterable[Sample]:
        return ()

    def sample_slow(self) -> Iterable[Sample]:
        return ()

    def close(self) -> None:
        """Release what the collector holds (threads, NVML handles)."""


def register(cls: type[Collector]) -> type[Collector]:
    if not cls.name or cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"collector {cls.__name__} needs a unique name, got {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls
