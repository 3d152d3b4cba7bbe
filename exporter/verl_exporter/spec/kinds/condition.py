"""kind condition: comparisons of a sidecar's series (verl metrics, step-domain statistics) combined with
all/any. One declaration gives both the PromQL and the breaker's evaluation on the trainer's own values:

    when:
      all:
        - {metric: verl_response_length_tokens, labels: {stat: mean, subset: all}, op: "<", than: tokens}
        - any:
            - {metric: verl_actor_entropy, op: "<", than: entropy}
            - {metric: verl_critic_score, labels: {stat: mean}, op: "<=",
               than: {metric: verl_critic_score, labels: {stat: min}}}

A term is a metric's series (``metric`` and ``labels``) or a signal's statistic (``signal`` and ``stat``, the
gauge ``verl_detector_<stat>{signal=...}``), optionally multiplied by a knob (``times``). ``than`` is a
number, a knob expression over ``params`` (``tokens``, ``-change``) or another term. Every series is one
sidecar's, matched on (job, instance, run, rank) where their labels differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from ...core.detect import Stat
from ...core.models import StrictModel
from ..rules import Number, Op, eval_knob_expr, fmt_knob
from . import promtool
from .base import AlertBase, StepView, WithParams, WithTest, register
from .promql import JOIN, matchers_text, vector
from .threshold import COMPARE, verl_keyed

if TYPE_CHECKING:
    from .. import Spec


class Term(StrictModel):
    """One series of a sidecar: a metric's (with labels) or a signal's statistic."""

    metric: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    signal: str | None = None
    stat: Stat | None = None
    times: str | None = Field(None, description="a knob expression the series is multiplied by")

    @model_validator(mode="after")
    def _one_series(self) -> Term:
        if (self.metric is None) == (self.signal is None):
            raise ValueError("a term names a metric or a signal, not both")
        if self.signal is not None and (self.stat is None or self.labels):
            raise ValueError("a signal's term names its stat (and no labels)")
        if self.metric is not None and self.stat is not None:
            raise ValueError("stat is for a signal's term")
        return self

    def identity(self) -> tuple[str, object]:
        """What tells its series apart from another term's of the same sidecar (besides the name)."""
        return ("signal", self.signal) if self.signal else ("labels", tuple(sorted(self.labels.items())))

    def promql(self, sel: str, knobs: dict[str, float]) -> str:
        if self.metric is None:  # a signal's statistic
            text = vector(f"verl_detector_{self.stat}", f'signal="{self.signal}"', sel)
        else:
            text = vector(self.metric, matchers_text(self.labels), sel)
        return f"{fmt_knob(eval_knob_expr(self.times, knobs))} * {text}" if self.times else text

    def value(self, view: StepView, knobs: dict[str, float]) -> float | None:
        if self.metric is None:
            assert self.signal is not None and self.stat is not None  # _one_series
            x = view.stat(self.signal, self.stat)
        else:
            x = view.value(self.metric, self.labels)
        if x is None or not self.times:
            return x
        return x * eval_knob_expr(self.times, knobs)

    def knob_names(self) -> set[str]:
        return _names(self.times)

    def words(self) -> str:
        if self.metric is None:
            return f"{self.signal} {self.stat}"
        return self.metric + (f"{{{', '.join(f'{k}={v}' for k, v in self.labels.items())}}}" if self.labels else "")


class Compare(Term):
    """``<term> op than``: than is a number, a knob expression or another term."""

    op: Op
    than: Number | str | Term

    def promql(self, sel: str, knobs: dict[str, float]) -> str:
        left = super().promql(sel, knobs)
        if isinstance(self.than, Term):
            on = "" if self.than.identity() == self.identity() else f"{JOIN} "
            return f"{left} {self.op} {on}{self.than.promql(sel, knobs)}"
        return f"{left} {self.op} {fmt_knob(self.bound(knobs))}"

    def bound(self, knobs: dict[str, float]) -> float:
        than = self.than
        if isinstance(than, Term):
            raise TypeError("a comparison with a term has no fixed bound")
        return float(than) if isinstance(than, (int, float)) else eval_knob_expr(than, knobs)

    def judge(self, view: StepView, knobs: dict[str, float]) -> float | None:
        x = super().value(view, knobs)
        other = self.than.value(view, knobs) if isinstance(self.than, Term) else self.bound(knobs)
        return x if x is not None and other is not None and COMPARE[self.op](x, other) else None

    def terms(self) -> list[Term]:
        return [self, self.than] if isinstance(self.than, Term) else [self]

    def quantity(self, sel: str, knobs: dict[str, float]) -> tuple[str, str, str] | None:
        """(knob, the PromQL the knob is compared with, in words) when ``than`` is a knob (``x``, ``-x``) or a
        term times a knob; None otherwise."""
        left = Term.promql(self, sel, knobs)
        than = self.than
        if isinstance(than, str) and than.strip().isidentifier():
            return than.strip(), left, self.words()
        if isinstance(than, str) and than.strip().startswith("-") and than.strip()[1:].strip().isidentifier():
            return than.strip()[1:].strip(), f"-({left})", f"-{self.words()}"
        if isinstance(than, Term) and than.times and than.times.strip().isidentifier():
            plain = than.model_copy(update={"times": None})
            on = "" if than.identity() == self.identity() else f"{JOIN} "
            return than.times.strip(), f"{left} / {on}{plain.promql(sel, knobs)}", f"{self.words()} / {plain.words()}"
        return None

    def knob_names(self) -> set[str]:
        names = super().knob_names()
        return names | (self.than.knob_names() if isinstance(self.than, Term) else
                        _names(self.than) if isinstance(self.than, str) else set())


