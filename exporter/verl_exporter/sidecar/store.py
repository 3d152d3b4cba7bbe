"""The latest training values, fed by the sources and read by the scrape.

``ingest()`` takes one logged step (verl's ``data`` dict) and maps each key through the spec; ``render()``
copies the values under a short lock (``series()``) and renders the text outside it, so a scrape never waits
on a source for longer than one copy and a source never waits on a slow scraper.

Whatever a key or value is (a key whose str() raises, an object whose __float__ does, a huge int, a label
value UTF-8 cannot encode), it costs only itself: it is counted, and the other keys of the step are kept.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from ..core.detect import Detectors
from ..exposition.encode import TextRenderer
from ..exposition.selfmetrics import SelfMetric, SelfMetrics, describe
from ..spec import MetricSpec, Spec
from .events import EventState, SeriesEvents
from .mapper import MAX_KEY_LENGTH, KeyMapper, Resolved, series_cap, unmapped_name

VALUES_REJECTED = SelfMetric("verl_exporter_values_rejected_total")
LABEL_VALUES_ESCAPED = SelfMetric("verl_exporter_label_values_escaped_total")
UNMAPPED_VALUES = SelfMetric("verl_exporter_unmapped_values_total")
SERIES_DROPPED = SelfMetric("verl_exporter_series_dropped_total")
UNMAPPED_SERIES = SelfMetric("verl_exporter_unmapped_series")

COMPONENT = "store"

DEFAULT_MAX_UNMAPPED = 100
# Deeper nesting than this in a logged dict is not flattened further (a guard against cycles and abuse).
MAX_DEPTH = 8
# verl's steps are non-negative integers; above 2**53 a float no longer holds every integer.
_MAX_STEP = 2**53


def flatten(data: Mapping[Any, Any], prefix: str = "", depth: int = 1) -> Iterator[tuple[str, Any]]:
    """verl's dicts are flat; custom code may nest them: {"a": {"b": 1}} is exported as key "a/b"."""
    for key, value in data.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping) and depth < MAX_DEPTH:
            yield from flatten(value, full + "/", depth + 1)
        else:
            yield full, value


def as_number(value: Any) -> float | str:
    """The float a logged value stands for, or the reason it is not a number.

    None is verl's NaN/Inf (orjson writes them as null) and becomes NaN: the signal must not vanish.
    """
    if value is None:
        return math.nan
    if isinstance(value, float):
        return value
    if isinstance(value, (bool, int)):
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits
            return "out_of_range"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, Mapping):
        return "too_deep"
    # numpy scalars and 0-d tensors; never reached on the training thread (see Monitor).
    try:
        if not hasattr(value, "__float__"):
            return "other"
        return float(value)
    except OverflowError:
        return "out_of_range"
    except Exception:  # whatever a custom __float__ (or __getattr__) raises: a bad value, not our bug
        return "not_a_scalar"


def as_step(step: Any) -> float | None:
    """The step as a float, or None when it is not a non-negative integer (verl's steps are)."""
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return None
    if isinstance(step, float) and not step.is_integer():  # also NaN and Inf
        return None
    return float(step) + 0.0 if 0 <= step < _MAX_STEP else None  # + 0.0: step -0.0 is step 0


def _nonfinite(value: float) -> bool:
    return value != value or value in (math.inf, -math.inf)  # without a function call: the hot path


