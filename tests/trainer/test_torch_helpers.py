"""In-process torch helpers: the gradient watch and CUDA allocator stats, through a real Monitor endpoint."""

from __future__ import annotations

import math

import pytest
from conftest import http_get, parse_metrics, sample
from verl_exporter import Monitor
from verl_exporter.trainer.torch_helpers import GradWatch

pytestmark = pytest.mark.integration  # torch: verl's stack, not the unit tier's
torch = None


@pytest.fixture(autouse=True, scope="module")
def _torch():
    """torch is imported when a test runs, not as the module loads (collecting the unit tier would cost 2 s)."""
    global torch
    torch = pytest.importorskip("torch")


def model_with_grads(nan: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model(torch.randn(4, 8)).sum().backward()
    if nan:
        next(model.parameters()).grad[0, 0] = float("nan")
    return model


def test_grad_norm_matches_torch_reference():
    model = model_with_grads()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    watch = GradWatch()
    watch.observe(model.parameters())
    watch.harvest()
    assert watch.latest == pytest.approx(expected, rel=1e-6)
    assert watch.nonfinite_steps == 0 and watch.observed_steps == 1


def test_nonfinite_gradients_are_counted_per_step():
    watch = GradWatch()
    watch.observe(model_with_grads(nan=True).parameters())
    watch.observe(model_with_grads().parameters())
    watch.observe(model_with_grads(nan=True).parameters())
    watch.harvest()
    assert watch.nonfinite_steps == 2 and watch.observed_steps == 3
    assert math.isnan(GradWatch().latest or math.nan)


def test_mixed_dtypes_and_missing_grads_do_not_break_observe():
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(4))
    c = torch.nn.Parameter(torch.ones(2))  # no grad
    a.grad = torch.full((3,), 2.0, dtype=torch.bfloat16)
    b.grad = torch.full((4,), 1.0)
    watch = GradWatch()
    watch.observe([a, b, c])
    watch.observe([c])  # nothing to observe
    watch.observe([object()])  # not a parameter: ignored, never raised
    watch.harvest()
    assert watch.latest == pytest.approx(math.sqrt(3 * 4 + 4 * 1), rel=1e-2)  # bf16 norms round
    assert watch.observed_steps == 1


@pytest.mark.integration
def test_monitor_exports_the_grad_watch():
    monitor = Monitor(listen="127.0.0.1:0", run="torch", rank=0)
    try:
        watch = monitor.grad_watch()
        watch.observe(model_with_grads(nan=True).parameters())
        sampler = monitor.sidecar.sampler
        assert sampler.run_once(sampler.collectors[-1])
        m = parse_metrics(http_get(monitor.url + "/metrics")[2].decode())
        assert math.isnan(sample(m, "verl_torch_grad_norm", run="torch"))
        assert sample(m, "verl_torch_nonfinite_grad_steps_total") == 1
        # The in-process endpoint runs no host or GPU collectors: those belong to the sidecar.
        assert not any(name.startswith(("verl_host_", "verl_gpu_")) for name, _ in m)
    finally:
        monitor.close()


@pytest.mark.integration
def test_cuda_memory_series_from_the_allocator(monkeypatch):
    stats = {"memory_allocated": 100, "memory_reserved": 300, "max_memory_allocated": 200}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for fn, value in stats.items():
        monkeypatch.setattr(torch.cuda, fn, lambda d, v=value: v)
    monitor = Monitor(listen="127.0.0.1:0", torch_memory=True)
    try:
        sampler = monitor.sidecar.sampler
        assert sampler.run_once(sampler.collectors[-1])
        m = parse_metrics(http_get(monitor.url + "/metrics")[2].decode())
        assert sample(m, "verl_torch_cuda_memory_allocated_bytes", device="0") == 100
        assert sample(m, "verl_torch_cuda_memory_reserved_bytes", device="0") == 300
        assert sample(m, "verl_torch_cuda_memory_peak_bytes", device="0") == 200
    finally:
        monitor.close()
