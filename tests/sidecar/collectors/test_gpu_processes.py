"""The gpu_processes collector: roles of real processes (trainer tree, rollout engines, others), memory sums,
missing memory figures, the role cache, and GPUs where NVML does not list processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
from fake_pynvml import NVML_ERROR_NOT_SUPPORTED, FakeNvml, make_context, series_of, value
from helpers import scaled
from verl_exporter.sidecar.collectors.gpu_processes import GpuProcessesCollector, looks_like_rollout

pytestmark = pytest.mark.integration  # starts servers or programs

SLEEP = "import time; time.sleep(120)"
GIB = 1 << 30


@pytest.fixture(scope="module")
def procs():
    """Real processes: a trainer with a child, a vLLM server by module, a Ray rollout actor by title,
    a trainer-like process that only mentions vllm in its arguments, and an unrelated one."""
    started: list[subprocess.Popen] = []

    def spawn(argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, executable=sys.executable, stdin=subprocess.DEVNULL, **kw)
        started.append(p)
        return p

    trainer = spawn([sys.executable, "-c",
                     "import subprocess, sys, time; "
                     "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                     "print(p.pid, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    grandchild = int(trainer.stdout.readline())
    try:
        yield {
            "trainer": trainer.pid,
            "trainer_child": grandchild,
            "vllm_module": spawn([sys.executable, "-c", SLEEP, "-m", "vllm.entrypoints.openai.api_server"]).pid,
            "ray_rollout": spawn(["ray::vLLMHttpServer.generate", "-c", SLEEP]).pid,  # argv[0] = the title
            "decoy": spawn([sys.executable, "-c", SLEEP, "actor_rollout_ref.rollout.name=vllm"]).pid,
            "other": spawn([sys.executable, "-c", SLEEP]).pid,
        }
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)  # the trainer's child, which this fixture had it start
        for p in started:
            p.kill()
        for p in started:
            p.wait(timeout=scaled(10))
            if p.stdout:
                p.stdout.close()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_looks_like_rollout():
    assert looks_like_rollout("python", ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "x"])
    assert looks_like_rollout("python3", ["python3", "-m", "sglang.launch_server", "--port", "30000"])
    assert looks_like_rollout("vllm", ["/usr/bin/vllm", "serve", "Qwen/Qwen3-8B"])
    assert looks_like_rollout("VLLM::EngineCore", ["VLLM::EngineCore"])
    assert looks_like_rollout("sglang::schedul", ["sglang::scheduler_TP0"])
    assert looks_like_rollout("ray::AsyncvLLMS", ["ray::AsyncvLLMServer.generate"])
    assert looks_like_rollout("ray::SGLangHttp", ["ray::SGLangHttpServer"])
    assert looks_like_rollout("ray::RolloutWor", ["ray::RolloutWorker.generate_sequences"])
    assert not looks_like_rollout("ray::WorkerDict", ["ray::WorkerDict.actor_rollout_generate_sequences"])
    assert not looks_like_rollout("python", ["python", "-m", "verl.trainer.main_ppo",
                                             "actor_rollout_ref.rollout.name=vllm"])
    assert not looks_like_rollout("python", [])


def test_memory_and_counts_by_role_from_real_processes(procs):
    fake = FakeNvml(2)
    fake.gpu(0).processes = [(procs["trainer"], 1 * GIB), (procs["trainer_child"], 2 * GIB),
                             (procs["vllm_module"], 3 * GIB), (procs["ray_rollout"], None),
                             (procs["decoy"], 5 * GIB), (procs["other"], 6 * GIB), (dead_pid(), 7 * GIB)]
    c = GpuProcessesCollector(make_context(fake, trainer_pid=procs["trainer"]))
    s = c.sample()
    assert value(s, "verl_gpu_process_memory_bytes", gpu=0, role="trainer") == 3 * GIB
    assert value(s, "verl_gpu_processes", gpu=0, role="trainer") == 2
    assert value(s, "verl_gpu_process_memory_bytes", gpu=0, role="rollout") == 3 * GIB  # None counts 0 bytes
    assert value(s, "verl_gpu_processes", gpu=0, role="rollout") == 2
    assert value(s, "verl_gpu_process_memory_bytes", gpu=0, role="other") == 18 * GIB  # decoy, other, dead pid
    assert value(s, "verl_gpu_processes", gpu=0, role="other") == 3
    for role in ("trainer", "rollout", "other"):  # an idle GPU has all three roles at 0
        assert value(s, "verl_gpu_process_memory_bytes", gpu=1, role=role) == 0
        assert value(s, "verl_gpu_processes", gpu=1, role=role) == 0
    assert len(s) == 2 * 3 * 2
    c.close()


def test_roles_are_cached_per_process(procs):
    fake = FakeNvml(1)
    fake.gpu(0).processes = [(procs["trainer"], GIB), (procs["vllm_module"], GIB), (procs["other"], GIB)]
    c = GpuProcessesCollector(make_context(fake, trainer_pid=procs["trainer"]))
    c.sample()
    assert c.roles.decisions == 3
    for _ in range(5):
        c.sample()
    assert c.roles.decisions == 3


def test_without_a_trainer_pid_the_trainer_is_other(procs):
    fake = FakeNvml(1)
    fake.gpu(0).processes = [(procs["trainer"], GIB), (procs["trainer_child"], GIB)]
    s = GpuProcessesCollector(make_context(fake)).sample()
    assert value(s, "verl_gpu_processes", gpu=0, role="trainer") == 0
    assert value(s, "verl_gpu_processes", gpu=0, role="other") == 2


def test_a_gpu_where_nvml_cannot_list_processes_has_no_series_and_is_not_asked_again():
    fake = FakeNvml(2)
    fake.fail("nvmlDeviceGetComputeRunningProcesses", NVML_ERROR_NOT_SUPPORTED, gpu=1)
    c = GpuProcessesCollector(make_context(fake))
    for _ in range(3):
        s = c.sample()
    assert series_of(s, 1) == set()
    assert value(s, "verl_gpu_processes", gpu=0, role="other") == 0
    assert fake.count("nvmlDeviceGetComputeRunningProcesses", gpu=1) == 1
    c.close()


def test_a_lost_gpu_has_no_process_series_until_it_is_back():
    fake = FakeNvml(1)
    c = GpuProcessesCollector(make_context(fake))
    fake.lose(0)
    assert c.sample() == []
    fake.restore(0)
    assert value(c.sample(), "verl_gpu_processes", gpu=0, role="other") == 0
    c.close()
