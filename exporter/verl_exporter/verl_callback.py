"""A verl checkpoint callback that writes a SHA-256 manifest into every checkpoint it is told about.

Use it with verl's trainer (the v1 PPO trainer calls it on the driver after each save)::

    trainer.checkpoint_callback_class=verl_exporter.verl_callback.ManifestCheckpointCallback

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

import logging
import time

from .checkpoint_manifest import write_manifest

log = logging.getLogger("verl_exporter")

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
            return
        started = time.monotonic()
        path = write_manifest(checkpoint_dir)
        log.info("verl-exporter: wrote %s in %.1fs", path, time.monotonic() - started)


# ---------------------------------------------------------------------------- step-boundary control
class _StopAtBoundary(Exception):
    """Raised from the per-step log call to leave verl's fit() loop right after a step."""


class StepControl:
    """Acts on control requests (verl-exporter's /control endpoint) at verl's step boundaries.

    verl's fit() calls its tracker's ``log()`` once per step, after the step's update and weight sync: the
    boundary where a checkpoint is consistent. At that call a pending checkpoint request saves one
    (``trainer._save_checkpoint()``); a stop request saves one and leaves fit() cleanly, so verl's entry
    point returns normally instead of the job being killed.
    """

    def __init__(self, control_file: str):
        from .control import ControlReader

        self.reader = ControlReader(control_file)
        self.saved_steps: list[int] = []
        self.stopped_at: int | None = None

    def after_step(self, trainer) -> None:
        """Called at a step boundary; may save a checkpoint and raise _StopAtBoundary. Never raises else."""
        try:
            self.reader.poll()
            checkpoint = self.reader.take_checkpoint_request()
            stop = self.reader.stop_requested
        except Exception as e:
            log.warning("verl-exporter: cannot read the control file: %r", e)
            return
        if not (checkpoint or stop):
            return
        step = getattr(trainer, "global_steps", None)
        reason = self.reader.reason or "control request"
        try:
            log.warning("verl-exporter: saving a checkpoint at step %s (%s)", step, reason)
            trainer._save_checkpoint()
            self.saved_steps.append(step)
        except Exception as e:  # a failed save must not also lose the run
            log.error("verl-exporter: the requested checkpoint at step %s failed: %r", step, e)
        if stop:
            self.stopped_at = step
            log.warning("verl-exporter: stopping at step %s (%s)", step, reason)
            raise _StopAtBoundary(reason)


def install_step_control(trainer_cls, control_file: str) -> StepControl:
    """Wrap ``trainer_cls.fit`` so that verl's per-step ``Tracking.log`` call runs StepControl.after_step.

    Idempotent per class. Trainers that override fit() need to call ``control.after_step(self)`` themselves.
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
            active.after_step(self)

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
    """ManifestCheckpointCallback plus step-boundary control of verl's RayPPOTrainer.

        trainer.checkpoint_callback_class=verl_exporter.verl_callback.ControlledCheckpointCallback

    verl builds the callback inside the process that runs fit(), which is where the hook must live. The
    control file is the sidecar's default, ``<trainer.default_local_dir>/.verl-exporter-control.json``, or
    $VERL_EXPORTER_CONTROL_FILE.
    """

    def __init__(self, config=None):
        super().__init__(config=config)
        self.control: StepControl | None = None
        try:
            import os

            from .control import default_control_file

            path = os.environ.get("VERL_EXPORTER_CONTROL_FILE") or default_control_file(
                _get(config, "trainer", "default_local_dir"))
            if path:
                from verl.trainer.ppo.ray_trainer import RayPPOTrainer

                self.control = install_step_control(RayPPOTrainer, path)
        except Exception as e:  # never break the trainer's construction
            log.warning("verl-exporter: step control is off: %r", e)


def _get(config, *keys):
    node = config
    for k in keys:
        if node is None:
            return None
        node = node.get(k) if hasattr(node, "get") else getattr(node, k, None)
    return node
