"""The rule and dashboard part of the spec: alerts, recording rules and panels declared on metric entries.

Kept apart from the metric model (``spec/__init__.py``) because the sidecar never needs it: only the
generator (``verl-exporter generate``) and its tests read these.

Placeholders in PromQL written in the spec:
  <metric>  the entry's metric name
  <sel>     the selector of the place the query goes: rules get the spec's ``selector`` (job="verl"),
            dashboards get job/run/rank template variables
  <name>    an expr alert's named threshold (``params:``), a knob an overrides file may change

Every alert has knobs (``knobs()``): ``threshold`` (kinds threshold, trend, stale), ``k`` and ``change``
(detector), ``k`` (adaptive) or its declared ``params`` (expr). Its summary, description and runbook may quote
them as ``<name>`` (the number) or ``<name|pct>`` (a percentage), and an expr alert's test may compute its
input values from them (``<expression>``: numbers, knob names, + - * /, min(), max()), so that the rules, their
tests and their texts follow an overridden knob.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StringConstraints, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..core.models import StrictModel

ALERT_NAME_RE = re.compile(r"^Verl[A-Z][A-Za-z0-9]*$")
DURATION_RE = re.compile(r"^(\d+[smhd])+$")
SEVERITIES = ("critical", "warning", "info")
KINDS = ("threshold", "nonfinite", "adaptive", "trend", "stale", "absent", "expr", "detector")
OPS = (">", "<", ">=", "<=")
DIRECTIONS = ("up", "down", "both")
DASHBOARDS = ("overview", "training", "gpu", "host")
PANEL_TYPES = ("timeseries", "bars", "stat", "heatmap", "bargauge", "table")
# The only Go-template constructs a summary/description may use, so that tests can expand them exactly.
TEMPLATE_RE = re.compile(r"\{\{\s*(\$value\s*\|\s*printf\s+\"%\.\d+[gf]\"|\$labels\.[a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
PARAM_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED_PLACEHOLDERS = ("metric", "sel")
EXPR_PLACEHOLDER_RE = re.compile(r"<([a-z][a-z0-9_]*)>")
TEXT_PLACEHOLDER_RE = re.compile(r"<([a-z][a-z0-9_]*)(\|pct)?>")
TEST_EXPR_RE = re.compile(r"<([^<>]+)>")
SIGNAL_MATCHER_RE = re.compile(r'signal\s*=~?\s*"([^"]+)"')


def duration_seconds(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", text))


@dataclass(frozen=True)
class Param:
    """One knob of an alert: its value, and on which side of it the alert fires (op: the watched quantity
    {op} value fires, so raising a ">" knob or lowering a "<" one loosens the alert)."""

    name: str
    value: float
    op: str = ">"
    min: float | None = None
    max: float | None = None

    def loosens(self, new: float) -> bool:
        return new > self.value if self.op in (">", ">=") else new < self.value


@dataclass(frozen=True)
class Alert:
    alert: str
    kind: str
    severity: str
    summary: str
    description: str
    metric: str  # the spec entry the alert is declared on
    for_: str = "0m"
    op: str = ">"
    threshold: float | None = None
    matchers: str = ""
    aggregate: str = ""
    window: str = "30m"
    k: float = 4.0
    direction: str = "up"
    rel_floor: float = 0.05
    horizon: str = "4h"
    expr: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    runbook: dict[str, str] = field(default_factory=dict)
    test: dict[str, Any] = field(default_factory=dict)
    inhibits: tuple[str, ...] = ()
    keep_firing_for: str = ""
    # kind detector: a step-domain signal (verl_exporter.core.detect) and, optionally, other signals that must
    # deviate at the same time (each a Confirm) for the alert to hold
    signal: str = ""
    change: float = 0.0  # the relative change from the expected value the deviation must also reach
    confirm: tuple[Confirm, ...] = ()
    params: tuple[Param, ...] = ()  # kind expr: the named thresholds of its expression
    base_for: str = ""  # the `for` the spec gives (an expr alert's test is timed for it); for_ may be overridden
    safety: str = ""  # "hard": NaN/Inf, hang, hardware (see is_hard_safety)
    # summary, description and runbook as written, with <knob> placeholders (rendered into the fields above)
    texts: dict[str, str] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Confirm:
    signal: str
    direction: str = "down"
    k: float = 4.0
    change: float = 0.0


@dataclass(frozen=True)
class Panel:
    metric: str
    dashboard: str
    title: str
    row: str = ""
    type: str = "timeseries"
    query: str = "<metric>{<sel>}"
    legend: str = ""
    moving_average: str = ""
    stack: bool = False
    rate: bool = False
    width: int = 12
    height: int = 8
    unit: str = ""
    min: float | None = None
    max: float | None = None
    description: str = ""


def in_range(p: Param, value: float) -> bool:
    return (p.min is None or value >= p.min) and (p.max is None or value <= p.max)


# ---------------------------------------------------------------------------------------------- knobs
def knobs(alert: Alert) -> dict[str, Param]:
    """The alert's thresholds an overrides file may set, by name."""
    numeric = isinstance(alert.threshold, (int, float)) and not isinstance(alert.threshold, bool)
    if alert.kind in ("threshold", "trend", "stale") and not numeric:
        return {}  # an invalid alert (its loader reports it)
    if alert.kind in ("threshold", "trend"):
        return {"threshold": Param("threshold", float(alert.threshold), alert.op)}
    if alert.kind == "stale":
        return {"threshold": Param("threshold", float(alert.threshold), ">", min=0)}
    if alert.kind == "detector":
        return {"k": Param("k", alert.k, ">", min=0.5), "change": Param("change", alert.change, ">", min=0)}
    if alert.kind == "adaptive":
        return {"k": Param("k", alert.k, ">", min=0.5)}
    return {p.name: p for p in alert.params}


