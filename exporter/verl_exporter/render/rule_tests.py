"""promtool unit tests generated from the spec: for every alert, one case where it must stay silent and one
where it must fire, with its full labels and expanded annotations.

Input series are built from the alert's kind and threshold (or given in the spec's ``test:`` for expr
alerts). Timing: series move from healthy to faulty at ``SHIFT``; the firing case is evaluated at the
shift plus the alert's ``for`` plus two evaluation intervals (plus the 5m lookback for absences).
"""

from __future__ import annotations

import math
import re

from ..spec import Spec
from ..spec.rules import TEMPLATE_RE, Alert, duration_seconds
from .promql import equality_matchers, output_labels

INTERVAL_M = 1  # minutes between input samples, and between rule evaluations in the tests
SHIFT = 60  # minute at which the fault starts (after every window of the pack has filled)
TAIL = 10  # samples after the firing evaluation
BASE_LABELS = {"instance": "node0:9477", "run": "r1", "rank": "0"}


def go_printf(fmt: str, value: float) -> str:
    """Go's fmt for %.Ng / %.Nf, as Prometheus's template `printf` writes it."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return fmt % value


def expand(text: str, value: float, labels: dict[str, str]) -> str:
    """Expand the Go-template subset the spec allows (checked at load), exactly as Prometheus would."""

    def one(m: re.Match) -> str:
        inner = m.group(1)
        if inner.startswith("$labels."):
            return labels.get(inner[len("$labels."):], "")
        return go_printf(re.search(r'"(%\.\d+[gf])"', inner).group(1), value)

    return TEMPLATE_RE.sub(one, text)


def _fmt(v: float) -> str:
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _series_text(values: list[float | None]) -> str:
    """promtool's series notation, run-length compressed: '1x9 2x4 _x3'."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        if values[i] is None:  # promtool: "_xN" is N missing samples, "axN" is N + 1 samples of a
            out.append("_" if j == i else f"_x{j - i + 1}")
        else:
            out.append(_fmt(values[i]) if j == i else f"{_fmt(values[i])}x{j - i}")
        i = j + 1
    return " ".join(out)


def _bad_and_ok(alert: Alert) -> tuple[float, float]:
    t = float(alert.threshold)
    explicit = alert.test
    if "ok" in explicit and "bad" in explicit:
        return float(explicit["ok"]), float(explicit["bad"])
    above = alert.op in (">", ">=")
    step = abs(t) if t else 1.0
    return (t - step / 2, t + step) if above else (t + step, t - step / 2)


def _adaptive_values(alert: Alert, total: int) -> tuple[list[float], float]:
    """An alternating healthy baseline (stddev d) then a sustained shift that is k-plus sigmas away."""
    base, d = 100.0, 1.0
    floor = d + alert.rel_floor * base
    delta = 2.0 * alert.k * floor + d
    sign = -1.0 if alert.direction == "down" else 1.0
    values = [base + (d if i % 2 else -d) for i in range(SHIFT)] + [base + sign * delta] * (total - SHIFT)
    return values, sign * delta


def _metric_labels(spec: Spec, alert: Alert) -> dict[str, str]:
    metric = spec[alert.metric]
    given = equality_matchers(alert.matchers)
    return {name: given.get(name, "a") for name in metric.labels}


def _fire_minute(alert: Alert) -> int:
    extra = 5 if alert.kind == "absent" else 0  # a vanished series stays visible for the 5m lookback
    return SHIFT + duration_seconds(alert.for_) // 60 + 2 * INTERVAL_M + extra


