"""kind stall: no new step for longer than a multiple of the run's own step time (a step-domain statistic of
the step_time signal), with a floor; optionally a fixed limit while the signal has no baseline yet.

Judged by the breaker between steps too: a hung trainer logs nothing, so the breaker's ticks carry the time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ...core.detect import Stat
from ..rules import Number
from . import promtool
from .base import AlertBase, StepView, WithTest, register
from .promql import JOIN, num, vector

if TYPE_CHECKING:
    from .. import Spec


@register
class StallAlert(WithTest, AlertBase):
    kind: Literal["stall"] = "stall"
    on_entry = True
    signal: str = Field(description="the step-time signal (detect:) whose statistic is the run's pace")
    stat: Stat = Field(description="window_max (the longest recent step) or level (the usual one)")
    factor: Number = Field(gt=0, description="how many times that statistic the run may go without a step")
    at_least: Number = Field(gt=0, description="seconds: the limit's floor")
    before_baseline: Number | None = Field(None, gt=0, description="seconds: the limit while the signal has "
                                                                    "no baseline yet (none: no alert then)")
    explicit_test = True

    def promql(self, sel: str) -> str:
        age = f"time() - {vector(self.metric, sel)}"
        pace = vector(f"verl_detector_{self.stat}", f'signal="{self.signal}"', sel)
        late = f"{age} > {JOIN} clamp_min({num(self.factor)} * {pace}, {num(self.at_least)})"
        if self.before_baseline is None:
            return late
        return f"({age} > {num(self.before_baseline)} unless {JOIN} {pace}) or ({late})"

    def test_case(self, spec: Spec) -> dict[str, Any]:
        return promtool.explicit_case(spec, self, self.test or {})  # a test is required (_common)

    def signals(self) -> tuple[str, ...]:
        return (self.signal,)

    def blind_reason(self, spec: Spec) -> str | None:
        return None

    judged_between_steps = True

    def judge(self, view: StepView) -> float | None:
        if view.last_step_at is None:
            return None
        age = view.now - view.last_step_at
        pace = view.stat(self.signal, self.stat)
        limit = self.before_baseline if pace is None else max(self.factor * pace, self.at_least)
        return age if limit is not None and age > limit else None
