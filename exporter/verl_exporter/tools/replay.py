"""One replay engine: simulate verl runs, replay any verl file-logger JSONL through the real sidecar path onto a
simulated clock, and evaluate the generated alert rules on it with promtool's rule engine.

* ``simulate(profile, fault)`` writes a verl run (verl 0.9.1 keys) step by step: healthy PPO, GRPO and agentic
  profiles with batch noise, heavy-tailed outliers and step times from seconds to 10 minutes, plus
  injectable faults (collapse, slow decline, clipping, memory leak, hang, NaN, slowdown, ...); FAULTS is the
  one table of them, the node faults (GPU, host, checkpoint, sidecar) included: ``tools.nodes`` makes the
  other sidecars' series of a run and applies those.
* ``replay(lines)`` appends each line to a file that the real ``VerlFileFollower`` polls on a simulated clock
  (the step's end, from ``timing_s/step`` or a given period); the real ``TrainingStore`` maps the keys through
  the spec and runs the step-domain detectors; every ``scrape_s`` the exported series are sampled, as
  Prometheus would scrape them.
* ``evaluate(samples)`` writes the samples as promtool input series with the generated rule files and reads
  back, minute by minute, which alerts start firing and with which value (``promtool test rules``).

The demo, the scenario tests, ``verl-exporter backtest`` and the benchmarks all go through this module.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import gzip
import json
import math
import os
import random
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.detect import step_duration, step_seconds_keys
from ..exposition.selfmetrics import SelfMetrics
from ..sidecar.sources import console
from ..sidecar.sources.verl_file import VerlFileFollower
from ..sidecar.store import TrainingStore
from ..spec import Spec, load_spec
from ..spec.rules import EVAL_TIME_RE, duration_seconds

JOB, INSTANCE, RANK = "verl", "replay:9477", "0"
GIB = 1024**3


# ---------------------------------------------------------------------------------------------- simulator
@dataclass(frozen=True)
class Profile:
    """A kind of healthy run: sizes, speeds and the shape of its curves."""

    name: str
    steps: int
    step_s: float  # mean step time at the start
    batch: int  # responses per step (sets the batch noise of the score)
    len0: float  # mean response length at the start, and its rise
    len_gain: float
    max_len: int
    score0: float  # score: score0 + gain * (1 - exp(-step / tau))
    score_gain: float
    score_tau: float
    ent0: float  # entropy: decays from ent0 to ent_end
    ent_end: float
    kl_key: str  # actor/kl_loss (GRPO) or actor/reward_kl_penalty (PPO's in-reward KL)
    critic: bool = False
    mem_gib: float = 60.0
    gpus: int = 8
    # A long run's slow drift (1 and 0: none): the gradient norm and the entropy are multiplied by
    # drift ** (step / steps), so they reach `drift` times their undrifted value at the last step.
    grad_drift: float = 1.0
    ent_drift: float = 1.0


PROFILES = {
    "ppo": Profile("ppo", steps=300, step_s=30.0, batch=1024, len0=220, len_gain=120, max_len=1024, score0=0.1,
                   score_gain=0.65, score_tau=80, ent0=1.1, ent_end=0.5, kl_key="actor/reward_kl_penalty",
                   critic=True, mem_gib=52.0),
    "grpo": Profile("grpo", steps=240, step_s=60.0, batch=1280, len0=300, len_gain=400, max_len=4096, score0=0.05,
                    score_gain=0.6, score_tau=70, ent0=0.9, ent_end=0.4, kl_key="actor/kl_loss", mem_gib=64.0),
    "agentic": Profile("agentic", steps=60, step_s=420.0, batch=256, len0=1500, len_gain=2500, max_len=8192,
                       score0=-0.55, score_gain=0.3, score_tau=25, ent0=0.7, ent_end=0.45,
                       kl_key="actor/kl_loss", mem_gib=70.0, gpus=16),
    # Issue 24's healthy 1,120-step PPO run (39 s steps, 12 h): after the early decay the gradient norm climbs
    # with the answer length to ~3.4x its lowest level and the entropy back to ~2.6x its lowest level, over
    # hundreds of steps; nothing is wrong with it.
    "ppo_long": Profile("ppo_long", steps=1120, step_s=39.0, batch=1024, len0=220, len_gain=120, max_len=1024,
                        score0=0.1, score_gain=0.65, score_tau=80, ent0=1.1, ent_end=0.5,
                        kl_key="actor/reward_kl_penalty", critic=True, mem_gib=52.0, grad_drift=6.0, ent_drift=3.6),
}


@dataclass(frozen=True)
class Fault:
    """A failure injected from step ``at`` on: ``kind`` is one of FAULTS."""

    kind: str
    at: int


def _fault_state(kind: str, k: int, s: dict, p: Profile) -> None:
    """Change step k (0 = the fault's first step) of a run's state in place."""
    if kind == "score_drop":  # the reward falls from its (still rising) curve to below its start at once
        s["score"] = p.score0 - 0.25 + s["noise"]
    elif kind == "collapse":  # answers collapse to a token, the score to its floor, in-reward KL explodes
        f = min(1.0, (k + 1) / 3)
        s["length"] = max(1.0, s["length"] * (1 - f) + f)
        s["score"] = s["score"] * (1 - f) + f * (-1.0 if p.score0 < 0 else 0.0)
        s["entropy"] *= 1 - 0.9 * f
        s["kl"] = s["kl"] + f * 15.0
        s["aborted"] = 0.6 * f
    elif kind == "slow_decline":  # the score slides and the entropy climbs to 3x over ~60 steps
        f = min(1.0, k / 60)
        s["score"] -= 0.4 * f
        s["entropy"] *= 1 + 2.0 * f
    elif kind == "clip":  # ~45% of responses hit the length cap
        s["clip"] = 0.45 + s["noise"] / 10
        s["length"] = 0.7 * p.max_len
    elif kind == "memory_leak":  # verl's peak reserved memory climbs ~9 GiB/h
        s["mem"] += 9.0 * s["since_fault_s"] / 3600
    elif kind == "nan":
        if k < 3:
            s["grad"] = math.nan
    elif kind == "slowdown":  # the rollout engine halves its speed: per-token latency doubles
        s["gen_x"] *= 2.0
    elif kind == "entropy_collapse":
        s["entropy"] *= 0.15
    elif kind == "kl_blowup":
        s["kl"] += 2.0 + 0.2 * k
    elif kind == "grad_spike":  # an explosion starts: two steps at ~100x, then NaN would follow
        if k < 2:
            s["grad"] *= 100
    elif kind == "grad_explosion":  # the demo's fault, as verl issue reports tell it: the gradient norm climbs
        # to ~40x over 5 steps, is NaN (with the loss) for 3, then stays large while the policy collapses
        if k < 5:
            s["grad"] *= (2.5, 6.0, 12.0, 24.0, 40.0)[k]
        elif k < 8:
            s["grad"] = s["loss"] = math.nan
        else:
            f = 1 - 0.9 * math.exp(-(k - 8) / 4)
            s["grad"] *= 8.0
            s["score"] = s["score"] * (1 - f) + 0.05 * f
            s["length"] = s["length"] * (1 - f) + 20.0 * f
            s["entropy"] *= 1 - 0.93 * f
            s["kl"] += 0.5 * f
            s["ppo_kl_x"] = 1 + 50 * f
            s["aborted"] = 0.4 * f
    elif kind == "grad_spike_nan":  # the gradient norm jumps 100x for 2 steps, then is NaN with the loss for 3
        if k < 2:
            s["grad"] *= 100
        elif k < 5:
            s["grad"] = s["loss"] = math.nan
    elif kind == "nan_loss":  # the loss (and so the gradient norm) is NaN for 2 steps
        if k < 2:
            s["grad"] = s["loss"] = math.nan
    elif kind == "critic_collapse":  # the critic stops tracking returns: explained variance ~-0.45, vf_loss x4
        s["vf_ev"] = (0.2, -0.2)[k] if k < 2 else -0.45 + 1.5 * s["noise"]
        s["vf_x"] = 4.0
    elif kind == "val_drop":  # held-out accuracy falls to 55% of its level (an over-optimised reward)
        s["val_x"] = 0.55
    elif kind == "lr_high":  # the learning rate is raised 10x: up to ~40% of tokens clipped, ppo_kl x100
        s["clipfrac"] = min(0.4, 0.1 + 0.1 * k) + abs(s["noise"])
        s["ppo_kl_x"] = 100.0
    elif kind == "critic_overfit":  # KL compounds 2% a step while the score stalls (and vf_loss keeps falling)
        s["kl"] *= 1.02 ** (k + 1)
        s["score"] = p.score0 + p.score_gain * (1 - math.exp(-(s["i"] - k) / p.score_tau)) - 0.0008 * k \
            + s["noise"]
    elif kind == "data_starved":  # data loading starves the rollout: gen x2.2, the actor update unchanged
        s["gen_x"] *= 2.2
    elif kind == "comm_slowdown":  # NCCL falls back to a slow path: the actor update x2.5
        s["update_x"] = 2.5
    elif kind == "power_cap":  # the GPUs' power limit is lowered: update x1.7, gen x1.3, MFU falls with them
        s["update_x"], s["gen_x"], s["mfu_x"] = 1.7, s["gen_x"] * 1.3, 1 / 1.7
    elif kind not in FAULTS:
        raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")


# The faults, one table: what they do to verl's training state is in _fault_state (hangs stop the run);
# NODE_FAULTS also change the node series of tools.nodes (GPUs, host, checkpoints, the sidecars' up).
FAULTS = ("score_drop", "collapse", "slow_decline", "clip", "memory_leak", "nan", "slowdown", "entropy_collapse",
          "kl_blowup", "grad_spike", "grad_explosion", "hang",
          "grad_spike_nan", "nan_loss", "critic_collapse", "val_drop", "lr_high", "critic_overfit", "data_starved",
          "comm_slowdown", "power_cap", "gpu_lost", "critical_xid", "gpu_xid", "thermal", "straggler", "gpu_idle",
          "ecc", "remap_failed", "nvlink", "gpu_memory_full", "gpu_memory_leak", "disk_fill", "disk_busy",
          "checkpoint_skip", "checkpoint_partial", "checkpoint_corrupt", "exporter_down", "exporter_absent")
HANGS = ("hang", "gpu_lost", "critical_xid")  # the run stops at the fault's step


# The replay engine's scenarios: (profile, fault, first faulty step, seconds of log after the last line).
SCENARIOS = [("ppo", None, 0, 0), ("grpo", None, 0, 0), ("agentic", None, 0, 0), ("ppo_long", None, 0, 0),
             ("ppo", "score_drop", 150, 0), ("agentic", "score_drop", 30, 0), ("grpo", "collapse", 100, 0),
             ("agentic", "collapse", 12, 0), ("grpo", "slow_decline", 60, 0), ("grpo", "nan", 120, 0),
             ("ppo", "slowdown", 150, 0), ("grpo", "entropy_collapse", 120, 0), ("grpo", "kl_blowup", 120, 0),
             ("ppo", "grad_spike", 150, 0), ("agentic", "clip", 20, 0), ("ppo", "memory_leak", 150, 0),
             ("agentic", "hang", 30, 4 * 3600)]


def simulate(profile: str | Profile, fault: Fault | None = None, steps: int | None = None,
             seed: int = 20261130, every_key: bool = False) -> list[dict]:
    """A verl file-logger run, one dict per line: {"step": n, "data": {verl key: value}} (NaN as None).

    every_key adds the rest of what verl 0.9.1's PPO loop logs, with the quirks of real files (see
    _verl_extras); the core keys keep the same values either way."""
    p = PROFILES[profile] if isinstance(profile, str) else profile
    rng = random.Random(f"{seed}:{p.name}")
    extras_rng = random.Random(f"{seed}:{p.name}:extras")
    n = steps or p.steps
    out: list[dict] = []
    t = 0.0
    fault_t = None
    for i in range(1, n + 1):
        g = rng.gauss
        heavy = 3.0 if rng.random() < 0.03 else 1.0  # an odd batch now and then
        sigma = 0.5 / math.sqrt(p.batch) * 2.0
        s = {"noise": g(0, sigma) * heavy}
        s["score"] = p.score0 + p.score_gain * (1 - math.exp(-i / p.score_tau)) + s["noise"]
        s["length"] = (p.len0 + p.len_gain * (1 - math.exp(-i / 120))) * (1 + g(0, 0.03))
        s["entropy"] = (p.ent_end + (p.ent0 - p.ent_end) * math.exp(-i / 90)) * (1 + g(0, 0.03))
        s["kl"] = max(0.0, 0.002 + 0.04 * (1 - math.exp(-i / 150))) * (1 + g(0, 0.1))
        s["grad"] = (0.2 + 0.3 * math.exp(-i / 200)) * math.exp(g(0, 0.2)) * (2.5 if rng.random() < 0.02 else 1)
        s["grad"] *= p.grad_drift ** (i / n)
        s["entropy"] *= p.ent_drift ** (i / n)
        s["clip"] = None
        s["aborted"] = rng.uniform(0.0, 0.004) if rng.random() < 0.15 else 0.0
        s["mem"] = p.mem_gib + g(0, 0.03)
        s["gen_x"] = (1 + g(0, 0.04)) * (1.5 if i == 1 else 1.0)
        s["loss"], s["ppo_kl_x"] = 0.0, 1.0
        s.update(i=i, clipfrac=None, vf_ev=None, vf_x=1.0, val_x=1.0, update_x=1.0, mfu_x=1.0)
        hang = False
        if fault is not None and i >= fault.at:
            fault_t = t if fault_t is None else fault_t
            s["since_fault_s"] = t - fault_t
            if fault.kind in HANGS:
                hang = True
            else:
                _fault_state(fault.kind, i - fault.at, s, p)
        if hang:
            break
        length = max(1.0, s["length"])
        clip = s["clip"] if s["clip"] is not None else \
            min(1.0, max(0.0, 0.002 + 0.5 * max(0.0, length / p.max_len - 0.3) + abs(g(0, 0.003))))
        tokens = p.batch * (length + 200)
        per_token_s = p.step_s * 0.5 / (p.batch * (p.len0 + 200)) * s["gen_x"]
        gen = per_token_s * p.batch * length + 2.0
        update = p.step_s * 0.35 * tokens / (p.batch * (p.len0 + 200)) * (1 + g(0, 0.03)) * s["update_x"]
        step_s = gen + update + p.step_s * 0.15 * (1 + g(0, 0.05))
        d: dict = {
            "actor/pg_loss": g(-0.004, 0.015) + s["loss"], "actor/entropy": s["entropy"],
            "actor/ppo_kl": 1e-4 * (1 + g(0, 0.5)) * s["ppo_kl_x"],
            "actor/pg_clipfrac": _first(s["clipfrac"], 0.004 + abs(g(0, 0.0015))), "actor/grad_norm": s["grad"],
            "actor/lr": 1e-6,
            p.kl_key: s["kl"],
            "critic/score/mean": s["score"], "critic/score/max": 1.0, "critic/score/min": -1.0,
            "critic/rewards/mean": s["score"], "response_length/mean": length,
            "response_length/max": float(p.max_len if clip > 0.0 else length * 2),
            "response_length/min": 1.0, "response_length/clip_ratio": clip, "response/aborted_ratio": s["aborted"],
            "prompt_length/mean": 200.0, "timing_s/gen": gen, "timing_s/update_actor": update,
            "timing_s/step": step_s, "timing_per_token_ms/gen": per_token_s * 1000 * (1 + g(0, 0.02)),
            "perf/total_num_tokens": tokens, "perf/time_per_step": step_s,
            "perf/throughput": tokens / step_s / p.gpus, "perf/max_memory_allocated_gb": s["mem"] - 6.0,
            "perf/max_memory_reserved_gb": s["mem"], "perf/mfu/actor": 0.35 * (1 + g(0, 0.03)) * s["mfu_x"],
            "training/global_step": float(i),
        }
        if p.critic:
            d["critic/vf_loss"] = (0.3 * math.exp(-i / 100) + 0.04) * s["vf_x"]
            d["critic/vf_explained_var"] = _first(s["vf_ev"], 0.6 - 0.8 * math.exp(-i / 60) + g(0, 0.03))
        if every_key:
            _verl_extras(d, i, p, extras_rng, s["val_x"])
        data = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
        out.append({"step": i, "data": data})
        t += step_s
    return out


def _first(override: float | None, value: float) -> float:
    """A fault's value where it sets one; the healthy value is drawn either way, so the draws stay the same."""
    return value if override is None else override


