"""One meaning of "hung": the stall alerts' knobs (factor, at_least, before_baseline: spec/kinds/stall.py), set
in the overrides file, move the rule Prometheus evaluates, its promtool test, the in-process breaker, the
sidecar's forensics trigger and /healthz together. A run whose steps take 20 s, which the defaults cannot page
before 10 minutes, is paged within 2 minutes by an overrides file alone (the real promtool on the generated
rules, and the breaker). The deprecated --hang-factor / --hang-min-seconds set the same knobs."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, require_tool
from verl_exporter.cli import build_parser
from verl_exporter.render.rules import render_rules
from verl_exporter.sidecar.collectors import REGISTRY
from verl_exporter.sidecar.config import build_config, flag_values
from verl_exporter.sidecar.sidecar import Sidecar
from verl_exporter.spec import load_spec
from verl_exporter.spec.kinds.promtool import expand
from verl_exporter.spec.overrides import OverridesError, apply_overrides, load_overrides
from verl_exporter.spec.rules import duration_seconds
from verl_exporter.trainer.breaker import CircuitBreaker

SPEC = load_spec()
STEP_S = 20.0
PAGE_WITHIN_S = 120.0
EVAL_S = 30  # the pack's evaluation_interval
# The overrides a team whose steps take 20 s writes (docs/tuning-and-calibrate.md): a stall is 2.5 times the
# longest recent step, at least 45 s; 5 minutes before the step time has a baseline (10 steps).
FAST = """alerts:
  VerlTrainingStalled:
    thresholds: {factor: 2.5, at_least: 45, before_baseline: 300}
"""
LABELS = {"job": "verl", "instance": "node0:9477", "run": "r1", "rank": "0"}
NO_COLLECTORS = {name: False for name in REGISTRY}


def write(tmp_path: Path, text: str, name: str = "verl-exporter.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def alert(spec, name: str):
    return next(a for a in spec.alerts() if a.alert == name)


def sidecar(**settings) -> Sidecar:
    return Sidecar(build_config({}, {"listen": "127.0.0.1:0", "collectors": NO_COLLECTORS, **settings}))


def step_times(n: int) -> list[float]:
    """A 20-s run's step times: 18 to 22 s (the longest recent one is 22 s)."""
    return [STEP_S + (2.0 if i % 5 == 0 else -2.0 if i % 5 == 2 else 0.0) for i in range(1, n + 1)]


def feed(steps: list[float], *logs) -> float:
    """Log the steps (each with its timing_s/step, at the time it ends) into every log(step, data, at); returns
    the last step's time."""
    at = 1000.0
    for i, seconds in enumerate(steps, start=1):
        at += seconds
        for log in logs:
            log(i, {"timing_s/step": seconds}, at)
    return at


def first_true(predicate, start: float, end: float) -> float | None:
    """The first whole second in [start, end] at which predicate(t) holds."""
    return next((float(t) for t in range(int(start), int(end) + 1) if predicate(float(t))), None)


