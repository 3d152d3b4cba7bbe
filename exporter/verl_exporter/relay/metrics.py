"""The relay's own metrics, declared in the spec with ``instrumented_by: relay`` and served from its own registry.

Label values that callers choose (the receiver in the URL path) are capped, so a misconfigured or hostile
sender cannot grow the series count without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from ..exposition.families import family
from ..exposition.selfmetrics import SelfMetric, SpecSeries
from ..spec import Spec, load_spec

MAX_RECEIVER_VALUES = 64
OTHER = "other"
QUEUE_DEPTH = SelfMetric("verl_relay_queue_depth")
QUEUE_OLDEST = SelfMetric("verl_relay_queue_oldest_seconds")


class RelayMetrics(SpecSeries):
    """Counters and gauges of the relay; gauges of the queues are read from a callback at scrape time."""

    def __init__(self, spec: Spec | None = None):
        self.spec = spec or load_spec()  # the relay's own pages (notices) are declared there too
        super().__init__(self.spec, "relay")
        self._receivers: set[str] = set()
        # () -> {target: (depth, oldest age in seconds)}, set by the dispatcher.
        self.queue_state: Callable[[], dict[str, tuple[int, float]]] = dict

    def receiver_label(self, receiver: str) -> str:
        with self._lock:
            if receiver in self._receivers or len(self._receivers) < MAX_RECEIVER_VALUES:
                self._receivers.add(receiver)
                return receiver
        return OTHER

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot()
        for target, (depth, oldest) in self.queue_state().items():
            snapshot[QUEUE_DEPTH.name][(target,)] = float(depth)
            snapshot[QUEUE_OLDEST.name][(target,)] = float(oldest)
        for name, metric in self._metrics.items():
            yield family(metric, snapshot[name], {})

    def registry(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return registry