VAL_EVERY, SAVE_EVERY, STEPS_PER_EPOCH, NOTE_STEP, VAL_TAG = 20, 50, 100, 100, "openai/gsm8k"


def _verl_extras(d: dict, i: int, p: Profile, rng: random.Random, val_x: float = 1.0) -> None:
    """The rest of a verl 0.9.1 PPO step's keys, derived from the core ones, with real files' quirks: integer
    counters written as JSON integers, `val-*` and `timing_s/testing` only on validation steps,
    `timing_s/save_checkpoint` only on save steps, and a string value (`training/note`) at one step."""
    g = rng.gauss
    length, score, step_s = d["response_length/mean"], d["critic/score/mean"], d["timing_s/step"]
    tokens = int(d["perf/total_num_tokens"])
    d.update({
        "actor/entropy_loss": d["actor/entropy"], "actor/kl_coef": 0.001, "actor/loss": d["actor/pg_loss"],
        "actor/pg_clipfrac_lower": abs(g(0, 2e-4)), "actor/mfu": d["perf/mfu/actor"],
        "actor/reward_kl_penalty_coeff": 0.001,
        "critic/rewards/max": 1.0, "critic/rewards/min": -1.0 if p.score0 < 0 else 0.0,
        "critic/advantages/mean": g(0, 4e-9), "critic/advantages/max": 3.4 + rng.random(),
        "critic/advantages/min": -3.1 - rng.random(), "critic/returns/mean": score + g(0, 0.006),
        "critic/returns/max": 1.0, "critic/returns/min": -0.01,
        "response_length_non_aborted/mean": length, "response_length_non_aborted/max": d["response_length/max"],
        "response_length_non_aborted/min": d["response_length/min"],
        "response_length_non_aborted/clip_ratio": d["response_length/clip_ratio"],
        "prompt_length/max": float(rng.randint(236, 262)), "prompt_length/min": float(rng.randint(54, 66)),
        "prompt_length/clip_ratio": 0.0,
        "global_seqlen/min": tokens // p.gpus - 900, "global_seqlen/max": tokens // p.gpus + 900,
        "global_seqlen/minmax_diff": 1800, "global_seqlen/mean": tokens / p.gpus,
        "perf/total_num_tokens": tokens, "perf/cpu_memory_used_gb": 82.0 + g(0, 0.2),
        "perf/mfu/actor_infer": 0.2 * (1 + g(0, 0.03)),
        "training/global_step": i, "training/epoch": (i - 1) // STEPS_PER_EPOCH,
        "training/rollout_probs_diff_valid": 1, "training/rollout_probs_diff_max": 0.4 + 0.1 * rng.random(),
        "training/rollout_probs_diff_mean": 0.003 * (1 + g(0, 0.1)),
        "training/rollout_probs_diff_std": 0.01 * (1 + g(0, 0.1)),
    })
    for name, share in (("reward", 0.02), ("old_log_prob", 0.05), ("ref", 0.05), ("adv", 0.01)):
        d[f"timing_s/{name}"] = step_s * share
        d[f"timing_per_token_ms/{name}"] = step_s * share * 1000 / tokens
    if p.critic:
        value = score - 0.05 + g(0, 0.004)
        d.update({"critic/values/mean": value, "critic/values/max": value + 0.55, "critic/values/min": value - 0.55,
                  "critic/vpred_mean": value, "critic/vf_clipfrac": abs(g(0, 0.002)), "critic/lr": 1e-5,
                  "critic/grad_norm": 1.0 * math.exp(g(0, 0.2)), "critic/mfu": 0.3 * (1 + g(0, 0.03)),
                  "perf/mfu/critic": 0.3 * (1 + g(0, 0.03)), "timing_s/values": step_s * 0.05,
                  "timing_s/update_critic": step_s * 0.1})
    if i % VAL_EVERY == 0:
        v = min(0.97, max(0.005, score - 0.03 + g(0, 0.012))) * val_x
        d["timing_s/testing"] = 40.0 * (1 + g(0, 0.05))
        d[f"val-core/{VAL_TAG}/reward/mean@4"] = v
        d[f"val-core/{VAL_TAG}/reward/best@4/mean"] = 1 - (1 - v) ** 2.1
        d[f"val-aux/{VAL_TAG}/reward/std@4"] = 0.8 * math.sqrt(v * (1 - v))
    if i % SAVE_EVERY == 0:
        d["timing_s/save_checkpoint"] = rng.uniform(21.0, 29.0)
    if i == NOTE_STEP:
        d["training/note"] = "resumed-from-ckpt"


