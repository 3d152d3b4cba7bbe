"""SHA-256 manifests of verl checkpoints, and reading verl's checkpoint directory layout.

verl writes ``<default_local_dir>/global_step_<N>/`` (actor/, critic/, data.pt) and, after a complete
synchronous save, ``<default_local_dir>/latest_checkpointed_iteration.txt`` holding N. On resume verl only checks
that the tracker file and the folder exist; a manifest written right after the save lets anyone check later that
every file is still there, whole and unchanged.

Everything here is a plain function of the file system: no threads, no state, no verl import.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import reprlib
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.atomicfile import TEMP_SUFFIX, temp_prefix, write_atomic

MANIFEST_NAME = "verl_exporter_manifest.json"
MANIFEST_FORMAT = "verl-exporter-checkpoint-manifest"
MANIFEST_FORMAT_VERSION = 1
TRACKER_NAME = "latest_checkpointed_iteration.txt"  # verl's get_checkpoint_tracker_filename()
CHUNK_BYTES = 1 << 20  # hashing reads this much at a time, so memory stays bounded whatever the file size
HASH_TRIES = 3  # a file that changed while hashed is hashed again this many times at most

# Temp files of write_manifest(); one left behind by a crash must not show up as an "extra file".
_MANIFEST_TEMP_PREFIX = temp_prefix(MANIFEST_NAME)  # write_atomic's temporary file, skipped by the scan
_MANIFEST_TEMP_SUFFIX = TEMP_SUFFIX
_STEP_DIR = re.compile(r"global_step_([0-9]{1,18})")  # more digits are no step: int() refuses 4,300
_TRACKER_MAX_BYTES = 64  # a step number is a few digits; anything longer is not a tracker we trust
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# a malformed entry is quoted in the message, shortened (a bounded depth and length, whatever the input)
_ENTRY_REPR = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_ENTRY_REPR.maxlevel, _ENTRY_REPR.maxstring, _ENTRY_REPR.maxother = 3, 80, 80


@dataclass
class VerifyResult:
    ok: bool
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    pruned: list[str] = field(default_factory=list)  # top-level folders gone whole, accepted with pruned_ok
    trusted: int = 0  # files not hashed again: same size, unchanged since the manifest (rehash=False)
    skipped: dict[str, str] = field(default_factory=dict)  # entries not checked (see scan_files), with why


def step_of(path: str | os.PathLike) -> int | None:
    """N for a folder named global_step_N, else None."""
    m = _STEP_DIR.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def find_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The global_step_N folders of a checkpoint directory as (N, path), oldest step first; [] if it is absent."""
    try:
        entries = list(os.scandir(ckpt_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        step = step_of(entry.name)
        try:
            # follow symlinks: a kept checkpoint may be a link to another disk
            if step is not None and entry.is_dir():
                found.append((step, Path(entry.path)))
        except OSError:
            continue
    return sorted(found, key=lambda item: item[0])


def tracker_path(ckpt_dir: str | os.PathLike) -> Path:
    return Path(ckpt_dir) / TRACKER_NAME


def read_tracker(ckpt_dir: str | os.PathLike) -> int | None:
    """The step in latest_checkpointed_iteration.txt; None when it is absent, unreadable or not a step number."""
    try:
        fd = os.open(tracker_path(ckpt_dir), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there must not block us
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = f.read(_TRACKER_MAX_BYTES + 1)
    except OSError:
        return None
    if len(raw) > _TRACKER_MAX_BYTES:
        return None
    # verl writes str(step) without a newline; tolerate whitespace, refuse signs, "1_000" and non-ASCII digits
    m = re.fullmatch(rb"\s*([0-9]+)\s*", raw)
    return int(m.group(1)) if m else None


def has_manifest(step_dir: str | os.PathLike) -> bool:
    return (Path(step_dir) / MANIFEST_NAME).is_file()


def is_retired(step_dir: str | os.PathLike) -> bool:
    """True for a PPO checkpoint folder whose actor/ verl's retention has removed.

    verl's max_actor_ckpt_to_keep / max_critic_ckpt_to_keep delete global_step_N/actor/ and critic/ of older
    checkpoints, not the folder: what stays is global_step_N/data.pt, which cannot be resumed from. A save in
    progress writes actor/ first and data.pt last, so it never looks retired. (The SFT trainer removes whole
    folders and names its files data_<rank>.pt, so its folders never look retired either.)
    """
    path = Path(step_dir)
    return (path / "data.pt").is_file() and not (path / "actor").is_dir()


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> tuple[int, Path] | None:
    """The latest complete checkpoint as (step, folder); the folder may be missing when the tracker says so.

    The rule, first that applies:
      1. the step in the tracker file (verl writes it only after a complete synchronous save);
      2. the newest global_step_N/ that has a manifest (written by our callback after verl's save returned);
      3. the newest global_step_N/ (nothing better to go on: it may be a save still in progress).
    """
    return pick_latest(ckpt_dir, read_tracker(ckpt_dir), find_checkpoints(ckpt_dir))


def pick_latest(ckpt_dir: str | os.PathLike, tracked: int | None,
                checkpoints: list[tuple[int, Path]]) -> tuple[int, Path] | None:
    """latest_checkpoint() from a tracker value and a folder list already read (the collector reads them once)."""
    if tracked is not None:
        return tracked, Path(ckpt_dir) / f"global_step_{tracked}"
    with_manifest = [c for c in checkpoints if has_manifest(c[1])]
    if with_manifest:
        return with_manifest[-1]
    return checkpoints[-1] if checkpoints else None


def _is_manifest_file(rel: str) -> bool:
    if "/" in rel:
        return False  # only the step folder's own manifest is ours; a nested file of that name is content
    return rel == MANIFEST_NAME or (rel.startswith(_MANIFEST_TEMP_PREFIX) and rel.endswith(_MANIFEST_TEMP_SUFFIX))


class FileChangedError(OSError):
    """A file kept changing while it was hashed: a save is probably still writing the checkpoint."""


@dataclass
class Scan:
    """What a checkpoint folder holds: the regular files to hash, and every entry skipped, with why."""

    files: dict[str, Path] = field(default_factory=dict)  # relative POSIX path -> path
    skipped: dict[str, str] = field(default_factory=dict)  # relative POSIX path -> reason


def scan_files(step_dir: str | os.PathLike) -> Scan:
    """Every regular file under step_dir except the manifest (and its temp files); every other entry is skipped.

    Skipped, with the reason: directory symlinks (not followed: no loops), file symlinks that are dangling,
    loop or point outside the folder, FIFOs, sockets and devices (reading one could block or never end), and
    subfolders that cannot be listed. A file symlink inside the folder counts as its target. Raises OSError
    when step_dir itself cannot be listed.
    """
    root = Path(step_dir)
    real_root = os.path.realpath(root)
    scan = Scan()

    def rel_of(path: str) -> str:
        return Path(path).relative_to(root).as_posix()

    def unlistable(error: OSError) -> None:
        if os.path.realpath(error.filename or root) == real_root:
            raise error
        scan.skipped[rel_of(error.filename)] = f"cannot be listed: {error.strerror}"

    for dirpath, dirnames, filenames in walk(root, onerror=unlistable):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):  # os.walk lists it but does not descend
                scan.skipped[rel_of(path)] = "a symlink to a directory (not followed)"
        for name in filenames:
            path = os.path.join(dirpath, name)
            rel = rel_of(path)
            if _is_manifest_file(rel):
                continue
            reason = _skip_reason(path, real_root)
            if reason:
                scan.skipped[rel] = reason
            else:
                scan.files[rel] = Path(path)
    return scan


def walk(top: str | os.PathLike, onerror=None):
    """os.walk(top, onerror=onerror), top-down, without following directory symlinks, and without recursion.

    Before Python 3.12 os.walk recurses once per folder level, so a tree deeper than the recursion limit (a
    checkpoint folder holds whatever was put there) raised RecursionError instead of being walked.
    """
    stack = [os.fspath(top)]
    while stack:
        dirpath = stack.pop()
        try:
            with os.scandir(dirpath) as it:
                entries = list(it)
        except OSError as e:
            if onerror is not None:
                onerror(e)
            continue
        dirnames, filenames = [], []
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows a symlink, as os.walk does when it sorts names
            except OSError:
                is_dir = False
            (dirnames if is_dir else filenames).append(entry.name)
        yield dirpath, dirnames, filenames
        for name in reversed(dirnames):  # popped in listing order
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                stack.append(path)


def _skip_reason(path: str, real_root: str) -> str | None:
    """Why a directory entry is not hashed; None for a regular file (or a symlink to one inside the folder)."""
    try:
        st = os.stat(path)  # follows a symlink
    except OSError as e:
        if os.path.islink(path):
            return "a dangling symlink" if e.errno == errno.ENOENT else f"a broken symlink ({e.strerror})"
        return f"cannot be read: {e.strerror}"
    if os.path.islink(path) and os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        return "a symlink to a file outside the checkpoint"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (FIFO, socket or device)"
    return None


def list_files(step_dir: str | os.PathLike) -> dict[str, Path]:
    """{relative POSIX path: path} of the files scan_files() would hash."""
    return scan_files(step_dir).files


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """(hex SHA-256, bytes read) of a regular file, read in CHUNK_BYTES pieces into one reused buffer.

    Raises OSError for anything but a regular file (opened without blocking, so a FIFO cannot hang us) and
    FileChangedError when its size or mtime changed while it was read.
    """
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    total = 0
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb", buffering=0) as f:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            total += n
        after = os.fstat(fd)
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or total != after.st_size:
        raise FileChangedError(errno.EAGAIN, "changed while it was hashed", str(path))
    return digest.hexdigest(), total


def sha256_stable(path: str | os.PathLike, tries: int = HASH_TRIES) -> tuple[str, int]:
    """sha256_file(), tried again when the file changed meanwhile; FileChangedError after `tries` attempts."""
    for attempt in range(tries):
        try:
            return sha256_file(path)
        except FileChangedError:
            if attempt == tries - 1:
                raise FileChangedError(errno.EAGAIN, f"changed while it was hashed, {tries} times in a row (is a "
                                                     "save still writing this checkpoint?)", str(path)) from None
    raise AssertionError("unreachable")


def write_manifest(step_dir: str | os.PathLike) -> Path:
    """Hash every file of a checkpoint folder into <step_dir>/verl_exporter_manifest.json; return its path.

    The manifest is written to a temp file in the same folder and renamed over the old one, so a reader sees
    either the old manifest or the complete new one, never half a file. Raises OSError on a missing folder.
    """
    root = Path(step_dir)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    scan = scan_files(root)
    files = []
    for rel, path in sorted(scan.files.items()):
        digest, size = sha256_stable(path)  # size = bytes hashed, so size and hash always describe the same bytes
        files.append({"path": rel, "size": size, "sha256": digest})
    now = time.time()
    doc = {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "created_unix": round(now, 3),
        "step": step_of(os.path.abspath(root)),  # abspath: "." inside the folder has a name
        "file_count": len(files),
        "total_bytes": sum(f["size"] for f in files),
        "files": files,
        "skipped": [{"path": rel, "reason": reason} for rel, reason in sorted(scan.skipped.items())],
    }
    target = root / MANIFEST_NAME
    # world-readable: the manifest is for anyone who can read the checkpoint
    write_atomic(target, json.dumps(doc, indent=1) + "\n", mode=0o644)
    return target


def _load_manifest(step_dir: Path) -> tuple[list[dict] | None, str | None]:
    """(entries, None) or (None, the one problem that stops the check)."""
    path = step_dir / MANIFEST_NAME
    if not path.is_file():
        return None, f"{MANIFEST_NAME} is missing from {step_dir}."
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{path} cannot be read: {e}."
    except RecursionError:  # nested deeper than the parser goes: no manifest we wrote looks like that
        return None, f"{path} cannot be read: nested too deeply to be a manifest."
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("files"), list):
        return None, f"{path} is not a verl-exporter checkpoint manifest."
    if doc.get("format_version") != MANIFEST_FORMAT_VERSION:
        return None, f"{path} has format version {doc.get('format_version')!r}; this exporter reads version 1."
    entries = []
    for i, entry in enumerate(doc["files"]):
        ok = (isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("size"), int)
              and isinstance(entry.get("sha256"), str) and _SHA256_HEX.fullmatch(entry["sha256"]))
        # a path that leaves the folder would make us read files that are not part of the checkpoint
        if ok:
            parts = entry["path"].split("/")
            ok = not entry["path"].startswith("/") and ".." not in parts and "" not in parts
        if not ok:
            return None, f"{path} has a malformed entry (number {i + 1}): {_ENTRY_REPR.repr(entry)}."
        entries.append(entry)
    return entries, None


