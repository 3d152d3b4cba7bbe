"""The vocabulary every alert kind shares: durations, knobs and the texts that quote them.

An alert's kind (``spec/kinds/``) owns what differs: its keys, its PromQL, its promtool test, its labels, its
in-process evaluation (the breaker) and its calibration quantity. What is the same for every kind lives here.

Placeholders in PromQL written in the spec:
  <metric>  the entry's metric name
  <sel>     the selector of the place the query goes: rules get the spec's ``selector`` (job="verl"),
            dashboards get job/run/rank template variables
  <name>    a named threshold (``params:``), a knob an overrides file may change
  <codes.NAME>  a code set of the spec (``codes:``, shared by the alerts that quote it), as a regex
            alternation 48|63|...; an overrides file's ``codes:`` may replace it

Every alert has knobs (``alert.knobs()``, each a ``Param`` with its unit and one line of meaning: a kind makes
them from its keys, declared with ``kinds.base.knob_field``; an expr or condition alert writes them under
``params:``). Every number that decides whether an alert fires is one (tests/spec/test_spec_knobs.py walks them). Its
summary, description and runbook may quote them as ``<name>`` (the number), ``<name|pct>`` (a percentage) or
``<name|min>`` (seconds as minutes), and an alert's own test may compute its input values from them
(``<expression>``: numbers, knob names, + - * /, min(), max()), so that the rules, their tests and their texts
follow an overridden knob.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, Field, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

from ..core.models import StrictModel

ALERT_NAME_RE = re.compile(r"^Verl[A-Z][A-Za-z0-9]*$")
DURATION_RE = re.compile(r"^(\d+[smhd])+$")
Severity = Literal["critical", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
Op = Literal[">", "<", ">=", "<="]
OPS: tuple[Op, ...] = get_args(Op)
Direction = Literal["up", "down", "both"]
# Base units a metric's name may end with (Prometheus conventions: seconds, bytes, ratios 0-1); "" a plain number.
MetricUnit = Literal["", "seconds", "bytes", "ratio", "tokens", "tokens_per_second", "bytes_per_second", "joules",
                     "watts", "celsius", "hertz"]
# What a knob is measured in: a metric's base unit (a plain number is "number"), or one of the knobs' own:
# count (of events, samples, requests), factor (a multiple of a baseline), spreads (robust standard deviations of
# a signal), quantile (a level 0-1 of a distribution), hours and bytes_per_hour (a horizon, a growth), nats
# (entropy).
KnobUnit = Literal[MetricUnit, "number", "count", "factor", "spreads", "quantile", "hours", "bytes_per_hour",
                   "nats"]
DIRECTIONS: tuple[Direction, ...] = get_args(Direction)
# The only Go-template constructs a summary/description may use, so that tests can expand them exactly.
TEMPLATE_RE = re.compile(r"\{\{\s*(\$value\s*\|\s*printf\s+\"%\.\d+[gf]\"|\$labels\.[a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
PARAM_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED_PLACEHOLDERS = ("metric", "sel")
EXPR_PLACEHOLDER_RE = re.compile(r"<([a-z][a-z0-9_]*)>")
TEXT_PLACEHOLDER_RE = re.compile(r"<([a-z][a-z0-9_]*)(\|pct|\|min)?>")
TEST_EXPR_RE = re.compile(r"<([^<>]+)>")
# A code set of the spec (codes:) in an alert's PromQL: <codes.NAME>, rendered as a regex alternation 48|63|...
CODES_PLACEHOLDER_RE = re.compile(r"<codes\.([a-z][a-z0-9_]*)>")
# ... and in its test's series and labels: <codes.NAME|in:79> is 79 when the set holds it, else its first code;
# <codes.NAME|out:13> is 13 when the set does not hold it, else the smallest code it does not hold.
CODES_TEST_RE = re.compile(r"<codes\.([a-z][a-z0-9_]*)\|(in|out):(\d+)>")


DURATION_UNITS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}


def duration_seconds(text: str) -> int:
    """Seconds of a Prometheus duration (5m, 1h30m; promtool also writes 1d2h and 1w past a day or a week)."""
    return sum(int(n) * DURATION_UNITS[u] for n, u in re.findall(r"(\d+)([ywdhms])(?!s)", text))


# promtool's evaluation time in its test output ("time: 1d0h1m0s,")
EVAL_TIME_RE = r"time: ([0-9ywdhms.]+),?"


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


# ---------------------------------------------------------------------------------------------- notices
PLACEHOLDER_RE = re.compile(r"\{([a-z_]+)\}")


class Notice(StrictModel):
    """A page the pack sends itself, with no Prometheus rule behind it (the relay's verdict of a forensics
    action): its name, its severity and its texts, whose {placeholders} the sender fills in."""

    alert: AlertName
    severity: Severity
    summary: Sentence = Field(description="one line; {placeholders} are filled in by the sender")
    description: Sentence

    def texts(self, values: Mapping[str, object]) -> dict[str, str]:
        """The summary and description with each {placeholder} of values filled in (once: a value that holds
        braces stays as it is)."""
        def fill(text: str) -> str:
            return PLACEHOLDER_RE.sub(lambda m: str(values[m[1]]) if m[1] in values else m[0], text)

        return {"summary": fill(self.summary), "description": fill(self.description)}


# ---------------------------------------------------------------------------------------------- knobs
def _distinct(codes: tuple[int, ...]) -> tuple[int, ...]:
    twice = sorted({c for c in codes if codes.count(c) > 1})
    if twice:
        raise ValueError(f"{', '.join(map(str, twice))} listed twice")
    return codes


# A set of codes as a file writes it: a list of distinct non-negative integers, at least one (held as a tuple,
# which strict validation takes only as one: the file's list is made one first).
Codes = Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(min_length=1), AfterValidator(_distinct),
                  BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)]
CODES_UNIT = "codes"  # the unit a code set's knob is shown with


class CodeSet(StrictModel):
    """A set of codes several alerts select by (a label's values: the XIDs that page as critical), declared
    once under the spec's ``codes:`` and quoted as <codes.NAME> in their PromQL; an overrides file's ``codes:``
    replaces it."""

    codes: Codes = Field(description="the codes (distinct non-negative integers, at least one)")
    meaning: Sentence = Field(description="one line: what the set decides")


def fill_codes(text: str, codes: Mapping[str, tuple[int, ...]]) -> str:
    """PromQL with each <codes.NAME> of a known set replaced by its alternation (others are left)."""
    return CODES_PLACEHOLDER_RE.sub(lambda m: "|".join(map(str, codes[m[1]])) if m[1] in codes else m[0], text)


def fill_test_codes(text: str, codes: Mapping[str, tuple[int, ...]]) -> str:
    """A test's series or label with each <codes.NAME|in:N> / <codes.NAME|out:N> chosen for the sets given."""
    def one(m: re.Match[str]) -> str:
        if m[1] not in codes:
            return m[0]
        held, wanted = codes[m[1]], int(m[3])
        if m[2] == "in":
            return str(wanted if wanted in held else held[0])
        return str(wanted if wanted not in held else next(c for c in range(len(held) + 1) if c not in held))

    return CODES_TEST_RE.sub(one, text)


class Param(StrictModel):
    """One knob of an alert: its value, on which side of it the alert fires (op: the watched quantity {op}
    value fires, so raising a ">" knob or lowering a "<" one loosens the alert), its unit and one line of
    meaning. Written under an expr or condition alert's ``params:``; the other kinds make theirs from their own
    keys (``knobs()``, from the keys' knob_field declarations)."""

    value: float
    op: Op = Field(">", description="the watched quantity {op} value fires")
    unit: KnobUnit = Field(description="what the value is measured in")
    meaning: Sentence = Field(description="one line: what the knob decides")
    min: float | None = None
    max: float | None = None
    quantity: str | None = Field(default=None, description="expr alerts: the PromQL (with <metric>, <sel> and "
                                 "knobs) of what the knob is compared with, where the rest holds; calibrate reads it")

    @model_validator(mode="after")
    def _in_range(self) -> Param:
        if self.unit == "":
            raise ValueError("a knob's unit is never '': a plain number is unit number")
        if not in_range(self, self.value):
            raise ValueError(f"value {self.value:g} is outside [{self.min}, {self.max}]")
        return self

    def loosens(self, new: float) -> bool:
        return new > self.value if self.op in (">", ">=") else new < self.value


def in_range(p: Param, value: float) -> bool:
    return (p.min is None or value >= p.min) and (p.max is None or value <= p.max)


def fmt_knob(value: float) -> str:
    """A knob as PromQL and promtool series read it: up to 12 significant digits, never an exponent."""
    text = f"{value:.12g}"
    if "e" in text:
        text = f"{float(text):.12f}".rstrip("0").rstrip(".")
    return text


def render_text(text: str, values: dict[str, float]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            return m.group(0)
        v = values[m.group(1)]
        if m.group(2) == "|min":
            return fmt_knob(round(v / 60, 10))
        return f"{fmt_knob(round(v * 100, 10))}%" if m.group(2) else fmt_knob(v)

    return TEXT_PLACEHOLDER_RE.sub(one, text)


def fill_knobs(expr: str, values: dict[str, float]) -> str:
    """PromQL with each <name> of a knob replaced by its value (other placeholders are left)."""
    return EXPR_PLACEHOLDER_RE.sub(lambda m: fmt_knob(values[m.group(1)]) if m.group(1) in values else m.group(0),
                                   expr)


def fill_test_text(text: str, values: dict[str, float]) -> str:
    """A test's input values or expected value with each <expression> of the knobs computed."""
    return TEST_EXPR_RE.sub(lambda m: fmt_knob(eval_knob_expr(m.group(1), values)), text)


_BINOPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b}


@functools.lru_cache(maxsize=1024)
def _parse_knob_expr(text: str) -> ast.Expression:
    """Parsed once: a condition's bound is evaluated on every step the breaker judges."""
    try:
        return ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None


def eval_knob_expr(text: str, values: dict[str, float]) -> float:
    """Arithmetic over knobs: numbers, names, + - * /, unary -, min(), max(). Raises ValueError otherwise."""
    tree = _parse_knob_expr(text)

    def ev(node: ast.AST) -> float:
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
