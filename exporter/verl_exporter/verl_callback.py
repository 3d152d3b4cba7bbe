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
