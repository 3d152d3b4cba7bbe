"""In-process circuit breaker (seed 003): stop a run that keeps producing critical anomalies.

Per-key detectors look at the values handed to ``Monitor.log()``:
  nonfinite  the value is NaN or Inf (verl writes them as null)
  threshold  the value crosses a fixed line
  zscore     the value is more than k robust spreads from the baseline of its recent steps
  detector   a spec `detector` alert: a signal's sustained deviation (and, if the alert asks, a second
             signal's), judged by the same step-domain detectors (verl_exporter.core.detect) as the sidecar's
A step with at least one anomaly extends a streak; N consecutive anomalous steps trip the breaker once:
it writes a diagnosis report (the step, each offending value with its window statistics, a resource
snapshot), then asks for a checkpoint and a stop through the Monitor.

The rules come from the spec's critical alerts by default, so the breaker and the alert pack agree on
what "critical" means. It runs on the Monitor's worker thread, never on the training thread, and costs
O(rules x window log window) per step.
"""

from __future__ import annotations

import json
import math
import operator
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.detect import Detectors, SignalDetector, SignalSpec
from ..spec import Spec

OPS = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}


@dataclass(frozen=True)
class Rule:
    key: str  # verl key, e.g. actor/grad_norm (kind detector: the signal's name)
    kind: str  # nonfinite | threshold | zscore | detector
    op: str = ">"
    threshold: float = 0.0
    k: float = 4.0
    direction: str = "up"  # for zscore and detector: up | down | both
    rel_floor: float = 0.05
    source: str = ""  # the alert it was derived from
    change: float = 0.0  # detector: the relative change the deviation must also reach
    confirm: tuple = ()  # detector: (signal, direction, k, change) of which one must deviate too


@dataclass
class Anomaly:
    key: str
    kind: str
    value: float | None
    mean: float | None = None
    stddev: float | None = None
    z: float | None = None
    threshold: float | None = None
    rule: str = ""


@dataclass
class Trip:
    step: Any
    time: float
    anomalies: list[Anomaly]
    streak: list[dict]
    resources: dict = field(default_factory=dict)
    report_path: str | None = None


def _key_of(metric, matchers: dict[str, str]) -> str | None:
    """The verl key an alert on this metric watches: a literal source, or a pattern filled by matchers."""
    for rule in metric.source:
        if rule.literal and all(rule.labels.get(k) == v for k, v in matchers.items()):
            return rule.pattern
        if "{" in rule.pattern and not rule.pattern.startswith("(") and rule.compiled is not None:
            names = rule.compiled.groupindex
            if set(names) <= set(matchers) and all(rule.labels.get(k, v) == v for k, v in matchers.items()):
                key = rule.pattern
                for name in names:
                    key = key.replace("{" + name + "}", matchers[name])
                if rule.compiled.fullmatch(key):
                    return key
    return None


def rules_from_spec(spec: Spec) -> list[Rule]:
    """Breaker rules from the spec's critical alerts that watch a single verl key."""
    from ..spec.rules import equality_matchers

    out = []
    for alert in spec.alerts():
        if alert.severity != "critical" or alert.metric not in spec:
            continue
        metric = spec[alert.metric]
        key = _key_of(metric, equality_matchers(alert.matchers))
        if key is None:
            continue
        if alert.kind == "nonfinite":
            out.append(Rule(key=key, kind="nonfinite", source=alert.alert))
        elif alert.kind == "threshold":
            out.append(Rule(key=key, kind="threshold", op=alert.op, threshold=float(alert.threshold),
                            source=alert.alert))
        elif alert.kind == "adaptive":
            out.append(Rule(key=key, kind="zscore", k=alert.k, direction=alert.direction,
                            rel_floor=alert.rel_floor, source=alert.alert))
    return out


