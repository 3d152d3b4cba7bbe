"""The overrides file (``verl-exporter.yaml`` or ``--overrides FILE``): a few named knobs over the packaged spec.

The monitoring-mixin way (kubernetes-mixin's ``_config``): instead of forking the 3,000-line spec to change one
threshold, a team writes only what differs and keeps upgrading the pack::

    version: 1
    global:
      selector: 'job="verl-agent"'            # the job selector every rule uses
      routing: {training: agent-oncall}       # team -> relay receiver (or {critical: NAME, warning: NAME})
    alerts:
      VerlResponseClipRatioHigh: {thresholds: {clip_ratio: 0.3}, for: 15m}
      VerlRewardDrop: {thresholds: {k: 6}, min_steps: 20}
      VerlGPUPowerCapped: {enabled: false}
    codes:
      critical_xids: [48, 79, 94, 95]         # a set of codes several alerts select by (spec's codes:)

Per alert: ``thresholds`` (its knobs, ``knobs()`` of its kind, spec/kinds/: the threshold, a detector's k and change,
an expr alert's named params), ``for``, ``severity``, ``enabled``, extra ``labels`` (``team`` reroutes it),
``min_steps`` (the step-domain signals it reads wait for that many steps). Global: the job ``selector``,
``runbook_url``, ``relay_url``, ``evaluation_interval``, ``max_alerts`` (alerts per webhook to the relay) and
``routing``. ``codes:`` replaces a code set of the spec (each is shared by the alerts that quote it, and by
preflight's XID check). ``preflight:`` holds the thresholds of `verl-exporter preflight` (PreflightKnobs).

``apply_overrides(spec, overrides)`` returns the effective Spec; everything downstream (the rules, their
promtool tests, the dashboards, Alertmanager, the PrometheusRule, the sidecar's detectors, the in-process
breaker, the replay) reads that Spec, so one knob changes every place it applies. Unknown keys, alert names
and knob names are errors, each with the file's line.

The model is a core.models StrictModel (pydantic v2; why pydantic, there); ``verl-exporter schema overrides``
writes its JSON Schema.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator
from pydantic_core import ErrorDetails

from ..core.detect import MIN_STEPS_FLOOR
from ..core.models import FileError, KeyPath, Lines, StrictModel, json_schema, read_yaml, validate, where
from . import LabelName, Spec, load_spec
from .kinds import Alert
from .rules import CODES_UNIT, SEVERITIES, AlertName, Codes, Duration, Param, ParamName, Severity, in_range

log = logging.getLogger(__name__)

DEFAULT_FILE = "verl-exporter.yaml"
ENV = "VERL_EXPORTER_OVERRIDES"
DEFAULT_TEAM = "verl"  # the receivers of alerts without a team label: verl-<severity>
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=|!=|=~|!~)\s*"(?:[^"\\]|\\.)*"\s*'
SELECTOR_RE = re.compile(rf"^{_MATCHER}(,{_MATCHER})*$")
RECEIVER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # the last part of the relay's URL path

Receiver = Annotated[str, StringConstraints(pattern=RECEIVER_RE.pattern)]
Url = Annotated[str, StringConstraints(pattern=r"^https?://\S+$")]


class AlertOverride(StrictModel):
    """What an overrides file may change on one alert of the pack."""

    enabled: bool | None = Field(None, description="false removes the alert (and the inhibit rules naming it)")
    severity: Severity | None = Field(None, description="critical, warning or info")
    for_: Duration | None = Field(None, alias="for", description="how long the condition must hold, e.g. 10m")
    thresholds: dict[str, float] = Field(
        default_factory=dict, description="the alert's knobs by name (`verl-exporter spec --knobs` lists them)")
    labels: dict[LabelName, str] = Field(
        default_factory=dict, description="extra labels on the alert; team decides its route")
    min_steps: int | None = Field(
        None, ge=MIN_STEPS_FLOOR, description="steps the step-domain signals it reads wait for before judging "
                                              "(applies to every alert reading those signals)")

    @field_validator("labels")
    @classmethod
    def _own_keys(cls, labels: dict[str, str]) -> dict[str, str]:
        for reserved in ("severity", "alertname"):
            if reserved in labels:
                raise ValueError(f"{reserved} is not a label to set here" +
                                 (" (use severity:)" if reserved == "severity" else ""))
        return labels


class GlobalOverrides(StrictModel):
    """Where the rules point and where the alerts go."""

    selector: str | None = Field(default=None, description='label matchers every rule selects with, e.g. job="verl"')
    runbook_url: Url | None = Field(default=None, description="base URL of the runbook; #<alertname> is appended")
    relay_url: Url | None = Field(default=None, description="where Alertmanager's receivers post (verl-exporter relay)")
    evaluation_interval: Duration | None = Field(default=None, description="how often Prometheus evaluates the rules")
    max_alerts: int | None = Field(default=None, ge=1, description="alerts per webhook to the relay (Alertmanager's "
                                                           "max_alerts); keep max_alerts x 2.2 KB under the "
                                                           "relay's max_body_bytes")
    routing: dict[LabelName, Receiver | dict[Severity, Receiver]] = Field(
        default_factory=dict, description="team -> relay receiver, or team -> {severity: receiver}; "
                                          f"alerts without a team are team {DEFAULT_TEAM!r}")

    @field_validator("selector")
    @classmethod
    def _selector(cls, value: str | None) -> str | None:
        if value is not None and not SELECTOR_RE.match(value):
            raise ValueError('must be comma-separated label matchers, e.g. job="verl-agent", cluster=~"a|b"')
        return value


class PreflightKnobs(StrictModel):
    """The thresholds of `verl-exporter preflight` (each one declared here, with its default, and only here)."""

    xid_lookback: Duration = Field("24h", description="a critical XID (VerlGPUXidCritical's codes) in the kernel "
                                                      "log this recently fails the GPU check")
    fabric_sample: Duration = Field("10s", description="how long the fabric check watches the error counters "
                                                       "(--fabric-sample overrides it)")
    free_space_margin: float = Field(0.1, ge=0, le=10, description="headroom over the space the next saves need "
                                                                   "(0.1 = 10%)")
    saves_ahead: int = Field(2, ge=1, le=1000, description="saves the free space must hold when max_ckpt_to_keep "
                                                           "is unset (verl keeps every checkpoint)")
    nodes_wait: Duration = Field("5m", description="how long to wait for every node's manifest in --manifests-dir")


class Overrides(StrictModel):
    """verl-exporter.yaml: knobs over the packaged alert pack."""

    version: Literal[1] = 1
    global_: GlobalOverrides = Field(default_factory=GlobalOverrides, alias="global")
    alerts: dict[AlertName, AlertOverride] = Field(default_factory=dict)
    codes: dict[ParamName, Codes] = Field(default_factory=dict, description="code sets of the spec by name, each "
                                          "a list of codes (`verl-exporter spec --knobs` lists them)")
    preflight: PreflightKnobs = Field(default_factory=PreflightKnobs)


class OverridesError(FileError):
    """An overrides file that cannot be used; ``problems`` lists every problem, each with its place."""


@dataclass(frozen=True)
class LoadedOverrides:
    """A validated overrides file, and the line of each key (for messages and `spec --overrides`)."""

    model: Overrides
    origin: str = "overrides"
    lines: Lines = field(default_factory=dict)

    def where(self, *path: str | int) -> str:
        """'FILE:LINE' of the deepest key of path the file has."""
        return where(self.origin, self.lines, path)


def _hint(err: ErrorDetails, path: KeyPath) -> str | None:
    if path and path[-1] in ("for", "evaluation_interval") and err["type"] in ("string_type",
                                                                               "string_pattern_mismatch"):
        return f"must be a Prometheus duration like 10m, got {err['input']!r}"
    # a knob of the wrong unit: a list for a number, a number for a code set
    if len(path) == 4 and path[2] == "thresholds" and isinstance(err["input"], (list, dict)):
        return f"a threshold is one number, got {type(err['input']).__name__} (a set of codes goes under codes:)"
    if len(path) == 2 and path[0] == "codes":
        if err["type"] == "tuple_type":
            return f"a code set is a list of integer codes like [48, 79], got {err['input']!r}"
        if err["type"] == "too_short":
            return "a code set holds at least one code (to page on none, disable the alerts that read it)"
    if len(path) == 3 and path[0] == "codes" and err["type"] in ("int_type", "int_from_float", "greater_than_equal"):
        return f"a code is a non-negative integer, got {err['input']!r}"
    return None


def parse_overrides(doc: Any, origin: str = "overrides", lines: Lines | None = None) -> LoadedOverrides:
    """Validate a parsed YAML document (structure only; apply_overrides checks it against a spec)."""
    lines = lines or {}
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise OverridesError(["the document must be a mapping (version, global, alerts)"], origin)
    model = validate(Overrides, doc, origin, lines, OverridesError, _hint)
    return LoadedOverrides(model, origin, lines)


def load_overrides(path: str | Path) -> LoadedOverrides:
    doc, lines = read_yaml(path, OverridesError)
    return parse_overrides(doc, str(path), lines)


def resolve_path(explicit: str | None) -> str | None:
    """The overrides file to use: the one given ('' for none), else $VERL_EXPORTER_OVERRIDES, else
    ./verl-exporter.yaml when it exists."""
    if explicit is not None:
        return explicit or None
    env = os.environ.get(ENV)
    if env is not None:
        return env or None
    return DEFAULT_FILE if Path(DEFAULT_FILE).is_file() else None


# ---------------------------------------------------------------------------------------------- applying
def is_hard_safety(spec: Spec, alert: Alert) -> bool:
    """NaN/Inf, hangs and hardware faults: alerts calibrate never loosens. NaN/Inf alerts (kind nonfinite),
    every alert on a fault-layer metric (GPU lost, ECC, row remapping, NVLink, XID, broken checkpoints) and
    those the spec marks `safety: hard` (the hang alerts)."""
    if alert.hard_safety or alert.safety == "hard":
        return True
    return alert.metric in spec and spec[alert.metric].layer == "fault"


def teams_of(alerts: Sequence[Alert]) -> set[str]:
    return {a.labels.get("team", DEFAULT_TEAM) for a in alerts}


def signal_min_steps(spec: Spec, loaded: LoadedOverrides, problems: list[str]) -> dict[str, tuple[int, str]]:
    """{signal: (min_steps, the alert that set it)} from the alerts' min_steps."""
    by_alert = {a.alert: a for a in spec.alerts()}
    windows = {s.name: s.window for s in spec.signals()}
    out: dict[str, tuple[int, str]] = {}
    for name, ov in loaded.model.alerts.items():
        if ov.min_steps is None or name not in by_alert:
            continue
        where = f"{loaded.where('alerts', name, 'min_steps')}: alerts.{name}.min_steps"
        signals = [s for s in by_alert[name].signals() if s in windows]
        if not signals:
            problems.append(f"{where}: {name} reads no step-domain signal; min_steps applies to adaptive alerts")
            continue
        for sig in signals:
            if ov.min_steps > windows[sig]:
                problems.append(f"{where}: {ov.min_steps} exceeds the {windows[sig]}-step window of signal {sig!r}")
            elif sig in out and out[sig][0] != ov.min_steps:
                problems.append(f"{where}: signal {sig!r} is also read by {out[sig][1]}, which sets min_steps "
                                f"{out[sig][0]}; alerts on one signal share its min_steps")
            else:
                out[sig] = (ov.min_steps, name)
    return out


