#!/usr/bin/env python3
"""Write the alert pack's scenario tests (``rules/scenarios/scenarios-test.yaml``): whole verl runs replayed as
promtool input series.

Where ``rules/tests/generated-test.yaml`` checks each alert against two or three hand-made series, the
scenarios replay six hours of a realistic run, one sample a minute, the way Prometheus would scrape it:

* the driver's sidecar (rank 0, ``node0:9477``) serves verl's logged metrics. Steps are simulated one by one
  (about 55 s each, longer on validation and checkpoint steps, the first one slower) and the gauges are
  sampled every minute, so a minute may show no new step or skip one, as a real scrape does;
* four ranks on two nodes (``node0:9477``, ``node0:9478``, ``node1:9477``, ``node1:9478``, GPUs 0 and 1)
  serve their GPU's NVML series; the first sidecar of each node serves the host's disk and filesystem;
* the checkpoint collector on the driver sees a save every 50 steps (three kept);
* Prometheus's own ``up`` is 1 for each sidecar.

Cases:

* ``clean PPO run`` and ``clean GRPO run``: every alert of the spec must stay silent at every check time
  (at 5m, then every 10 minutes to the end). An alert known to fire on a healthy run is left out at the
  times it fires and listed in ``KNOWN_CLEAN_FIRING`` (with the evidence) until its rule is fixed.
* one case per failure the pack covers, injected into the clean PPO run at ``F`` (120m unless said): the
  intended alert is silent at F-1m and fires, with its full labels and annotations, at F + its detection
  delay + its ``for`` + 2m. The detection delay (how long after F the rule's condition first holds: a step
  to be logged, a window to fill or drain) is computed here from the series by a small Python replica of
  the rule's condition, and written in a comment above the check; promtool is the judge.

Everything is drawn from ``random.Random`` instances seeded from ``SEED`` and a name, values are rounded
before use, and the file is written byte for byte the same every time. Series are checked against the spec:
the script fails on a name that is not a spec metric (or Prometheus's ``up``), or on labels other than job,
instance, the target labels (run, rank) and the metric's own.

Usage::

    python scripts/make_scenarios.py             # (re)write rules/scenarios/scenarios-test.yaml
    python scripts/make_scenarios.py --check     # exit 1 if the committed file is not up to date
    python scripts/make_scenarios.py --discover  # every alert that fires on the clean runs, minute by minute
    python scripts/make_scenarios.py --only nan-loss  # one failure alone, series in full, to stdout
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "exporter"))

from verl_exporter.render.promql import MIN_SAMPLES  # noqa: E402
from verl_exporter.render.rule_tests import expand  # noqa: E402
from verl_exporter.render.rules import runbook_url  # noqa: E402
from verl_exporter.render.templating import to_yaml  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.spec.rules import Alert, duration_seconds  # noqa: E402
from verl_exporter.tools.replay import replay_timed  # noqa: E402

OUT = REPO / "rules" / "scenarios" / "scenarios-test.yaml"
RULE_FILES = ("verl-recording.yaml", "verl-alerts.yaml")
SEED = 20260917
END = 360  # minutes: the clean runs are sampled at minutes 0..END
F = 120  # minute at which a failure starts: 2 h in, the 1h baselines have filled (and the 2h ones mostly)
CLEAN_CHECKS = [5] + list(range(10, END + 1, 10))  # minutes at which the clean runs are checked
MARGIN = 2  # evaluation intervals between "the alert should fire" and the check
JOB = "verl"


def q(value) -> str:
    """A YAML scalar, always quoted, as the generator's templates write one."""
    return to_yaml(value, quoted=True)


GIB = 1024**3
MIB = 1024**2
GPU_TOTAL = 85520809984  # NVML's total memory of an H100 80GB HBM3 (81559 MiB)
FS_SIZE = 7001593487360  # the nodes' local NVMe holding /ckpt
CKPT_PATH = "/ckpt"
DISK = "nvme0n1"
DISK_IO_TIME_AT_START = 51234.5  # seconds of I/O time since the node booted, when the sidecars start
VAL_LABELS = {"kind": "core", "data_source": "openai/gsm8k", "variable": "reward", "stat": "mean@1"}
CHECKPOINT_GRACE_S = 900  # the sidecar's default --checkpoint-grace
KEEP_CHECKPOINTS = 3  # trainer.max_actor_ckpt_to_keep
LINKS = ("0", "1", "2", "3")  # NVLink links exported per GPU (an H100 has 18; four keep the file small)
# (instance, rank, gpu) of the four sidecars; the first of each node also runs the host collectors.
RANKS = (("node0:9477", "0", "0"), ("node0:9478", "1", "1"), ("node1:9477", "2", "0"), ("node1:9478", "3", "1"))
HOST_RANKS = ("0", "2")

# Alerts that fire on a realistic clean run, with the minutes (first, last) they fire at and the evidence.
# They are left out of the committed checks at those minutes, so that CI stays green until the rule is
# fixed; tests/test_scenarios.py checks every minute of the clean runs and fails when this list is no longer
# exact (a fixed rule: delete its entry; a new false alarm: fix the rule).
KNOWN_CLEAN_FIRING: dict[str, dict[str, tuple[tuple[int, int], str]]] = {
    "clean PPO run": {},
    "clean GRPO run": {},
}


# ---------------------------------------------------------------------------------------------- helpers
def rng_for(*parts: object) -> random.Random:
    """An independent, reproducible stream per series (str seeds hash with SHA-512, not PYTHONHASHSEED)."""
    return random.Random(":".join([str(SEED), *map(str, parts)]))


def clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def sig4(x: float) -> float:
    """Four significant digits: what the file holds, and so what every computation here uses."""
    return x if not math.isfinite(x) else float(f"{x:.4g}")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]


def key(name: str, labels: dict[str, str]) -> Key:
    return name, tuple(labels.items())


# ---------------------------------------------------------------------------------------------- the run model
@dataclass(frozen=True)
class Profile:
    """What kind of run: sizes, speeds and the shape of its curves."""

    kind: str
    run: str
    critic: bool
    prompts: int  # prompts per step
    n: int  # responses per prompt
    prompt_len: float
    len0: float  # mean response length at the start, and its rise along a sigmoid
    len_gain: float
    len_mid: float
    gen0: float  # timing_s/gen = (gen0 + gen_per_token * mean length) * noise
    gen_per_token: float
    actor_s_per_token: float  # timing_s/update_actor per token of the batch
    weights_s: float  # timing_s/update_weights
    other_s: float  # the other phases (old_log_prob, ref, values, update_critic, adv, reward)
    testing_s: float
    save_s: float
    mfu: float  # perf/mfu/actor at nominal speed
    mem_gib: float  # perf/max_memory_reserved_gb
    ckpt_bytes_per_node: float
    kl0: float  # kl_loss: kl0 + kl_gain * (1 - exp(-step / kl_tau))
    kl_gain: float
    kl_tau: float
    ent0: float  # entropy: ent_end + (ent0 - ent_end) * exp(-step / ent_tau)
    ent_end: float
    ent_tau: float
    score0: float  # critic/score/mean: score0 + score_gain * sigmoid((step - score_mid) / 45)
    score_gain: float
    score_mid: float
    val0: float
    val_gain: float
    val_mid: float
    gpus: int = 4
    save_every: int = 50
    val_every: int = 20
    start_s: float = 150.0  # model loading, rollout engine start-up and validation before training


PPO = Profile(kind="ppo", run="ppo-gsm8k", critic=True, prompts=256, n=1, prompt_len=180, len0=240, len_gain=170,
              len_mid=180, gen0=5.0, gen_per_token=0.05, actor_s_per_token=1.15e-4, weights_s=2.5, other_s=12.0,
              testing_s=25.0, save_s=45.0, mfu=0.38, mem_gib=58.5, ckpt_bytes_per_node=8.4e10, kl0=0.001,
              kl_gain=0.049 / (1 - math.exp(-400 / 250)), kl_tau=250, ent0=1.2, ent_end=0.55, ent_tau=130,
              score0=0.15, score_gain=0.6, score_mid=150, val0=0.18, val_gain=0.58, val_mid=160)
