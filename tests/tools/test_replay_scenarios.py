"""Whole runs through the one replay engine (verl_exporter.tools.replay): simulated verl lines -> the real follower,
store, mapper and detectors on a simulated clock -> the generated rules in promtool's engine.

Healthy PPO (30 s steps), GRPO (60 s), agentic (7 min) and long PPO (1,120 steps of 39 s) runs raise nothing;
each injected fault raises its alert within the stated number of steps (or minutes) of the first faulty line."""

from __future__ import annotations

import functools

import pytest
from conftest import REPO, require_tool
from verl_exporter.spec import load_spec
from verl_exporter.tools import agreement as ag
from verl_exporter.tools import replay as rp

pytestmark = pytest.mark.integration  # starts servers or programs

RULES = REPO / "rules"
SPEC = load_spec()


@functools.cache
def backtest(profile: str, fault: str | None = None, at: int = 0, tail_s: float = 0.0,
             rules: str = str(RULES)) -> tuple[rp.Samples, list[rp.Firing], list[dict]]:
    lines = rp.simulate(profile, rp.Fault(fault, at) if fault else None)
    samples = rp.replay(lines, tail_s=tail_s)
    return samples, rp.evaluate(samples, rules, promtool=require_tool("promtool")), lines


def onset_minute(samples: rp.Samples, at: int) -> float:
    """When the first faulty line was written (minutes since the start)."""
    return next(end for step, end in samples.step_end_s if step == at) / 60


# ppo_long: issue 24's healthy 1,120-step run whose gradient norm and entropy drift to ~3x their lowest levels
# over hundreds of steps; the rules before it raised VerlGradNormGrowing 11 times and VerlEntropyBlowUp 4 times.
@pytest.mark.parametrize("profile", ["ppo", "grpo", "agentic", "ppo_long"])
def test_healthy_runs_raise_nothing(profile):
    _, fired, lines = backtest(profile)
    assert len(lines) >= 60
    assert fired == [], [(f.alert, f.minute, f.value) for f in fired]


# (profile, fault, first faulty step, {alert: most steps after the fault's first line}, critical expected)
FAULTS = [
    ("ppo", "score_drop", 150, {"VerlRewardDrop": 3}, set()),
    ("agentic", "score_drop", 30, {"VerlRewardDrop": 3}, set()),
    ("grpo", "collapse", 100, {"VerlRewardCollapse": 3, "VerlResponseLengthCollapse": 3, "VerlEntropyCollapse": 3,
                               "VerlHighKLDivergence": 3},
     {"VerlRewardCollapse", "VerlAnswersCollapsed", "VerlNumericalCollapse"}),
    ("agentic", "collapse", 12, {"VerlRewardCollapse": 4, "VerlResponseLengthCollapse": 3,
                                 "VerlHighKLDivergence": 3},
     {"VerlRewardCollapse", "VerlNumericalCollapse", "VerlAnswersCollapsed"}),
    ("grpo", "slow_decline", 60, {"VerlRewardDecline": 25}, set()),  # issue 24: a slow degradation within 25 steps
    ("grpo", "nan", 120, {"VerlNonFiniteGradNorm": 1}, {"VerlNonFiniteGradNorm"}),
    ("ppo", "slowdown", 150, {"VerlRolloutSlow": 3}, set()),
    ("grpo", "entropy_collapse", 120, {"VerlEntropyCollapse": 3}, set()),
    ("grpo", "kl_blowup", 120, {"VerlHighKLDivergence": 3, "VerlKLDrift": 3}, set()),
    ("ppo", "grad_spike", 150, {"VerlGradNormSpike": 2}, set()),
]


@pytest.mark.parametrize("profile,fault,at,expected,critical", FAULTS, ids=[f"{p}-{f}" for p, f, *_ in FAULTS])
def test_faults_are_caught_within_their_steps(profile, fault, at, expected, critical):
    samples, fired, _ = backtest(profile, fault, at)
    first = {}
    for f in fired:
        first.setdefault(f.alert, rp.step_at(samples, f.minute))
    for alert, steps in expected.items():
        assert alert in first, (alert, sorted(first))
        assert at <= first[alert] <= at + steps, (alert, first[alert], at)
    assert {f.alert for f in fired if f.severity == "critical"} == critical
    assert all(rp.step_at(samples, f.minute) >= at for f in fired), "an alert before the fault"


def test_clipping_pages_within_15_minutes_on_7_minute_steps():
    samples, fired, _ = backtest("agentic", "clip", 20)
    clip = [f for f in fired if f.alert == "VerlResponseClipRatioHigh"]
    assert clip and clip[0].value >= 0.4
    assert clip[0].minute - onset_minute(samples, 20) <= 15


def test_memory_growth_of_9_gib_an_hour_warns_within_45_minutes():
    samples, fired, _ = backtest("ppo", "memory_leak", 150)
    leak = [f for f in fired if f.alert == "VerlMemoryLeak"]
    assert leak and leak[0].minute - onset_minute(samples, 150) <= 45


def test_a_hang_is_critical_relative_to_the_runs_own_step_time():
    samples, fired, _ = backtest("agentic", "hang", 30, tail_s=4 * 3600)
    last = samples.step_end_s[-1][1] / 60
    stalled = {f.alert: f.minute - last for f in fired}
    assert stalled.get("VerlTrainingStalledRelative", 1e9) < stalled["VerlTrainingStalled"] <= 60
    assert [f.severity for f in fired if f.alert == "VerlTrainingStalled"] == ["critical"]


def test_one_bad_batch_on_a_long_step_run_pages_nobody():
    """Issue 11: a one-step dip of the score on a healthy 7-minute-step agent run (early, and later on) raised
    VerlRewardCollapse (critical)."""
    lines = rp.simulate("agentic")
    for step in (6, 25):
        lines[step - 1]["data"]["critic/score/mean"] -= 0.15
    samples = rp.replay(lines)
    fired = rp.evaluate(samples, RULES, promtool=require_tool("promtool"))
    assert [f for f in fired if f.severity == "critical"] == []
    assert fired == [], [(f.alert, f.minute) for f in fired]


@pytest.mark.parametrize("profile,fault,at,tail_s", rp.SCENARIOS,
                         ids=[f"{p}-{f or 'healthy'}" for p, f, *_ in rp.SCENARIOS])
def test_the_breaker_trips_if_and_only_if_the_pack_pages_critical(profile, fault, at, tail_s):
    """The same lines on the same clock: the breaker trips iff the rules page a critical alert it judges, at
    most MAX_LAG_STEPS steps after the page, and never on a healthy run."""
    # called as the other tests call it, so that each run is replayed once for the module
    if fault is None:
        samples, fired, lines = backtest(profile)
    elif tail_s:
        samples, fired, lines = backtest(profile, fault, at, tail_s=tail_s)
    else:
        samples, fired, lines = backtest(profile, fault, at)
    a = ag.agreement(lines, samples, fired, SPEC)
    assert a.agrees, a
    if fault is None:
        assert a.trip is None and a.page is None
