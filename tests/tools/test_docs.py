"""The documentation: the README stays short with its two commands, the MkDocs site builds with no broken link
or anchor, and the examples are real: every block marked `<!-- run -->` runs, every tuning line of the alerts
reference applies."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, require_tool
from helpers import scaled
from hypothesis import given
from hypothesis import strategies as st
from verl_exporter.spec import load_spec
from verl_exporter.spec.overrides import apply_overrides, parse_overrides
from verl_exporter.tools.docs import site_config

DOCS = REPO / "docs"
README = REPO / "README.md"
DEMO_COMMAND = ("    sudo apt-get update && sudo apt-get install -y python3-venv prometheus prometheus-alertmanager "
                "&&\n      python3 -m venv .venv && . .venv/bin/activate && pip install . && verl-exporter demo\n")
TEST_COMMAND = "    ./scripts/test\n"
# A fenced block the line before marks: `<!-- run -->` (a shell or Python block the tests run) or
# `<!-- file: NAME -->` (its text is written to NAME first, for the page's run blocks to use).
MARKED_RE = re.compile(r"^<!-- (run|file: ([\w.-]+)) -->\n```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)
LINK_RE = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def marked_blocks(page: Path) -> list[tuple[str, str, str]]:
    """(what: "run" or the file's name, language, text) of each marked block, in page order."""
    return [(m.group(2) or "run", m.group(3), m.group(4)) for m in MARKED_RE.finditer(page.read_text())]


def pages_with_runs() -> list[str]:
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if any(
        what == "run" for what, _, _ in marked_blocks(p)))


# ------------------------------------------------------------------------------------------------- README
def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    first_screen = text[: text.index(TEST_COMMAND) + len(TEST_COMMAND)]
    assert DEMO_COMMAND in first_screen and len(first_screen.splitlines()) <= 45


def test_the_readme_links_to_pages_that_exist_and_reaches_the_three_tasks():
    links = [m.group(1) for m in LINK_RE.finditer(README.read_text()) if not m.group(1).startswith("http")]
    assert links and all((REPO / link).exists() for link in links), [x for x in links if not (REPO / x).exists()]
    # a newcomer's three questions, each a link away: connect a run, what an alert means, how to tune it
    assert {"docs/getting-started.md", "docs/reference/alerts.md", "docs/tuning-and-calibrate.md"} <= set(links)


# ------------------------------------------------------------------------------------------------- the pages
def test_every_page_of_the_folder_is_in_the_nav_and_every_nav_entry_a_page():
    def flat(items):
        for item in items:
            for value in item.values():
                yield from flat(value) if isinstance(value, list) else [value]

    nav = set(flat(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]))
    assert nav == {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}


def test_each_tuning_line_of_the_alerts_reference_applies_and_names_the_defaults():
    spec = load_spec()
    text = (DOCS / "reference/alerts.md").read_text()
    lines = re.findall(r"```yaml\n(alerts:\n  (\w+): .*?\n)```", text)
    assert [name for _, name in lines] == [a.alert for a in spec.alerts()]
    for block, name in lines:
        eff = apply_overrides(spec, parse_overrides(yaml.safe_load(block) | {"version": 1}, "alerts.md"))
        alert = next(a for a in eff.alerts() if a.alert == name)
        default = next(a for a in spec.alerts() if a.alert == name)
        assert (alert.knob_values(), alert.for_, alert.severity) == (default.knob_values(), default.for_,
                                                                     default.severity)


def test_the_marker_finds_the_blocks_it_should():
    page = "<!-- file: a.yaml -->\n```yaml\nx: 1\n```\ntext\n<!-- run -->\n```bash\necho hi\n```\n```bash\nno\n```\n"
    found = [(m.group(2) or "run", m.group(3), m.group(4)) for m in MARKED_RE.finditer(page)]
    assert found == [("a.yaml", "yaml", "x: 1\n"), ("run", "bash", "echo hi\n")]
    assert len(pages_with_runs()) >= 3


