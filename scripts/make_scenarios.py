#!/usr/bin/env python3
"""Write the alert pack's scenario tests (``rules/scenarios/scenarios-test.yaml``): whole verl runs replayed as
promtool input series.

Where ``rules/tests/generated-test.yaml`` checks each alert against two or three hand-made series, the
scenarios replay six hours of a realistic run, one sample a minute, the way Prometheus would scrape it. The
runs are the replay engine's (``verl_exporter.tools.replay``): a simulated verl run (a PPO run with a critic
and the KL loss, and a GRPO run) written line by line to a file that the real follower, store and detectors
read on a simulated clock, with the driver's sidecar (rank 0, ``node0:9477``) scraped every minute; the other
sidecars' GPU, host, checkpoint and ``up`` series come from ``verl_exporter.tools.nodes``. Faults are the
replay engine's (``replay.FAULTS``), injected at the first step that starts at or after ``F``.

Cases:

* ``clean PPO run`` and ``clean GRPO run``: every alert of the spec must stay silent at every check time
  (at 5m, then every 10 minutes to the end). An alert known to fire on a healthy run is left out at the
  times it fires and listed in ``KNOWN_CLEAN_FIRING`` (with the evidence) until its rule is fixed; the
  script fails when another alert fires on a clean run, under either range semantics (below).
* one case per failure the pack covers, injected into the clean PPO run: promtool evaluates the generated
  rules over the case's series (``replay.evaluate``) twice, with ranges as Prometheus 2.x selects them
  ([t-d, t]) and as 3.x does ((t-d, t], ``render.rule_tests.left_open``), for the file to pass under both.
  The checks: silent just before the fault and just before the earlier first firing, firing with its full
  labels and annotations at the first minute from the later first firing on where both semantics agree on
  them (a value whose window starts on a sample differs between them). The script fails unless each
  intended alert fires, and the semantics agree, within its bound after the fault: its ``for``, plus the
  longest window its expression reads (its threshold, for an age), plus the cadence of what it reads (a few
  steps for the training log, a validation interval, a checkpoint interval and the grace), plus
  Prometheus' 5-minute lookback and ``MARGIN`` scrapes.

The file is written byte for byte the same every time (seeded draws). Series are checked against the spec:
a name that is not a spec metric (or Prometheus's ``up``), or labels other than job, instance, the target
labels (run, rank) and the metric's own, are refused.

Usage::

    python scripts/make_scenarios.py             # (re)write rules/scenarios/scenarios-test.yaml
    python scripts/make_scenarios.py --check     # exit 1 if the committed file is not up to date
    python scripts/make_scenarios.py --discover  # every alert that fires on the clean runs, minute by minute
    python scripts/make_scenarios.py --only nan-loss  # one failure alone, series in full, to stdout
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import shutil
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "exporter"))

from verl_exporter.core.models import read_yaml  # noqa: E402
from verl_exporter.render.promql import alert_expr, all_recordings  # noqa: E402
from verl_exporter.render.rule_tests import expand, left_open  # noqa: E402
from verl_exporter.render.rules import runbook_url  # noqa: E402
from verl_exporter.render.templating import to_yaml  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.spec.kinds import Alert  # noqa: E402
from verl_exporter.spec.rules import duration_seconds  # noqa: E402
from verl_exporter.tools import nodes  # noqa: E402
from verl_exporter.tools import replay as rp  # noqa: E402

OUT = REPO / "rules" / "scenarios" / "scenarios-test.yaml"
RULE_FILES = ("verl-recording.yaml", "verl-alerts.yaml")
SEED = 20260917
END = 360  # minutes: the clean runs are sampled at minutes 0..END
F = 120  # minute from which a failure starts: 2 h in, the 1h baselines have filled (and the 2h ones mostly)
CLEAN_CHECKS = [5] + list(range(10, END + 1, 10))  # minutes at which the clean runs are checked
MARGIN = 2  # scrapes between the condition's first holding and the check (one to be scraped, one to evaluate)
LOOKBACK = 5  # minutes a series that ends stays visible to an instant selector (Prometheus' lookback)
DETECT_STEPS = 5  # steps a log-fed alert may wait: a step to be logged, the detectors' 3 held steps, a spare
STEPS = 1000  # more steps than six hours hold: the replay stops at the last scrape
# A PPO run with a critic and the KL loss (actor/kl_loss, use_kl_loss=True), the GRPO run as replay has it.
PPO = dataclasses.replace(rp.PROFILES["ppo"], kl_key="actor/kl_loss")
GRPO = rp.PROFILES["grpo"]
RUN_NAMES = {"ppo": "ppo-gsm8k", "grpo": "grpo-gsm8k"}
SPEC = load_spec()

# Alerts that fire on a realistic clean run, with the minutes (first, last) they fire at and the evidence.
# They are left out of the committed checks at those minutes, so that CI stays green until the rule is
# fixed; tests/alerts/test_scenarios.py checks every minute of the clean runs and fails when this list is no longer
# exact (a fixed rule: delete its entry; a new false alarm: fix the rule).
KNOWN_CLEAN_FIRING: dict[str, dict[str, tuple[tuple[int, int], str]]] = {
    "clean PPO run": {},
    "clean GRPO run": {},
}


def q(value) -> str:
    """A YAML scalar, always quoted, as the generator's templates write one."""
    return to_yaml(value, quoted=True)


Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]


