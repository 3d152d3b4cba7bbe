#!/usr/bin/env python3
"""Generate the bundled demo replay of a verl PPO run (``demo_run.jsonl.gz``).

The output mimics what verl's file logger writes for a PPO-with-critic run on a
GSM8K-like math dataset: one line per training step, ``{"step": N, "data": {...}}``,
compact JSON, with NaN / +-Inf written as ``null`` (verl serialises with orjson,
which does that). The metric names and units follow verl's own computations
(``compute_data_metrics``, ``compute_timing_metrics``, ``compute_throughout_metrics``
and the actor / critic update metrics).

Simulated setup: 1280 prompts per step (n=1), 4 GPUs, max response length 1024
tokens, 100 steps per epoch, validation every 20 steps (4 samples per prompt),
a checkpoint every 50 steps.

The run is healthy until step 229: the score climbs along a sigmoid from ~0.15 to
~0.75, entropy falls slowly from ~1.2 to ~0.6, the critic's explained variance
rises from ~-0.5 to ~0.6, and responses grow from ~250 to ~400 tokens.

Injected fault (see ``FAULT``): a gradient explosion. Over steps 230-234
``actor/grad_norm`` climbs to ~40x its maximum over the previous 20 steps; at steps
235-237 it is NaN (written ``null``), as are ``actor/pg_loss`` and ``actor/loss``.
Afterwards the policy collapses: ``critic/score/mean`` falls towards ~0.05,
``response/aborted_ratio`` rises to ~0.3-0.5, ``response_length/mean`` falls towards
~20 tokens, ``actor/entropy`` falls towards ~0.05 and ``actor/ppo_kl`` and
``actor/kl_loss`` jump. From step 238 on ``actor/grad_norm`` is finite again but
large.

Quirks real files contain, so that a replay exercises them: step 100 carries an
extra string-valued key (``training/note``); integer counters
(``perf/total_num_tokens``, ``training/global_step``, ``training/epoch``,
``global_seqlen/min|max|minmax_diff``, ``training/rollout_probs_diff_valid``) are
written as JSON integers; ``timing_s/save_checkpoint`` and ``timing_s/testing`` and
the ``val-*`` keys appear only on the steps that do those things.

Everything is drawn from one ``random.Random(20261130)``, floats are rounded to 6
significant digits and the gzip header carries no name and mtime 0, so the output
is byte-for-byte reproducible.

Usage::

    python scripts/make_demo_run.py            # (re)write the bundled file
    python scripts/make_demo_run.py --check    # exit 1 if the bundled file is stale
    python scripts/make_demo_run.py --out x.jsonl.gz --steps 50
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import random
import sys
from pathlib import Path

SEED = 20261130
DEFAULT_STEPS = 300
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "exporter" / "verl_exporter" / "data" / "demo_run.jsonl.gz"

FAULT = {
    "start_step": 230,
    "description": (
        "Gradient explosion: actor/grad_norm climbs to ~40x its recent maximum over steps 230-234, "
        "is NaN (null) at steps 235-237 together with actor/pg_loss and actor/loss, then stays finite "
        "but large; the policy collapses afterwards (critic/score/mean -> ~0.05, "
        "response/aborted_ratio -> ~0.3-0.5, response_length/mean -> ~20 tokens, "
        "actor/entropy -> ~0.05, actor/ppo_kl and actor/kl_loss jump)."
    ),
}

# Simulated run configuration.
BATCH = 1280  # prompts (= responses, n=1) per step
N_GPUS = 4
MAX_RESPONSE_LEN = 1024
MAX_PROMPT_LEN = 512
STEPS_PER_EPOCH = 100
VAL_EVERY = 20
SAVE_EVERY = 50
LR = 1e-6
LR_WARMUP = 10
KL_COEF = 0.001
NAN_STEPS = range(FAULT["start_step"] + 5, FAULT["start_step"] + 8)  # 235-237
NOTE_STEP = 100
VAL_TAG = "openai/gsm8k"


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _round(x: float | int | str | None) -> float | int | str | None:
    """Round floats to 6 significant digits; non-finite floats become None (as orjson writes them)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.6g}")
    return x