def write_jsonl(lines: Iterable[dict], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------------- replay
class NotAVerlLog(ValueError):
    """The file is not a verl file-logger JSONL (no line of the form {"step": N, "data": {...}})."""




# The most steps of one run a backtest or calibration judges by default: the last ones are kept, with a
# warning. A million-step log held whole took gigabytes and hours; 100,000 steps (~1 GB, linear time) judge
# months of training.
MAX_STEPS = 100_000


def read_jsonl(path: str | Path, probe: int = 50) -> list[dict]:
    """The lines of a verl run: file-logger JSONL (optionally .gz), or else verl's console output
    (``step:N - key:value``, read by ``sources.console``: Ray prefixes, one key per line, notebooks, cut lines).
    Raises NotAVerlLog when neither is found, or when a console log holds several runs."""
    return read_run(path, probe)[0]


def read_run(path: str | Path, probe: int = 50, max_steps: int | None = None) -> tuple[list[dict], int]:
    """(lines, how many the run has) as read_jsonl, keeping only the last max_steps lines (None or 0: all); the
    lines before them are parsed and dropped as the file is read, so memory stays bounded."""
    kept: collections.deque[dict] = collections.deque(maxlen=max_steps or None)
    total = bad = 0
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("data"), dict) and isinstance(obj.get("step"), int):
                kept.append(obj)
                total += 1
                continue
            bad += 1
            if not total and n >= probe:
                break
    if total:
        return list(kept), total
    try:
        records = console.convert(console.read_text(str(path)))
    except console.ConsoleLogError as e:
        raise NotAVerlLog(f"{path}: not a verl log: no line is {{\"step\": N, \"data\": {{...}}}} (the file logger) "
                          f"and as a console log: {e} ({bad} other lines); enable the file logger with "
                          "trainer.logger='[\"console\",\"file\"]'") from None
    lines = [{"step": step, "data": data} for step, data in records]
    return (lines[-max_steps:] if max_steps else lines), len(lines)


