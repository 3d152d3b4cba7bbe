"""Checkpoints: SHA-256 manifests, the `checkpoint` CLI, verl's checkpoint callback, and the checkpoint collector.

Layouts are built the way verl writes them (global_step_N/actor/, critic/, data.pt, then the tracker file), and,
where verl 0.9.1 has a writer that runs without GPUs, by verl itself.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from conftest import IN_CI, parse_metrics, require_tool, sample
from helpers import scaled
from verl_exporter.checkpoint import cli as checkpoint_cli
from verl_exporter.checkpoint import manifest as checkpoint_manifest
from verl_exporter.checkpoint.manifest import (
    MANIFEST_NAME,
    TRACKER_NAME,
    find_checkpoints,
    latest_checkpoint,
    read_tracker,
    verify_manifest,
    write_manifest,
)
from verl_exporter.core import atomicfile
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.collectors import Context, Unavailable
from verl_exporter.sidecar.collectors import checkpoint as checkpoint_collector
from verl_exporter.sidecar.collectors.checkpoint import CheckpointCollector
from verl_exporter.sidecar.collectors.sampler import Sampler
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.spec import load_spec

GRACE = 900.0
T0 = 1_700_000_000.0  # file times the tests set, far from "now", so the fake clock alone decides ages


def verl_module(name: str):
    """A module of the real verl: required in CI, a skip elsewhere (as in test_verl_integration)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if IN_CI:
            pytest.fail(f"verl is not installed: {e}")
        pytest.skip(f"verl is not installed: {e}")


@pytest.fixture
def verl_callback(monkeypatch):
    """The callback module as it loads where verl is absent (on its stand-in base class): the unit tier imports
    no verl. Under verl's own base class it is test_callback_is_loaded_by_verl_and_writes_the_manifest's."""
    import verl_exporter.trainer as trainer

    name = "verl_exporter.trainer.verl_callback"
    monkeypatch.setitem(sys.modules, "verl", None)  # `import verl...` raises ImportError
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(trainer, "verl_callback", raising=False)
    yield importlib.import_module(name)
    sys.modules.pop(name, None)  # monkeypatch then puts back the real module, where one was loaded
    trainer.__dict__.pop("verl_callback", None)


def make_checkpoint(root: Path, step: int, *, tracker: bool = True, critic: bool = True) -> Path:
    """global_step_<step>/ as verl's PPO trainer lays it out; the tracker is written last, as verl does."""
    d = root / f"global_step_{step}"
    (d / "actor" / "huggingface").mkdir(parents=True)
    for rank in range(2):
        (d / "actor" / f"model_world_size_2_rank_{rank}.pt").write_bytes(os.urandom(3000 + step + rank))
        (d / "actor" / f"optim_world_size_2_rank_{rank}.pt").write_bytes(os.urandom(5000 + rank))
    (d / "actor" / "huggingface" / "config.json").write_text('{"model_type": "qwen2"}')
    if critic:
        (d / "critic").mkdir()
        (d / "critic" / "model_world_size_2_rank_0.pt").write_bytes(os.urandom(2000))
    (d / "data.pt").write_bytes(os.urandom(100))
    if tracker:
        (root / TRACKER_NAME).write_text(str(step))  # verl: f.write(str(self.global_steps)), no newline
    return d


