"""Numbers read from outside text are bounded: int() of thousands of digits raises (Python refuses 4,300), so a
folder name, an environment variable or a label must never reach it unbounded."""

from __future__ import annotations

import pytest
from verl_exporter.checkpoint.manifest import latest_checkpoint, step_of


def test_a_step_of_thousands_of_digits_is_no_step():
    assert step_of("global_step_" + "9" * 5000) is None


@pytest.mark.parametrize("name", ["global_step_" + "9" * 200, "global_step_" + "1" * 19, "global_step_٣"])
def test_a_step_folder_with_a_number_no_step_has_is_no_step_folder(tmp_path, name):
    assert step_of(name) is None
    (tmp_path / name).mkdir()
    (tmp_path / "global_step_40").mkdir()
    assert step_of(tmp_path / "global_step_40") == 40
    found = latest_checkpoint(tmp_path)
    assert found is None or "global_step_40" in str(found)


@pytest.mark.parametrize("rank", ["1" * 5000, "٣", "１"])
def test_a_rank_of_the_environment_that_is_no_rank_is_ignored(monkeypatch, rank):
    from verl_exporter.sidecar.config import build_config

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", rank)
    config = build_config({}, {"listen": "127.0.0.1:0"})
    assert config.rank is None and config.local_rank is None


@pytest.mark.parametrize("text", ["9" * 5000, "٣", "-1", "1.5", "", " "])
def test_a_count_flag_refuses_what_is_no_bounded_whole_number(text):
    import argparse

    from verl_exporter.core.argtypes import whole_number

    with pytest.raises(argparse.ArgumentTypeError, match="not a whole number"):
        whole_number(text)


def test_preflight_refuses_a_count_of_thousands_of_digits_with_a_usage_error(capsys):
    from verl_exporter.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["preflight", "--gpus", "9" * 5000])
    assert stop.value.code == 2
    assert "not a whole number" in capsys.readouterr().err


@pytest.mark.parametrize("pid", [0, 2**31, 10**20])
def test_a_trainer_pid_no_process_can_have_is_refused_at_start(pid):
    """os.kill(2**31, 0) raises OverflowError (the state's liveness check took the sidecar down at start);
    os.kill(0, 0) reaches the sidecar's own process group, so pid 0 read as a trainer always running."""
    from verl_exporter.sidecar.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="trainer_pid"):
        build_config({}, {"listen": "127.0.0.1:0", "trainer_pid": pid})
    assert build_config({}, {"listen": "127.0.0.1:0", "trainer_pid": 2**31 - 1}).trainer_pid == 2**31 - 1


@pytest.mark.parametrize("flag, text", [("--rank", "٣"), ("--rank", "9" * 20), ("--local-rank", "１"),
                                        ("--forensics-max-files", "٣"), ("--max-unmapped", "9" * 5000)])
def test_a_serve_number_flag_refuses_non_ascii_digits_and_unbounded_digits(flag, text, capsys):
    """int() alone read '٣' as 3 and took 20 or 5,000 digits: every integer flag of serve is ASCII and bounded."""
    from verl_exporter.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["serve", flag, text])
    assert stop.value.code == 2
    assert "not a whole number" in capsys.readouterr().err


def test_a_count_setting_of_a_config_file_is_bounded():
    from verl_exporter.sidecar.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="max_unmapped"):
        build_config({"max_unmapped": 10**30}, {"listen": "127.0.0.1:0"})
    assert build_config({"max_unmapped": 7}, {"listen": "127.0.0.1:0"}).max_unmapped == 7