def read_manifest(step_dir: str | os.PathLike) -> tuple[list[dict] | None, str | None]:
    """(the manifest's file entries {path, size, sha256}, None), or (None, the one problem that stops a check)."""
    return _load_manifest(Path(step_dir))


def verify_manifest(step_dir: str | os.PathLike, *, pruned_ok: bool = False, rehash: bool = True) -> VerifyResult:
    """Check a checkpoint folder against its manifest: every problem found is one sentence naming the file.

    A top-level folder of the manifest (actor/, critic/) that is gone as a whole is one problem, not one per
    file: that is what verl's checkpoint retention does to older checkpoints. pruned_ok=True accepts it (the
    folder is then listed in result.pruned); use it for checkpoints older than the latest.

    rehash=False trusts the hashes already in the manifest for every file of the listed size not modified
    since the manifest was written (its mtime is not newer than the manifest's); only the others are hashed.
    That finds missing, extra, truncated and rewritten files without reading the checkpoint again, not a
    change that kept size and mtime (bit rot, a copy that preserved mtimes): rehash=True for those.
    """
    root = Path(step_dir)
    if not root.is_dir():
        return VerifyResult(ok=False, problems=[f"{root} is not a directory."])
    entries, problem = _load_manifest(root)
    if entries is None:
        return VerifyResult(ok=False, problems=[problem])
    try:
        written_ns = (root / MANIFEST_NAME).stat().st_mtime_ns
    except OSError as e:
        return VerifyResult(ok=False, problems=[f"{root / MANIFEST_NAME} cannot be read: {e.strerror}."])
    result = VerifyResult(ok=True)
    if not entries:
        return VerifyResult(ok=False, problems=[f"{root}: the manifest lists no files (an empty checkpoint cannot "
                                                "be resumed from)."])
    try:
        scan = scan_files(root)
    except OSError as e:
        return VerifyResult(ok=False, problems=[f"{root} cannot be listed: {e}."])
    present, result.skipped = scan.files, scan.skipped
    gone_folders: dict[str, int] = {}  # top-level folder that no longer exists -> files the manifest lists in it
    for entry in entries:
        rel = entry["path"]
        path = present.pop(rel, None)
        if path is None:
            top = rel.split("/", 1)[0] if "/" in rel else None
            if rel in scan.skipped:
                result.problems.append(f"{rel} is listed in the manifest but is skipped now: {scan.skipped[rel]}.")
            elif top is not None and not os.path.lexists(root / top):
                gone_folders[top] = gone_folders.get(top, 0) + 1
            else:
                result.problems.append(f"{rel} is missing (the manifest lists it with {entry['size']} bytes).")
            continue
        try:
            st = path.stat()
            if st.st_size != entry["size"]:
                result.problems.append(f"{rel} has {st.st_size} bytes; the manifest says {entry['size']}.")
                continue
            if not rehash and st.st_mtime_ns <= written_ns:
                os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # readable, as a resume will need it
                result.trusted += 1
                continue
            digest, read = sha256_stable(path)
        except OSError as e:
            result.problems.append(f"{rel} cannot be read: {e}.")
            continue
        result.files_checked += 1
        result.bytes_checked += read
        if read != entry["size"]:  # it changed while we read it
            result.problems.append(f"{rel} has {read} bytes; the manifest says {entry['size']}.")
        elif digest != entry["sha256"]:
            result.problems.append(f"{rel} does not match its SHA-256 in the manifest (same size, other content).")
    for top, count in sorted(gone_folders.items()):
        if pruned_ok:
            result.pruned.append(f"{top}/")
        else:
            result.problems.append(f"{top}/ is missing, with the {count} file(s) the manifest lists in it "
                                   f"(verl's max_*_ckpt_to_keep removes it from older checkpoints).")
    for rel in sorted(present):
        result.problems.append(f"{rel} is not in the manifest (added after the manifest was written).")
    result.ok = not result.problems
    return result
