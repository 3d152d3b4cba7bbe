"""The metric spec: its model, its loader and its validation.

The YAML files beside this module (``metrics/``, one per area, merged in name order) are the single place
where a metric is named. Loading is strict: every problem of every entry is reported at once, each as
``FILE:LINE: key.path: message`` naming the file it is in.

One model per concept. The file's shape is a tree of core.models StrictModels (``Spec``, ``MetricSpec``,
``SourceRule``, the alert kinds of ``kinds/``, ``Panel`` in panels.py, core.detect's ``SignalSpec``): they
check each entry, ``verl-exporter schema spec`` writes their JSON Schema, and the same frozen objects are what
the rest of the pack reads, so a key of the file is the attribute its readers use. What the runtime needs
beyond what the file says is derived once at load: a list becomes a tuple, a source's key pattern is compiled,
the default max_series is applied, and each alert, panel and signal knows its metric. Overrides, calibrate
and the CLI derive new ones with ``model_copy(update=...)``.

Checks across entries (unique names, keys and fields feeding one metric, alerts and inhibits naming known
ones, signals' gauges declared) are ``Spec.cross_problems``: each finds several problems, each at its own
entry's line, which a pydantic validator (one error, at the model's place) cannot report. They run once every
entry is valid.

May import: core.detect (the detectors' statistics) and core.models (the typed-file base).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, TypeVar, get_args

from pydantic import (
    AfterValidator,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from ..core.detect import SignalSpec
from ..core.models import (
    FileError,
    KeyPath,
    Lines,
    StrictModel,
    json_schema,
    parse_yaml,
    problems,
    read_yaml,
    where,
)
from .kinds import CROSS_METRIC, KINDS, Alert, AlertBase
from .kinds.condition import NODES as CONDITION_NODES
from .panels import Panel
from .rules import PATTERN_MESSAGES, CodeSet, MetricUnit, Notice, ParamName, Sentence, Severity

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable  # Python 3.11; a Path is one too

METRIC_NAME_RE = re.compile(r"^verl_[a-z0-9_]*[a-z0-9]$")
# Engines Prometheus scrapes itself (not the sidecar): their entries keep the engine's own names, vllm:..., and
# may be histograms; the sidecar never exports them.
Engine = Literal["vllm", "sglang"]
SCRAPED_FROM: tuple[Engine, ...] = get_args(Engine)
ANY_NAME_RE = re.compile(rf"^(verl_|{'|'.join(e + ':' for e in SCRAPED_FROM)})[a-z0-9_]*[a-z0-9]$")
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
PLACEHOLDER_RE = re.compile(r"\{([a-zA-Z_][a-zA-Z0-9_]*)\}")

MetricType = Literal["gauge", "counter"]
TYPES: tuple[MetricType, ...] = get_args(MetricType)
ScrapedType = Literal[MetricType, "histogram"]
Layer = Literal["data", "compute", "resource", "fault", "exporter"]
LineField = Literal["step", "step_time", "nonfinite"]
# What an `events:` entry records of each series of the metric it watches.
EventRecord = Literal["count", "step", "time"]
# What feeds a metric: exactly one of these keys of its entry.
FEEDS = ("source", "field", "collector", "instrumented_by", "scraped_from", "events")
# The parts of the pack that set metrics from their own code (not through a collector).
InstrumentedBy = Literal["exporter", "detector", "relay"]
INSTRUMENTED_BY: tuple[InstrumentedBy, ...] = get_args(InstrumentedBy)
Unit = MetricUnit  # the base unit a name may end with (spec/rules.py)
Conversion = Literal["gib_to_bytes", "mib_to_bytes", "kib_to_bytes", "ms_to_seconds", "us_to_seconds",
                     "percent_to_ratio"]
CONVERSIONS: dict[Conversion, float] = {  # a factor for each Conversion
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

RECORDINGS = ("cross_rank",)
# Per-series window aggregates recorded once a minute, so that alerts over thousands of GPUs read one recorded
# sample per series instead of a window of raw samples: record: [avg_over_time_10m, max_over_time_1m, ...]
WINDOW_RECORDING = re.compile(r"(avg|max|min)_over_time_([1-9][0-9]*[mh])")
# A recording rule written on an entry: {record: level:name:operations, expr: PromQL with <metric> and <sel>}.
# (an engine's series vllm:x is recorded as level:vllm_x:operations, keeping the name's three parts)
RECORDING_NAME_RE = re.compile(rf"^[a-z_]+:({'|'.join(('verl', *SCRAPED_FROM))})_[a-z0-9_]+:[a-z0-9_]+$")

DEFAULT_SPEC = "metrics"  # the packaged spec: a directory of area files (area_files), merged in order
# The top-level lists a spec directory's files concatenate, in file order.
MERGED = ("metrics", "alerts")


class SpecError(FileError):
    """A spec that cannot be used; ``problems`` lists every problem, each with its place."""


def _compile_match(pattern: str) -> re.Pattern[str] | None:
    """A match pattern: literal text with {label} placeholders, each one '/'-free run of characters."""
    if not PLACEHOLDER_RE.search(pattern):
        return None
    parts, pos = [], 0
    for m in PLACEHOLDER_RE.finditer(pattern):
        parts.append(re.escape(pattern[pos:m.start()]))
        parts.append(f"(?P<{m.group(1)}>[^/]+)")
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts))


def _one_line(text: str) -> str:
    return " ".join(text.split())


LabelName = Annotated[str, StringConstraints(pattern=LABEL_NAME_RE.pattern)]
Key = Annotated[str, StringConstraints(min_length=1)]
# A list of the file held as a tuple, immutable like the model that holds it (pydantic validates the list; the
# type checker sees the tuple its readers get).
T = TypeVar("T")
if TYPE_CHECKING:
    TupleOf: TypeAlias = tuple[T, ...]
else:
    TupleOf = Annotated[list[T], AfterValidator(tuple)]


class SourceRule(StrictModel):
    """One way verl keys feed the metric: a key (``match``, with {label} placeholders) or a ``regex``."""

    match: Key | None = Field(None, description="a key; each {label} stands for one '/'-free part")
    regex: Key | None = Field(None, description="a full regular expression whose named groups are label values")
    labels: dict[str, str] = Field(default_factory=dict, description="constant label values for these keys")
    values: dict[str, Annotated[list[str], Field(min_length=1)]] = Field(
        default_factory=dict, description="allowed values per placeholder (others fall through to later sources)")
    convert: Conversion | None = None
    scale: float | None = None
    when_absent: Key | None = Field(None, description="feed only from a line without this key (an older "
                                                      "verl's name for the same quantity)")

    @model_validator(mode="after")
    def _pattern(self) -> SourceRule:
        if (self.match is None) == (self.regex is None):
            raise ValueError("give exactly one of 'match' or 'regex'")
        try:
            compiled = self.compiled
        except re.error as e:
            raise ValueError(f"{'regex' if self.regex is not None else 'match'} {self.pattern!r} does not "
                             f"compile: {e}") from None
        if self.regex is not None and compiled is not None and not compiled.groupindex:
            raise ValueError(f"regex {self.regex!r} has no named group; use 'match' for a literal key")
        bad = []
        if set(self.captured) & set(self.labels):
            bad.append(f"label(s) {sorted(set(self.captured) & set(self.labels))} both captured and constant")
        bad += [f"'values' names {k!r}, which the pattern does not capture" for k in self.values
                if k not in self.captured]
        if self.convert is not None and self.scale is not None:
            bad.append("give 'convert' or 'scale', not both")
        if self.scale == 0:
            bad.append("'scale' must be a non-zero number")
        if self.when_absent is not None and self.captured:
            bad.append(f"'when_absent' needs a literal 'match' key, got pattern {self.pattern!r}")
        if bad:
            raise ValueError("; ".join(bad))
        return self

    @property
    def pattern(self) -> str:
        """The key or the regex, as written."""
        return self.match or self.regex or ""

    # Derived once, on first use (validation uses them): cached in the instance like a field, so that the
    # sidecar's per-key lookups read them as fast as one (a property, or a pydantic private attribute, costs a
    # call each time).
    @cached_property
    def compiled(self) -> re.Pattern[str] | None:
        """The pattern keys are matched with; None for a literal key."""
        return re.compile(self.regex) if self.regex is not None else _compile_match(self.match or "")

    @property
    def literal(self) -> bool:
        return self.compiled is None

    @property
    def captured(self) -> list[str]:
        """The labels the pattern captures."""
        return list(self.compiled.groupindex) if self.compiled is not None else []

    @cached_property
    def factor(self) -> float:
        """What each value is multiplied by: the convert's factor, the scale, or 1."""
        return CONVERSIONS[self.convert] if self.convert else 1.0 if self.scale is None else float(self.scale)


