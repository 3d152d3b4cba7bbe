"""The checkpoint to resume, on this node (check checkpoint) and across the nodes (check agreement).

checkpoint: the step verl's tracker file names exists and verifies against its manifest. A manifest already
written is not hashed again: each file must have its listed size and be unchanged since the manifest (its
mtime), and only a file modified later is hashed (--deep hashes every file). Without a manifest nothing can
vouch for completeness; the files are hashed only when the nodes are compared.

agreement: every node publishes what it would resume from (step, and each file's size and SHA-256: the
manifest's, or hashed here without one) as <node>.json in a shared --manifests-dir, waits for the others
(--nodes, knob nodes_wait) and compares: the same step everywhere, and the same bytes for every file that
several nodes hold (with one disk per node each node holds its own ranks' shards; with a shared filesystem
every node sees every file). The node that differs is named.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...checkpoint.manifest import (
    _SHA256_HEX,
    find_checkpoints,
    read_manifest,
    read_tracker,
    scan_files,
    sha256_stable,
    tracker_path,
    verify_manifest,
)
from ...core.atomicfile import TEMP_SUFFIX, write_atomic
from ...spec.rules import duration_seconds
from .report import Finding, Options, UsageError

CHECKPOINT, AGREEMENT = "checkpoint", "agreement"
NODE_FORMAT = "verl-exporter-preflight-node"
NODE_FORMAT_VERSION = 1
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_NODE_FILE_BYTES = 256 << 20  # ~1.5 M files of a checkpoint; a bigger file is not one we wrote
MAX_NAMED = 4  # files named in one line; the rest are counted
POLL_S = 1.0


@dataclass
class NodeView:
    """What one node would resume from."""

    node: str
    step: int | None
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # rel -> (size, sha256)
    local_ok: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"format": NODE_FORMAT, "format_version": NODE_FORMAT_VERSION, "node": self.node,
                "step": self.step, "local_ok": self.local_ok,
                "files": {rel: [size, digest] for rel, (size, digest) in sorted(self.files.items())}}


class BadNodeFile(ValueError):
    pass


def parse_node(raw: bytes, name: str) -> NodeView:
    """A node's published view; BadNodeFile says why a file is not one (hostile input: it is a shared folder)."""
    if len(raw) > MAX_NODE_FILE_BYTES:
        raise BadNodeFile(f"larger than {MAX_NODE_FILE_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadNodeFile(f"not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict) or (doc.get("format"), doc.get("format_version")) != (NODE_FORMAT,
                                                                                        NODE_FORMAT_VERSION):
        raise BadNodeFile("not a preflight node manifest (format, format_version)")
    if doc.get("node") != name:
        raise BadNodeFile(f"names node {str(doc.get('node'))[:60]!r}, not {name!r}")
    step, ok, files = doc.get("step"), doc.get("local_ok"), doc.get("files")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise BadNodeFile("step is not a step number")
    if not isinstance(ok, bool) or not isinstance(files, dict):
        raise BadNodeFile("local_ok or files has the wrong type")
    view = NodeView(name, step, local_ok=ok)
    for rel, entry in files.items():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and not isinstance(entry[0], bool) and entry[0] >= 0 and isinstance(entry[1], str)
                and _SHA256_HEX.fullmatch(entry[1]) and isinstance(rel, str) and rel and len(rel) <= 4096):
            raise BadNodeFile(f"malformed file entry {str(rel)[:60]!r}")
        view.files[rel] = (entry[0], entry[1])
    return view


# ------------------------------------------------------------------------------------------ this node
def _local(o: Options) -> tuple[list[Finding], NodeView]:
    """This node's checkpoint findings and view, computed once per run (both checks read them)."""
    if "local" not in o.cache:
        o.cache["local"] = _inspect(o, hash_missing=bool(o.manifests_dir))
    result: tuple[list[Finding], NodeView] = o.cache["local"]
    return result


