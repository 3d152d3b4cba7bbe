"""The node side of a replayed run: what the other collectors of a verl job's sidecars serve beside the driver's
training series (``tools.replay``), one sample a minute, for the scenario tests.

* four ranks on two nodes (``node0:9477``, ``node0:9478``, ``node1:9477``, ``node1:9478``, GPUs 0 and 1) serve
  their GPU's NVML series; the first sidecar of each node serves the host's disk and filesystem;
* the checkpoint collector on the driver sees each save the run logs (``timing_s/save_checkpoint``), three kept;
* Prometheus's own ``up`` is 1 for each sidecar.

``add_node_series(samples, lines, run, fault, onset)`` adds them to the replay's samples and applies the node
side of the fault (``replay.FAULTS``) from minute ``onset`` on. Every series is named and labelled as the spec
declares the metric (job, instance, the target labels and the metric's own): a name or label set the spec
does not declare is refused. No training dynamics here: the steps and saves are the replayed run's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from ..spec import Spec, load_spec
from .replay import FAULTS, GIB, JOB, Fault, Samples

MIB = 1024**2
GPU_TOTAL = 85520809984  # NVML's total memory of an H100 80GB HBM3 (81559 MiB)
FS_SIZE = 7001593487360  # the nodes' local NVMe holding /ckpt
CKPT_PATH, DISK = "/ckpt", "nvme0n1"
DISK_IO_TIME_AT_START = 51234.5  # seconds of I/O time since the node booted, when the sidecars start
CKPT_BYTES_PER_NODE = 8.4e10
CHECKPOINT_GRACE_S = 900  # the sidecar's default --checkpoint-grace
KEEP_CHECKPOINTS = 3  # trainer.max_actor_ckpt_to_keep
LINKS = ("0", "1", "2", "3")  # NVLink links exported per GPU (an H100 has 18; four keep the file small)
# (instance, rank, gpu) of the four sidecars; the first is the driver's, the first of each node also runs the
# host collectors.
RANKS = (("node0:9477", "0", "0"), ("node0:9478", "1", "1"), ("node1:9477", "2", "0"), ("node1:9478", "3", "1"))
HOST_RANKS = ("0", "2")
Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Save:
    step: int
    start: float
    end: float
    status: str  # ok | skip | partial | corrupt


class Nodes:
    """The series being built: one list of per-minute values per (name, labels), checked against the spec."""

    def __init__(self, samples: Samples, run: str, length: int, spec: Spec, seed: str) -> None:
        self.samples, self.run, self.n, self.spec, self.seed = samples, run, length, spec, seed

    def rng(self, *parts: object) -> random.Random:
        """An independent, reproducible stream per series (str seeds hash with SHA-512, not PYTHONHASHSEED)."""
        return random.Random(":".join([self.seed, self.run, *map(str, parts)]))

    def key(self, name: str, rank: str | None, **own: str) -> Key:
        if name == "up":
            labels = {"job": JOB, "instance": own.pop("instance")}
        else:
            if name not in self.spec:
                raise ValueError(f"{name} is not in the spec")
            if set(own) != set(self.spec[name].labels):
                raise ValueError(f"{name} has labels {sorted(own)}, the spec says {sorted(self.spec[name].labels)}")
            instance = next(r[0] for r in RANKS if r[1] == rank)
            target = dict(zip(self.spec.target_labels, (self.run, rank), strict=True))
            labels = {"job": JOB, "instance": instance, **target, **own}
        return name, tuple(labels.items())

    def add(self, name: str, rank: str | None, values: list, **own: str) -> None:
        assert len(values) == self.n, (name, len(values))
        self.samples.series[self.key(name, rank, **own)] = values

    def edit(self, name: str, rank: str, start: int, fn: Callable[[int, float | None], float | None],
             **own: str) -> None:
        """Rewrite the series of that rank (and those label values) from minute start: fn(minutes, old)."""
        for (n, labels), v in self.samples.series.items():
            d = dict(labels)
            if n == name and d.get("rank") == rank and own.items() <= d.items():
                for m in range(start, self.n):
                    v[m] = fn(m - start, v[m])


def clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def power_cap_pattern(rng: random.Random, length: int) -> list[float]:
    """sw_power_cap flips on and off under full load; never on for 30 minutes in a row."""
    out: list[float] = []
    on = rng.random() < 0.3
    while len(out) < length:
        k = rng.randint(2, 18) if on else rng.randint(5, 40)
        out += [1.0 if on else 0.0] * k
        on = not on
    return out[:length]


def gpu_series(nodes: Nodes) -> None:
    n = nodes.n
    for _, rank, gpu in RANKS:
        rng = nodes.rng("gpu", rank)
        nodes.add("verl_gpu_up", rank, [1.0] * n, gpu=gpu)
        nodes.add("verl_gpu_utilization_ratio", rank,
                  [round(clamp(rng.gauss(0.925, 0.028), 0.85, 0.98), 2) for _ in range(n)], gpu=gpu)
        nodes.add("verl_gpu_memory_used_bytes", rank,
                  [float(round(GPU_TOTAL * clamp(rng.gauss(0.895, 0.012), 0.86, 0.93) / MIB) * MIB)
                   for _ in range(n)], gpu=gpu)
        nodes.add("verl_gpu_memory_total_bytes", rank, [float(GPU_TOTAL)] * n, gpu=gpu)
        nodes.add("verl_gpu_clock_event_active", rank, power_cap_pattern(rng, n), gpu=gpu, reason="sw_power_cap")
        nodes.add("verl_gpu_clock_event_active", rank, [0.0] * n, gpu=gpu, reason="hw_thermal_slowdown")
        nodes.add("verl_gpu_ecc_errors_total", rank, [0.0] * n, gpu=gpu, error="uncorrected", counter="volatile")
        nodes.add("verl_gpu_row_remap_pending", rank, [0.0] * n, gpu=gpu)
        nodes.add("verl_gpu_row_remap_failed", rank, [0.0] * n, gpu=gpu)
        for link in LINKS:
            nodes.add("verl_gpu_nvlink_link_up", rank, [1.0] * n, gpu=gpu, link=link)
        nodes.add("verl_gpu_nvlink_links_down", rank, [0.0] * n, gpu=gpu)
        nodes.add("verl_gpu_nvlink_errors_total", rank,
                  [float(sum(rng.choice((0, 0, 0, 1, 2, 7)) for _ in LINKS))] * n, gpu=gpu, type="replay")


def saves_of(lines: list[dict], samples: Samples, fault: Fault | None) -> list[Save]:
    """The saves the run logged (timing_s/save_checkpoint, at the end of its step), with the fault's status:
    checkpoint_skip fails every save from the fault's step on, checkpoint_partial and checkpoint_corrupt the
    first one."""
    ends = dict(samples.step_end_s)
    out = []
    for line in lines:
        step, took = line["step"], line["data"].get("timing_s/save_checkpoint")
        if took is None or step not in ends:
            continue
        status = "ok"
        if fault is not None and step >= fault.at and fault.kind.startswith("checkpoint_"):
            first = not any(s.step >= fault.at for s in out)
            status = {"checkpoint_skip": "skip", "checkpoint_partial": "partial" if first else "ok",
                      "checkpoint_corrupt": "corrupt" if first else "ok"}[fault.kind]
        out.append(Save(step, ends[step] - took, ends[step], status))
    return out


def host_series(nodes: Nodes, saves: list[Save]) -> None:
    n = nodes.n
    for rank in HOST_RANKS:
        rng = nodes.rng("host", rank)
        # The disk's I/O time counter (seconds since boot): each minute adds the share of it the disk was busy,
        # most during a checkpoint save.
        io_time = [DISK_IO_TIME_AT_START]
        for m in range(1, n):
            saving = any(s.status != "skip" and s.start < m * 60 and s.end > (m - 1) * 60 for s in saves)
            busy = round(rng.uniform(0.6, 0.93) if saving else rng.uniform(0.005, 0.05), 3)
            io_time.append(round(io_time[-1] + 60 * busy, 3))
        nodes.add("verl_host_disk_io_time_seconds_total", rank, io_time, device=DISK)
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
                    used += CKPT_BYTES_PER_NODE * min(1.0, (t - save.start) / (save.end - save.start))
            avail.append(float(round((avail0 - used) / 4096) * 4096))
        nodes.add("verl_host_filesystem_avail_bytes", rank, avail, path=CKPT_PATH)
        nodes.add("verl_host_filesystem_size_bytes", rank, [float(FS_SIZE)] * n, path=CKPT_PATH)


def checkpoint_series(nodes: Nodes, saves: list[Save]) -> None:
    n = nodes.n
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
    nodes.add("verl_checkpoint_latest_timestamp_seconds", "0", latest)
    nodes.add("verl_checkpoint_incomplete", "0", incomplete)
    manifested = [s for s in written if s.status in ("ok", "corrupt")]
    for k, save in enumerate(manifested):
        retired_by = manifested[k + KEEP_CHECKPOINTS] if k + KEEP_CHECKPOINTS < len(manifested) else None
        values: list[float | None] = [None] * n
        for m in range(math.floor(save.end / 60) + 2, n):  # verified on the next slow pass
            if retired_by is not None and retired_by.end <= m * 60:
                break
            values[m] = 0.0 if save.status == "corrupt" else 1.0
        if any(v is not None for v in values):
            nodes.add("verl_checkpoint_manifest_verified", "0", values, step=str(save.step))


def _silence(nodes: Nodes, start: int, instance: str | None = None) -> None:
    """Sidecars that cannot be scraped from minute start: their series end (stale) and up is 0; with no
    instance every target is gone, up included."""
    for (name, labels), v in nodes.samples.series.items():
        if instance is None or dict(labels).get("instance") == instance:
            for m in range(start, nodes.n):
                v[m] = 0.0 if name == "up" and instance else None


def _xid(nodes: Nodes, rank: str, code: str, counts: tuple[float, ...], at: int) -> None:
    gpu = next(r[2] for r in RANKS if r[1] == rank)
    nodes.add("verl_gpu_xid_errors_total", rank,
              [None] * at + [counts[min(k, len(counts) - 1)] for k in range(nodes.n - at)], gpu=gpu, xid=code)


def _node_fault(nodes: Nodes, kind: str, at: int) -> None:
    """The node side of a fault, from minute `at` on (faults of the training alone change nothing here)."""
    r = nodes.rng("fault", kind)
    if kind == "gpu_lost":  # rank 1's GPU falls off the bus (XID 79): NVML loses it
        for (name, labels), v in nodes.samples.series.items():
            if name.startswith("verl_gpu_") and dict(labels).get("rank") == "1":
                for m in range(at, nodes.n):
                    v[m] = 0.0 if name == "verl_gpu_up" else None
        _xid(nodes, "1", "79", (1.0,), at)
    elif kind == "critical_xid":  # XID 94 (contained ECC error) on rank 2's GPU
        _xid(nodes, "2", "94", (1.0,), at)
    elif kind == "gpu_xid":  # XID 13 (graphics engine exception) twice on rank 0's GPU
        _xid(nodes, "0", "13", (1.0, 1.0, 1.0, 2.0), at)
    elif kind == "thermal":  # rank 3's GPU is held down by hw_thermal_slowdown (a failed fan)
        nodes.edit("verl_gpu_clock_event_active", "3", at, lambda k, v: 1.0, reason="hw_thermal_slowdown")
    elif kind == "straggler":  # rank 2's GPU runs at ~55% (a noisy neighbour)
        nodes.edit("verl_gpu_utilization_ratio", "2", at, lambda k, v: round(r.uniform(0.5, 0.6), 2))
    elif kind == "gpu_idle":  # rank 1's GPU is left out of the placement: ~3% busy while the run steps
        nodes.edit("verl_gpu_utilization_ratio", "1", at, lambda k, v: round(r.uniform(0.0, 0.06), 2))
    elif kind == "data_starved":  # every GPU waits for input: ~33% busy
        for _, rank, _ in RANKS:
            nodes.edit("verl_gpu_utilization_ratio", rank, at, lambda k, v: round(r.uniform(0.25, 0.42), 2))
    elif kind == "ecc":  # two uncorrectable ECC errors on rank 1's GPU; a row remap then waits for a reset
        nodes.edit("verl_gpu_ecc_errors_total", "1", at, lambda k, v: 2.0)
        nodes.edit("verl_gpu_row_remap_pending", "1", at + 1, lambda k, v: 1.0)
    elif kind == "remap_failed":  # rank 2's GPU runs out of spare rows
        nodes.edit("verl_gpu_row_remap_failed", "2", at, lambda k, v: 1.0)
    elif kind == "nvlink":  # NVLink 2 of rank 0's GPU logs replays for 5 minutes, then goes down
        nodes.edit("verl_gpu_nvlink_errors_total", "0", at, lambda k, v: v + 40.0 * (min(k, 5) + 1))
        nodes.edit("verl_gpu_nvlink_link_up", "0", at + 5, lambda k, v: 0.0, link="2")
        nodes.edit("verl_gpu_nvlink_links_down", "0", at + 5, lambda k, v: 1.0)
    elif kind == "gpu_memory_full":  # a colocated process fills rank 2's GPU to ~98.5%
        nodes.edit("verl_gpu_memory_used_bytes", "2", at,
                   lambda k, v: float(round(GPU_TOTAL * r.uniform(0.9815, 0.9895) / MIB) * MIB))
    elif kind == "gpu_memory_leak":  # rank 3's rollout server leaks 0.12 GiB of GPU memory a minute
        nodes.edit("verl_gpu_memory_used_bytes", "3", at,
                   lambda k, v: float(round((v + 0.12 * GIB * (k + 1)) / MIB) * MIB))
    elif kind == "power_cap":  # every GPU's clocks are held by sw_power_cap
        for _, rank, _ in RANKS:
            nodes.edit("verl_gpu_clock_event_active", rank, at, lambda k, v: 1.0, reason="sw_power_cap")
    elif kind == "disk_fill":  # another job writes 60 GB a minute to node1's /ckpt
        nodes.edit("verl_host_filesystem_avail_bytes", "2", at, lambda k, v: max(0.0, v - 6.0e10 * (k + 1)))
    elif kind == "disk_busy":  # node0's NVMe is saturated by a dataset copy
        io_time = nodes.samples.series[nodes.key("verl_host_disk_io_time_seconds_total", "0", device=DISK)]
        for m in range(at, nodes.n):
            io_time[m] = round(io_time[m - 1] + 60 * round(r.uniform(0.93, 0.99), 3), 3)
    elif kind == "exporter_down":  # the sidecar of rank 3 dies: its scrapes fail
        _silence(nodes, at, RANKS[3][0])
    elif kind == "exporter_absent":  # every target of the job vanishes (service discovery lost them)
        _silence(nodes, at)
    elif kind not in FAULTS:
        raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")


def add_node_series(samples: Samples, lines: list[dict], run: str, fault: Fault | None = None,
                    onset: int | None = None, length: int | None = None, spec: Spec | None = None,
                    seed: str = "20260917") -> None:
    """Pad the replay's series to `length` minutes and add the node series, the fault's from minute onset."""
    n = length or samples.length
    for v in samples.series.values():
        v.extend([None] * (n - len(v)))
    nodes = Nodes(samples, run, n, spec or load_spec(), seed)
    gpu_series(nodes)
    saves = saves_of(lines, samples, fault)
    host_series(nodes, saves)
    checkpoint_series(nodes, saves)
    for instance, _, _ in RANKS[1:]:  # the driver's up comes from the replay
        nodes.add("up", None, [1.0] * n, instance=instance)
    if fault is not None:
        _node_fault(nodes, fault.kind, onset)