class RecordingEntry(StrictModel):
    """A recording rule written on an entry, e.g. a ratio as the rate() of a kernel counter."""

    record: Annotated[str, StringConstraints(pattern=RECORDING_NAME_RE.pattern)]
    expr: str = Field(description="PromQL using <metric> and <sel>")

    @field_validator("expr")
    @classmethod
    def _placeholders(cls, expr: str) -> str:
        if "<metric>" not in expr or "<sel>" not in expr:
            raise ValueError("expr must be PromQL using <metric> and <sel>")
        return _one_line(expr)


class Events(StrictModel):
    """The events of another metric's series: an event is a step at which one of the series' verl keys arrives
    (a validation series' evaluation: a gauge that did not move cannot show Prometheus that it happened)."""

    of: str = Field(description="the metric, fed by verl keys, whose series' arrivals are the events (the entry has "
                                "its labels, in its order, and its cap)")
    record: EventRecord = Field(description="count: how many steps the series arrived at (a counter); step: the "
                                            "last such step; time: the unix time it was seen")

    def __str__(self) -> str:
        return f"{self.record} of {self.of}"

    def type_problem(self, mtype: str) -> str | None:
        want = "counter" if self.record == "count" else "gauge"
        return None if mtype == want else f"events of record {self.record!r} are a {want}, not a {mtype}"


