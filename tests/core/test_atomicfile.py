"""The one atomic write (atomicfile.write_atomic): whole or nothing, fsynced file and directory, for every file
the package replaces (file_sd registration, control file, checkpoint manifest, relay journal and spool)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from verl_exporter.checkpoint.manifest import MANIFEST_NAME, write_manifest
from verl_exporter.core.atomicfile import TEMP_SUFFIX, remove_stale_temps, temp_prefix, write_atomic
from verl_exporter.relay.journal import Journal
from verl_exporter.relay.metrics import RelayMetrics
from verl_exporter.sidecar.control import ControlState
from verl_exporter.sidecar.file_sd import FileSdRegistration


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """The paths of the file descriptors os.fsync is called on."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def assert_durable(fsynced: list[str], target: Path) -> None:
    """The new content was fsynced under its temporary name before the rename, then the directory."""
    temps = [p for p in fsynced if Path(p).parent == target.parent and Path(p).name.startswith(temp_prefix(target))
             and p.endswith(TEMP_SUFFIX)]
    assert temps, f"the file was not fsynced before the rename: {fsynced}"
    assert str(target.parent) in fsynced, f"the directory was not fsynced after the rename: {fsynced}"
    assert fsynced.index(str(target.parent)) > fsynced.index(temps[-1])
    assert not [p for p in target.parent.iterdir() if p.name.endswith(TEMP_SUFFIX)]


def test_write_atomic_replaces_with_the_mode_asked_whatever_the_umask(tmp_path, fsynced):
    target = tmp_path / "f.json"
    target.write_text("old")
    old = os.umask(0o077)
    try:
        write_atomic(target, "new ✓", mode=0o644)
    finally:
        os.umask(old)
    assert target.read_text(encoding="utf-8") == "new ✓"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert_durable(fsynced, target)


def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "f.json"
    target.write_text("old")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, b"new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_stale_temporary_files_of_a_killed_writer_are_removed(tmp_path):
    target = tmp_path / "relay-journal.jsonl"
    (tmp_path / f"{temp_prefix(target)}k3j2x{TEMP_SUFFIX}").write_text("half")
    (tmp_path / f".other.k3j2x{TEMP_SUFFIX}").write_text("someone else's")
    assert remove_stale_temps(target) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".other.k3j2x{TEMP_SUFFIX}"]


# ---------------------------------------------------------------------- every writer of the package uses it
def test_file_sd_registration(tmp_path, fsynced):
    reg = FileSdRegistration(str(tmp_path / "sd"), "node0", 9477)
    reg.write()
    assert stat.S_IMODE(reg.path.stat().st_mode) == 0o644  # Prometheus may run as another user
    assert_durable(fsynced, reg.path)


def test_control_file(tmp_path, fsynced):
    state = ControlState(str(tmp_path / "control.json"), mode=0o640)
    state.request("checkpoint", "NaN")
    assert stat.S_IMODE(state.path.stat().st_mode) == 0o640
    assert_durable(fsynced, state.path)


def test_checkpoint_manifest(tmp_path, fsynced):
    step = tmp_path / "global_step_10"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "model.pt").write_bytes(b"\0" * 64)
    path = write_manifest(step)
    assert path == step / MANIFEST_NAME
    assert_durable(fsynced, path)


def test_relay_journal(tmp_path, fsynced):
    journal = Journal(tmp_path, RelayMetrics(), window=60)
    journal.recover()
    journal.restart([])  # rewrites the journal compactly
    assert stat.S_IMODE(journal.path.stat().st_mode) == 0o600  # alerts are for its owner only
    assert_durable(fsynced, journal.path)