# ---------------------------------------------------------------------------------------------- runs
@dataclass
class Run:
    series: dict[Key, list[float | None]]
    samples: rp.Samples
    onset: int  # the first scrape at or after the fault's first step starts (0 for a clean run)
    step_s: float  # the longest step of the run


@functools.cache
def fault_step(profile: rp.Profile, minute: int) -> int:
    """The first step of the clean run that starts at or after the minute."""
    ends = _ends(rp.simulate(profile, steps=STEPS, seed=SEED, every_key=True))
    return 1 + next(k for k, e in enumerate(ends, 1) if e >= minute * 60)


_REPLAYED: dict[tuple[str, int, str], rp.Samples] = {}


def replayed(lines: list[dict], ends: list[float], length: int, run: str) -> rp.Samples:
    """The driver's series, replayed once per distinct run: a fault of the nodes alone leaves the log as the
    clean run's. A copy, as the node faults edit the series."""
    key = (run, length, json.dumps(lines))
    if key not in _REPLAYED:
        _REPLAYED[key] = rp.replay_timed(list(zip(ends, lines, strict=True)), length, SPEC, run=run,
                                         instance=nodes.RANKS[0][0])
    done = _REPLAYED[key]
    return dataclasses.replace(done, series={k: list(v) for k, v in done.series.items()},
                               step_end_s=list(done.step_end_s))


def _ends(lines: list[dict]) -> list[float]:
    t, out = 0.0, []
    for d in rp.step_period(lines, spec=SPEC):
        t += d
        out.append(t)
    return out


def build_run(profile: rp.Profile, kind: str | None = None, at: int = F, length: int = END + 1) -> Run:
    """The run replayed through the real sidecar path, the node series beside it, the fault from minute `at`."""
    fault = rp.Fault(kind, fault_step(profile, at)) if kind else None
    lines = rp.simulate(profile, fault, steps=STEPS, seed=SEED, every_key=True)
    ends = _ends(lines)
    run = RUN_NAMES[profile.name]
    samples = replayed(lines, ends, length, run)
    onset = math.ceil(ends[fault.at - 2] / 60) if fault else 0
    nodes.add_node_series(samples, lines, run, fault, onset, length, SPEC, seed=str(SEED))
    kept = ends[:len(samples.step_end_s)]
    return Run(samples.series, samples, onset, max(b - a for a, b in zip([0.0] + kept, kept, strict=False)))


# ---------------------------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    slug: str
    title: str
    fault: str  # one of replay.FAULTS
    alerts: tuple[str, ...]  # the alerts the failure must raise
    at: int = F
    length: int = END + 1
    ramp: int = 0  # steps the fault itself takes to cross the alert's line (a compounding KL): added to the bound