def set_times(path: Path, t: float) -> None:
    """Set the mtime of a folder and everything under it."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.utime(os.path.join(dirpath, name), (t, t))
    os.utime(path, (t, t))


def flip_byte(path: Path, offset: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------- manifest


def test_manifest_round_trip_lists_every_file_with_size_and_sha256(tmp_path):
    d = make_checkpoint(tmp_path, 7)
    path = write_manifest(d)
    assert path == d / MANIFEST_NAME
    doc = json.loads(path.read_text())
    assert doc["format_version"] == 1 and doc["step"] == 7 and doc["created"].endswith("Z")
    assert isinstance(doc["created_unix"], float)
    on_disk = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    assert [f["path"] for f in doc["files"]] == on_disk  # sorted, nested paths, the manifest itself left out
    for entry in doc["files"]:
        content = (d / entry["path"]).read_bytes()
        assert entry["size"] == len(content)
        assert entry["sha256"] == hashlib.sha256(content).hexdigest()
    assert doc["file_count"] == len(on_disk) and doc["total_bytes"] == sum(f["size"] for f in doc["files"])

    result = verify_manifest(d)
    assert result.ok and result.problems == []
    assert result.files_checked == len(on_disk) and result.bytes_checked == doc["total_bytes"]

    # writing again does not list the first manifest or a temp file
    (d / "actor" / "extra_state_world_size_2_rank_0.pt").write_bytes(b"x" * 10)
    again = json.loads(write_manifest(d).read_text())
    assert MANIFEST_NAME not in {f["path"] for f in again["files"]}
    assert len(again["files"]) == len(on_disk) + 1
    assert verify_manifest(d).ok


def test_hashing_reads_in_chunks_so_memory_stays_bounded(tmp_path):
    big = tmp_path / "global_step_1" / "actor" / "shard.pt"
    big.parent.mkdir(parents=True)
    content = os.urandom(3 * checkpoint_manifest.CHUNK_BYTES + 12345)  # crosses chunk boundaries
    big.write_bytes(content * 8)  # ~ 25 MiB
    expected = hashlib.sha256(content * 8).hexdigest()
    del content
    tracemalloc.start()
    try:
        digest, size = checkpoint_manifest.sha256_file(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert digest == expected and size == big.stat().st_size
    assert peak < 3 * checkpoint_manifest.CHUNK_BYTES  # one reused 1 MiB buffer, not the 25 MiB file


def _tamper_flip(d):
    flip_byte(d / "actor" / "model_world_size_2_rank_0.pt")
    return "actor/model_world_size_2_rank_0.pt", "SHA-256"


def _tamper_truncate(d):
    p = d / "actor" / "optim_world_size_2_rank_1.pt"
    p.write_bytes(p.read_bytes()[:100])
    return "actor/optim_world_size_2_rank_1.pt", "has 100 bytes; the manifest says 5001"


def _tamper_delete(d):
    (d / "critic" / "model_world_size_2_rank_0.pt").unlink()
    return "critic/model_world_size_2_rank_0.pt", "is missing"


def _tamper_add(d):
    (d / "actor" / "stray.pt").write_bytes(b"late write")
    return "actor/stray.pt", "is not in the manifest"


def _tamper_manifest_gone(d):
    (d / MANIFEST_NAME).unlink()
    return MANIFEST_NAME, "is missing"


def _tamper_manifest_garbage(d):
    (d / MANIFEST_NAME).write_text('{"format": "verl-exporter-checkpoint-manifest", "files": [')
    return MANIFEST_NAME, "cannot be read"


def _tamper_manifest_escapes(d):
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["files"][0]["path"] = "../../etc/passwd"
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    return MANIFEST_NAME, "malformed entry (number 1)"


@pytest.mark.parametrize("tamper", [_tamper_flip, _tamper_truncate, _tamper_delete, _tamper_add,
                                    _tamper_manifest_gone, _tamper_manifest_garbage, _tamper_manifest_escapes],
                         ids=lambda f: f.__name__.removeprefix("_tamper_"))
def test_verify_names_the_file_and_the_kind_of_problem(tmp_path, tamper):
    d = make_checkpoint(tmp_path, 3)
    write_manifest(d)
    name, phrase = tamper(d)
    result = verify_manifest(d)
    assert not result.ok
    assert len(result.problems) == 1, result.problems
    assert name in result.problems[0] and phrase in result.problems[0], result.problems[0]
    assert result.problems[0].endswith(".")


def test_verify_reports_every_problem_at_once(tmp_path):
    d = make_checkpoint(tmp_path, 3)
    write_manifest(d)
    _tamper_flip(d)
    _tamper_delete(d)
    _tamper_add(d)
    problems = verify_manifest(d).problems
    assert len(problems) == 3
    assert [p.split(" ")[0] for p in problems] == ["actor/model_world_size_2_rank_0.pt",
                                                    "critic/model_world_size_2_rank_0.pt", "actor/stray.pt"]


def test_a_failed_rewrite_leaves_the_old_manifest_whole_and_no_temp_file(tmp_path, monkeypatch):
    d = make_checkpoint(tmp_path, 3)
    old = write_manifest(d).read_bytes()
    (d / "data.pt").write_bytes(b"new dataloader state")

    real_write = os.write

    def disk_full(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))  # half a document, then the error
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_manifest(d)
    assert (d / MANIFEST_NAME).read_bytes() == old
    assert sorted(p.name for p in d.iterdir()) == ["actor", "critic", "data.pt", MANIFEST_NAME]
    # the old manifest still describes the old data.pt, so the change is reported, not hidden
    assert verify_manifest(d).problems == ["data.pt has 20 bytes; the manifest says 100."]


def test_a_temp_file_left_by_a_crashed_write_is_not_an_extra_file(tmp_path):
    d = make_checkpoint(tmp_path, 3)
    write_manifest(d)
    (d / f".{MANIFEST_NAME}.k3j2_x.tmp").write_text('{"format": ')
    assert verify_manifest(d).ok
    assert write_manifest(d).read_text().count(".tmp") == 0


def test_find_checkpoints_orders_by_step_and_ignores_other_names(tmp_path):
    for step in (100, 2, 10):
        make_checkpoint(tmp_path, step, tracker=False)
    (tmp_path / "global_step_x").mkdir()
    (tmp_path / "global_step_5.tmp").mkdir()
    (tmp_path / "global_step_7").write_text("a file, not a checkpoint")
    (tmp_path / "hf_model").mkdir()
    assert [s for s, _ in find_checkpoints(tmp_path)] == [2, 10, 100]
    assert find_checkpoints(tmp_path / "nope") == []


@pytest.mark.parametrize(("content", "expected"), [
    (b"42", 42), (b" 42\n", 42), (b"0", 0), (b"", None), (b"\n", None), (b"abc", None), (b"-1", None),
    (b"4 2", None), (b"1_000", None), (b"\xff\xfe", None), (b"7" * 100, None),
])
def test_read_tracker_tolerates_whitespace_and_refuses_garbage(tmp_path, content, expected):
    (tmp_path / TRACKER_NAME).write_bytes(content)
    assert read_tracker(tmp_path) == expected


def test_read_tracker_without_file_or_dir(tmp_path):
    assert read_tracker(tmp_path) is None
    assert read_tracker(tmp_path / "missing") is None


@pytest.mark.integration  # verl
def test_real_verl_checkpoint_handler_writes_a_layout_we_read(tmp_path):
    """verl's own CheckpointHandler saves (tracker via temp + rename); our reader agrees with verl's."""
    handler_mod = verl_module("verl.utils.checkpoint.checkpoint_handler")
    manager_mod = verl_module("verl.utils.checkpoint.checkpoint_manager")

    class Engine:  # stands in for an FSDP engine: writes its shards into the folder it is given
        def save_checkpoint(self, local_path, global_step, max_ckpt_to_keep=None):
            os.makedirs(local_path, exist_ok=True)
            Path(local_path, "model_world_size_1_rank_0.pt").write_bytes(os.urandom(4096))

    class Loader:
        def state_dict(self):
            return {"step": 1}

    handler = handler_mod.CheckpointHandler(Engine(), Loader(), default_local_dir=str(tmp_path),
                                            mode=handler_mod.OrchestrationMode.RAY)
    handler.save_checkpoint(5)
    handler.save_checkpoint(10)

    assert manager_mod.get_checkpoint_tracker_filename(str(tmp_path)) == str(tmp_path / TRACKER_NAME)
    assert read_tracker(tmp_path) == 10
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "global_step_10")
    assert manager_mod.find_latest_ckpt_path(str(tmp_path)) == str(tmp_path / "global_step_10")
    assert [s for s, _ in find_checkpoints(tmp_path)] == [5, 10]
    d = tmp_path / "global_step_10"
    write_manifest(d)
    assert {f["path"] for f in json.loads((d / MANIFEST_NAME).read_text())["files"]} == {
        "model_world_size_1_rank_0.pt", "data_0.pt"}
    assert verify_manifest(d).ok


# ---------------------------------------------------------------------------------------------- CLI


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="verl-exporter")
    checkpoint_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return checkpoint_cli.run(parser.parse_args(list(argv)))


def test_cli_manifest_then_verify_a_step_folder(tmp_path, capsys):
    d = make_checkpoint(tmp_path, 3)
    assert run_cli("checkpoint", "manifest", str(d)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {d / MANIFEST_NAME}: 7 files, ")
    assert run_cli("checkpoint", "verify", str(d)) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"ok: {d}: 7 files") and captured.err == ""


def test_cli_on_the_checkpoint_directory_uses_the_trackers_step(tmp_path, capsys):
    make_checkpoint(tmp_path, 2)
    partial = make_checkpoint(tmp_path, 3, tracker=False)  # a save in progress: the tracker still says 2
    assert run_cli("checkpoint", "manifest", str(tmp_path)) == 0
    assert (tmp_path / "global_step_2" / MANIFEST_NAME).is_file()
    assert not (partial / MANIFEST_NAME).exists()
    assert str(tmp_path / "global_step_2") in capsys.readouterr().out
    assert run_cli("checkpoint", "verify", str(tmp_path)) == 0


def test_cli_verify_exits_1_with_each_problem_on_stderr(tmp_path, capsys):
    d = make_checkpoint(tmp_path, 3)
    write_manifest(d)
    _tamper_flip(d)
    _tamper_add(d)
    assert run_cli("checkpoint", "verify", str(d)) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith("actor/model_world_size_2_rank_0.pt does not match its SHA-256")
    assert lines[1].startswith("actor/stray.pt is not in the manifest")
    assert lines[2] == f"{d}: 2 problem(s)"
    assert captured.out == ""


def test_cli_verify_without_a_manifest_exits_1(tmp_path, capsys):
    d = make_checkpoint(tmp_path, 3)
    assert run_cli("checkpoint", "verify", str(d)) == 1
    assert f"{MANIFEST_NAME} is missing from {d}" in capsys.readouterr().err


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert run_cli("checkpoint", "verify", str(tmp_path / "nope")) == 2
    assert "nope does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert run_cli("checkpoint", "manifest", str(tmp_path / "file")) == 2
    assert "is not a directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("checkpoint", "verify", str(empty)) == 2
    assert "neither a global_step_N folder nor a checkpoint directory" in capsys.readouterr().err
    assert not list(empty.iterdir())  # nothing written on a usage error
    # the tracker names a folder verl's pruning (or a person) removed
    make_checkpoint(empty, 4)
    (empty / TRACKER_NAME).write_text("9")
    assert run_cli("checkpoint", "verify", str(empty)) == 2
    err = capsys.readouterr().err
    assert "tracker file says step 9" in err and "global_step_4" in err
    with pytest.raises(SystemExit) as e:
        run_cli("checkpoint", "verify")  # no DIR: argparse's own usage error
    assert e.value.code == 2


def test_cli_manifest_that_cannot_be_written_exits_1(tmp_path, capsys, monkeypatch):
    d = make_checkpoint(tmp_path, 3)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomicfile.tempfile, "mkstemp", read_only)
    assert run_cli("checkpoint", "manifest", str(d)) == 1
    assert "cannot write a manifest" in capsys.readouterr().err


def _cli_has_checkpoint() -> bool:
    from verl_exporter.cli import build_parser

    try:
        build_parser().parse_args(["checkpoint", "verify", "."])
    except SystemExit:
        return False
    return True


@pytest.mark.integration
def test_cli_through_the_installed_entry_point(tmp_path):
    if not _cli_has_checkpoint():
        pytest.skip("the checkpoint subcommand is not wired into verl_exporter.cli yet")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "verl_exporter", "checkpoint", *args], capture_output=True,
                              text=True, timeout=scaled(60))

    d = make_checkpoint(tmp_path, 3)
    p = cli("manifest", str(tmp_path))
    assert p.returncode == 0 and f"wrote {d / MANIFEST_NAME}" in p.stdout, p.stderr
    assert cli("verify", str(d)).returncode == 0
    _tamper_truncate(d)
    p = cli("verify", str(d))
    assert p.returncode == 1 and "has 100 bytes; the manifest says 5001" in p.stderr
    p = cli("verify", str(tmp_path / "nope"))
    assert p.returncode == 2 and "does not exist" in p.stderr
    assert cli("--help").returncode == 0


# ---------------------------------------------------------------------------------------------- callback


@pytest.mark.integration  # verl
def test_callback_is_loaded_by_verl_and_writes_the_manifest(tmp_path):
    callback_mod = verl_module("verl.trainer.ppo.checkpoint_callback")
    from omegaconf import OmegaConf
    from verl_exporter.trainer import verl_callback

    config = OmegaConf.create({"trainer": {
        "checkpoint_callback_class": "verl_exporter.trainer.verl_callback.ManifestCheckpointCallback"}})
    callback = callback_mod.build_checkpoint_callback(config)  # how verl's trainer builds it
    assert isinstance(callback, verl_callback.ManifestCheckpointCallback)
    assert isinstance(callback, callback_mod.CheckpointCallback)
    assert callback.config is config

    d = make_checkpoint(tmp_path, 20)
    # the keyword call of verl's v1 trainer, after it wrote the tracker file
    assert callback.on_save(trainer=object(), global_step=20, checkpoint_dir=str(d), async_save=False) is None
    assert verify_manifest(d).ok
    callback.on_save(object(), 20, str(d), future_context="ignored")  # positional, and kwargs verl may add later
    assert verify_manifest(d).ok


def test_callback_skips_async_saves(tmp_path, caplog, verl_callback):
    d = make_checkpoint(tmp_path, 20, tracker=False)  # verl writes no tracker with async_save either
    callback = verl_callback.ManifestCheckpointCallback(config=None)
    with caplog.at_level(logging.INFO, logger="verl_exporter"):
        callback.on_save(trainer=None, global_step=20, checkpoint_dir=str(d), async_save=True)
        callback.on_save(trainer=None, global_step=30, checkpoint_dir=str(d), async_save=True)
    assert not (d / MANIFEST_NAME).exists()
    records = [r for r in caplog.records if "async_save" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO]  # loud once, then quiet


def test_an_async_save_over_an_earlier_runs_checkpoint_removes_its_stale_manifest(tmp_path, caplog, verl_callback):
    d = make_checkpoint(tmp_path, 20)
    write_manifest(d)  # run 1's save of step 20
    # run 2 resumed from an earlier step and saves step 20 again, asynchronously: new shards are on their way
    (d / "actor" / "model_world_size_2_rank_0.pt").write_bytes(b"run 2, half written")
    callback = verl_callback.ManifestCheckpointCallback(config=None)
    with caplog.at_level(logging.INFO, logger="verl_exporter"):
        callback.on_save(trainer=None, global_step=20, checkpoint_dir=str(d), async_save=True)
    assert not (d / MANIFEST_NAME).exists()  # it described run 1's files: verify would call run 2's corrupt
    assert verify_manifest(d).problems == [f"{MANIFEST_NAME} is missing from {d}."]
    assert "earlier save" in caplog.text


@pytest.mark.parametrize("where", ["missing", "a_file"])
def test_callback_never_raises_on_a_bad_dir(tmp_path, caplog, where, verl_callback):
    target = tmp_path / where
    if where == "a_file":
        target.write_text("not a folder")
    callback = verl_callback.ManifestCheckpointCallback()
    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        callback.on_save(trainer=None, global_step=1, checkpoint_dir=str(target), async_save=False)
    assert len(caplog.records) == 1 and "no manifest for checkpoint step 1" in caplog.records[0].getMessage()


def test_callback_never_raises_whatever_fails_and_logs_the_traceback_once(tmp_path, caplog, monkeypatch, verl_callback):
    def broken(step_dir):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(verl_callback, "write_manifest", broken)
    callback = verl_callback.ManifestCheckpointCallback()
    d = make_checkpoint(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        for step in (1, 2, 3):
            callback.on_save(trainer=None, global_step=step, checkpoint_dir=str(d))
    assert len(caplog.records) == 3 and all("disk on fire" in r.getMessage() for r in caplog.records)
    assert [bool(r.exc_info) for r in caplog.records] == [True, False, False]


def test_callback_lets_ctrl_c_through(tmp_path, monkeypatch, verl_callback):
    def interrupted(step_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(verl_callback, "write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        verl_callback.ManifestCheckpointCallback().on_save(None, 1, str(tmp_path))


@pytest.mark.integration
def test_callback_module_imports_and_works_without_verl(tmp_path):
    d = make_checkpoint(tmp_path, 4)
    code = (
        "import sys\n"
        "sys.modules['verl'] = None  # any 'import verl...' now raises ImportError\n"
        "from verl_exporter.trainer.verl_callback import ManifestCheckpointCallback as C\n"
        "assert [b.__name__ for b in C.__mro__] == ['ManifestCheckpointCallback', '_CallbackBase', 'object']\n"
        "C(config={'x': 1}).on_save(trainer=None, global_step=4, checkpoint_dir=sys.argv[1], async_save=False)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=scaled(60))
    assert p.returncode == 0, p.stderr
    assert verify_manifest(d).ok


# ---------------------------------------------------------------------------------------------- collector


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_ctx(ckpt_dir, clock=None, verify=False) -> Context:
    spec = load_spec()
    settings = ServeConfig(checkpoint_dir=None if ckpt_dir is None else str(ckpt_dir), checkpoint_grace=GRACE,
                           checkpoint_verify=verify)
    return Context(spec=spec, self_metrics=SelfMetrics(spec), config=settings, clock=clock or Clock(T0))


def values(samples) -> dict:
    out = {}
    for name, labels, value in samples:
        key = (name, tuple(sorted(labels.items())))
        assert key not in out, f"duplicate series {key}"
        out[key] = value
    return out


def fast(collector) -> dict:
    return {name: v for (name, labels), v in values(collector.sample()).items()}


def test_collector_is_unavailable_without_a_checkpoint_dir():
    with pytest.raises(Unavailable, match="no --checkpoint-dir"):
        CheckpointCollector(make_ctx(None))


def test_collector_missing_dir_gives_no_series_then_picks_it_up(tmp_path):
    root = tmp_path / "checkpoints" / "proj" / "exp"
    ctx = make_ctx(root, verify=True)
    collector = CheckpointCollector(ctx)
    sampler = Sampler([collector], ctx.spec, ctx.self_metrics)
    assert sampler.run_once(collector, slow=True) is True  # not an error: training has not saved yet
    assert sampler.series() == []
    root.mkdir(parents=True)
    sampler.run_once(collector, slow=True)
    assert {metric.name: list(rows.values()) for metric, rows in sampler.series()} == {
        "verl_checkpoint_kept": [0.0], "verl_checkpoint_incomplete": [0.0]}
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="checkpoint") == 0


def test_collector_latest_step_and_time_come_from_the_tracker(tmp_path):
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    (tmp_path / TRACKER_NAME).write_text("20\n")  # e.g. resumed at 20; 30 is not trusted by verl either
    os.utime(tmp_path / TRACKER_NAME, (T0 - 50, T0 - 50))
    got = fast(CheckpointCollector(make_ctx(tmp_path)))
    assert got["verl_checkpoint_latest_step"] == 20
    assert got["verl_checkpoint_latest_timestamp_seconds"] == T0 - 50
    assert got["verl_checkpoint_kept"] == 3


def test_collector_latest_time_is_never_in_the_future(tmp_path):
    make_checkpoint(tmp_path, 10)
    os.utime(tmp_path / TRACKER_NAME, (T0 + 7200, T0 + 7200))  # written by a host whose clock runs ahead
    got = fast(CheckpointCollector(make_ctx(tmp_path)))
    assert got["verl_checkpoint_latest_timestamp_seconds"] == T0


def test_collector_without_tracker_prefers_the_newest_folder_with_a_manifest(tmp_path):
    for step in (10, 20, 30):
        set_times(make_checkpoint(tmp_path, step, tracker=False), T0 - 1000 + step)
    collector = CheckpointCollector(make_ctx(tmp_path))
    got = fast(collector)  # no tracker, no manifests: the newest folder is all there is
    assert got["verl_checkpoint_latest_step"] == 30
    assert got["verl_checkpoint_latest_timestamp_seconds"] == T0 - 970

    write_manifest(tmp_path / "global_step_20")
    os.utime(tmp_path / "global_step_20", (T0 - 500, T0 - 500))
    got = fast(collector)
    assert got["verl_checkpoint_latest_step"] == 20
    assert got["verl_checkpoint_latest_timestamp_seconds"] == T0 - 500


def test_collector_flags_a_save_left_unfinished_only_after_the_grace(tmp_path):
    make_checkpoint(tmp_path, 100)
    partial = tmp_path / "global_step_200"
    (partial / "actor").mkdir(parents=True)  # a save that died while writing the actor shards
    (partial / "actor" / "model_world_size_2_rank_0.pt").write_bytes(b"half")
    set_times(partial, T0)
    clock = Clock(T0 + GRACE - 1)
    collector = CheckpointCollector(make_ctx(tmp_path, clock))
    assert fast(collector)["verl_checkpoint_incomplete"] == 0  # young: an async save may still be writing
    clock.now = T0 + GRACE + 1
    got = fast(collector)
    assert got["verl_checkpoint_incomplete"] == 1
    assert got["verl_checkpoint_latest_step"] == 100 and got["verl_checkpoint_kept"] == 2

    # a new shard in actor/ does not touch global_step_200/'s own mtime, but it is progress all the same
    os.utime(partial / "actor", (T0 + GRACE - 10, T0 + GRACE - 10))
    assert fast(collector)["verl_checkpoint_incomplete"] == 0

    # the save finished after all: verl wrote the tracker
    set_times(partial, T0)
    (tmp_path / TRACKER_NAME).write_text("200")
    clock.now = T0 + 10 * GRACE
    assert fast(collector)["verl_checkpoint_incomplete"] == 0


def test_collector_incomplete_without_tracker_unless_the_folder_has_a_manifest(tmp_path):
    d = make_checkpoint(tmp_path, 5, tracker=False)
    set_times(d, T0)
    collector = CheckpointCollector(make_ctx(tmp_path, Clock(T0 + GRACE + 1)))
    assert fast(collector)["verl_checkpoint_incomplete"] == 1
    write_manifest(d)  # our callback only writes one after verl's save returned
    set_times(d, T0)
    assert fast(collector)["verl_checkpoint_incomplete"] == 0


def test_collector_slow_path_size_of_the_latest_checkpoint(tmp_path):
    done = make_checkpoint(tmp_path, 100)
    partial = tmp_path / "global_step_200"
    partial.mkdir()
    (partial / "huge.pt").write_bytes(b"x" * 50_000)
    collector = CheckpointCollector(make_ctx(tmp_path))
    got = values(collector.sample_slow())
    expected = sum(p.stat().st_size for p in done.rglob("*") if p.is_file())
    assert got == {("verl_checkpoint_latest_size_bytes", ()): expected}  # no verify series: --checkpoint-verify off


def test_collector_size_counts_only_the_checkpoints_own_regular_files(tmp_path):
    done = make_checkpoint(tmp_path, 100)
    expected = sum(p.stat().st_size for p in done.rglob("*") if p.is_file())
    outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    outside.write_bytes(b"y" * 70_000)
    (done / "link-out.bin").symlink_to(outside)  # not part of what the checkpoint holds
    (done / "zero").symlink_to("/dev/zero")
    collector = CheckpointCollector(make_ctx(tmp_path))
    assert values(collector.sample_slow()) == {("verl_checkpoint_latest_size_bytes", ()): expected}


def test_collector_verifies_each_manifest_once_until_something_changes(tmp_path, monkeypatch):
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    write_manifest(tmp_path / "global_step_10")
    write_manifest(tmp_path / "global_step_20")  # 30 has none: it was saved with async_save
    calls = []

    def counting_verify(step_dir, **kwargs):
        calls.append(Path(step_dir).name)
        return verify_manifest(step_dir, **kwargs)

    monkeypatch.setattr(checkpoint_collector, "verify_manifest", counting_verify)
    collector = CheckpointCollector(make_ctx(tmp_path, verify=True))

    def verified():
        return {dict(labels)["step"]: v for (name, labels), v in values(collector.sample_slow()).items()
                if name == "verl_checkpoint_manifest_verified"}

    assert verified() == {"10": 1, "20": 1}
    assert sorted(calls) == ["global_step_10", "global_step_20"]
    assert verified() == {"10": 1, "20": 1}
    assert verified() == {"10": 1, "20": 1}
    assert len(calls) == 2  # cached: no rehashing on later passes

    _tamper_flip(tmp_path / "global_step_10")  # same size, new content, new mtime
    assert verified() == {"10": 0, "20": 1}
    assert calls[2:] == ["global_step_10"]
    assert verified() == {"10": 0, "20": 1} and len(calls) == 3  # the failure is cached too

    write_manifest(tmp_path / "global_step_10")  # someone re-blessed it: a new manifest is checked afresh
    assert verified() == {"10": 1, "20": 1} and calls[3:] == ["global_step_10"]

    shutil.rmtree(tmp_path / "global_step_20")  # verl pruned it (max_actor_ckpt_to_keep)
    assert verified() == {"10": 1}
    assert set(collector._verified) == {10}


def prune_like_verl(root: Path, steps: list[int], component: str, keep: int) -> None:
    """Run verl's own retention (BaseCheckpointManager.register_checkpoint) over global_step_N/<component>."""
    manager_mod = verl_module("verl.utils.checkpoint.checkpoint_manager")
    manager = manager_mod.BaseCheckpointManager.__new__(manager_mod.BaseCheckpointManager)  # no model, no GPUs
    manager.previous_saved_paths = []
    for step in steps:
        manager.register_checkpoint(str(root / f"global_step_{step}" / component), keep)