RECORDING_KIND = rf"^({'|'.join(RECORDINGS)}|{WINDOW_RECORDING.pattern})$"
RecordingKind = Annotated[str, StringConstraints(pattern=RECORDING_KIND)]


class MetricSpec(StrictModel):
    """One metric: its name and meaning, what feeds it, and the alerts, panels, recordings and adaptive
    signals declared on it."""

    # first, so that the checks of name and type see it
    scraped_from: Engine | None = Field(
        None, description="an engine Prometheus scrapes directly (named as it names it, never on the sidecar)")
    name: Annotated[str, StringConstraints(pattern=ANY_NAME_RE.pattern)]
    type: ScrapedType
    unit: Unit = Field("", description="the base unit the name ends with, or '' for a plain number")
    help: Annotated[Sentence, AfterValidator(_one_line)]
    layer: Layer
    labels: TupleOf[LabelName] = Field(default_factory=tuple, description="bounded: fixed values or max_series")
    # min_length on the Field, so that it checks the file's list (before the tuple)
    source: TupleOf[SourceRule] = Field(default_factory=tuple, min_length=1, description="the verl keys that feed it")
    field: LineField | None = Field(None, description="a field of the line itself")
    collector: LabelName | None = Field(None, description="a collector fills it: the sidecar's "
                                                          "(sidecar/collectors/<name>.py) or the Monitor's torch")
    instrumented_by: InstrumentedBy | None = Field(
        None, description="code of the pack sets it directly: exporter (the sidecar's own health), detector (its "
                          "adaptive detectors), relay (the relay's own health)")
    events: Events | None = Field(None, description="the steps at which another metric's series arrive (kept across "
                                                    "sidecar restarts in --state-dir)")
    max_series: int | None = Field(None, ge=1, description="cap on label-value combinations (default: "
                                                            "defaults.max_series)")  # the Spec applies it
    # held as Alert, Panel and SignalSpec objects (_on_this_metric, _signals)
    alerts: TupleOf[Alert] = Field(default_factory=tuple)
    panels: TupleOf[Panel] = Field(default_factory=tuple)
    record: TupleOf[RecordingKind | RecordingEntry] = Field(
        default_factory=tuple, description="generated recordings (names), and written ones ({record, expr})")
    detect: TupleOf[SignalSpec] = Field(default_factory=tuple)

    @field_validator("name")
    @classmethod
    def _not_unmapped(cls, name: str) -> str:
        if name.startswith(UNMAPPED_PREFIX):
            raise ValueError(f"the prefix {UNMAPPED_PREFIX} is reserved for unmapped keys")
        return name

    @field_validator("name")
    @classmethod
    def _prefix_of_its_engine(cls, name: str, info: ValidationInfo) -> str:
        engine = info.data.get("scraped_from")
        if engine and not name.startswith(f"{engine}:"):
            raise ValueError(f"scraped from {engine}, the name must start with {engine}:")
        if not engine and not METRIC_NAME_RE.match(name):
            raise ValueError(f"must match {METRIC_NAME_RE.pattern} (lower case, prefix verl_); another engine's "
                             "name needs scraped_from")
        return name

    @field_validator("collector")
    @classmethod
    def _a_collector(cls, collector: str | None) -> str | None:
        if collector in INSTRUMENTED_BY:  # how the spec said it before instrumented_by existed
            raise ValueError(f"{collector} is not a collector: write instrumented_by: {collector}")
        return collector

    @field_validator("type")
    @classmethod
    def _type_fits_name(cls, mtype: str, info: ValidationInfo) -> str:
        if mtype not in TYPES and not info.data.get("scraped_from"):  # the sidecar exports none
            raise ValueError(f"must be one of {' or '.join(map(repr, TYPES))}, got {mtype!r}")
        name = info.data.get("name")
        if name is None:  # its own problem is reported
            return mtype
        if mtype == "counter" and not name.endswith("_total"):
            raise ValueError("a counter's name must end in _total")
        if mtype == "gauge" and name.endswith("_total"):
            raise ValueError("only counters end in _total")
        if name.removesuffix("_total").endswith("_timestamp_seconds") and mtype != "gauge":
            raise ValueError("a *_timestamp_seconds metric must be a gauge")
        return mtype

    @field_validator("unit")
    @classmethod
    def _unit_ends_name(cls, unit: str, info: ValidationInfo) -> str:
        name, mtype = info.data.get("name"), info.data.get("type")
        if unit and name and mtype and not name.removesuffix("_total" if mtype == "counter" else "").endswith(
                "_" + unit):
            raise ValueError(f"unit {unit!r} but the name does not end in _{unit}")
        return unit

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: tuple[str, ...]) -> tuple[str, ...]:
        bad = [f"bad label name {lab!r}" for lab in labels if lab.startswith("__")]
        bad += [f"label {lab!r} is reserved (Prometheus)" for lab in labels if lab in RESERVED_LABELS]
        if len(set(labels)) != len(labels):
            bad.append("duplicate label names")
        if bad:
            raise ValueError("; ".join(bad))
        return labels

    @field_validator("source")
    @classmethod
    def _sources_give_the_labels(cls, sources: tuple[SourceRule, ...], info: ValidationInfo) -> tuple[SourceRule, ...]:
        labels = info.data.get("labels")
        for j, s in enumerate(sources):
            got = set(s.captured) | set(s.labels)
            if labels is not None and got != set(labels):
                raise ValueError(f"source {j}: pattern {s.pattern!r} gives labels {sorted(got)} but the "
                                 f"metric declares {sorted(labels)}")
        return sources

    # What rules.py and detectors.py declare on a metric is held in its runtime form, built with the metric's
    # name: this is the one place their entries are converted.
    @field_validator("alerts", "panels")
    @classmethod
    def _on_this_metric(cls, entries: Sequence[Alert | Panel], info: ValidationInfo) -> tuple[Alert | Panel, ...]:
        name, unit = info.data.get("name", ""), info.data.get("unit", "")
        return tuple(e.on_metric(name, unit) if isinstance(e, AlertBase) else e.on_metric(name) for e in entries)

    @field_validator("detect")
    @classmethod
    def _signals(cls, detect: tuple[SignalSpec, ...], info: ValidationInfo) -> tuple[SignalSpec, ...]:
        labels = info.data.get("labels")
        for j, d in enumerate(detect):
            if labels is not None and set(d.labels) != set(labels):
                raise ValueError(f"detect {j}: labels must give a value for each of the metric's labels "
                                 f"{list(labels)}")
        return tuple(d.on_metric(info.data.get("name", "")) for d in detect)

    @model_validator(mode="after")
    def _one_feed(self) -> MetricSpec:
        kinds = [k for k in FEEDS if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of {', '.join(FEEDS)} (got {kinds or 'none'})")
        if self.events is not None and (why := self.events.type_problem(self.type)):
            raise ValueError(why)
        return self

    @property
    def recordings(self) -> list[RecordingEntry]:
        """The recording rules written on the entry; the other items of ``record`` name generated ones."""
        return [r for r in self.record if isinstance(r, RecordingEntry)]

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "type": self.type, "unit": self.unit, "help": self.help,
            "layer": self.layer, "labels": list(self.labels), "max_series": self.max_series,
        }
        if self.source:
            out["source"] = [
                {"pattern": s.pattern, "kind": "literal" if s.literal else "pattern",
                 "labels": s.labels, "values": {k: sorted(v) for k, v in s.values.items()},
                 "scale": s.factor, **({"when_absent": s.when_absent} if s.when_absent else {})}
                for s in self.source
            ]
        if self.field:
            out["field"] = self.field
        if self.collector:
            out["collector"] = self.collector
        if self.instrumented_by:
            out["instrumented_by"] = self.instrumented_by
        if self.scraped_from:
            out["scraped_from"] = self.scraped_from
        if self.events:
            out["events"] = {"of": self.events.of, "record": self.events.record}
        if self.alerts:
            out["alerts"] = [a.alert for a in self.alerts]
        if self.panels:
            out["panels"] = [f"{p.dashboard}: {p.title}" for p in self.panels]
        if self.record:
            out["record"] = [r if isinstance(r, str) else r.record for r in self.record]
        return out


