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
from typing import Any

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
ALERT_KEYS = {"alert", "kind", "severity", "summary", "description", "for", "op", "threshold", "matchers",
              "aggregate", "window", "k", "direction", "rel_floor", "horizon", "expr", "labels", "runbook",
              "test", "inhibits", "keep_firing_for", "signal", "change", "confirm", "params", "safety"}
PARAM_KEYS = {"value", "op", "min", "max"}
PARAM_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED_PLACEHOLDERS = ("metric", "sel")
EXPR_PLACEHOLDER_RE = re.compile(r"<([a-z][a-z0-9_]*)>")
TEXT_PLACEHOLDER_RE = re.compile(r"<([a-z][a-z0-9_]*)(\|pct)?>")
TEST_EXPR_RE = re.compile(r"<([^<>]+)>")
SIGNAL_MATCHER_RE = re.compile(r'signal\s*=~?\s*"([^"]+)"')
SAFETY = ("hard",)  # safety: hard marks an alert calibrate never loosens (NaN/Inf, hangs, hardware faults)
CONFIRM_KEYS = {"signal", "direction", "k", "change"}
PANEL_KEYS = {"dashboard", "row", "title", "type", "query", "legend", "moving_average", "stack", "rate",
              "width", "height", "unit", "min", "max", "description"}
RUNBOOK_KEYS = {"meaning", "confirm", "action"}


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


def _check_template(where: str, text: str, problems: list[str]) -> None:
    leftover = TEMPLATE_RE.sub("", text)
    if "{{" in leftover or "}}" in leftover:
        problems.append(f"{where}: only {{{{ $value | printf \"%.3g\" }}}} and {{{{ $labels.NAME }}}} may be used "
                        f"in annotations, got {text!r}")