def case_for(spec: Spec, alert: Alert) -> dict:
    """One promtool test group for an alert: silent before the fault, firing after it."""
    if alert.kind == "expr":
        return expr_case(spec, alert)
    if alert.kind == "detector":
        return detector_case(spec, alert)
    sel_labels = equality_matchers(spec.rules.selector) or {"job": "verl"}
    series_labels = {**sel_labels, **BASE_LABELS, **_metric_labels(spec, alert)}
    fire_at = _fire_minute(alert)
    silent_at = SHIFT - 5
    value: float = 0.0
    name = alert.metric
    if alert.kind == "trend":
        fire_at = SHIFT + duration_seconds(alert.window) // 60 + duration_seconds(alert.for_) // 60 + 2
    elif alert.kind == "stale":
        fire_at = SHIFT + math.ceil(float(alert.threshold) / 60) + duration_seconds(alert.for_) // 60 + 2
    total = fire_at + TAIL
    if alert.kind == "threshold":
        ok, bad = _bad_and_ok(alert)
        values = [ok] * SHIFT + [bad] * (total - SHIFT)
        value = bad
    elif alert.kind == "nonfinite":
        name = "verl_training_nonfinite_values_total"
        series_labels = {**sel_labels, **BASE_LABELS, "metric": alert.metric}
        values = [0.0] * SHIFT + [1.0] * (total - SHIFT)
    elif alert.kind == "adaptive":
        values, _ = _adaptive_values(alert, total)
    elif alert.kind == "trend":
        t = float(alert.threshold)
        start = t / 2 if t else -1.0
        horizon_m = duration_seconds(alert.horizon) / 60
        slope = 2 * (abs(t - start) or 1.0) / horizon_m * (1 if alert.op in (">", ">=") else -1)
        values = [start] * SHIFT + [start + slope * (i + 1) for i in range(total - SHIFT)]
    elif alert.kind == "stale":
        # A unix-time gauge that advances with time, then stops: its age grows past the threshold.
        values = [i * 60.0 for i in range(SHIFT)] + [(SHIFT - 1) * 60.0] * (total - SHIFT)
        value = fire_at * 60.0 - (SHIFT - 1) * 60.0
    else:  # absent
        values = [1.0] * SHIFT + [None] * (total - SHIFT)
    labels_text = ", ".join(f'{k}="{v}"' for k, v in series_labels.items())
    input_series = [{"series": f"{name}{{{labels_text}}}", "values": _series_text(values)}]
    out_labels = output_labels(alert, series_labels, spec.rules.selector)
    return _group(spec, alert, input_series, silent_at, fire_at, out_labels, value)


def detector_case(spec: Spec, alert: Alert) -> dict:
    """The detector's gauges of the signal (and of the first confirming signal) move from normal to a
    sustained deviation of twice the alert's k at the shift."""
    base = {**(equality_matchers(spec.rules.selector) or {"job": "verl"}), **BASE_LABELS}
    total = _fire_minute(alert) + TAIL
    series = []
    for signal, direction, k, change in [(alert.signal, alert.direction, alert.k, alert.change)] + \
            [(c.signal, c.direction, c.k, c.change) for c in alert.confirm[:1]]:
        sign = -1.0 if direction == "down" else 1.0
        stat = "sustained_drop_zscore" if direction == "down" else "sustained_rise_zscore"
        labels = ", ".join(f'{key}="{v}"' for key, v in {**base, "signal": signal}.items())
        series.append({"series": f"verl_detector_{stat}{{{labels}}}",
                       "values": _series_text([0.0] * SHIFT + [2.0 * k] * (total - SHIFT))})
        if change:
            series.append({"series": f"verl_detector_relative_change{{{labels}}}",
                           "values": _series_text([0.0] * SHIFT + [sign * 2.0 * change] * (total - SHIFT))})
    return _group(spec, alert, series, SHIFT - 5, _fire_minute(alert), {**base, "signal": alert.signal},
                  2.0 * alert.k)


def expr_case(spec: Spec, alert: Alert) -> dict:
    """An expr alert brings its own test: input series, silent_at, fire_at, the labels and $value expected."""
    t = alert.test
    input_series = [{"series": s["series"], "values": s["values"]} for s in t["input"]]
    return _group(spec, alert, input_series, _minutes(t["silent_at"]), _minutes(t["fire_at"]),
                  {str(k): str(v) for k, v in t.get("labels", {}).items()}, float(t.get("value", 0.0)))


def _minutes(text) -> int:
    return duration_seconds(str(text)) // 60


def _group(spec: Spec, alert: Alert, input_series: list[dict], silent_at: int, fire_at: int,
           out_labels: dict[str, str], value: float) -> dict:
    labels = {**out_labels, **alert.labels, "severity": alert.severity}
    annotations = {
        "summary": expand(alert.summary, value, out_labels),
        "description": expand(alert.description, value, out_labels),
        "runbook_url": f"{spec.rules.runbook_url}#{alert.alert.lower()}",
    }
    return {
        "name": f"{alert.alert}: silent at {silent_at}m, firing at {fire_at}m",
        "interval": f"{INTERVAL_M}m",
        "input_series": input_series,
        "alert_rule_test": [
            {"eval_time": f"{silent_at}m", "alertname": alert.alert, "exp_alerts": []},
            {"eval_time": f"{fire_at}m", "alertname": alert.alert,
             "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}]},
        ],
    }


def all_cases(spec: Spec) -> list[dict]:
    return [case_for(spec, a) for a in spec.alerts()]