# ---------------------------------------------------------------------------------------------- one declaration
def test_one_overrides_file_moves_the_rule_the_breaker_healthz_and_the_forensics_trigger(tmp_path, monkeypatch):
    path = write(tmp_path, FAST)
    eff = apply_overrides(SPEC, load_overrides(path))
    stalled = alert(eff, "VerlTrainingStalled")
    assert stalled.knob_values() == {"factor": 2.5, "at_least": 45, "before_baseline": 300}
    assert alert(eff, "VerlTrainingStalledRelative").knob_values() == \
        alert(SPEC, "VerlTrainingStalledRelative").knob_values()

    # the rule Prometheus evaluates and its texts
    rules = render_rules(eff)["rules/verl-alerts.yaml"]
    assert ('(time() - verl_training_last_step_timestamp_seconds{job="verl"} > 300 unless on (job, instance, run, '
            'rank) verl_detector_window_max{signal="step_time", job="verl"}) or (time() - '
            'verl_training_last_step_timestamp_seconds{job="verl"} > on (job, instance, run, rank) '
            'clamp_min(2.5 * verl_detector_window_max{signal="step_time", job="verl"}, 45))') in rules
    assert stalled.summary == ("No new training step for over 2.5 times the run's longest recent step (5 minutes "
                               "until it has 10 steps).")
    assert "(at least 45 s; 300 s before it has 10 steps)" in stalled.description

    # the sidecar reading that file: /healthz (--healthz-hang) and the forensics trigger on its store
    side = sidecar(overrides=str(path), healthz_hang=True, forensics_dir=str(tmp_path / "f"))
    captured: list[str] = []
    monkeypatch.setattr(side.forensics, "capture", lambda trigger, reason="", step=None: captured.append(reason)
                        or {"reason": reason})
    breaker = CircuitBreaker.from_spec(eff)
    last = feed(step_times(30), side.store.ingest, lambda step, data, at: breaker.observe(step, data, now=at))
    limit = 2.5 * 22.0  # the longest of the last 30 steps, 2.5 times: over the floor
    assert [a.alert for a in side.hang_alerts] == ["VerlTrainingStalled"]
    assert side.hang_alerts[0].knob_values() == stalled.knob_values()

    def unhealthy(t: float) -> bool:
        return not side.trainer_liveness(now=t)[0]

    def captures(t: float) -> bool:
        return side.stall_watch.check(now=t) is not None

    def trips(t: float) -> bool:
        return breaker.tick(now=t) is not None

    for judged in (unhealthy, captures, trips):
        assert first_true(judged, last, last + 3600) == last + limit + 1, judged.__name__
    assert side.trainer_liveness(now=last + 56)[1] == "no new step for 56 s (limit 55 s): VerlTrainingStalled holds"
    assert captured == ["VerlTrainingStalled: no step for 56 s"]
    assert breaker.tripped.alert == "VerlTrainingStalled"

    # the same three with the spec's own knobs: the 10-minute floor
    default = sidecar(overrides="", healthz_hang=True)
    plain = CircuitBreaker.from_spec(SPEC)
    last = feed(step_times(30), default.store.ingest, lambda step, data, at: plain.observe(step, data, now=at))
    assert first_true(lambda t: not default.trainer_liveness(now=t)[0], last, last + 3600) == last + 601
    assert first_true(lambda t: plain.tick(now=t) is not None, last, last + 3600) == last + 601


def test_before_a_baseline_the_limit_is_before_baseline(tmp_path):
    side = sidecar(overrides=str(write(tmp_path, FAST)), healthz_hang=True)
    last = feed(step_times(5), side.store.ingest)  # under the signal's 10 steps: no step-time statistic yet
    assert first_true(lambda t: not side.trainer_liveness(now=t)[0], last, last + 3600) == last + 301


def test_healthz_judges_the_trainer_only_when_asked():
    off = sidecar(overrides="")
    feed(step_times(3), off.store.ingest)
    healthy, details = off.health()
    assert healthy and "trainer" not in details and not off.judges_trainer
    assert sidecar(overrides="", healthz_hang=True).trainer_liveness(now=10**9)[0]  # no step: nothing to judge


def test_the_tuning_page_shows_this_file():
    assert f"```yaml\n{FAST}```" in (REPO / "docs/tuning-and-calibrate.md").read_text()


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_stall_knobs_get_the_loaders_file_line_error(tmp_path):
    path = write(tmp_path, """version: 1
alerts:
  VerlTrainingStalled:
    thresholds:
      factor: -1
      at_least: 0
  VerlTrainingStalledRelative:
    thresholds: {before_baseline: 600}
""")
    with pytest.raises(OverridesError) as e:
        apply_overrides(SPEC, load_overrides(path))
    assert e.value.problems == [
        f"{path}:5: alerts.VerlTrainingStalled.thresholds.factor: -1 is outside the knob's range [1.0, None]",
        f"{path}:6: alerts.VerlTrainingStalled.thresholds.at_least: 0 is outside the knob's range [1.0, None]",
        f"{path}:8: alerts.VerlTrainingStalledRelative.thresholds.before_baseline: VerlTrainingStalledRelative has "
        "no knob 'before_baseline' (its knobs: factor, at_least)"]
    text = write(tmp_path, "alerts:\n  VerlTrainingStalled:\n    thresholds: {factor: soon}\n", "text.yaml")
    with pytest.raises(OverridesError) as e:
        load_overrides(text)
    [problem] = e.value.problems
    assert problem.startswith(f"{text}:3: alerts.VerlTrainingStalled.thresholds.factor: ") and "number" in problem