def parse_alert(metric: str, i: int, raw: dict, problems: list[str]) -> Alert | None:
    name = raw.get("alert")
    where = f"metric {metric!r} alert {name!r}" if name else f"metric {metric!r} alerts[{i}]"
    unknown = set(raw) - ALERT_KEYS
    if unknown:
        problems.append(f"{where}: unknown key(s) {sorted(unknown)}")
    missing = [k for k in ("alert", "kind", "severity", "summary", "description") if k not in raw]
    if missing:
        problems.append(f"{where}: missing required key(s) {missing}")
        return None
    if not ALERT_NAME_RE.match(str(name)):
        problems.append(f"{where}: alert names are CamelCase and start with Verl")
    kind = raw["kind"]
    if kind not in KINDS:
        problems.append(f"{where}: kind must be one of {list(KINDS)}, got {kind!r}")
    if raw["severity"] not in SEVERITIES:
        problems.append(f"{where}: severity must be one of {list(SEVERITIES)}")
    for key in ("summary", "description"):
        if not isinstance(raw[key], str) or not raw[key].strip():
            problems.append(f"{where}: {key} must be a non-empty sentence")
        else:
            _check_template(where, raw[key], problems)
    for key in ("for", "window", "horizon", "keep_firing_for"):
        if key in raw and not DURATION_RE.match(str(raw[key])):
            problems.append(f"{where}: {key} must be a Prometheus duration like 5m, got {raw[key]!r}")
    if "op" in raw and raw["op"] not in OPS:
        problems.append(f"{where}: op must be one of {list(OPS)}")
    threshold = raw.get("threshold")
    if kind in ("threshold", "trend", "stale") and (not isinstance(threshold, (int, float))
                                                    or isinstance(threshold, bool)):
        problems.append(f"{where}: a {kind} alert needs a numeric threshold")
    if kind == "expr" and not str(raw.get("expr", "")).strip():
        problems.append(f"{where}: an expr alert needs expr")
    if kind == "expr" and not isinstance(raw.get("test"), dict):
        problems.append(f"{where}: an expr alert needs a test (input series, when it fires, when it is silent)")
    if kind == "adaptive":
        if raw.get("direction", "up") not in DIRECTIONS:
            problems.append(f"{where}: direction must be one of {list(DIRECTIONS)}")
        k = raw.get("k", 4.0)
        if not isinstance(k, (int, float)) or k <= 0:
            problems.append(f"{where}: k must be a positive number of standard deviations")
    confirm: list[Confirm] = []
    if kind == "detector":
        if not isinstance(raw.get("signal"), str) or not raw.get("signal"):
            problems.append(f"{where}: a detector alert needs a signal")
        if raw.get("direction", "up") not in DIRECTIONS:
            problems.append(f"{where}: direction must be one of {list(DIRECTIONS)}")
        for j, c in enumerate(raw.get("confirm", []) or []):
            if not isinstance(c, dict) or set(c) - CONFIRM_KEYS or not isinstance(c.get("signal"), str) \
                    or c.get("direction", "down") not in DIRECTIONS:
                problems.append(f"{where}: confirm[{j}] needs a signal and may hold {sorted(CONFIRM_KEYS)}")
                continue
            confirm.append(Confirm(signal=c["signal"], direction=c.get("direction", "down"),
                                   k=float(c.get("k", raw.get("k", 4.0))), change=float(c.get("change", 0.0))))
    runbook = raw.get("runbook", {}) or {}
    if not isinstance(runbook, dict) or set(runbook) - RUNBOOK_KEYS:
        problems.append(f"{where}: runbook may hold {sorted(RUNBOOK_KEYS)}")
        runbook = {}
    labels = raw.get("labels", {}) or {}
    if not isinstance(labels, dict) or "severity" in labels:
        problems.append(f"{where}: labels must be a mapping (severity has its own key)")
        labels = {}
    inhibits = raw.get("inhibits", []) or []
    if not isinstance(inhibits, list) or not all(ALERT_NAME_RE.match(str(x)) for x in inhibits):
        problems.append(f"{where}: inhibits must list alert names")
        inhibits = []
    test = raw.get("test", {}) or {}
    if not isinstance(test, dict):
        problems.append(f"{where}: test must be a mapping")
        test = {}
    params = _parse_params(where, kind, raw, problems)
    if raw.get("safety", "hard") not in SAFETY:
        problems.append(f"{where}: safety may only be {list(SAFETY)}")
    alert = Alert(
        alert=str(name), kind=kind, severity=raw["severity"], summary=" ".join(str(raw["summary"]).split()),
        description=" ".join(str(raw["description"]).split()), metric=metric, for_=str(raw.get("for", "0m")),
        op=raw.get("op", ">"), threshold=raw.get("threshold"), matchers=str(raw.get("matchers", "")),
        aggregate=str(raw.get("aggregate", "")), window=str(raw.get("window", "30m")), k=float(raw.get("k", 4.0)),
        direction=raw.get("direction", "up"), rel_floor=float(raw.get("rel_floor", 0.05)),
        horizon=str(raw.get("horizon", "4h")), expr=" ".join(str(raw.get("expr", "")).split()),
        labels={str(k): str(v) for k, v in labels.items()}, runbook={k: str(v) for k, v in runbook.items()},
        test=test, inhibits=tuple(inhibits), keep_firing_for=str(raw.get("keep_firing_for", "")),
        signal=str(raw.get("signal", "")), change=float(raw.get("change", 0.0)), confirm=tuple(confirm),
        params=params, safety=str(raw.get("safety", "")), base_for=str(raw.get("for", "0m")))
    alert = replace(alert, texts={"summary": alert.summary, "description": alert.description,
                                  **{f"runbook.{k}": v for k, v in alert.runbook.items()}})
    names = set(knobs(alert))
    for key in ("summary", "description"):  # runbook prose may hold <step>-like words of its own
        text = alert.texts[key]
        unknown = {name for name, _ in TEXT_PLACEHOLDER_RE.findall(text)} - names
        if unknown:
            problems.append(f"{where}: {key} quotes <{'>, <'.join(sorted(unknown))}>, which are not its knobs "
                            f"({sorted(names)})")
    if kind == "expr":
        for j, s in enumerate(test.get("input", []) or []):
            if isinstance(s, dict):
                _check_test_exprs(f"{where} test.input[{j}]", str(s.get("values", "")), names, problems)
        for key in ("value", "value_slope"):
            if key in test:
                _check_test_exprs(f"{where} test.{key}", str(test[key]), names, problems)
    return render_texts(alert)


