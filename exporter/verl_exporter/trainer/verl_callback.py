"""A verl checkpoint callback that writes a SHA-256 manifest into every checkpoint it is told about.

Use it with verl's trainer (the v1 PPO trainer calls it on the driver after each save)::

    trainer.checkpoint_callback_class=verl_exporter.trainer.verl_callback.ManifestCheckpointCallback

Then ``verl-exporter checkpoint verify DIR`` (or the sidecar's --checkpoint-verify) checks a checkpoint against
its manifest before you resume from it or copy it away.

- verl aborts training when its callback raises, so on_save never does: any failure is logged and swallowed.
  A manifest is a convenience; losing a training run over one is not.
- With async_save (Megatron) verl calls on_save while worker writes may still be in flight, and writes the
  tracker file only later. Hashing then would record half-written shards as the truth, so such saves get no
  manifest (``verl-exporter checkpoint manifest DIR`` can add one once the save is done).
- The manifest covers what the driver's file system shows. On several nodes without a shared file system
  that is only the driver node's part of the checkpoint.
- Hashing reads the whole checkpoint once, on the driver, before training goes on: SHA-256 runs at about
  1 GB/s per core, so count a second or more per GB (more when the disk is slower than that).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from pathlib import Path

from ..checkpoint.manifest import MANIFEST_NAME, write_manifest
from ..sidecar.control import default_control_file

log = logging.getLogger(__name__)

try:  # a subclass of verl's own base class when verl is here, so verl's type checks and future hooks apply
    from verl.trainer.ppo.checkpoint_callback import CheckpointCallback as _CallbackBase
except Exception:  # verl absent or broken: importing this module must still work (tests, docs, other tools)

    class _CallbackBase:  # type: ignore[no-redef]
        """Stand-in for verl.trainer.ppo.checkpoint_callback.CheckpointCallback (same signatures)."""

        def __init__(self, config=None):
            self.config = config

        def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False,
                    **kwargs) -> None:
            """Called after a checkpoint save (verl's contract)."""


class ManifestCheckpointCallback(_CallbackBase):
    """Writes <checkpoint_dir>/verl_exporter_manifest.json after each synchronous save; never raises."""

    def __init__(self, config=None):
        super().__init__(config=config)
        self._failures = 0
        self._told_async = False

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False,
                **kwargs) -> None:
        try:
            self._on_save(global_step, checkpoint_dir, async_save)
        except Exception as e:  # not BaseException: Ctrl-C and SystemExit must still stop the trainer
            self._failures += 1
            # the traceback once; later failures (likely the same cause) one line each
            log.warning("verl-exporter: no manifest for checkpoint step %s in %s: %r", global_step, checkpoint_dir,
                        e, exc_info=self._failures == 1)

    def _on_save(self, global_step, checkpoint_dir, async_save: bool) -> None:
        if async_save:
            # WARNING the first time, so that a user who expected manifests learns why there are none
            level = logging.INFO if self._told_async else logging.WARNING
            self._told_async = True
            log.log(level, "verl-exporter: no manifest for checkpoint step %s: async_save may still be writing %s",
                    global_step, checkpoint_dir)
            # A manifest there is an earlier save's (a resumed run saving a step again): it no longer describes
            # the folder, and checking against it would call the new checkpoint corrupt.
            stale = Path(checkpoint_dir) / MANIFEST_NAME
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
                log.warning("verl-exporter: removed %s, the manifest of an earlier save of that folder", stale)
            return
        started = time.monotonic()
        path = write_manifest(checkpoint_dir)
        log.info("verl-exporter: wrote %s in %.1fs", path, time.monotonic() - started)


# ---------------------------------------------------------------------------- step-boundary control
class _StopAtBoundary(Exception):
    """Raised from the per-step log call to leave the legacy RayPPOTrainer.fit() loop right after a step."""


class StepControl:
    """Acts on control requests (verl-exporter's /control endpoint) at verl's step boundaries.

    At a boundary, a pending checkpoint request saves one with the trainer's own ``_save_checkpoint()``
    (unless verl has just saved this step itself); a stop request saves one and tells the caller to leave the
    loop. Reading the control file costs one stat per step.
    """

    def __init__(self, control_file: str):
        from ..sidecar.control import ControlReader

        self.reader = ControlReader(control_file)
        self.saved_steps: list[int] = []  # the saves made for requests
        self.last_saved_step: int | None = None  # the last save of any kind (verl's save_freq ones too)
        self.stopped_at: int | None = None

    def after_step(self, trainer) -> bool:
        """Called at a step boundary: may save a checkpoint; True when the run must stop. Never raises."""
        try:
            self.reader.poll()
            checkpoint = self.reader.take_checkpoint_request()
            stop = self.reader.stop_requested
        except Exception as e:
            log.warning("verl-exporter: cannot read the control file: %r", e)
            return False
        if not (checkpoint or stop) or self.stopped_at is not None:
            return self.stopped_at is not None
        step = getattr(trainer, "global_steps", None)
        reason = self.reader.reason or "control request"
        if step is not None and step == self.last_saved_step:
            log.warning("verl-exporter: step %s is already saved (%s)", step, reason)
        else:
            try:
                log.warning("verl-exporter: saving a checkpoint at step %s (%s)", step, reason)
                trainer._save_checkpoint()
                self.saved_steps.append(step)
                self.last_saved_step = step
            except Exception as e:  # a failed save must not also lose the run
                log.error("verl-exporter: the requested checkpoint at step %s failed: %r", step, e)
        if stop:
            self.stopped_at = step
            log.warning("verl-exporter: stopping after step %s (%s)", step, reason)
        return bool(stop)