GRPO = Profile(kind="grpo", run="grpo-gsm8k", critic=False, prompts=64, n=5, prompt_len=150, len0=280,
               len_gain=240, len_mid=200, gen0=6.0, gen_per_token=0.045, actor_s_per_token=9e-5, weights_s=2.5,
               other_s=8.0, testing_s=30.0, save_s=30.0, mfu=0.41, mem_gib=64.2, ckpt_bytes_per_node=4.2e10,
               kl0=0.0002, kl_gain=0.03, kl_tau=120, ent0=1.05, ent_end=0.45, ent_tau=110, score0=0.1,
               score_gain=0.62, score_mid=140, val0=0.15, val_gain=0.6, val_mid=150)

# The driver's logged keys: (state key, verl key, divisor). They are written as verl's file logger would and
# replayed through the real follower, store, mapper and detectors (verl_exporter.tools.replay): no series is
# made here by hand for the driver.
VERL_KEYS = (
    ("grad", "actor/grad_norm", 1.0),
    ("pg_loss", "actor/pg_loss", 1.0),
    ("kl", "actor/kl_loss", 1.0),
    ("ppo_kl", "actor/ppo_kl", 1.0),
    ("entropy", "actor/entropy", 1.0),
    ("clipfrac", "actor/pg_clipfrac", 1.0),
    ("score", "critic/score/mean", 1.0),
    ("vf_loss", "critic/vf_loss", 1.0),
    ("vf_ev", "critic/vf_explained_var", 1.0),
    ("len", "response_length/mean", 1.0),
    ("clip", "response_length/clip_ratio", 1.0),
    ("aborted", "response/aborted_ratio", 1.0),
    ("step_s", "timing_s/step", 1.0),
    ("gen", "timing_s/gen", 1.0),
    ("update_actor", "timing_s/update_actor", 1.0),
    ("update_weights", "timing_s/update_weights", 1.0),
    ("gen_ms_per_token", "timing_per_token_ms/gen", 1.0),
    ("agent_mean", "timing_s/agent_loop/generate_sequences/mean", 1.0),
    ("throughput", "perf/throughput", 1.0),
    ("mfu", "perf/mfu/actor", 1.0),
    ("mem", "perf/max_memory_reserved_gb", GIB),
    ("val", "val-core/openai/gsm8k/reward/mean@1", 1.0),
)
NONFINITE = "verl_training_nonfinite_values_total"


def draw_state(p: Profile, i: int, rng: random.Random) -> dict[str, float]:
    """The primary quantities of step i. Always the same draws for the same step, whatever a fault does."""
    g = rng.gauss
    s: dict[str, float] = {}
    s["len"] = p.len0 + p.len_gain * sigmoid((i - p.len_mid) / 60) + g(0, 8)
    s["clip_noise"] = abs(g(0, 0.004))
    s["entropy"] = (p.ent_end + (p.ent0 - p.ent_end) * math.exp(-i / p.ent_tau)) * (1 + g(0, 0.03))
    s["score"] = clamp(p.score0 + p.score_gain * sigmoid((i - p.score_mid) / 45) + g(0, 0.025), 0.0, 1.0)
    s["kl"] = max(0.0, (p.kl0 + p.kl_gain * (1 - math.exp(-i / p.kl_tau))) * (1 + g(0, 0.08)))
    s["ppo_kl"] = 0.0015 * (1 + g(0, 0.3))
    spike = 2.5 if rng.random() < 0.02 else 1.0
    s["grad"] = (0.25 + 0.5 * math.exp(-i / 600)) * math.exp(g(0, 0.2)) * spike
    s["pg_loss"] = g(-0.004, 0.015)
    s["clipfrac"] = 0.004 + 0.003 * i / 400 + abs(g(0, 0.0015))
    aborted = rng.uniform(0.001, 0.004)
    s["aborted"] = aborted if rng.random() < 0.15 else 0.0
    vf_noise, ev_noise = g(0, 0.1), g(0, 0.03)
    if p.critic:
        s["vf_loss"] = (0.35 * math.exp(-i / 120) + 0.04) * (1 + vf_noise)
        s["vf_ev"] = -0.4 + (1 - math.exp(-i / 80)) + ev_noise
    s["mem_gib"] = p.mem_gib + g(0, 0.04)
    warm = i == 1  # the first step compiles kernels and captures CUDA graphs
    s["gen_x"] = (1 + g(0, 0.04)) * (1.5 if warm else 1.0)
    s["actor_x"] = (1 + g(0, 0.03)) * (1.6 if warm else 1.0)
    s["weights_x"] = (1 + g(0, 0.05)) * (3.0 if warm else 1.0)
    s["other_x"] = 1 + g(0, 0.05)
    s["agent_x"] = 1 + g(0, 0.03)
    s["other_extra"] = 0.0
    val = p.val0 + p.val_gain * sigmoid((i - p.val_mid) / 50) + g(0, 0.012)
    if i == 1 or i % p.val_every == 0:  # i == 1 stands for the validation before training
        s["val"] = val
    return s


def derive(p: Profile, i: int, s: dict[str, float]) -> None:
    """Timings, throughput and MFU from the (possibly faulty) primary quantities, as verl computes them."""
    tokens = p.prompts * p.n * (p.prompt_len + s["len"])
    s.setdefault("clip", clamp(0.004 + 0.03 * (s["len"] - p.len0) / p.len_gain + s["clip_noise"], 0.0, 1.0))
    s["gen"] = (p.gen0 + p.gen_per_token * s["len"]) * s["gen_x"]
    # per-sample latency of the agent loop: all requests of the batch are in flight together
    s["agent_mean"] = 0.55 * s["gen"] * s["agent_x"]
    s["gen_ms_per_token"] = 1000 * s["gen"] / (p.prompts * p.n * max(s["len"], 1.0))
    s["update_actor"] = p.actor_s_per_token * tokens * s["actor_x"]
    s["update_weights"] = p.weights_s * s["weights_x"]
    extra = (p.testing_s if "val" in s else 0.0) + (p.save_s if i % p.save_every == 0 else 0.0)
    s["step_s"] = s["gen"] + s["update_actor"] + s["update_weights"] + p.other_s * s["other_x"] + s["other_extra"] \
        + extra
    s["throughput"] = tokens / (s["step_s"] * p.gpus)
    s["mfu"] = p.mfu * p.actor_s_per_token * tokens / s["update_actor"]
    s["mem"] = s["mem_gib"] * GIB


@dataclass
class Step:
    index: int
    start: float  # seconds since the sidecars started
    end: float
    data: dict[str, float | None]  # the line verl logs (NaN as null)


@dataclass
class Fault:
    """How a failure changes a run. Every hook sees minutes or seconds since the sidecars started."""

    state: Callable[[int, float, dict], None] | None = None  # (step, start s, state) before derive()
    stop_at: float | None = None  # minute after which no step completes (a hang)
    ckpt: Callable[[int, float], str] | None = None  # (step, end s) -> ok | skip | partial | corrupt
    post: Callable[[Run], None] | None = None  # edits of the per-minute series (GPU, host, up)


@dataclass
class Run:
    profile: Profile
    length: int  # samples per series (minutes 0..length-1)
    series: dict[Key, list[float | None]] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)

    def labels(self, rank: str, **extra: str) -> dict[str, str]:
        instance = next(r[0] for r in RANKS if r[1] == rank)
        return {"job": JOB, "instance": instance, "run": self.profile.run, "rank": rank, **extra}

    def add(self, name: str, labels: dict[str, str], values: list[float | None]) -> None:
        assert len(values) == self.length, (name, len(values))
        self.series[key(name, labels)] = values

    def find(self, name: str, **match: str) -> Key:
        hits = [k for k in self.series if k[0] == name and match.items() <= dict(k[1]).items()]
        if len(hits) != 1:
            raise KeyError(f"{name}{match}: {len(hits)} series")
        return hits[0]

    def s(self, name: str, **match: str) -> list[float | None]:
        return self.series[self.find(name, **match)]

    def out_labels(self, name: str, **match: str) -> dict[str, str]:
        return dict(self.find(name, **match)[1])


