"""A key written twice in one mapping of any file the pack reads is an error naming both lines. YAML keeps the
last silently: the spec once had `inhibits:` twice on VerlRewardCollapse, and its inhibit of
VerlAnswersCollapsed was dropped without a word."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import verl_exporter.spec as spec_pkg
from verl_exporter.core.models import FileError
from verl_exporter.relay.config import load_config
from verl_exporter.sidecar.config import read_config_file
from verl_exporter.spec import DEFAULT_SPEC, load_spec
from verl_exporter.spec.overrides import load_overrides

PACKAGED_SPEC = Path(spec_pkg.__file__).parent / DEFAULT_SPEC


def test_the_spec_bug_it_would_have_caught(tmp_path):
    anchor = "        inhibits: [VerlRewardDrop, VerlRewardDecline, VerlAnswersCollapsed]\n"
    shutil.copytree(PACKAGED_SPEC, tmp_path / "spec")
    (path,) = [p for p in (tmp_path / "spec").rglob("*.yaml") if anchor in p.read_text(encoding="utf-8")]
    text = path.read_text(encoding="utf-8")
    assert text.count(anchor) == 1
    first_line = text[: text.index(anchor)].count("\n") + 1
    path.write_text(text.replace(anchor, anchor + "        inhibits: [VerlRewardDrop]\n"), encoding="utf-8")
    with pytest.raises(FileError) as e:
        load_spec(tmp_path / "spec")
    assert e.value.problems == [
        f"{path}:{first_line + 1}: metrics.{_index_of(text, anchor)}.alerts.{_alert_index(text, anchor)}.inhibits: "
        f"duplicate key (first at line {first_line}); YAML would keep only this one"]


def _index_of(text: str, anchor: str) -> int:
    """The metrics[] index of the entry holding anchor."""
    before = text[: text.index(anchor)]
    return before[before.index("\nmetrics:"):].count("\n  - name: ") - 1


def _alert_index(text: str, anchor: str) -> int:
    """The alerts[] index, within its entry, of the alert holding anchor."""
    before = text[: text.index(anchor)]
    entry = before[before.rindex("\n  - name: "):]
    return entry.count("\n      - alert: ") - 1


@pytest.mark.parametrize("load, text", [
    (load_overrides, "version: 1\nalerts:\n  VerlRewardDrop: {for: 10m}\n  VerlRewardDrop: {for: 20m}\n"),
    (lambda p: load_config(p, environ={}, secrets_needed=False),
     "listen: 127.0.0.1:9095\nlisten: 127.0.0.1:9096\ntargets: {}\nroutes: []\n"),
    (read_config_file, "run: a\nrank: 1\nrun: b\n"),
], ids=["overrides", "relay", "sidecar"])
def test_every_file_the_pack_reads_refuses_a_key_given_twice(tmp_path, load, text):
    path = tmp_path / "file.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(FileError) as e:
        load(path)
    assert any("duplicate key (first at line" in p and p.startswith(f"{path}:") for p in e.value.problems), \
        e.value.problems


def test_the_same_key_in_two_mappings_is_fine(tmp_path):
    path = tmp_path / "o.yaml"
    path.write_text("version: 1\nalerts:\n  VerlRewardDrop: {for: 10m}\n  VerlRewardDecline: {for: 10m}\n")
    assert set(load_overrides(path).model.alerts) == {"VerlRewardDrop", "VerlRewardDecline"}