SCENARIOS = (
    Scenario("nan-grad-norm", "the gradient norm jumps 100x for 2 steps, then is NaN (null) with the loss for 3",
             "grad_spike_nan", ("VerlGradNormSpike", "VerlNonFiniteGradNorm")),
    Scenario("nan-loss", "actor/pg_loss (and the gradient norm) are NaN for 2 steps", "nan_loss",
             ("VerlNonFiniteLoss",)),
    Scenario("critic-explained-variance-collapse", "the critic stops tracking returns: explained variance ~-0.45",
             "critic_collapse", ("VerlCriticExplainedVarianceCollapse",)),
    Scenario("validation-score-drop", "held-out accuracy falls to 55% of its level (over-optimised reward)",
             "val_drop", ("VerlValidationScoreDrop",)),
    Scenario("ppo-clip-fraction-high", "the learning rate is raised 10x: ~40% of tokens clipped, ppo_kl x100",
             "lr_high", ("VerlPPOClipFractionHigh", "VerlPPOKLSpike")),
    Scenario("critic-overfitting", "KL compounds 2% a step while the critic's loss keeps falling and the score "
             "stalls", "critic_overfit", ("VerlCriticOverfitting",), ramp=35),
    Scenario("data-loading-bottleneck", "data loading starves the rollout: gen x2.2, GPUs ~33% busy, "
             "update_actor unchanged", "data_starved", ("VerlDataLoadingBottleneck",)),
    Scenario("communication-slowdown", "NCCL falls back to a slow path: update_actor x2.5, GPUs stay busy",
             "comm_slowdown", ("VerlCommunicationSlowdown",)),
    Scenario("gpu-lost", "rank 1's GPU falls off the bus (XID 79): NVML loses it, the run hangs", "gpu_lost",
             ("VerlGPULost", "VerlGPUXidCritical")),
    Scenario("critical-xid", "XID 94 (contained ECC error) on rank 2's GPU; the process on it dies and the run "
             "hangs", "critical_xid", ("VerlGPUXidCritical",)),
    Scenario("non-critical-xid", "XID 13 (graphics engine exception) twice on rank 0's GPU; the run goes on",
             "gpu_xid", ("VerlGPUXid",)),
    Scenario("thermal-throttling", "rank 3's GPU is held down by hw_thermal_slowdown (a failed fan)", "thermal",
             ("VerlGPUThermalThrottling",)),
    Scenario("straggler-rank", "rank 2's GPU runs at ~55% (a noisy neighbour on node1)", "straggler",
             ("VerlStragglerRank",)),
    Scenario("gpu-idle-while-training", "rank 1's GPU is left out of the placement: ~3% busy while the run steps",
             "gpu_idle", ("VerlGPUIdleWhileTraining",)),
    Scenario("uncorrectable-ecc", "two uncorrectable ECC errors on rank 1's GPU; a row remap then waits for a "
             "reset", "ecc", ("VerlGPUUncorrectableECC", "VerlGPURowRemapPending")),
    Scenario("row-remap-failed", "rank 2's GPU runs out of spare rows", "remap_failed", ("VerlGPURowRemapFailed",)),
    Scenario("nvlink-down", "NVLink 2 of rank 0's GPU logs replays for 5 minutes, then goes down", "nvlink",
             ("VerlNVLinkDown", "VerlNVLinkErrors")),
    Scenario("gpu-memory-near-full", "a colocated process fills rank 2's GPU to ~98.5%", "gpu_memory_full",
             ("VerlGPUMemoryNearFull",)),
    Scenario("gpu-memory-oom-forecast", "rank 3's rollout server leaks 0.12 GiB of GPU memory a minute",
             "gpu_memory_leak", ("VerlGPUMemoryOOMForecast",)),
    Scenario("mfu-drop", "the GPUs' power limit is lowered: clocks held by sw_power_cap, update_actor x1.7, "
             "MFU falls", "power_cap", ("VerlMFUDrop", "VerlGPUPowerCapped")),
    Scenario("disk-filling-up", "another job writes 60 GB a minute to node1's /ckpt", "disk_fill",
             ("VerlCheckpointDiskFillingUp",)),
    Scenario("disk-saturated", "node0's NVMe is saturated by a dataset copy", "disk_busy", ("VerlDiskSaturated",)),
    # the last good save is before the fault: six hours after it, and a margin
    Scenario("checkpoint-stale", "every save from 60m fails silently: the latest checkpoint ages past 6 hours",
             "checkpoint_skip", ("VerlCheckpointStale",), at=60, length=60 + 6 * 60 + 10),
    Scenario("checkpoint-incomplete", "the first save after the fault is interrupted and leaves a partial "
             "global_step folder", "checkpoint_partial", ("VerlCheckpointIncomplete",)),
    Scenario("checkpoint-corrupt", "the first checkpoint saved after the fault does not match its manifest",
             "checkpoint_corrupt", ("VerlCheckpointCorrupt",)),
    Scenario("exporter-down", "the sidecar of rank 3 (node1:9478) dies: its scrapes fail", "exporter_down",
             ("VerlExporterDown",)),
    Scenario("exporter-absent", "every target of the job vanishes (service discovery lost them)",
             "exporter_absent", ("VerlExporterAbsent",)),
)