def simulate(p: Profile, fault: Fault, length: int) -> list[Step]:
    rng = rng_for(p.kind, "steps")
    steps: list[Step] = []
    t, i = p.start_s, 0
    horizon = (length - 1) * 60.0
    while True:
        i += 1
        if fault.stop_at is not None and t >= fault.stop_at * 60:
            break
        s = draw_state(p, i, rng)
        if fault.state:
            fault.state(i, t, s)
        derive(p, i, s)
        end = t + s["step_s"]
        if end > horizon:
            break
        data: dict[str, float | None] = {}
        for state_key, verl_key, divisor in VERL_KEYS:
            if state_key in s:
                v = s[state_key] / divisor
                data[verl_key] = None if math.isnan(v) else sig4(v)
        steps.append(Step(i, t, end, data))
        t = end
    return steps


def sample_driver(run: Run) -> None:
    """The driver's sidecar follows the log on the replay engine's simulated clock; Prometheus scrapes it every
    minute (a minute may show no new step or skip one, as a real scrape does)."""
    events = [(float(round(st.end)), {"step": st.index, "data": st.data}) for st in run.steps]
    samples = replay_timed(events, run.length, run=run.profile.run, instance=RANKS[0][0])
    for (name, labels), values in samples.series.items():
        if name == "up":
            continue  # build_run adds Prometheus's up for every sidecar
        run.add(name, dict(labels), values + [None] * (run.length - len(values)))


def power_cap_pattern(rng: random.Random, length: int) -> list[float]:
    """sw_power_cap flips on and off under full load; never on for 30 minutes in a row."""
    out: list[float] = []
    on = rng.random() < 0.3
    while len(out) < length:
        n = rng.randint(2, 18) if on else rng.randint(5, 40)
        out += [1.0 if on else 0.0] * n
        on = not on
    return out[:length]


def add_gpu_series(run: Run) -> None:
    p, n = run.profile, run.length
    for _, rank, gpu in RANKS:
        rng = rng_for(p.kind, "gpu", rank)
        lab = run.labels(rank, gpu=gpu)
        run.add("verl_gpu_up", lab, [1.0] * n)
        run.add("verl_gpu_utilization_ratio", lab,
                [round(clamp(rng.gauss(0.925, 0.028), 0.85, 0.98), 2) for _ in range(n)])
        run.add("verl_gpu_memory_used_bytes", lab,
                [float(round(GPU_TOTAL * clamp(rng.gauss(0.895, 0.012), 0.86, 0.93) / MIB) * MIB) for _ in range(n)])
        run.add("verl_gpu_memory_total_bytes", lab, [float(GPU_TOTAL)] * n)
        run.add("verl_gpu_clock_event_active", {**lab, "reason": "sw_power_cap"}, power_cap_pattern(rng, n))
        run.add("verl_gpu_clock_event_active", {**lab, "reason": "hw_thermal_slowdown"}, [0.0] * n)
        run.add("verl_gpu_ecc_errors_total", {**lab, "error": "uncorrected", "counter": "volatile"}, [0.0] * n)
        run.add("verl_gpu_row_remap_pending", lab, [0.0] * n)
        run.add("verl_gpu_row_remap_failed", lab, [0.0] * n)
        for link in LINKS:
            run.add("verl_gpu_nvlink_link_up", {**lab, "link": link}, [1.0] * n)
        run.add("verl_gpu_nvlink_links_down", lab, [0.0] * n)
        run.add("verl_gpu_nvlink_errors_total", {**lab, "type": "replay"},
                [float(sum(rng.choice((0, 0, 0, 1, 2, 7)) for _ in LINKS))] * n)


@dataclass
class Save:
    step: int
    start: float
    end: float
    status: str  # ok | skip | partial | corrupt


def saves_of(run: Run, fault: Fault) -> list[Save]:
    p = run.profile
    out = []
    for st in run.steps:
        if st.index % p.save_every == 0:
            status = fault.ckpt(st.index, st.end) if fault.ckpt else "ok"
            out.append(Save(st.index, st.end - p.save_s, st.end, status))
    return out


def add_host_series(run: Run, saves: list[Save]) -> None:
    p, n = run.profile, run.length
    for rank in HOST_RANKS:
        rng = rng_for(p.kind, "host", rank)
        # The disk's I/O time counter (seconds since boot): each minute adds the share of it the disk was busy,
        # most during a checkpoint save.
        io_time = [DISK_IO_TIME_AT_START]
        for m in range(1, n):
            saving = any(s.status != "skip" and s.start < m * 60 and s.end > (m - 1) * 60 for s in saves)
            busy = round(rng.uniform(0.6, 0.93) if saving else rng.uniform(0.005, 0.05), 3)
            io_time.append(round(io_time[-1] + 60 * busy, 3))
        run.add("verl_host_disk_io_time_seconds_total", run.labels(rank, device=DISK), io_time)
        avail0 = 4.15e12 if rank == "0" else 4.32e12
        written = [s for s in saves if s.status != "skip"]
        avail = []
        for m in range(n):
            t = m * 60
            used = 2.0e7 * m  # rollout dumps and logs
            for j, save in enumerate(written):
                # verl deletes the oldest checkpoint when a save starts with max_ckpt_to_keep already kept,
                # then writes the new one: free space saw-tooths around each save
                deleted = j + KEEP_CHECKPOINTS < len(written) and written[j + KEEP_CHECKPOINTS].start <= t
                if save.start < t and not deleted:
                    used += p.ckpt_bytes_per_node * min(1.0, (t - save.start) / (save.end - save.start))
            avail.append(float(round((avail0 - used) / 4096) * 4096))
        lab = run.labels(rank, path=CKPT_PATH)
        run.add("verl_host_filesystem_avail_bytes", lab, avail)
        run.add("verl_host_filesystem_size_bytes", lab, [float(FS_SIZE)] * n)


def add_checkpoint_series(run: Run, saves: list[Save]) -> None:
    n = run.length
    base = run.labels("0")
    written = [s for s in saves if s.status != "skip"]
    if not written:
        return
    first = math.ceil(written[0].start / 60)  # the directory appears with the first save
    latest: list[float | None] = [None] * n
    incomplete: list[float | None] = [None] * n
    for m in range(first, n):
        done = [s for s in written if s.end <= m * 60 and s.status in ("ok", "corrupt")]
        if done:
            latest[m] = float(round(done[-1].end))
        started = [s for s in written if s.start <= m * 60]
        newest = started[-1] if started else None
        partial = newest is not None and newest.status == "partial" and m * 60 - newest.start > CHECKPOINT_GRACE_S
        incomplete[m] = 1.0 if partial else 0.0
    run.add("verl_checkpoint_latest_timestamp_seconds", base, latest)
    run.add("verl_checkpoint_incomplete", base, incomplete)
    manifested = [s for s in written if s.status in ("ok", "corrupt")]
    for k, save in enumerate(manifested):
        retired_by = manifested[k + KEEP_CHECKPOINTS] if k + KEEP_CHECKPOINTS < len(manifested) else None
        values: list[float | None] = [None] * n
        for m in range(math.floor(save.end / 60) + 2, n):  # verified on the next slow pass
            if retired_by is not None and retired_by.end <= m * 60:
                break
            values[m] = 0.0 if save.status == "corrupt" else 1.0
        if any(v is not None for v in values):
            run.add("verl_checkpoint_manifest_verified", {**base, "step": str(save.step)}, values)


def build_run(p: Profile, fault: Fault | None = None, length: int = END + 1) -> Run:
    fault = fault or Fault()
    run = Run(p, length)
    run.steps = simulate(p, fault, length)
    sample_driver(run)
    add_gpu_series(run)
    saves = saves_of(run, fault)
    add_host_series(run, saves)
    add_checkpoint_series(run, saves)
    for instance, _, _ in RANKS:
        run.add("up", {"job": JOB, "instance": instance}, [1.0] * length)
    if fault.post:
        fault.post(run)
    return run


# ---------------------------------------------------------------------------------------------- PromQL replica
# Just enough of PromQL's semantics (Prometheus 2.x) to find when a rule's condition first holds and the
# exact $value it reports: instant selectors look back 5 minutes, ranges are closed [t - w, t].
Values = list[float | None]


def inst(v: Values, m: int) -> float | None:
    for k in range(m, m - 6, -1):
        if 0 <= k < len(v) and v[k] is not None:
            return v[k]
    return None


