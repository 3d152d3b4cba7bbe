"""CLI and config errors: each a clear one-line message and an exit status, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from helpers import scaled
from verl_exporter import cli
from verl_exporter.sidecar.config import ConfigError, build_config, read_config_file

NOT_UTF8 = b"listen: \xff\xfe:9477\n"


def run(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_exporter", *argv], capture_output=True, text=True,
                          timeout=scaled(60), **kwargs)


@pytest.mark.integration
def test_a_file_sd_problem_is_not_called_a_listen_failure(tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    p = run("serve", "--listen", "127.0.0.1:0", "--file-sd", str(not_a_dir / "sd"))
    assert p.returncode == 2
    assert "cannot listen" not in p.stderr and str(not_a_dir) in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.integration
def test_a_port_in_use_is_a_listen_failure():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = run("serve", "--listen", f"127.0.0.1:{port}")
    assert p.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in p.stderr, p.stderr


def test_dashed_keys_in_the_config_file_are_accepted(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("verl-log: /var/log/run.jsonl\nmax-line-bytes: 2048\nrun: exp\n")
    config = build_config(read_config_file(str(path)), {})
    assert (config.verl_log, config.max_line_bytes, config.run) == ("/var/log/run.jsonl", 2048, "exp")


def test_a_setting_given_both_ways_is_refused(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("verl-log: a.jsonl\nverl_log: b.jsonl\n")
    with pytest.raises(ConfigError, match="given twice"):
        read_config_file(str(path))


def test_a_non_utf8_config_is_a_config_error(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_bytes(NOT_UTF8)
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_config_file(str(path))


@pytest.mark.parametrize("command", [["spec"], ["generate", "--check"]])
def test_a_non_utf8_spec_is_a_clear_error(tmp_path, capsys, command):
    path = tmp_path / "spec.yaml"
    path.write_bytes(NOT_UTF8)
    assert cli.main([*command, "--spec", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "not UTF-8 text" in err


def test_generate_into_a_file_is_a_clear_error(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("")
    assert cli.main(["generate", "--out", str(target)]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_generate_where_it_cannot_write_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "rules"
    blocker.write_text("")  # a file where generate needs a folder
    assert cli.main(["generate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot write the generated files" in err and str(blocker) in err


@pytest.mark.integration
def test_a_closed_pipe_stops_quietly(tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head` that has already left
    try:
        p = subprocess.run([sys.executable, "-m", "verl_exporter", "spec"], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=scaled(60))
    finally:
        os.close(write_end)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert p.returncode == 1


@pytest.mark.parametrize("value", [0, -1])
def test_max_line_bytes_must_allow_a_line(value):
    with pytest.raises(ConfigError, match="max_line_bytes"):
        build_config({}, {"max_line_bytes": value})


@pytest.mark.parametrize("rate", ["0", "-5", "nan", "inf", "fast"])
def test_demo_rate_must_be_positive(rate, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["demo", "--rate", rate])
    assert e.value.code == 2 and "--rate" in capsys.readouterr().err


def test_run_demo_refuses_a_rate_that_would_replay_at_once():
    from verl_exporter.tools.demo import run_demo

    with pytest.raises(ValueError, match="rate"):
        run_demo(listen="127.0.0.1:0", rate=0)


def test_node_refuses_a_negative_rank_offset(capsys):
    assert cli.main(["node", "--ranks", "2", "--rank-offset", "-1", "--listen", "127.0.0.1:0"]) == 2
    assert "--rank-offset" in capsys.readouterr().err


@pytest.mark.integration
def test_a_non_utf8_token_file_is_named_without_quoting_the_secret(tmp_path):
    token = tmp_path / "token"
    token.write_bytes(b"\xe9secret")
    p = run("serve", "--listen", "127.0.0.1:0", "--checkpoint-dir", str(tmp_path), "--control-token-file",
            str(token))
    assert p.returncode == 2 and "is not UTF-8 text" in p.stderr, p.stderr
    assert "0xe9" not in p.stderr and "secret" not in p.stderr.replace(str(token), "")