def scenarios() -> tuple[Scenario, ...]:
    return SCENARIOS


def reads(spec, alerts: list[str]) -> set[str]:
    """The metric and recording names the alerts' expressions read, recordings followed to their inputs."""
    recordings = {r.record: r.expr for r in all_recordings(spec)}
    by_name = {a.alert: a for a in spec.alerts()}
    exprs = [alert_expr(by_name[a], spec.rules.selector) for a in alerts]
    names: set[str] = set()
    while exprs:
        expr = exprs.pop()
        for name in re.findall(r"\b([a-zA-Z_][a-zA-Z0-9_:]*)\s*[{\[]", expr):
            if name in recordings and name not in names:
                exprs.append(recordings[name])
            names.add(name)
    return names


def horizon_minutes(spec, alert: Alert) -> int:
    """How long the expression may take to see a change: its longest range that ends now (the window that
    must fill with or drain of the faulty samples; one shifted by an offset is a baseline it remembers),
    recordings followed, or the age its kind waits for (a `stale` alert: its threshold)."""
    recordings = {r.record: r.expr for r in all_recordings(spec)}
    texts = [alert_expr(alert, spec.rules.selector)] + [recordings[n] for n in reads(spec, [alert.alert])
                                                          if n in recordings]
    ranges = [duration_seconds(m) for text in texts for m in re.findall(r"\[(\w+)(?::\w*)?\](?!\s*offset)", text)]
    return math.ceil(max([*ranges, alert.wait_seconds()], default=0) / 60)


def cadence_steps(spec, alert: Alert) -> tuple[int, float]:
    """(steps, seconds) that what the alert reads may take to change after a fault: a checkpoint interval and
    the grace for the checkpoint collector, a validation interval for validation scores, DETECT_STEPS for the
    rest of the training log; the node collectors change with the next scrape."""
    steps, extra = 0, 0.0
    for name in reads(spec, [alert.alert]):
        if name not in spec:
            continue
        m = spec[name]
        if m.events:  # the arrivals of another metric's series change as often as it does
            m = spec[m.events.of]
        if m.collector == "checkpoint":
            steps, extra = max(steps, rp.SAVE_EVERY), nodes.CHECKPOINT_GRACE_S
        elif any(s.pattern.startswith("val-") for s in m.source):
            steps = max(steps, rp.VAL_EVERY)
        elif m.source or m.field or m.instrumented_by:
            steps = max(steps, DETECT_STEPS)
    return steps, extra


def bound_minutes(spec, alert: Alert, step_s: float) -> int:
    """The latest the alert may start firing after the fault, from its declaration and the run's sampling."""
    steps, extra = cadence_steps(spec, alert)
    return (duration_seconds(alert.for_) // 60 + horizon_minutes(spec, alert)
            + math.ceil((steps * step_s + extra) / 60) + LOOKBACK + MARGIN)