# ---------------------------------------------------------------------------------------------- the old flags
def test_the_deprecated_hang_flags_set_the_stall_knobs(caplog):
    args = build_parser().parse_args(["serve", "--hang-factor", "5", "--hang-min-seconds", "60"])
    flags = {**flag_values(vars(args)), "listen": "127.0.0.1:0", "collectors": NO_COLLECTORS, "overrides": ""}
    with caplog.at_level(logging.WARNING, logger="verl_exporter.sidecar.sidecar"):
        side = Sidecar(build_config({}, flags))
    assert alert(side.spec, "VerlTrainingStalled").knob_values() == {"factor": 5, "at_least": 60,
                                                                     "before_baseline": 1800}
    assert alert(side.spec, "VerlTrainingStalledRelative").knob_values() == {"factor": 3, "at_least": 300}
    [line] = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert line == ("--hang-factor and --hang-min-seconds are deprecated: set alerts.VerlTrainingStalled.thresholds."
                    "factor and alerts.VerlTrainingStalled.thresholds.at_least in the overrides file (the rules "
                    "follow it too) and --healthz-hang")
    # --hang-factor K > 0 still switches the check on, now with the alert's own judgement
    assert side.judges_trainer and not side.config.healthz_hang
    last = feed([30.0] * 15, side.store.ingest)
    assert first_true(lambda t: not side.trainer_liveness(now=t)[0], last, last + 3600) == last + 5 * 30 + 1
    # 0 was "off": it changes nothing; a floor of 0 is no floor, refused as the file refuses it
    off = sidecar(overrides="", hang_factor=0)
    assert not off.judges_trainer and off.spec.alerts() == load_spec().alerts()
    with pytest.raises(OverridesError, match=r"(?s)--hang-min-seconds: .*at_least: 0 is outside the knob.s range"):
        sidecar(overrides="", hang_min_seconds=0)


def test_a_deprecated_flag_wins_over_the_file(tmp_path):
    side = sidecar(overrides=str(write(tmp_path, FAST)), hang_min_seconds=90)
    assert alert(side.spec, "VerlTrainingStalled").knob_values() == {"factor": 2.5, "at_least": 90,
                                                                     "before_baseline": 300}


