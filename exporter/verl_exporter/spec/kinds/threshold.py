"""kind threshold: a series crosses a fixed line (optionally aggregated first)."""

from __future__ import annotations

import operator
import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ..rules import Number, Op, Param
from . import promtool
from .base import AlertBase, StepView, knob_field, register
from .promql import num, vector

if TYPE_CHECKING:
    from .. import Spec

COMPARE = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}


def metric_labels(spec: Spec, alert: AlertBase, given: dict[str, str]) -> dict[str, str]:
    """Labels of a test series of the alert's metric: those its matchers give, "a" for the others."""
    return {name: given.get(name, "a") for name in spec[alert.metric].labels}


def verl_keyed(spec: Spec, metric: str, labels: dict[str, str]) -> str | None:
    """None when verl's logged keys feed that series (a trainer process sees it), else what feeds it."""
    from ...core.detect import keys_of

    if metric not in spec:
        return "it reads series of several metrics or of Prometheus itself"
    m = spec[metric]
    if m.collector:
        return f"{metric} comes from the sidecar's {m.collector} collector, not from verl's logged keys"
    if m.instrumented_by:  # e.g. the progress kept across trainer restarts, which a trainer cannot see
        return f"{metric} is set by the pack's {m.instrumented_by} itself, not from verl's logged keys"
    if not keys_of(m, labels):
        return f"no verl key feeds {metric}{labels or ''}"
    return None


@register
class ThresholdAlert(AlertBase):
    kind: Literal["threshold"] = "threshold"
    on_entry = True
    op: Op = ">"
    threshold: Number = knob_field(meaning="the line the series (or its aggregate) crosses", unit=None, op=None)
    matchers: str = ""
    aggregate: str = ""
    test: dict[str, Any] | None = Field(None, description="ok and bad: the values the test uses")

    def knobs(self) -> dict[str, Param]:
        return {"threshold": self.field_knob("threshold", op=self.op, unit=self.metric_unit)}

    def _knob_update(self, values: dict[str, float]) -> dict[str, Any]:
        return {"threshold": values["threshold"]} if "threshold" in values else {}

    def _series(self, sel: str) -> str:
        inner = vector(self.metric, sel, self.matchers.strip("{} "))
        return f"{self.aggregate} ({inner})" if self.aggregate else inner

    def promql(self, sel: str) -> str:
        return f"{self._series(sel)} {self.op} {num(self.threshold)}"

    def quantities(self, sel: str) -> dict[str, tuple[str, str]]:
        return {"threshold": (self._series(sel), f"{self.metric} ({self.op} line)")}

    def _bad_and_ok(self) -> tuple[float, float]:
        t = float(self.threshold)
        explicit = self.test or {}
        if "ok" in explicit and "bad" in explicit:
            ok, bad = float(explicit["ok"]), float(explicit["bad"])
            fires = COMPARE[self.op]
            if fires(bad, t) and not fires(ok, t):  # still right for an overridden threshold
                return ok, bad
        above = self.op in (">", ">=")
        step = abs(t) if t else 1.0
        return (t - step / 2, t + step) if above else (t + step, t - step / 2)

    def test_case(self, spec: Spec) -> dict[str, Any]:
        """The series at an ok value, then at a bad one from the shift; with keep_firing_for the fault ends
        right after the firing evaluation and the alert is checked to stay firing, then to resolve."""
        from ..rules import duration_seconds, equality_matchers

        labels = {**promtool.base_labels(spec), **metric_labels(spec, self, equality_matchers(self.matchers))}
        fire_at = promtool.fire_minute(self)
        held = -(-duration_seconds(self.keep_firing_for) // 60) if self.keep_firing_for else 0
        total = fire_at + held + promtool.TAIL
        ok, bad = self._bad_and_ok()
        end = fire_at + 1 if held else total
        values = [ok] * promtool.SHIFT + [bad] * (end - promtool.SHIFT) + [ok] * (total - end)
        if self.aggregate:
            by = re.search(r"\bby\s*\(([^)]*)\)", self.aggregate)
            keep = [x.strip() for x in by.group(1).split(",")] if by else []
            out = {k: v for k, v in labels.items() if k in keep}
        else:
            out = dict(labels)
        return promtool.group(spec, self, [promtool.series(self.metric, labels, values)], promtool.SHIFT - 5,
                              fire_at, out, bad, held)

    def blind_reason(self, spec: Spec) -> str | None:
        from ..rules import equality_matchers

        return verl_keyed(spec, self.metric, equality_matchers(self.matchers))

    def series_read(self) -> list[tuple[str, dict[str, str]]]:
        from ..rules import equality_matchers

        return [(self.metric, equality_matchers(self.matchers))]

    def judge(self, view: StepView) -> float | None:
        from ..rules import equality_matchers

        x = view.value(self.metric, equality_matchers(self.matchers))
        return x if x is not None and COMPARE[self.op](x, self.threshold) else None
