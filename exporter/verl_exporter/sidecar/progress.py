"""Progress supervision across restarts: a run's step high-water mark, its restarts, ETA and next checkpoint.

What one sidecar process sees is lost when it restarts, and verl's log starts again when the trainer does
(mode "wb"). So the high-water mark and the restart counts live in ``<state dir>/progress.json``, replaced
whole (core.atomicfile) whenever they change, and read back at start.

A trainer restart is any of: the followed log truncated or replaced (the follower's
verl_exporter_source_resets_total going up), the logged step going below the last one seen, a --trainer-pid
other than the one in the state file (a sidecar started again for a new trainer).

The evaluations counted so far (sidecar/events.py: per validation series, how many, the last step and when) are
kept there too, so that a restarted sidecar goes on counting instead of starting again from the recovered tail
(a counter going back would read as new evaluations to Prometheus' increase()).

A stop this sidecar's control endpoint accepted (the relay's stop action, a person's POST /control/stop) is kept
in the state too, until the trainer restarts: a run that ends after it was asked to has not ended early.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, PlainValidator

from ..core.atomicfile import write_atomic
from ..core.models import FileError, Pid, StrictModel, read_json, valid_fields
from ..exposition.selfmetrics import SelfMetric, SelfMetrics
from .events import EventState, EventStates
from .store import as_step

if TYPE_CHECKING:
    from .store import TrainingStore

RESTARTS = SelfMetric("verl_run_restarts_total")
RESTARTS_WITHOUT_PROGRESS = SelfMetric("verl_run_restarts_without_progress")
RESTART_REDONE_STEPS = SelfMetric("verl_run_restart_redone_steps")
MAX_STEP = SelfMetric("verl_run_max_step")
TRAINER_RUNNING = SelfMetric("verl_run_trainer_running")
ETA_SECONDS = SelfMetric("verl_run_eta_seconds")
NEXT_CHECKPOINT_TIMESTAMP_SECONDS = SelfMetric("verl_run_next_checkpoint_timestamp_seconds")
PLANNED_STEPS = SelfMetric("verl_run_planned_steps")
DEADLINE_TIMESTAMP_SECONDS = SelfMetric("verl_run_deadline_timestamp_seconds")
CHECKPOINTS_TO_KEEP = SelfMetric("verl_run_checkpoints_to_keep")
STOP_REQUESTED = SelfMetric("verl_run_stop_requested")

log = logging.getLogger(__name__)

STATE_NAME = "progress.json"
REJECTED_SUFFIX = ".rejected"  # a state file that could not be used whole is kept beside it under this name
# The sidecar writes a few hundred bytes, and ~150 for each evaluated validation series it keeps: a run's few
# dozen series stay far below this, and so do the 200 of the spec's cap with four label values of 128 characters
# each, JSON-escaped at worst (~1.3 MB).
MAX_STATE_BYTES = 4 * 1024 * 1024
_MAX_COUNT = 2**53  # a count above this is no count of restarts (and a float no longer holds every integer)


def _step(value: Any) -> float:
    step = as_step(value)  # the store's own test of a step: a non-negative integer below 2**53
    if step is None:
        raise ValueError("not a step (a non-negative integer)")
    return step


Step = Annotated[float, PlainValidator(_step)]
Count = Annotated[int, Field(ge=0, le=_MAX_COUNT)]


class ProgressState(StrictModel):
    """progress.json as the sidecar writes it; every field checked when it is read back (null only where the
    sidecar writes it: no step seen yet, no --trainer-pid)."""

    last_step: Step | None = None
    max_step: Step | None = None
    restarts: Count = 0
    restarts_without_progress: Count = 0
    redone_steps: Annotated[float, Field(ge=0, le=_MAX_COUNT)] = 0.0
    trainer_pid: Pid | None = None
    stop_requested: bool = False
    awaiting_resume: bool = False
    events: EventStates | None = None  # the evaluations counted (sidecar/events.py), left out while there are none
_RESETS = SelfMetric("verl_exporter_source_resets_total")
_CONTROL = SelfMetric("verl_exporter_control_requests_total")


class Progress:
    def __init__(self, state_dir: str, store: TrainingStore, self_metrics: SelfMetrics, trainer_pid: int | None = None,
                 planned_steps: int | None = None, save_freq: int | None = None, deadline: float | None = None,
                 ckpt_to_keep: int | None = None, interval: float = 1.0,
                 clock: Callable[[], float] = time.time):
        self.path = Path(state_dir) / STATE_NAME
        self._store = store
        self._self = self_metrics
        self._trainer_pid = trainer_pid
        self._planned = planned_steps
        self._save_freq = save_freq
        self._interval = interval
        self._clock = clock
        self.state = self._load()
        # before the follower recovers the log's tail: the evaluations in it that were counted stay counted
        if self.state.get("events"):
            left_out = store.restore_events([EventState.model_validate(e) for e in self.state["events"]])
            if left_out:
                self._self.problem("progress", "state", f"{self.path}: {left_out} evaluation record(s) of series "
                                   "this spec does not export left out", expected=True)
        # the last step seen, kept across sidecar restarts: a recovered log below it is a trainer restart
        self._last_step: float | None = self.state.get("last_step")
        self._resets = self._resets_seen()
        self._stops = self._stops_accepted()
        if trainer_pid is not None and self.state.get("trainer_pid") not in (None, trainer_pid):
            self._restarted()  # a sidecar started for a new trainer
        self.state["trainer_pid"] = trainer_pid
        self._save()
        for metric, value in ((PLANNED_STEPS, planned_steps), (DEADLINE_TIMESTAMP_SECONDS, deadline),
                              (CHECKPOINTS_TO_KEEP, ckpt_to_keep)):
            if value is not None:
                self._self.set(metric, value)
        self._export()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verl-progress", daemon=True)

    def _load(self) -> dict[str, Any]:
        """The state read back as hostile input: a wrong field is left out, a file that is no state starts a
        new one. Either way the file is set aside (progress.json.rejected), counted and logged; the sidecar
        starts."""
        try:
            doc = read_json(self.path, MAX_STATE_BYTES)
        except FileNotFoundError:
            return {}
        except FileError as e:
            self._reject("; ".join(e.problems) + ": starting a new one")
            return {}
        if not isinstance(doc, dict):
            self._reject("not a JSON object: starting a new one")
            return {}
        state, bad = valid_fields(ProgressState, doc)
        if bad:
            shown = ", ".join(repr(name[:40]) for name in bad[:5]) + (", ..." if len(bad) > 5 else "")
            self._reject(f"{len(bad)} field(s) of a wrong type or out of range left out: {shown}")
        return state.model_dump(exclude_none=True)

    def _reject(self, why: str) -> None:
        aside = self.path.with_name(self.path.name + REJECTED_SUFFIX)
        try:
            os.replace(self.path, aside)
        except OSError as e:
            aside = Path(f"(not set aside: {e.strerror})")
        self._self.problem("progress", "state", f"{self.path}: {why} (the file as it was: {aside})", expected=True)

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(self.state, sort_keys=True))
        except OSError as e:
            self._self.problem("progress", "write", f"cannot write {self.path}: {e}")

    def _resets_seen(self) -> float:
        snapshot = self._self.snapshot().get(_RESETS.name, {})
        return sum(snapshot.values())

    def _stops_accepted(self) -> float:
        return self._self.value(_CONTROL, action="stop", result="accepted")

    def _restarted(self) -> None:
        s = self.state
        s.pop("stop_requested", None)  # asked of the trainer before: the new one was not
        s["restarts"] = s.get("restarts", 0) + 1
        s["restarts_without_progress"] = s.get("restarts_without_progress", 0) + 1
        s["awaiting_resume"] = True  # the first step after it says where it resumed from

    def update(self) -> None:
        """Take what the store and the follower saw since the last call; save the state when it changed."""
        before = json.dumps(self.state, sort_keys=True)
        resets = self._resets_seen()
        step = self._store.step
        went_back = step is not None and self._last_step is not None and step < self._last_step
        if resets > self._resets or (went_back and not self.state.get("awaiting_resume")):
            self._restarted()
        self._resets = resets
        s = self.state
        stops = self._stops_accepted()
        if stops > self._stops:
            s["stop_requested"] = True
        self._stops = stops
        if step is not None and step != self._last_step:
            high = s.get("max_step")
            if s.pop("awaiting_resume", False) and high is not None:
                s["redone_steps"] = max(0.0, high - step)
            if high is None or step > high:
                s["max_step"] = step
                s["restarts_without_progress"] = 0
        self._last_step = s["last_step"] = step
        events = self._store.events_state()
        if events:
            s["events"] = events
        else:
            s.pop("events", None)
        if json.dumps(s, sort_keys=True) != before:
            self._save()
        self._export()

    def _export(self) -> None:
        s = self.state
        self._self.set(RESTARTS, s.get("restarts", 0))
        self._self.set(RESTARTS_WITHOUT_PROGRESS, s.get("restarts_without_progress", 0))
        self._self.set(RESTART_REDONE_STEPS, s.get("redone_steps", 0))
        self._self.set(STOP_REQUESTED, 1.0 if s.get("stop_requested") else 0.0)
        if s.get("max_step") is not None:
            self._self.set(MAX_STEP, s["max_step"])
        if self._trainer_pid is not None:
            self._self.set(TRAINER_RUNNING, 1.0 if _exists(self._trainer_pid) else 0.0)
        step, seconds = self._store.step, self._store.recent_step_seconds()
        if step is None or not seconds:
            return
        if self._planned is not None:
            self._self.set(ETA_SECONDS, max(0.0, self._planned - step) * seconds)
        if self._save_freq:
            left = self._save_freq - step % self._save_freq
            self._self.set(NEXT_CHECKPOINT_TIMESTAMP_SECONDS, self._clock() + left * seconds)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.update()
            except Exception as e:  # supervision must never take the sidecar down
                self._self.problem("progress", "update", f"progress update failed: {e}")

    def start(self) -> Progress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.update()  # the last step seen is in the state file when the sidecar exits


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return True
