"""GPU memory and process counts on this rank's GPUs, by role: trainer, rollout, other. Pids are not labels.

Role of a process holding GPU memory:
- trainer: the --trainer-pid process or one of its descendants;
- rollout: a rollout engine: vLLM / SGLang servers and workers (``-m vllm.entrypoints...``,
  ``-m sglang.launch_server``, the ``vllm`` / ``sglang`` commands, process titles ``VLLM::...`` /
  ``sglang::...``) and Ray actors whose class names a rollout (``ray::vLLMHttpServer...``,
  ``ray::...Rollout...``, ``ray::SGLang...``);
- other: the rest, and processes this sidecar cannot see.

The role is cached per (pid, start time), so a sample costs one NVML call per GPU and one small /proc read
per process. "other" is looked at again after a while, as a Ray worker takes its actor's title only once it has
one. NVML reports pids of the host's pid namespace: run the sidecar in the trainer's pid namespace (or the
host's) for the roles to be right. usedGpuMemory is None where NVML may not tell (containers without the
permission): the process is counted, with 0 bytes.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

import psutil

from .base import Collector, Context, Sample, register
from .nvml import LOST, UNSUPPORTED, Gpu, GpuLost, NvmlSession

ROLES = ("trainer", "rollout", "other")
RECHECK_OTHER_S = 60.0

_RAY_ACTOR = re.compile(r"ray::([A-Za-z0-9_]*)")
_ROLLOUT_CLASS = re.compile(r"rollout|vllm|sglang", re.IGNORECASE)
_ENGINE_TITLE = re.compile(r"(vllm|sglang)::", re.IGNORECASE)
_ENGINE_MODULE = re.compile(r"(vllm\.entrypoints|vllm\.v1\.|sglang\.launch_server|sglang\.srt\.)")
_ENGINE_COMMANDS = ("vllm", "sglang")


def looks_like_rollout(name: str, cmdline: list[str]) -> bool:
    """True for a vLLM / SGLang process or a Ray actor of a rollout class (by title, command or module)."""
    titles = [name, cmdline[0]] if cmdline else [name]
    for title in titles:
        m = _RAY_ACTOR.match(title)
        if m and _ROLLOUT_CLASS.search(m.group(1)):
            return True
        if _ENGINE_TITLE.match(title):
            return True
    if cmdline and os.path.basename(cmdline[0]) in _ENGINE_COMMANDS:
        return True
    # a module run with -m: match whole arguments only, so "--rollout.name=vllm" of a trainer does not count
    return any(_ENGINE_MODULE.match(arg) for arg in cmdline[1:])


def looks_like_ray_worker(name: str, cmdline: list[str]) -> bool:
    """True for a Ray worker process (title ``ray::<Actor or task>``, or Ray's default_worker.py)."""
    titles = [name, cmdline[0]] if cmdline else [name]
    return any(_RAY_ACTOR.match(t) for t in titles) or any(a.endswith("ray/_private/workers/default_worker.py")
                                                           for a in cmdline[:3])


def start_time(pid: int) -> float | None:
    """The process's start time, which tells a pid's reuse apart: from /proc/<pid>/stat (a few us, where
    psutil.Process() costs tens), else from psutil; None when the process is not there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return float(data[data.rindex(b")") + 2:].split()[19])  # field 22, starttime (comm may hold spaces)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


class RoleCache:
    """pid -> role, valid while the pid keeps its start time; 'other' is rechecked after RECHECK_OTHER_S."""

    def __init__(self, trainer_pid: int | None, monotonic: Callable[[], float] = time.monotonic):
        self.trainer_pid = trainer_pid
        self._entries: dict[int, tuple[float, str, float]] = {}  # pid -> (start time, role, decided at)
        self._monotonic = monotonic
        self.decisions = 0  # how many times a role was worked out (a cache miss)

    def role(self, pid: int) -> str:
        started = start_time(pid)
        if started is None:  # gone, or not visible from this pid namespace
            self._entries.pop(pid, None)
            return "other"
        now = self._monotonic()
        cached = self._entries.get(pid)
        if cached and cached[0] == started and (cached[1] != "other" or now - cached[2] < RECHECK_OTHER_S):
            return cached[1]
        try:
            role = self._decide(psutil.Process(pid))
        except (psutil.Error, OSError):
            return "other"
        self.decisions += 1
        self._entries[pid] = (started, role, now)
        return role

    def _decide(self, proc: psutil.Process) -> str:
        if self.trainer_pid is not None:
            if proc.pid == self.trainer_pid:
                return "trainer"
            try:
                if any(p.pid == self.trainer_pid for p in proc.parents()):
                    return "trainer"
            except (psutil.Error, OSError):
                pass
        try:
            name = proc.name()
        except (psutil.Error, OSError):
            name = ""
        try:
            cmdline = proc.cmdline()
        except (psutil.Error, OSError):
            cmdline = []
        return "rollout" if looks_like_rollout(name, cmdline) else "other"

    def forget_except(self, alive: set[int]) -> None:
        for pid in [p for p in self._entries if p not in alive]:
            del self._entries[pid]


@register
class GpuProcessesCollector(Collector):
    name = "gpu_processes"
    description = "GPU memory and process counts on this rank's GPUs by role: trainer, rollout, other (NVML)"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.session = NvmlSession(ctx)
        self.nvml = self.session.nvml
        self.roles = RoleCache(ctx.config.trainer_pid)
        self._unsupported: set[str] = set()  # gpu labels where NVML does not list processes
        self._labels = {g.label: {r: {"gpu": g.label, "role": r} for r in ROLES} for g in self.session.gpus}

    def _processes(self, gpu: Gpu) -> list[Any] | None:
        try:
            processes: list[Any] = self.nvml.nvmlDeviceGetComputeRunningProcesses(gpu.handle)
            return processes
        except Exception as e:
            kind = self.session.kind(e)
            if kind == UNSUPPORTED:
                self._unsupported.add(gpu.label)
            elif kind == LOST:
                raise GpuLost(str(e)) from None
            else:
                self.ctx.self_metrics.problem(self.name, "list", f"GPU {gpu.label}: listing processes failed: {e!r}")
            return None

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        roles: dict[int, str] = {}  # this sample's: a process on several GPUs is looked up once
        for gpu in self.session.gpus:
            if gpu.label in self._unsupported:
                continue
            if not gpu.up and not self.session.reacquire(gpu):
                continue  # the gpu collector shows verl_gpu_up 0
            try:
                procs = self._processes(gpu)
            except GpuLost:
                gpu.up = False
                continue
            gpu.up = True
            if procs is None:
                continue
            memory = dict.fromkeys(ROLES, 0.0)
            count = dict.fromkeys(ROLES, 0.0)
            for p in procs:
                pid = int(p.pid)
                role = roles.get(pid)
                if role is None:
                    role = roles[pid] = self.roles.role(pid)
                count[role] += 1
                used = getattr(p, "usedGpuMemory", None)
                memory[role] += float(used) if used is not None else 0.0
            labels = self._labels[gpu.label]
            for role in ROLES:  # every role every time, 0 when none, so that series do not come and go
                out.append(("verl_gpu_process_memory_bytes", labels[role], memory[role]))
                out.append(("verl_gpu_processes", labels[role], count[role]))
        self.roles.forget_except(set(roles))
        return out

    def close(self) -> None:
        self.session.close()
