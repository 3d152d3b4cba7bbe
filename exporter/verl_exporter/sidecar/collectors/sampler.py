"""Run collectors in the background; serve their latest samples to a scrape.

Each collector has its own daemon thread, so one that hangs (a stat on a dead NFS mount, a wedged GPU)
holds up nobody else: its samples go stale, and the age of
verl_exporter_collector_last_success_timestamp_seconds{collector} shows it. A scrape never calls NVML or
touches a file system: it copies the latest samples and renders them as the spec declares them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from ...exposition.encode import TextRenderer
from ...exposition.selfmetrics import SelfMetric, SelfMetrics, describe
from ...spec import MetricSpec, Spec
from ..mapper import series_cap
from .base import Collector, Context, Sample

# {metric: {label values: value}}: a collector's samples grouped for the scrape
Rows = dict[str, dict[tuple[str, ...], float]]

COLLECTOR_DURATION_SECONDS = SelfMetric("verl_exporter_collector_duration_seconds")
COLLECTOR_SUCCESS = SelfMetric("verl_exporter_collector_success")
COLLECTOR_LAST_SUCCESS_TIMESTAMP_SECONDS = SelfMetric("verl_exporter_collector_last_success_timestamp_seconds")
SERIES_DROPPED = SelfMetric("verl_exporter_series_dropped_total")

log = logging.getLogger(__name__)

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
        # A family that still fails to render (values are checked in _group) costs only itself, counted.
        self._renderer = TextRenderer(self._const, on_error=lambda name, e: self_metrics.problem(
            "exposition", "family", f"family {name} left out of /metrics: {describe(e)}"))
        self._interval = interval
        self._slow_interval = slow_interval
        # collector name -> (fast rows, slow rows, both merged under the caps) as {metric: {label values: value}};
        # replaced whole, never mutated
        self._latest: dict[str, tuple[Rows, Rows, Rows]] = {c.name: ({}, {}, {}) for c in self.collectors}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sampled: dict[str, threading.Event] = {}  # collector name -> set once its first sample is done
        self._started = False

    def start(self) -> Sampler:
        self._started = True
        for c in self.collectors:
            self._start_thread(c)
        return self

    def add(self, c: Collector) -> None:
        """Add a collector, also while running (e.g. Monitor.grad_watch() after start)."""
        self._latest[c.name] = ({}, {}, {})
        self.collectors.append(c)
        if self._started:
            self._start_thread(c)

    def wait_first_samples(self, timeout: float) -> list[str]:
        """Wait until every collector has sampled once (each on its own thread), at most timeout seconds in all;
        the names of those still sampling."""
        deadline = time.monotonic() + timeout
        for event in list(self._sampled.values()):
            event.wait(max(0.0, deadline - time.monotonic()))
        return [name for name, event in self._sampled.items() if not event.is_set()]

    def _start_thread(self, c: Collector) -> None:
        self._sampled[c.name] = threading.Event()
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
            self._sampled[c.name].set()
            self._stop.wait(self._interval)

    def run_once(self, c: Collector, slow: bool = True) -> bool:
        """One sample of one collector (the slow reads too when slow=True); True when it succeeded."""
        started = time.perf_counter()
        try:
            fast = self._group(c.name, c.sample())
            slow_rows = self._group(c.name, c.sample_slow()) if slow else self._latest[c.name][1]
            self._latest[c.name] = (fast, slow_rows, self._capped(fast, slow_rows))
            ok = True
        except Exception as e:
            self._self.problem(c.name, "sample", f"sample failed: {e!r}")
            ok = False
        self._self.set(COLLECTOR_DURATION_SECONDS, time.perf_counter() - started,
                       collector=c.name)
        self._self.set(COLLECTOR_SUCCESS, 1 if ok else 0, collector=c.name)
        if ok:
            self._self.set(COLLECTOR_LAST_SUCCESS_TIMESTAMP_SECONDS, time.time(),
                           collector=c.name)
        return ok

    def _group(self, collector: str, samples: Iterable[Sample]) -> Rows:
        """Samples keyed by metric and label values, once per sample rather than on every scrape."""
        out: Rows = {}
        for metric_name, labels, value in samples:
            try:
                metric = self._spec[metric_name]
                key = tuple(str(labels[label]) for label in metric.labels)
            except KeyError as e:
                self._self.problem(collector, "bad_sample", f"sample {metric_name}{labels} does not fit the spec: {e}")
                continue
            try:
                # Checked here, once per sample, so that the scrape never meets a value it cannot render.
                number = float(value)
            except (TypeError, ValueError, OverflowError) as e:
                self._self.problem(collector, "bad_sample", f"sample {metric_name} has a value that is not a "
                                   f"number: {describe(e)}")
                continue
            out.setdefault(metric_name, {})[key] = number
        return out

    def _capped(self, *parts: Rows, count: bool = True) -> Rows:
        """The parts merged by spec entry, each capped by its max_series; what is dropped is counted once
        per sample (never on the scrape path, where every scrape and every HA replica would count it again)."""
        by_metric: Rows = {}
        for part in parts:
            for metric_name, rows in part.items():
                series = by_metric.get(metric_name)
                if series is None:
                    by_metric[metric_name] = series = {}
                cap = series_cap(self._spec[metric_name])
                if len(series) + len(rows) <= cap:
                    series.update(rows)
                    continue
                for key, value in rows.items():
                    if key in series or len(series) < cap:
                        series[key] = value
                    elif count:
                        self._self.inc(SERIES_DROPPED, reason="series_cap")
        return by_metric

    # ------------------------------------------------------------------ scrape side
    def series(self) -> list[tuple[MetricSpec, dict[tuple[str, ...], float]]]:
        """The latest samples of every collector, grouped by spec entry and capped by its max_series."""
        # Each spec entry belongs to one collector, so this merge finds nothing new to drop; it counts nothing.
        by_metric = self._capped(*(merged for _, _, merged in list(self._latest.values())), count=False)
        return [(self._spec[name], by_metric[name]) for name in sorted(by_metric)]

    def render(self, openmetrics: bool = False) -> str:
        """The exposition text of the latest samples (what a scrape serves; see exposition.py)."""
        return self._renderer.render(self.series(), openmetrics)


def build_collectors(enabled: dict[str, bool], ctx: Context) -> list[Collector]:
    """Instantiate the enabled collectors; one whose source is absent here is skipped with one log line."""
    from . import REGISTRY, Unavailable

    out: list[Collector] = []
    off: dict[str, list[str]] = {}  # reason -> collectors, so that one missing driver is one log line
    for name, cls in sorted(REGISTRY.items()):
        if not enabled.get(name, cls.default_enabled):
            continue
        if cls.per_node and ctx.config.local_rank not in (None, 0) and enabled.get(name) is not True:
            continue
        try:
            out.append(cls(ctx))
        except Unavailable as e:
            off.setdefault(str(e), []).append(name)
        except Exception as e:
            ctx.self_metrics.problem(name, "init", f"collector {name} could not start: {e!r}")
    for reason, names in off.items():
        log.info("collector%s %s: off, %s", "s" if len(names) > 1 else "", ", ".join(names), reason)
    return out
