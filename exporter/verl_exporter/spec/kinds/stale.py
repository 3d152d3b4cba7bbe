"""kind stale: a unix-time gauge older than a number of seconds (time() - gauge > threshold)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from ..rules import Number, Param, equality_matchers
from . import promtool
from .base import AlertBase, knob_field, register
from .promql import num, vector
from .threshold import metric_labels

if TYPE_CHECKING:
    from .. import Spec


@register
class StaleAlert(AlertBase):
    kind: Literal["stale"] = "stale"
    on_entry = True
    threshold: Number = knob_field(meaning="how old the unix-time gauge may get", unit="seconds", min=0)
    matchers: str = ""

    def knobs(self) -> dict[str, Param]:
        return {"threshold": self.field_knob("threshold")}

    def _knob_update(self, values: dict[str, float]) -> dict[str, Any]:
        return {"threshold": values["threshold"]} if "threshold" in values else {}

    def _age(self, sel: str) -> str:
        return f"time() - {vector(self.metric, sel, self.matchers.strip('{} '))}"

    def promql(self, sel: str) -> str:
        return f"{self._age(sel)} > {num(self.threshold)}"

    def quantities(self, sel: str) -> dict[str, tuple[str, str]]:
        return {"threshold": (self._age(sel), f"seconds since {self.metric}")}

    def wait_seconds(self) -> float:
        return float(self.threshold)

    def test_case(self, spec: Spec) -> dict[str, Any]:
        """A unix-time gauge that advances with time, then stops: its age grows past the threshold."""
        from ..rules import duration_seconds

        shift = promtool.SHIFT
        labels = {**promtool.base_labels(spec), **metric_labels(spec, self, equality_matchers(self.matchers))}
        fire_at = shift + math.ceil(float(self.threshold) / 60) + duration_seconds(self.for_) // 60 + 2
        total = fire_at + promtool.TAIL
        values = [i * 60.0 for i in range(shift)] + [(shift - 1) * 60.0] * (total - shift)
        return promtool.group(spec, self, [promtool.series(self.metric, labels, values)], shift - 5, fire_at,
                              dict(labels), fire_at * 60.0 - (shift - 1) * 60.0)