# ---------------------------------------------------------------------------------------------- promtool
def _ticks_case(spec, stamps: str, pace: float | None, last: float, until: float) -> tuple[dict, float]:
    """A promtool test of VerlTrainingStalled at every evaluation from the last step (at ``last``) to ``until``,
    each expecting what the kind's limit says: silent up to it, firing past it. Returns the test and the
    seconds from the last step to the first evaluation it expects to fire at."""
    a = alert(spec, "VerlTrainingStalled")
    limit = a.limit(pace)
    series = [{"series": f"verl_training_last_step_timestamp_seconds{{{_labels(LABELS)}}}", "values": stamps}]
    if pace is not None:  # from the 10th step on (the signal's baseline)
        series.append({"series": f"verl_detector_{a.stat}{{{_labels({**LABELS, 'signal': a.signal})}}}",
                       "values": f"_x9 {pace:g}x{int(until / STEP_S)}"})
    checks, first = [], None
    for t in range(-(-int(last) // EVAL_S) * EVAL_S, int(until) + 1, EVAL_S):  # promtool's evaluations
        age = t - last
        fires = age > limit
        first = t if fires and first is None else first
        exp = [] if not fires else [{
            "exp_labels": {**LABELS, **a.labels, "severity": a.severity},
            "exp_annotations": {"summary": expand(a.summary, age, LABELS),
                                "description": expand(a.description, age, LABELS),
                                "runbook_url": spec.rules.runbook_link(a.alert)}}]
        checks.append({"eval_time": f"{t}s", "alertname": a.alert, "exp_alerts": exp})
    assert first is not None
    return {"interval": f"{STEP_S:g}s", "input_series": series, "alert_rule_test": checks}, first - last


def _labels(labels: dict[str, str]) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in labels.items())


def _promtool(folder: Path, spec, tests: list[dict]) -> None:
    folder.mkdir(exist_ok=True)
    for rel, text in render_rules(spec).items():
        if "/tests/" not in rel:
            (folder / Path(rel).name).write_text(text)
    doc = {"rule_files": ["verl-recording.yaml", "verl-alerts.yaml"], "evaluation_interval": f"{EVAL_S}s",
           "tests": tests}
    (folder / "test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    run = subprocess.run([require_tool("promtool"), "test", "rules", str(folder / "test.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.integration
def test_a_20s_step_run_is_paged_within_2_minutes_by_an_overrides_file_alone(tmp_path):
    """Prometheus' own evaluation (promtool, every 30 s as the pack's rules) of the rules generated at the
    overrides: 31 steps of 20 s (the longest recent one 22 s: the sidecar's window_max), then none, the last
    step seen just after an evaluation (the worst phase) or between two; and a run that hangs after 5 steps,
    before the step time has a baseline."""
    eff = apply_overrides(SPEC, load_overrides(write(tmp_path, FAST)))
    until = 1500.0
    n = int(until / STEP_S)
    runs = {  # name: (the last step's timestamp series, the last step's time, the longest recent step)
        "worst phase": (f"-15+{STEP_S:g}x31 605x{n - 31}", 605.0, 22.0),  # 55 s later is just past a tick
        "between": (f"0+{STEP_S:g}x31 620x{n - 31}", 620.0, 22.0),
        "no baseline": (f"0+{STEP_S:g}x5 100x{n - 5 + 100}", 100.0, None),
    }
    delays: dict[tuple[str, str], float] = {}
    for which, spec in (("overrides", eff), ("defaults", SPEC)):
        cases = []
        for name, (stamps, last, pace) in runs.items():
            case, delays[which, name] = _ticks_case(spec, stamps, pace, last, until + (2000 if pace is None else 0))
            cases.append(case)
        _promtool(tmp_path / which, spec, cases)
    # limit max(2.5 x 22, 45) = 55 s, paged at the first evaluation past it; the defaults' floor is 10 minutes
    assert delays == {("overrides", "worst phase"): 85, ("overrides", "between"): 70,
                      ("overrides", "no baseline"): 320, ("defaults", "worst phase"): 625,
                      ("defaults", "between"): 610, ("defaults", "no baseline"): 1820}
    group_wait = yaml.safe_load((REPO / "alertmanager/alertmanager.yml").read_text())["route"]["group_wait"]
    page = max(d for (which, name), d in delays.items() if which == "overrides" and name != "no baseline") + \
        duration_seconds(group_wait)
    assert page <= PAGE_WITHIN_S, page


@pytest.mark.integration
@pytest.mark.parametrize("knobs", ["x10", "x0.5", "fast"])
def test_the_stall_alerts_generated_tests_follow_their_knobs(tmp_path, knobs):
    """The spec's stall tests are written for its knobs; other knobs move them by the minutes they move the
    stall's onset (StallAlert.test_case), and promtool still passes them."""
    if knobs == "fast":
        eff = apply_overrides(SPEC, load_overrides(write(tmp_path, FAST)))
    else:
        scale = float(knobs[1:])
        eff = apply_overrides(SPEC, {"alerts": {a.alert: {"thresholds": {k: max(1.0, v * scale) for k, v in
                                                                            a.knob_values().items()}}
                                                for a in SPEC.alerts() if a.kind == "stall"}})
    tests = yaml.safe_load(render_rules(eff)["rules/tests/generated-test.yaml"])["tests"]
    stalls = [t for t in tests if t["alert_rule_test"][0]["alertname"].startswith("VerlTrainingStalled")]
    assert len(stalls) == 2
    _promtool(tmp_path / "rules", eff, stalls)
