"""kind expr: free PromQL, for what a trainer process cannot see (GPU, host, checkpoint, the sidecars' `up`)
or cannot judge step by step (time windows of Prometheus series). A critical one says why the in-process
breaker cannot judge it (``outside_trainer``); anything the trainer can judge is a declaration of another kind.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from ..rules import (
    CODES_PLACEHOLDER_RE,
    CODES_TEST_RE,
    EXPR_PLACEHOLDER_RE,
    RESERVED_PLACEHOLDERS,
    fill_codes,
    fill_knobs,
)
from . import promtool
from .base import AlertBase, WithParams, WithTest, register
from .promql import fill

if TYPE_CHECKING:
    from .. import Spec

SIGNAL_MATCHER_RE = re.compile(r'signal\s*=~?\s*"([^"]+)"')


@register
class ExprAlert(WithParams, WithTest, AlertBase):
    kind: Literal["expr"] = "expr"
    expr: str = Field(description="PromQL with <metric>, <sel>, <param> and <codes.NAME> placeholders")
    outside_trainer: str | None = Field(None, description="why a trainer process cannot judge it (needed when "
                                                          "critical: the breaker judges every other critical)")
    explicit_test = True

    @field_validator("expr")
    @classmethod
    def _one_line(cls, expr: str) -> str:
        if not expr.strip():
            raise ValueError("an expr alert needs expr")
        return " ".join(expr.split())

    @model_validator(mode="after")
    def _params_used(self) -> ExprAlert:
        used = set(EXPR_PLACEHOLDER_RE.findall(self.expr)) - set(RESERVED_PLACEHOLDERS)
        declared = set(self.params)
        bad = []
        if used - declared:
            bad.append(f"expr uses undeclared param(s) {sorted(used - declared)}")
        if declared - used:
            bad.append(f"param(s) {sorted(declared - used)} are not used in expr")
        if self.severity == "critical" and not self.outside_trainer:
            bad.append("a critical expr alert says why the trainer cannot judge it (outside_trainer), or is "
                       "declared as a kind the breaker evaluates (condition, stall, threshold, detector)")
        if bad:
            raise ValueError("; ".join(bad))
        return self

    def promql(self, sel: str) -> str:
        return fill(fill_codes(fill_knobs(self.expr, self.knob_values()), self._codes), self.metric, sel)

    def code_sets(self) -> tuple[str, ...]:
        texts = [self.expr, str(self.test or "")]
        return tuple(dict.fromkeys(name for text in texts for name in CODES_PLACEHOLDER_RE.findall(text) +
                                   [m[0] for m in CODES_TEST_RE.findall(text)]))

    def test_case(self, spec: Spec) -> dict[str, Any]:
        return promtool.explicit_case(spec, self, self.test or {})  # a test is required (_common)

    def quantities(self, sel: str) -> dict[str, tuple[str, str]]:
        knobs = self.knob_values()
        return {name: (fill(fill_knobs(p.quantity, knobs), self.metric, sel), " ".join(p.quantity.split()))
                for name, p in self.params.items() if p.quantity}

    def signals(self) -> tuple[str, ...]:
        found: list[str] = []
        for group in SIGNAL_MATCHER_RE.findall(self.expr):
            found.extend(x for x in group.split("|") if x and x not in found)
        return tuple(found)

    def blind_reason(self, spec: Spec) -> str | None:
        return self.outside_trainer or "free PromQL is judged by Prometheus only"