def rate(v: Values, m: int, w: int) -> float | None:
    """rate(c[w]) at minute m, extrapolated as Prometheus 2.x does (counter resets included)."""
    pts = [(k * 60.0, v[k]) for k in range(max(m - w, 0), min(m, len(v) - 1) + 1) if v[k] is not None]
    if len(pts) < 2:
        return None
    result = pts[-1][1] - pts[0][1]
    last = 0.0
    for _, x in pts:
        if x < last:
            result += last
        last = x
    to_start, to_end = pts[0][0] - (m - w) * 60.0, m * 60.0 - pts[-1][0]
    sampled = pts[-1][0] - pts[0][0]
    average = sampled / (len(pts) - 1)
    if result > 0 and pts[0][1] >= 0:
        to_start = min(to_start, sampled * (pts[0][1] / result))
    threshold = average * 1.1
    interval = sampled + (to_start if to_start < threshold else average / 2)
    interval += to_end if to_end < threshold else average / 2
    return result * (interval / sampled) / (w * 60.0)


def window(v: Values, m: int, w: int, offset: int = 0) -> list[float]:
    end = m - offset
    return [v[k] for k in range(max(end - w, 0), min(end, len(v) - 1) + 1) if v[k] is not None]


def avg(xs: list[float]) -> float:
    """avg_over_time as Prometheus 2.x computes it (an incremental mean)."""
    mean, count = 0.0, 0.0
    for x in xs:
        count += 1
        mean += x / count - mean / count
    return mean


def stddev(xs: list[float]) -> float:
    count, mean, aux = 0.0, 0.0, 0.0
    for x in xs:
        count += 1
        delta = x - mean
        mean += delta / count
        aux += delta * (x - mean)
    return math.sqrt(aux / count)


def vmax(xs: list[float]) -> float | None:
    finite = [x for x in xs if not math.isnan(x)]
    return max(finite) if finite else None


