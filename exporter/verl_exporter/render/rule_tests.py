"""promtool unit tests generated from the spec: for every alert, one case where it must stay silent and one
where it must fire, with its full labels and expanded annotations.

Input series are built from the alert's kind and threshold (or given in the spec's ``test:`` for expr
alerts). Timing: series move from healthy to faulty at ``SHIFT``; the firing case is evaluated at the
shift plus the alert's ``for`` plus two evaluation intervals (plus the 5m lookback for absences).
A threshold alert with ``keep_firing_for`` recovers right after that evaluation, and is checked to stay
firing for keep_firing_for and to resolve the minute after.
"""

from __future__ import annotations

import math
import operator
import re

from ..spec import Spec
from ..spec.rules import TEMPLATE_RE, Alert, duration_seconds, fill_test_text
from .promql import alert_expr, equality_matchers, keeps_label, output_labels, selector_labels

INTERVAL_M = 1  # minutes between input samples, and between rule evaluations in the tests
SHIFT = 60  # minute at which the fault starts (after every window of the pack has filled)
TAIL = 10  # samples after the firing evaluation
BASE_LABELS = {"instance": "node0:9477", "run": "r1", "rank": "0"}
OPS = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}


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
        ok, bad = float(explicit["ok"]), float(explicit["bad"])
        fires = OPS[alert.op]
        if fires(bad, t) and not fires(ok, t):  # still right for an overridden threshold
            return ok, bad
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
    sel_labels = selector_labels(spec.rules.selector)
    series_labels = {**sel_labels, **BASE_LABELS, **_metric_labels(spec, alert)}
    fire_at = _fire_minute(alert)
    silent_at = SHIFT - 5
    value: float = 0.0
    name = alert.metric
    if alert.kind == "trend":
        fire_at = SHIFT + duration_seconds(alert.window) // 60 + duration_seconds(alert.for_) // 60 + 2
    elif alert.kind == "stale":
        fire_at = SHIFT + math.ceil(float(alert.threshold) / 60) + duration_seconds(alert.for_) // 60 + 2
    held = 0  # minutes a threshold alert with keep_firing_for is checked to stay firing after it recovers
    if alert.kind == "threshold" and alert.keep_firing_for:
        held = math.ceil(duration_seconds(alert.keep_firing_for) / 60)
    total = fire_at + held + TAIL
    if alert.kind == "threshold":
        ok, bad = _bad_and_ok(alert)
        # with keep_firing_for the fault ends right after the firing evaluation
        end = fire_at + 1 if held else total
        values = [ok] * SHIFT + [bad] * (end - SHIFT) + [ok] * (total - end)
        value = bad
    elif alert.kind == "nonfinite":
        name = "verl_training_nonfinite_values_total"
        series_labels = {**sel_labels, **BASE_LABELS, "metric": alert.metric}
        # one NaN fires an alert without `for`; with one (an override), NaNs must keep coming
        keep = duration_seconds(alert.for_) > 0
        values = [0.0] * SHIFT + [float(i + 1) if keep else 1.0 for i in range(total - SHIFT)]
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
    return _group(spec, alert, input_series, silent_at, fire_at, out_labels, value, held)


def detector_case(spec: Spec, alert: Alert) -> dict:
    """The detector's gauges of the signal (and of the first confirming signal) move from normal to a
    sustained deviation of twice the alert's k at the shift."""
    base = {**selector_labels(spec.rules.selector), **BASE_LABELS}
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
    """An expr alert brings its own test: input series, silent_at, fire_at, the labels and $value expected.

    Input values and the expected value may be computed from the alert's knobs (<expression>), so the test
    follows an overridden threshold. An overridden `for` moves the test: a shorter one checks silence as
    much earlier (dropped if that is before the start) and firing at the same time; a longer one fires that
    much later, the input's state at fire_at held for the extra minutes (a ramp keeps its step, a counter
    keeps counting) and $value moved by the test's value_slope (per minute, default 0). A `for` longer than
    the baseline an expression compares with makes the alert unable to fire; its test then fails, saying so.
    """
    t = alert.test
    silent_at, fire_at = _minutes(t["silent_at"]), _minutes(t["fire_at"])
    delta = (duration_seconds(alert.for_) - duration_seconds(alert.base_for or alert.for_)) // 60
    # The spec's tests are written for job="verl"; a series of a target gets the selector's labels instead.
    sel = selector_labels(spec.rules.selector)
    input_series = []
    for s in t["input"]:
        values = fill_test_text(str(s["values"]), alert)
        if delta > 0:
            counter = _SERIES_RE.match(str(s["series"]).strip())
            counter = bool(counter) and counter.group(1).endswith("_total")
            values = _series_text(hold_at(expand_series(values), fire_at, delta, counter))
        input_series.append({"series": _retarget(str(s["series"]), sel), "values": values})
    value = float(fill_test_text(str(t.get("value", 0.0)), alert))
    silent: int | None = silent_at
    if delta < 0:
        silent = silent_at + delta if silent_at + delta >= 0 else None
    else:
        value += delta * float(fill_test_text(str(t.get("value_slope", 0.0)), alert))
        fire_at += delta
    labels = {str(k): str(v) for k, v in t.get("labels", {}).items()}
    expr = alert_expr(alert, spec.rules.selector)
    if expr.startswith("absent("):  # absent() keeps the equality matchers of its selector, nothing else
        labels = {k: v for k, v in labels.items() if k not in ("job", *sel)}
        labels.update(equality_matchers(spec.rules.selector))
    elif "job" in labels:  # the output keeps job; other selector labels unless the test says it drops them
        keeps = t.get("target_labels", True) is not False
        labels.update({k: v for k, v in sel.items() if k == "job" or (keeps and keeps_label(expr, k))})
    return _group(spec, alert, input_series, silent, fire_at, labels, value)


