"""What every kind's generated promtool test is made of: series in promtool's notation, the Go-template subset
of the annotations expanded as Prometheus would, and the test group of one alert (silent before the fault,
firing after it, with its full labels and annotations).

Timing: series move from healthy to faulty at ``SHIFT``; the firing case is evaluated at the shift plus the
alert's ``for`` plus two evaluation intervals. An alert that brings its own test (``test:`` in the spec, the
kinds expr, condition and stall) gives its input series and times itself (``explicit_case``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..rules import TEMPLATE_RE, duration_seconds, equality_matchers, fill_test_codes, fill_test_text
from .promql import keeps_label, selector_labels

if TYPE_CHECKING:
    from .. import Spec
    from .base import AlertBase

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

    def one(m: re.Match[str]) -> str:
        inner = m.group(1)
        if inner.startswith("$labels."):
            return labels.get(inner[len("$labels."):], "")
        return go_printf(inner.split('"')[1], value)  # $value | printf "%.3g"

    return TEMPLATE_RE.sub(one, text)


def _fmt(v: float) -> str:
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def series_text(values: Sequence[float | None]) -> str:
    """promtool's series notation, run-length compressed: '1x9 2x4 _x3'."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        v = values[i]
        if v is None:  # promtool: "_xN" is N missing samples, "axN" is N + 1 samples of a
            out.append("_" if j == i else f"_x{j - i + 1}")
        else:
            out.append(_fmt(v) if j == i else f"{_fmt(v)}x{j - i}")
        i = j + 1
    return " ".join(out)


def series(name: str, labels: dict[str, str], values: Sequence[float | None]) -> dict[str, str]:
    text = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{text}}}", "values": series_text(values)}


def fire_minute(alert: AlertBase) -> int:
    return SHIFT + duration_seconds(alert.for_) // 60 + 2 * INTERVAL_M


def base_labels(spec: Spec) -> dict[str, str]:
    """The labels of a test series of one sidecar: the selector's, the target's."""
    return {**selector_labels(spec.rules.selector), **BASE_LABELS}


def group(spec: Spec, alert: AlertBase, input_series: list[dict[str, str]], silent_at: int | None, fire_at: int,
          out_labels: dict[str, str], value: float, held: int = 0) -> dict[str, Any]:
    """One promtool test group. ``held``: the fault ended right after fire_at, and keep_firing_for keeps the
    alert firing (its labels, and its annotations as last evaluated) through fire_at + held; it resolves the
    minute after."""
    labels = {**out_labels, **alert.labels, "severity": alert.severity}
    annotations = {
        "summary": expand(alert.summary, value, out_labels),
        "description": expand(alert.description, value, out_labels),
        "runbook_url": spec.rules.runbook_link(alert.alert),
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


def explicit_case(spec: Spec, alert: AlertBase, t: dict[str, Any], later: int = 0) -> dict[str, Any]:
    """An alert that brings its own test: input series, silent_at, fire_at, the labels and $value expected.

    Input values and the expected value may be computed from the alert's knobs (<expression>), so the test
    follows an overridden threshold. An overridden `for` moves the test: a shorter one checks silence as
    much earlier (dropped if that is before the start) and firing at the same time; a longer one fires that
    much later, the input's state at fire_at held for the extra minutes (a ramp keeps its step, a counter
    keeps counting) and $value moved by the test's value_slope (per minute, default 0). A `for` longer than
    the baseline an expression compares with makes the alert unable to fire; its test then fails, saying so.
    ``later``: minutes the kind's knobs move the condition's onset on these series (a stall's limits), moved
    alike.
    """
    knobs, codes = alert.knob_values(), alert.code_values()
    silent_at, fire_at = _minutes(t["silent_at"]), _minutes(t["fire_at"])
    delta = (duration_seconds(alert.for_) - duration_seconds(alert.base_for)) // 60 + later
    # The spec's tests are written for job="verl"; a series of a target gets the selector's labels instead.
    sel = selector_labels(spec.rules.selector)
    input_series: list[dict[str, str]] = []
    for s in t["input"]:
        values = fill_test_text(str(s["values"]), knobs)
        if delta > 0:
            m = _SERIES_RE.match(str(s["series"]).strip())
            counter = m is not None and m.group(1).endswith("_total")
            values = series_text(hold_at(expand_series(values), fire_at, delta, counter))
        input_series.append({"series": _retarget(fill_test_codes(str(s["series"]), codes), sel), "values": values})
    value = float(fill_test_text(str(t.get("value", 0.0)), knobs))
    silent: int | None = silent_at
    if delta < 0:
        silent = silent_at + delta if silent_at + delta >= 0 else None
    else:
        value += delta * float(fill_test_text(str(t.get("value_slope", 0.0)), knobs))
        fire_at += delta
    labels = {str(k): fill_test_codes(str(v), codes) for k, v in t.get("labels", {}).items()}
    expr = alert.promql(spec.rules.selector)
    if expr.startswith("absent("):  # absent() keeps the equality matchers of its selector, nothing else
        labels = {k: v for k, v in labels.items() if k not in ("job", *sel)}
        labels.update(equality_matchers(spec.rules.selector))
    elif "job" in labels:  # the output keeps job; other selector labels unless the test says it drops them
        keeps = t.get("target_labels", True) is not False
        labels.update({k: v for k, v in sel.items() if k == "job" or (keeps and keeps_label(expr, k))})
    return group(spec, alert, input_series, silent, fire_at, labels, value)


_SERIES_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}$')


def parse_series(text: str) -> tuple[str, dict[str, str]] | None:
    """A test series' name and labels ('name{a="1"}'), None for another notation."""
    m = _SERIES_RE.match(text.strip())
    if not m:
        return None
    return m.group(1), dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"', m.group(2)))


def _retarget(text: str, sel: dict[str, str]) -> str:
    """A test series of a scraped target (it has a job label) with the selector's labels."""
    parsed = parse_series(text)
    if parsed is None:
        return text
    name, labels = parsed
    if "job" not in labels:
        return text
    labels.update({k: v.replace("\\", "\\\\").replace('"', '\\"') for k, v in sel.items()})
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


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


def _minutes(text: object) -> int:
    return duration_seconds(str(text)) // 60
