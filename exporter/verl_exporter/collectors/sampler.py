"""Run collectors in the background; serve their latest samples to a scrape.

Each collector has its own daemon thread, so one that hangs (a stat on a dead NFS mount, a wedged GPU)
holds up nobody else: its samples go stale, and the age of
verl_exporter_collector_last_success_timestamp_seconds{collector} shows it. A scrape never calls NVML or
touches a file system: it copies the latest samples and builds families from the spec.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from ..families import family
from ..selfmetrics import SelfMetrics
from ..spec import Spec
from .base import Collector, Sample

log = logging.getLogger("verl_exporter")

DEFAULT_INTERVAL_S = 2.0
DEFAULT_SLOW_INTERVAL_S = 30.0


class Sampler:
    def __init__(self, collectors: Iterable[Collector], spec: Spec, self_metrics: SelfMetrics,
                 const_labels: dict[str, str] | None = None, interval: float = DEFAULT_INTERVAL_S,
                 slow_interval: float = DEFAULT_SLOW_INTERVAL_S):
        self.collectors = list(collectors)
        self._spec = spec
        self._self = self_metrics
        self._const = dict(const_labels or {})
        self._interval = interval
        self._slow_interval = slow_interval
        # collector name -> (fast samples, slow samples); replaced whole, never mutated in place
        self._latest: dict[str, tuple[list[Sample], list[Sample]]] = {c.name: ([], []) for c in self.collectors}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False

    def start(self) -> Sampler:
        self._started = True
        for c in self.collectors:
            self._start_thread(c)
        return self

    def add(self, c: Collector) -> None:
        """Add a collector, also while running (e.g. Monitor.grad_watch() after start)."""
        self._latest[c.name] = ([], [])
        self.collectors.append(c)
        if self._started:
            self._start_thread(c)

    def _start_thread(self, c: Collector) -> None:
        t = threading.Thread(target=self._loop, args=(c,), name=f"verl-exporter-{c.name}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        for c in self.collectors:
            try:
                c.close()
            except Exception as e:
                self._self.problem(c.name, "close", f"close failed: {e!r}")

    def _loop(self, c: Collector) -> None:
        next_slow = 0.0
        while not self._stop.is_set():
            slow = time.monotonic() >= next_slow
            if slow:
                next_slow = time.monotonic() + self._slow_interval
            self.run_once(c, slow=slow)
            self._stop.wait(self._interval)

    def run_once(self, c: Collector, slow: bool = True) -> bool:
        """One sample of one collector (the slow reads too when slow=True); True when it succeeded."""
        started = time.perf_counter()
        try:
            fast = list(c.sample())
            previous_slow = self._latest[c.name][1]
            slow_samples = list(c.sample_slow()) if slow else previous_slow
            self._latest[c.name] = (fast, slow_samples)
            ok = True
        except Exception as e:
            self._self.problem(c.name, "sample", f"sample failed: {e!r}")
            ok = False
        self._self.set("verl_exporter_collector_duration_seconds", time.perf_counter() - started,
                       collector=c.name)
        self._self.set("verl_exporter_collector_success", 1 if ok else 0, collector=c.name)
        if ok:
            self._self.set("verl_exporter_collector_last_success_timestamp_seconds", time.time(),
                           collector=c.name)
        return ok

    # ------------------------------------------------------------------ scrape side
    def collect(self):
        by_metric: dict[str, dict[tuple[str, ...], float]] = {}
        for name, (fast, slow) in list(self._latest.items()):
            for metric_name, labels, value in fast + slow:
                try:
                    metric = self._spec[metric_name]
                    key = tuple(str(labels[label]) for label in metric.labels)
                except KeyError as e:
                    self._self.problem(name, "bad_sample", f"sample {metric_name}{labels} does not fit the spec: {e}")
                    continue
                series = by_metric.setdefault(metric_name, {})
                if key not in series and len(series) >= metric.max_series:
                    self._self.inc("verl_exporter_series_dropped_total", reason="series_cap")
                    continue
                series[key] = value
        for metric_name in sorted(by_metric):
            yield family(self._spec[metric_name], by_metric[metric_name], self._const)


def build_collectors(enabled: dict[str, bool], ctx) -> list[Collector]:
    """Instantiate the enabled collectors; one whose source is absent here is skipped with one log line."""
    from . import Unavailable, load_all

    out = []
    for name, cls in sorted(load_all().items()):
        if not enabled.get(name, cls.default_enabled):
            continue
        try:
            out.append(cls(ctx))
        except Unavailable as e:
            log.info("collector %s is off: %s", name, e)
        except Exception as e:
            ctx.self_metrics.problem(name, "init", f"collector {name} could not start: {e!r}")
    return out
