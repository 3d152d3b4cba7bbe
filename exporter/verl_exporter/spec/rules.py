"""The rule and dashboard part of the spec: alerts, recording rules and panels declared on metric entries.

Kept apart from the metric model (``spec/__init__.py``) because the sidecar never needs it: only the
generator (``verl-exporter generate``) and its tests read these.

Placeholders in PromQL written in the spec:
  <metric>  the entry's metric name
  <sel>     the selector of the place the query goes: rules get the spec's ``selector`` (job="verl"),
            dashboards get job/run/rank template variables
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
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
              "test", "inhibits", "keep_firing_for", "signal", "change", "confirm"}
CONFIRM_KEYS = {"signal", "direction", "k", "change"}
PANEL_KEYS = {"dashboard", "row", "title", "type", "query", "legend", "moving_average", "stack", "rate",
              "width", "height", "unit", "min", "max", "description"}
RUNBOOK_KEYS = {"meaning", "confirm", "action"}


def duration_seconds(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", text))


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
    # kind detector: a step-domain signal (verl_exporter.detect) and, optionally, other signals that must
    # deviate at the same time (each a Confirm) for the alert to hold
    signal: str = ""
    change: float = 0.0  # the relative change from the expected value the deviation must also reach
    confirm: tuple[Confirm, ...] = ()


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
    return Alert(
        alert=str(name), kind=kind, severity=raw["severity"], summary=" ".join(str(raw["summary"]).split()),
        description=" ".join(str(raw["description"]).split()), metric=metric, for_=str(raw.get("for", "0m")),
        op=raw.get("op", ">"), threshold=raw.get("threshold"), matchers=str(raw.get("matchers", "")),
        aggregate=str(raw.get("aggregate", "")), window=str(raw.get("window", "30m")), k=float(raw.get("k", 4.0)),
        direction=raw.get("direction", "up"), rel_floor=float(raw.get("rel_floor", 0.05)),
        horizon=str(raw.get("horizon", "4h")), expr=" ".join(str(raw.get("expr", "")).split()),
        labels={str(k): str(v) for k, v in labels.items()}, runbook={k: str(v) for k, v in runbook.items()},
        test=test, inhibits=tuple(inhibits), keep_firing_for=str(raw.get("keep_firing_for", "")),
        signal=str(raw.get("signal", "")), change=float(raw.get("change", 0.0)), confirm=tuple(confirm))


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