def with_knobs(alert: Alert, values: dict[str, float]) -> Alert:
    """The alert with some knobs set (names must be among knobs(alert)); its texts follow."""
    if not values:
        return alert
    direct = {k: float(v) for k, v in values.items() if k in ("threshold", "k", "change") and alert.kind != "expr"}
    params = tuple(replace(p, value=float(values[p.name])) if p.name in values else p for p in alert.params)
    return render_texts(replace(alert, params=params, **direct))


def knob_values(alert: Alert) -> dict[str, float]:
    return {name: p.value for name, p in knobs(alert).items()}


def fmt_knob(value: float) -> str:
    """A knob as PromQL and promtool series read it: up to 12 significant digits, never an exponent."""
    text = f"{value:.12g}"
    if "e" in text:
        text = f"{float(text):.12f}".rstrip("0").rstrip(".")
    return text


def render_text(text: str, values: dict[str, float]) -> str:
    def one(m: re.Match) -> str:
        if m.group(1) not in values:
            return m.group(0)
        v = values[m.group(1)]
        return f"{fmt_knob(round(v * 100, 10))}%" if m.group(2) else fmt_knob(v)

    return TEXT_PLACEHOLDER_RE.sub(one, text)


def render_texts(alert: Alert) -> Alert:
    values = knob_values(alert)
    texts = alert.texts or {"summary": alert.summary, "description": alert.description}
    runbook = {k.split(".", 1)[1]: render_text(v, values) for k, v in texts.items() if k.startswith("runbook.")}
    return replace(alert, summary=render_text(texts["summary"], values),
                   description=render_text(texts["description"], values), runbook=runbook or alert.runbook)


def fill_params(expr: str, alert: Alert) -> str:
    """An expr alert's PromQL with its params' values in place of <name>."""
    values = {p.name: p.value for p in alert.params}
    return EXPR_PLACEHOLDER_RE.sub(lambda m: fmt_knob(values[m.group(1)]) if m.group(1) in values else m.group(0),
                                   expr)


def fill_test_text(text: str, alert: Alert) -> str:
    """A test's input values or expected value with each <expression> of the knobs computed."""
    values = knob_values(alert)
    return TEST_EXPR_RE.sub(lambda m: fmt_knob(eval_knob_expr(m.group(1), values)), text)


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}


