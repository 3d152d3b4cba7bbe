"""The disk check: the checkpoint folder is writable (a temporary file created and removed there, the only
write of the check) and its filesystem holds the next saves: the last checkpoint's size times the saves
that will be on disk beyond those kept now (verl trims to max_ckpt_to_keep - 1 before it saves; with no
limit, the knob saves_ahead), plus the knob free_space_margin."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ...checkpoint.manifest import find_checkpoints, is_retired, latest_checkpoint, read_manifest, scan_files
from .report import Finding, Options

CHECK = "disk"
PROBE_PREFIX = ".verl-exporter-preflight-"
GB = 1e9


def _existing(path: Path) -> Path:
    """path, or its nearest existing parent (verl creates the checkpoint folder on its first save)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def checkpoint_size(step_dir: Path) -> int | None:
    """Bytes of a checkpoint: its manifest's sizes when it has one (nothing read), else the files' sizes."""
    entries, _ = read_manifest(step_dir)
    if entries is not None:
        return sum(e["size"] for e in entries)
    try:
        return sum(p.stat().st_size for p in scan_files(step_dir).files.values())
    except OSError:
        return None


def check(o: Options) -> list[Finding]:
    if not o.checkpoint_dir:
        return [Finding(CHECK, True, "no --checkpoint-dir given: nothing to check")]
    folder = _existing(Path(o.checkpoint_dir))
    if not folder.is_dir():
        return [Finding(CHECK, False, f"{folder} is not a directory; point --checkpoint-dir at verl's "
                                      "trainer.default_local_dir")]
    out: list[Finding] = []
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=PROBE_PREFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        out.append(Finding(CHECK, False, f"{folder} is not writable ({e.strerror}): verl's next save would fail; "
                                         "fix its permissions or mount (read-only? quota?)"))
    try:
        st = os.statvfs(folder)
    except OSError as e:
        return out + [Finding(CHECK, False, f"{folder}: free space unknown ({e.strerror}); check the mount")]
    free = st.f_bavail * st.f_frsize
    latest = latest_checkpoint(o.checkpoint_dir) if folder == Path(o.checkpoint_dir) else None
    size = checkpoint_size(latest[1]) if latest and latest[1].is_dir() else None
    if not size:
        if all(f.ok for f in out):
            out.append(Finding(CHECK, True, f"{folder} writable, {free / GB:.1f} GB free (no checkpoint yet to "
                                            "size the next saves by)"))
        return out
    kept = sum(1 for _, path in find_checkpoints(o.checkpoint_dir) if not is_retired(path))
    keep = o.max_ckpt_to_keep
    saves = max(keep - kept, 1) if keep else o.knobs.saves_ahead
    need = size * saves * (1 + o.knobs.free_space_margin)
    if free < need:
        out.append(Finding(CHECK, False, f"{folder} has {free / GB:.1f} GB free, the next {saves} save(s) of "
                                         f"{size / GB:.1f} GB need {need / GB:.1f} GB (with a "
                                         f"{o.knobs.free_space_margin:.0%} margin): free space, or lower "
                                         "trainer.max_actor_ckpt_to_keep"))
    elif all(f.ok for f in out):
        out.append(Finding(CHECK, True, f"{folder} writable, {free / GB:.1f} GB free for the next {saves} save(s) "
                                        f"of {size / GB:.1f} GB ({kept} kept"
                                        + (f", max_ckpt_to_keep {keep})" if keep else ")")))
    return out