class RulesConfig(StrictModel):
    """Where the generated rules and dashboards point: the job selector, the runbook, the evaluation interval,
    and how Alertmanager reaches the relay."""

    selector: str = Field(default='job="verl"', description='the label matchers of the scrape job, e.g. job="verl"')
    # the alerts' reference page (docs/reference/alerts.md, one section per alert): GitHub renders it, and a
    # published docs site gives its headings the same anchors; point it at your own site with an overrides file
    runbook_url: str = Field(default="https://github.com/verl-exporter/verl-exporter/blob/main/docs/reference/alerts.md",
                             description="the runbook page; #<alertname in lower case> is appended")
    evaluation_interval: str = "30s"
    relay_url: str = Field(default="http://127.0.0.1:9095", description="where Alertmanager's receivers post "
                                                                         "(verl-exporter relay)")
    # 200 of the pack's largest alert (~2.2 KB with its generatorURL) are under half the relay's 1 MiB
    # max_body_bytes; the rest is counted in truncatedAlerts
    max_alerts: int = Field(default=200, ge=1,
                            description="alerts per webhook to the relay (Alertmanager's max_alerts)")
    routing: dict[LabelName, dict[Severity, Key]] = Field(
        default_factory=dict, description="team -> severity -> receiver name (an overrides file's global.routing "
                                          "adds to it); unset: <team>-<severity>")

    def runbook_link(self, alert: str) -> str:
        """Where an alert's runbook_url annotation points: its section of the runbook page."""
        return f"{self.runbook_url}#{alert.lower()}"


