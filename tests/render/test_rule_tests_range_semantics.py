"""The rule tests under Prometheus 3.x range semantics as well as 2.x's.

3.x selects (t-d, t] where 2.x selects [t-d, t]; promtool's samples and evaluations fall on whole minutes, so
the sample at the range's start is exactly the one that differs. No promtool 3.x comes from a registry this
project installs from (Debian ships 2.x), so 3.x is emulated: every range in the rules 1 s shorter
(``left_open``). The 2.x runs are tests/render/test_render_generate.py's and tests/alerts/test_scenarios.py's.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, require_tool
from helpers import scaled
from verl_exporter.render.rule_tests import left_open

pytestmark = pytest.mark.integration  # starts servers or programs

RULE_FILES = ("verl-recording.yaml", "verl-alerts.yaml")


def left_open_rules(root: Path) -> Path:
    """A copy of rules/ whose rule files select ranges as 3.x does; the test files beside them unchanged."""
    shutil.copytree(REPO / "rules", root / "rules")
    for name in RULE_FILES:
        path = root / "rules" / name
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                rule["expr"] = left_open(rule["expr"])
        path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return root / "rules"


def promtool_test(test_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), "test", "rules", str(test_file)], capture_output=True,
                          text=True, timeout=scaled(600))


@pytest.mark.parametrize("expr,expected", [
    ("rate(x[5m])", "rate(x[4m59s])"),
    ("avg_over_time(x{a=\"[1m]\"}[1h]) > 1", "avg_over_time(x{a=\"[1m]\"}[59m59s]) > 1"),
    ("max_over_time(x[1d]) - x offset 5m", "max_over_time(x[23h59m59s]) - x offset 5m"),
    ("max_over_time(rate(x[5m])[1h30m:1m])", "max_over_time(rate(x[4m59s])[1h29m59s:1m])"),
    ("rate(x[$__rate_interval])", "rate(x[$__rate_interval])"),
])
def test_left_open_shortens_every_range_by_a_second(expr, expected):
    assert left_open(expr) == expected


def test_the_emulation_drops_the_sample_at_the_range_start(tmp_path):
    """Teeth: a value that holds the start sample under 2.x loses it under the emulation."""
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x:avg", "expr": "avg_over_time(x[2m])"}]}]}))
    (tmp_path / "l.yaml").write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x:avg", "expr": left_open("avg_over_time(x[2m])")}]}]}))

    def case(rules: str, value: float) -> Path:
        path = tmp_path / f"{rules}-{value}.yaml"
        path.write_text(yaml.safe_dump({"rule_files": [rules], "evaluation_interval": "1m", "tests": [{
            "interval": "1m", "input_series": [{"series": "x", "values": "1 2 3"}],
            "promql_expr_test": [{"expr": "x:avg", "eval_time": "2m",
                                  "exp_samples": [{"labels": "x:avg", "value": value}]}]}]}))
        return path

    assert promtool_test(case("r.yaml", 2)).returncode == 0  # 2.x: the samples at 0, 1m and 2m
    assert promtool_test(case("l.yaml", 2.5)).returncode == 0  # 3.x: at 1m and 2m only
    assert promtool_test(case("l.yaml", 2)).returncode != 0


@pytest.mark.parametrize("test_file", ["tests/generated-test.yaml", "scenarios/scenarios-test.yaml"])
def test_the_rule_tests_pass_with_left_open_ranges(tmp_path, test_file):
    run = promtool_test(left_open_rules(tmp_path) / test_file)
    assert run.returncode == 0, (run.stdout + run.stderr)[-20000:]