@dataclass
class Check:
    minute: int
    alert: str
    expected: list[tuple[dict[str, str], dict[str, str]]]  # (labels, annotations)
    comment: str = ""


def annotations(spec, alert: Alert, labels: dict[str, str], value: float) -> dict[str, str]:
    out = {name: expand(text, value, labels) for name, text in (("summary", alert.summary),
                                                                 ("description", alert.description))}
    out["runbook_url"] = runbook_url(spec, alert)
    return out


# How a range selects its samples: [t-d, t] as the rules are generated (Prometheus 2.x), (t-d, t] as 3.x does
# (emulated on a 2.x promtool by render.rule_tests.left_open). A check must hold under both.
SEMANTICS = {"2.x": lambda expr: expr, "3.x": left_open}


def evaluate(samples: rp.Samples, alerts, ranges, minutes_firing: dict[str, int] | None = None) -> list[rp.Firing]:
    """replay.evaluate over the generated rules, every expression rewritten by `ranges`, every minute each
    alert fires: every recording, and of the alerting rules those named (each is evaluated on its own, so the
    others change nothing but promtool's time, ten times over)."""
    with tempfile.TemporaryDirectory(prefix="scenario-rules-") as tmp:
        for name in RULE_FILES:
            doc = read_yaml(REPO / "rules" / name)[0]
            for group in doc["groups"]:
                group["rules"] = [{**r, "expr": ranges(r["expr"])} for r in group["rules"]
                                  if "record" in r or r["alert"] in alerts]
            (Path(tmp) / name).write_text(json.dumps(doc), encoding="utf-8")
        return rp.evaluate(samples, tmp, minutes_firing=minutes_firing, every_minute=True)


def failure_checks(spec, sc: Scenario, run: Run) -> list[Check]:
    """Each intended alert as promtool evaluates it over the case's series under both range semantics: silent
    before the earlier first firing, and firing at the first minute from the later one on at which both agree
    on its labels and annotations (a value read at a window's edge differs between them), within its bound."""
    alerts = {a.alert: a for a in spec.alerts()}
    ramp = math.ceil(sc.ramp * run.step_s / 60)
    bounds = {name: bound_minutes(spec, alerts[name], run.step_s) + ramp for name in sc.alerts}
    end = run.onset + max(bounds.values()) + 1  # what comes later decides nothing: evaluate no further
    samples = dataclasses.replace(run.samples, series={k: v[:end] for k, v in run.series.items()})
    fired = {sem: evaluate(samples, sc.alerts, ranges) for sem, ranges in SEMANTICS.items()}
    checks = []
    for name in sc.alerts:
        alert, bound = alerts[name], bounds[name]
        # {semantics: {minute: the alerts it expects then, as labels and annotations}}
        expected: dict[str, dict[int, list]] = {}
        for sem, firings in fired.items():
            mine = [f for f in firings if f.alert == name]
            if not mine:
                raise SystemExit(f"scenario {sc.slug}: {name} never fires ({sem} ranges)")
            if min(f.minute for f in mine) < run.onset:
                raise SystemExit(f"scenario {sc.slug}: {name} fires at {min(f.minute for f in mine)}m, before the "
                                 f"fault at {run.onset}m ({sem} ranges)")
            by_minute = expected[sem] = {}
            for f in sorted(mine, key=lambda f: (f.minute, f.labels)):
                labels = {k: v for k, v in f.labels if k != "__name__"}  # the name of evaluate's recording
                by_minute.setdefault(f.minute, []).append(({**labels, **alert.labels, "severity": alert.severity},
                                                           annotations(spec, alert, labels, f.value)))
        firsts = {sem: min(by_minute) for sem, by_minute in expected.items()}
        first = min(firsts.values())
        agreed = agreed_minute(expected, run.onset + bound)
        if agreed is None:
            raise SystemExit(f"scenario {sc.slug}: {name} fires from " + ", ".join(f"{m}m ({sem})" for sem, m in
                                                                  firsts.items())
                             + f", but 2.x and 3.x ranges agree on its labels and annotations at no minute by "
                             f"{run.onset + bound}m ({bound}m after the fault at {run.onset}m)")
        checks.append(Check(run.onset - 1, name, [], "silent just before the fault"))
        if first - 1 > run.onset - 1:
            checks.append(Check(first - 1, name, [], "silent just before it fires"))
        fires = (f"{first - run.onset}m later" if len(set(firsts.values())) == 1 else
                 ", ".join(f"{m - run.onset}m later ({sem})" for sem, m in firsts.items()))
        checks.append(Check(agreed, name, expected["2.x"][agreed],
                            f"{name}: fault at {run.onset}m, fires {fires} (bound: {bound}m)"))
    return checks