class Defaults(StrictModel):
    max_series: int = Field(default=64, ge=1)


class Spec(StrictModel):
    """A spec (a file, or a directory's files merged): every metric verl-exporter exports, alerts on or draws."""

    version: Literal[1]
    rules: RulesConfig = Field(default_factory=RulesConfig)
    target_labels: TupleOf[LabelName] = Field(
        default_factory=tuple, description="labels the sidecar adds to every series (--run, --rank)")
    defaults: Defaults = Field(default_factory=Defaults)
    metrics: Annotated[list[MetricSpec], Field(min_length=1)]
    global_alerts: TupleOf[Alert] = Field(default_factory=tuple, alias="alerts",
                                          description="alerts on several metrics")
    notices: TupleOf[Notice] = Field(default_factory=tuple,
                                     description="pages the pack sends itself, with no Prometheus rule behind them")
    codes: dict[ParamName, CodeSet] = Field(default_factory=dict, description="sets of codes alerts select by "
                                            "(<codes.NAME> in their PromQL), each declared once")
    _overrides: str = PrivateAttr("")  # the overrides file applied (spec.overrides.apply_overrides), if any

    @model_validator(mode="after")
    def _bind_codes(self) -> Spec:
        """Every alert reads the code sets declared here (an overrides file's codes: rebinds them)."""
        values = self.code_values()
        for a in self.alerts():
            a._codes = {name: values[name] for name in a.code_sets() if name in values}
        return self

    def code_values(self) -> dict[str, tuple[int, ...]]:
        return {name: c.codes for name, c in self.codes.items()}

    @field_validator("metrics")
    @classmethod
    def _max_series(cls, metrics: list[MetricSpec], info: ValidationInfo) -> tuple[MetricSpec, ...]:
        """Each metric with its cap: its own max_series, or defaults.max_series; an `events:` entry has one series
        per series of the metric it watches, so that metric's cap."""
        default = info.data["defaults"].max_series if "defaults" in info.data else None
        own = {m.name: m.max_series or default for m in metrics}

        def cap(m: MetricSpec) -> int | None:
            return own.get(m.events.of, default) if m.events else default

        return tuple(m if m.max_series else m.model_copy(update={"max_series": cap(m)}) for m in metrics)

    @field_validator("global_alerts")
    @classmethod
    def _cross_metric(cls, entries: Sequence[Alert]) -> tuple[Alert, ...]:
        return tuple(a.on_metric(CROSS_METRIC) for a in entries)

    def cross_problems(self) -> list[tuple[KeyPath, str]]:
        """(key path, message) of each problem across entries."""
        out: list[tuple[KeyPath, str]] = []
        seen: dict[tuple[str, str], Any] = {}

        def clash(what: str, name: str, owner: Any) -> Any:
            """Who declared this name first, when that is not owner."""
            first = seen.setdefault((what, name), owner)
            return None if first == owner else first

        detector_gauges = {m.name for m in self.metrics if m.instrumented_by == "detector"}
        metric_names = {m.name for m in self.metrics}
        for i, m in enumerate(self.metrics):
            at = ("metrics", i)
            if clash("metric", m.name, i) is not None:
                out.append(((*at, "name"), f"metric {m.name!r} is declared twice"))
            out += [((*at, "labels", k), f"label {lab!r} is reserved (a target label)")
                    for k, lab in enumerate(m.labels) if lab in self.target_labels]
            for j, s in enumerate(m.source):
                # a literal key feeds one metric; a conditional one (when_absent) may share its key
                if s.match and not s.captured and not s.when_absent and (
                        other := clash("key", s.match, m.name)) is not None:
                    out.append(((*at, "source", j), f"key {s.match!r} already feeds {other!r}"))
            if m.field and (other := clash("field", m.field, m.name)) is not None:
                out.append(((*at, "field"), f"field {m.field!r} already feeds {other!r}"))
            if m.events:
                out += [((*at, "events", key), why) for key, why in self._events_problems(m)]
                if (other := clash("events", f"{m.events.of} {m.events.record}", m.name)) is not None:
                    out.append(((*at, "events"), f"the {m.events.record} of {m.events.of}'s events is already "
                                                 f"{other!r}"))
            for j, r in enumerate(m.record):
                if not isinstance(r, str) and clash("recording", r.record, (i, j)) is not None:
                    out.append(((*at, "record", j), f"recording {r.record!r} is declared twice"))
            for j, d in enumerate(m.detect):
                if clash("signal", d.name, (i, j)) is not None:
                    out.append(((*at, "detect", j, "signal"), f"signal {d.name!r} is declared twice"))
                if d.skip_when_zero and d.skip_when_zero not in metric_names:
                    out.append(((*at, "detect", j, "skip_when_zero"), f"{d.skip_when_zero!r} is not a metric of "
                                "the spec"))
                out += [((*at, "detect", j, "export"), f"exports {stat} but verl_detector_{stat} is not declared "
                         "(instrumented_by: detector)") for stat in d.export
                        if f"verl_detector_{stat}" not in detector_gauges]
        alerts: list[tuple[KeyPath, Alert]] = [(("metrics", i, "alerts", j), a) for i, m in enumerate(self.metrics)
                                               for j, a in enumerate(m.alerts)]
        alerts += [(("alerts", j), a) for j, a in enumerate(self.global_alerts)]
        names = {a.alert for _, a in alerts}
        named: list[tuple[KeyPath, Alert | Notice]] = [*alerts, *((("notices", j), n) for j, n in
                                                                 enumerate(self.notices))]
        for path, one in named:
            if clash("alert", one.alert, path) is not None:
                out.append(((*path, "alert"), f"alert {one.alert!r} is declared twice"))
        for path, a in alerts:
            for key in ("inhibits", "explains"):
                out += [((*path, key, k), f"{key} unknown alert {t!r}") for k, t in enumerate(getattr(a, key))
                        if t not in names]
        out += [(("alerts", j, "kind"), f"a top-level alert names its series: its kind is one of "
                 f"{sorted(k for k, c in KINDS.items() if not c.on_entry)}") for j, a in enumerate(self.global_alerts)
                if a.on_entry]
        used: set[str] = set()
        for path, a in alerts:
            used.update(a.code_sets())
            out += [((*path, "alert"), f"quotes <codes.{name}>, which codes: does not declare")
                    for name in a.code_sets() if name not in self.codes]
        out += [(("codes", name), "no alert quotes it (<codes.NAME>)") for name in self.codes if name not in used]
        metrics, signals = {m.name for m in self.metrics}, {d.name for m in self.metrics for d in m.detect}
        for path, a in alerts:
            out += [((*path, "kind"), f"reads metric {name!r}, which is not in the spec")
                    for name in a.metrics() if name not in metrics]
            out += [((*path, "kind"), f"reads signal {name!r}, which no detect: declares")
                    for name in a.signals() if name not in signals]
        return out

    def _events_problems(self, m: MetricSpec) -> list[tuple[str, str]]:
        """(key, problem) of an `events:` entry: it watches a metric fed by verl keys, with that metric's labels."""
        assert m.events is not None
        watched = self.by_name.get(m.events.of)
        if watched is None or not watched.source:
            return [("of", f"{m.events.of!r} is not a metric of the spec fed by verl keys (source:)")]
        if m.labels != watched.labels:
            return [("of", f"its labels {list(m.labels)} must be those of {m.events.of}, in its order "
                           f"{list(watched.labels)}")]
        if m.max_series != watched.max_series:
            return [("of", f"its max_series {m.max_series} must be that of {m.events.of} ({watched.max_series}): "
                           "one series per series watched (leave it out)")]
        return []

    @cached_property
    def by_name(self) -> dict[str, MetricSpec]:
        return {m.name: m for m in self.metrics}

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Spec:
        """A copy (with ``update`` applied, unvalidated) whose index of metrics by name follows its metrics."""
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("by_name", None)  # cached from the metrics copied, maybe not the copy's own
        return copied

    @property
    def overrides(self) -> str:
        return self._overrides

    def alerts(self) -> list[Alert]:
        """Every alert, in spec order: those on metric entries, then the cross-metric ones."""
        return [a for m in self.metrics for a in m.alerts] + list(self.global_alerts)

    def notice(self, name: str) -> Notice:
        """The notice (a page the pack sends itself) of this name; KeyError when the spec declares none."""
        found = next((n for n in self.notices if n.alert == name), None)
        if found is None:
            raise KeyError(f"notice {name!r} is not in the spec")
        return found

    def panels(self) -> list[Panel]:
        return [p for m in self.metrics for p in m.panels]

    def signals(self) -> list[SignalSpec]:
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

    def events(self) -> list[MetricSpec]:
        """The `events:` entries, in spec order."""
        return [m for m in self.metrics if m.events is not None]

    def for_collector(self, collector: str) -> list[MetricSpec]:
        return [m for m in self.metrics if m.collector == collector]

    def instrumented(self, by: str) -> list[MetricSpec]:
        """The entries one part of the pack sets directly (one of INSTRUMENTED_BY)."""
        return [m for m in self.metrics if m.instrumented_by == by]