_SERIES_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}$')


def _retarget(series: str, sel: dict[str, str]) -> str:
    """A test series of a scraped target (it has a job label) with the selector's labels."""
    m = _SERIES_RE.match(series.strip())
    if not m:
        return series
    labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"', m.group(2)))
    if "job" not in labels:
        return series
    labels.update({k: v.replace("\\", "\\\\").replace('"', '\\"') for k, v in sel.items()})
    return m.group(1) + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


_TOKEN_RE = re.compile(r"^(_|stale|[-+]?[0-9.]+(?:[eE][-+]?\d+)?|[-+]?Inf|NaN)(?:([+-])([0-9.]+(?:[eE][-+]?\d+)?))?"
                       r"(?:x(\d+))?$")


def expand_series(text: str) -> list[tuple[float | None, float]]:
    """promtool's series notation as (value or None, the step of the ramp it belongs to) per sample."""
    out: list[tuple[float | None, float]] = []
    for token in text.split():
        m = _TOKEN_RE.match(token)
        if not m:
            raise ValueError(f"cannot read series token {token!r}")
        first, sign, step, times = m.groups()
        if first in ("_", "stale"):
            out.extend([(None, 0.0)] * (int(times) if times else 1))
            continue
        a = float(first)
        b = float(step) * (-1 if sign == "-" else 1) if step else 0.0
        n = int(times) + 1 if times else 1
        out.extend((a + b * i, b) for i in range(n))
    return out


def hold_at(samples: list[tuple[float | None, float]], at: int, extra: int,
            counter: bool = False) -> list[float | None]:
    """The samples with the one at index ``at`` held ``extra`` more samples: a ramp keeps its step (a counter
    its step, or one a sample), and the samples after it are moved by as much, so a counter stays monotonic."""
    if at >= len(samples):
        at = len(samples) - 1
    value, step = samples[at]
    if counter and not step:
        step = 1.0
    before = [v for v, _ in samples[: at + 1]]
    held = [None if value is None else value + step * (i + 1) for i in range(extra)]
    after = [None if v is None else v + step * extra for v, _ in samples[at + 1:]]
    return before + held + after


def _minutes(text) -> int:
    return duration_seconds(str(text)) // 60


def _group(spec: Spec, alert: Alert, input_series: list[dict], silent_at: int | None, fire_at: int,
           out_labels: dict[str, str], value: float, held: int = 0) -> dict:
    """``held``: the fault ended right after fire_at, and keep_firing_for keeps the alert firing (its labels,
    and its annotations as last evaluated) through fire_at + held; it resolves the minute after."""
    labels = {**out_labels, **alert.labels, "severity": alert.severity}
    annotations = {
        "summary": expand(alert.summary, value, out_labels),
        "description": expand(alert.description, value, out_labels),
        "runbook_url": f"{spec.rules.runbook_url}#{alert.alert.lower()}",
    }
    silent = [] if silent_at is None else [{"eval_time": f"{silent_at}m", "alertname": alert.alert, "exp_alerts": []}]
    when = ("" if silent_at is None else f"silent at {silent_at}m, ") + f"firing at {fire_at}m"
    fired = [{"eval_time": f"{fire_at}m", "alertname": alert.alert,
              "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}]}]
    if held:
        when += f", still at {fire_at + held}m (keep_firing_for), resolved at {fire_at + held + 1}m"
        fired += [{**fired[0], "eval_time": f"{fire_at + held}m"},
                  {"eval_time": f"{fire_at + held + 1}m", "alertname": alert.alert, "exp_alerts": []}]
    return {
        "name": f"{alert.alert}: {when}",
        "interval": f"{INTERVAL_M}m",
        "input_series": input_series,
        "alert_rule_test": silent + fired,
    }


def all_cases(spec: Spec) -> list[dict]:
    return [case_for(spec, a) for a in spec.alerts()]

