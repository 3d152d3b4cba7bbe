"""Checkpoint manifests on odd trees: FIFOs, devices, symlinks of every kind, files changing, empty folders."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import pytest
from helpers import scaled
from verl_exporter.checkpoint import cli as checkpoint_cli
from verl_exporter.checkpoint import manifest as checkpoint_manifest
from verl_exporter.checkpoint.manifest import (
    MANIFEST_NAME,
    FileChangedError,
    scan_files,
    verify_manifest,
    write_manifest,
)


def make_step(tmp_path):
    d = tmp_path / "ckpt" / "global_step_5"
    (d / "actor").mkdir(parents=True)
    (d / "actor" / "model.pt").write_bytes(b"weights" * 100)
    (d / "data.pt").write_bytes(b"dataloader")
    return d


def cli(*args):
    """The CLI in a subprocess: a regression that blocks (a FIFO) fails on the timeout instead of hanging."""
    return subprocess.run([sys.executable, "-m", "verl_exporter", "checkpoint", *args], capture_output=True,
                          text=True, timeout=scaled(60))


@pytest.mark.integration
def test_fifo_and_device_symlink_are_skipped_not_read(tmp_path):
    d = make_step(tmp_path)
    os.mkfifo(d / "actor" / "pipe")
    os.symlink("/dev/zero", d / "zero")
    p = cli("manifest", str(d))
    assert p.returncode == 0, p.stderr
    assert "skipped actor/pipe: not a regular file" in p.stderr
    assert "skipped zero: a symlink to a file outside the checkpoint" in p.stderr
    doc = json.loads((d / MANIFEST_NAME).read_text())
    assert [f["path"] for f in doc["files"]] == ["actor/model.pt", "data.pt"]
    assert {s["path"] for s in doc["skipped"]} == {"actor/pipe", "zero"}
    p = cli("verify", str(d))
    assert p.returncode == 0 and "2 entries skipped" in p.stdout, p.stderr


def test_dangling_and_looping_symlinks_are_skipped_and_counted(tmp_path):
    d = make_step(tmp_path)
    os.symlink(d / "nothing-here", d / "dangling")
    os.symlink(d / "loop", d / "loop")
    path = write_manifest(d)
    doc = json.loads(path.read_text())
    assert doc["file_count"] == 2
    assert {s["path"]: s["reason"] for s in doc["skipped"]} == {
        "dangling": "a dangling symlink", "loop": "a broken symlink (Too many levels of symbolic links)"}
    assert verify_manifest(d).ok


def test_a_file_symlink_out_of_the_tree_is_not_hashed(tmp_path):
    d = make_step(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the checkpoint")
    os.symlink(secret, d / "escape")
    os.symlink(d / "data.pt", d / "actor" / "data-link")  # inside the tree: hashed as its target
    doc = json.loads(write_manifest(d).read_text())
    assert [f["path"] for f in doc["files"]] == ["actor/data-link", "actor/model.pt", "data.pt"]
    assert doc["skipped"] == [{"path": "escape", "reason": "a symlink to a file outside the checkpoint"}]
    hashes = {f["path"]: f["sha256"] for f in doc["files"]}
    assert hashlib.sha256(secret.read_bytes()).hexdigest() not in hashes.values()


@pytest.mark.integration
def test_a_directory_symlink_is_reported_not_silently_dropped(tmp_path):
    d = make_step(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "big.bin").write_bytes(b"x")
    os.symlink(elsewhere, d / "critic")
    scan = scan_files(d)
    assert scan.skipped == {"critic": "a symlink to a directory (not followed)"}
    p = cli("manifest", str(d))
    assert p.returncode == 0 and "skipped critic: a symlink to a directory" in p.stderr
    assert ", 1 skipped" in p.stdout


def test_an_unlistable_subfolder_is_skipped_not_an_abort(tmp_path, monkeypatch):
    d = make_step(tmp_path)
    locked = d / "locked"
    locked.mkdir()
    real_scandir = os.scandir

    def scandir(path):  # a folder of another user (as root, chmod 0 would not stop us)
        if os.fspath(path) == str(locked):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    doc = json.loads(write_manifest(d).read_text())
    assert doc["skipped"] == [{"path": "locked", "reason": "cannot be listed: Permission denied"}]


class _Mutating:
    """A sha256 whose first update() rewrites bytes already read of the file being hashed (a save still writing
    it: same size, other content), for the first times[0] files hashed."""

    def __init__(self, target, times: list[int]):
        self._inner = hashlib.new("sha256")
        self._target = target
        self._mutate = times[0] > 0
        times[0] -= 1

    def update(self, data):
        if self._mutate:
            self._mutate = False
            with open(self._target, "r+b") as f:
                f.write(b"CHANGED")
        self._inner.update(data)

    def hexdigest(self):
        return self._inner.hexdigest()


def test_a_file_changing_while_hashed_is_hashed_again(tmp_path, monkeypatch):
    d = make_step(tmp_path)
    target = d / "actor" / "model.pt"  # the first file hashed: the first hasher is the one that mutates
    times = [1]
    monkeypatch.setattr(checkpoint_manifest.hashlib, "sha256", lambda: _Mutating(target, times))
    write_manifest(d)
    monkeypatch.undo()
    result = verify_manifest(d)
    assert result.ok, result.problems  # the manifest describes the file as it is now


def test_a_file_that_keeps_changing_fails_clearly_and_writes_nothing(tmp_path, monkeypatch):
    d = make_step(tmp_path)
    target = d / "actor" / "model.pt"  # the first file hashed: the first hasher is the one that mutates
    times = [checkpoint_manifest.HASH_TRIES + 10]
    monkeypatch.setattr(checkpoint_manifest.hashlib, "sha256", lambda: _Mutating(target, times))
    with pytest.raises(FileChangedError, match="changed while it was hashed"):
        write_manifest(d)
    assert not (d / MANIFEST_NAME).exists()


@pytest.mark.integration
def test_an_empty_checkpoint_warns_and_does_not_verify(tmp_path):
    d = tmp_path / "global_step_1"
    d.mkdir()
    p = cli("manifest", str(d))
    assert p.returncode == 0 and "holds no files" in p.stderr
    p = cli("verify", str(d))
    assert p.returncode == 1 and "lists no files" in p.stderr


@pytest.mark.integration
def test_a_fifo_as_the_tracker_file_does_not_block(tmp_path):
    d = make_step(tmp_path)
    os.mkfifo(d.parent / "latest_checkpointed_iteration.txt")
    p = cli("manifest", str(d.parent))  # the newest folder, since the tracker cannot be read
    assert p.returncode == 0 and f"wrote {d / MANIFEST_NAME}" in p.stdout, p.stderr


# ---------------------------------------------------------------------------- manifests nested past any use
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["top", "files", "entry"])
def test_a_deeply_nested_manifest_is_a_bad_manifest_not_a_traceback(tmp_path, capsys, where):
    d = tmp_path / "global_step_1"
    (d / "actor").mkdir(parents=True)
    (d / "actor" / "model.pt").write_bytes(b"w")
    deep = _nested(200_000)  # past the JSON parser's recursion limit
    text = {"top": deep,
            "files": '{"format": "verl-exporter-checkpoint-manifest", "format_version": 1, "files": ' + deep + "}",
            # parses (under the limit) but repr() of the entry in the message would recurse just as deep
            "entry": '{"format": "verl-exporter-checkpoint-manifest", "format_version": 1, "files": ['
                     + _nested(sys.getrecursionlimit() - 50) + "]}"}[where]
    (d / MANIFEST_NAME).write_text(text)
    result = verify_manifest(d)
    assert not result.ok and len(result.problems) == 1
    assert str(d / MANIFEST_NAME) in result.problems[0] and len(result.problems[0]) < 600
    parser = argparse.ArgumentParser(prog="verl-exporter")
    checkpoint_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    assert checkpoint_cli.run(parser.parse_args(["checkpoint", "verify", str(d)])) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{d}: 1 problem(s)" in err


def test_a_checkpoint_nested_deeper_than_the_recursion_limit_is_hashed_and_verified(tmp_path):
    import inspect

    from verl_exporter.sidecar.collectors.checkpoint import _tree_size

    d = tmp_path / "global_step_2"
    path = str(d)
    os.mkdir(path)
    for _ in range(300):
        path = os.path.join(path, "d")
        os.mkdir(path)
    with open(os.path.join(path, "deep.pt"), "wb") as f:
        f.write(b"deep")
    # os.walk before Python 3.12 recursed once per level. A low limit stands for a tree deeper than the
    # default one, which shutil.rmtree (the tmp_path cleanup) could not remove either.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 150)
    try:
        write_manifest(d)
        doc = json.loads((d / MANIFEST_NAME).read_text())
        assert doc["file_count"] == 1 and doc["files"][0]["path"].endswith("/d/deep.pt")
        assert verify_manifest(d).ok
        assert _tree_size(d) == 4 + (d / MANIFEST_NAME).stat().st_size  # the collector's size walk too
        with open(os.path.join(path, "deep.pt"), "wb") as f:
            f.write(b"DEEP")
        assert "does not match its SHA-256" in verify_manifest(d).problems[0]
    finally:
        sys.setrecursionlimit(limit)