def _inspect(o: Options, hash_missing: bool) -> tuple[list[Finding], NodeView]:
    view = NodeView(o.node, None)
    if not o.checkpoint_dir:
        return [Finding(CHECKPOINT, True, "no --checkpoint-dir given: nothing to resume")], view
    root = Path(o.checkpoint_dir)
    tracker = tracker_path(root)
    folders = find_checkpoints(root)

    def fail(line: str) -> tuple[list[Finding], NodeView]:
        view.local_ok = False
        return [Finding(CHECKPOINT, False, line)], view

    if not os.path.lexists(tracker):
        if not folders:
            return [Finding(CHECKPOINT, True, f"no checkpoint in {root}: the run starts from step 0")], view
        return fail(f"{root} holds {len(folders)} global_step_N folder(s) (newest {folders[-1][0]}) but no "
                    f"{tracker.name}: verl would start from step 0; write the step to resume into it, or move the "
                    "folders away to start afresh")
    step = read_tracker(root)
    if step is None:
        try:
            fd = os.open(tracker, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there must not block the pre-flight
            try:
                regular = stat.S_ISREG(os.fstat(fd).st_mode)
            finally:
                os.close(fd)
            why = "does not hold a step number" if regular else "is not a regular file"
        except OSError as e:
            why = f"cannot be read ({e.strerror})"
        return fail(f"{tracker} {why}: fix it to name the step to resume (e.g. the newest complete global_step_N)")
    view.step = step
    step_dir = root / f"global_step_{step}"
    if not step_dir.is_dir():
        newest = f"; the newest folder is global_step_{folders[-1][0]}" if folders else ""
        return fail(f"{tracker.name} names step {step}, but {step_dir} does not exist{newest}: point the tracker "
                    "at a complete checkpoint")
    entries, problem = read_manifest(step_dir)
    if entries is None:
        line = (f"global_step_{step} has no manifest, so nothing vouches that it is complete; write manifests "
                "after each save (ManifestCheckpointCallback, or verl-exporter checkpoint manifest)")
        if problem and "is missing" not in problem:
            return fail(f"{problem.rstrip('.')}; rewrite it with verl-exporter checkpoint manifest {step_dir}")
        findings = [Finding(CHECKPOINT, True, line)]
        if hash_missing:
            try:
                for rel, path in sorted(scan_files(step_dir).files.items()):
                    digest, size = sha256_stable(path)
                    view.files[rel] = (size, digest)
            except OSError as e:
                return fail(f"global_step_{step}: {e.filename or step_dir} cannot be read ({e.strerror}): "
                            "a resume would fail on it; fix its permissions or resume from an older step")
        return findings, view
    result = verify_manifest(step_dir, rehash=o.deep)
    if not result.ok:
        shown = "; ".join(p.rstrip(".") for p in result.problems[:MAX_NAMED])
        more = f" (+{len(result.problems) - MAX_NAMED} more)" if len(result.problems) > MAX_NAMED else ""
        return fail(f"global_step_{step} does not match its manifest: {shown}{more}; resume from an older verified "
                    f"checkpoint (verl-exporter checkpoint verify {step_dir} lists every problem)")
    view.files = {e["path"]: (e["size"], e["sha256"]) for e in entries}
    hashed = result.files_checked
    return [Finding(CHECKPOINT, True, f"global_step_{step}: {len(entries)} files match its manifest ("
                    + (f"{result.trusted} unchanged since it was written, " if not o.deep else "")
                    + f"{hashed} hashed)")], view


def check_checkpoint(o: Options) -> list[Finding]:
    return _local(o)[0]


# ------------------------------------------------------------------------------------------ across nodes
def _publish(o: Options, view: NodeView) -> None:
    if not NODE_NAME.fullmatch(o.node):
        raise UsageError(f"--node {o.node!r}: a node name is letters, digits, '.', '_' and '-' (up to 128)")
    write_atomic(Path(o.manifests_dir or ".") / f"{o.node}.json", json.dumps(view.as_dict()) + "\n", mode=0o644)


def read_nodes(folder: Path) -> tuple[dict[str, NodeView], list[str]]:
    """Every node's published view in the folder, and a line for each file that is not one."""
    views: dict[str, NodeView] = {}
    bad: list[str] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        return {}, [f"{folder} cannot be listed ({e.strerror})"]
    for name in names:
        if not name.endswith(".json") or name.startswith(".") and name.endswith(TEMP_SUFFIX):
            continue
        node = name[: -len(".json")]
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_NONBLOCK)
            with open(fd, "rb") as f:
                if not os.path.isfile(folder / name):
                    raise BadNodeFile("not a regular file")
                views[node] = parse_node(f.read(MAX_NODE_FILE_BYTES + 1), node)
        except (OSError, BadNodeFile) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            bad.append(f"{folder / name}: {why}")
    return views, bad