def generate(steps: int = DEFAULT_STEPS) -> list[dict]:
    """Return the step records, ``[{"step": N, "data": {...}}, ...]`` for steps 1..steps."""
    rng = random.Random(SEED)
    g = rng.gauss
    fault_start = FAULT["start_step"]

    def lognoise(sigma: float) -> float:
        return math.exp(g(0.0, sigma))

    records: list[dict] = []
    grad_hist: list[float] = []
    value_mean = 0.02  # the critic's running estimate starts near zero
    cpu_mem = 82.0
    explode_mult = {0: 2.5, 1: 6.0, 2: 12.0, 3: 24.0, 4: 40.0}

    for step in range(1, steps + 1):
        t = float(step)
        # Collapse progress: 0 while healthy, a small precursor during the explosion, then -> 1.
        if step < fault_start + 2:
            c = 0.0
        elif step < fault_start + 5:
            c = 0.01 * (step - fault_start - 1)
        else:
            c = 1.0 - 0.9 * math.exp(-(step - fault_start - 5) / 4.0)
        # Shock: transient disturbance peaking right after the NaN steps.
        shock = 0.0 if step < fault_start + 5 else math.exp(-abs(step - fault_start - 6) / 6.0)

        def blend(healthy: float, collapsed: float, _c: float = c) -> float:
            return healthy * (1.0 - _c) + collapsed * _c

        # ---------------------------------------------------------------- rollout shape
        score_trend = 0.15 + 0.60 * (_sig((t - 90.0) / 25.0) - _sig(-3.6)) / (1.0 - _sig(-3.6))
        p_correct = _clamp(blend(score_trend + g(0.0, 0.012), 0.05 + g(0.0, 0.01)), 0.01, 0.97)
        n_correct = int(round(_clamp(p_correct * BATCH + g(0.0, math.sqrt(BATCH * 0.2)), 1, BATCH - 1)))
        score_mean = n_correct / BATCH

        aborted_p = blend(0.0012, 0.40 + g(0.0, 0.04))
        n_aborted = max(0, int(round(aborted_p * BATCH + g(0.0, 1.0 + 0.02 * BATCH * c))))
        if step < fault_start + 2 and rng.random() < 0.6:
            n_aborted = 0
        n_ok = BATCH - n_aborted

        len_trend = 250.0 + 150.0 * (1.0 - math.exp(-t / 120.0)) / (1.0 - math.exp(-300.0 / 120.0))
        ok_len_mean = blend(len_trend * (1.0 + g(0.0, 0.025)), 34.0 * (1.0 + g(0.0, 0.08)))
        clip_p = blend(_clamp(0.004 + 0.010 * (len_trend - 250.0) / 150.0 + g(0.0, 0.003), 0.0, 0.05), 0.0)
        n_clip = max(0, int(round(clip_p * n_ok + g(0.0, 1.0))))
        if c > 0.5:
            n_clip = 0
        resp_tokens = int(round(ok_len_mean * n_ok))
        resp_max = MAX_RESPONSE_LEN if n_clip else int(blend(rng.uniform(780, 1010), rng.uniform(140, 420)))
        ok_min = int(blend(rng.uniform(28, 62), rng.uniform(1, 4)))
        resp_min = 0 if n_aborted else ok_min

        prompt_mean = 131.0 + g(0.0, 1.6)
        prompt_tokens = int(round(prompt_mean * BATCH))
        prompt_mean = prompt_tokens / BATCH
        total_tokens = prompt_tokens + resp_tokens

        # ---------------------------------------------------------------- timings (seconds)
        tok = total_tokens
        gen = (10.0 + resp_tokens * 5.2e-5 + (4.0 if n_clip else 0.0) * (n_clip / 10.0)) * lognoise(0.04)
        timing = {
            "gen": gen,
            "reward": (0.7 + BATCH * 7e-4) * lognoise(0.08),
            "old_log_prob": (0.8 + tok * 6.0e-6) * lognoise(0.04),
            "ref": (0.8 + tok * 5.85e-6) * lognoise(0.04),
            "values": (0.8 + tok * 6.1e-6) * lognoise(0.04),
            "adv": (0.12 + tok * 3.2e-7) * lognoise(0.10),
            "update_critic": (1.5 + tok * 1.52e-5) * lognoise(0.03),
            "update_actor": (2.0 + tok * 1.68e-5) * lognoise(0.03),
            "update_weights": 1.2 * lognoise(0.06),
        }
        if step % SAVE_EVERY == 0:
            timing["save_checkpoint"] = rng.uniform(21.0, 29.0)
        is_val = step % VAL_EVERY == 0
        if is_val:
            timing["testing"] = blend(18.0 + 6.0 * (len_trend - 250.0) / 150.0, 7.0) * lognoise(0.05)
        step_time = sum(timing.values()) + rng.uniform(0.6, 1.4)

        # ---------------------------------------------------------------- actor
        progress = min(t, fault_start) / fault_start
        entropy = blend(0.6 + 0.6 * math.exp(-t / 95.0) + g(0.0, 0.015), 0.05 + abs(g(0.0, 0.01)))
        kl_loss = blend(0.001 + 0.049 * (min(t, 300.0) / 300.0) ** 1.4, 0.55) * lognoise(0.06)
        kl_loss += 0.6 * shock * lognoise(0.2)
        ppo_kl = (0.0015 + 0.004 * progress) * lognoise(0.35) + blend(0.0, 0.03)
        ppo_kl += 0.18 * shock * lognoise(0.3)
        pg_clipfrac = (0.004 + 0.008 * progress) * lognoise(0.25) + blend(0.0, 0.06) + 0.25 * shock
        pg_clipfrac_lower = 1e-4 * lognoise(0.6) + 0.004 * shock

        grad_base = (0.42 - 0.10 * progress) * lognoise(0.22)
        grad_base = _clamp(grad_base, 0.18, 0.62)
        if fault_start <= step < fault_start + 5:
            recent = max(grad_hist[-20:]) if grad_hist else 0.5
            grad_norm = recent * explode_mult[step - fault_start] * lognoise(0.05)
        elif step in NAN_STEPS:
            grad_norm = math.nan
        elif step >= fault_start + 8:
            grad_norm = (2.5 + 7.0 * math.exp(-(step - fault_start - 8) / 25.0)) * lognoise(0.3)
        else:
            grad_norm = grad_base
        if math.isfinite(grad_norm) and step < fault_start:
            grad_hist.append(grad_norm)

        pg_loss = g(-0.004, 0.018) * (1.0 + 4.0 * c) + 0.4 * shock * g(0.0, 1.0)
        if step in NAN_STEPS:
            pg_loss = math.nan
        loss = pg_loss + KL_COEF * kl_loss
        lr = LR * min(step, LR_WARMUP) / LR_WARMUP
        reward_kl = kl_loss * 0.85 * lognoise(0.05)

        mfu_actor = _clamp(blend(0.27 + 0.10 * (len_trend - 250.0) / 150.0, 0.16) + g(0.0, 0.008), 0.05, 0.6)
        mfu_critic = _clamp(mfu_actor * 0.93 + g(0.0, 0.006), 0.05, 0.6)
        mfu_infer = _clamp(blend(0.12 + 0.05 * (len_trend - 250.0) / 150.0, 0.05) + g(0.0, 0.006), 0.01, 0.5)

        # ---------------------------------------------------------------- critic
        ev = blend(0.6 - 1.1 * math.exp(-t / 40.0) + g(0.0, 0.03), -0.6 + g(0.0, 0.15))
        value_mean += (score_mean - value_mean) * (0.08 if step < 40 else 0.3) + g(0.0, 0.006)
        ret_var = score_mean * (1.0 - score_mean) + 0.01
        vf_loss = 0.5 * ret_var * max(0.05, 1.0 - ev) * lognoise(0.08)
        vf_clipfrac = (0.002 + 0.03 * math.exp(-t / 30.0)) * lognoise(0.3) + 0.08 * shock
        kl_per_seq = KL_COEF * reward_kl * max(1.0, ok_len_mean)
        adv_scale = 1.0 + 0.4 * c

        # ---------------------------------------------------------------- rollout/training mismatch
        pd_mean = blend(0.0032, 0.011) * lognoise(0.08)
        pd_std = blend(0.011, 0.045) * lognoise(0.08)
        pd_max = _clamp(blend(0.55, 0.93) * lognoise(0.12), 0.05, 0.999)

        # ---------------------------------------------------------------- memory
        mem_alloc = blend(43.0 + 9.0 * (len_trend - 250.0) / 150.0, 41.0) + g(0.0, 0.35)
        mem_reserved = mem_alloc + 5.5 + abs(g(0.0, 0.6))
        cpu_mem = _clamp(cpu_mem + 0.055 + g(0.0, 0.12), 80.0, 99.5)

        # ---------------------------------------------------------------- balance (per DP rank)
        seq_mean = total_tokens / N_GPUS
        diff = int(abs(g(0.0, 0.004)) * seq_mean) + rng.randint(20, 120)
        seq_min = int(seq_mean - diff * rng.uniform(0.3, 0.7))

        data: dict[str, float | int | str] = {
            "actor/entropy": entropy,
            "actor/entropy_loss": entropy * lognoise(0.004),
            "actor/kl_loss": kl_loss,
            "actor/kl_coef": KL_COEF,
            "actor/pg_loss": pg_loss,
            "actor/pg_clipfrac": pg_clipfrac,
            "actor/ppo_kl": ppo_kl,
            "actor/pg_clipfrac_lower": pg_clipfrac_lower,
            "actor/loss": loss,
            "actor/grad_norm": grad_norm,
            "actor/mfu": mfu_actor,
            "actor/lr": lr,
            "actor/reward_kl_penalty": reward_kl,
            "actor/reward_kl_penalty_coeff": KL_COEF,
            "critic/vf_loss": vf_loss,
            "critic/vf_clipfrac": vf_clipfrac,
            "critic/vpred_mean": value_mean + g(0.0, 0.004),
            "critic/grad_norm": (0.9 + 3.0 * math.exp(-t / 25.0)) * lognoise(0.2) * (1.0 + 6.0 * shock),
            "critic/mfu": mfu_critic,
            "critic/lr": 1e-5 * min(step, LR_WARMUP) / LR_WARMUP,
            "training/global_step": step,
            "training/epoch": (step - 1) // STEPS_PER_EPOCH,
            "training/rollout_probs_diff_valid": 1,
            "training/rollout_probs_diff_max": pd_max,
            "training/rollout_probs_diff_mean": pd_mean,
            "training/rollout_probs_diff_std": pd_std,
            "critic/score/mean": score_mean,
            "critic/score/max": 1.0,
            "critic/score/min": 0.0,
            "critic/rewards/mean": score_mean - kl_per_seq,
            "critic/rewards/max": 1.0 - KL_COEF * reward_kl * rng.uniform(20.0, 60.0),
            "critic/rewards/min": -KL_COEF * reward_kl * rng.uniform(200.0, 900.0) - 0.2 * KL_COEF * shock,
            "critic/advantages/mean": g(0.0, 4e-9),
            "critic/advantages/max": (3.4 + 1.2 * rng.random()) * adv_scale,
            "critic/advantages/min": -(3.1 + 1.4 * rng.random()) * adv_scale,
            "critic/returns/mean": score_mean - kl_per_seq * 0.5 + g(0.0, 0.006),
            "critic/returns/max": 1.0 + abs(g(0.0, 0.002)) + 0.05 * shock,
            "critic/returns/min": -KL_COEF * reward_kl * rng.uniform(150.0, 700.0) - 0.01,
            "critic/values/mean": value_mean,
            "critic/values/max": _clamp(value_mean + 0.55 + g(0.0, 0.05), 0.1, 1.4) + shock,
            "critic/values/min": value_mean - 0.55 + g(0.0, 0.05) - shock,
            "critic/vf_explained_var": ev,
            "response_length/mean": resp_tokens / BATCH,
            "response_length/max": resp_max,
            "response_length/min": resp_min,
            "response_length/clip_ratio": n_clip / BATCH,
            "response_length_non_aborted/mean": resp_tokens / n_ok,
            "response_length_non_aborted/max": resp_max,
            "response_length_non_aborted/min": ok_min,
            "response_length_non_aborted/clip_ratio": n_clip / n_ok,
            "response/aborted_ratio": n_aborted / BATCH,
            "prompt_length/mean": prompt_mean,
            "prompt_length/max": float(rng.randint(236, 262)),
            "prompt_length/min": float(rng.randint(54, 66)),
            "prompt_length/clip_ratio": 0.0,
            "global_seqlen/min": seq_min,
            "global_seqlen/max": seq_min + diff,
            "global_seqlen/minmax_diff": diff,
            "global_seqlen/mean": seq_mean,
        }
        # verl reports lengths as floats (torch .item() on float tensors).
        for key in (
            "response_length/max",
            "response_length/min",
            "response_length_non_aborted/max",
            "response_length_non_aborted/min",
        ):
            data[key] = float(data[key])

        for name, secs in timing.items():
            data[f"timing_s/{name}"] = secs
        data["timing_s/step"] = step_time
        data["timing_per_token_ms/gen"] = timing["gen"] * 1000.0 / max(1, resp_tokens)
        for name in ("ref", "values", "adv", "update_critic", "update_actor"):
            data[f"timing_per_token_ms/{name}"] = timing[name] * 1000.0 / total_tokens

        data["perf/total_num_tokens"] = total_tokens
        data["perf/time_per_step"] = step_time
        data["perf/throughput"] = total_tokens / (step_time * N_GPUS)
        data["perf/max_memory_allocated_gb"] = mem_alloc
        data["perf/max_memory_reserved_gb"] = mem_reserved
        data["perf/cpu_memory_used_gb"] = cpu_mem
        data["perf/mfu/actor"] = mfu_actor
        data["perf/mfu/critic"] = mfu_critic
        data["perf/mfu/actor_infer"] = mfu_infer

        if is_val:
            p = _clamp(score_mean - 0.03 + g(0.0, 0.012), 0.005, 0.97)
            data[f"val-core/{VAL_TAG}/reward/mean@4"] = p
            data[f"val-core/{VAL_TAG}/reward/best@4/mean"] = 1.0 - (1.0 - p) ** 2.1
            maj = _clamp(p + 0.025 * (1.0 - c) + g(0.0, 0.006), 0.0, 1.0)
            data[f"val-core/{VAL_TAG}/reward/maj@4/mean"] = maj
            data[f"val-aux/{VAL_TAG}/reward/std@4"] = 0.8 * math.sqrt(p * (1.0 - p)) * lognoise(0.03)
            data[f"val-aux/{VAL_TAG}/reward/best@4/std"] = 0.02 * math.sqrt(p * (1.0 - p)) * lognoise(0.1)
            data[f"val-aux/{VAL_TAG}/reward/worst@4/mean"] = p**2.1

        if step == NOTE_STEP:
            data["training/note"] = "resumed-from-ckpt"

        records.append({"step": step, "data": {k: _round(v) for k, v in data.items()}})
    return records


def encode(records: list[dict]) -> bytes:
    """Serialise records as verl's file logger does: compact JSON, one per line, NaN/Inf as null."""
    out = []
    for rec in records:
        data = {k: _round(v) for k, v in rec["data"].items()}
        out.append(json.dumps({"step": rec["step"], "data": data}, separators=(",", ":"), allow_nan=False))
        out.append("\n")
    return "".join(out).encode("utf-8")


def compress(raw: bytes) -> bytes:
    """Gzip with an empty file name and mtime 0 so the bytes are reproducible."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(raw)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output path (default: bundled file)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="number of steps (default 300)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file at --out is not up to date")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    blob = compress(encode(generate(args.steps)))
    if args.check:
        try:
            current = args.out.read_bytes()
        except FileNotFoundError:
            print(f"{args.out} is missing; run scripts/make_demo_run.py to create it", file=sys.stderr)
            return 1
        if current != blob:
            print(
                f"{args.out} is out of date with scripts/make_demo_run.py; "
                "run scripts/make_demo_run.py to regenerate it",
                file=sys.stderr,
            )
            return 1
        print(f"{args.out} is up to date ({len(blob)} bytes)")
        return 0

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(blob)
    print(f"wrote {args.out} ({args.steps} steps, {len(blob)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