def detector_rules_from_spec(spec: Spec) -> list[Rule]:
    """Breaker rules from the spec's critical `detector` alerts (signals, not keys)."""
    return [Rule(key=a.signal, kind="detector", k=a.k, direction=a.direction, change=a.change, source=a.alert,
                 confirm=tuple((c.signal, c.direction, c.k, c.change) for c in a.confirm))
            for a in spec.alerts() if a.severity == "critical" and a.kind == "detector"]


def deviates(stats: dict[str, float], direction: str, k: float, change: float) -> float | None:
    """The sustained z-score if a detector's latest stats deviate as asked (the PromQL of a detector alert,
    render.promql.detector_cond, in Python), else None."""
    for d in (("down", "up") if direction == "both" else (direction,)):
        stat = "sustained_drop_zscore" if d == "down" else "sustained_rise_zscore"
        z = stats.get(stat)
        rel = stats.get("relative_change", 0.0)
        if z is not None and z > k and (not change or (rel < -change if d == "down" else rel > change)):
            return z
    return None


def resource_snapshot() -> dict:
    """What the process and host look like at the trip; torch only if the program already imported it."""
    snap: dict[str, Any] = {"pid": os.getpid()}
    try:
        import psutil

        proc = psutil.Process()
        vm = psutil.virtual_memory()
        snap.update(process_rss_bytes=proc.memory_info().rss, host_memory_available_bytes=vm.available,
                    host_memory_total_bytes=vm.total, load_average=list(os.getloadavg()))
    except Exception as e:  # a snapshot is best effort
        snap["psutil_error"] = repr(e)
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                d = torch.cuda.current_device()
                snap["cuda"] = {"device": d, "allocated_bytes": torch.cuda.memory_allocated(d),
                                "reserved_bytes": torch.cuda.memory_reserved(d),
                                "peak_allocated_bytes": torch.cuda.max_memory_allocated(d)}
        except Exception as e:
            snap["cuda_error"] = repr(e)
    return snap


