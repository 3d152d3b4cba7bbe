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

import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..spec import Spec
from ..spec.kinds import Alert
from ..spec.overrides import LoadedOverrides, apply_overrides, is_hard_safety, parse_overrides
from ..spec.rules import Param, fmt_knob, in_range
from . import replay as rp

MARGIN = 0.2

# ---------------------------------------------------------------------------------------------- quantities
Values = list[float | None]  # one value per scraped minute (None: no sample)


@dataclass
class Run:
    name: str
    samples: rp.Samples

    def series(self, name: str, **labels: str) -> list[Values]:
        """Every series of a metric whose labels include these, padded to the run's length."""
        n = self.samples.length
        out = []
        for (metric, lab), values in self.samples.series.items():
            if metric == name and labels.items() <= dict(lab).items():
                out.append(list(values) + [None] * (n - len(values)))
        return out

    def one(self, name: str, **labels: str) -> Values:
        found = self.series(name, **labels)
        return found[0] if found else [None] * self.samples.length

    def det(self, stat: str, signal: str) -> Values:
        return self.one(f"verl_detector_{stat}", signal=signal)


def _where(cond: Values, *values: Values, fn: Callable[..., float | None]) -> Values:
    out: Values = []
    for i, ok in enumerate(cond):
        args = [v[i] for v in values]
        out.append(fn(*args) if ok and all(a is not None for a in args) else None)
    return out


def _zip(fn: Callable[..., float | None], *values: Values) -> Values:
    return [fn(*args) if all(a is not None for a in args) else None for args in zip(*values, strict=True)]


def _gt(values: Values, line: float) -> list[bool]:
    return [v is not None and v > line for v in values]


def _lt(values: Values, line: float) -> list[bool]:
    return [v is not None and v < line for v in values]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _detector(run: Run, signal: str, direction: str, k: float, change: float) -> tuple[Values, Values]:
    """(the sustained z-score where the change gate passes, the relative change beyond the trend where the
    z-score passes), both signed so that larger means more deviating."""
    zs: list[Values] = []
    rels: list[Values] = []
    for d in (("down", "up") if direction == "both" else (direction,)):
        z = run.det("sustained_drop_zscore" if d == "down" else "sustained_rise_zscore", signal)
        rel = run.det("relative_change", signal)
        signed = [None if r is None else (-r if d == "down" else r) for r in rel]
        gate = _gt(signed, change) if change else [True] * len(z)
        zs.append(_where(gate, z, fn=lambda x: x))
        rels.append(_where(_gt(z, k), signed, fn=lambda x: x))
    return ([_max(*xs) for xs in zip(*zs, strict=True)], [_max(*xs) for xs in zip(*rels, strict=True)])


def _max(*xs: float | None) -> float | None:
    return max((x for x in xs if x is not None), default=None)


def _detector_knobs(run: Run, alert: Alert, values: dict[str, float]) -> dict[str, Values]:
    """k of a detector alert: its sustained z-score where its change gate and a confirming signal also pass."""
    z, _ = _detector(run, alert.signal, alert.direction, alert.k, alert.change)
    if alert.confirm:
        confirmed = [False] * len(z)
        for c in alert.confirm:
            cz, _ = _detector(run, c.signal, c.direction, c.k, c.change)
            confirmed = [a or (b is not None and b > c.k) for a, b in zip(confirmed, cz, strict=True)]
        z = _where(confirmed, z, fn=lambda x: x)
    return {"k": z}


def _threshold(run: Run, spec: Spec, alert: Alert) -> dict[str, Values]:
    if alert.aggregate or alert.metric not in spec:
        return {}
    from ..spec.rules import equality_matchers

    found = run.series(alert.metric, **equality_matchers(alert.matchers))
    if not found:
        return {}
    pick = max if alert.op in (">", ">=") else min
    return {"threshold": [pick((s[i] for s in found if s[i] is not None), default=None)
                          for i in range(len(found[0]))]}


def _entropy_blowup(run: Run, v: dict[str, float]) -> dict[str, Values]:
    z, _ = _detector(run, "entropy", "up", v["k"], v["change"])
    return {"ratio": _zip(_ratio, run.det("level", "entropy"), run.det("floor_level", "entropy")), "k": z}


def _kl(run: Run, v: dict[str, float]) -> dict[str, Values]:
    return {"kl_loss": run.det("held_min", "kl_loss"), "kl_penalty": run.det("held_min", "kl_penalty")}


def _kl_drift(run: Run, v: dict[str, float]) -> dict[str, Values]:
    a, _ = _detector(run, "kl_loss", "up", v["k"], v["change"])
    b, _ = _detector(run, "kl_penalty", "up", v["k"], v["change"])
    return {"k": [_max(*xs) for xs in zip(a, b, strict=True)]}


def _reward_decline(run: Run, v: dict[str, float]) -> dict[str, Values]:
    peak, level, spread = run.det("peak_level", "score"), run.det("level", "score"), run.det("spread", "score")
    drop = _zip(lambda p, lv: p - lv, peak, level)
    share_ok = [d is not None and p is not None and d > v["share"] * abs(p) + 0.05 for d, p in zip(drop, peak,
                                                                                                  strict=True)]
    return {"spreads": _where(share_ok, drop, spread, fn=_ratio)}


def _memory_leak(run: Run, v: dict[str, float]) -> dict[str, Values]:
    out: Values = [None] * run.samples.length
    for sig in ("memory_reserved", "memory_allocated"):
        above = _zip(lambda lv, f: lv - f, run.det("level", sig), run.det("floor_level", sig))
        rate = _where(_gt(above, v["above_lowest"]), run.det("slope_per_second", sig), fn=lambda s: s * 3600)
        out = [_max(*xs) for xs in zip(out, rate, strict=True)]
    return {"growth_per_hour": out}


