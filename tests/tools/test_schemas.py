"""The published JSON Schemas: generated from the typed models, the same bytes `verl-exporter schema` prints,
and the example files that point to them validate against them (what an editor checks as you type)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from helpers import REPO, scaled
from verl_exporter import cli
from verl_exporter.spec import load_spec
from verl_exporter.tools.schemas import SCHEMA_DIR, SCHEMAS, schema_files

POINTER = re.compile(r"^# yaml-language-server: \$schema=(\S+)$", re.M)


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_the_cli_prints_the_committed_schema(kind, capsys):
    assert cli.main(["schema", kind]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((REPO / SCHEMA_DIR / f"{kind}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(printed)


def test_generate_writes_every_schema():
    assert sorted(schema_files(load_spec())) == sorted(f"{SCHEMA_DIR}/{k}.schema.json" for k in SCHEMAS)


def source_files(pattern: str) -> list[Path]:
    """The checkout's own files matching pattern: what git tracks or would track, never build outputs (the
    build/ copy a plain `pip install .` leaves points to schemas by paths that only hold in the source tree)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", pattern],
                                cwd=REPO, capture_output=True, check=True, timeout=scaled(30)).stdout
        return sorted(REPO / name for name in listed.decode().split("\0") if name and (REPO / name).is_file())
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an unpacked sdist): skip what git ignores
        skip = {".venv", "node_modules", "build", "dist", ".git"}
        return sorted(p for p in REPO.glob(pattern) if not skip & set(p.relative_to(REPO).parts))


def pointing_files() -> list[Path]:
    out = []
    for path in source_files("*.y*ml"):
        head = path.read_text(encoding="utf-8", errors="replace")[:2000]
        if POINTER.search(head):
            out.append(path)
    return out


@pytest.mark.integration
def test_the_examples_that_point_to_a_schema_validate_against_it():
    files = pointing_files()
    checked = []
    for path in files:
        target = (path.parent / POINTER.search(path.read_text(encoding="utf-8")).group(1)).resolve()
        assert target.is_file(), f"{path.relative_to(REPO)} points to a missing schema {target}"
        schema = json.loads(target.read_text())
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
        assert errors == [], path.relative_to(REPO)
        checked.append(target.name)
    # every published schema has at least one example that an editor checks against it
    assert sorted(set(checked)) == sorted(f"{k}.schema.json" for k in SCHEMAS)


def test_a_wrong_example_fails_its_schema():
    schema = json.loads((REPO / SCHEMA_DIR / "overrides.schema.json").read_text())
    doc = {"version": 1, "alerts": {"VerlRewardCollapse": {"thresholdz": {"k": 5}}}}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