class CircuitBreaker:
    def __init__(self, rules: list[Rule], window: int = 50, min_samples: int = 10, consecutive: int = 3,
                 report_dir: str | None = None, clock=time.time, detectors: Detectors | None = None):
        """detectors: the spec's signals (Detectors.from_spec), needed by rules of kind detector."""
        if consecutive < 1 or window < 2 or min_samples < 2:
            raise ValueError("consecutive >= 1, window >= 2 and min_samples >= 2 are required")
        self.rules = [r for r in rules if r.kind != "detector"]
        self._by_key: dict[str, list[Rule]] = {}
        for r in self.rules:
            self._by_key.setdefault(r.key, []).append(r)
        # A zscore rule is a one-key signal of the shared detector: a baseline of its last `window` steps,
        # flat (no trend), floored by rel_floor of its level, deciding on the step itself (hold 1).
        self._windows = {r.key: SignalDetector(SignalSpec(name=r.key, metric="", window=window, hold=1,
                                                          min_steps=min_samples, rel_floor=r.rel_floor,
                                                          trend=False))
                         for r in self.rules if r.kind == "zscore"}
        self.detector_rules = [r for r in rules if r.kind == "detector"]
        self.detectors = detectors
        self._min_samples = min_samples
        self._consecutive = consecutive
        self._report_dir = report_dir
        self._clock = clock
        self._streak: deque[dict] = deque(maxlen=consecutive)
        self.tripped: Trip | None = None

    @classmethod
    def from_spec(cls, spec: Spec, **kwargs) -> CircuitBreaker:
        """The spec's critical alerts as rules, with the spec's signals their detector alerts read (only those:
        the breaker pays for no signal it does not judge)."""
        detector_rules = detector_rules_from_spec(spec)
        needed = {r.key for r in detector_rules} | {c[0] for r in detector_rules for c in r.confirm}
        return cls(rules_from_spec(spec) + detector_rules,
                   detectors=Detectors([sig for sig in spec.signals() if sig.name in needed], spec), **kwargs)

    def observe(self, step: Any, data: dict) -> tuple[list[Anomaly], Trip | None]:
        """Check one step. Returns its anomalies and, on the step that trips the breaker, the Trip."""
        anomalies: list[Anomaly] = []
        for key, rules in self._by_key.items():
            if key not in data:
                continue
            raw = data[key]
            value = math.nan if raw is None else _as_float(raw)  # null is verl's NaN
            if value is None:
                continue  # not a number at all (a string): nothing to judge
            finite = math.isfinite(value)
            outlier = False
            for rule in rules:
                a = self._check(rule, value, finite)
                if a is not None:
                    anomalies.append(a)
                    outlier = outlier or a.kind == "zscore"
            # Outliers stay out of the window: a sustained shift keeps counting instead of becoming normal.
            if finite and not outlier and key in self._windows:
                self._windows[key].values.append(value)
        if self.detector_rules and self.detectors is not None and self.detectors.observe(step, data):
            anomalies.extend(self._check_detectors())
        if self.tripped is not None:
            return anomalies, None
        if anomalies:
            self._streak.append({"step": step, "anomalies": [asdict(a) for a in anomalies]})
        else:
            self._streak.clear()
        if len(self._streak) >= self._consecutive:
            self.tripped = Trip(step=step, time=self._clock(), anomalies=anomalies, streak=list(self._streak),
                                resources=resource_snapshot())
            self.tripped.report_path = self._write_report(self.tripped)
            return anomalies, self.tripped
        return anomalies, None

    def _check(self, rule: Rule, value: float, finite: bool) -> Anomaly | None:
        if rule.kind == "nonfinite":
            return None if finite else Anomaly(rule.key, "nonfinite", value, rule=rule.source)
        if not finite:
            return None  # NaN is the nonfinite rule's business
        if rule.kind == "threshold":
            if OPS[rule.op](value, rule.threshold):
                return Anomaly(rule.key, "threshold", value, threshold=rule.threshold, rule=rule.source)
            return None
        w = self._windows[rule.key]
        if len(w.values) < self._min_samples:
            return None
        stats = w.compare(value)  # the shared detector's statistics; the caller decides if the value joins
        z, mean, spread = stats["zscore"], stats["expected"], stats["spread"]
        hit = z > rule.k if rule.direction == "up" else z < -rule.k if rule.direction == "down" else abs(z) > rule.k
        return Anomaly(rule.key, "zscore", value, mean, spread, z, rule=rule.source) if hit else None

    def _check_detectors(self) -> list[Anomaly]:
        out = []
        for rule in self.detector_rules:
            det = self.detectors.by_name.get(rule.key)
            if det is None:
                continue
            z = deviates(det.stats, rule.direction, rule.k, rule.change)
            if z is None:
                continue
            confirmed = not rule.confirm or any(
                (d := self.detectors.by_name.get(sig)) is not None and deviates(d.stats, direction, k, change)
                is not None for sig, direction, k, change in rule.confirm)
            if confirmed:
                out.append(Anomaly(rule.key, "detector", det.values[-1] if det.values else None,
                                   det.stats.get("expected"), det.stats.get("spread"), z, rule=rule.source))
        return out

    def _write_report(self, trip: Trip) -> str | None:
        if not self._report_dir:
            return None
        path = Path(self._report_dir) / f"verl-exporter-diagnosis-step{trip.step}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = {"step": trip.step, "time": trip.time, "anomalies": [asdict(a) for a in trip.anomalies],
                   "streak": trip.streak, "resources": trip.resources,
                   "rules": [asdict(r) for r in self.rules]}
            path.write_text(json.dumps(doc, indent=2, default=str, allow_nan=True), encoding="utf-8")
            return str(path)
        except OSError:
            return None


def _as_float(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return float(raw)
    try:
        return float(raw)
    except Exception:  # a string, an int beyond a float's range, an object whose __float__ raises
        return None