def agreed_minute(expected: dict[str, dict[int, list]], until: int) -> int | None:
    """The first minute from the latest first firing on, by `until`, at which every semantics expects the same
    alerts ({semantics: {minute: [(labels, annotations)]}}); None when there is none."""
    views = list(expected.values())
    start = max(min(by_minute) for by_minute in views)
    return next((m for m in range(start, until + 1) if m in views[0] and all(v.get(m) == views[0][m] for v in views)),
                None)


def keep(spec, run: Run, alerts: list[str]) -> Run:
    """Only the series the alerts read (and the recordings they use): promtool then evaluates every rule over
    a handful of series, not the whole run, which makes the file far faster to test and smaller."""
    names = reads(spec, alerts)
    series = {k: v for k, v in run.series.items() if k[0] in names}
    samples = dataclasses.replace(run.samples, series=series)
    return dataclasses.replace(run, series=series, samples=samples)


def check_names(run: Run, spec) -> None:
    """Every series is a spec metric (or Prometheus's up) with exactly the labels it would be scraped with:
    job and instance, the sidecar's target labels, and the metric's own."""
    problems = []
    for name, labels in run.series:
        have = {n for n, _ in labels}
        if name == "up":
            want = {"job", "instance"}
        elif name in spec:
            want = {"job", "instance", *spec.target_labels, *spec[name].labels}
        else:
            problems.append(f"{name} is not in the spec")
            continue
        if have != want:
            problems.append(f"{name} has labels {sorted(have)}, the spec says {sorted(want)}")
    if problems:
        raise SystemExit("series that do not match the spec: " + "; ".join(sorted(set(problems))))


# ---------------------------------------------------------------------------------------------- rendering
def selector_text(k: Key) -> str:
    name, labels = k
    return name + "{" + ", ".join(f'{n}="{v}"' for n, v in labels) + "}"


def anchor_of(prefix: str, k: Key) -> str:
    """A readable, unique YAML anchor: the name without verl_, then the label values (rank stands for the
    instance). go-yaml allows only letters, digits, '_' and '-' in anchors."""
    name, labels = k
    d = dict(labels)
    skip = {"job", "run"} | ({"instance"} if "rank" in d else set())
    parts = [name.removeprefix("verl_")] + [v for n, v in labels if n not in skip]
    return prefix + "-" + "-".join(re.sub(r"[^A-Za-z0-9_]", "_", p) for p in parts)


def fmt_minutes(m: int) -> str:
    return f"{m}m"


def known_firing(case: str, alert: str, minute: int) -> bool:
    (first, last), _ = KNOWN_CLEAN_FIRING.get(case, {}).get(alert, ((-1, -2), ""))
    return first <= minute <= last


def clean_checks(spec, case: str, minutes: list[int]) -> list[Check]:
    return [Check(minute, alert.alert, []) for minute in minutes for alert in spec.alerts()
            if not known_firing(case, alert.alert, minute)]


