"""The `detect:` part of a metric entry: which series are adaptive signals, and how their step-domain
baselines are built (see ``verl_exporter.core.detect``)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from ..core.detect import MIN_STEPS_FLOOR, SignalSpec, Stat
from ..core.models import StrictModel

SIGNAL_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


class DetectEntry(StrictModel):
    """An adaptive signal fed by one series of the entry's metric."""

    signal: Annotated[str, StringConstraints(pattern=SIGNAL_NAME_RE.pattern)]
    labels: dict[str, str] = Field(default_factory=dict, description="a value for each of the metric's labels")
    window: int = Field(30, ge=MIN_STEPS_FLOOR, description="steps in the baseline window")
    hold: int = Field(3, ge=1, description="steps a deviation must last to count as sustained")
    level_steps: int = Field(5, ge=1, description="steps in the running level (a median)")
    trail: int = Field(100, ge=MIN_STEPS_FLOOR, description="steps whose running levels trailing_peak and "
                       "trailing_floor cover")
    min_steps: int = Field(MIN_STEPS_FLOOR, ge=MIN_STEPS_FLOOR, description="steps before it judges")
    floor: float = Field(0.0, ge=0, description="absolute floor of the spread")
    rel_floor: float = Field(0.02, ge=0, description="floor of the spread as a share of |expected|")
    trend: bool = Field(True, description="project the window's trend (off for values that should be flat)")
    skip_when_zero: str | None = Field(
        None, description="a metric of the spec: a step on which it is exactly 0 carries no value of this signal "
                          "(e.g. the gradient norm of a step whose policy loss is 0: every group scored alike)")
    export: list[Stat] = ["steps", "zscore", "sustained_rise_zscore", "sustained_drop_zscore"]

    @model_validator(mode="after")
    def _min_steps(self) -> DetectEntry:
        if self.min_steps > self.window:
            raise ValueError("min_steps cannot exceed window")
        return self

    def to_signal(self, metric: str) -> SignalSpec:
        export = self.export if "steps" in self.export else ["steps", *self.export]
        return SignalSpec(name=self.signal, metric=metric, labels=tuple(self.labels.items()), window=self.window,
                          hold=self.hold, level_steps=self.level_steps, trail=self.trail, min_steps=self.min_steps,
                          floor=float(self.floor), rel_floor=float(self.rel_floor), trend=self.trend,
                          skip_when_zero=self.skip_when_zero, export=tuple(export))
