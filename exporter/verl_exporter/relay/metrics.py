"""The relay's own metrics, declared in the spec with ``collector: relay`` and served from its own registry.

Label values that callers choose (the receiver in the URL path) are capped, so a misconfigured or hostile
sender cannot grow the series count without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from ..families import family
from ..spec import Spec, load_spec

MAX_RECEIVER_VALUES = 64
OTHER = "other"


class RelayMetrics:
    """Counters and gauges of the relay; gauges of the queues are read from a callback at scrape time."""

    def __init__(self, spec: Spec | None = None):
        spec = spec or load_spec()
        self._metrics = {m.name: m for m in spec.for_collector("relay")}
        self._values: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in self._metrics}
        self._lock = threading.Lock()
        self._receivers: set[str] = set()
        # () -> {target: (depth, oldest age in seconds)}, set by the dispatcher.
        self.queue_state: Callable[[], dict[str, tuple[int, float]]] = dict

    def _key(self, name: str, labels: dict[str, str]) -> tuple[str, ...]:
        metric = self._metrics[name]  # KeyError: a name the spec does not declare
        return tuple(str(labels[label]) for label in metric.labels)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = self._key(name, labels)
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0.0) + amount

    def value(self, name: str, **labels: str) -> float:
        key = self._key(name, labels)
        with self._lock:
            return self._values[name].get(key, 0.0)

    def receiver_label(self, receiver: str) -> str:
        with self._lock:
            if receiver in self._receivers or len(self._receivers) < MAX_RECEIVER_VALUES:
                self._receivers.add(receiver)
                return receiver
        return OTHER

    def collect(self):
        with self._lock:
            snapshot = {name: dict(series) for name, series in self._values.items()}
        for target, (depth, oldest) in self.queue_state().items():
            snapshot["verl_relay_queue_depth"][(target,)] = float(depth)
            snapshot["verl_relay_queue_oldest_seconds"][(target,)] = float(oldest)
        for name, metric in self._metrics.items():
            yield family(metric, snapshot[name], {})

    def registry(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return registry
