"""In-process circuit breaker: save and stop a run on which the pack would page a critical training alert.

The rules are the spec's critical alerts themselves: every one a trainer process can judge (its kind's
``judge``, spec/kinds/, the Python side of the same declaration that writes its PromQL), on the values handed to
``Monitor.log()`` and the same step-domain detectors (verl_exporter.core.detect) the sidecar runs. What a
trainer cannot see (GPU, host, checkpoint files, the sidecars' `up`) its kind says (``blind_reason``), and
``verl-exporter spec --breaker`` lists both.

An alert "fires" here as in Prometheus: its condition holds on every step (or tick) for its `for`, timed by
the steps' own clock (the time each step was logged), and on at least ``consecutive`` steps. The first alert
that fires trips the breaker once: it writes a diagnosis report (the step, each alert holding with its value,
a resource snapshot), then the Monitor asks for a checkpoint and a stop. A hang logs no step, so the stall
alerts are also judged between steps (``tick``, from the Monitor's worker).

It runs on the Monitor's worker thread, never on the training thread.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.detect import Detectors, finite, keys_of
from ..spec import Spec
from ..spec.rules import duration_seconds


@dataclass
class Anomaly:
    alert: str  # the critical alert whose condition held
    kind: str
    value: float | None  # its $value
    held_s: float = 0.0  # how long it has held (its `for` is reached at for_s)
    for_s: float = 0.0


@dataclass
class Trip:
    step: Any
    time: float
    anomalies: list[Anomaly]
    alert: str  # the alert that fired
    resources: dict = field(default_factory=dict)
    report_path: str | None = None


class _View:
    """What the kinds judge: the latest value of each verl key (as the sidecar's gauges hold it) and the
    detectors' statistics (as verl_detector_* export them)."""

    def __init__(self, spec: Spec, detectors: Detectors):
        self.spec = spec
        self.detectors = detectors
        self.latest: dict[str, float] = {}
        self.now = 0.0
        self.last_step_at: float | None = None
        self._keys: dict[tuple, list[tuple[str, float]]] = {}

    def keys(self, metric: str, labels: dict[str, str]) -> list[tuple[str, float]]:
        k = (metric, tuple(sorted(labels.items())))
        if k not in self._keys:
            self._keys[k] = keys_of(self.spec[metric], labels) if metric in self.spec else []
        return self._keys[k]

    def value(self, metric: str, labels: dict[str, str]) -> float | None:
        for key, scale in self.keys(metric, labels):
            if key in self.latest:
                return self.latest[key] * scale
        return None

    def stat(self, signal: str, stat: str) -> float | None:
        d = self.detectors.by_name.get(signal)
        return None if d is None else d.stats.get(stat)


class _Held:
    """One alert's pending state: since when (and over how many steps) its condition has held."""

    __slots__ = ("alert", "for_s", "since", "steps", "value")

    def __init__(self, alert):
        self.alert = alert
        self.for_s = float(duration_seconds(alert.for_))
        self.since: float | None = None
        self.steps = 0
        self.value: float | None = None


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


def judged_alerts(spec: Spec) -> tuple[list, dict[str, str]]:
    """(the critical alerts the breaker judges, {critical alert it cannot judge: why})."""
    judged, blind = [], {}
    for a in spec.alerts():
        if a.severity != "critical":
            continue
        why = a.blind_reason(spec)
        if why is None:
            judged.append(a)
        else:
            blind[a.alert] = why
    return judged, blind


class CircuitBreaker:
    def __init__(self, alerts: list, spec: Spec, consecutive: int = 1, report_dir: str | None = None,
                 clock=time.time, detectors: Detectors | None = None):
        """alerts: the spec's alerts to judge (judged_alerts); consecutive: the fewest steps a condition must
        hold besides its `for` (1: as Prometheus judges it)."""
        if consecutive < 1:
            raise ValueError("consecutive >= 1 is required")
        self.alerts = list(alerts)
        needed = {s for a in self.alerts for s in a.breaker_signals()}
        self.detectors = detectors if detectors is not None else \
            Detectors([sig for sig in spec.signals() if sig.name in needed], spec)
        self._view = _View(spec, self.detectors)
        # only the keys the judged alerts read are kept (a step logs a hundred or more)
        self._keys = {key for a in self.alerts for metric, labels in a.series_read()
                      for key, _ in self._view.keys(metric, labels)}
        self._held = [_Held(a) for a in self.alerts]
        self._ticked = [h for h in self._held if h.alert.judged_between_steps]
        self._consecutive = consecutive
        self._report_dir = report_dir
        self._clock = clock
        self.tripped: Trip | None = None

    @classmethod
    def from_spec(cls, spec: Spec, **kwargs) -> CircuitBreaker:
        """Every critical alert of the spec that a trainer process can judge, with the signals they read (only
        those: the breaker pays for no signal it does not judge)."""
        return cls(judged_alerts(spec)[0], spec, **kwargs)

    def observe(self, step: Any, data: dict, now: float | None = None) -> tuple[list[Anomaly], Trip | None]:
        """Judge one logged step (``now``: when it was logged). Returns the alerts whose condition holds and, on
        the step that trips the breaker, the Trip."""
        view = self._view
        now = self._clock() if now is None else now
        for key in self._keys.intersection(data):
            raw = data[key]
            if raw is None:
                view.latest[key] = math.nan  # null is verl's NaN
            elif (x := finite(raw)) is not None:
                view.latest[key] = x
            elif isinstance(raw, float):
                view.latest[key] = raw  # +-Inf, NaN
        new = self.detectors.observe(step, data, now) or step is None  # a repeated step judges nothing new
        view.now = now
        view.last_step_at = now
        return self._judge(step, self._held if new else [], now)

    def tick(self, now: float | None = None) -> Trip | None:
        """Judge the alerts that need no new step (a stall) at ``now``."""
        if not self._ticked or self._view.last_step_at is None:
            return None
        now = self._clock() if now is None else now
        self._view.now = now
        return self._judge(None, self._ticked, now, step_counts=False)[1]

    def _judge(self, step, held: list[_Held], now: float, step_counts: bool = True):
        anomalies: list[Anomaly] = []
        fired = None
        for h in held:
            value = h.alert.judge(self._view)
            if value is None:
                h.since, h.steps = None, 0
                continue
            if h.since is None:
                h.since = now
            h.steps += 1 if step_counts else 0
            h.value = value
            a = Anomaly(h.alert.alert, h.alert.kind, value, now - h.since, h.for_s)
            anomalies.append(a)
            # a stall is judged on time alone (it has no steps); the others on their `for` and their steps
            if fired is None and now - h.since >= h.for_s and \
                    (h.alert.judged_between_steps or h.steps >= self._consecutive):
                fired = a
        if self.tripped is not None or fired is None:
            return anomalies, None
        last_step = step if step is not None else self.detectors._last_step
        self.tripped = Trip(step=last_step, time=now, anomalies=anomalies, alert=fired.alert,
                            resources=resource_snapshot())
        self.tripped.report_path = self._write_report(self.tripped)
        return anomalies, self.tripped

    def _write_report(self, trip: Trip) -> str | None:
        if not self._report_dir:
            return None
        path = Path(self._report_dir) / f"verl-exporter-diagnosis-step{trip.step}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = {"step": trip.step, "time": trip.time, "alert": trip.alert,
                   "anomalies": [asdict(a) for a in trip.anomalies], "resources": trip.resources,
                   "judged": [a.alert for a in self.alerts]}
            path.write_text(json.dumps(doc, indent=2, default=str, allow_nan=True), encoding="utf-8")
            return str(path)
        except OSError:
            return None