def _odd_ones(groups: dict[Any, list[str]], views: dict[str, NodeView]) -> list[str]:
    """The nodes outside the largest group; on a tie, those whose own check failed, else every node."""
    sizes = sorted((len(v) for v in groups.values()), reverse=True)
    if len(sizes) > 1 and sizes[0] > sizes[1]:
        top = max(groups.values(), key=len)
        return sorted(n for members in groups.values() if members is not top for n in members)
    suspects = sorted(n for members in groups.values() for n in members if not views[n].local_ok)
    return suspects or sorted(n for members in groups.values() for n in members)


def compare(views: dict[str, NodeView]) -> list[Finding]:
    out: list[Finding] = []
    steps: dict[int | None, list[str]] = {}
    for name, v in sorted(views.items()):
        steps.setdefault(v.step, []).append(name)
    if len(steps) > 1:
        for node in _odd_ones(steps, views):
            others = ", ".join(f"{n}: {s}" for s, ns in steps.items() for n in ns if n != node)
            out.append(Finding(AGREEMENT, False, f"node {node} would resume from step {views[node].step}, the others "
                                                 f"from another ({others}): its tracker or its save differs; make "
                                                 "every node resume from the same complete step"))
        return out
    for name, v in sorted(views.items()):
        if not v.local_ok:
            out.append(Finding(AGREEMENT, False, f"node {name}'s own checkpoint check failed on step {v.step} (its "
                                                 "preflight names the problem): fix that node or resume every node "
                                                 "from an older step"))
    holders: dict[str, dict[tuple[int, str], list[str]]] = {}
    for name, v in sorted(views.items()):
        for rel, entry in v.files.items():
            holders.setdefault(rel, {}).setdefault(entry, []).append(name)
    differs: dict[str, list[str]] = {}
    for rel, groups in sorted(holders.items()):
        if len(groups) > 1:
            for node in _odd_ones(groups, views):
                differs.setdefault(node, []).append(rel)
    lacks: dict[str, list[str]] = {}
    if len(views) >= 3:  # with two nodes a file on one only is that node's own shard
        for rel, groups in sorted(holders.items()):
            have = [n for ns in groups.values() for n in ns]
            if len(groups) == 1 and len(have) >= 2 and len(have) == len(views) - 1:
                (missing,) = set(views) - set(have)
                lacks.setdefault(missing, []).append(rel)
    for node, rels in sorted(differs.items()):
        out.append(Finding(AGREEMENT, False, f"node {node} differs from the others on {len(rels)} shared file(s) "
                                             f"({_names(rels)}): its copy of step {views[node].step} is partial or "
                                             "corrupt; recopy it or resume every node from an older step"))
    for node, rels in sorted(lacks.items()):
        out.append(Finding(AGREEMENT, False, f"node {node} lacks {len(rels)} file(s) every other node holds "
                                             f"({_names(rels)}): a partial save; recopy it or resume from an "
                                             "older step"))
    return out


def _names(rels: list[str]) -> str:
    return ", ".join(rels[:MAX_NAMED]) + (f", +{len(rels) - MAX_NAMED} more" if len(rels) > MAX_NAMED else "")


def check_agreement(o: Options) -> list[Finding]:
    if not o.manifests_dir:
        return [Finding(AGREEMENT, True, "no --manifests-dir given: no other node to compare with")]
    folder = Path(o.manifests_dir)
    if not folder.is_dir():
        raise UsageError(f"--manifests-dir {folder} is not a directory")
    _, view = _local(o)
    _publish(o, view)
    deadline = o.clock() + duration_seconds(o.knobs.nodes_wait)
    while True:
        views, bad = read_nodes(folder)
        if o.nodes is None or len(views) >= o.nodes or o.clock() >= deadline:
            break
        o.sleep(POLL_S)
    out = [Finding(AGREEMENT, False, f"{line}; remove it, or rerun the preflight on that node") for line in bad]
    if o.nodes is not None and len(views) < o.nodes:
        out.append(Finding(AGREEMENT, False, f"only {len(views)} of {o.nodes} nodes published a manifest in {folder} "
                                             f"within {o.knobs.nodes_wait} ({', '.join(sorted(views))}): run the "
                                             "preflight on every node with the same --manifests-dir"))
    out += compare(views)
    if all(f.ok for f in out):
        shared = len({rel for v in views.values() for rel in v.files})
        what = f"step {view.step}" if view.step is not None else "starting from step 0 (no checkpoint)"
        out.append(Finding(AGREEMENT, True, f"{len(views)} node(s) agree on {what} and on the bytes of their "
                                            f"{shared} file(s)"))
    return out
