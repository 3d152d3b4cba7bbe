"""What every alert kind has: the common keys of an alert, its texts rendered with its knobs, and the
interface each kind module fills in (its PromQL, its promtool test, its labels, its in-process evaluation).

A kind is a subclass of ``AlertBase`` with ``kind: Literal["<name>"]``, registered with ``@register``; the
spec's ``alerts:`` lists are the union of the registered kinds, told apart by ``kind``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticUndefined

from ...core.models import StrictModel
from ..rules import (
    RESERVED_PLACEHOLDERS,
    TEMPLATE_RE,
    TEST_EXPR_RE,
    TEXT_PLACEHOLDER_RE,
    AlertName,
    Duration,
    KnobUnit,
    MetricUnit,
    Op,
    Param,
    ParamName,
    Sentence,
    Severity,
    eval_knob_expr,
    render_text,
)

if TYPE_CHECKING:
    from .. import Spec

KINDS: dict[str, type[AlertBase]] = {}  # kind name -> its model, in registration order
CROSS_METRIC = "(cross-metric)"  # the metric of an alert declared at the top level


def register(cls: type[AlertBase]) -> type[AlertBase]:
    KINDS[cls.model_fields["kind"].default] = cls
    return cls


def knob_field(default: Any = PydanticUndefined, *, meaning: str, unit: KnobUnit | None, op: Op | None = ">",
               min: float | None = None, max: float | None = None) -> Any:
    """A kind's key that is one of its knobs: its meaning (the field's description), its unit (None: the
    metric's), on which side it fires (None: the alert's own op) and its range (also the key's bounds), declared
    once on the field; ``AlertBase.field_knob`` makes the knob's Param from it."""
    return Field(default, description=meaning, ge=min, le=max,
                 json_schema_extra={"knob": {"unit": unit, "op": op, "min": min, "max": max}})


def field_knob_of(model: type[StrictModel], name: str, value: float, *, echo: bool = False, **given: Any) -> Param:
    """The Param of a knob_field of a model (given: what the field leaves to the instance, unit or op). echo: the
    value is echoed unchecked (the declaration is checked at its range's bound), for a copy made off the range on
    purpose (the demo's compressed clock: tools/demo_stack.py compress_stalls); an overrides file is still held
    to the range."""
    f = model.model_fields[name]
    extra = f.json_schema_extra
    knob = extra.get("knob") if isinstance(extra, dict) else None
    assert isinstance(knob, dict), f"{model.__name__}.{name} is not declared with knob_field"
    decl = {k: v for k, v in knob.items() if v is not None}
    doc = {"value": float(value), "meaning": f.description, **decl, **given}
    if not echo:
        return Param.model_validate(doc)
    bound = doc.get("min", doc.get("max", 0.0))
    return Param.model_validate({**doc, "value": bound}).model_copy(update={"value": float(value)})


class StepView(Protocol):
    """What the in-process breaker shows a kind at one step (or tick) of a run."""

    @property
    def now(self) -> float:
        """The time of the step (or of the tick)."""

    @property
    def last_step_at(self) -> float | None:
        """When the latest step was logged."""

    def value(self, metric: str, labels: dict[str, str]) -> float | None:
        """The latest value logged for one series of a spec metric (NaN for verl's null), None if never."""

    def stat(self, signal: str, stat: str) -> float | None:
        """A step-domain signal's statistic as the sidecar would export it (verl_detector_<stat>), or None."""


class AlertBase(StrictModel):
    """An alert, on a metric entry or (on several metrics) at the top level."""

    kind: str
    alert: AlertName
    severity: Severity
    summary: Sentence
    description: Sentence
    for_: Duration = Field("0m", alias="for")
    labels: dict[str, str] = Field(default_factory=dict, description="team decides the route")
    runbook: dict[Literal["meaning", "confirm", "action"], str] = Field(default_factory=dict)
    inhibits: list[AlertName] = Field(default_factory=list)
    # symptom alerts it may be the cause of but must not silence (a critical hang with other causes): the
    # runbook names it in theirs, as it names the alerts that inhibit them
    explains: list[AlertName] = Field(default_factory=list)
    # how long the alert stays firing after its condition stops: Prometheus >= 2.42 (render/rules.py); vmalert
    # 1.79 refuses the key and gets the alerts without it (render/victoriametrics.py)
    keep_firing_for: Duration | None = None
    safety: Literal["hard"] | None = Field(None, description="hard: calibrate never loosens it")

    # A kind that brings its own promtool test (`test:` with input series and times) says so.
    explicit_test: ClassVar[bool] = False
    # A kind judged between steps too (the breaker's ticks), not only when a step arrives.
    judged_between_steps: ClassVar[bool] = False
    # A kind that watches the metric entry it is declared on (it cannot be a top-level alert).
    on_entry: ClassVar[bool] = False
    # A kind calibrate never loosens, whatever the spec says (NaN/Inf).
    hard_safety: ClassVar[bool] = False

    _metric: str = PrivateAttr(CROSS_METRIC)  # the spec entry it is declared on (set by the entry)
    _unit: MetricUnit = PrivateAttr("")  # that entry's unit
    _codes: dict[str, tuple[int, ...]] = PrivateAttr(default_factory=dict)  # the spec's code sets (Spec binds them)
    _written: dict[str, str] = PrivateAttr(default_factory=dict)  # texts as written, with <knob> placeholders
    _base_for: str = PrivateAttr("0m")  # the `for` the spec gives (an explicit test is timed for it)
    _base_knobs: dict[str, float] = PrivateAttr(default_factory=dict)  # the knobs the spec gives (likewise)

    # ------------------------------------------------------------------ what each kind fills in
    def knobs(self) -> dict[str, Param]:
        """The alert's thresholds an overrides file may set, by name."""
        return {}

    def _knob_update(self, values: dict[str, float]) -> dict[str, Any]:
        """The fields that set those knobs."""
        return {}

    def promql(self, sel: str) -> str:
        raise NotImplementedError

    def test_case(self, spec: Spec) -> dict[str, Any]:
        """The alert's promtool test group (promtool.group)."""
        raise NotImplementedError

    def signals(self) -> tuple[str, ...]:
        """The step-domain signals (detect:) whose gauges the alert reads."""
        return ()

    def breaker_signals(self) -> tuple[str, ...]:
        """The signals its in-process evaluation needs."""
        return self.signals()

    def wait_seconds(self) -> float:
        """How long its condition takes to hold after a fault beyond the windows of its PromQL (an age)."""
        return 0.0

    def series_read(self) -> list[tuple[str, dict[str, str]]]:
        """The (metric, labels) series its ``judge`` reads through ``view.value``."""
        return []

    def metrics(self) -> tuple[str, ...]:
        """Metrics other than its entry's that it names in its declaration (checked to exist)."""
        return ()

    def blind_reason(self, spec: Spec) -> str | None:
        """Why a trainer process cannot judge this alert itself (None: the breaker can)."""
        return f"a {self.kind} alert is judged by Prometheus only"

    def judge(self, view: StepView) -> float | None:
        """The alert's $value if its condition holds now (before its `for`), else None."""
        return None

    def quantities(self, sel: str) -> dict[str, tuple[str, str]]:
        """{knob: (the PromQL of what it is compared with, where the rest of the condition holds; what that
        is, in words)}: what calibrate reads on healthy runs."""
        return {}

    # ------------------------------------------------------------------ the same for every kind
    @property
    def metric(self) -> str:
        return self._metric

    @property
    def metric_unit(self) -> KnobUnit:
        """Its entry's unit as a knob's: a plain number is "number"."""
        return self._unit or "number"

    @property
    def base_for(self) -> str:
        return self._base_for

    @property
    def base_knobs(self) -> dict[str, float]:
        return dict(self._base_knobs)

    def knob_values(self) -> dict[str, float]:
        return {name: p.value for name, p in self.knobs().items()}

    def with_knobs(self, values: dict[str, float]) -> AlertBase:
        """The alert with some knobs set (names must be among knobs()); its texts follow."""
        if not values:
            return self
        out = self.model_copy(update=self._knob_update({k: float(v) for k, v in values.items()}))
        out._render()
        return out

    def on_metric(self, metric: str, unit: MetricUnit = "") -> AlertBase:
        self._metric = metric
        self._unit = unit
        return self

    def field_knob(self, name: str, *, echo: bool = False, **given: Any) -> Param:
        """The knob of one of its knob_field keys, at its value."""
        return field_knob_of(type(self), name, getattr(self, name), echo=echo, **given)

    def code_sets(self) -> tuple[str, ...]:
        """The spec's code sets (codes:) its PromQL or its test quotes as <codes.NAME>."""
        return ()

    def code_values(self) -> dict[str, tuple[int, ...]]:
        """The code sets it reads, as bound by its spec."""
        return dict(self._codes)

    def with_codes(self, codes: dict[str, tuple[int, ...]]) -> AlertBase:
        """The alert reading these code sets (a copy when they differ from those it reads)."""
        own = {name: codes[name] for name in self.code_sets() if name in codes}
        if own == {name: self._codes.get(name) for name in self.code_sets()}:
            return self
        out = self.model_copy()
        out._codes = own
        return out

    def _render(self) -> None:
        values = self.knob_values()
        w = self._written
        self.__dict__["summary"] = render_text(w["summary"], values)
        self.__dict__["description"] = render_text(w["description"], values)
        self.__dict__["runbook"] = {k.split(".", 1)[1]: render_text(v, values) for k, v in w.items()
                                    if k.startswith("runbook.")}

    @field_validator("summary", "description")
    @classmethod
    def _template(cls, text: str) -> str:
        leftover = TEMPLATE_RE.sub("", text)
        if "{{" in leftover or "}}" in leftover:
            raise ValueError('only {{ $value | printf "%.3g" }} and {{ $labels.NAME }} may be used in annotations')
        return " ".join(text.split())

    @field_validator("labels")
    @classmethod
    def _no_severity(cls, labels: dict[str, str]) -> dict[str, str]:
        if "severity" in labels:
            raise ValueError("severity has its own key")
        return labels

    @model_validator(mode="after")
    def _common(self) -> AlertBase:
        """The texts and the test quote only the alert's knobs; then the texts are rendered with them."""
        bad = []
        names = set(self.knobs())
        for key in ("summary", "description"):  # runbook prose may hold <step>-like words of its own
            unknown = {name for name, _ in TEXT_PLACEHOLDER_RE.findall(getattr(self, key))} - names
            if unknown:
                bad.append(f"{key} quotes <{'>, <'.join(sorted(unknown))}>, which are not its knobs "
                           f"({sorted(names)})")
        test = getattr(self, "test", None)
        if self.explicit_test and test is None:
            bad.append(f"a {self.kind} alert needs a test (input series, when it fires, when it is silent)")
        if self.explicit_test and test:
            texts = {f"test.input[{j}]": str(s.get("values", "")) for j, s in enumerate(test.get("input") or [])
                     if isinstance(s, dict)}
            texts.update({f"test.{key}": str(test[key]) for key in ("value", "value_slope") if key in test})
            for where, text in texts.items():
                for expr in TEST_EXPR_RE.findall(text):
                    try:
                        eval_knob_expr(expr, dict.fromkeys(names, 1.0))
                    except ValueError as e:
                        bad.append(f"{where}: <{expr}>: {e}")
        if bad:
            raise ValueError("; ".join(bad))
        self._written = {"summary": self.summary, "description": self.description,
                         **{f"runbook.{k}": v for k, v in self.runbook.items()}}
        self._base_for = self.for_
        self._base_knobs = self.knob_values()
        self._render()
        return self


class WithParams(StrictModel):
    """Kinds whose knobs are named thresholds of their own (``params:``)."""

    params: dict[ParamName, Param] = Field(default_factory=dict, description="its named thresholds (knobs)")

    @field_validator("params")
    @classmethod
    def _param_names(cls, params: dict[str, Param]) -> dict[str, Param]:
        reserved = set(params) & set(RESERVED_PLACEHOLDERS)
        if reserved:
            raise ValueError(f"{sorted(reserved)} are the placeholders of every expr, not params")
        return params

    def knobs(self) -> dict[str, Param]:
        return dict(self.params)

    def _knob_update(self, values: dict[str, float]) -> dict[str, Any]:
        return {"params": {name: p.model_copy(update={"value": values[name]}) if name in values else p
                           for name, p in self.params.items()}}


class WithTest(StrictModel):
    """Kinds that bring their own promtool test."""

    test: dict[str, Any] | None = Field(None, description="input series, when it fires and when it is silent")