def _routing(model: GlobalOverrides) -> dict[str, dict[Severity, str]]:
    out: dict[str, dict[Severity, str]] = {}
    for team, target in model.routing.items():
        out[team] = {s: target for s in SEVERITIES} if isinstance(target, str) else dict(target)
    return out


def _line_of(problem: str) -> int:
    m = re.match(r"^.*?:(\d+): ", problem)
    return int(m.group(1)) if m else 0


def apply_overrides(spec: Spec, overrides: LoadedOverrides | Overrides | dict[str, Any] | None) -> Spec:
    """The effective spec: the spec with the overrides applied. Raises OverridesError naming every problem."""
    if overrides is None:
        return spec
    if isinstance(overrides, dict):
        overrides = parse_overrides(overrides)
    loaded = overrides if isinstance(overrides, LoadedOverrides) else LoadedOverrides(overrides)
    model = loaded.model
    problems: list[str] = []
    by_name = {a.alert: a for a in spec.alerts()}
    changed: dict[str, Alert | None] = {}  # None: disabled
    for name, ov in model.alerts.items():
        at = loaded.where("alerts", name)
        alert = by_name.get(name)
        if alert is None:
            near = difflib.get_close_matches(name, list(by_name), n=1)
            problems.append(f"{at}: alerts.{name}: no such alert in the spec"
                            + (f" (did you mean {near[0]}?)" if near else ""))
            continue
        own = alert.knobs()
        values: dict[str, float] = {}
        for knob, value in ov.thresholds.items():
            where = f"{loaded.where('alerts', name, 'thresholds', knob)}: alerts.{name}.thresholds.{knob}"
            if knob not in own:
                has = f"its knobs: {', '.join(own)}" if own else \
                    "it has none; for, severity, enabled and labels still apply"
                if knob in spec.codes:
                    has += f"; {knob} is a code set: set codes.{knob}"
                problems.append(f"{where}: {name} has no knob {knob!r} ({has})")
            elif not math.isfinite(value) or not in_range(own[knob], value):
                p = own[knob]
                problems.append(f"{where}: {value:g} is outside the knob's range [{p.min}, {p.max}]")
            else:
                values[knob] = value
        if ov.enabled is False:
            changed[name] = None
            continue
        alert = alert.with_knobs(values)
        if ov.for_ is not None:
            alert = alert.model_copy(update={"for_": ov.for_})
        if ov.severity is not None:
            alert = alert.model_copy(update={"severity": ov.severity})
        if ov.labels:
            alert = alert.model_copy(update={"labels": {**alert.labels, **ov.labels}})
        changed[name] = alert
    for code_set in model.codes:
        if code_set not in spec.codes:
            near = difflib.get_close_matches(code_set, list(spec.codes), n=1)
            problems.append(f"{loaded.where('codes', code_set)}: codes.{code_set}: no such code set in the spec "
                            f"(code sets: {', '.join(spec.codes) or 'none'})" + (f"; did you mean {near[0]}?" if near
                                                                                 else ""))
    min_steps = signal_min_steps(spec, loaded, problems)
    enabled = [e for e in (changed.get(a.alert, a) for a in spec.alerts()) if e is not None]
    teams = teams_of(enabled)
    for team in model.global_.routing:
        if team not in teams:
            near = difflib.get_close_matches(team, sorted(teams), n=1)
            problems.append(f"{loaded.where('global', 'routing', team)}: global.routing.{team}: no alert has team "
                            f"{team!r} (teams: {', '.join(sorted(teams))})" + (f"; did you mean {near[0]}?" if near
                                                                               else ""))
    if problems:
        raise OverridesError(sorted(problems, key=_line_of), loaded.origin)
    off = {name for name, a in changed.items() if a is None}
    codes = {**spec.code_values(), **{name: tuple(c) for name, c in model.codes.items()}}

    def effective(alerts: Sequence[Alert]) -> tuple[Alert, ...]:
        out: list[Alert] = []
        for a in alerts:
            e = changed.get(a.alert, a)
            if e is None:
                continue
            if set(e.inhibits) & off:
                e = e.model_copy(update={"inhibits": [t for t in e.inhibits if t not in off]})
            out.append(e.with_codes(codes))
        return tuple(out)

    metrics = []
    for m in spec.metrics:
        detect = tuple(s.model_copy(update={"min_steps": min_steps[s.name][0]}) if s.name in min_steps else s
                       for s in m.detect)
        metrics.append(m.model_copy(update={"alerts": effective(m.alerts), "detect": detect}))
    g = model.global_
    given = {"selector": g.selector, "runbook_url": g.runbook_url, "relay_url": g.relay_url,
             "evaluation_interval": g.evaluation_interval, "max_alerts": g.max_alerts}
    rules = spec.rules.model_copy(update={**{k: v for k, v in given.items() if v is not None},
                                          "routing": {**spec.rules.routing, **_routing(g)}})
    code_sets = {name: c.model_copy(update={"codes": codes[name]}) for name, c in spec.codes.items()}
    effective_spec = spec.model_copy(update={"metrics": tuple(metrics), "rules": rules, "codes": code_sets,
                                             "global_alerts": effective(spec.global_alerts)})
    effective_spec._overrides = loaded.origin  # not a key of the spec file: private, set on this fresh copy
    return effective_spec