def install_v1_step_control(trainer_base) -> None:
    """Make verl's v1 loop (``verl.trainer.ppo.v1.trainer_base.PPOTrainer.fit``) act on control requests.

    Every v1 trainer mode inherits the base class's fit(), which calls ``self.on_step_end()`` once per step
    after the update, verl's own save and the weight sync: a consistent boundary. During fit() the trainer's
    on_step_end is followed by its checkpoint callback's StepControl. A stop ends the loop through verl's own
    exit path: the step's validation and metrics are still logged, then the loop condition
    (``global_steps <= total_training_steps``) fails, so on_train_end() and the dump executor's shutdown run
    and fit() returns normally. Idempotent; a trainer without a ControlledCheckpointCallback is untouched.
    """
    if getattr(trainer_base.fit, "_verl_exporter_wrapped", False):
        return
    original_fit = trainer_base.fit

    @functools.wraps(original_fit)
    def fit(self, *args, **kwargs):
        control = getattr(getattr(self, "checkpoint_callback", None), "control", None)
        if not isinstance(control, StepControl):
            return original_fit(self, *args, **kwargs)
        step_end = self.on_step_end  # the subclass's own hook (weight sync and so on) runs first

        def on_step_end():
            step_end()
            if control.after_step(self):
                self.total_training_steps = self.global_steps  # this step is the last one

        self.on_step_end = on_step_end
        try:
            return original_fit(self, *args, **kwargs)
        finally:
            del self.on_step_end

    fit._verl_exporter_wrapped = True
    trainer_base.fit = fit


def install_step_control(trainer_cls, control_file: str) -> StepControl:
    """Legacy loop (``trainer.use_v1=false``): wrap ``trainer_cls.fit`` so that verl's per-step
    ``Tracking.log`` call runs StepControl.after_step, and a stop leaves fit() by an exception caught here.

    verl 0.9.1 never builds the checkpoint callback in its legacy RayPPOTrainer, so nothing calls this for
    you there: call it in your own entry point before ``trainer.fit()``. Idempotent per class. Trainers that
    override fit() call ``control.after_step(self)`` themselves.
    """
    from verl.utils import tracking

    control = StepControl(control_file)
    if getattr(trainer_cls.fit, "_verl_exporter_wrapped", False):
        trainer_cls.fit._verl_exporter_control[0] = control
        return control
    original_fit = trainer_cls.fit
    original_log = tracking.Tracking.log
    holder = [control]

    def fit(self, *args, **kwargs):
        active = holder[0]

        def log_then_control(tracker, data, step, backend=None):
            original_log(tracker, data=data, step=step, backend=backend)
            if active.after_step(self):
                raise _StopAtBoundary(active.reader.reason)

        tracking.Tracking.log = log_then_control
        try:
            return original_fit(self, *args, **kwargs)
        except _StopAtBoundary:
            shutdown = getattr(self, "_shutdown_dump_executor", None)
            if callable(shutdown):
                shutdown()
            return None
        finally:
            tracking.Tracking.log = original_log

    fit._verl_exporter_wrapped = True
    fit._verl_exporter_control = holder
    trainer_cls.fit = fit
    return control


class ControlledCheckpointCallback(ManifestCheckpointCallback):
    """ManifestCheckpointCallback plus step-boundary control of verl's v1 trainer (verl 0.9.1's default).

        trainer.checkpoint_callback_class=verl_exporter.trainer.verl_callback.ControlledCheckpointCallback

    verl's v1 PPOTrainer builds the callback in its __init__, inside the process that runs fit(): the hook
    goes there (see install_v1_step_control), for every ``trainer.v1.trainer_mode``. The control file is the
    sidecar's default, ``<trainer.default_local_dir>/.verl-exporter-control.json``, or
    $VERL_EXPORTER_CONTROL_FILE. The requests already in it when the callback is built (the stop that ended the
    run this one resumes) are not acted on; every later request is, once.
    """

    def __init__(self, config=None):
        super().__init__(config=config)
        self.control: StepControl | None = None
        try:
            path = os.environ.get("VERL_EXPORTER_CONTROL_FILE") or default_control_file(
                _get(config, "trainer", "default_local_dir"))
            if not path:
                log.warning("verl-exporter: step control is off: no trainer.default_local_dir and no "
                            "$VERL_EXPORTER_CONTROL_FILE")
                return
            from verl.trainer.ppo.v1.trainer_base import PPOTrainer

            install_v1_step_control(PPOTrainer)
            self.control = StepControl(path)
            log.info("verl-exporter: step control reads %s", path)
        except Exception as e:  # never break the trainer's construction
            log.warning("verl-exporter: step control is off: %r", e)

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False,
                **kwargs) -> None:
        if self.control is not None:
            self.control.last_saved_step = global_step  # a stop right after verl's own save needs no second one
        super().on_save(trainer, global_step, checkpoint_dir, async_save=async_save, **kwargs)


def _get(config, *keys):
    node = config
    for k in keys:
        if node is None:
            return None
        node = node.get(k) if hasattr(node, "get") else getattr(node, k, None)
    return node
