"""Hostile YAML files: every file the pack reads goes through one loader that refuses aliases, files over a size
cap and nesting deeper than a cap, each as a clear error naming the file (and the line where there is one).
A 600-byte "billion laughs" file once hung `generate --overrides`, `relay --check-config` and `serve --config`
(serve grew to 24 GB, ignored SIGTERM and was OOM-killed): the duplicate-key and line walks visited each node
once per alias path, 9^9 visits for 9 levels."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO, scaled
from verl_exporter.core import models
from verl_exporter.core.models import FileError, parse_yaml, read_yaml
from verl_exporter.relay.config import load_config
from verl_exporter.sidecar.config import read_config_file
from verl_exporter.spec import load_spec
from verl_exporter.spec.overrides import load_overrides

LOADERS = {
    "overrides": load_overrides,
    "relay": lambda p: load_config(p, environ={}, secrets_needed=False),
    "sidecar": read_config_file,
    "spec": load_spec,
}


def laughs(levels: int, head: str = "version: 1\n") -> str:
    """The billion-laughs file: each level an anchored list of nine aliases of the level above."""
    names = "abcdefghijklmnopqrstuvwxyz"[:levels]
    lines = [head.rstrip("\n"), 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"{n}: &{n} [{','.join(['*' + p] * 9)}]" for p, n in zip(names, names[1:], strict=False)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("kind", LOADERS)
def test_an_alias_is_refused_naming_the_file_and_its_line(tmp_path, kind):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(5), encoding="utf-8")
    with pytest.raises(FileError) as e:
        LOADERS[kind](path)
    assert len(e.value.problems) == 1, e.value.problems
    problem = e.value.problems[0]
    assert problem.startswith(f"{path}:3: "), problem  # line 3: b's list, the first alias
    assert "alias *a" in problem and "anchor &a at line 2" in problem, problem


def test_a_single_alias_is_refused_too():
    with pytest.raises(FileError) as e:
        parse_yaml("base: &base {for: 5m}\nalerts:\n  X: *base\n", "o.yaml")
    assert e.value.problems[0].startswith("o.yaml:3: "), e.value.problems


def test_an_anchor_without_an_alias_is_harmless():
    doc, lines = parse_yaml("a: &x 1\nb: 2\n", "o.yaml")
    assert doc == {"a": 1, "b": 2} and lines == {("a",): 1, ("b",): 2}


@pytest.mark.integration
@pytest.mark.parametrize("argv", [
    ["generate", "--out", "{out}", "--overrides", "{file}"],
    ["relay", "--check-config", "--config", "{file}"],
    ["serve", "--listen", "127.0.0.1:0", "--config", "{file}"],
], ids=["generate", "relay", "serve"])
def test_the_600_byte_bomb_is_refused_at_once_by_every_command(tmp_path, argv):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(9), encoding="utf-8")
    assert len(path.read_bytes()) < 700
    cmd = [a.format(out=tmp_path / "out", file=path) for a in argv]
    p = subprocess.run([sys.executable, "-m", "verl_exporter", *cmd], capture_output=True, text=True,
                       timeout=scaled(60))
    assert p.returncode in (1, 2), (p.returncode, p.stderr)  # generate's "cannot use the overrides" is 1
    assert f"{path}:3: " in p.stderr and "alias" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_file_over_the_size_cap_is_refused_with_the_limit(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * (models.MAX_YAML_BYTES // 10 + 1) + "version: 1\n", encoding="utf-8")
    with pytest.raises(FileError) as e:
        read_yaml(path)
    assert e.value.problems == [f"{path}: larger than the {models.MAX_YAML_BYTES // 1024**2} MiB a YAML file "
                                "may have here"], e.value.problems


def test_an_endless_file_is_read_no_further_than_the_cap():
    with pytest.raises(FileError, match="larger than"):
        read_yaml("/dev/zero")


def test_text_over_the_size_cap_is_refused():
    with pytest.raises(FileError, match="larger than"):
        parse_yaml("a: " + "x" * models.MAX_YAML_BYTES, "o.yaml")


@pytest.mark.parametrize("text, line", [
    ("[" * 80 + "]" * 80, 1),
    ("".join(" " * i + f"k{i}:\n" for i in range(80)) + " " * 80 + "1\n", models.MAX_YAML_DEPTH + 1),
    ("- " * 80 + "1\n", 1),
], ids=["flow", "block-mapping", "block-sequence"])
def test_nesting_deeper_than_the_cap_is_refused(text, line):
    with pytest.raises(FileError) as e:
        parse_yaml(text, "deep.yaml")
    assert e.value.problems[0].startswith(f"deep.yaml:{line}: ") and \
        f"nested deeper than {models.MAX_YAML_DEPTH} levels" in e.value.problems[0], e.value.problems


def test_nesting_within_the_cap_is_fine():
    doc, _ = parse_yaml("[" * 20 + "1" + "]" * 20, "o.yaml")
    for _ in range(20):
        doc = doc[0]
    assert doc == 1


@pytest.mark.parametrize("text", [
    "a: 2001-13-45\n",                  # a timestamp with no such month: datetime's ValueError
    "a: " + "1" * 5000 + "\n",          # past Python's int-from-string digit limit: ValueError
    "a: !!float nope\n",
    "a: !!int nope\n",
    "a: !!bool nope\n",
    "a: !!timestamp nope\n",
    "a: !!python/object:os.system {}\n",
    "{[1]: 2}\n",
    "<<: 5\n",
], ids=["bad-date", "huge-int", "bad-float", "bad-int", "bad-bool", "bad-timestamp", "python-tag", "unhashable-key",
        "bad-merge"])
def test_a_value_yaml_cannot_build_is_a_file_error(text):
    with pytest.raises(FileError) as e:
        parse_yaml(text, "v.yaml")
    assert e.value.problems[0].startswith("v.yaml:"), e.value.problems


def test_a_syntax_error_names_the_file_and_line():
    with pytest.raises(FileError) as e:
        parse_yaml("a: 1\nb: [1, 2\nc: 3\n", "s.yaml")
    problem = e.value.problems[0]
    assert problem.startswith("s.yaml:") and "not valid YAML" in problem and "<unicode string>" not in problem, \
        problem


def test_the_files_the_pack_ships_load_with_the_loader():
    root = REPO
    shipped = [*sorted((root / "exporter/verl_exporter/spec/metrics").glob("*.yaml")),
               root / "alertmanager/alertmanager.yml",
               root / "alertmanager/relay.example.yaml", root / "rules/verl-alerts.yaml",
               root / "rules/verl-recording.yaml", *sorted((root / "tests/fixtures").rglob("*.yaml")),
               root / "docker/verl-exporter.example.yaml", root / "docker/verl-exporter-serve.example.yaml",
               root / "docker/relay/relay.yaml"]
    for path in shipped:
        read_yaml(path)


def test_a_problem_with_no_line_is_reported_for_a_path_given_as_a_path(tmp_path):
    # found by the fuzzer: a dashed key of the sidecar config ('0-' read as '0_') has no line of its own, and
    # the place of the problem was then the Path itself, which broke the report with an AttributeError
    path = tmp_path / "serve.yaml"
    path.write_text("0-: false\n")
    with pytest.raises(FileError) as e:
        read_config_file(path)
    assert e.value.problems[0].startswith(f"{path}"), e.value.problems