def _answers_collapsed(run: Run, v: dict[str, float]) -> dict[str, Values]:
    length = run.one("verl_response_length_tokens", stat="mean", subset="all")
    entropy = run.one("verl_actor_entropy")
    low_score = _zip(lambda m, lo: 1.0 if m <= lo else None, run.one("verl_critic_score", stat="mean"),
                     run.one("verl_critic_score", stat="min"))
    gate = [(e is not None and e < v["entropy"]) or s is not None for e, s in zip(entropy, low_score, strict=True)]
    return {"tokens": _where(gate, length, fn=lambda x: x)}


def _numerical_collapse(run: Run, v: dict[str, float]) -> dict[str, Values]:
    rel = run.det("relative_change", "response_length")
    return {"aborted": _where(_lt(rel, -v["length_drop"]), run.det("held_min", "aborted"), fn=lambda x: x)}


# What each expr alert's knobs are compared with (detector, threshold and adaptive kinds are generic). A knob
# not listed (a change gate, an AND-ed second line) keeps its value: calibrate moves the first line only.
EXPR_QUANTITIES: dict[str, Callable[[Run, dict[str, float]], dict[str, Values]]] = {
    "VerlEntropyBlowUp": _entropy_blowup,
    "VerlHighKLDivergence": _kl,
    "VerlKLDivergenceVeryHigh": _kl,
    "VerlKLDrift": _kl_drift,
    "VerlGradNormSpike": lambda run, v: {"ratio": run.det("spike_ratio", "grad_norm")},
    "VerlGradNormGrowing": lambda run, v: {"ratio": _zip(_ratio, run.det("level", "grad_norm"),
                                                         run.det("floor_level", "grad_norm"))},
    "VerlRewardDecline": _reward_decline,
    "VerlResponseClipRatioHigh": lambda run, v: {"clip_ratio": run.det("held_min", "clip_ratio")},
    "VerlEmptyResponses": lambda run, v: {"aborted": run.det("held_min", "aborted")},
    "VerlMemoryLeak": _memory_leak,
    "VerlAnswersCollapsed": _answers_collapsed,
    "VerlNumericalCollapse": _numerical_collapse,
}
# What the quantity is, for the report.
WHAT = {
    ("VerlEntropyBlowUp", "ratio"): "entropy level / its lowest level",
    ("VerlEntropyBlowUp", "k"): "entropy sustained rise (spreads) past the change gate",
    ("VerlHighKLDivergence", "kl_loss"): "KL loss held 3 steps", ("VerlHighKLDivergence", "kl_penalty"):
        "in-reward KL held 3 steps", ("VerlKLDivergenceVeryHigh", "kl_loss"): "KL loss held 3 steps",
    ("VerlKLDivergenceVeryHigh", "kl_penalty"): "in-reward KL held 3 steps",
    ("VerlKLDrift", "k"): "KL sustained rise (spreads) past the change gate",
    ("VerlGradNormSpike", "ratio"): "grad norm / its window's largest", ("VerlGradNormGrowing", "ratio"):
        "grad-norm level / its lowest level", ("VerlRewardDecline", "spreads"): "score fall from its best (spreads)",
    ("VerlResponseClipRatioHigh", "clip_ratio"): "clip ratio of a step", ("VerlEmptyResponses", "aborted"):
        "empty-response ratio held 2 steps", ("VerlMemoryLeak", "growth_per_hour"): "peak memory growth, bytes/h",
    ("VerlAnswersCollapsed", "tokens"): "mean answer length (with entropy gone or score at its minimum)",
    ("VerlNumericalCollapse", "aborted"): "empty-response ratio while lengths fall",
}


def quantities(spec: Spec, alert: Alert, run: Run) -> dict[str, Values]:
    """{knob: the value it is compared with, each scraped minute} for the knobs calibrate reads."""
    values = {name: p.value for name, p in alert.knobs().items()}
    if alert.kind == "detector":
        return _detector_knobs(run, alert, values)
    if alert.kind == "threshold":
        return _threshold(run, spec, alert)
    fn = EXPR_QUANTITIES.get(alert.alert) if alert.kind == "expr" else None
    return fn(run, values) if fn else {}


def describe(alert: Alert, knob: str) -> str:
    if (alert.alert, knob) in WHAT:
        return WHAT[(alert.alert, knob)]
    if alert.kind == "detector":
        return f"{alert.signal} sustained {'drop' if alert.direction == 'down' else 'rise'} (spreads)" + \
            (" past the change gate" if alert.change else "") + (" with a confirming signal" if alert.confirm else "")
    return f"{alert.metric} ({alert.op} line)"


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


def propose_knob(spec: Spec, alert: Alert, knob: str, param: Param, ext: Extreme | None, margin: float) -> Knob:
    what = describe(alert, knob)
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
        doc = self.base.model.model_dump(by_alias=True, exclude_defaults=True) if self.base else {}
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
    for alert in eff.alerts():
        own = alert.knobs()
        per_knob: dict[str, list[tuple[Run, Values]]] = {}
        for run in runs:
            for knob, values in quantities(eff, alert, run).items():
                per_knob.setdefault(knob, []).append((run, values))
        for knob, per_run in per_knob.items():
            result.knobs.append(propose_knob(eff, alert, knob, own[knob], _extreme(own[knob].op, per_run), margin))
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
