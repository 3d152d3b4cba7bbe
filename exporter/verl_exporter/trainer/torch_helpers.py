"""In-process torch helpers: CUDA memory of this rank, and a gradient watch that never stalls training.

Both feed the ``torch`` collector, which runs on the Monitor's sampler thread:

    monitor = Monitor(listen="0.0.0.0:9478", torch_memory=True)
    watch = monitor.grad_watch()
    ...
    loss.backward()
    watch.observe(model.parameters())   # queues the norm on the GPU; no host sync here
    optimizer.step()

torch is imported lazily, so the package works without it.

Why no sync: ``observe()`` computes the global L2 norm with ``torch._foreach_norm`` (one kernel per dtype and
device, not one per parameter), starts a non-blocking copy of that single scalar to the host and records a
CUDA event. The sampler thread later reads the scalar only once the event has completed; until then it
leaves it for the next sample. A NaN or Inf in any gradient makes the norm non-finite, so one scalar per
step is enough to count non-finite steps.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

from ..sidecar.collectors.base import Collector, Context, Unavailable


def _torch():
    try:
        import torch
    except ImportError as e:
        raise Unavailable(f"torch is not installed: {e}") from None
    return torch


class GradWatch:
    """Observe gradients once per step; the values are exported by the torch collector."""

    def __init__(self, max_pending: int = 64):
        self._torch = _torch()
        self._pending: deque = deque(maxlen=max_pending)  # (host scalar tensor, event or None)
        self._lock = threading.Lock()  # between the sampler thread's reads; observe() never takes it
        self.latest: float | None = None
        self.nonfinite_steps = 0
        self.observed_steps = 0

    def observe(self, parameters: Iterable[Any]) -> None:
        """Queue the global grad norm of these parameters. Never raises into training."""
        try:
            torch = self._torch
            grads = [p.grad.detach() for p in parameters if getattr(p, "grad", None) is not None]
            if not grads:
                return
            with torch.no_grad():
                device = grads[0].device
                norms = [n.to(device=device, dtype=torch.float32, non_blocking=True)
                         for n in torch._foreach_norm(grads)]
                total = torch.linalg.vector_norm(torch.stack(norms))
                if total.is_cuda:
                    host = torch.empty((), dtype=total.dtype, pin_memory=True)
                    host.copy_(total, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                else:
                    host, event = total, None
            self._pending.append((host, event))
        except Exception:  # monitoring must never break a training step
            return

    def harvest(self) -> None:
        """Read every queued norm whose copy has completed (sampler thread)."""
        with self._lock:
            while self._pending:
                host, event = self._pending[0]
                if event is not None and not event.query():
                    return  # not yet computed: try again at the next sample, never wait
                self._pending.popleft()
                value = float(host.item())
                self.observed_steps += 1
                self.latest = value
                if not math.isfinite(value):
                    self.nonfinite_steps += 1


class TorchCollector(Collector):
    """CUDA memory of this process's devices, and the GradWatch values. In-process only (Monitor)."""

    name = "torch"
    default_enabled = False
    description = "in-process torch CUDA memory and gradient watch"

    def __init__(self, ctx: Context, memory: bool = True, grad_watch: GradWatch | None = None,
                 devices: list[int] | None = None):
        super().__init__(ctx)
        self.grad_watch = grad_watch  # may be attached later (Monitor.grad_watch())
        self._devices: list[int] = []
        if memory:
            torch = _torch()
            if torch.cuda.is_available():
                self._devices = devices if devices is not None else [torch.cuda.current_device()]
            # Without CUDA there is no allocator to read; the collector still serves a GradWatch.
        self._cuda = _torch().cuda if self._devices else None

    def sample(self):
        out = []
        for d in self._devices:
            labels = {"device": str(d)}
            # Allocator statistics: host-side counters, no device synchronisation.
            out.append(("verl_torch_cuda_memory_allocated_bytes", labels, float(self._cuda.memory_allocated(d))))
            out.append(("verl_torch_cuda_memory_reserved_bytes", labels, float(self._cuda.memory_reserved(d))))
            out.append(("verl_torch_cuda_memory_peak_bytes", labels, float(self._cuda.max_memory_allocated(d))))
        watch = self.grad_watch
        if watch is not None:
            watch.harvest()
            if watch.latest is not None:
                out.append(("verl_torch_grad_norm", {}, watch.latest))
            out.append(("verl_torch_nonfinite_grad_steps_total", {}, float(watch.nonfinite_steps)))
        return out
