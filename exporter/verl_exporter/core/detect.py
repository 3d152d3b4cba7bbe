"""Step-domain baselines: robust statistics over the last N *steps* of the signals the spec marks with `detect:`.

verl logs one value per step and a step lasts 5 s to over 10 minutes, so a baseline over a time window holds
anywhere from 1 to 700 steps. Here every baseline is counted in steps instead. At each new step each signal
compares its value with the window of the steps before it:

  expected   the window's trend projected to this step: the median of its recent half plus the slope
             between the medians of its two halves (a rising learning curve is a trend, not variance),
             kept within the window's range
  spread     the noise around that trend: 1.4826 * MAD of the step-to-step differences / sqrt(2), floored by
             a share of the level and an absolute floor, so a flat series cannot make an infinite z-score
  zscore     (value - expected) / spread; the sustained rise / drop is the weakest of the last `hold` steps,
             so one odd batch is never an anomaly
  spike_ratio  the largest value / window_max of the last `hold` steps (a jump stays visible for hold steps)
  level      median of the last few steps; peak_level / floor_level: its highest and lowest since the start
  slope_per_second   the window's slope divided by the median step time (memory growth per second)

Nothing is exported for a signal before its window holds `min_steps` distinct steps (at least 10). The window
is rebuilt after a sidecar restart from the lines the follower recovers from the file's tail. The sidecar
(through the store) and the in-process circuit breaker both use this module, so both judge alike.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import median
from typing import Any

# The gauges a signal may export (each declared in the spec as verl_detector_<stat>, label `signal`).
STATS = ("steps", "zscore", "sustained_rise_zscore", "sustained_drop_zscore", "expected", "spread",
         "relative_change", "level", "peak_level", "floor_level", "window_max", "spike_ratio", "held_min",
         "slope_per_second")
MIN_STEPS_FLOOR = 10  # no adaptive alert may fire before this many distinct steps
_MAD_TO_SIGMA = 1.4826 / math.sqrt(2.0)  # MAD of differences of N(0, s) noise -> s
STEP_METRIC = "verl_timing_seconds"  # its phase=step series is the step's duration, under each verl key scheme


def step_seconds_keys(spec) -> list[str]:
    """The verl keys of a step's duration (timing_s/step today, timing/step in older verl), from the spec."""
    try:
        return [key for key, _ in keys_of(spec[STEP_METRIC], {"phase": "step"})]
    except (KeyError, TypeError):  # no spec, or one without the metric
        return ["timing_s/step"]


def step_duration(data: Mapping[str, Any], keys: list[str]) -> float | None:
    """The step's logged duration in seconds, or None."""
    for key in keys:
        d = data.get(key)
        # Compared, not math.isfinite(): that raises OverflowError for an int of 400 digits.
        if isinstance(d, (int, float)) and not isinstance(d, bool) and 0 < d <= sys.float_info.max:
            return float(d)
    return None


@dataclass(frozen=True)
class SignalSpec:
    """One adaptive signal: which metric series feeds it and how its baseline is built (from the spec)."""

    name: str
    metric: str
    labels: tuple[tuple[str, str], ...] = ()
    window: int = 30  # steps in the baseline window
    hold: int = 3  # steps a deviation must last to count as sustained
    level_steps: int = 5  # steps in the running level (a median)
    min_steps: int = MIN_STEPS_FLOOR
    floor: float = 0.0  # absolute floor of the spread
    rel_floor: float = 0.02  # floor of the spread as a share of |expected|
    trend: bool = True  # project the window's trend (off for values that should be flat)
    export: tuple[str, ...] = ("steps", "zscore", "sustained_rise_zscore", "sustained_drop_zscore")


def keys_of(metric, labels: Mapping[str, str]) -> list[tuple[str, float]]:
    """The verl keys (and their scale) that feed one series of a spec metric: literal sources whose constant
    labels agree, and `match:` patterns filled in from the labels."""
    out: list[tuple[str, float]] = []
    for rule in metric.sources:
        if any(rule.const_labels.get(k, v) != v for k, v in labels.items()):
            continue
        if rule.literal:
            if all(labels.get(k) == v for k, v in rule.const_labels.items()):
                out.append((rule.pattern, rule.scale))
            continue
        key = rule.pattern
        for name in rule.regex.groupindex:
            if name not in labels:
                break
            key = key.replace("{" + name + "}", labels[name])
        else:
            if "{" not in key and rule.regex.fullmatch(key):
                out.append((key, rule.scale))
    return out


