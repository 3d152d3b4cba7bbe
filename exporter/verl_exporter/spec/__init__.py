"""The metric spec: its model, its loader and its validation.

The YAML file beside this module is the single place where a metric is named. Loading is strict: every
problem of every entry is collected and reported at once, each message naming the entry and the problem.

May import: core.detect (the detectors' statistics) and core.models (the typed-file base).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .detectors import parse_detect
from .rules import Alert, Panel, parse_alert, parse_panel

METRIC_NAME_RE = re.compile(r"^verl_[a-z0-9_]*[a-z0-9]$")
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
PLACEHOLDER_RE = re.compile(r"\{([a-zA-Z_][a-zA-Z0-9_]*)\}")

TYPES = ("gauge", "counter")
LAYERS = ("data", "compute", "resource", "fault", "exporter")
FIELDS = ("step", "step_time", "nonfinite")
# Base units a name may end with (Prometheus conventions: seconds, bytes, ratios 0-1).
UNITS = ("", "seconds", "bytes", "ratio", "tokens", "tokens_per_second", "bytes_per_second", "joules", "watts",
         "celsius", "hertz")
CONVERSIONS = {
    "gib_to_bytes": 1024.0**3,
    "mib_to_bytes": 1024.0**2,
    "kib_to_bytes": 1024.0,
    "ms_to_seconds": 1e-3,
    "us_to_seconds": 1e-6,
    "percent_to_ratio": 1e-2,
}
RESERVED_LABELS = ("le", "quantile", "job", "instance")
# Unknown keys are exported under this prefix, so they can never collide with a spec name.
UNMAPPED_PREFIX = "verl_unmapped_"

ENTRY_KEYS = {"name", "type", "unit", "help", "layer", "labels", "source", "field", "collector",
              "max_series", "alerts", "panels", "record", "detect"}
SOURCE_KEYS = {"match", "regex", "labels", "values", "convert", "scale", "when_absent"}
TOP_KEYS = {"version", "target_labels", "defaults", "rules", "alerts", "metrics"}
RULES_KEYS = {"selector", "runbook_url", "evaluation_interval", "relay_url"}
RECORDINGS = ("cross_rank",)
# Per-series window aggregates recorded once a minute, so that alerts over thousands of GPUs read one recorded
# sample per series instead of a window of raw samples: record: [avg_over_time_10m, max_over_time_1m, ...]
WINDOW_RECORDING = re.compile(r"(avg|max|min)_over_time_([1-9][0-9]*[mh])")
# A recording rule written on an entry: {record: level:name:operations, expr: PromQL with <metric> and <sel>}.
RECORDING_NAME_RE = re.compile(r"^[a-z_]+:verl_[a-z0-9_]+:[a-z0-9_]+$")
RECORDING_KEYS = {"record", "expr"}
DEFAULT_KEYS = {"max_series"}

DEFAULT_SPEC = "metrics.yaml"


class SpecError(ValueError):
    """A spec that cannot be used; ``problems`` lists every problem found, one sentence each."""

    def __init__(self, problems: list[str], origin: str = "spec"):
        self.problems = problems
        super().__init__(f"{origin}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class SourceRule:
    """One way a verl key feeds a metric."""

    pattern: str  # as written in the spec (match or regex)
    regex: re.Pattern | None  # None for a literal key
    const_labels: dict[str, str]
    allowed: dict[str, frozenset[str]]
    scale: float
    # Feed the metric only from a line that lacks this key (an older verl's name for the same quantity).
    when_absent: str | None = None

    @property
    def literal(self) -> bool:
        return self.regex is None


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str
    unit: str
    help: str
    layer: str
    labels: tuple[str, ...]
    sources: tuple[SourceRule, ...] = ()
    field: str | None = None
    collector: str | None = None
    max_series: int = 64
    alerts: tuple[Alert, ...] = ()
    panels: tuple[Panel, ...] = ()
    record: tuple[str, ...] = ()  # generated recordings (RECORDINGS)
    recordings: tuple[tuple[str, str], ...] = ()  # written ones: (name, PromQL with <metric> and <sel>)
    detect: tuple = ()  # SignalSpec: the adaptive signals this metric feeds (verl_exporter.core.detect)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "type": self.type, "unit": self.unit, "help": self.help,
            "layer": self.layer, "labels": list(self.labels), "max_series": self.max_series,
        }
        if self.sources:
            out["source"] = [
                {"pattern": s.pattern, "kind": "literal" if s.literal else "pattern",
                 "labels": s.const_labels, "values": {k: sorted(v) for k, v in s.allowed.items()},
                 "scale": s.scale, **({"when_absent": s.when_absent} if s.when_absent else {})}
                for s in self.sources
            ]
        if self.field:
            out["field"] = self.field
        if self.collector:
            out["collector"] = self.collector
        if self.alerts:
            out["alerts"] = [a.alert for a in self.alerts]
        if self.panels:
            out["panels"] = [f"{p.dashboard}: {p.title}" for p in self.panels]
        if self.record or self.recordings:
            out["record"] = list(self.record) + [name for name, _ in self.recordings]
        return out


@dataclass(frozen=True)
class RulesConfig:
    """Where rules and dashboards point: the job selector, the runbook, the evaluation interval."""

    selector: str = 'job="verl"'
    runbook_url: str = "https://github.com/verl-exporter/verl-exporter/blob/main/rules/runbook.md"
    evaluation_interval: str = "30s"
    relay_url: str = "http://127.0.0.1:9095"  # where Alertmanager's receivers post (verl-exporter relay)
    # team -> severity -> receiver name (an overrides file's global.routing); unset: <team>-<severity>
    routing: dict[str, dict[str, str]] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Spec:
    version: int
    target_labels: tuple[str, ...]
    metrics: tuple[MetricSpec, ...]
    by_name: dict[str, MetricSpec] = field(repr=False, compare=False, default_factory=dict)
    rules: RulesConfig = field(default_factory=RulesConfig)
    global_alerts: tuple[Alert, ...] = ()  # alerts on several metrics (cross-layer), declared at the top
    overrides: str = ""  # the overrides file applied (spec.overrides.apply_overrides), if any

    def alerts(self) -> list[Alert]:
        """Every alert, in spec order: those on metric entries, then the cross-metric ones."""
        return [a for m in self.metrics for a in m.alerts] + list(self.global_alerts)

    def panels(self) -> list[Panel]:
        return [p for m in self.metrics for p in m.panels]

    def signals(self) -> list:
        """Every adaptive signal (``detect:``), in spec order."""
        return [s for m in self.metrics for s in m.detect]

    def __getitem__(self, name: str) -> MetricSpec:
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"metric {name!r} is not in the spec") from None

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def with_field(self, field_name: str) -> MetricSpec:
        for m in self.metrics:
            if m.field == field_name:
                return m
        raise KeyError(f"no spec entry has field: {field_name}")

    def for_collector(self, collector: str) -> list[MetricSpec]:
        return [m for m in self.metrics if m.collector == collector]


def _compile_match(pattern: str) -> tuple[re.Pattern | None, list[str]]:
    """A match pattern: literal text with {label} placeholders, each one '/'-free run of characters."""
    names = PLACEHOLDER_RE.findall(pattern)
    if not names:
        return None, []
    parts, pos = [], 0
    for m in PLACEHOLDER_RE.finditer(pattern):
        parts.append(re.escape(pattern[pos:m.start()]))
        parts.append(f"(?P<{m.group(1)}>[^/]+)")
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts)), names


def _parse_source(where: str, raw: Any, labels: tuple[str, ...], problems: list[str]) -> SourceRule | None:
    if not isinstance(raw, dict):
        problems.append(f"{where}: a source must be a mapping, got {type(raw).__name__}")
        return None
    unknown = set(raw) - SOURCE_KEYS
    if unknown:
        problems.append(f"{where}: unknown source key(s) {sorted(unknown)}")
    if ("match" in raw) == ("regex" in raw):
        problems.append(f"{where}: give exactly one of 'match' or 'regex'")
        return None
    pattern = raw.get("match", raw.get("regex"))
    if not isinstance(pattern, str) or not pattern:
        problems.append(f"{where}: the pattern must be a non-empty string")
        return None
    if "match" in raw:
        regex, captured = _compile_match(pattern)
    else:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            problems.append(f"{where}: regex {pattern!r} does not compile: {e}")
            return None
        captured = list(regex.groupindex)
        if not captured:
            problems.append(f"{where}: regex {pattern!r} has no named group; use 'match' for a literal key")
    const = raw.get("labels", {}) or {}
    if not isinstance(const, dict) or not all(isinstance(v, (str, int)) for v in const.values()):
        problems.append(f"{where}: 'labels' must map label names to string values")
        const = {}
    const = {str(k): str(v) for k, v in const.items()}
    dup = set(captured) & set(const)
    if dup:
        problems.append(f"{where}: label(s) {sorted(dup)} both captured and constant")
    got = set(captured) | set(const)
    if got != set(labels):
        problems.append(
            f"{where}: pattern {pattern!r} gives labels {sorted(got)} but the metric declares {sorted(labels)}")
    allowed_raw = raw.get("values", {}) or {}
    allowed: dict[str, frozenset[str]] = {}
    if not isinstance(allowed_raw, dict):
        problems.append(f"{where}: 'values' must map placeholders to lists of allowed values")
    else:
        for k, vals in allowed_raw.items():
            if k not in captured:
                problems.append(f"{where}: 'values' names {k!r}, which the pattern does not capture")
            elif not isinstance(vals, list) or not vals:
                problems.append(f"{where}: 'values.{k}' must be a non-empty list")
            else:
                allowed[k] = frozenset(str(v) for v in vals)
    scale = 1.0
    if "convert" in raw and "scale" in raw:
        problems.append(f"{where}: give 'convert' or 'scale', not both")
    elif "convert" in raw:
        if raw["convert"] not in CONVERSIONS:
            problems.append(f"{where}: unknown convert {raw['convert']!r} (known: {sorted(CONVERSIONS)})")
        else:
            scale = CONVERSIONS[raw["convert"]]
    elif "scale" in raw:
        if isinstance(raw["scale"], bool) or not isinstance(raw["scale"], (int, float)) or raw["scale"] == 0:
            problems.append(f"{where}: 'scale' must be a non-zero number")
        else:
            scale = float(raw["scale"])
    when_absent = raw.get("when_absent")
    if when_absent is not None:
        if not isinstance(when_absent, str) or not when_absent:
            problems.append(f"{where}: 'when_absent' must be a key")
            when_absent = None
        elif regex is not None:
            problems.append(f"{where}: 'when_absent' needs a literal 'match' key, got pattern {pattern!r}")
            when_absent = None
    return SourceRule(pattern=pattern, regex=regex, const_labels=const, allowed=allowed, scale=scale,
                      when_absent=when_absent)


def _parse_recording(where: str, raw: dict, problems: list[str]) -> tuple[str, str] | None:
    unknown = set(raw) - RECORDING_KEYS
    if unknown:
        problems.append(f"{where}: unknown key(s) {sorted(unknown)}")
    name, expr = raw.get("record"), raw.get("expr")
    if not isinstance(name, str) or not RECORDING_NAME_RE.match(name):
        problems.append(f"{where}: record must be a name like level:verl_name:operations, got {name!r}")
        return None
    if not isinstance(expr, str) or "<metric>" not in expr or "<sel>" not in expr:
        problems.append(f"{where}: expr must be PromQL using <metric> and <sel>")
        return None
    return name, " ".join(expr.split())


def _check_name(where: str, name: str, mtype: str, unit: str, problems: list[str]) -> None:
    if not METRIC_NAME_RE.match(name):
        problems.append(f"{where}: name must match {METRIC_NAME_RE.pattern} (lower case, prefix verl_)")
    if name.startswith(UNMAPPED_PREFIX):
        problems.append(f"{where}: the prefix {UNMAPPED_PREFIX} is reserved for unmapped keys")
    if mtype == "counter" and not name.endswith("_total"):
        problems.append(f"{where}: a counter's name must end in _total")
    if mtype == "gauge" and name.endswith("_total"):
        problems.append(f"{where}: only counters end in _total")
    if unit not in UNITS:
        known = ", ".join(repr(u) for u in UNITS)
        problems.append(f"{where}: unknown unit {unit!r} (known: {known})")
    elif unit:
        base = name[: -len("_total")] if mtype == "counter" else name
        if not base.endswith("_" + unit):
            problems.append(f"{where}: unit {unit!r} but the name does not end in _{unit}")
    if name.removesuffix("_total").endswith("_timestamp_seconds") and mtype != "gauge":
        problems.append(f"{where}: a *_timestamp_seconds metric must be a gauge")


def _parse_entry(i: int, raw: Any, defaults: dict, target_labels: tuple[str, ...],
                 problems: list[str]) -> MetricSpec | None:
    if not isinstance(raw, dict):
        problems.append(f"metrics[{i}]: an entry must be a mapping")
        return None
    name = raw.get("name")
    where = f"metric {name!r}" if isinstance(name, str) else f"metrics[{i}]"
    unknown = set(raw) - ENTRY_KEYS
    if unknown:
        problems.append(f"{where}: unknown key(s) {sorted(unknown)}")
    missing = [k for k in ("name", "type", "help", "layer") if k not in raw]
    if missing:
        problems.append(f"{where}: missing required key(s) {missing}")
        return None
    if not isinstance(name, str):
        problems.append(f"{where}: name must be a string")
        return None
    mtype, unit, help_, layer = raw["type"], raw.get("unit", ""), raw["help"], raw["layer"]
    if mtype not in TYPES:
        problems.append(f"{where}: type must be one of {list(TYPES)}, got {mtype!r}")
    if not isinstance(unit, str):
        problems.append(f"{where}: unit must be a string")
        unit = ""
    _check_name(where, name, mtype, unit, problems)
    if not isinstance(help_, str) or not help_.strip():
        problems.append(f"{where}: help must be a non-empty sentence")
    if layer not in LAYERS:
        problems.append(f"{where}: layer must be one of {list(LAYERS)}, got {layer!r}")
    labels = raw.get("labels", []) or []
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        problems.append(f"{where}: labels must be a list of names")
        labels = []
    for lab in labels:
        if not LABEL_NAME_RE.match(lab) or lab.startswith("__"):
            problems.append(f"{where}: bad label name {lab!r}")
        if lab in RESERVED_LABELS or lab in target_labels:
            problems.append(f"{where}: label {lab!r} is reserved (Prometheus or a target label)")
    if len(set(labels)) != len(labels):
        problems.append(f"{where}: duplicate label names")
    labels_t = tuple(labels)

    kinds = [k for k in ("source", "field", "collector") if k in raw]
    if len(kinds) != 1:
        problems.append(f"{where}: give exactly one of source, field or collector (got {kinds or 'none'})")
    sources: list[SourceRule] = []
    if "source" in raw:
        raw_sources = raw["source"]
        if isinstance(raw_sources, dict):
            raw_sources = [raw_sources]
        if not isinstance(raw_sources, list) or not raw_sources:
            problems.append(f"{where}: source must be a non-empty list")
        else:
            for j, rs in enumerate(raw_sources):
                rule = _parse_source(f"{where} source[{j}]", rs, labels_t, problems)
                if rule:
                    sources.append(rule)
    fld = raw.get("field")
    if "field" in raw and fld not in FIELDS:
        problems.append(f"{where}: field must be one of {list(FIELDS)}, got {fld!r}")
    collector = raw.get("collector")
    if "collector" in raw and (not isinstance(collector, str) or not LABEL_NAME_RE.match(collector)):
        problems.append(f"{where}: collector must be a plain name")
    max_series = raw.get("max_series", defaults.get("max_series", 64))
    if isinstance(max_series, bool) or not isinstance(max_series, int) or max_series < 1:
        problems.append(f"{where}: max_series must be a positive integer")
        max_series = 1
    extras: dict[str, tuple] = {}
    for key, parse in (("alerts", parse_alert), ("panels", parse_panel)):
        val = raw.get(key, []) or []
        if not isinstance(val, list) or not all(isinstance(x, dict) for x in val):
            problems.append(f"{where}: {key} must be a list of mappings")
            val = []
        parsed = [parse(str(name), j, item, problems) for j, item in enumerate(val)]
        extras[key] = tuple(x for x in parsed if x is not None)
    record = raw.get("record", []) or []
    if not isinstance(record, list):
        record = [record]
    kinds = [r for r in record if not isinstance(r, dict)]
    if any(r not in RECORDINGS and not WINDOW_RECORDING.fullmatch(str(r)) for r in kinds):
        problems.append(f"{where}: record may list {list(RECORDINGS)}, <avg|max|min>_over_time_<N><m|h> "
                        "and {record, expr} rules")
        kinds = []
    extras["record"] = tuple(kinds)
    extras["recordings"] = tuple(r for j, item in enumerate(record) if isinstance(item, dict)
                                 for r in [_parse_recording(f"{where} record[{j}]", item, problems)] if r)
    detect = raw.get("detect", []) or []
    if not isinstance(detect, list):
        problems.append(f"{where}: detect must be a list of mappings")
        detect = []
    parsed_detect = [parse_detect(str(name), labels_t, j, item, problems) for j, item in enumerate(detect)]
    extras["detect"] = tuple(x for x in parsed_detect if x is not None)
    return MetricSpec(
        name=name, type=mtype, unit=unit, help=" ".join(str(help_).split()), layer=layer, labels=labels_t,
        sources=tuple(sources), field=fld, collector=collector, max_series=max_series, **extras)


def parse_spec(doc: Any, origin: str = "spec") -> Spec:
    """Validate a parsed YAML document and build the Spec; raise SpecError listing every problem."""
    problems: list[str] = []
    if not isinstance(doc, dict):
        raise SpecError(["the document must be a mapping with a 'metrics' list"], origin)
    unknown = set(doc) - TOP_KEYS
    if unknown:
        problems.append(f"unknown top-level key(s) {sorted(unknown)}")
    if doc.get("version") != 1:
        problems.append(f"version must be 1, got {doc.get('version')!r}")
    target_labels = doc.get("target_labels", []) or []
    if not isinstance(target_labels, list) or not all(
            isinstance(x, str) and LABEL_NAME_RE.match(x) for x in target_labels):
        problems.append("target_labels must be a list of label names")
        target_labels = []
    defaults = doc.get("defaults", {}) or {}
    if not isinstance(defaults, dict) or set(defaults) - DEFAULT_KEYS:
        problems.append(f"defaults may only hold {sorted(DEFAULT_KEYS)}")
        defaults = {}
    raw_metrics = doc.get("metrics")
    if not isinstance(raw_metrics, list) or not raw_metrics:
        problems.append("'metrics' must be a non-empty list")
        raise SpecError(problems, origin)
    metrics: list[MetricSpec] = []
    for i, raw in enumerate(raw_metrics):
        m = _parse_entry(i, raw, defaults, tuple(target_labels), problems)
        if m:
            metrics.append(m)
    seen: dict[str, str] = {}
    literal_keys: dict[str, str] = {}
    fields: dict[str, str] = {}
    for m in metrics:
        if m.name in seen:
            problems.append(f"metric {m.name!r}: declared twice")
        seen[m.name] = m.name
        for s in m.sources:
            if s.literal and not s.when_absent:  # a conditional source may share its key with another metric
                if s.pattern in literal_keys and literal_keys[s.pattern] != m.name:
                    problems.append(
                        f"metric {m.name!r}: key {s.pattern!r} already feeds {literal_keys[s.pattern]!r}")
                literal_keys[s.pattern] = m.name
        if m.field:
            if m.field in fields:
                problems.append(f"metric {m.name!r}: field {m.field!r} already feeds {fields[m.field]!r}")
            fields[m.field] = m.name
    rules_raw = doc.get("rules", {}) or {}
    if not isinstance(rules_raw, dict) or set(rules_raw) - RULES_KEYS:
        problems.append(f"rules may hold {sorted(RULES_KEYS)}")
        rules_raw = {}
    rules_config = RulesConfig(**{k: str(v) for k, v in rules_raw.items()})
    global_raw = doc.get("alerts", []) or []
    if not isinstance(global_raw, list):
        problems.append("alerts (top level) must be a list")
        global_raw = []
    global_alerts = []
    for j, item in enumerate(global_raw):
        if not isinstance(item, dict):
            problems.append(f"alerts[{j}]: must be a mapping")
            continue
        a = parse_alert("(cross-metric)", j, item, problems)
        if a is not None:
            if a.kind != "expr":
                problems.append(f"alert {a.alert!r}: a top-level alert must be of kind expr")
            global_alerts.append(a)
    recorded = [name for m in metrics for name, _ in m.recordings]
    for dup in sorted({n for n in recorded if recorded.count(n) > 1}):
        problems.append(f"recording {dup!r}: declared twice")
    names = [a.alert for m in metrics for a in m.alerts] + [a.alert for a in global_alerts]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"alert {dup!r}: declared twice")
    for a in [a for m in metrics for a in m.alerts] + global_alerts:
        for target in a.inhibits:
            if target not in names:
                problems.append(f"alert {a.alert!r}: inhibits unknown alert {target!r}")
    signals = [sig for m in metrics for sig in m.detect]
    seen_signals: set[str] = set()
    detector_gauges = {m.name for m in metrics if m.collector == "detector"}
    for sig in signals:
        if sig.name in seen_signals:
            problems.append(f"signal {sig.name!r}: declared twice")
        seen_signals.add(sig.name)
        for stat in sig.export:
            if f"verl_detector_{stat}" not in detector_gauges:
                problems.append(f"signal {sig.name!r}: exports {stat} but verl_detector_{stat} is not declared "
                                "(collector: detector)")
    if problems:
        raise SpecError(problems, origin)
    return Spec(version=1, target_labels=tuple(target_labels), metrics=tuple(metrics),
                by_name={m.name: m for m in metrics}, rules=rules_config, global_alerts=tuple(global_alerts))


def load_spec(path: str | Path | None = None) -> Spec:
    """Load a spec file (the packaged one by default)."""
    if path is None:
        text = resources.files(__name__).joinpath(DEFAULT_SPEC).read_text(encoding="utf-8")
        origin = f"packaged spec {DEFAULT_SPEC}"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise SpecError([f"cannot read the spec: {e.strerror}"], str(path)) from None
        except UnicodeDecodeError as e:
            raise SpecError([f"not UTF-8 text (byte {e.start})"], str(path)) from None
        origin = str(path)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError([f"not valid YAML: {e}"], origin) from None
    return parse_spec(doc, origin)
