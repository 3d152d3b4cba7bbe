"""The alerts that hold in steps, each with a fault that should raise it, replayed at 5-s, 60-s and 10-minute
steps: the same declaration should page after the same number of steps whatever the step time (a `for:` in
minutes was 120 steps at 5-s steps and one step at 10-minute steps). Shared by tests/alerts/test_step_holds.py and
bench/step_holds.py."""

from __future__ import annotations

import dataclasses
import math
import random

from verl_exporter.core.detect import keys_of
from verl_exporter.spec import load_spec
from verl_exporter.tools import replay as rp

STEP_TIMES = (5.0, 60.0, 600.0)
# alert: (profile, fault, the fault's own ramp in steps before the line is crossed). The replay engine's
# faults, and two that set keys its profiles do not log (an off-policy run's importance-weight ESS, a fully
# async run's trainer idle ratio): INJECTED below.
CASES = {
    "VerlPPOClipFractionHigh": ("ppo", "lr_high", 2),  # the clip fraction climbs 0.1 a step from 0.1
    "VerlCriticExplainedVarianceCollapse": ("ppo", "critic_collapse", 1),  # 0.2, then below 0
    "VerlNumericalCollapse": ("grpo", "collapse", 0),
    "VerlRolloutISEffectiveSampleSizeLow": ("grpo", "is_ess_low", 0),
    "VerlFullyAsyncTrainerIdle": ("grpo", "trainer_idle", 0),
}
# fault: (the spec's series, its labels, healthy value, faulty value, noise); the verl key comes from the spec
INJECTED = {
    "is_ess_low": ("verl_rollout_corr_is_eff_sample_size_ratio", {}, 0.85, 0.3, 0.03),
    "trainer_idle": ("verl_fully_async_idle_ratio", {"role": "trainer"}, 0.2, 0.8, 0.05),
}


def fault_step(step_s: float) -> int:
    """Late enough for the windows of the rules (30 minutes of run) and for the simulated critic to have
    learnt (its explained variance is over 0.3 from about step 60)."""
    return max(100, math.ceil(1800 / step_s))


def lines_for(alert: str, step_s: float) -> tuple[list[dict], int]:
    """(the run's lines, the fault's first step) for one alert at one step time."""
    name, fault, _ = CASES[alert]
    profile = dataclasses.replace(rp.PROFILES[name], step_s=step_s)
    at = fault_step(step_s)
    steps = at + max(15, math.ceil(900 / step_s))  # and 15 minutes after it at least
    injected = INJECTED.get(fault)
    lines = rp.simulate(profile, None if injected else rp.Fault(fault, at), steps=steps)
    if injected:
        metric, labels, ok, bad, noise = injected
        [(key, _)] = keys_of(load_spec()[metric], labels)
        rng = random.Random(f"{alert}:{step_s}")
        for line in lines:
            value = bad if line["step"] >= at else ok
            line["data"][key] = min(1.0, max(0.0, value + rng.gauss(0, noise)))
    return lines, at


def steps_to_page(alert: str, step_s: float, rules_dir, promtool: str | None = None) -> tuple[int | None, float]:
    """(steps from the fault's first line to the step at which the alert first fires, or None; the minutes)."""
    lines, at = lines_for(alert, step_s)
    samples = rp.replay(lines)
    fired = [f for f in rp.evaluate(samples, rules_dir, promtool=promtool) if f.alert == alert]
    if not fired:
        return None, math.nan
    onset = next(end for step, end in samples.step_end_s if step == at)
    step = rp.step_at(samples, fired[0].minute)
    return (None if step is None else step - at), fired[0].minute - onset / 60
