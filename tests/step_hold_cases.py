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
from verl_exporter.tools import nodes
from verl_exporter.tools import replay as rp

STEP_TIMES = (5.0, 60.0, 600.0)
# alert: (profile, fault, the fault's own ramp in steps before the line is crossed). The replay engine's
# faults, and those that set keys its profiles do not log (an off-policy run's importance-weight ESS, its
# rollout-training mismatch, a fully async run's trainer idle ratio and sample counts): INJECTED below.
CASES = {
    "VerlPPOClipFractionHigh": ("ppo", "lr_high", 2),  # the clip fraction climbs 0.1 a step from 0.1
    "VerlCriticExplainedVarianceCollapse": ("ppo", "critic_collapse", 1),  # 0.2, then below 0
    "VerlNumericalCollapse": ("grpo", "collapse", 0),
    "VerlRolloutISEffectiveSampleSizeLow": ("grpo", "is_ess_low", 0),
    "VerlFullyAsyncTrainerIdle": ("grpo", "trainer_idle", 0),
    # the KL compounds 2% a step from its level at the fault: past 0.05 and twice its floor ~45 steps later
    "VerlCriticOverfitting": ("ppo_kl_loss", "critic_overfit", 45),
    "VerlRolloutActorProbsCorrelationLow": ("grpo", "probs_decorrelated", 0),
    "VerlRolloutMismatchKLRising": ("grpo", "mismatch_kl_up", 0),
    "VerlRolloutPPLGapRising": ("grpo", "ppl_gap_up", 0),
    # 10 steps' counts: a quarter of what is generated dropped from the fault on is a tenth after 4 steps
    "VerlFullyAsyncStaleSamplesDropped": ("grpo", "stale_dropped", 4),
    "VerlDataLoadingBottleneck": ("grpo", "data_starved", 0),
    "VerlCommunicationSlowdown": ("grpo", "comm_slowdown", 0),
}
# the profiles of the replay engine, and a PPO run with the KL loss (the critic's over-fitting reads actor/kl_loss)
PROFILES = {**rp.PROFILES, "ppo_kl_loss": dataclasses.replace(rp.PROFILES["ppo"], kl_key="actor/kl_loss")}
# fault: [(the spec's series, its labels, healthy value, faulty value, noise, a cumulative count?)]; the verl key
# comes from the spec. A cumulative count adds its value (with noise) at each step.
INJECTED = {
    "is_ess_low": [("verl_rollout_corr_is_eff_sample_size_ratio", {}, 0.85, 0.3, 0.03, False)],
    "trainer_idle": [("verl_fully_async_idle_ratio", {"role": "trainer"}, 0.2, 0.8, 0.05, False)],
    "probs_decorrelated": [("verl_training_rollout_actor_probs_correlation", {}, 0.995, 0.9, 0.002, False)],
    "mismatch_kl_up": [("verl_rollout_corr_kl", {"estimator": "k3"}, 0.0005, 0.005, 0.0001, False)],
    "ppl_gap_up": [("verl_rollout_corr_log_ppl_diff", {"stat": "abs_mean"}, 0.002, 0.03, 0.0004, False)],
    "stale_dropped": [("verl_fully_async_samples", {"kind": "generated"}, 100, 100, 5, True),
                      ("verl_fully_async_samples", {"kind": "dropped_stale"}, 0.5, 25, 0.5, True)],
}
def fault_step(step_s: float) -> int:
    """Late enough for the windows of the rules (30 minutes of run) and for the simulated critic to have
    learnt (its explained variance is over 0.3 from about step 60)."""
    return max(100, math.ceil(1800 / step_s))


def lines_for(alert: str, step_s: float) -> tuple[list[dict], int]:
    """(the run's lines, the fault's first step) for one alert at one step time."""
    name, fault, _ = CASES[alert]
    profile = dataclasses.replace(PROFILES[name], step_s=step_s)
    at = fault_step(step_s)
    # 15 minutes after it at least, and 15 steps after its ramp
    steps = at + max(15, math.ceil(900 / step_s), CASES[alert][2] + 15)
    injected = INJECTED.get(fault, [])
    lines = rp.simulate(profile, None if injected else rp.Fault(fault, at), steps=steps)
    rng = random.Random(f"{alert}:{step_s}")
    for metric, labels, ok, bad, noise, cumulative in injected:
        [(key, _)] = keys_of(load_spec()[metric], labels)
        total = 0.0
        for line in lines:
            value = (bad if line["step"] >= at else ok) + rng.gauss(0, noise)
            if cumulative:
                total += max(0.0, value)
                line["data"][key] = round(total)
            else:
                line["data"][key] = min(1.0, max(0.0, value))
    return lines, at


def samples_for(alert: str, step_s: float) -> tuple[rp.Samples, int]:
    """(the run replayed through the sidecar path with the other sidecars' series beside it, the fault's side of
    them included (the GPUs a data-starved run leaves idle); the fault's first step)."""
    lines, at = lines_for(alert, step_s)
    fault = CASES[alert][1]
    samples = rp.replay(lines, run="r1", instance=nodes.RANKS[0][0])
    onset = math.ceil(next(end for step, end in samples.step_end_s if step == at - 1) / 60)
    nodes.add_node_series(samples, lines, "r1", None if fault in INJECTED else rp.Fault(fault, at), onset)
    return samples, at


def steps_to_page(alert: str, step_s: float, rules_dir, promtool: str | None = None) -> tuple[int | None, float]:
    """(steps from the fault's first line to the step at which the alert first fires, or None; the minutes)."""
    samples, at = samples_for(alert, step_s)
    fired = [f for f in rp.evaluate(samples, rules_dir, promtool=promtool) if f.alert == alert]
    if not fired:
        return None, math.nan
    onset = next(end for step, end in samples.step_end_s if step == at)
    step = rp.step_at(samples, fired[0].minute)
    return (None if step is None else step - at), fired[0].minute - onset / 60
