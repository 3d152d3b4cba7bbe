"""verl's checkpoint directory (--checkpoint-dir, verl's trainer.default_local_dir).

Every interval (stats only, no reading of checkpoint data):
  verl_checkpoint_latest_step
      The latest complete checkpoint, first rule that applies: the step in latest_checkpointed_iteration.txt
      (verl writes it after a complete synchronous save); else the newest global_step_N/ that has our manifest
      (written by verl_exporter.trainer.verl_callback after verl's save returned); else the newest global_step_N/.
  verl_checkpoint_latest_timestamp_seconds
      mtime of the tracker file (verl rewrites it on every save), else of that folder.
  verl_checkpoint_kept
      How many global_step_N/ checkpoints there are, not counting retired ones: verl's max_*_ckpt_to_keep
      deletes actor/ and critic/ of older checkpoints but leaves global_step_N/data.pt behind.
  verl_checkpoint_incomplete
      1 when the newest global_step_N/ is newer than the tracker's step (or there is no tracker), has no
      manifest, and nothing has been created in it for longer than --checkpoint-grace: a save that started
      and never finished, which verl would later hang on. "Nothing created" is the newest mtime of the folder
      and of the directories up to two levels below it, because shards land in actor/ (or actor/dist_ckpt/),
      which does not touch the top folder's mtime. With async_save verl writes no tracker when the save
      returns (Megatron writes it once the background writes finish), so a young folder ahead of the tracker
      is normal: the grace period covers that window.
On the slow cadence (reads whole folders):
  verl_checkpoint_latest_size_bytes
      Sum of the file sizes (apparent sizes, as the manifest counts them) under the latest folder.
  verl_checkpoint_manifest_verified{step}
      With --checkpoint-verify: each kept checkpoint that has a manifest, hashed against it; 1 ok, 0 not.
      Older than the latest, a critic/ removed whole by verl's retention is not a mismatch.
      A result is cached until the manifest or the folder's files change (their count, sizes or mtimes),
      so a checkpoint is hashed once, not every pass. Hashing runs on this collector's thread: while a large
      checkpoint is hashed (about 1 GB/s), this collector's other series are not refreshed.
A checkpoint directory that does not exist yet gives no series at all: it is not an error.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from ...checkpoint.manifest import (
    MANIFEST_NAME,
    find_checkpoints,
    has_manifest,
    is_retired,
    list_files,
    pick_latest,
    read_tracker,
    tracker_path,
    verify_manifest,
    walk,
)
from ..mapper import series_cap
from .base import Collector, Context, Sample, Unavailable, register

log = logging.getLogger(__name__)

_VERIFIED = "verl_checkpoint_manifest_verified"
_ACTIVITY_DEPTH = 2  # global_step_N/actor/dist_ckpt is as deep as verl creates folders during a save
_MAX_PROBLEMS_LOGGED = 5
# The manifest's mtime and size, and a hash of every file's (path, size, mtime): see _cache_key.
CacheKey = tuple[int, int, int]


@register
class CheckpointCollector(Collector):
    name = "checkpoint"
    description = "verl checkpoints under --checkpoint-dir: latest step, age, size, unfinished saves, manifests"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.config.checkpoint_dir is None:
            raise Unavailable("no --checkpoint-dir")
        self.root = Path(ctx.config.checkpoint_dir)
        # verify no more checkpoints than the spec lets us export, newest first
        self._verify_cap = series_cap(ctx.spec[_VERIFIED])
        # step -> (cache key, ok)
        self._verified: dict[int, tuple[tuple[CacheKey, bool], bool]] = {}  # step -> ((key, pruned_ok), ok)

    def sample(self) -> list[Sample]:
        if not self.root.is_dir():
            return []
        checkpoints = find_checkpoints(self.root)
        tracked = read_tracker(self.root)
        kept = sum(1 for _, path in checkpoints if not is_retired(path))
        out: list[Sample] = [("verl_checkpoint_kept", {}, float(kept))]
        latest = pick_latest(self.root, tracked, checkpoints)
        if latest is not None:
            out.append(("verl_checkpoint_latest_step", {}, float(latest[0])))
            written = _mtime(tracker_path(self.root)) if tracked is not None else _mtime(latest[1])
            if written is not None:  # never in the future (a shared file system's clock may run ahead)
                out.append(("verl_checkpoint_latest_timestamp_seconds", {}, min(written, self.ctx.clock())))
        out.append(("verl_checkpoint_incomplete", {}, 1.0 if self._unfinished(checkpoints, tracked) else 0.0))
        return out

    def _unfinished(self, checkpoints: list[tuple[int, Path]], tracked: int | None) -> bool:
        if not checkpoints:
            return False
        step, path = checkpoints[-1]
        if tracked is not None and step <= tracked:
            return False
        if has_manifest(path):
            return False
        last_activity = _last_activity(path)
        if last_activity is None:  # deleted while we looked: nothing left unfinished
            return False
        return self.ctx.clock() - last_activity > self.ctx.config.checkpoint_grace

    def sample_slow(self) -> list[Sample]:
        if not self.root.is_dir():
            return []
        checkpoints = find_checkpoints(self.root)
        out: list[Sample] = []
        latest = pick_latest(self.root, read_tracker(self.root), checkpoints)
        if latest is not None and latest[1].is_dir():
            out.append(("verl_checkpoint_latest_size_bytes", {}, float(_tree_size(latest[1]))))
        if self.ctx.config.checkpoint_verify:
            out.extend(self._verify(checkpoints, latest[0] if latest is not None else None))
        return out

    def _verify(self, checkpoints: list[tuple[int, Path]], latest_step: int | None) -> list[Sample]:
        candidates = [c for c in checkpoints if has_manifest(c[1]) and not is_retired(c[1])][-self._verify_cap:]
        out: list[Sample] = []
        for step, path in candidates:
            pruned_ok = step != latest_step  # verl never prunes the latest: there a missing critic/ is a loss
            try:
                key = (_cache_key(path), pruned_ok)
            except OSError:
                continue  # changing under us (verl pruning old checkpoints): look again next pass
            cached = self._verified.get(step)
            if cached is not None and cached[0] == key:
                ok = cached[1]
            else:
                result = verify_manifest(path, pruned_ok=pruned_ok)
                ok = result.ok
                self._verified[step] = (key, ok)
                if ok:
                    log.info("checkpoint step %d matches its manifest (%d files)", step, result.files_checked)
                else:
                    shown = "; ".join(result.problems[:_MAX_PROBLEMS_LOGGED])
                    more = len(result.problems) - _MAX_PROBLEMS_LOGGED
                    log.warning("checkpoint %s does not match its manifest: %s%s", path, shown,
                                f" (and {more} more)" if more > 0 else "")
            out.append((_VERIFIED, {"step": str(step)}, 1.0 if ok else 0.0))
        kept = {step for step, _ in candidates}
        self._verified = {step: v for step, v in self._verified.items() if step in kept}
        return out


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _last_activity(step_dir: Path) -> float | None:
    """Newest mtime of step_dir and the directories up to _ACTIVITY_DEPTH levels below it (stats only)."""
    newest = _mtime(step_dir)
    if newest is None:
        return None
    level = [str(step_dir)]
    for _ in range(_ACTIVITY_DEPTH):
        below = []
        for directory in level:
            try:
                with os.scandir(directory) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            below.append(entry.path)
                            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
        level = below
    return newest


def _tree_size(step_dir: Path) -> int:
    """Sum of the regular files' sizes under step_dir; unreadable folders and files removed mid-walk are skipped.

    Symlinks are not followed (lstat), like the manifest's scan: one to a file outside the checkpoint, or to a
    device, is not part of what the checkpoint holds on disk.
    """
    total = 0
    for dirpath, _dirnames, filenames in walk(step_dir):  # not os.walk: it recurses before 3.12
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _cache_key(step_dir: Path) -> CacheKey:
    """What must stay the same for an earlier verification to still hold: the manifest and every file's stat."""
    manifest = (step_dir / MANIFEST_NAME).stat()
    files = []
    for rel, path in sorted(list_files(step_dir).items()):
        st = path.stat()
        files.append((rel, st.st_size, st.st_mtime_ns))
    return manifest.st_mtime_ns, manifest.st_size, hash(tuple(files))
