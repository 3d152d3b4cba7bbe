"""The in-process API, for code that is not verl's file logger.

``Monitor.log(data, step)`` has the signature of verl's tracking backends, so a Monitor can sit next to
them; ``on_train_begin`` / ``on_batch_begin`` / ``on_batch_end(batch, logs)`` are the callback shape.

The training thread only appends to a deque (atomic under the GIL, no lock, no I/O): mapping, rendering
and writing happen on a worker thread, or on the scraping thread when it drains the queue first. If the
worker falls behind, the oldest entries are dropped and counted; training never waits.

Two ways to publish:
- ``Monitor(listen="0.0.0.0:9478")`` serves /metrics from the training process itself;
- ``Monitor(sidecar_file=PATH)`` appends lines in verl's file-logger format, for a ``verl-exporter serve
  --verl-log PATH`` sidecar to follow (one data path, whatever writes it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from ..exposition.selfmetrics import SelfMetric, SelfMetrics, describe
from ..sidecar.config import ServeConfig
from ..sidecar.control import ControlReader
from ..sidecar.store import MAX_DEPTH

LINES_PARSED = SelfMetric("verl_exporter_lines_parsed_total")
CONTROL_REQUESTS = SelfMetric("verl_exporter_control_requests_total")
BREAKER_ANOMALIES = SelfMetric("verl_exporter_breaker_anomalies_total")
BREAKER_TRIPS = SelfMetric("verl_exporter_breaker_trips_total")
MONITOR_DROPPED = SelfMetric("verl_exporter_monitor_dropped_total")

log = logging.getLogger(__name__)

SOURCE = "monitor"
COMPONENT = "monitor"
_WORKER_PERIOD_S = 0.2


def _jsonable(value: Any, depth: int = 1) -> Any:
    """verl's file logger writes NaN/Inf as null (orjson); keep that contract for the sidecar.

    Never raises: a key whose str() raises is left out (the other keys are kept), and what JSON cannot hold
    (a cycle, an integer of thousands of digits, an object without a number) becomes a string the sidecar
    counts as a rejected value.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, int):
        return value if -_BIG_INT < value < _BIG_INT else "(integer out of range)"
    if isinstance(value, (Mapping, list, tuple)):
        if depth >= MAX_DEPTH:  # as the store flattens: deeper values are not exported either
            return "(nested too deep)"
        if not isinstance(value, Mapping):
            return [_jsonable(v, depth + 1) for v in value]
        out = {}
        for k, v in value.items():
            try:
                out[k if isinstance(k, str) else str(k)] = _jsonable(v, depth + 1)
            except Exception:  # a key whose str() raises
                continue
        return out
    try:
        number = float(value)  # numpy scalars, 0-d tensors
    except Exception:
        try:
            return str(value)[:_MAX_TEXT]
        except Exception:
            return "(unprintable)"
    return number if math.isfinite(number) else None


_BIG_INT = 10**300  # beyond a float's range: the sidecar could not export it, and json may refuse its digits
_MAX_TEXT = 200