def _parse_params(where: str, kind: str, raw: dict, problems: list[str]) -> tuple[Param, ...]:
    declared = raw.get("params")
    expr = str(raw.get("expr", ""))
    used = set(EXPR_PLACEHOLDER_RE.findall(expr)) - set(RESERVED_PLACEHOLDERS)
    if declared is None:
        if kind == "expr" and used:
            problems.append(f"{where}: expr uses <{'>, <'.join(sorted(used))}> but declares no params")
        return ()
    if kind != "expr":
        problems.append(f"{where}: only expr alerts declare params (a {kind} alert's knobs are its own keys)")
        return ()
    if not isinstance(declared, dict):
        problems.append(f"{where}: params must map names to {{value, op}}")
        return ()
    out = []
    for name, spec in declared.items():
        pw = f"{where} params.{name}"
        if not isinstance(name, str) or not PARAM_NAME_RE.match(name) or name in RESERVED_PLACEHOLDERS:
            problems.append(f"{pw}: a param name is lower_snake_case (not metric or sel)")
            continue
        if not isinstance(spec, dict) or set(spec) - PARAM_KEYS or "value" not in spec:
            problems.append(f"{pw}: needs value (and op), may hold {sorted(PARAM_KEYS)}")
            continue
        numbers = {}
        for key in ("value", "min", "max"):
            v = spec.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                problems.append(f"{pw}: {key} must be a number")
                v = None
            numbers[key] = None if v is None else float(v)
        if numbers["value"] is None:
            continue
        op = spec.get("op", ">")
        if op not in OPS:
            problems.append(f"{pw}: op must be one of {list(OPS)}")
            op = ">"
        p = Param(name=name, value=numbers["value"], op=op, min=numbers["min"], max=numbers["max"])
        if not in_range(p, p.value):
            problems.append(f"{pw}: value {p.value:g} is outside [{p.min}, {p.max}]")
        out.append(p)
    names = {p.name for p in out}
    if used - names:
        problems.append(f"{where}: expr uses undeclared param(s) {sorted(used - names)}")
    if names - used:
        problems.append(f"{where}: param(s) {sorted(names - used)} are not used in expr")
    return tuple(out)


def in_range(p: Param, value: float) -> bool:
    return (p.min is None or value >= p.min) and (p.max is None or value <= p.max)


def _check_test_exprs(where: str, text: str, names: set[str], problems: list[str]) -> None:
    for expr in TEST_EXPR_RE.findall(text):
        try:
            eval_knob_expr(expr, {n: 1.0 for n in names})
        except ValueError as e:
            problems.append(f"{where}: <{expr}>: {e}")


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


def parse_panel(metric: str, i: int, raw: dict, problems: list[str]) -> Panel | None:
    where = f"metric {metric!r} panels[{i}]"
    unknown = set(raw) - PANEL_KEYS
    if unknown:
        problems.append(f"{where}: unknown key(s) {sorted(unknown)}")
    if raw.get("dashboard") not in DASHBOARDS:
        problems.append(f"{where}: dashboard must be one of {list(DASHBOARDS)}")
        return None
    if not raw.get("title"):
        problems.append(f"{where}: a panel needs a title")
        return None
    if raw.get("type", "timeseries") not in PANEL_TYPES:
        problems.append(f"{where}: type must be one of {list(PANEL_TYPES)}")
    query = str(raw.get("query", "<metric>{<sel>}"))
    if "<sel>" not in query:
        problems.append(f"{where}: the query must use <sel> so the dashboard's job/run/rank variables apply")
    if raw.get("rate") and query != "<metric>{<sel>}":
        problems.append(f"{where}: rate: true wraps the plain selector; write rate() into a custom query instead")
    if "rate(" in query and "$__rate_interval" not in query:
        problems.append(f"{where}: rate() in a panel must use [$__rate_interval]")
    width = raw.get("width", 12)
    if not isinstance(width, int) or not 1 <= width <= 24:
        problems.append(f"{where}: width is 1-24 grid columns")
    return Panel(metric=metric, dashboard=raw["dashboard"], title=str(raw["title"]), row=str(raw.get("row", "")),
                 type=raw.get("type", "timeseries"), query=query, legend=str(raw.get("legend", "")),
                 moving_average=str(raw.get("moving_average", "")), stack=bool(raw.get("stack", False)),
                 rate=bool(raw.get("rate", False)), width=width if isinstance(width, int) else 12,
                 height=int(raw.get("height", 8)), unit=str(raw.get("unit", "")), min=raw.get("min"),
                 max=raw.get("max"), description=str(raw.get("description", "")))


def equality_matchers(text: str) -> dict[str, str]:
    """The name="value" matchers of a selector: the labels absent() and aggregations keep."""
    return dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"', text))