def test_the_docs_command_finds_the_site_of_its_checkout_only(tmp_path):
    assert site_config() == REPO / "mkdocs.yml"
    assert site_config(tmp_path / "x") is None
    assert yaml.safe_load((REPO / "mkdocs.yml").read_text())["strict"] is True  # `docs --build` is strict too


@pytest.mark.integration
def test_the_site_builds_strictly(tmp_path):
    """mkdocs build --strict, as `verl-exporter docs --build` runs it: a link to a missing page or anchor fails
    it (validation in mkdocs.yml). mkdocs-material is in the test extra: a missing one fails here."""
    proc = subprocess.run([sys.executable, "-m", "verl_exporter", "docs", "--build", str(tmp_path / "site")],
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                          timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alerts = (tmp_path / "site/reference/alerts.html").read_text()
    assert all(f'id="{a.alert.lower()}"' in alerts for a in load_spec().alerts())


@pytest.mark.integration
def test_a_broken_anchor_fails_the_strict_build(tmp_path):
    """The check itself: the same config on a copy of the pages with one anchor broken."""
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    index = tmp_path / "docs/index.md"
    index.write_text(index.read_text() + "\nSee [the stall](reference/alerts.md#verltrainingstaled).\n")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--config-file", str(tmp_path / "mkdocs.yml"),
                           "--site-dir", str(tmp_path / "site")], capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=scaled(300))
    assert proc.returncode == 1 and "#verltrainingstaled" in proc.stdout + proc.stderr


@pytest.mark.integration
@pytest.mark.parametrize("page", pages_with_runs())
def test_the_examples_marked_to_run_run(page, tmp_path):
    """Each run block of the page, in order, in one temporary directory (with the repo's example configs),
    the package's CLI on PATH."""
    require_tool("promtool")
    shutil.copytree(REPO / "alertmanager", tmp_path / "alertmanager")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO / "exporter"), os.environ.get("PYTHONPATH", "")])}
    for what, lang, text in marked_blocks(DOCS / page):
        if what != "run":
            (tmp_path / what).write_text(text)
            continue
        assert lang in ("bash", "python"), f"{page}: a {lang} block cannot run"
        argv = ["bash", "-euo", "pipefail", "-c", text] if lang == "bash" else [sys.executable, "-c", text]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(300))
        assert proc.returncode == 0, f"{page}:\n{text}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"


# ------------------------------------------------------------------------------------------- the demo's excerpt
SAMPLE = """\
  35.6s  step 235  trainer      logs a NaN gradient norm (null in verl's log); it had been exploding for a few
                          steps
  35.8s  step 236  Prometheus   firing: VerlGradNormGrowing (grad_norm) warning
  36.2s  step 238  Prometheus   firing: VerlNonFiniteGradNorm critical
  36.3s  step 240  trainer      checkpoint requested (VerlNonFiniteGradNorm): saved global_step_240 after step
                          240 in /tmp/verl-exporter-demo-ab12cd34/checkpoints

Timeline of the live stack
  36.9s  step 241  Prometheus   firing: VerlNonFiniteGradNorm critical
The path: NaN logged 35.6s (step 235) → VerlNonFiniteGradNorm firing 36.2s →
  robot message 36.2s.

Backtest
"""


def test_the_excerpt_keeps_the_path_and_abridges_the_rest():
    from verl_exporter.tools.docs import excerpt, kinds_in

    text = excerpt(SAMPLE)
    assert kinds_in(text) == ["nan", "firing", "checkpoint taken"]
    assert text.splitlines()[2:4] == ["  …", "  36.2s  step 238  Prometheus   firing: VerlNonFiniteGradNorm critical"]
    assert "<demo folder>/checkpoints" in text and "ab12cd34" not in text
    assert text.endswith("  …\nThe path: NaN logged 35.6s (step 235) → VerlNonFiniteGradNorm firing 36.2s →\n"
                         "  robot message 36.2s.\n")


@given(st.text())
def test_any_output_gives_an_excerpt(text):
    from verl_exporter.tools.docs import excerpt

    assert isinstance(excerpt(text), str) and isinstance(excerpt(text, "demo_hang"), str)