_PATTERN_MESSAGES = {
    **PATTERN_MESSAGES,
    ANY_NAME_RE.pattern: f"must match {METRIC_NAME_RE.pattern} (lower case, prefix verl_), or start with "
                         f"{' or '.join(e + ':' for e in SCRAPED_FROM)} with scraped_from",
    LABEL_NAME_RE.pattern: "must be a label name (letters, digits, _; not a digit first)",
    RECORDING_NAME_RE.pattern: "must be a name like level:verl_name:operations (or level:vllm_name:operations)",
    RECORDING_KIND: f"record may list {list(RECORDINGS)}, <avg|max|min>_over_time_<N><m|h> and {{record, expr}} "
                    "rules",
}


def _locate(loc: KeyPath) -> KeyPath:
    """An alert's error location without the kind tag pydantic puts after it (the file does not spell it),
    nor the branch names of a condition's nodes; a missing or unknown kind is the kind key's problem."""
    def tag(i: int) -> bool:
        before = loc[i - 2:i]
        if loc[i] in KINDS and len(before) == 2 and before[0] == "alerts" and isinstance(before[1], int):
            return True
        return loc[i] in CONDITION_NODES and (before[-1:] == ("when",) or (
            len(before) == 2 and before[0] in ("all", "any") and isinstance(before[1], int)))

    return tuple(part for i, part in enumerate(loc) if not tag(i))