@dataclass(frozen=True)
class SpecWithOverrides:
    """A spec as declared, the overrides file applied to it (None: none), and the result."""

    declared: Spec
    overrides: LoadedOverrides | None
    effective: Spec


def load_with_overrides(spec_path: str | None = None, overrides: str | None = None,
                        announce: Callable[[str], object] | None = None) -> SpecWithOverrides:
    """The spec (packaged, or spec_path) and the overrides file resolve_path(overrides) names, applied.
    announce(path) is called with the file used (default: logged). Raises SpecError or OverridesError."""
    spec = load_spec(spec_path)
    path = resolve_path(overrides)
    if path is None:
        return SpecWithOverrides(spec, None, spec)
    (announce or (lambda used: log.info("using overrides %s", used)))(path)
    loaded = load_overrides(path)
    return SpecWithOverrides(spec, loaded, apply_overrides(spec, loaded))


def load_effective_spec(spec_path: str | None = None, overrides: str | None = None,
                        announce: Callable[[str], object] | None = None) -> Spec:
    """The spec with the overrides applied, as load_with_overrides loads them."""
    return load_with_overrides(spec_path, overrides, announce).effective


# ---------------------------------------------------------------------------------------------- reading back
@dataclass(frozen=True)
class KnobRow:
    knob: str  # e.g. VerlRewardDrop.k, VerlRewardDrop.for, global.selector
    default: str
    value: str
    source: str  # "spec", or FILE:LINE
    note: str = ""
    unit: str = ""  # a threshold's (Param.unit), a code set's (codes); "" for the settings
    meaning: str = ""  # one line: what it decides


