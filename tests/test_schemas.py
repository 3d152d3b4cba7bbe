"""The published JSON Schemas: generated from the typed models, the same bytes `verl-exporter schema` prints,
and the example files that point to them validate against them (what an editor checks as you type)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from verl_exporter import cli
from verl_exporter.spec import load_spec
from verl_exporter.tools.schemas import SCHEMA_DIR, SCHEMAS, schema_files

REPO = Path(__file__).resolve().parent.parent
POINTER = re.compile(r"^# yaml-language-server: \$schema=(\S+)$", re.M)


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_the_cli_prints_the_committed_schema(kind, capsys):
    assert cli.main(["schema", kind]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((REPO / SCHEMA_DIR / f"{kind}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(printed)


def test_generate_writes_every_schema():
    assert sorted(schema_files(load_spec())) == sorted(f"{SCHEMA_DIR}/{k}.schema.json" for k in SCHEMAS)


def pointing_files() -> list[Path]:
    out = []
    for path in sorted(REPO.glob("**/*.y*ml")):
        if ".venv" in path.parts or "node_modules" in path.parts:
            continue
        head = path.read_text(encoding="utf-8", errors="replace")[:2000]
        if POINTER.search(head):
            out.append(path)
    return out


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
