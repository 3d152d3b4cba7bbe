"""kind stall: no new step for longer than a multiple of the run's own step time (a step-domain statistic of
the step_time signal), with a floor; optionally a fixed limit while the signal has no baseline yet.

Judged by the breaker between steps too: a hung trainer logs nothing, so the breaker's ticks carry the time.
The sidecar judges the same declaration on its own store: its forensics trigger (every stall alert) and, with
``--healthz-hang``, ``/healthz`` (the critical ones: sidecar/forensics.py ``hang_alerts``). The three limits
are knobs, so an overrides file moves the rule, its test, the breaker, the trigger and ``/healthz`` at once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ...core.detect import Stat
from ..rules import Number, Param, fill_test_text
from . import promtool
from .base import AlertBase, StepView, WithTest, knob_field, register
from .promql import JOIN, num, vector

if TYPE_CHECKING:
    from .. import Spec

# The knobs' ranges: a limit under the step time itself would call every healthy step a stall, and a floor
# of zero is no floor (seconds: one is the least that means one).
MIN_FACTOR = 1.0
MIN_SECONDS = 1.0
KNOBS = ("factor", "at_least", "before_baseline")


@register
class StallAlert(WithTest, AlertBase):
    kind: Literal["stall"] = "stall"
    on_entry = True
    signal: str = Field(description="the step-time signal (detect:) whose statistic is the run's pace")
    stat: Stat = Field(description="window_max (the longest recent step) or level (the usual one)")
    factor: Number = knob_field(meaning="how many times that statistic the run may go without a step",
                                unit="factor", min=MIN_FACTOR)
    at_least: Number = knob_field(meaning="the limit's floor: no stall is called sooner", unit="seconds",
                                  min=MIN_SECONDS)
    before_baseline: Number | None = knob_field(None, meaning="the limit while the signal has no baseline yet "
                                                "(none: no alert then)", unit="seconds", min=MIN_SECONDS)
    explicit_test = True

    def knobs(self) -> dict[str, Param]:
        # Each value is echoed unchecked: the spec's keys were checked against the same bounds when it was read,
        # and the demo's compressed clock makes a copy off them on purpose (field_knob_of).
        names = KNOBS if self.before_baseline is not None else KNOBS[:2]  # none is no clause, not a number to move
        return {name: self.field_knob(name, echo=True) for name in names}

    def _knob_update(self, values: dict[str, float]) -> dict[str, Any]:
        return {k: v for k, v in values.items() if k in KNOBS}

    def limit(self, pace: float | None) -> float | None:
        """Seconds without a step after which the condition holds, at a pace (None: no baseline yet)."""
        return self.before_baseline if pace is None else max(self.factor * pace, self.at_least)

    def _age(self, sel: str) -> str:
        return f"time() - {vector(self.metric, sel)}"

    def _pace(self, sel: str) -> str:
        return vector(f"verl_detector_{self.stat}", f'signal="{self.signal}"', sel)

    def promql(self, sel: str) -> str:
        age, pace = self._age(sel), self._pace(sel)
        late = f"{age} > {JOIN} clamp_min({num(self.factor)} * {pace}, {num(self.at_least)})"
        if self.before_baseline is None:
            return late
        return f"({age} > {num(self.before_baseline)} unless {JOIN} {pace}) or ({late})"

    def quantities(self, sel: str) -> dict[str, tuple[str, str]]:
        age, pace = self._age(sel), self._pace(sel)
        out = {"factor": (f"({age}) / {JOIN} {pace} and ({age} > {num(self.at_least)})",
                          f"seconds without a step over the step time's {self.stat}, past the floor"),
               "at_least": (f"{age} > {JOIN} {num(self.factor)} * {pace}",
                            f"seconds without a step, past {num(self.factor)} x the step time's {self.stat}")}
        if self.before_baseline is not None:
            out["before_baseline"] = (f"{age} unless {JOIN} {pace}",
                                      "seconds without a step before the step time has a baseline")
        return out

    def test_case(self, spec: Spec) -> dict[str, Any]:
        """The spec's test (required: _common), written for the spec's knobs; other knobs move it by the minutes
        they move the stall's onset on its input series, as a longer `for` moves it."""
        t = self.test or {}
        return promtool.explicit_case(spec, self, t, later=self._onset(t, self) - self._onset(t, self.declared()))

    def declared(self) -> StallAlert:
        """The alert with the spec's knobs (an overridden one keeps them: base_knobs)."""
        out = self.with_knobs(self.base_knobs)
        assert isinstance(out, StallAlert)
        return out

    def _onset(self, t: dict[str, Any], alert: StallAlert) -> int:
        """The first minute of the test at which the alert's condition holds, the input's last samples held."""
        stamps: list[tuple[float | None, float]] = []
        paces: list[tuple[float | None, float]] = []
        for s in t.get("input") or []:
            name, labels = promtool.parse_series(str(s["series"])) or ("", {})
            values = promtool.expand_series(fill_test_text(str(s["values"]), alert.knob_values()))
            if name == self.metric:
                stamps = values
            elif name == f"verl_detector_{self.stat}" and labels.get("signal") == self.signal:
                paces = values
        if not stamps:
            raise ValueError(f"{self.alert}: its test has no {self.metric} series")
        limits = [alert.limit(p) for p in {None, *(p for p, _ in paces)}]
        longest = max(x for x in limits if x is not None) if any(x is not None for x in limits) else 0.0
        for minute in range(len(stamps) + math.ceil(longest / 60) + 2):
            stamp = stamps[min(minute, len(stamps) - 1)][0]
            pace = paces[min(minute, len(paces) - 1)][0] if paces else None
            limit = alert.limit(pace)
            if stamp is not None and limit is not None and minute * 60 - stamp > limit:
                return minute
        raise ValueError(f"{self.alert}: its test's input never stalls past the limit")

    def signals(self) -> tuple[str, ...]:
        return (self.signal,)

    def blind_reason(self, spec: Spec) -> str | None:
        return None

    judged_between_steps = True

    def judge(self, view: StepView) -> float | None:
        if view.last_step_at is None:
            return None
        age = view.now - view.last_step_at
        limit = self.limit(view.stat(self.signal, self.stat))
        return age if limit is not None and age > limit else None