def param_meaning(p: Param) -> str:
    """A threshold's meaning, on which side it fires and its range, in one line."""
    bounds = knob_range(p)
    return f"{p.meaning}; fires when the watched value {p.op} it" + (f" ({bounds})" if bounds else "")


def knob_range(p: Param) -> str:
    if p.min is not None and p.max is not None:
        return f"{p.min:.12g} to {p.max:.12g}"
    if p.min is not None:
        return f"at least {p.min:.12g}"
    return "" if p.max is None else f"at most {p.max:.12g}"


# what the keys of every alert mean (its thresholds have their own: param_meaning)
ALERT_KEYS = {"enabled": "false drops the alert and the inhibit rules naming it",
              "for": "how long the condition must hold before it fires",
              "severity": "critical, warning or info",
              "labels": "extra labels; team reroutes the alert",
              "min_steps": "steps the signal waits for before its statistics are exported"}


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.12g}"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return str(value)


def knob_table(spec: Spec, loaded: LoadedOverrides | None = None) -> list[KnobRow]:
    """Every knob: its default (the spec's), its effective value and where that came from."""
    loaded = loaded or LoadedOverrides(Overrides(), "")
    eff = apply_overrides(spec, loaded)
    eff_alerts = {a.alert: a for a in eff.alerts()}
    model = loaded.model
    rows: list[KnobRow] = []

    def src(*path: str | int) -> str:
        return loaded.where(*path) if loaded.origin else "spec"

    g = model.global_
    for key in ("selector", "runbook_url", "relay_url", "evaluation_interval", "max_alerts"):
        given = getattr(g, key)
        rows.append(KnobRow(f"global.{key}", str(getattr(spec.rules, key)), str(getattr(eff.rules, key)),
                            src("global", key) if given is not None else "spec",
                            meaning=type(spec.rules).model_fields[key].description or key.replace("_", " ")))
    for team in sorted(teams_of(list(eff_alerts.values())) | set(g.routing)):
        default = f"{team}-<severity>"
        routed = eff.rules.routing.get(team)
        value = default if routed is None else (next(iter(set(routed.values()))) if len(set(routed.values())) == 1
                                                else _fmt(routed))
        rows.append(KnobRow(f"global.routing.{team}", default, value,
                            src("global", "routing", team) if team in g.routing else "spec",
                            meaning="the relay receiver of this team's alerts"))
    for name, c in spec.codes.items():
        readers = [a.alert for a in spec.alerts() if name in a.code_sets()]
        rows.append(KnobRow(f"codes.{name}", _fmt(list(c.codes)), _fmt(list(eff.codes[name].codes)),
                            src("codes", name) if name in model.codes else "spec", unit=CODES_UNIT,
                            meaning=f"{c.meaning} (read by {', '.join(readers)})"))
    defaults = PreflightKnobs()
    for key in PreflightKnobs.model_fields:
        given = key in model.preflight.model_fields_set
        rows.append(KnobRow(f"preflight.{key}", _fmt(getattr(defaults, key)), _fmt(getattr(model.preflight, key)),
                            src("preflight", key) if given else "spec",
                            meaning=PreflightKnobs.model_fields[key].description or key.replace("_", " ")))
    signals = {s.name: s for s in eff.signals()}
    base_signals = {s.name: s for s in spec.signals()}
    for a in spec.alerts():
        ov = model.alerts.get(a.alert)
        e = eff_alerts.get(a.alert)
        note = "hard safety" if is_hard_safety(spec, a) else ""
        path = ("alerts", a.alert)
        rows.append(KnobRow(f"{a.alert}.enabled", "true", "false" if e is None else "true",
                            src(*path, "enabled") if ov and ov.enabled is not None else "spec", note,
                            meaning=ALERT_KEYS["enabled"]))
        if e is None:
            continue
        for name, p in a.knobs().items():
            rows.append(KnobRow(f"{a.alert}.{name}", _fmt(p.value), _fmt(e.knobs()[name].value),
                                src(*path, "thresholds", name) if ov and name in ov.thresholds else "spec", note,
                                unit=p.unit, meaning=param_meaning(p)))
        rows.append(KnobRow(f"{a.alert}.for", a.for_, e.for_, src(*path, "for") if ov and ov.for_ else "spec",
                            note, meaning=ALERT_KEYS["for"]))
        rows.append(KnobRow(f"{a.alert}.severity", a.severity, e.severity,
                            src(*path, "severity") if ov and ov.severity else "spec", note,
                            meaning=ALERT_KEYS["severity"]))
        if a.labels or e.labels:
            rows.append(KnobRow(f"{a.alert}.labels", _fmt(a.labels), _fmt(e.labels),
                                src(*path, "labels") if ov and ov.labels else "spec", note,
                                meaning=ALERT_KEYS["labels"]))
        for sig in a.signals():
            if sig in signals:
                setter = next((n for n, o in model.alerts.items() if o.min_steps is not None and n in eff_alerts
                               and sig in eff_alerts[n].signals()), None)
                rows.append(KnobRow(f"{a.alert}.min_steps[{sig}]", str(base_signals[sig].min_steps),
                                    str(signals[sig].min_steps),
                                    src("alerts", setter, "min_steps") if setter else "spec", note, unit="count",
                                    meaning=ALERT_KEYS["min_steps"]))
    return rows