def render_group(lines: list[str], name: str, run: Run, checks: list[Check], anchors: dict[Key, tuple],
                 prefix: str | None) -> None:
    lines.append(f"  - name: {q(name)}")
    lines.append("    interval: 1m")
    lines.append("    input_series:")
    for k, values in run.series.items():
        text = rp.series_text(values)
        shared = anchors.get(k)
        if shared is not None and shared[0] == text:
            lines.append(f"      - *{shared[1]}")
            continue
        if prefix is not None:
            anchor = anchor_of(prefix, k)
            if any(a[1] == anchor for a in anchors.values()):
                raise SystemExit(f"duplicate anchor {anchor}")
            anchors[k] = (text, anchor)
            lines.append(f"      - &{anchor}")
            lines.append(f"        series: {q(selector_text(k))}")
        else:
            lines.append(f"      - series: {q(selector_text(k))}")
        lines.append(f"        values: {q(text)}")
    lines.append("    alert_rule_test:")
    for c in sorted(checks, key=lambda c: (c.minute, c.alert)):
        if not c.expected:
            if c.comment:
                lines.append(f"      # {c.alert}: {c.comment}")
            lines.append(f"      - {{eval_time: {fmt_minutes(c.minute)}, alertname: {c.alert}, exp_alerts: []}}")
            continue
        lines.append(f"      # {c.comment}")
        lines.append(f"      - eval_time: {fmt_minutes(c.minute)}")
        lines.append(f"        alertname: {c.alert}")
        lines.append("        exp_alerts:")
        for labels, ann in c.expected:
            lines.append("          - exp_labels:")
            lines.extend(f"              {k}: {q(v)}" for k, v in labels.items())
            lines.append("            exp_annotations:")
            lines.extend(f"              {k}: {q(v)}" for k, v in ann.items())


HEADER = """\
# Generated by scripts/make_scenarios.py: do not edit, change the script and run it again.
# Whole verl runs replayed as scraped series (one sample a minute): two clean runs on which no alert may
# fire, then one failure after another injected into the clean PPO run. Series a failure leaves unchanged
# are YAML aliases of the clean PPO run's. Run: promtool test rules rules/scenarios/scenarios-test.yaml
"""
CLEAN_CASES = ((PPO, "clean PPO run"), (GRPO, "clean GRPO run"))


def header_lines(rule_dir: str) -> list[str]:
    lines = HEADER.rstrip("\n").split("\n")
    for case, known in KNOWN_CLEAN_FIRING.items():
        for alert, ((first, last), evidence) in known.items():
            text = (f"KNOWN FALSE ALARM: {alert} fires on the {case} at {first}-{last}m and is not checked there "
                    f"until its rule is fixed. {evidence}")
            lines.extend("# " + line for line in textwrap.wrap(text, 110, subsequent_indent="  "))
    lines.append("rule_files:")
    lines.extend(f"  - {q(rule_dir + '/' + f)}" for f in RULE_FILES)
    lines.append("evaluation_interval: 1m")
    # the groups in the order replay.evaluate runs them (recordings first, as written): the checks are at the
    # first firing minute, which a random order could shift by one
    lines.append("group_eval_order:")
    lines.extend(f"  - {q(g['name'])}" for f in RULE_FILES for g in read_yaml(REPO / "rules" / f)[0]["groups"])
    lines.append("tests:")
    return lines


def render(rule_dir: str = "..", only: str | None = None) -> str:
    """The scenario file; or with only="clean" the clean runs alone, with only=<slug> one failure alone (its
    series written out in full)."""
    spec = load_spec()
    lines = header_lines(rule_dir)
    anchors: dict[Key, tuple] = {}
    cleans = CLEAN_CASES if only in (None, "clean") else ()
    cases = [sc for sc in SCENARIOS if only in (None, sc.slug)]
    with ThreadPoolExecutor(2) as pool:  # promtool runs in a process of its own
        clean_runs = list(pool.map(lambda pc: clean_case(spec, *pc), cleans))
        results = list(pool.map(lambda sc: failure_case(spec, sc), cases))
    for (profile, case), run in zip(cleans, clean_runs, strict=True):
        render_group(lines, f"{case}: every alert silent at {CLEAN_CHECKS[0]}m and every 10m to {END}m", run,
                     clean_checks(spec, case, CLEAN_CHECKS), anchors, profile.name)
    for sc, (run, checks) in zip(cases, results, strict=True):
        fires = ", ".join(f"{c.alert} at {c.minute}m" for c in checks if c.expected)
        render_group(lines, f"{sc.slug}: {sc.title}. Fault at {run.onset}m; {fires}", run, checks, anchors, None)
    return "\n".join(lines) + "\n"