class SignalDetector:
    """The rolling state of one signal. ``observe`` costs O(window log window) per step."""

    def __init__(self, spec: SignalSpec, keys: list[tuple[str, float]] | None = None):
        self.spec = spec
        self.keys = list(keys or [])
        self.values: deque[float] = deque(maxlen=spec.window)
        self.zs: deque[float] = deque(maxlen=spec.hold)
        self.spikes: deque[float] = deque(maxlen=spec.hold)
        self.recent: deque[float] = deque(maxlen=max(spec.level_steps, spec.hold))
        self.last_step: Any = None
        self.peak: float | None = None
        self.floor_level: float | None = None
        self.stats: dict[str, float] = {"steps": 0.0}

    def value_in(self, data: Mapping[str, Any]) -> float | None:
        for key, scale in self.keys:
            raw = data.get(key)
            if raw is None or isinstance(raw, bool) or not isinstance(raw, (int, float)):
                continue  # absent, or NaN/Inf (null): the nonfinite alerts' business
            try:
                x = float(raw) * scale
            except OverflowError:  # an int beyond a float's range
                continue
            if math.isfinite(x):
                return x
        return None

    def compare(self, x: float) -> dict[str, float]:
        """The value against the window of the steps before it (changes nothing); empty before min_steps."""
        s, n = self.spec, len(self.values)
        if n < s.min_steps:
            return {}
        v = list(self.values)
        h = n // 2
        m1, m2 = median(v[: n - h]), median(v[n - h:])
        c1, c2 = (n - h - 1) / 2, (n - h) + (h - 1) / 2
        slope = (m2 - m1) / (c2 - c1)
        expected = m2 + slope * (n - c2) if s.trend else median(v)
        expected = min(max(expected, min(v)), max(v))  # never extrapolate past the window (e.g. after a break)
        diffs = [b - a for a, b in zip(v, v[1:], strict=False)]
        md = median(diffs)
        spread = _MAD_TO_SIGMA * median(abs(d - md) for d in diffs)
        spread = max(spread, s.rel_floor * abs(expected), s.floor, 1e-12)
        return {"zscore": (x - expected) / spread, "expected": expected, "spread": spread, "window_max": max(v),
                "relative_change": (x - expected) / abs(expected) if expected else 0.0, "slope": slope}

    def observe(self, step: Any, x: float, step_seconds: float | None = None) -> dict[str, float]:
        """Take the value of a new step; a repeated step (a duplicate line) is ignored."""
        if step is not None and step == self.last_step:
            return self.stats
        self.last_step = step
        s = self.spec
        stats = self.compare(x)
        slope = stats.pop("slope", None)
        if stats:
            self.zs.append(stats["zscore"])
            if stats["window_max"] > 0:
                self.spikes.append(x / stats["window_max"])
                stats["spike_ratio"] = max(self.spikes)
            if len(self.zs) == s.hold:
                stats["sustained_rise_zscore"] = min(self.zs)
                stats["sustained_drop_zscore"] = -max(self.zs)
            if step_seconds and step_seconds > 0:
                stats["slope_per_second"] = slope / step_seconds
        n = len(self.values)
        self.values.append(x)
        self.recent.append(x)
        if len(self.recent) >= s.hold:
            stats["held_min"] = min(list(self.recent)[-s.hold:])
        if len(self.recent) >= s.level_steps:
            level = median(list(self.recent)[-s.level_steps:])
            stats["level"] = level
            if n + 1 >= s.min_steps:  # the extremes of the running level, once it means something
                self.peak = level if self.peak is None else max(self.peak, level)
                self.floor_level = level if self.floor_level is None else min(self.floor_level, level)
                stats.update(peak_level=self.peak, floor_level=self.floor_level)
        stats["steps"] = float(len(self.values))
        self.stats = stats
        return stats


class Detectors:
    """Every signal of the spec; fed one logged step (verl's ``data`` dict) at a time."""

    def __init__(self, signals: list[SignalSpec] | tuple[SignalSpec, ...], spec=None):
        self.detectors: list[SignalDetector] = []
        for sig in signals:
            keys = keys_of(spec[sig.metric], dict(sig.labels)) if spec is not None else []
            self.detectors.append(SignalDetector(sig, keys))
        self.by_name = {d.spec.name: d for d in self.detectors}
        self._step_keys = step_seconds_keys(spec)
        window = max((sig.window for sig in signals), default=30)
        self._durations: deque[float] = deque(maxlen=window)
        self._last_step: Any = None
        self._last_seen: float | None = None

    @classmethod
    def from_spec(cls, spec) -> Detectors:
        return cls(spec.signals(), spec)

    def step_seconds(self) -> float | None:
        return median(self._durations) if self._durations else None

    def observe(self, step: Any, data: Mapping[str, Any], seen_at: float | None = None) -> bool:
        """Feed one line; False when it was not a new step (then nothing changes)."""
        if step is None or step == self._last_step:
            return False
        self._last_step = step
        duration = step_duration(data, self._step_keys)
        if duration is not None:
            self._durations.append(duration)
        elif seen_at is not None and self._last_seen is not None and seen_at > self._last_seen:
            self._durations.append(seen_at - self._last_seen)
        self._last_seen = seen_at
        step_seconds = self.step_seconds()
        for d in self.detectors:
            x = d.value_in(data)
            if x is not None:
                d.observe(step, x, step_seconds)
        return True

    def rows(self) -> dict[str, dict[tuple[str, ...], float]]:
        """{gauge name: {(signal,): value}} of what each signal exports (its `export` list)."""
        out: dict[str, dict[tuple[str, ...], float]] = {}
        for d in self.detectors:
            if not d.values:  # a signal this rank never logs (every rank but the driver) costs no series
                continue
            for stat in d.spec.export:
                value = d.stats.get(stat)
                if value is not None:
                    out.setdefault(f"verl_detector_{stat}", {})[(d.spec.name,)] = value
        return out