def eval_knob_expr(text: str, values: dict[str, float]) -> float:
    """Arithmetic over knobs: numbers, names, + - * /, unary -, min(), max(). Raises ValueError otherwise."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def ev(node) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.Name):
            if node.id not in values:
                raise ValueError(f"unknown knob {node.id!r} (knobs: {sorted(values)})")
            return float(values[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max") \
                and node.args and not node.keywords:
            args = [ev(a) for a in node.args]
            return min(args) if node.func.id == "min" else max(args)
        raise ValueError(f"only numbers, knob names, + - * / and min()/max() are allowed, got {ast.dump(node)}")

    try:
        return ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None


def alert_signals(alert: Alert) -> tuple[str, ...]:
    """The step-domain signals (detect:) whose gauges the alert reads."""
    if alert.kind == "detector":
        return (alert.signal,)
    if alert.kind == "expr":
        found = []
        for group in SIGNAL_MATCHER_RE.findall(alert.expr):
            found.extend(x for x in group.split("|") if x and x not in found)
        return tuple(found)
    return ()


def equality_matchers(text: str) -> dict[str, str]:
    """The name="value" matchers of a selector: the labels absent() and aggregations keep."""
    return dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"', text))


# ---------------------------------------------------------------------------------------------- the file's shape
def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("number_type", "must be a number")
    return value


# A number kept as written (an int stays an int, as the dashboards' JSON and the rules print it).
Number = Annotated[int | float, BeforeValidator(_number)]
Duration = Annotated[str, StringConstraints(pattern=DURATION_RE.pattern)]
Sentence = Annotated[str, StringConstraints(pattern=r"\S")]
AlertName = Annotated[str, StringConstraints(pattern=ALERT_NAME_RE.pattern)]
ParamName = Annotated[str, StringConstraints(pattern=PARAM_NAME_RE.pattern)]
# What a pattern check says when it fails (core.models reports pydantic's own words otherwise).
PATTERN_MESSAGES = {
    DURATION_RE.pattern: "must be a Prometheus duration like 5m",
    r"\S": "must be a non-empty sentence",
    ALERT_NAME_RE.pattern: "alert names are CamelCase and start with Verl",
    PARAM_NAME_RE.pattern: "a param name is lower_snake_case",
}


class ParamEntry(StrictModel):
    """A named threshold of an expr alert (a knob an overrides file may change)."""

    value: float
    op: Literal[OPS] = Field(">", description="the watched quantity {op} value fires")
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _in_range(self) -> ParamEntry:
        if not in_range(self.to_param(""), self.value):
            raise ValueError(f"value {self.value:g} is outside [{self.min}, {self.max}]")
        return self

    def to_param(self, name: str) -> Param:
        return Param(name=name, value=self.value, op=self.op, min=self.min, max=self.max)


class ConfirmEntry(StrictModel):
    """Another signal that must deviate at the same time for a detector alert to hold."""

    signal: str
    direction: Literal[DIRECTIONS] = "down"
    k: float | None = Field(None, description="default: the alert's k")
    change: float = 0.0


class AlertEntry(StrictModel):
    """An alert, on a metric entry or (kind expr, on several metrics) at the top level."""

    alert: AlertName
    kind: Literal[KINDS]
    severity: Literal[SEVERITIES]
    summary: Sentence
    description: Sentence
    for_: Duration = Field("0m", alias="for")
    op: Literal[OPS] = ">"
    threshold: Number | None = Field(None, description="kinds threshold, trend and stale")
    matchers: str = ""
    aggregate: str = ""
    window: Duration = "30m"
    k: float = Field(4.0, gt=0, description="standard deviations (kinds adaptive and detector)")
    direction: Literal[DIRECTIONS] = "up"
    rel_floor: float = 0.05
    horizon: Duration = "4h"
    expr: str = Field("", description="kind expr: PromQL with <metric>, <sel> and <param> placeholders")
    labels: dict[str, str] = Field(default_factory=dict, description="team decides the route")
    runbook: dict[Literal["meaning", "confirm", "action"], str] = Field(default_factory=dict)
    test: dict[str, Any] | None = Field(None, description="kind expr: input series, when it fires and is silent")
    inhibits: list[AlertName] = Field(default_factory=list)
    # how long the alert stays firing after its condition stops: Prometheus >= 2.42 (render/rules.py); vmalert
    # 1.79 refuses the key and gets the alerts without it (render/victoriametrics.py)
    keep_firing_for: Duration | None = None
    signal: str = Field("", description="kind detector: the step-domain signal (detect:)")
    change: float = 0.0
    confirm: list[ConfirmEntry] = Field(default_factory=list)
    params: dict[ParamName, ParamEntry] | None = Field(None, description="kind expr: its named thresholds")
    safety: Literal["hard"] | None = Field(None, description="hard: calibrate never loosens it")

    @field_validator("summary", "description")
    @classmethod
    def _template(cls, text: str) -> str:
        leftover = TEMPLATE_RE.sub("", text)
        if "{{" in leftover or "}}" in leftover:
            raise ValueError('only {{ $value | printf "%.3g" }} and {{ $labels.NAME }} may be used in annotations')
        return text

    @field_validator("labels")
    @classmethod
    def _no_severity(cls, labels: dict[str, str]) -> dict[str, str]:
        if "severity" in labels:
            raise ValueError("severity has its own key")
        return labels

    @field_validator("params")
    @classmethod
    def _param_names(cls, params: dict[str, ParamEntry] | None) -> dict[str, ParamEntry] | None:
        reserved = set(params or ()) & set(RESERVED_PLACEHOLDERS)
        if reserved:
            raise ValueError(f"{sorted(reserved)} are the placeholders of every expr, not params")
        return params

    @model_validator(mode="after")
    def _by_kind(self) -> AlertEntry:
        """What each kind needs, and that the texts and the test quote only its knobs."""
        bad = []
        if self.kind in ("threshold", "trend", "stale") and self.threshold is None:
            bad.append(f"a {self.kind} alert needs a numeric threshold")
        if self.kind == "expr" and not self.expr.strip():
            bad.append("an expr alert needs expr")
        if self.kind == "expr" and self.test is None:
            bad.append("an expr alert needs a test (input series, when it fires, when it is silent)")
        if self.kind == "detector" and not self.signal:
            bad.append("a detector alert needs a signal")
        used = set(EXPR_PLACEHOLDER_RE.findall(self.expr)) - set(RESERVED_PLACEHOLDERS)
        declared = set(self.params or ())
        if self.params is not None and self.kind != "expr":
            bad.append(f"only expr alerts declare params (a {self.kind} alert's knobs are its own keys)")
        elif self.kind == "expr":
            if used - declared:
                bad.append(f"expr uses undeclared param(s) {sorted(used - declared)}")
            if declared - used:
                bad.append(f"param(s) {sorted(declared - used)} are not used in expr")
        names = set(knobs(self.to_alert("")))
        for key in ("summary", "description"):  # runbook prose may hold <step>-like words of its own
            unknown = {name for name, _ in TEXT_PLACEHOLDER_RE.findall(getattr(self, key))} - names
            if unknown:
                bad.append(f"{key} quotes <{'>, <'.join(sorted(unknown))}>, which are not its knobs "
                           f"({sorted(names)})")
        if self.kind == "expr" and self.test:
            texts = {f"test.input[{j}]": str(s.get("values", "")) for j, s in enumerate(self.test.get("input") or [])
                     if isinstance(s, dict)}
            texts.update({f"test.{key}": str(self.test[key]) for key in ("value", "value_slope") if key in self.test})
            for where, text in texts.items():
                for expr in TEST_EXPR_RE.findall(text):
                    try:
                        eval_knob_expr(expr, dict.fromkeys(names, 1.0))
                    except ValueError as e:
                        bad.append(f"{where}: <{expr}>: {e}")
        if bad:
            raise ValueError("; ".join(bad))
        return self

    def to_alert(self, metric: str) -> Alert:
        """The Alert of the metric entry ``metric``, its texts rendered with its knobs."""
        alert = Alert(
            alert=self.alert, kind=self.kind, severity=self.severity, summary=" ".join(self.summary.split()),
            description=" ".join(self.description.split()), metric=metric, for_=self.for_, op=self.op,
            threshold=self.threshold, matchers=self.matchers, aggregate=self.aggregate, window=self.window,
            k=float(self.k), direction=self.direction, rel_floor=float(self.rel_floor), horizon=self.horizon,
            expr=" ".join(self.expr.split()), labels=dict(self.labels), runbook=dict(self.runbook),
            test=dict(self.test or {}), inhibits=tuple(self.inhibits), keep_firing_for=self.keep_firing_for or "",
            signal=self.signal, change=float(self.change), safety=self.safety or "", base_for=self.for_,
            confirm=tuple(Confirm(c.signal, c.direction, float(self.k if c.k is None else c.k), float(c.change))
                          for c in self.confirm),
            params=tuple(p.to_param(name) for name, p in (self.params or {}).items()))
        alert = replace(alert, texts={"summary": alert.summary, "description": alert.description,
                                      **{f"runbook.{k}": v for k, v in alert.runbook.items()}})
        return render_texts(alert)


class PanelEntry(StrictModel):
    """A dashboard panel drawing the entry's metric (or a query of its own)."""

    dashboard: Literal[DASHBOARDS]
    row: str = ""
    title: Annotated[str, StringConstraints(min_length=1)]
    type: Literal[PANEL_TYPES] = "timeseries"
    query: str = Field("<metric>{<sel>}", description="PromQL with <metric> and <sel>")
    legend: str = ""
    moving_average: str = ""
    stack: bool = False
    rate: bool = False
    width: int = Field(12, ge=1, le=24, description="grid columns")
    height: int = 8
    unit: str = Field("", description="a Grafana unit")
    min: Number | None = None
    max: Number | None = None
    description: str = ""

    @model_validator(mode="after")
    def _query(self) -> PanelEntry:
        bad = []
        if "<sel>" not in self.query:
            bad.append("the query must use <sel> so the dashboard's job/run/rank variables apply")
        if self.rate and self.query != "<metric>{<sel>}":
            bad.append("rate: true wraps the plain selector; write rate() into a custom query instead")
        if "rate(" in self.query and "$__rate_interval" not in self.query:
            bad.append("rate() in a panel must use [$__rate_interval]")
        if bad:
            raise ValueError("; ".join(bad))
        return self

    def to_panel(self, metric: str) -> Panel:
        return Panel(metric=metric, **{name: getattr(self, name) for name in type(self).model_fields})
