"""kind latency_spike: a rollout engine's latency histogram whose p99, per run and replica, rises over `factor`
times its own p99 of the hour that ended 30 minutes ago, while the run steps.

Every engine (SCRAPED_FROM: vLLM, SGLang) names its latency histograms alike after its prefix, so one key,
``histogram``, names both engines' series; time to first token and time per output token are two alerts of this
kind that differ in that key and their texts. The baseline ends 30 minutes back: with offset 15m a spike entered
its own baseline after 15 minutes, and a `for` over that (an override of +10m) could never fire. Every engine
alert takes the `job` of the run's training series, so that an engine root cause inhibits the run's training
alerts (Alertmanager's inhibitions match on job and run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ..rules import Number, Param, duration_seconds
from . import promtool
from .base import AlertBase, knob_field, register
from .promql import fill, matchers_text, num

if TYPE_CHECKING:
    from .. import Spec

WINDOW, BASELINE = "5m", "1h] offset 30m"  # the baseline as written inside rate(...[...])
JOIN = "* on (run) group_left (job) (max by (job, run) (verl_training_step{<sel>}) * 0 + 1)"


def _engines() -> tuple[str, ...]:
    from .. import SCRAPED_FROM  # the spec package imports the kinds first

    return SCRAPED_FROM


@register
class LatencySpikeAlert(AlertBase):
    kind: Literal["latency_spike"] = "latency_spike"
    histogram: str = Field(pattern=r"^[a-z][a-z0-9_]*_seconds$",
                           description="the histogram's name after the engine's prefix (vllm:, sglang:), as every "
                                       "engine names it: time_to_first_token_seconds")
    factor: Number = knob_field(3, meaning="how many times its baseline the quantile must reach", unit="factor",
                                min=1)
    quantile: Number = knob_field(0.99, meaning="the latency quantile compared (0.99: the p99)", unit="quantile",
                                  min=0.01, max=0.999)

    def knobs(self) -> dict[str, Param]:
        return {name: self.field_knob(name) for name in ("factor", "quantile")}

    def _knob_update(self, values: dict[str, float]) -> dict[str, Any]:
        return {k: v for k, v in values.items() if k in ("factor", "quantile")}

    def metrics(self) -> tuple[str, ...]:
        return tuple(f"{e}:{self.histogram}" for e in _engines())

    def _p99(self, window: str) -> str:
        rates = " or ".join(f"rate({e}:{self.histogram}_bucket[{window})" for e in _engines())
        return f"histogram_quantile({num(float(self.quantile))}, sum by (run, instance, le) ({rates}))"

    def promql(self, sel: str) -> str:
        spike = f"{self._p99(WINDOW + ']')} > {num(float(self.factor))} * {self._p99(BASELINE)}"
        return fill(f"({spike}) {JOIN}", self.metric, sel)

    def quantities(self, sel: str) -> dict[str, tuple[str, str]]:
        return {"factor": (f"{self._p99(WINDOW + ']')} / {self._p99(BASELINE)}",
                           f"p99 of {self.histogram} over its p99 of the hour that ended 30 minutes ago")}

    def test_case(self, spec: Spec) -> dict[str, Any]:
        """One replica of the first engine: every observation under le=1 s for the healthy hour (p99 0.99 s),
        then every one between 1 s and 3 * factor + 1 s (p99 over factor times the baseline)."""
        shift, engine = promtool.SHIFT, _engines()[0]
        fire_at = shift + duration_seconds(self.for_) // 60 + 5
        n = fire_at + promtool.TAIL
        lo, hi = 1.0, 3 * float(self.factor) + 1
        replica = {"instance": "node0:8000", "run": "r1"}
        ramp, held = f"0+10x{n - 1}", f"0+10x{shift - 1} {10 * (shift - 1)}x{n - shift - 1}"
        inputs = [{"series": f'{engine}:{self.histogram}_bucket{{{matchers_text({**replica, "le": le})}}}',
                   "values": values} for le, values in ((num(lo), held), (num(hi), ramp), ("+Inf", ramp))]
        training = promtool.base_labels(spec)
        inputs.append({"series": f"verl_training_step{{{matchers_text(training)}}}", "values": f"0+1x{n - 1}"})
        return promtool.group(spec, self, inputs, shift - 5, fire_at, {"job": training["job"], **replica},
                              lo + (hi - lo) * float(self.quantile))