def regression(v: Values, m: int, w: int) -> tuple[float, float] | None:
    """(slope per second, value at minute m) of the least-squares line over [m - w, m]."""
    pts = [(k * 60.0 - m * 60.0, v[k]) for k in range(max(m - w, 0), min(m, len(v) - 1) + 1) if v[k] is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    sx = sum(x for x, _ in pts)
    sy = sum(y for _, y in pts)
    sxy = sum(x * y for x, y in pts)
    sxx = sum(x * x for x, _ in pts)
    slope = (sxy - sx * sy / n) / (sxx - sx * sx / n)
    return slope, sy / n - slope * sx / n


def zscore(v: Values, m: int, w: int, lag: int, rel_floor: float = 0.05) -> float | None:
    """The adaptive rules' score: x against the recorded mean and stddev of [t - lag - w, t - lag]."""
    x, base = inst(v, m), window(v, m, w, lag)
    if x is None or len(base) < MIN_SAMPLES:
        return None
    mu = avg(base)
    return (x - mu) / (stddev(base) + rel_floor * abs(mu) + 1e-9)


def born_or_increased(v: Values, m: int, w: int = 10) -> bool:
    """`increase(c[w]) > 0 or (c unless c offset w)`."""
    now = inst(v, m)
    if now is None:
        return False
    xs = window(v, m, w)
    return (len(xs) >= 2 and xs[-1] > xs[0]) or inst(v, m - w) is None


def quantile(q: float, xs: list[float]) -> float:
    xs = sorted(xs)
    rank = q * (len(xs) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    weight = rank - lo
    return xs[lo] * (1 - weight) + xs[hi] * weight


# ---------------------------------------------------------------------------------------------- scenarios
@dataclass
class Expect:
    """One alert (one label set) a failure must raise."""

    alert: str
    labels: dict[str, str]  # the alert's labels from the expression (alertname and the rule's own labels added)
    cond: Callable[[int], bool]  # the rule's condition at minute m
    why: str  # what the detection delay waits for
    value: Callable[[int], float] | None = None  # $value at minute m
    computed: bool = False  # $value is computed (a ratio, a mean), not a sample as written in the file


@dataclass
class Scenario:
    slug: str
    title: str
    fault: Fault
    expects: Callable[[Run], list[Expect]]
    at: int = F


def after(minute: int, fn: Callable[[int, float, dict], None]) -> Callable[[int, float, dict], None]:
    """A step hook for the steps that start at or after `minute`; fn gets the number of faulty steps so far."""
    first: list[int] = []

    def hook(i: int, start: float, s: dict) -> None:
        if start >= minute * 60:
            if not first:
                first.append(i)
            fn(i - first[0], start, s)
    return hook


def edit(run: Run, name: str, start: int, fn: Callable[[int, float | None], float | None], **match: str) -> None:
    """Rewrite one per-minute series from minute `start` on: fn(minutes since start, old value)."""
    v = run.s(name, **match)
    for m in range(start, run.length):
        v[m] = fn(m - start, v[m])


def silence_instance(run: Run, instance: str, start: int) -> None:
    """A sidecar that cannot be scraped: its series end (Prometheus marks them stale) and up is 0."""
    for (name, labels), v in run.series.items():
        if dict(labels).get("instance") == instance:
            for m in range(start, run.length):
                v[m] = 0.0 if name == "up" else None


def scenarios() -> list[Scenario]:
    out: list[Scenario] = []
    alerts = {a.alert: a for a in load_spec().alerts()}

    def threshold(alert: str) -> float:
        return float(alerts[alert].threshold)

    def detector(alert: str, why: str) -> Callable[[Run], Expect]:
        """A detector alert's condition on the step-domain gauges, with its signal, k and change from the spec."""
        a = alerts[alert]
        stat = "verl_detector_sustained_drop_zscore" if a.direction == "down" else \
            "verl_detector_sustained_rise_zscore"
        sign = -1 if a.direction == "down" else 1

        def make(run: Run) -> Expect:
            z = run.s(stat, signal=a.signal)
            rel = run.s("verl_detector_relative_change", signal=a.signal) if a.change else None

            def cond(m: int) -> bool:
                if (inst(z, m) or 0) <= a.k:
                    return False
                return rel is None or (inst(rel, m) or 0) * sign > a.change
            return Expect(alert, run.out_labels(stat, signal=a.signal), cond, why, lambda m: inst(z, m))
        return make

    def add(slug: str, title: str, fault: Fault, expects: Callable[[Run], list[Expect]], at: int = F) -> None:
        out.append(Scenario(slug, title, fault, expects, at))

    # -------------------------------------------------------------------- training health (driver series)
    explode = (12, 19, 27, 36, 44)
    grad_base = build_run(PPO).s("verl_actor_grad_norm")
    prior_max = vmax(window(grad_base, F, 60))

    def grad_explodes(k: int, start: float, s: dict) -> None:
        if k < len(explode):
            s["grad"] = prior_max * explode[k]
        elif k < len(explode) + 3:
            s["grad"] = math.nan
        else:
            s["grad"] *= 8

    def spike_expect(run: Run) -> Expect:
        r = run.s("verl_detector_spike_ratio", signal="grad_norm")
        return Expect("VerlGradNormSpike", run.out_labels("verl_detector_spike_ratio", signal="grad_norm"),
                      lambda m: (inst(r, m) or 0) > 10,
                      "the first exploding step to be logged (over 10x the window's largest)", lambda m: inst(r, m))

    def nonfinite_expect(run: Run, alert: str, metric: str, why: str) -> Expect:
        c = run.s(NONFINITE, metric=metric)
        return Expect(alert, run.out_labels(NONFINITE, metric=metric), lambda m: born_or_increased(c, m), why)

    add("nan-grad-norm", "the gradient norm explodes over 5 steps, then is NaN (null) for 3 steps",
        Fault(state=after(F, grad_explodes)),
        lambda run: [spike_expect(run),
                     nonfinite_expect(run, "VerlNonFiniteGradNorm", "verl_actor_grad_norm",
                                      "5 exploding steps, then the first NaN step to be logged")])

    def nan_loss(k: int, start: float, s: dict) -> None:
        if k < 2:
            s["pg_loss"] = math.nan
            s["grad"] = math.nan

    add("nan-loss", "actor/pg_loss (and the gradient norm) are NaN for 2 steps",
        Fault(state=after(F, nan_loss)),
        lambda run: [nonfinite_expect(run, "VerlNonFiniteLoss", "verl_actor_pg_loss",
                                      "the first NaN step to be logged")])

    def ev_collapse(k: int, start: float, s: dict) -> None:
        s["vf_ev"] = (0.2, -0.2)[k] if k < 2 else -0.45 + rng_for("ev", k).gauss(0, 0.05)
        s["vf_loss"] *= 4

    def ev_expect(run: Run) -> list[Expect]:
        ev = run.s("verl_critic_vf_explained_variance")
        return [Expect("VerlCriticExplainedVarianceCollapse", run.out_labels("verl_critic_vf_explained_variance"),
                       lambda m: inst(ev, m) < 0 and vmax(window(ev, m, 120, 15)) > 0.3,
                       "the explained variance to go negative", lambda m: inst(ev, m))]

    add("critic-explained-variance-collapse", "the critic stops tracking returns: explained variance ~-0.45",
        Fault(state=after(F, ev_collapse)), ev_expect)

    def val_drop(k: int, start: float, s: dict) -> None:
        if "val" in s:
            s["val"] *= 0.55

    def val_expect(run: Run) -> list[Expect]:
        v = run.s("verl_validation_score", kind="core")
        return [Expect("VerlValidationScoreDrop", run.out_labels("verl_validation_score", kind="core"),
                       lambda m: inst(v, m) < 0.8 * vmax(window(v, m, 360)),
                       "the next validation (every 20 steps) to be logged", lambda m: inst(v, m))]

    add("validation-score-drop", "held-out accuracy falls to 55% of its level (over-optimised reward)",
        Fault(state=after(F, val_drop)), val_expect)

    def clipfrac_high(k: int, start: float, s: dict) -> None:
        r = rng_for("clipfrac", k)
        s["clipfrac"] = min(0.4, 0.1 + 0.1 * k) + abs(r.gauss(0, 0.02))
        s["ppo_kl"] = 0.02 + abs(r.gauss(0, 0.003))

    def clipfrac_expect(run: Run) -> list[Expect]:
        c = run.s("verl_actor_pg_clip_ratio", bound="upper")
        return [Expect("VerlPPOClipFractionHigh", run.out_labels("verl_actor_pg_clip_ratio", bound="upper"),
                       lambda m: inst(c, m) > threshold("VerlPPOClipFractionHigh"), "the clip fraction to pass 30%",
                       lambda m: inst(c, m)),
                detector("VerlPPOKLSpike", "actor/ppo_kl to stay 6 spreads and 2x above its median for 3 steps")(run)]

    add("ppo-clip-fraction-high", "the learning rate is raised 10x: ~40% of tokens clipped, ppo_kl x13",
        Fault(state=after(F, clipfrac_high)), clipfrac_expect)

    score_base = build_run(PPO).s("verl_critic_score", stat="mean")
    score_at_f = avg(window(score_base, F, 10))

    def overfit(k: int, start: float, s: dict) -> None:
        s["kl"] *= 1.02 ** (k + 1)
        s["score"] = score_at_f - 0.0008 * k + rng_for("overfit", k).gauss(0, 0.01)

    def overfit_expect(run: Run) -> list[Expect]:
        kl = run.s("verl_actor_kl_loss")
        vf = run.s("verl_critic_vf_loss")
        sc = run.s("verl_critic_score", stat="mean")

        def cond(m: int) -> bool:
            now, old = inst(kl, m), inst(kl, m - 60)
            rv, rs = regression(vf, m, 60), regression(sc, m, 60)
            return (now > 0.05 and old is not None and now > 2 * old and rv is not None and rv[0] < 0
                    and rs is not None and rs[0] <= 0)
        return [Expect("VerlCriticOverfitting", run.out_labels("verl_actor_kl_loss"), cond,
                       "KL to double within the hour while vf_loss falls and the score's 1h slope turns <= 0")]

    add("critic-overfitting", "KL compounds 2% a step (x3.3 an hour) while the critic's loss keeps falling "
        "and the score stalls", Fault(state=after(F, overfit)), overfit_expect)

    # -------------------------------------------------------------------- cross-layer root causes
    def starved(k: int, start: float, s: dict) -> None:
        s["gen_x"] *= 2.2

    def starve_gpus(run: Run) -> None:
        for _, rank, _ in RANKS:
            r = rng_for("starved", rank)
            edit(run, "verl_gpu_utilization_ratio", F, lambda k, v, r=r: round(r.uniform(0.25, 0.42), 2), rank=rank)

    def mean_util(run: Run) -> Callable[[int], float]:
        utils = [run.s("verl_gpu_utilization_ratio", rank=rank) for _, rank, _ in RANKS]
        return lambda m: avg([inst(u, m) for u in utils if inst(u, m) is not None])

    def starve_expect(run: Run) -> list[Expect]:
        gen, act = run.s("verl_timing_seconds", phase="gen"), run.s("verl_timing_seconds", phase="update_actor")
        util = mean_util(run)
        return [Expect("VerlDataLoadingBottleneck", run.out_labels("verl_timing_seconds", phase="gen"),
                       lambda m: inst(gen, m) > 1.5 * avg(window(gen, m, 60, 15)) and util(m) < 0.5
                       and inst(act, m) < 1.2 * avg(window(act, m, 60, 15)),
                       "the first slow step to be logged", lambda m: inst(gen, m))]

    add("data-loading-bottleneck", "the reward workers and data loading starve the rollout: gen x2.2, "
        "GPUs ~33% busy, update_actor unchanged", Fault(state=after(F, starved), post=starve_gpus), starve_expect)

    def slow_collectives(k: int, start: float, s: dict) -> None:
        s["actor_x"] *= 2.5
        s["weights_x"] *= 3.0

    def comm_expect(run: Run) -> list[Expect]:
        util = mean_util(run)
        out = []
        for phase in ("update_actor", "update_weights"):
            t = run.s("verl_timing_seconds", phase=phase)
            out.append(Expect("VerlCommunicationSlowdown", run.out_labels("verl_timing_seconds", phase=phase),
                              lambda m, t=t: inst(t, m) > 2 * avg(window(t, m, 60, 15)) and util(m) > 0.7,
                              "the first slow step to be logged", lambda m, t=t: inst(t, m)))
        return out

    add("communication-slowdown", "NCCL falls back to a slow path: update_actor x2.5, update_weights x3, "
        "GPUs stay busy", Fault(state=after(F, slow_collectives)), comm_expect)

    # -------------------------------------------------------------------- GPUs
    def gpu_lost(run: Run) -> None:
        lab = run.labels("1", gpu="1")
        for (name, labels), v in run.series.items():
            d = dict(labels)
            if name.startswith("verl_gpu_") and d.get("rank") == "1":
                for m in range(F, run.length):
                    v[m] = 0.0 if name == "verl_gpu_up" else None
        run.add("verl_gpu_xid_errors_total", {**lab, "xid": "79"}, [None] * F + [1.0] * (run.length - F))

    def gpu_lost_expect(run: Run) -> list[Expect]:
        up = run.s("verl_gpu_up", rank="1")
        x = run.s("verl_gpu_xid_errors_total", rank="1")
        return [Expect("VerlGPULost", run.out_labels("verl_gpu_up", rank="1"), lambda m: inst(up, m) < 1,
                       "NVML to report the GPU gone"),
                Expect("VerlGPUXidCritical", run.out_labels("verl_gpu_xid_errors_total", rank="1"),
                       lambda m: born_or_increased(x, m), "the XID 79 event")]

    add("gpu-lost", "rank 1's GPU falls off the bus (XID 79): NVML loses it, the run hangs",
        Fault(stop_at=F + 1, post=gpu_lost), gpu_lost_expect)

    def xid(rank: str, gpu: str, code: str, counts: tuple[float, ...]) -> Callable[[Run], None]:
        def post(run: Run) -> None:
            values: list[float | None] = [None] * F
            for k in range(run.length - F):
                values.append(counts[min(k, len(counts) - 1)])
            run.add("verl_gpu_xid_errors_total", run.labels(rank, gpu=gpu, xid=code), values)
        return post

    def xid_expect(alert: str, rank: str) -> Callable[[Run], list[Expect]]:
        def make(run: Run) -> list[Expect]:
            x = run.s("verl_gpu_xid_errors_total", rank=rank)
            return [Expect(alert, run.out_labels("verl_gpu_xid_errors_total", rank=rank),
                           lambda m: born_or_increased(x, m), "the XID event")]
        return make

    add("critical-xid", "XID 94 (contained ECC error) on rank 2's GPU; the process on it dies and the run hangs",
        Fault(stop_at=F + 1, post=xid("2", "0", "94", (1.0,))), xid_expect("VerlGPUXidCritical", "2"))
    add("non-critical-xid", "XID 13 (graphics engine exception) twice on rank 0's GPU; the run goes on",
        Fault(post=xid("0", "0", "13", (1.0, 1.0, 1.0, 2.0))), xid_expect("VerlGPUXid", "0"))

    def thermal(run: Run) -> None:
        edit(run, "verl_gpu_clock_event_active", F, lambda k, v: 1.0, rank="3", reason="hw_thermal_slowdown")

    def thermal_expect(run: Run) -> list[Expect]:
        v = run.s("verl_gpu_clock_event_active", rank="3", reason="hw_thermal_slowdown")
        # max by (job, instance, run, rank, gpu): the GPU's labels, without reason
        return [Expect("VerlGPUThermalThrottling", run.out_labels("verl_gpu_up", rank="3"),
                       lambda m: inst(v, m) == 1, "the throttle flag")]

    add("thermal-throttling", "rank 3's GPU is held down by hw_thermal_slowdown (a failed fan)",
        Fault(post=thermal), thermal_expect)

    def straggle(run: Run) -> None:
        r = rng_for("straggler")
        edit(run, "verl_gpu_utilization_ratio", F, lambda k, v: round(r.uniform(0.5, 0.6), 2), rank="2")

    def straggler_expect(run: Run) -> list[Expect]:
        utils = {rank: run.s("verl_gpu_utilization_ratio", rank=rank) for _, rank, _ in RANKS}

        def score(m: int) -> float:
            means = {rank: avg(window(u, m, 10)) for rank, u in utils.items()}
            return means["2"] / quantile(0.5, list(means.values()))

        return [Expect("VerlStragglerRank", run.out_labels("verl_gpu_utilization_ratio", rank="2"),
                       lambda m: score(m) < 0.75, "rank 2's 10m mean to fall under 0.75 of the median", score,
                       computed=True)]

    add("straggler-rank", "rank 2's GPU runs at ~55% (a noisy neighbour on node1)", Fault(post=straggle),
        straggler_expect)

    def idle(run: Run) -> None:
        r = rng_for("idle")
        edit(run, "verl_gpu_utilization_ratio", F, lambda k, v: round(r.uniform(0.0, 0.06), 2), rank="1")

    def idle_expect(run: Run) -> list[Expect]:
        u, step = run.s("verl_gpu_utilization_ratio", rank="1"), run.s("verl_training_step")
        return [Expect("VerlGPUIdleWhileTraining", run.out_labels("verl_gpu_utilization_ratio", rank="1"),
                       lambda m: avg(window(u, m, 15)) < 0.1 and len(set(window(step, m, 15))) > 1,
                       "the GPU's 15m mean to fall under 10%")]

    add("gpu-idle-while-training", "rank 1's GPU is left out of the placement: ~3% busy while the run steps",
        Fault(post=idle), idle_expect)

    def ecc(run: Run) -> None:
        edit(run, "verl_gpu_ecc_errors_total", F, lambda k, v: 2.0, rank="1")
        edit(run, "verl_gpu_row_remap_pending", F + 1, lambda k, v: 1.0, rank="1")

    def ecc_expect(run: Run) -> list[Expect]:
        c, p = run.s("verl_gpu_ecc_errors_total", rank="1"), run.s("verl_gpu_row_remap_pending", rank="1")
        return [Expect("VerlGPUUncorrectableECC", run.out_labels("verl_gpu_ecc_errors_total", rank="1"),
                       lambda m: born_or_increased(c, m), "the counter to increase"),
                Expect("VerlGPURowRemapPending", run.out_labels("verl_gpu_row_remap_pending", rank="1"),
                       lambda m: inst(p, m) > 0, "the remap a minute after the errors")]

    add("uncorrectable-ecc", "two uncorrectable ECC errors on rank 1's GPU; a row remap then waits for a reset",
        Fault(post=ecc), ecc_expect)

    def remap_failed(run: Run) -> None:
        edit(run, "verl_gpu_row_remap_failed", F, lambda k, v: 1.0, rank="2")

    add("row-remap-failed", "rank 2's GPU runs out of spare rows", Fault(post=remap_failed),
        lambda run: [Expect("VerlGPURowRemapFailed", run.out_labels("verl_gpu_row_remap_failed", rank="2"),
                            lambda m: inst(run.s("verl_gpu_row_remap_failed", rank="2"), m) > 0, "the flag")])

    def nvlink(run: Run) -> None:
        edit(run, "verl_gpu_nvlink_errors_total", F, lambda k, v: v + 40.0 * (min(k, 5) + 1), rank="0")
        edit(run, "verl_gpu_nvlink_link_up", F + 5, lambda k, v: 0.0, rank="0", link="2")
        edit(run, "verl_gpu_nvlink_links_down", F + 5, lambda k, v: 1.0, rank="0")

    def nvlink_expect(run: Run) -> list[Expect]:
        down, err = run.s("verl_gpu_nvlink_links_down", rank="0"), run.s("verl_gpu_nvlink_errors_total", rank="0")
        gpu = run.out_labels("verl_gpu_up", rank="0")
        return [Expect("VerlNVLinkDown", run.out_labels("verl_gpu_nvlink_links_down", rank="0"),
                       lambda m: inst(down, m) > 0, "the link to go down after 5 minutes of replays",
                       value=lambda m: inst(down, m)),
                Expect("VerlNVLinkErrors", gpu,
                       lambda m: len(window(err, m, 10)) >= 2 and window(err, m, 10)[-1] > window(err, m, 10)[0],
                       "the replay counter to rise")]

    add("nvlink-down", "NVLink 2 of rank 0's GPU logs replays for 5 minutes, then goes down", Fault(post=nvlink),
        nvlink_expect)

    def mem_full(run: Run) -> None:
        r = rng_for("memfull")
        edit(run, "verl_gpu_memory_used_bytes", F,
             lambda k, v: float(round(GPU_TOTAL * r.uniform(0.9815, 0.9895) / MIB) * MIB), rank="2")

    def mem_full_expect(run: Run) -> list[Expect]:
        used, total = run.s("verl_gpu_memory_used_bytes", rank="2"), run.s("verl_gpu_memory_total_bytes", rank="2")
        return [Expect("VerlGPUMemoryNearFull", run.out_labels("verl_gpu_memory_used_bytes", rank="2"),
                       lambda m: inst(used, m) / inst(total, m) > 0.97, "memory over 97%",
                       lambda m: inst(used, m) / inst(total, m), computed=True)]

    add("gpu-memory-near-full", "a colocated process fills rank 2's GPU to ~98.5%", Fault(post=mem_full),
        mem_full_expect)

    def gpu_mem_growth(run: Run) -> None:
        edit(run, "verl_gpu_memory_used_bytes", F, lambda k, v: float(round((v + 0.12 * GIB * (k + 1)) / MIB) * MIB),
             rank="3")

    def forecast_expect(run: Run) -> list[Expect]:
        used, total = run.s("verl_gpu_memory_used_bytes", rank="3"), run.s("verl_gpu_memory_total_bytes", rank="3")

        def cond(m: int) -> bool:
            r = regression(used, m, 60)
            return r is not None and r[1] + r[0] * 7200 > inst(total, m) and inst(used, m) / inst(total, m) > 0.8
        return [Expect("VerlGPUMemoryOOMForecast", run.out_labels("verl_gpu_memory_used_bytes", rank="3"), cond,
                       "the 1h linear forecast to cross the GPU's memory within 2h")]

    add("gpu-memory-oom-forecast", "rank 3's rollout server leaks 0.12 GiB of GPU memory a minute",
        Fault(post=gpu_mem_growth), forecast_expect)

    def power_capped(k: int, start: float, s: dict) -> None:
        s["actor_x"] *= 1.7
        s["gen_x"] *= 1.3

    def cap_all(run: Run) -> None:
        for _, rank, _ in RANKS:
            edit(run, "verl_gpu_clock_event_active", F, lambda k, v: 1.0, rank=rank, reason="sw_power_cap")

    def mfu_expect(run: Run) -> list[Expect]:
        out = [detector("VerlMFUDrop", "3 slow steps, 4 spreads and 30% under the trend of the 30 before")(run)]
        for _, rank, _ in RANKS:
            v = run.s("verl_gpu_clock_event_active", rank=rank, reason="sw_power_cap")
            out.append(Expect("VerlGPUPowerCapped", run.out_labels("verl_gpu_clock_event_active", rank=rank,
                                                                   reason="sw_power_cap"),
                              lambda m, v=v: inst(v, m) > 0, "the power cap flag"))
        return out

    add("mfu-drop", "the GPUs' power limit is lowered: clocks held by sw_power_cap, update_actor x1.7, MFU falls",
        Fault(state=after(F, power_capped), post=cap_all), mfu_expect)

    # -------------------------------------------------------------------- host, checkpoints, the exporter
    def disk_fill(run: Run) -> None:
        edit(run, "verl_host_filesystem_avail_bytes", F, lambda k, v: max(0.0, v - 6.0e10 * (k + 1)), rank="2")

    def disk_fill_expect(run: Run) -> list[Expect]:
        a, size = run.s("verl_host_filesystem_avail_bytes", rank="2"), run.s("verl_host_filesystem_size_bytes",
                                                                           rank="2")

        def cond(m: int) -> bool:
            r = regression(a, m, 120)
            return inst(a, m) / inst(size, m) < 0.15 and r is not None and r[1] + r[0] * 21600 < 0
        return [Expect("VerlCheckpointDiskFillingUp", run.out_labels("verl_host_filesystem_avail_bytes", rank="2"),
                       cond, "free space to fall under 15% (60 GB written a minute)",
                       lambda m: inst(a, m) / inst(size, m), computed=True)]

    add("disk-filling-up", "another job writes 60 GB a minute to node1's /ckpt", Fault(post=disk_fill),
        disk_fill_expect)

    def disk_busy(run: Run) -> None:
        r = rng_for("busy")
        io_time = run.s("verl_host_disk_io_time_seconds_total", rank="0")
        for m in range(F, run.length):
            io_time[m] = round(io_time[m - 1] + 60 * round(r.uniform(0.93, 0.99), 3), 3)

    def disk_busy_expect(run: Run) -> list[Expect]:
        c = run.s("verl_host_disk_io_time_seconds_total", rank="0")

        def busy(m: int) -> float:
            return rate(c, m, 5) or 0.0

        return [Expect("VerlDiskSaturated", run.out_labels("verl_host_disk_io_time_seconds_total", rank="0"),
                       lambda m: busy(m) > 0.9, "the 5-minute rate of the I/O time to be over 0.9", busy,
                       computed=True)]

    add("disk-saturated", "node0's NVMe is saturated by a dataset copy", Fault(post=disk_busy), disk_busy_expect)

    def ckpt_fault(status: str, from_minute: int, once: bool = True) -> Callable[[int, float], str]:
        """Saves that end after from_minute get the status: the first one only, or all (once=False)."""
        hit: list[int] = []

        def fn(step: int, end: float) -> str:
            if end < from_minute * 60 or (once and hit and hit[0] != step):
                return "ok"
            hit.append(step)
            return status
        return fn

    def ckpt_expect(alert: str, name: str, bad: Callable[[float], bool], why: str) -> Callable[[Run], list[Expect]]:
        """The one checkpoint series that turns bad (manifest_verified has a series per step)."""
        def make(run: Run) -> list[Expect]:
            hits = [k for k in run.series if k[0] == name and any(v is not None and bad(v) for v in run.series[k])]
            assert len(hits) == 1, hits
            v = run.series[hits[0]]
            return [Expect(alert, dict(hits[0][1]), lambda m: inst(v, m) is not None and bad(inst(v, m)), why)]
        return make

    def stale_expect(run: Run) -> list[Expect]:
        ts = run.s("verl_checkpoint_latest_timestamp_seconds")

        def age(m: int) -> float:
            return m * 60 - inst(ts, m)
        return [Expect("VerlCheckpointStale", run.out_labels("verl_checkpoint_latest_timestamp_seconds"),
                       lambda m: age(m) > threshold("VerlCheckpointStale"),
                       "6 hours since the last good save (the first one, before F)", age)]

    stale_at = 60
    add("checkpoint-stale", f"every save after the first fails silently (from {stale_at}m): the latest "
        "checkpoint ages past 6 hours", Fault(ckpt=ckpt_fault("skip", stale_at, once=False)),
        stale_expect, at=stale_at)
    add("checkpoint-incomplete", "the first save after F is interrupted and leaves a partial global_step folder",
        Fault(ckpt=ckpt_fault("partial", F)),
        ckpt_expect("VerlCheckpointIncomplete", "verl_checkpoint_incomplete", lambda v: v > 0,
                    "the next save (every 50 steps) to start, then the 900 s grace"))
    add("checkpoint-corrupt", "the first checkpoint saved after F does not match its manifest",
        Fault(ckpt=ckpt_fault("corrupt", F)),
        ckpt_expect("VerlCheckpointCorrupt", "verl_checkpoint_manifest_verified", lambda v: v < 1,
                    "the next save (every 50 steps), then its verification on the next slow pass"))

    def exporter_down(run: Run) -> None:
        silence_instance(run, "node1:9478", F)

    def down_expect(run: Run) -> list[Expect]:
        up = run.s("up", instance="node1:9478")
        return [Expect("VerlExporterDown", run.out_labels("up", instance="node1:9478"), lambda m: inst(up, m) == 0,
                       "the first failed scrape")]

    add("exporter-down", "the sidecar of rank 3 (node1:9478) dies: its scrapes fail", Fault(post=exporter_down),
        down_expect)

    def all_gone(run: Run) -> None:
        for v in run.series.values():
            for m in range(F, run.length):
                v[m] = None

    def absent_expect(run: Run) -> list[Expect]:
        ups = [run.s("up", instance=i) for i, _, _ in RANKS]
        return [Expect("VerlExporterAbsent", {"job": JOB}, lambda m: all(inst(u, m) is None for u in ups),
                       "the last up samples to leave the 5m lookback")]

    add("exporter-absent", "every target of the job vanishes (service discovery lost them)", Fault(post=all_gone),
        absent_expect)

    return out


# ---------------------------------------------------------------------------------------------- rendering
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


def _same(a: float | None, b: float | None) -> bool:
    """Samples a run-length code may merge. promtool reads no 'NaNxN': NaN samples stay one by one."""
    return (a is None and b is None) or (a is not None and b is not None and a == b)


def series_text(values: Values) -> str:
    """promtool's notation, constant runs compressed: '1x9 _x3 0.5' (10 ones, 3 gaps, 0.5)."""
    def fmt(v: float | None) -> str:
        if v is None:
            return "_"
        if math.isnan(v):
            return "NaN"
        if v.is_integer() and abs(v) < 1e17:
            return str(int(v))
        return repr(v)

    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and _same(values[j + 1], values[i]):
            j += 1
        text = fmt(values[i])
        if j == i:
            out.append(text)
        elif values[i] is None:  # '_xN' is N missing samples, where 'axN' is N+1 samples of a
            out.append(f"_x{j - i + 1}")
        else:
            out.append(f"{text}x{j - i}")
        i = j + 1
    return " ".join(out)


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


@dataclass
class Check:
    minute: int
    alert: str
    expected: list[tuple[dict[str, str], dict[str, str]]]  # (labels, annotations)
    comment: str = ""


def annotations(spec, alert: Alert, labels: dict[str, str], value: float | None,
                computed: bool = False) -> dict[str, str]:
    out = {}
    for name, text in (("summary", alert.summary), ("description", alert.description)):
        if "$value" in text:
            if value is None:
                raise SystemExit(f"{alert.alert}: the description uses $value: the scenario must compute it")
            # a computed value on the edge of the printed precision could print either way (Prometheus may
            # sum in another order): refuse it. A sample is parsed to the same float by both sides.
            lo, hi = expand(text, value * (1 - 1e-9), labels), expand(text, value * (1 + 1e-9), labels)
            if computed and lo != hi:
                raise SystemExit(f"{alert.alert}: $value {value!r} sits on a rounding edge; change the scenario")
        out[name] = expand(text, value if value is not None else 0.0, labels)
    out["runbook_url"] = runbook_url(spec, alert)
    return out


def failure_checks(spec, sc: Scenario, run: Run) -> list[Check]:
    alerts = {a.alert: a for a in spec.alerts()}
    groups: dict[str, list[Expect]] = {}
    for e in sc.expects(run):
        if e.alert not in alerts:
            raise SystemExit(f"scenario {sc.slug}: no alert {e.alert} in the spec")
        groups.setdefault(e.alert, []).append(e)
    checks = []
    last = run.length - 1
    for name, members in groups.items():
        alert = alerts[name]
        hold = duration_seconds(alert.for_) // 60
        fires, delays = [], []
        for e in members:
            # the first minute from which the condition holds long enough to fire and be checked
            start = next((m for m in range(sc.at, last - hold - MARGIN + 1)
                          if all(e.cond(k) for k in range(m, m + hold + MARGIN + 1))), None)
            if start is None:
                raise SystemExit(f"scenario {sc.slug}: the condition of {name} never holds long enough")
            delays.append(start - sc.at)
            fires.append(start + hold + MARGIN)
        fire = max(fires)
        if fire > last:
            raise SystemExit(f"scenario {sc.slug}: {name} would fire at {fire}m, after the run's end")
        expected = []
        for e, delay in zip(members, delays, strict=True):
            broken = [m for m in range(sc.at + delay, fire + 1) if not e.cond(m)]
            if broken:
                raise SystemExit(f"scenario {sc.slug}: {name}'s condition breaks at {broken[0]}m before {fire}m")
            if all(e.cond(m) for m in range(max(sc.at - 1 - hold, 0), sc.at)):
                raise SystemExit(f"scenario {sc.slug}: {name} already fires at {sc.at - 1}m")
            value = e.value(fire) if e.value else None
            labels = {**e.labels, **alert.labels, "severity": alert.severity}
            expected.append((labels, annotations(spec, alert, e.labels, value, e.computed)))
        delay = max(delays)
        note = (f"{name}: fault at {sc.at}m + {delay}m detection ({members[0].why}) + for {hold}m "
                f"+ {MARGIN}m = {fire}m")
        checks.append(Check(sc.at - 1, name, [], "silent just before the fault"))
        checks.append(Check(fire, name, expected, note))
    return checks


def known_firing(case: str, alert: str, minute: int) -> bool:
    (first, last), _ = KNOWN_CLEAN_FIRING.get(case, {}).get(alert, ((-1, -2), ""))
    return first <= minute <= last


def clean_checks(spec, case: str, minutes: list[int], include_known: bool = False) -> list[Check]:
    return [Check(minute, alert.alert, []) for minute in minutes for alert in spec.alerts()
            if include_known or not known_firing(case, alert.alert, minute)]


def only_what_the_checks_read(spec, run: Run, checks: list[Check]) -> Run:
    """A failure case keeps only the series its checked alerts' expressions read (and the recordings they
    use): promtool then evaluates every rule over a handful of series, not the whole run, which makes the
    file about 8 times faster to test. The clean runs keep everything: there every alert is checked."""
    from verl_exporter.render.promql import alert_expr, all_recordings

    recordings = {r.record: r.expr for r in all_recordings(spec)}
    by_name = {a.alert: a for a in spec.alerts()}
    exprs = [alert_expr(by_name[c.alert], spec.rules.selector) for c in checks]
    names: set[str] = set()
    while exprs:
        for name in re.findall(r"\b([a-zA-Z_][a-zA-Z0-9_:]*)\s*[{\[]", exprs.pop()):
            if name in recordings and name not in names:
                exprs.append(recordings[name])
            names.add(name)
    return dataclasses.replace(run, series={k: v for k, v in run.series.items() if k[0] in names})


def render_group(lines: list[str], name: str, run: Run, checks: list[Check], anchors: dict[Key, tuple],
                 prefix: str | None) -> None:
    lines.append(f"  - name: {q(name)}")
    lines.append("    interval: 1m")
    lines.append("    input_series:")
    for k, values in run.series.items():
        text = series_text(values)
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
    lines.append("tests:")
    return lines


def render(rule_dir: str = "..", only: str | None = None, every_minute: bool = False) -> str:
    """The scenario file; or with only="clean" the clean runs alone, with only=<slug> one failure alone (its
    series written out in full). every_minute: the clean runs checked at every minute, the known false alarms
    included (what clean_firings() runs)."""
    spec = load_spec()
    lines = header_lines(rule_dir)
    anchors: dict[Key, tuple] = {}
    if only in (None, "clean"):
        for profile, case in CLEAN_CASES:
            run = build_run(profile)
            check_names(run, spec)
            minutes = list(range(END + 1)) if every_minute else CLEAN_CHECKS
            title = "every alert silent at every minute" if every_minute else \
                f"every alert silent at {CLEAN_CHECKS[0]}m and every 10m to {END}m"
            render_group(lines, f"{case}: {title}", run, clean_checks(spec, case, minutes, every_minute),
                         anchors, profile.kind)
    for sc in scenarios():
        if only not in (None, sc.slug):
            continue
        length = END + 1
        if sc.slug == "checkpoint-stale":
            length = sc.at + 6 * 60 + 10  # the last good save is before F: six hours after it, and a margin
        run = build_run(PPO, sc.fault, length)
        check_names(run, spec)
        checks = failure_checks(spec, sc, run)
        run = only_what_the_checks_read(spec, run, checks)
        fires = ", ".join(f"{c.alert} at {c.minute}m" for c in checks if c.expected)
        render_group(lines, f"{sc.slug}: {sc.title}. Fault at {sc.at}m; {fires}", run, checks, anchors, None)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- discovery
def clean_firings(promtool: str) -> tuple[dict[tuple[str, str], list[int]], dict[tuple[str, str], str]]:
    """{(case, alert): minutes it fires at} on the clean runs, checked every minute, and a description
    of its first firing (promtool prints what it got where it expected nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clean-test.yaml"
        path.write_text(render(rule_dir=str(REPO / "rules"), only="clean", every_minute=True), encoding="utf-8")
        proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    fired: dict[tuple[str, str], list[int]] = {}
    detail: dict[tuple[str, str], str] = {}
    case, current = "", ("", "")
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r"\s*name: (.*?):", line)
        if m:
            case = m.group(1)
        m = re.match(r"\s*alertname: (\w+), time: (\S+),", line)
        if m:
            current = (case, m.group(1))
            fired.setdefault(current, []).append(duration_seconds(m.group(2)) // 60)
        m = re.match(r"\s*Annotations:\{description=\"(.*?)\"", line)
        if m and current not in detail:
            detail[current] = m.group(1)
    if proc.returncode != 0 and not fired:
        raise RuntimeError(f"promtool failed: {proc.stdout}{proc.stderr}")
    return fired, detail


def known_minutes() -> dict[tuple[str, str], list[int]]:
    return {(case, alert): list(range(first, last + 1))
            for case, known in KNOWN_CLEAN_FIRING.items() for alert, ((first, last), _) in known.items()}


def discover() -> int:
    """Print which alerts fire on the clean runs, and when; exit 1 unless that is KNOWN_CLEAN_FIRING."""
    promtool = shutil.which("promtool")
    if promtool is None:
        print("promtool is not installed", file=sys.stderr)
        return 2
    fired, detail = clean_firings(promtool)
    for (case, alert), minutes in sorted(fired.items()):
        print(f"{case}: {alert} fires at {_ranges(minutes)}\n    first: {detail.get((case, alert), '')}")
    if not fired:
        print(f"no alert fires on the clean runs (checked every minute, 0-{END}m)")
    if {k: sorted(v) for k, v in fired.items()} != known_minutes():
        print("this differs from KNOWN_CLEAN_FIRING", file=sys.stderr)
        return 1
    return 0


def _ranges(minutes: list[int]) -> str:
    out, start, prev = [], None, None
    for m in sorted(minutes):
        if start is None:
            start = prev = m
        elif m == prev + 1:
            prev = m
        else:
            out.append(f"{start}-{prev}m" if start != prev else f"{start}m")
            start = prev = m
    out.append(f"{start}-{prev}m" if start != prev else f"{start}m")
    return ", ".join(out)


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