@pytest.mark.integration  # verl
def test_verls_retention_leaves_husks_that_are_neither_kept_nor_mismatches(tmp_path):
    steps = [10, 20, 30]
    for step in steps:
        write_manifest(make_checkpoint(tmp_path, step))
    prune_like_verl(tmp_path, steps, "actor", keep=2)  # max_actor_ckpt_to_keep=2
    prune_like_verl(tmp_path, steps, "critic", keep=1)  # max_critic_ckpt_to_keep=1
    husk = tmp_path / "global_step_10"
    assert sorted(p.name for p in husk.iterdir()) == ["data.pt", MANIFEST_NAME]  # verl left the folder
    assert not (tmp_path / "global_step_20" / "critic").exists()

    # the CLI still says exactly what is gone: one sentence per folder, not one per file
    assert verify_manifest(husk).problems == [
        "actor/ is missing, with the 5 file(s) the manifest lists in it (verl's max_*_ckpt_to_keep removes it from "
        "older checkpoints).",
        "critic/ is missing, with the 1 file(s) the manifest lists in it (verl's max_*_ckpt_to_keep removes it from "
        "older checkpoints)."]
    older = verify_manifest(tmp_path / "global_step_20", pruned_ok=True)
    assert older.ok and older.pruned == ["critic/"]

    collector = CheckpointCollector(make_ctx(tmp_path, verify=True))
    assert fast(collector)["verl_checkpoint_kept"] == 2
    got = values(collector.sample_slow())
    assert {dict(labels)["step"]: v for (name, labels), v in got.items()
            if name == "verl_checkpoint_manifest_verified"} == {"20": 1, "30": 1}

    # on the latest checkpoint a missing critic/ is a loss: verl never prunes that one
    shutil.rmtree(tmp_path / "global_step_30" / "critic")
    got = values(collector.sample_slow())
    assert got[("verl_checkpoint_manifest_verified", (("step", "30"),))] == 0