class Monitor:
    def __init__(self, *, listen: str | None = None, sidecar_file: str | None = None, run: str | None = None,
                 rank: int | None = None, queue_size: int = 4096, torch_memory: bool = False, spec=None,
                 control_file: str | None = None, control_token: str | None = None, breaker=None,
                 on_control=None, overrides: str | None = None):
        """
        control_file: where checkpoint/stop requests arrive (written by a sidecar's or this Monitor's
            /control endpoint); should_checkpoint() / should_stop() report them.
        control_token: enables POST /control/{checkpoint,stop} on this Monitor's own endpoint (listen mode).
        breaker: a CircuitBreaker, or True for one built from the spec's critical alerts.
        overrides: an overrides file (verl-exporter.yaml) applied to the spec of the endpoint and the breaker;
            unset: $VERL_EXPORTER_OVERRIDES, then ./verl-exporter.yaml when it exists ("" for none).
        on_control: called as on_control(action, reason) from the worker thread when a request arrives.
        """
        if (listen is None) == (sidecar_file is None):
            raise ValueError("Monitor needs exactly one of listen='HOST:PORT' or sidecar_file=PATH")
        if control_token and listen is None:
            raise ValueError("control_token needs listen=...: the endpoint is served by this Monitor")
        self._queue: deque = deque(maxlen=queue_size)
        self._maxlen = queue_size
        # Written by the training thread only; the worker publishes the difference (no lost increments).
        self._dropped = 0
        self._dropped_published = 0
        self._drain_lock = threading.Lock()
        self._stop = threading.Event()
        self._sidecar = None
        self._file = None
        self._file_path = sidecar_file
        self._on_control = on_control
        self._control_lock = threading.Lock()  # between the worker and should_*(); never the scraper's
        self._checkpoint_requested = False
        self._stop_requested = False
        self.control_reason = ""
        own_file = control_token and control_file is None
        if own_file:  # written and read by this process only
            import tempfile

            control_file = os.path.join(tempfile.mkdtemp(prefix="verl-exporter-control-"), "control.json")
        self._control = ControlReader(control_file, on_error=self._control_unreadable) if control_file else None
        if spec is None and (listen is not None or breaker is True):
            from ..spec.overrides import load_effective_spec

            spec = load_effective_spec(None, overrides)  # one spec for the endpoint and the breaker
        if listen is not None:
            from ..sidecar.collectors import REGISTRY
            from ..sidecar.sidecar import Sidecar

            # In the training process only what the process itself knows: no host or GPU collectors
            # (the per-rank sidecar has those), and torch's allocator stats when asked for.
            config = ServeConfig(listen=listen, run=run, rank=rank, collectors={n: False for n in REGISTRY},
                                 **({"control_file_mode": "0600"} if own_file else {}))
            self._sidecar = Sidecar(config, spec=spec, before_scrape=self.drain, control_token=control_token,
                                    control_file=control_file)
            self._torch = None
            if torch_memory:
                self._torch_collector(memory=True)
            self._self: SelfMetrics = self._sidecar.self_metrics
            self._self.inc(LINES_PARSED, 0, source=SOURCE)
            self._sidecar.start()
        if breaker is True:
            from .breaker import CircuitBreaker

            breaker = CircuitBreaker.from_spec(spec)
        self.breaker = breaker or None
        self._worker = threading.Thread(target=self._run, name="verl-exporter-monitor", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ the training thread's side
    def log(self, data: Mapping, step: int | None = None, backend=None) -> None:
        """Hand one step's metrics over. Never raises, never blocks, O(len(data)) for a shallow copy."""
        try:
            if len(self._queue) >= self._maxlen:
                self._dropped += 1
            self._queue.append((step, dict(data), time.time()))
        except Exception:
            self._dropped += 1

    def on_train_begin(self, logs: Mapping | None = None) -> None:
        if logs:
            self.log(logs, step=None)

    def on_batch_begin(self, batch: int | None = None, logs: Mapping | None = None) -> None:
        """Nothing to record before a batch; present so Monitor fits the callback shape."""

    def on_batch_end(self, batch: int, logs: Mapping | None = None) -> None:
        if logs:
            self.log(logs, step=batch)

    # ------------------------------------------------------------------ automated response
    def should_checkpoint(self) -> bool:
        """True once for each checkpoint request (from the control endpoint or the circuit breaker)."""
        with self._control_lock:
            requested, self._checkpoint_requested = self._checkpoint_requested, False
        return requested

    def should_stop(self) -> bool:
        """True once a stop was requested; stays true (a stop request is idempotent)."""
        return self._stop_requested

    def _request(self, action: str, reason: str) -> None:
        with self._control_lock:
            if action == "checkpoint":
                self._checkpoint_requested = True
            elif self._stop_requested:
                return
            else:
                self._stop_requested = True
            self.control_reason = reason
        if self._sidecar:
            self._self.inc(CONTROL_REQUESTS, action=action, result="delivered")
        if self._on_control:
            try:
                self._on_control(action, reason)
            except Exception as e:
                if self._sidecar:
                    self._self.problem(COMPONENT, "on_control", f"on_control callback failed: {e!r}")

    def _control_unreadable(self, message: str) -> None:
        if self._sidecar:
            self._self.problem(COMPONENT, "control_read", message)

    def _poll_control(self) -> None:
        if self._control is None:
            return
        self._control.poll()
        if self._control.take_checkpoint_request():
            self._request("checkpoint", self._control.reason)
        if self._control.stop_requested and not self._stop_requested:
            self._request("stop", self._control.reason)

    def grad_watch(self):
        """A GradWatch whose values this Monitor's endpoint exports (verl_torch_grad_norm, ...)."""
        from .torch_helpers import GradWatch

        if self._sidecar is None:
            raise ValueError("grad_watch() needs a Monitor with its own endpoint (listen=...)")
        watch = GradWatch()
        self._torch_collector(memory=False).grad_watch = watch
        return watch

    def _torch_collector(self, memory: bool):
        from .torch_helpers import TorchCollector

        if self._torch is None:
            self._torch = TorchCollector(self._sidecar.context(), memory=memory)
            self._sidecar.sampler.add(self._torch)
        return self._torch

    @property
    def url(self) -> str | None:
        return self._sidecar.server.url if self._sidecar and self._sidecar.server else None

    @property
    def sidecar(self):
        return self._sidecar

    def close(self) -> None:
        """Flush what is queued and stop the worker (and the endpoint, if any)."""
        self._stop.set()
        self._worker.join(timeout=5)
        self.drain()
        if self._file:
            self._file.close()
            self._file = None
        if self._sidecar:
            self._sidecar.stop()

    finish = close  # verl's tracking backends are closed with finish()

    # ------------------------------------------------------------------ the worker's side
    def _run(self) -> None:
        while not self._stop.wait(_WORKER_PERIOD_S):
            self.drain()
            if self.breaker is not None:
                try:  # a hung trainer logs nothing: its stall is judged on the clock
                    self._on_trip(self.breaker.tick())
                except Exception as e:
                    if self._sidecar:
                        self._self.problem(COMPONENT, "breaker", f"the breaker could not judge a stall: {describe(e)}")
            try:
                self._poll_control()
            except Exception as e:
                if self._sidecar:
                    self._self.problem(COMPONENT, "control", f"reading the control file failed: {e!r}")

    def drain(self) -> None:
        """Move everything queued into the store or the file. One drainer at a time keeps step order."""
        with self._drain_lock:
            try:
                self._publish_drops()
                while self._queue:
                    self._publish(*self._queue.popleft())
                if self._file:
                    self._file.flush()
            except Exception as e:  # monitoring never raises into training, nor kills its worker
                if self._sidecar:
                    self._self.problem(COMPONENT, "drain", f"could not publish a step: {describe(e)}")

    def _publish(self, step, data, seen_at) -> None:
        """One step; whatever fails costs this step's part alone (the breaker, the store or the file)."""
        if self.breaker is not None:
            try:
                self._observe_breaker(step, data, seen_at)
            except Exception as e:
                if self._sidecar:
                    self._self.problem(COMPONENT, "breaker", f"the breaker could not take a step: {describe(e)}")
        try:
            if self._sidecar:
                self._sidecar.store.ingest(step, data, seen_at)
                self._self.inc(LINES_PARSED, source=SOURCE)
            else:
                self._write_line(step, data)
        except Exception as e:
            if self._sidecar:
                self._self.problem(COMPONENT, "drain", f"could not publish a step: {describe(e)}")

    def _observe_breaker(self, step, data, seen_at) -> None:
        anomalies, trip = self.breaker.observe(step, data, seen_at)
        if self._sidecar:
            for a in anomalies:
                self._self.inc(BREAKER_ANOMALIES, alert=a.alert)
        self._on_trip(trip)

    def _on_trip(self, trip) -> None:
        if trip is None:
            return
        if self._sidecar:
            self._self.inc(BREAKER_TRIPS)
        reason = f"circuit breaker tripped at step {trip.step}: {trip.alert} (holding: " + ", ".join(
            f"{a.alert} {a.value:.4g}" if a.value is not None else a.alert for a in trip.anomalies) + ")"
        log.error("verl-exporter: %s; report: %s", reason, trip.report_path or "(no report_dir)")
        self._request("checkpoint", reason)
        self._request("stop", reason)

    def _publish_drops(self) -> None:
        dropped = self._dropped
        if self._sidecar and dropped != self._dropped_published:
            self._self.inc(MONITOR_DROPPED, dropped - self._dropped_published)
            self._dropped_published = dropped

    def _write_line(self, step, data) -> None:
        if self._file is None:
            self._file = open(self._file_path, "ab")  # noqa: SIM115 - kept open across steps
        line = json.dumps({"step": _jsonable(step), "data": _jsonable(data)}, separators=(",", ":"), allow_nan=False)
        self._file.write(line.encode() + b"\n")
