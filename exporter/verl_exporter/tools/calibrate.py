"""``verl-exporter calibrate RUN.jsonl [...]``: fit the pack's thresholds to the user's own healthy runs.

Each run is replayed with the replay engine (the real follower, store and step-domain detectors on a simulated
clock, sampled once a minute as Prometheus would scrape them). For every knob of the pack that calibrate knows
how to read, the quantity the alert compares with it is taken from those samples (a KL line: the held minimum
of the KL; a detector's k: its sustained z-score at the minutes its change gate also passes; ...). A knob
whose runs come closer to its line than the margin (default 20%) is moved so that the highest value seen
(lowest, for a "<" knob) keeps that margin; every other knob keeps its value, so calibrate only loosens,
and only where the user's healthy runs need it. Each knob is printed with its default, the proposal and why.

Hard-safety alerts (NaN/Inf, hangs, hardware faults: spec.overrides.is_hard_safety) are never loosened: when
a healthy run raises one, calibrate says so and leaves it alone. The proposal is then checked: the rules
rendered with it are evaluated by promtool over the same runs (what ``backtest --overrides`` shows), and an
alert that still fires is named with the reason calibrate could not silence it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..spec import Spec
from ..spec.kinds import Alert
from ..spec.overrides import LoadedOverrides, apply_overrides, is_hard_safety, parse_overrides
from ..spec.rules import EVAL_TIME_RE, Param, duration_seconds, fmt_knob, in_range
from . import replay as rp

MARGIN = 0.2

# ---------------------------------------------------------------------------------------------- quantities
Values = list[float | None]  # one value per scraped minute (None: no sample)
QUANTITY = "calibrate:quantity"


@dataclass
class Run:
    name: str
    samples: rp.Samples


def quantity_exprs(spec: Spec) -> dict[tuple[str, str], tuple[str, str, str]]:
    """{(alert, knob): (PromQL of what the knob is compared with, in words, op)}: each kind's own
    ``quantities`` (spec/kinds/), the extreme across series taken on the side that fires."""
    out = {}
    for alert in spec.alerts():
        own = alert.knobs()
        for knob, (expr, words) in alert.quantities(spec.rules.selector).items():
            pick = "max" if own[knob].op in (">", ">=") else "min"
            out[(alert.alert, knob)] = (f"{pick}({expr})", words, own[knob].op)
    return out


def quantities(spec: Spec, run: Run, exprs: dict[tuple[str, str], tuple[str, str, str]],
               promtool: str | None = None) -> dict[tuple[str, str], Values]:
    """Each quantity's value at every scraped minute of a replayed run, by promtool over the spec's recording
    rules (the replay engine's evaluation path: the same series, the same rule engine as the alerts)."""
    from ..render.rules import render_rules

    promtool = promtool or shutil.which("promtool")
    if promtool is None:
        raise RuntimeError("promtool is not installed (Debian: apt-get install prometheus)")
    keys = sorted(exprs)
    minutes = run.samples.length
    out: dict[tuple[str, str], Values] = {k: [None] * minutes for k in keys}
    with tempfile.TemporaryDirectory(prefix="verl-exporter-calibrate-") as tmp:
        recording = Path(tmp) / "verl-recording.yaml"
        recording.write_text(render_rules(spec)["rules/verl-recording.yaml"], encoding="utf-8")
        rules = [{"record": QUANTITY, "expr": f'label_replace({exprs[k][0]}, "knob", "{i}", "", "")'}
                 for i, k in enumerate(keys)]
        (Path(tmp) / "quantities.yaml").write_text(json.dumps({"groups": [{"name": "calibrate", "rules": rules}]}))
        doc = {"rule_files": [str(recording), str(Path(tmp) / "quantities.yaml")], "evaluation_interval": "1m",
               "group_eval_order": [g["name"] for g in _groups(recording)] + ["calibrate"],
               "tests": [{"interval": "1m",
                          "input_series": [{"series": _series_name(n, lab),
                                            "values": rp.series_text(v + [None] * (minutes - len(v)))}
                                           for (n, lab), v in run.samples.series.items()],
                          "promql_expr_test": [{"expr": QUANTITY, "eval_time": f"{m}m", "exp_samples": []}
                                               for m in range(minutes)]}]}
        test = Path(tmp) / "calibrate-test.yaml"
        test.write_text(json.dumps(doc))
        proc = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True)
    minute, answered = 0, False
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r'\s*expr: .*, ' + EVAL_TIME_RE + r'\s*$', line)
        if m:
            answered = True
            minute = int(duration_seconds(m.group(1).replace(".", "")) // 60)
            continue
        for i, value in re.findall(r'knob="(\d+)"[^}]*\} ([^\s,\]]+)', line):
            if minute < minutes:
                out[keys[int(i)]][minute] = float(value)
    if proc.returncode != 0 and not answered:
        raise RuntimeError(f"promtool failed: {(proc.stdout + proc.stderr)[-4000:]}")
    return out


def _groups(path: Path) -> list[dict]:
    from ..core.models import read_yaml

    return read_yaml(path)[0]["groups"]


def _series_name(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    return f"{name}{{{', '.join(f'{k}={chr(34)}{v}{chr(34)}' for k, v in labels)}}}"


# ---------------------------------------------------------------------------------------------- proposal
@dataclass
class Knob:
    alert: str
    knob: str
    default: float  # the value before calibration (the spec's, or the base overrides')
    proposed: float
    op: str
    what: str
    reason: str
    changed: bool = False
    refused: bool = False  # a hard-safety alert calibrate will not loosen


@dataclass
class Extreme:
    value: float
    run: str
    step: int | None
    p995: float
    count: int


def _extreme(op: str, per_run: list[tuple[Run, Values]]) -> Extreme | None:
    best: tuple[float, str, int] | None = None
    allv = []
    for run, values in per_run:
        for minute, v in enumerate(values):
            if v is None or not math.isfinite(v):
                continue
            allv.append(v)
            worse = best is None or (v > best[0] if op in (">", ">=") else v < best[0])
            if worse:
                best = (v, run.name, minute)
    if best is None:
        return None
    allv.sort()
    q = 0.995 if op in (">", ">=") else 0.005
    pos = q * (len(allv) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    p = allv[lo] + (allv[hi] - allv[lo]) * (pos - lo)
    run = next(r for r, _ in per_run if r.name == best[1])
    return Extreme(best[0], best[1], rp.step_at(run.samples, best[2]), p, len(allv))


def _round_loose(value: float, op: str) -> float:
    """Two significant digits, rounded in the loosening direction (up for a ">" knob)."""
    if value == 0:
        return 0.0
    scale = 10.0 ** (math.floor(math.log10(abs(value))) - 1)
    q = value / scale
    q = math.ceil(q - 1e-9) if op in (">", ">=") else math.floor(q + 1e-9)
    return float(fmt_knob(q * scale))


def propose_knob(spec: Spec, alert: Alert, knob: str, param: Param, ext: Extreme | None, margin: float,
                 what: str = "") -> Knob:
    up = param.op in (">", ">=")
    k = Knob(alert.alert, knob, param.value, param.value, param.op, what, "")
    if ext is None:
        k.reason = "kept: no value on these runs (not logged, or the alert's other condition never held)"
        return k
    seen = f"{'highest' if up else 'lowest'} {ext.value:.4g} ({ext.run}" + \
        (f" step {ext.step}" if ext.step is not None else "") + f"), p{99.5 if up else 0.5:g} {ext.p995:.4g}"
    need = ext.value * (1 + margin) if up else ext.value / (1 + margin)
    if ext.value <= 0 and up:
        need = ext.value + margin * abs(param.value)
    if (need <= param.value) if up else (need >= param.value):
        if (up and ext.value > 0) or (not up and param.value > 0):
            headroom = param.value / ext.value - 1 if up else ext.value / param.value - 1
            k.reason = f"kept: {seen}; the line leaves {headroom:.0%} headroom"
        else:
            k.reason = f"kept: {seen}; never near the line"
        return k
    proposal = _round_loose(need, param.op)
    if is_hard_safety(spec, alert):
        k.refused = True
        k.reason = (f"REFUSED: {seen} would need {proposal:g}, but {alert.alert} is a hard-safety alert "
                    "(NaN/Inf, hang, hardware): calibrate never loosens it; look at that run")
        return k
    if not in_range(param, proposal):
        bound = param.max if up else param.min
        k.reason = f"cannot: {seen} would need {proposal:g}, past the knob's limit {bound:g}; consider " \
                   f"`enabled: false` for {alert.alert} if it does not apply to this task"
        return k
    k.proposed = proposal
    k.changed = True
    k.reason = f"{seen}; +{margin:.0%} margin"
    return k


@dataclass
class Calibration:
    runs: list[str]
    margin: float
    knobs: list[Knob]
    base: LoadedOverrides | None = None
    fired_before: dict[str, list[rp.Firing]] = field(default_factory=dict)
    fired_after: dict[str, list[rp.Firing]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def thresholds(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for k in self.knobs:
            if k.changed:
                out.setdefault(k.alert, {})[k.knob] = k.proposed
        return out

    def overrides_doc(self) -> dict:
        """The proposed overrides file as a mapping: the base overrides (if any) with the new thresholds."""
        doc = self.base.model.model_dump(mode="json", by_alias=True, exclude_defaults=True) if self.base else {}
        doc.setdefault("version", 1)
        alerts = doc.setdefault("alerts", {})
        for alert, values in self.thresholds().items():
            alerts.setdefault(alert, {}).setdefault("thresholds", {}).update(values)
        if not alerts:
            doc.pop("alerts")
        return doc


def calibrate(paths: list[str], spec: Spec, base: LoadedOverrides | None = None, margin: float = MARGIN,
              step_seconds: float | None = None, progress=None,
              max_steps: int | None = rp.MAX_STEPS) -> tuple[Calibration, list[Run]]:
    """Replay the runs with the spec (and base overrides) and propose knobs; nothing is evaluated yet. A run
    longer than max_steps (0 or None: no limit) is calibrated on its last max_steps steps, with a warning."""
    eff = apply_overrides(spec, base) if base else spec
    runs = []
    for path in paths:
        lines, total = rp.read_run(path, max_steps=max_steps)
        warning = rp.too_long(path, lines, total)
        if warning:
            print(f"verl-exporter calibrate: warning: {warning}", file=sys.stderr)
        name = Path(path).name
        samples = rp.replay(lines, eff, run=Path(path).stem, period_s=step_seconds,
                            progress=progress(name) if progress else None)
        runs.append(Run(name, samples))
    result = Calibration([r.name for r in runs], margin, [], base)
    # the replayed series are the replay engine's (job="verl"), whatever selector the overrides give the rules
    replayed = apply_overrides(eff, {"version": 1, "global": {"selector": f'job="{rp.JOB}"'}})
    exprs = quantity_exprs(replayed)
    per_run = [(run, quantities(replayed, run, exprs)) for run in runs]
    alerts = {a.alert: a for a in eff.alerts()}
    for (name, knob), (_, words, op) in exprs.items():
        alert = alerts[name]
        ext = _extreme(op, [(run, values[(name, knob)]) for run, values in per_run])
        result.knobs.append(propose_knob(eff, alert, knob, alert.knobs()[knob], ext, margin, words))
    return result, runs


def proposal_overrides(result: Calibration) -> LoadedOverrides:
    return parse_overrides(result.overrides_doc(), "the proposal")


def evaluate_runs(spec: Spec, runs: list[Run]) -> dict[str, list[rp.Firing]]:
    """The alert starts of the spec's rules over each replayed run (promtool)."""
    from ..render.rules import render_rules

    with tempfile.TemporaryDirectory(prefix="verl-exporter-calibrate-") as tmp:
        for rel, text in render_rules(spec).items():
            (Path(tmp) / Path(rel).name).write_text(text, encoding="utf-8")
        return {run.name: rp.evaluate(run.samples, tmp) for run in runs}


def verify(result: Calibration, spec: Spec, runs: list[Run]) -> None:
    """Fill fired_before / fired_after (the base's rules, the proposal's) and the notes on what still fires."""
    before_spec = apply_overrides(spec, result.base) if result.base else spec
    after_spec = apply_overrides(spec, proposal_overrides(result))
    result.fired_before = evaluate_runs(before_spec, runs)
    result.fired_after = evaluate_runs(after_spec, runs)
    alerts = {a.alert: a for a in after_spec.alerts()}
    by_knob = {(k.alert, k.knob): k for k in result.knobs}
    for run in runs:
        for f in _first_starts(result.fired_after[run.name]):
            alert = alerts.get(f.alert)
            step = rp.step_at(run.samples, f.minute)
            if alert is not None and is_hard_safety(spec, alert):
                result.notes.append(f"{f.alert} (hard safety) fires on {run.name} at step {step}: calibrate never "
                                    "loosens or disables it; check what happened there")
                continue
            own = [k for (a, _), k in by_knob.items() if a == f.alert]
            why = "; ".join(f"{k.knob}: {k.reason}" for k in own if not k.changed) if own else \
                "calibrate has no quantity for its knobs" if alert is not None and alert.knobs() else \
                "it has no threshold knob (set its for, or enabled: false if it does not apply to this task)"
            result.notes.append(f"{f.alert} still fires on {run.name} at step {step}: {why}")


def _first_starts(fired: list[rp.Firing]) -> list[rp.Firing]:
    seen, out = set(), []
    for f in sorted(fired, key=lambda f: f.minute):
        if f.alert not in seen:
            seen.add(f.alert)
            out.append(f)
    return out


# ---------------------------------------------------------------------------------------------- output
def render_overrides(result: Calibration) -> str:
    """The proposal as an overrides file, each calibrated knob with its reason as a comment."""
    doc = result.overrides_doc()
    reasons = {(k.alert, k.knob): k for k in result.knobs if k.changed}
    head = [f"# Proposed by `verl-exporter calibrate` from {len(result.runs)} healthy run(s): "
            f"{', '.join(result.runs)}",
            f"# Each moved knob keeps those runs {result.margin:.0%} inside its line. Review it, then "
            "`verl-exporter backtest --overrides` on healthy and faulty runs, then `verl-exporter generate`.",
            f"version: {doc.get('version', 1)}"]
    body = []
    if "global" in doc:
        body.append(yaml.safe_dump({"global": doc["global"]}, sort_keys=False, default_flow_style=False).rstrip())
    alerts = doc.get("alerts", {})
    if alerts:
        body.append("alerts:")
        for name, entry in alerts.items():
            body.append(f"  {name}:")
            for key, value in entry.items():
                if key != "thresholds":
                    dumped = yaml.safe_dump({key: value}, default_flow_style=True, sort_keys=False).strip()
                    body.append(f"    {dumped[1:-1] if dumped.startswith('{') else dumped}")
                    continue
                body.append("    thresholds:")
                for knob, v in value.items():
                    k = reasons.get((name, knob))
                    note = f"  # default {k.default:g}: {k.what}, {k.reason}" if k else ""
                    body.append(f"      {knob}: {fmt_knob(v)}{note}")
    for key, value in doc.items():  # what else the base overrides set (code sets, preflight), as it was
        if key not in ("version", "global", "alerts"):
            body.append(yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=None).rstrip())
    return "\n".join(head + body) + "\n"


def report(result: Calibration, out=print) -> None:
    out(f"calibrated on {len(result.runs)} run(s): {', '.join(result.runs)} (margin {result.margin:.0%})")
    width = max((len(f"{k.alert}.{k.knob}") for k in result.knobs), default=10)
    out(f"  {'knob':<{width}}  {'default':>10}  {'proposal':>10}  why")
    order = sorted(result.knobs, key=lambda k: (not k.changed, not k.refused, k.alert))
    for k in order:
        mark = fmt_knob(k.proposed) if k.changed else "-"
        out(f"  {k.alert + '.' + k.knob:<{width}}  {fmt_knob(k.default):>10}  {mark:>10}  {k.what}: {k.reason}")
    if result.fired_before or result.fired_after:
        out("alerts on these runs (first start of each):")
        for run in result.runs:
            before = _names(result.fired_before.get(run, []))
            after = _names(result.fired_after.get(run, []))
            out(f"  {run}: before {before or 'none'}; with the proposal {after or 'none'}")
    for note in result.notes:
        out(f"  ! {note}")


def _names(fired: list[rp.Firing]) -> str:
    return ", ".join(f.alert for f in _first_starts(fired))
