"""XID errors as counters per GPU and code, fed by an NVML event-set thread.

A counter (unlike dcgm-exporter's last-XID gauge) shows a repeat of the same code, and
verl_gpu_last_xid_timestamp_seconds says when the latest one came. The thread blocks in nvmlEventSetWait_v2
with a timeout of at most a second, so close() returns promptly; sample() only copies the counts.
"""

from __future__ import annotations

import threading
from typing import Any

from .base import Collector, Context, Sample, Unavailable, register
from .nvml import UNSUPPORTED, NvmlSession, text

WAIT_MS = 500  # bounds how long close() waits for the thread
UNKNOWN_GPU = "unknown"  # an event whose device matches none of this rank's GPUs (should not happen)


@register
class XidCollector(Collector):
    name = "xid"
    description = "XID errors per GPU and code, and the time of the latest (NVML event thread)"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.session = NvmlSession(ctx)
        n = self.nvml = self.session.nvml
        self._xid_type = getattr(n, "nvmlEventTypeXidCriticalError", 0x8)
        self._counts: dict[tuple[str, str], float] = {}
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        try:
            self._set = n.nvmlEventSetCreate()
        except Exception as e:
            self.session.close()
            raise Unavailable(f"NVML event sets are not available: {type(e).__name__}: {e}") from None
        self._registered = []
        for gpu in self.session.gpus:
            try:
                n.nvmlDeviceRegisterEvents(gpu.handle, self._xid_type, self._set)
            except Exception as e:
                if self.session.kind(e) != UNSUPPORTED:
                    ctx.self_metrics.problem(self.name, "register",
                                             f"GPU {gpu.label}: XID events cannot be registered: {e!r}")
                continue
            self._registered.append(gpu)
        if not self._registered:
            self._free_set()
            self.session.close()
            raise Unavailable("no GPU of this rank reports XID events to NVML")
        self._by_uuid = {g.uuid: g.label for g in self._registered}
        self._thread = threading.Thread(target=self._run, name="verl-exporter-xid-events", daemon=True)
        self._thread.start()

    def _label_of(self, device: Any) -> str:
        """The gpu label of an event's device: by UUID (handles are not comparable), else the only GPU."""
        try:
            label = self._by_uuid.get(text(self.nvml.nvmlDeviceGetUUID(device)))
        except Exception:  # an XID 79 GPU may not answer any more
            label = None
        if label is None:
            label = self._registered[0].label if len(self._registered) == 1 else UNKNOWN_GPU
        return label

    def _record(self, event: Any) -> None:
        if not int(getattr(event, "eventType", 0)) & self._xid_type:
            return
        gpu = self._label_of(event.device)
        key = (gpu, str(int(event.eventData)))
        now = self.ctx.clock()
        with self._lock:
            self._counts[key] = self._counts.get(key, 0.0) + 1.0
            self._last[gpu] = now

    def _run(self) -> None:
        wait = self.nvml.nvmlEventSetWait_v2
        while not self._stop.is_set():
            try:
                event = wait(self._set, WAIT_MS)
            except Exception as e:
                if self.session.is_code(e, self.session.timeout_code):
                    continue  # nothing happened
                if self._stop.is_set():
                    break
                self.ctx.self_metrics.problem(self.name, "wait", f"waiting for XID events failed: {e!r}")
                self._stop.wait(1.0)  # do not spin on a broken event set
                continue
            try:
                self._record(event)
            except Exception as e:
                self.ctx.self_metrics.problem(self.name, "event", f"could not read an XID event: {e!r}")

    def sample(self) -> list[Sample]:
        with self._lock:
            counts = list(self._counts.items())
            last = list(self._last.items())
        rows: list[Sample] = [("verl_gpu_xid_errors_total", {"gpu": g, "xid": x}, v) for (g, x), v in counts]
        rows.extend(("verl_gpu_last_xid_timestamp_seconds", {"gpu": g}, t) for g, t in last)
        return rows

    def _free_set(self) -> None:
        try:
            self.nvml.nvmlEventSetFree(self._set)
        except Exception as e:
            self.ctx.self_metrics.problem(self.name, "close", f"nvmlEventSetFree failed: {e!r}")

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=WAIT_MS / 1000 + 2)
        if not self._thread.is_alive():  # freeing a set a thread still waits on would be unsafe
            self._free_set()
        self.session.close()
