"""verl-exporter checkpoint manifest|verify DIR: write or check a checkpoint's SHA-256 manifest.

DIR is a global_step_N folder (or any folder that already holds a manifest), or a checkpoint directory
(verl's trainer.default_local_dir), which stands for its latest checkpoint: the tracker file's step, else the
newest folder with a manifest, else the newest folder.

Only regular files inside DIR are hashed: symlinks to directories or out of DIR, dangling symlinks, FIFOs,
sockets and devices are skipped, each named on stderr (and listed in the manifest).

Exit status: 0 done / everything matches; 1 problems found (each on stderr) or the manifest could not be
written; 2 usage errors (DIR missing, or not a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .manifest import (
    MANIFEST_NAME,
    find_checkpoints,
    latest_checkpoint,
    step_of,
    verify_manifest,
    write_manifest,
)

_PROG = "verl-exporter checkpoint"


class _UsageError(Exception):
    pass


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``checkpoint`` (with ``manifest`` and ``verify``) to the top-level subparsers."""
    p = subparsers.add_parser("checkpoint", help="write or check a SHA-256 manifest of a verl checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="checkpoint_command", required=True, metavar="{manifest,verify}")
    manifest = sub.add_parser("manifest", help=f"hash every file of a checkpoint into {MANIFEST_NAME}")
    manifest.add_argument("dir", metavar="DIR", help="a global_step_N folder, or the checkpoint directory (latest)")
    verify = sub.add_parser("verify", help="check a checkpoint against its manifest (exit 1 on any mismatch)")
    verify.add_argument("dir", metavar="DIR", help="a global_step_N folder, or the checkpoint directory (latest)")
    return p


def resolve_step_dir(arg: str) -> Path:
    """The checkpoint folder that DIR stands for; _UsageError when there is none."""
    path = Path(arg)
    if not path.exists():
        raise _UsageError(f"{arg} does not exist")
    if not path.is_dir():
        raise _UsageError(f"{arg} is not a directory")
    if (path / MANIFEST_NAME).is_file() or step_of(path.absolute()) is not None:
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise _UsageError(f"{arg} is neither a global_step_N folder nor a checkpoint directory holding one")
    step, step_dir = latest
    if not step_dir.is_dir():
        newest = find_checkpoints(path)[-1:]  # the tracker names a folder that is gone
        hint = f"; the newest folder is {newest[0][1]}" if newest else ""
        raise _UsageError(f"{arg}: the tracker file says step {step}, but {step_dir} does not exist{hint}")
    return step_dir


def run(args: argparse.Namespace) -> int:
    try:
        step_dir = resolve_step_dir(args.dir)
    except _UsageError as e:
        print(f"{_PROG} {args.checkpoint_command}: {e}", file=sys.stderr)
        return 2
    if args.checkpoint_command == "manifest":
        return _manifest(step_dir)
    return _verify(step_dir)


def _manifest(step_dir: Path) -> int:
    try:
        path = write_manifest(step_dir)
    except OSError as e:
        why = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
        print(f"{_PROG} manifest: cannot write a manifest for {step_dir}: {why}", file=sys.stderr)
        return 1
    # re-reading is cheap next to hashing, and reports exactly what a later verify will compare against
    doc = json.loads(path.read_text(encoding="utf-8"))
    _report_skipped({s["path"]: s["reason"] for s in doc.get("skipped", [])})
    if not doc["file_count"]:
        print(f"{_PROG} manifest: warning: {step_dir} holds no files to hash; `verify` will fail on it",
              file=sys.stderr)
    print(f"wrote {path}: {doc['file_count']} files, {doc['total_bytes']} bytes"
          + (f", {len(doc.get('skipped', []))} skipped" if doc.get("skipped") else ""))
    return 0


def _report_skipped(skipped: dict[str, str]) -> None:
    for rel, reason in sorted(skipped.items()):
        print(f"skipped {rel}: {reason}", file=sys.stderr)


def _verify(step_dir: Path) -> int:
    result = verify_manifest(step_dir)
    _report_skipped(result.skipped)
    if result.ok:
        print(f"ok: {step_dir}: {result.files_checked} files, {result.bytes_checked} bytes match the manifest"
              + (f" ({len(result.skipped)} entries skipped)" if result.skipped else ""))
        return 0
    for problem in result.problems:
        print(problem, file=sys.stderr)
    print(f"{step_dir}: {len(result.problems)} problem(s)", file=sys.stderr)
    return 1