@pytest.mark.integration
def test_exposition_passes_promtool(tmp_path):
    promtool = require_tool("promtool")
    make_checkpoint(tmp_path, 10)
    write_manifest(make_checkpoint(tmp_path, 20))
    set_times(tmp_path / "global_step_10", T0)
    partial = tmp_path / "global_step_30"
    partial.mkdir()
    set_times(partial, T0)
    ctx = make_ctx(tmp_path, Clock(T0 + GRACE + 5), verify=True)
    collector = CheckpointCollector(ctx)
    sampler = Sampler([collector], ctx.spec, ctx.self_metrics, const_labels={"run": "ppo", "rank": "0"})
    assert sampler.run_once(collector, slow=True)
    text = sampler.render()
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr

    m = parse_metrics(text)
    assert sample(m, "verl_checkpoint_latest_step", run="ppo", rank="0") == 20
    assert sample(m, "verl_checkpoint_kept") == 3
    assert sample(m, "verl_checkpoint_incomplete") == 1
    assert sample(m, "verl_checkpoint_manifest_verified", step="20") == 1
    assert sample(m, "verl_checkpoint_manifest_verified", step="10") is None  # no manifest, nothing to check
    assert sample(m, "verl_checkpoint_latest_size_bytes") == sum(
        p.stat().st_size for p in (tmp_path / "global_step_20").rglob("*") if p.is_file())
    assert "# HELP verl_checkpoint_latest_timestamp_seconds" in text
    # every sample fitted the spec: the sampler reports a misfit as a problem of the collector
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="checkpoint") == 0