def clean_case(spec, profile: rp.Profile, case: str) -> Run:
    """The clean run, refused unless what fires on it is KNOWN_CLEAN_FIRING under both range semantics."""
    run = keep(spec, build_run(profile), [a.alert for a in spec.alerts()])
    check_names(run, spec)
    wrong = [f"{line} ({sem} ranges)" for sem, ranges in SEMANTICS.items()
             for line in known_differences(case, clean_firings(run, ranges))]
    if wrong:
        raise SystemExit(f"{case}: " + "; ".join(wrong) + " (run --discover)")
    return run


def failure_case(spec, sc: Scenario) -> tuple[Run, list[Check]]:
    run = keep(spec, build_run(PPO, sc.fault, sc.at, sc.length), list(sc.alerts))
    check_names(run, spec)
    return run, failure_checks(spec, sc, run)


# ---------------------------------------------------------------------------------------------- discovery
def clean_firings(run: Run, ranges) -> dict[str, tuple[int, int]]:
    """{alert: (the minute it first fires, the minutes it fires)} on a clean run, as promtool evaluates the
    generated rules with `ranges` over it (replay.evaluate), every minute."""
    minutes: dict[str, int] = {}
    fired = evaluate(run.samples, [a.alert for a in SPEC.alerts()], ranges, minutes)
    return {a: (min(f.minute for f in fired if f.alert == a), minutes[a]) for a in sorted({f.alert for f in fired})}


def known_differences(case: str, fired: dict[str, tuple[int, int]]) -> list[str]:
    """How what fires on a clean run differs from KNOWN_CLEAN_FIRING (an entry's alert must start at its first
    minute and fire through its last): a new false alarm, or a fixed one still listed."""
    known = KNOWN_CLEAN_FIRING.get(case, {})
    out = [f"{a} fires from {first}m, {n} minutes (fix the rule)" for a, (first, n) in fired.items()
           if a not in known]
    for alert, ((first, last), _) in known.items():
        if fired.get(alert) != (first, last - first + 1):
            out.append(f"{alert} is listed as firing at {first}-{last}m but fires "
                       + (f"from {fired[alert][0]}m, {fired[alert][1]} minutes" if alert in fired else "no more"))
    return out


def discover() -> int:
    """Print which alerts fire on the clean runs, and when; exit 1 unless that is KNOWN_CLEAN_FIRING."""
    if shutil.which("promtool") is None:
        print("promtool is not installed", file=sys.stderr)
        return 2
    spec, wrong = load_spec(), False
    for profile, case in CLEAN_CASES:
        run = keep(spec, build_run(profile), [a.alert for a in spec.alerts()])
        for sem, ranges in SEMANTICS.items():
            fired = clean_firings(run, ranges)
            for alert, (first, n) in fired.items():
                print(f"{case} ({sem} ranges): {alert} fires from {first}m, {n} minutes")
            if not fired:
                print(f"{case} ({sem} ranges): no alert fires (checked every minute, 0-{END}m)")
            for line in known_differences(case, fired):
                print(f"{case} ({sem} ranges): {line}: this differs from KNOWN_CLEAN_FIRING", file=sys.stderr)
                wrong = True
    return 1 if wrong else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is not up to date")
    parser.add_argument("--discover", action="store_true", help="list the alerts that fire on the clean runs")
    parser.add_argument("--only", help="write only the clean runs (clean) or one scenario (its slug), to stdout")
    args = parser.parse_args(argv)
    if args.discover:
        return discover()
    if args.only:
        sys.stdout.write(render(only=args.only))
        return 0
    text = render()
    rel = OUT.relative_to(REPO)
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else None
        if current != text:
            print(f"{rel} is out of date: run scripts/make_scenarios.py", file=sys.stderr)
            return 1
        print(f"{rel} is up to date ({len(text.encode())} bytes)")
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {rel} ({len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
