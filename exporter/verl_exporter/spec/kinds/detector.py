"""kind detector: a step-domain signal's sustained deviation from its own trend (verl_exporter.core.detect),
optionally past a relative change, optionally confirmed by other signals deviating at the same time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from ...core.models import StrictModel
from ..rules import Direction, Param
from . import promtool
from .base import AlertBase, StepView, field_knob_of, knob_field, register
from .promql import JOIN, detector_gauge, num

if TYPE_CHECKING:
    from .. import Spec


class Confirm(StrictModel):
    """Another signal that must deviate at the same time for a detector alert to hold."""

    signal: str
    direction: Direction = "down"
    k: float | None = knob_field(None, meaning="how many spreads the confirming signal must deviate by too "
                                               "(unset: the alert's k)", unit="spreads", min=0.5)
    change: float = knob_field(0.0, meaning="the relative change from its expected value the confirming signal "
                                            "must reach too (0: no gate)", unit="ratio", min=0)

    def knobs(self) -> dict[str, Param]:
        """Its own k (when set) and change gate (when there is one, which a knob keeps: at least CHANGE_MIN),
        named after its signal: <signal>_k, <signal>_change."""
        out = {}
        if self.k is not None:
            out[f"{self.signal}_k"] = field_knob_of(Confirm, "k", self.k)
        if self.change:
            out[f"{self.signal}_change"] = field_knob_of(Confirm, "change", self.change, min=CHANGE_MIN)
        return out

    def set_knobs(self, values: dict[str, float]) -> Confirm:
        update = {key: values[f"{self.signal}_{key}"] for key in ("k", "change") if f"{self.signal}_{key}" in values}
        return self.model_copy(update=update) if update else self


CHANGE_MIN = 0.01  # a confirming signal's change gate stays a gate: at least 1%


def _directions(direction: str) -> tuple[str, ...]:
    return ("down", "up") if direction == "both" else (direction,)


def _stat(d: str) -> str:
    return "sustained_drop_zscore" if d == "down" else "sustained_rise_zscore"


def deviation(signal: str, direction: str, k: float | None, change: float, sel: str) -> str:
    """A sustained deviation of one signal, from the gauges the detectors export; its value is the z-score
    (k None: the z-score wherever the change gate passes, what calibrate compares k with)."""
    parts = []
    for d in _directions(direction):
        cond = detector_gauge(_stat(d), signal, sel) + ("" if k is None else f" > {num(k)}")
        if change:
            cmp, ch = ("<", -change) if d == "down" else (">", change)
            cond += f" and {JOIN} {detector_gauge('relative_change', signal, sel)} {cmp} {num(ch)}"
        parts.append(cond)
    return " or ".join(f"({p})" for p in parts) if len(parts) > 1 else parts[0]


def deviates(view: StepView, signal: str, direction: str, k: float, change: float) -> float | None:
    """``deviation`` judged on the breaker's view: the sustained z-score, or None."""
    for d in _directions(direction):
        z = view.stat(signal, _stat(d))
        rel = view.stat(signal, "relative_change") or 0.0
        if z is not None and z > k and (not change or (rel < -change if d == "down" else rel > change)):
            return z
    return None


@register
class DetectorAlert(AlertBase):
    kind: Literal["detector"] = "detector"
    signal: str = Field(description="the step-domain signal (detect:)")
    direction: Direction = "up"
    k: float = knob_field(4.0, meaning="how many spreads (robust standard deviations) the signal's sustained "
                                       "deviation from its own trend must reach", unit="spreads", min=0.5)
    change: float = knob_field(0.0, meaning="the relative change from its expected value the signal must also "
                                            "reach (0: no gate)", unit="ratio", min=0)
    confirm: list[Confirm] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_confirm_per_signal(self) -> DetectorAlert:
        signals = [c.signal for c in self.confirm]
        if len(set(signals)) != len(signals) or self.signal in signals:
            raise ValueError("each confirming signal is named once, and is not the alert's own (its knobs are "
                             "named after it)")
        return self

    def knobs(self) -> dict[str, Param]:
        out = {name: self.field_knob(name) for name in ("k", "change")}
        for c in self.confirm:
            out.update(c.knobs())
        return out

    def _knob_update(self, values: dict[str, float]) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in values.items() if k in ("k", "change")}
        if self.confirm:
            out["confirm"] = [c.set_knobs(values) for c in self.confirm]
        return out

    def confirms(self) -> list[tuple[str, str, float, float]]:
        return [(c.signal, c.direction, self.k if c.k is None else c.k, c.change) for c in self.confirm]

    def signals(self) -> tuple[str, ...]:
        return (self.signal,)

    def breaker_signals(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([self.signal, *[c.signal for c in self.confirm]]))

    def promql(self, sel: str, k: float | None | Literal["own"] = "own") -> str:
        main = deviation(self.signal, self.direction, self.k if isinstance(k, str) else k, self.change, sel)
        if not self.confirm:
            return main
        others = " or ".join(f"({deviation(*c, sel)})" for c in self.confirms())
        return f"({main}) and {JOIN} ({others})"

    def quantities(self, sel: str) -> dict[str, tuple[str, str]]:
        what = f"{self.signal} sustained {'drop' if self.direction == 'down' else 'rise'} (spreads)" + \
            (" past the change gate" if self.change else "") + (" with a confirming signal" if self.confirm else "")
        return {"k": (self.promql(sel, k=None), what)}

    def test_case(self, spec: Spec) -> dict[str, Any]:
        """The detector's gauges of the signal (and of the first confirming signal) move from normal to a
        sustained deviation of twice the alert's k at the shift."""
        base = promtool.base_labels(spec)
        shift = promtool.SHIFT
        total = promtool.fire_minute(self) + promtool.TAIL
        series = []
        for signal, direction, k, change in [(self.signal, self.direction, self.k, self.change)] + \
                self.confirms()[:1]:
            sign = -1.0 if direction == "down" else 1.0
            labels = {**base, "signal": signal}
            series.append(promtool.series(f"verl_detector_{_stat(direction)}", labels,
                                          [0.0] * shift + [2.0 * k] * (total - shift)))
            if change:
                series.append(promtool.series("verl_detector_relative_change", labels,
                                              [0.0] * shift + [sign * 2.0 * change] * (total - shift)))
        return promtool.group(spec, self, series, shift - 5, promtool.fire_minute(self),
                              {**base, "signal": self.signal}, 2.0 * self.k)

    def blind_reason(self, spec: Spec) -> str | None:
        return None

    def judge(self, view: StepView) -> float | None:
        z = deviates(view, self.signal, self.direction, self.k, self.change)
        if z is None:
            return None
        if self.confirm and not any(deviates(view, *c) is not None for c in self.confirms()):
            return None
        return z