def schema(spec: Spec | None = None) -> dict[str, Any]:
    """The JSON Schema of an overrides file for this spec (the packaged one by default): the model's, with the
    spec's alert names, each alert's knob names (and ranges) and the teams spelled out."""
    spec = spec or load_spec()
    doc = json_schema(Overrides, "verl-exporter overrides (verl-exporter.yaml)")
    props: dict[str, Any] = {}
    for a in spec.alerts():
        thresholds: dict[str, Any] = {}
        for name, p in a.knobs().items():
            t: dict[str, Any] = {"type": "number", "description": f"{p.unit}, default {p.value:g}: "
                                                                  f"{param_meaning(p)}"}
            if p.min is not None:
                t["minimum"] = p.min
            if p.max is not None:
                t["maximum"] = p.max
            thresholds[name] = t
        entry: dict[str, Any] = {"$ref": "#/$defs/AlertOverride", "description": a.summary,
                                 "properties": {"thresholds": {"type": "object", "properties": thresholds,
                                                               "additionalProperties": False}}}
        if not a.signals():
            entry["properties"]["min_steps"] = {"type": "null"}
        props[a.alert] = entry
    doc["properties"]["alerts"] = {"type": "object", "properties": props, "additionalProperties": False,
                                   "description": "per alert of the pack (unknown names are errors)"}
    codes = doc["properties"]["codes"]
    # the model's: any name, a list of codes; here each set of the spec, spelled out
    item = next(iter(codes.pop("patternProperties").values()))
    codes.update({"properties": {name: {**item, "description": f"default {_fmt(list(c.codes))}: {c.meaning}"}
                                 for name, c in spec.codes.items()}, "additionalProperties": False})
    return doc