class AllOf(StrictModel):
    all: list[Node] = Field(min_length=2)

    def promql(self, sel: str, knobs: dict[str, float]) -> str:
        return f" and {JOIN} ".join(_part(c, sel, knobs) for c in self.all)

    def judge(self, view: StepView, knobs: dict[str, float]) -> float | None:
        values = [c.judge(view, knobs) for c in self.all]
        return values[0] if all(v is not None for v in values) else None

    def terms(self) -> list[Term]:
        return [t for c in self.all for t in c.terms()]

    def knob_names(self) -> set[str]:
        return set().union(*(c.knob_names() for c in self.all))


class AnyOf(StrictModel):
    any: list[Node] = Field(min_length=2)

    def promql(self, sel: str, knobs: dict[str, float]) -> str:
        return " or ".join(_part(c, sel, knobs) for c in self.any)

    def judge(self, view: StepView, knobs: dict[str, float]) -> float | None:
        return next((v for c in self.any if (v := c.judge(view, knobs)) is not None), None)

    def terms(self) -> list[Term]:
        return [t for c in self.any for t in c.terms()]

    def knob_names(self) -> set[str]:
        return set().union(*(c.knob_names() for c in self.any))


def _node_of(doc: object) -> str:
    if isinstance(doc, dict):
        return "all" if "all" in doc else "any" if "any" in doc else "compare"
    return "all" if isinstance(doc, AllOf) else "any" if isinstance(doc, AnyOf) else "compare"


# A node is told apart by its key (all, any, or a comparison), so a problem is reported in that branch only.
Node = Annotated[Union[Annotated[Compare, Tag("compare")], Annotated[AllOf, Tag("all")],  # noqa: UP007
                       Annotated[AnyOf, Tag("any")]], Discriminator(_node_of)]
NODES = ("compare", "all", "any")  # the tags pydantic puts in an error's location
AllOf.model_rebuild()
AnyOf.model_rebuild()


def _part(node: Node, sel: str, knobs: dict[str, float]) -> str:
    text = node.promql(sel, knobs)
    return text if isinstance(node, Compare) else f"({text})"


def _names(text: str | None) -> set[str]:
    import ast

    if not text:
        return set()
    try:
        return {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}
    except SyntaxError:
        return set()


@register
class ConditionAlert(WithParams, WithTest, AlertBase):
    kind: Literal["condition"] = "condition"
    when: Node = Field(description="comparisons of one sidecar's series, combined with all/any")
    explicit_test = True

    @model_validator(mode="after")
    def _knobs_used(self) -> ConditionAlert:
        used, declared = self.when.knob_names(), set(self.params)
        bad = []
        if used - declared:
            bad.append(f"when uses undeclared param(s) {sorted(used - declared)}")
        if declared - used:
            bad.append(f"param(s) {sorted(declared - used)} are not used in when")
        try:
            self.when.promql("", dict.fromkeys(declared, 1.0))
        except ValueError as e:
            bad.append(f"when: {e}")
        if bad:
            raise ValueError("; ".join(bad))
        return self

    def promql(self, sel: str) -> str:
        return self.when.promql(sel, self.knob_values())

    def test_case(self, spec: Spec) -> dict[str, Any]:
        return promtool.explicit_case(spec, self, self.test or {})  # a test is required (_common)

    def signals(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.signal for t in self.when.terms() if t.signal))

    def metrics(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.metric for t in self.when.terms() if t.metric))

    def series_read(self) -> list[tuple[str, dict[str, str]]]:
        return [(t.metric, t.labels) for t in self.when.terms() if t.metric]

    def blind_reason(self, spec: Spec) -> str | None:
        for t in self.when.terms():
            if t.metric and (why := verl_keyed(spec, t.metric, t.labels)):
                return why
        return None

    def judge(self, view: StepView) -> float | None:
        return self.when.judge(view, self.knob_values())

    def quantities(self, sel: str) -> dict[str, tuple[str, str]]:
        """Each knob's side of its comparison, where the comparisons it is AND-ed with hold."""
        knobs, out = self.knob_values(), {}

        def walk(node: Node, gates: list[Node]) -> None:
            if isinstance(node, Compare):
                found = node.quantity(sel, knobs)
                if found and found[0] not in out:
                    name, text, words = found
                    for g in gates:
                        text += f" and {JOIN} ({g.promql(sel, knobs)})"
                    out[name] = (text, words + (" where the rest holds" if gates else ""))
            elif isinstance(node, AllOf):
                for c in node.all:
                    walk(c, gates + [o for o in node.all if o is not c])
            else:
                for c in node.any:
                    walk(c, gates)

        walk(self.when, [])
        return out