def _hint(err: ErrorDetails, path: KeyPath) -> str | None:
    """The spec's own words for a failed literal or pattern (pydantic's are generic)."""
    if err["type"] == "union_tag_invalid":
        return f"kind: must be one of {list(KINDS)}, got {err['ctx']['tag']!r}"
    if err["type"] == "union_tag_not_found":
        return f"kind: required, one of {list(KINDS)}"
    if path == ("version",) and err["type"] == "literal_error":
        return f"must be 1, got {err['input']!r}"
    if err["type"] == "literal_error":
        return f"must be one of {err['ctx']['expected']}, got {err['input']!r}"
    if err["type"] == "string_pattern_mismatch":
        return _PATTERN_MESSAGES.get(err["ctx"]["pattern"])
    return None


def _line_of(problem: str) -> int:
    m = re.match(r"^.*?:(\d+): ", problem)
    return int(m.group(1)) if m else 0


class _Part:
    """One file of a spec: the origin its problems name, its document and its key lines."""

    def __init__(self, origin: str, doc: Any, lines: Lines) -> None:
        self.origin, self.doc, self.lines = origin, doc, lines


@functools.lru_cache(maxsize=32)
def _parse_packaged(text: str, origin: str) -> tuple[Any, Lines]:
    """A packaged spec file parsed once per process for the same text: each load_spec() of the packaged spec
    read and line-tracked every file again, a tenth of a second every time (a sidecar, the relay and the CLI
    load it several times, the tests a thousand)."""
    return parse_yaml(text, origin, SpecError)


# A folder of a spec directory holding one area's sub-area files: named like an area file (10-training/).
AREA_FOLDER_RE = re.compile(r"^\d+-[a-z0-9-]+$")


def area_files(folder: Traversable) -> list[tuple[str, Traversable]]:
    """(name relative to folder, file) of a spec directory's *.yaml files, in spec order: each area's file
    (NN-area.yaml), then the sub-area files of its folder (NN-area/*.yaml) by name. An area grows by a
    sub-area file instead of one file growing without end; other folders are not the spec's."""
    found: list[tuple[tuple[str, str], str, Traversable]] = []
    for entry in folder.iterdir():
        if entry.is_file() and entry.name.endswith(".yaml"):
            found.append(((entry.name.removesuffix(".yaml"), ""), entry.name, entry))
        elif entry.is_dir() and AREA_FOLDER_RE.match(entry.name):
            found += [((entry.name, sub.name), f"{entry.name}/{sub.name}", sub) for sub in entry.iterdir()
                      if sub.is_file() and sub.name.endswith(".yaml")]
    return [(name, f) for _, name, f in sorted(found, key=lambda t: t[0])]


def _read(path: str | Path | None) -> tuple[list[_Part], str]:
    """(the files of a spec, its origin): a file, or a directory's area files in spec order (area_files)."""
    if path is None:
        origin, parts = f"packaged spec {DEFAULT_SPEC}", []
        for rel, f in area_files(resources.files(__name__).joinpath(DEFAULT_SPEC)):
            name = f"{origin}/{rel}"
            doc, lines = _parse_packaged(f.read_text(encoding="utf-8"), name)
            parts.append(_Part(name, copy.deepcopy(doc), lines))  # a copy: callers may edit their document
        return parts, origin
    if Path(path).is_dir():
        files = [f for _, f in area_files(Path(path))]
        if not files:
            raise SpecError(["a spec directory needs at least one *.yaml file"], str(path))
        return [_Part(str(f), *read_yaml(str(f), SpecError)) for f in files], str(path)
    return [_Part(str(path), *read_yaml(path, SpecError))], str(path)