class TrainingStore:
    def __init__(self, spec: Spec, self_metrics: SelfMetrics, const_labels: dict[str, str] | None = None,
                 max_unmapped: int = DEFAULT_MAX_UNMAPPED):
        self._spec = spec
        self._mapper = KeyMapper(spec)
        self._self = self_metrics
        self._const = dict(const_labels or {})
        self._max_unmapped = max_unmapped
        self._lock = threading.Lock()
        # metric name -> {label values -> value}
        self._series: dict[str, dict[tuple[str, ...], float]] = {}
        # sanitised name -> (original key, value)
        self._unmapped: dict[str, tuple[str, float]] = {}
        self._nonfinite: dict[str, float] = {}
        self._step: float | None = None
        self._step_time: float | None = None
        self._step_times: deque[float] = deque(maxlen=21)  # when each of the recent new steps was seen
        self._step_metric = spec.with_field("step")
        self._step_time_metric = spec.with_field("step_time")
        self._nonfinite_metric = spec.with_field("nonfinite")
        self._nonfinite_cap = series_cap(self._nonfinite_metric)
        self._unmapped_specs: dict[str, MetricSpec] = {}
        self._renderer = TextRenderer(self._const, on_error=lambda name, e: self_metrics.problem(
            "exposition", "family", f"family {name} left out of /metrics: {describe(e)}"))
        # Step-domain baselines of the spec's adaptive signals, exported as verl_detector_* gauges.
        self.detectors = Detectors.from_spec(spec)
        # The steps at which the series of the metrics `events:` entries watch arrive (evaluations).
        self._events = SeriesEvents(spec)
        self._watched = self._events.watched
        self._arrived: list[tuple[str, tuple[str, ...]]] = []  # watched series stored from the line being ingested

    # ------------------------------------------------------------------ writing
    def ingest(self, step: Any, data: Mapping[Any, Any], seen_at: float) -> None:
        """Record one logged step. Never raises on bad values: they are counted instead."""
        new_step = False
        with self._lock:
            for key, raw in data.items():
                try:  # free when nothing raises; what does costs this key alone
                    # Fast path first: verl's values are floats and ints; flatten only what is nested.
                    if type(raw) is float and type(key) is str:
                        self._put(key, raw)
                    elif isinstance(raw, Mapping):
                        self._put_nested(key, raw)
                    else:
                        self._put_raw(key, raw)
                except Exception as e:  # every bad input is handled above: this is a bug, with its traceback
                    self._self.problem(COMPONENT, "ingest", f"could not store a value: {describe(e)}")
            for key, resolved in self._mapper.conditional(data):
                value = as_number(data[key])
                if not isinstance(value, str):  # a rejected value was counted once already, above
                    self._put(key, value, resolved)
            valid = as_step(step)
            if valid is not None:
                if valid != self._step:
                    self._step_times.append(seen_at)
                    new_step = True
                if self._step is not None and valid < self._step:  # a resumed run logs its steps again
                    self._events.rewind(valid)
                if self._arrived:
                    self._events.take(valid, seen_at, self._arrived)
                self._step = valid
                self._step_time = seen_at
            elif step is not None:
                self._self.inc(VALUES_REJECTED, reason="bad_step")
            self._arrived.clear()
        if new_step:
            # Outside the lock (a scrape never waits for it); each signal swaps in a new stats dict at once.
            try:
                self.detectors.observe(step, data, seen_at)
            except Exception as e:  # the stored values stay; the baselines skip this step
                self._self.problem(COMPONENT, "detectors", f"the detectors could not take step {step!r}: {describe(e)}")

    def count_nonfinite(self, data: Mapping[Any, Any]) -> None:
        """Count the NaN/Inf values of a logged step without exporting its values.

        For the part of the file before the tail a restarted sidecar recovers from: the NaN counter is a
        function of the whole file, so a restart shows Prometheus the same count, not a reset.
        """
        with self._lock:
            for key, raw in flatten(data, depth=0):  # the values ingest() visits: nested as deep
                value = as_number(raw)
                if not isinstance(value, str) and _nonfinite(value):
                    key = str(key)
                    resolved = self._resolve(key)
                    if not isinstance(resolved, str):
                        self._count_nonfinite(resolved.name if resolved else unmapped_name(key))
            for key, resolved in self._mapper.conditional(data):  # as ingest() counts a stand-in's NaN
                value = as_number(data[key])
                if not isinstance(value, str) and _nonfinite(value):
                    self._count_nonfinite(resolved.name)

    def reset_nonfinite(self) -> None:
        """Forget the NaN counts: the followed file was truncated or replaced (counts are per file)."""
        with self._lock:
            self._nonfinite.clear()

    def _put_nested(self, key: Any, raw: Mapping[Any, Any]) -> None:
        try:
            items = list(flatten(raw, f"{key}/"))
        except Exception:  # a key whose str() raises, a mapping that cannot be iterated
            self._self.inc(VALUES_REJECTED, reason="bad_key")
            return
        for sub_key, sub_raw in items:
            self._put_raw(sub_key, sub_raw)

    def _put_raw(self, key: Any, raw: Any) -> None:
        value = as_number(raw)
        if isinstance(value, str):
            self._self.inc(VALUES_REJECTED, reason=value)
            return
        if type(key) is not str:
            try:
                key = str(key)
            except Exception:  # Monitor.log() takes any hashable key
                self._self.inc(VALUES_REJECTED, reason="bad_key")
                return
        self._put(key, value)

    def _resolve(self, key: str) -> Resolved | None | str:
        """The spec entry a key feeds (None: unmapped), or the reason it is too long to export."""
        if len(key) > MAX_KEY_LENGTH:
            return "key_too_long"
        return self._mapper.resolve(key)  # which refuses a label value too long to export

    def _put(self, key: str, value: float, resolved: Resolved | None | str = None) -> None:
        """Store one value; ``resolved`` when the caller already knows the entry (a key standing in)."""
        if resolved is None:
            resolved = self._mapper.resolve(key) if len(key) <= MAX_KEY_LENGTH else "key_too_long"
        if isinstance(resolved, str):
            self._self.inc(VALUES_REJECTED, reason=resolved)
            return
        if resolved is not None and resolved.escaped:
            self._self.inc(LABEL_VALUES_ESCAPED, reason=resolved.escaped)
        if value != value or value in (math.inf, -math.inf):  # NaN or Inf, without a function call
            # Counted before any cap, and under a name that depends on the key alone, so that the count
            # can be rebuilt from the file after a restart (see count_nonfinite).
            self._count_nonfinite(resolved.name if resolved else unmapped_name(key))
        if resolved is None:
            self._self.inc(UNMAPPED_VALUES)
            self._put_unmapped(key, value)
            return
        series = self._series.get(resolved.name)
        if series is None:
            series = self._series[resolved.name] = {}
        labels = resolved.label_values
        if labels not in series and len(series) >= resolved.cap:
            self._self.inc(SERIES_DROPPED, reason="series_cap")
            return
        series[labels] = value * resolved.scale if resolved.scale != 1.0 else value
        if resolved.name in self._watched:  # an event of this series (an evaluation), taken with the line's step
            self._arrived.append((resolved.name, labels))

    def _count_nonfinite(self, name: str) -> None:
        if name in self._nonfinite or len(self._nonfinite) < self._nonfinite_cap:
            self._nonfinite[name] = self._nonfinite.get(name, 0.0) + 1.0
        else:
            self._self.inc(SERIES_DROPPED, reason="series_cap")

    def _put_unmapped(self, key: str, value: float) -> None:
        name = unmapped_name(key)
        known = self._unmapped.get(name)
        if known is None:
            if len(self._unmapped) >= self._max_unmapped:
                self._self.inc(SERIES_DROPPED, reason="unmapped_cap")
                return
        elif known[0] != key:
            # Two keys that sanitise to one name ("a/b" and "a.b"): the first one keeps it.
            self._self.inc(SERIES_DROPPED, reason="name_clash")
            return
        self._unmapped[name] = (key, value)
        if known is None:  # a new series: the only time the count changes
            self._self.set(UNMAPPED_SERIES, len(self._unmapped))

    # ------------------------------------------------------------------ reading
    @property
    def step(self) -> float | None:
        return self._step

    @property
    def step_time(self) -> float | None:
        return self._step_time

    def view(self, now: float) -> StoreView:
        """The store as the stall alerts judge it at ``now`` (a StepView)."""
        return StoreView(self, now)

    def recent_step_seconds(self) -> float | None:
        """Median time between recent new steps (None until two were seen live)."""
        with self._lock:
            times = list(self._step_times)
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
        return gaps[len(gaps) // 2] if gaps else None

    def events_state(self) -> list[dict[str, Any]]:
        """The events counted so far, as the progress state keeps them across sidecar restarts."""
        with self._lock:
            return self._events.state()

    def restore_events(self, entries: list[EventState]) -> int:
        """Take back the events of a state file (before any line is ingested); returns how many were left out."""
        with self._lock:
            return self._events.restore(entries)

    def nonfinite_counts(self) -> dict[str, float]:
        """NaN/Inf values counted so far, by metric name."""
        with self._lock:
            return dict(self._nonfinite)

    def value(self, name: str, **labels: str) -> float | None:
        """One exported value (None when absent); for tests and the demo's summary."""
        with self._lock:
            if name in self._spec:
                metric = self._spec[name]
                key = tuple(labels[label] for label in metric.labels)
                return self._series.get(name, {}).get(key)
            entry = self._unmapped.get(name)
            return entry[1] if entry else None

    def series(self) -> list[tuple[MetricSpec, dict[tuple[str, ...], float]]]:
        """A consistent copy of every metric's series, taken under the lock; rendered into text outside it."""
        with self._lock:
            series = {name: dict(values) for name, values in self._series.items()}
            unmapped = dict(self._unmapped)
            nonfinite = dict(self._nonfinite)
            step, step_time = self._step, self._step_time
            detector_rows = self.detectors.rows()
            event_rows = self._events.rows()
        out: list[tuple[MetricSpec, dict[tuple[str, ...], float]]] = []
        if step is not None and step_time is not None:  # set together
            out.append((self._step_metric, {(): step}))
            out.append((self._step_time_metric, {(): step_time}))
        out.append((self._nonfinite_metric, {(name,): count for name, count in nonfinite.items()}))
        by_name = self._spec.by_name  # one dict for every family (a lookup through the Spec model costs more)
        out.extend((by_name[name], series[name]) for name in sorted(series))
        out.extend((by_name[name], rows) for name, rows in sorted(detector_rows.items()))
        out.extend(event_rows)
        for name in sorted(unmapped):
            key, value = unmapped[name]
            out.append((self._unmapped_spec(name, key), {(): value}))
        return out

    def _unmapped_spec(self, name: str, key: str) -> MetricSpec:
        """An ad-hoc gauge entry for an unmapped key (cached: the cap bounds how many there are)."""
        metric = self._unmapped_specs.get(name)
        if metric is None:
            # built, not validated: the file's checks would refuse the name (UNMAPPED_PREFIX is reserved for
            # exactly this) and the missing feed
            metric = MetricSpec.model_construct(name=name, type="gauge", help=f"Unmapped verl key {key!r} "
                                                "(no spec entry matches it).", layer="data")
            self._unmapped_specs[name] = metric
        return metric

    def render(self, openmetrics: bool = False) -> str:
        return self._renderer.render(self.series(), openmetrics)


class StoreView:
    """The StepView (spec/kinds/base.py) of a sidecar's store at one moment: the last step's time and the
    step-domain signals' statistics as verl_detector_* export them. What the sidecar's judges of the stall
    alerts read between steps: the forensics trigger and /healthz (sidecar/forensics.py)."""

    def __init__(self, store: TrainingStore, now: float):
        self._store = store
        self.now = now

    @property
    def last_step_at(self) -> float | None:
        return self._store.step_time

    def value(self, metric: str, labels: dict[str, str]) -> float | None:
        return None  # a stall reads no value

    def stat(self, signal: str, stat: str) -> float | None:
        d = self._store.detectors.by_name.get(signal)
        return None if d is None else d.stats.get(stat)
