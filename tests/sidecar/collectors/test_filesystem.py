"""The filesystem collector: statvfs per watched path, paths not created yet, errors counted, the real disk."""

from __future__ import annotations

import errno
import os

import pytest
from helpers import configure
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.collectors import Context
from verl_exporter.sidecar.collectors import filesystem as filesystem_module
from verl_exporter.sidecar.collectors.filesystem import FilesystemCollector
from verl_exporter.spec import load_spec


@pytest.fixture
def ctx():
    spec = load_spec()
    return Context(spec=spec, self_metrics=SelfMetrics(spec))


def by_path(samples) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in samples:
        out.setdefault(labels["path"], {})[name.removeprefix("verl_host_filesystem_")] = value
    return out


def errors(ctx) -> float:
    return ctx.self_metrics.value("verl_exporter_source_errors_total", component="filesystem")


class FakeStatvfs:
    f_frsize = 4096
    f_blocks = 1_000_000  # 4096 x 1e6 = 4.096 GB
    f_bfree = 300_000
    f_bavail = 250_000  # 50,000 blocks reserved for root are not available


def test_size_and_avail_use_the_fragment_size_and_unprivileged_blocks(ctx, monkeypatch, tmp_path):
    monkeypatch.setattr(filesystem_module.os, "statvfs", lambda path: FakeStatvfs)
    configure(ctx, checkpoint_dir=str(tmp_path))
    assert by_path(FilesystemCollector(ctx).sample()) == {
        str(tmp_path): {"size_bytes": 4096 * 1_000_000, "avail_bytes": 4096 * 250_000}}


def test_checkpoint_dir_and_watch_paths_labelled_as_given(ctx, tmp_path):
    (tmp_path / "ckpt").mkdir()
    configure(ctx, checkpoint_dir=str(tmp_path / "ckpt"))
    configure(ctx, watch_paths=(str(tmp_path) + "/", str(tmp_path / "ckpt")))  # the checkpoint dir twice: one series
    got = by_path(FilesystemCollector(ctx).sample())
    assert list(got) == [str(tmp_path / "ckpt"), str(tmp_path) + "/"]
    st = os.statvfs(tmp_path)
    for values in got.values():
        assert values["size_bytes"] == st.f_blocks * st.f_frsize
        assert 0 < values["avail_bytes"] <= values["size_bytes"]


def test_a_path_not_created_yet_has_no_series_and_is_no_error(ctx, tmp_path):
    configure(ctx, checkpoint_dir=str(tmp_path / "checkpoints"))
    configure(ctx, watch_paths=(str(tmp_path),))
    c = FilesystemCollector(ctx)
    assert list(by_path(c.sample())) == [str(tmp_path)]
    assert errors(ctx) == 0
    (tmp_path / "checkpoints").mkdir()  # the first save creates it
    assert list(by_path(c.sample())) == [str(tmp_path / "checkpoints"), str(tmp_path)]


def test_a_file_where_a_directory_should_be_is_counted(ctx, tmp_path):
    (tmp_path / "ckpt").write_text("not a directory")
    configure(ctx, checkpoint_dir=str(tmp_path / "ckpt" / "global_step_10"))  # ENOTDIR, not ENOENT
    configure(ctx, watch_paths=(str(tmp_path),))
    assert list(by_path(FilesystemCollector(ctx).sample())) == [str(tmp_path)]
    assert errors(ctx) == 1


def test_permission_denied_is_counted(ctx, monkeypatch, tmp_path):
    # Tests run as root, for whom chmod does not deny a statvfs: raise the error the kernel would give.
    real_statvfs = os.statvfs

    def statvfs(path):
        if path.endswith("private"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_statvfs(path)

    monkeypatch.setattr(filesystem_module.os, "statvfs", statvfs)
    configure(ctx, watch_paths=(str(tmp_path / "private"), str(tmp_path)))
    assert list(by_path(FilesystemCollector(ctx).sample())) == [str(tmp_path)]
    assert errors(ctx) == 1


def test_permission_denied_for_real_when_not_root(ctx, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root is never denied a search permission")
    locked = tmp_path / "locked"
    (locked / "inner").mkdir(parents=True)
    locked.chmod(0)
    try:
        configure(ctx, watch_paths=(str(locked / "inner"),))
        assert FilesystemCollector(ctx).sample() == []
        assert errors(ctx) == 1
    finally:
        locked.chmod(0o755)


def test_nothing_to_watch(ctx):
    assert FilesystemCollector(ctx).sample() == []


def test_real_root_filesystem(ctx):
    configure(ctx, watch_paths=("/",))
    got = by_path(FilesystemCollector(ctx).sample())["/"]
    assert got["size_bytes"] > 0
    assert 0 <= got["avail_bytes"] <= got["size_bytes"]
