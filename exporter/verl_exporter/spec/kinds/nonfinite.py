"""kind nonfinite: the metric was logged as NaN or +-Inf (null in verl's file logger)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from ..rules import Duration, duration_seconds
from . import promtool
from .base import AlertBase, StepView, register
from .promql import vector
from .threshold import verl_keyed

if TYPE_CHECKING:
    from .. import Spec

NONFINITE = "verl_training_nonfinite_values_total"
NONFINITE_MEMORY = "1d"  # how far back a restarted sidecar's NaN count is compared


@register
class NonfiniteAlert(AlertBase):
    kind: Literal["nonfinite"] = "nonfinite"
    on_entry = True
    hard_safety = True
    window: Duration = "10m"  # how long one NaN keeps the alert firing

    def promql(self, sel: str) -> str:
        counter = vector(NONFINITE, sel, f'metric="{self.metric}"')
        w = self.window
        # The sidecar rebuilds this counter from the file after a restart, so a value that differs from the
        # last one before a gap (a sidecar down for longer than w) means NaNs logged in the gap; the same
        # value means none, and must not page. A counter never seen before is born with its first NaN.
        before = f"last_over_time({counter}[{NONFINITE_MEMORY}] offset {w})"
        return (f"increase({counter}[{w}]) > 0 or ({counter} != {before}) > 0"
                f" or ({counter} unless {before}) > 0")

    def test_case(self, spec: Spec) -> dict[str, Any]:
        """One NaN fires an alert without `for`; with one (an override), NaNs must keep coming."""
        labels = {**promtool.base_labels(spec), "metric": self.metric}
        fire_at = promtool.fire_minute(self)
        total = fire_at + promtool.TAIL
        keep = duration_seconds(self.for_) > 0
        values = [0.0] * promtool.SHIFT + [float(i + 1) if keep else 1.0 for i in range(total - promtool.SHIFT)]
        return promtool.group(spec, self, [promtool.series(NONFINITE, labels, values)], promtool.SHIFT - 5,
                              fire_at, {**labels, "metric": self.metric}, 0.0)

    def blind_reason(self, spec: Spec) -> str | None:
        return verl_keyed(spec, self.metric, {})

    def series_read(self) -> list[tuple[str, dict[str, str]]]:
        return [(self.metric, {})]

    def judge(self, view: StepView) -> float | None:
        x = view.value(self.metric, {})
        return 1.0 if x is not None and not math.isfinite(x) else None