def _merge(parts: list[_Part], origin: str) -> tuple[dict[str, Any], Callable[[KeyPath], tuple[_Part, KeyPath]]]:
    """(the merged document, a function giving the file and the path in it of a path of the merged document).
    The files' MERGED lists are concatenated in file order; any other top-level key may be in one file only."""
    for part in parts:
        if not isinstance(part.doc, dict):
            raise SpecError(["the document must be a mapping with a 'metrics' list"], part.origin)
    if len(parts) == 1:  # a single file is its own document
        return parts[0].doc, lambda path: (parts[0], path)
    whole = _Part(origin, {}, {})  # where a problem of no one file is (a key none of them gives)
    doc: dict[str, Any] = {}
    holder: dict[Any, _Part] = {}  # the file of each top-level key (the first, for a merged list)
    items: dict[str, list[tuple[_Part, int]]] = {key: [] for key in MERGED}
    clashes = []
    for part in parts:
        for key, value in part.doc.items():
            place = where(part.origin, part.lines, (key,))
            if key in MERGED and not isinstance(value, list):
                clashes.append(f"{place}: {key}: must be a list")
            elif key in MERGED:
                doc.setdefault(key, []).extend(value)
                items[key] += [(part, i) for i in range(len(value))]
                holder.setdefault(key, part)
            elif key in holder:
                clashes.append(f"{place}: {key}: also given in {where(holder[key].origin, holder[key].lines, (key,))}"
                               f"; only {' and '.join(MERGED)} may be in several files")
            else:
                doc[key], holder[key] = value, part
    if clashes:
        raise SpecError(clashes, origin)

    def locate(path: KeyPath) -> tuple[_Part, KeyPath]:
        if len(path) > 1 and path[0] in MERGED and isinstance(path[1], int) and path[1] < len(items[path[0]]):
            part, i = items[path[0]][path[1]]
            return part, (path[0], i, *path[2:])
        return (holder.get(path[0], whole) if path else whole), path

    return doc, locate


def _value(doc: Any, path: KeyPath) -> Any:
    for key in path:
        try:
            doc = doc[key]
        except (KeyError, IndexError, TypeError):
            return None
    return doc


def _first_declared(parts: list[_Part], part: _Part, at: KeyPath, message: str) -> str:
    """' (first at FILE:LINE)' for a name declared twice: the first place that gives it under the same key."""
    twice = re.fullmatch(r"\w+ '(.+)' is declared twice", message)
    if not twice:
        return ""
    name = twice.group(1)
    if isinstance(entry := _value(part.doc, at), dict):  # reported at its entry (a recording): the key naming it
        at = (*at, next((k for k, v in entry.items() if v == name), ""))
    for other in parts:
        for path in other.lines:
            if path[-1] == at[-1] and (other, path) != (part, at) and _value(other.doc, path) == name:
                return f" (first at {where(other.origin, other.lines, path)})"
    return ""


def _parse(parts: list[_Part], origin: str) -> Spec:
    """Validate a spec's files as one document and build the Spec; each problem names its own file and line."""
    doc, locate = _merge(parts, origin)
    rank = {p: i for i, p in enumerate(parts)}.get  # file order; a problem of no one file first
    try:
        model = Spec.model_validate(doc)
    except ValidationError as e:
        by_part: dict[_Part, list[ErrorDetails]] = {}
        for err in e.errors():
            by_part.setdefault(locate(err["loc"])[0], []).append(err)
        raise SpecError([text for part in sorted(by_part, key=lambda p: rank(p, -1))
                         for text in problems(by_part[part], part.origin, part.lines, _hint,
                                              lambda loc: locate(_locate(loc))[1])], origin) from None
    found = []
    for path, message in model.cross_problems():
        part, at = locate(path)
        text = f"{where(part.origin, part.lines, at)}: {'.'.join(map(str, at))}: {message}"
        found.append((rank(part, -1), _line_of(text), text + _first_declared(parts, part, at, message)))
    if found:
        raise SpecError([text for *_, text in sorted(found)], origin)
    return model


def parse_spec(doc: Any, origin: str = "spec", lines: Lines | None = None) -> Spec:
    """Validate a parsed YAML document and build the Spec; raise SpecError listing every problem."""
    return _parse([_Part(origin, doc, lines or {})], origin)


def load_spec(path: str | Path | None = None) -> Spec:
    """Load a spec: a file, or a directory whose *.yaml files are merged in name order (by default the
    packaged one, the directory spec/metrics/)."""
    return _parse(*_read(path))


def spec_document(path: str | Path | None = None) -> dict[str, Any]:
    """A spec's document as the loader merges it, unvalidated (to edit and give to parse_spec)."""
    return _merge(*_read(path))[0]


def schema() -> dict[str, Any]:
    """The JSON Schema of a spec file (``verl-exporter schema spec``). No key is required: a file of a spec
    directory holds part of the spec, and the loader checks the merged whole."""
    doc = json_schema(Spec, "verl-exporter metric spec (a spec file, or one file of a spec directory)")
    del doc["required"]
    return doc