def too_long(path: str | Path, lines: list[dict], total: int) -> str | None:
    """The warning for a run cut to its last steps by read_run, or None when it was read whole."""
    if len(lines) == total:
        return None
    return (f"{path}: {total:,} steps, more than --max-steps {len(lines):,}: judging the last {len(lines):,} "
            f"(steps {lines[0]['step']}..{lines[-1]['step']}); --max-steps 0 judges them all, in time and memory "
            "that grow with the steps")


@dataclass
class Samples:
    """What Prometheus would have scraped: series -> one value (or None) per scrape, and the step times."""

    scrape_s: float
    series: dict[tuple[str, tuple[tuple[str, str], ...]], list[float | None]] = field(default_factory=dict)
    step_end_s: list[tuple[int, float]] = field(default_factory=list)  # (step, simulated end time)

    @property
    def length(self) -> int:
        return max((len(v) for v in self.series.values()), default=0)

    def get(self, name: str, **labels: str) -> list[float | None]:
        for (n, lab), values in self.series.items():
            if n == name and labels.items() <= dict(lab).items():
                return values
        return []


def step_period(lines: list[dict], given: float | None = None, spec: Spec | None = None) -> list[float]:
    """Each step's duration: as logged (`timing_s/step`, `timing/step` in older verl; else the median of those
    logged, else 60 s), or `given`."""
    if given:
        return [given] * len(lines)
    keys = step_seconds_keys(spec or load_spec())
    logged = [step_duration(ln["data"], keys) for ln in lines]
    ok = sorted(x for x in logged if x is not None)
    fallback = ok[len(ok) // 2] if ok else 60.0
    return [x if x is not None else fallback for x in logged]


def replay(lines: list[dict], spec: Spec | None = None, run: str = "replay", scrape_s: float = 60.0,
           period_s: float | None = None, tail_s: float = 0.0,
           progress: Callable[[int, int], None] | None = None, instance: str = INSTANCE) -> Samples:
    """Push the lines through the real follower, store, mapper and detectors on a simulated clock.

    The run starts at t=0; step i ends after the durations of steps 1..i (``timing_s/step``, or period_s);
    Prometheus scrapes every scrape_s until tail_s after the last step (tail_s shows a hang after the end)."""
    durations = step_period(lines, period_s, spec)
    ends, t = [], 0.0
    for d in durations:
        t += d
        ends.append(t)
    scrapes = math.ceil((t + tail_s) / scrape_s) + 1  # the last scrape comes after the last line
    return replay_timed(list(zip(ends, lines, strict=True)), scrapes, spec, run=run, instance=instance,
                        scrape_s=scrape_s, progress=progress)


def replay_timed(events: list[tuple[float, dict]], scrapes: int, spec: Spec | None = None, run: str = "replay",
                 instance: str = INSTANCE, scrape_s: float = 60.0,
                 progress: Callable[[int, int], None] | None = None) -> Samples:
    """Like replay(), with each line's time given: (seconds since the start when it is written, line)."""
    spec = spec or load_spec()
    clock = {"now": 0.0}
    self_metrics = SelfMetrics(spec)
    store = TrainingStore(spec, self_metrics, {"run": run, "rank": RANK})
    samples = Samples(scrape_s)
    with tempfile.TemporaryDirectory(prefix="verl-exporter-replay-") as tmp:
        path = os.path.join(tmp, "run.jsonl")
        open(path, "wb").close()
        follower = VerlFileFollower(path, store, self_metrics, clock=lambda: clock["now"])
        follower.poll()  # the first open "recovers" an empty file: later lines get the simulated clock
        i = 0
        with open(path, "ab", buffering=0) as f:
            for m in range(scrapes):
                now = m * scrape_s
                while i < len(events) and events[i][0] <= now:
                    clock["now"], line = events[i]
                    f.write(json.dumps(line, allow_nan=False).encode() + b"\n")
                    follower.poll()
                    samples.step_end_s.append((int(line["step"]), events[i][0]))
                    i += 1
                    if progress:
                        progress(i, len(events))
                _sample(store, samples, m, run, instance)
        follower.stop()
    return samples


def _sample(store: TrainingStore, samples: Samples, m: int, run: str, instance: str) -> None:
    base = (("job", JOB), ("instance", instance), ("run", run), ("rank", RANK))
    up = ("up", (("job", JOB), ("instance", instance)))
    samples.series.setdefault(up, []).append(1.0)
    for metric, rows in store.series():
        if metric.name.startswith("verl_unmapped_"):
            continue  # no rule reads them
        for values, value in rows.items():
            key = (metric.name, base + tuple(zip(metric.labels, values, strict=True)))
            col = samples.series.setdefault(key, [])
            col.extend([None] * (m - len(col)))
            col.append(value)


# ---------------------------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class Firing:
    alert: str
    severity: str
    minute: int  # when it started firing (minutes since the run started)
    labels: tuple[tuple[str, str], ...]
    value: float | None


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def series_text(values: list[float | None]) -> str:
    """promtool's series notation, run-length compressed: '1x9 2x4 _x3'."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and (values[j + 1] is values[i] is None or (
                values[i] is not None and values[j + 1] is not None and values[j + 1] == values[i])):
            j += 1
        if values[i] is None:
            out.append("_" if j == i else f"_x{j - i + 1}")
        else:
            out.append(_fmt(values[i]) if j == i else f"{_fmt(values[i])}x{j - i}")
        i = j + 1
    return " ".join(out)


def _labels_text(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels)
    return f"{name}{{{inner}}}"


# A long run is evaluated in chunks of this many minutes (7 days), each after a warm-up long enough for every
# rule's windows, offsets and `for:` (see warmup_minutes), so promtool's time grows linearly with the run and
# its memory stays bounded; a run that fits one chunk is evaluated in one promtool call, as before.
CHUNK_MINUTES = 7 * 24 * 60
_DURATION = r"(\d+(?:ms|[smhdwy]))+"


def warmup_minutes(rule_texts: Iterable[str]) -> int:
    """Minutes of samples before a minute that decide every rule's state at it: twice the longest window plus
    offset (a recording rule's window feeding an alert's), the longest `for:`, and Prometheus' 5-minute
    lookback with room to spare."""
    def longest(pattern: str, text: str) -> int:
        found = [duration_seconds(m.group(1)) for m in re.finditer(pattern, text)]
        return max(found, default=0) // 60 + 1

    window = offset = hold = 0
    for text in rule_texts:
        window = max(window, longest(r"\[(" + _DURATION + r")(?::[^\]]*)?\]", text),
                     longest(r"\[[^\]:]*:(" + _DURATION + r")\]", text))
        offset = max(offset, longest(r"offset\s+(" + _DURATION + ")", text))
        hold = max(hold, longest(r"(?:for|keep_firing_for):\s*['\"]?(" + _DURATION + ")", text))
    return 2 * (window + offset) + hold + 10


def evaluate(samples: Samples, rules_dir: str | Path, promtool: str | None = None,
             minutes_firing: dict[str, int] | None = None, chunk_minutes: int = CHUNK_MINUTES,
             every_minute: bool = False) -> list[Firing]:
    """Every alert start (minute by minute) of the generated rules over the samples, with its value (with
    every_minute, every minute it fires, with that minute's value); when minutes_firing is given, it is filled
    with the minutes each alert (any of its label sets) fired. A run
    longer than chunk_minutes (plus the warm-up) is evaluated chunk by chunk: each chunk replays the warm-up
    before it and keeps only what starts inside it."""
    from ..core.models import read_yaml

    promtool = promtool or shutil.which("promtool")
    if promtool is None:
        raise RuntimeError("promtool is not installed (Debian: apt-get install prometheus)")
    if samples.scrape_s != 60:
        raise ValueError("evaluate() reads one sample a minute (scrape_s=60)")
    rules_dir = Path(rules_dir).resolve()
    # The alerting rules as the files hold them (not the spec): a backtest judges the rules it is given.
    recording_groups = read_yaml(rules_dir / "verl-recording.yaml")[0]["groups"]
    alert_groups = read_yaml(rules_dir / "verl-alerts.yaml")[0]["groups"]
    rules = [r for g in alert_groups for r in g["rules"] if "alert" in r]
    # promtool runs the groups of one minute in a random order unless told: recordings first, as written, so
    # that an alert reads this minute's recordings and a backtest gives the same answer every time
    order = [g["name"] for g in recording_groups + alert_groups] + ["backtest"]
    severity = {r["alert"]: r.get("labels", {}).get("severity", "") for r in rules}
    rule_labels = sorted({k for r in rules for k in r.get("labels", {})} | {"alertstate"})
    minutes = samples.length
    warm = warmup_minutes((rules_dir / name).read_text(encoding="utf-8")
                          for name in ("verl-recording.yaml", "verl-alerts.yaml"))
    out: list[Firing] = []
    with tempfile.TemporaryDirectory(prefix="verl-exporter-eval-") as tmp:
        # The value of each alert's expression, recorded beside it (the alert itself only says "firing").
        values_rules = [{"record": "backtest:alert_value",
                         "expr": f'label_replace({r["expr"]}, "alertname", "{r["alert"]}", "", "")'} for r in rules]
        values_file = Path(tmp) / "values.yaml"
        values_file.write_text(json.dumps({"groups": [{"name": "backtest", "rules": values_rules}]}))
        rule_files = [str(rules_dir / "verl-recording.yaml"), str(rules_dir / "verl-alerts.yaml"), str(values_file)]
        firing = 'ALERTS{alertstate="firing"}' + ("" if every_minute else
                                                  ' unless ALERTS{alertstate="firing"} offset 1m')
        starts = f'backtest:alert_value and ignoring({", ".join(rule_labels)}) ({firing})'
        bounds = [(0, minutes)] if minutes <= chunk_minutes + warm else \
            [(c, min(minutes, c + chunk_minutes)) for c in range(0, minutes, chunk_minutes)]
        for first, end in bounds:
            lo = max(0, first - warm)
            series = {key: v[lo:end] for key, v in samples.series.items()}
            fired = _evaluate_chunk(series, end - lo, first - lo, rule_files, order, starts, severity, promtool,
                                    Path(tmp) / "backtest-test.yaml", minutes_firing)
            out += [dataclasses.replace(f, minute=f.minute + lo) for f in fired]
    return out


def _evaluate_chunk(series: dict, minutes: int, first: int, rule_files: list[str], order: list[str], starts: str,
                    severity: dict[str, str], promtool: str, path: Path,
                    minutes_firing: dict[str, int] | None) -> list[Firing]:
    """The alert starts at minutes first..minutes-1 of one promtool run over minutes 0..minutes-1 (the
    minutes before first are the warm-up); minutes_firing gets the firing minutes from first on added."""
    doc = {
        "rule_files": rule_files,
        "evaluation_interval": "1m",
        "group_eval_order": order,
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": _labels_text(n, lab),
                              "values": series_text(v + [None] * (minutes - len(v)))}
                             for (n, lab), v in series.items()],
            "promql_expr_test": [{"expr": starts, "eval_time": f"{m}m", "exp_samples": []}
                                 for m in range(max(1, first), minutes)] + [
                # a range holds both its ends: a second short of the chunk's minutes counts them alone
                {"expr": f'sum by (alertname) (count_over_time(ALERTS{{alertstate="firing"}}'
                         f'[{(minutes - first) * 60 - 1}s]))',
                 "eval_time": f"{minutes - 1}m", "exp_samples": []}],
        }],
    }
    path.write_text(json.dumps(doc))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    out: list[Firing] = []
    minute, counting, answered = 0, False, False
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r'\s*expr: .*, ' + EVAL_TIME_RE + r'\s*$', line)
        if m:
            answered = True
            minute = int(duration_seconds(m.group(1).replace(".", "")) // 60)
            counting = "count_over_time" in line
            continue
        if counting:
            for alert, count in re.findall(r'alertname="(\w+)"\} ([^\s,\]]+)', line):
                if minutes_firing is not None:
                    minutes_firing[alert] = minutes_firing.get(alert, 0) + int(float(count))
            continue
        m = re.match(r"\s*got: (.*)", line) or re.match(r"\s*(\{.*\}) (\S+)$", line)
        if m:
            for labels_text, value in re.findall(r"(\{[^}]*\}) ([^\s,\]]+)", line):
                labels = tuple(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels_text))
                d = dict(labels)
                alert = d.get("alertname", "")
                out.append(Firing(alert, severity.get(alert, ""), minute,
                                  tuple((k, v) for k, v in labels if k != "alertname"), float(value)))
    if proc.returncode != 0 and not answered:  # promtool did not get as far as the queries
        raise RuntimeError(f"promtool failed: {(proc.stdout + proc.stderr)[-4000:]}")
    return out


def step_at(samples: Samples, minute: int) -> int | None:
    """The latest step logged by that minute (None before the first); a binary search, as a long run's
    timeline asks it once per alert start."""
    i = bisect.bisect_right(samples.step_end_s, minute * 60.0, key=lambda se: se[1])
    return samples.step_end_s[i - 1][0] if i else None
