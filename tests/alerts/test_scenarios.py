"""The scenario tests (rules/scenarios/scenarios-test.yaml, written by scripts/make_scenarios.py): up to date,
passed by promtool, covering every alert on the clean runs, and naming only alerts that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, require_tool
from verl_exporter.spec import load_spec
from verl_exporter.tools import nodes

SCRIPT = REPO / "scripts" / "make_scenarios.py"
SCENARIOS = REPO / "rules" / "scenarios" / "scenarios-test.yaml"
SPEC_ALERTS = {a.alert for a in load_spec().alerts()}


def _load_script():
    spec = importlib.util.spec_from_file_location("make_scenarios", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module


ms = _load_script()


@pytest.fixture(scope="module")
def doc() -> dict:
    return yaml.safe_load(SCENARIOS.read_text(encoding="utf-8"))  # PyYAML resolves the aliases


def _clean_cases(doc: dict) -> dict[str, dict]:
    return {t["name"].split(":")[0]: t for t in doc["tests"] if t["name"].startswith("clean ")}


@pytest.mark.integration
def test_committed_file_is_up_to_date():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.integration
def test_promtool_passes_the_scenarios():
    promtool = require_tool("promtool")
    proc = subprocess.run([promtool, "test", "rules", str(SCENARIOS)], capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-20000:]


def test_every_alert_is_checked_silent_on_both_clean_runs(doc):
    cases = _clean_cases(doc)
    assert set(cases) == {case for _, case in ms.CLEAN_CASES}
    for case, test in cases.items():
        checks = test["alert_rule_test"]
        assert all(c["exp_alerts"] == [] for c in checks), case
        assert {c["alertname"] for c in checks} == SPEC_ALERTS, case


def test_known_false_alarms_name_real_alerts_and_leave_checks_out(doc):
    cases = _clean_cases(doc)
    for case, known in ms.KNOWN_CLEAN_FIRING.items():
        checked = {(c["alertname"], ms.duration_seconds(str(c["eval_time"])) // 60)
                   for c in cases[case]["alert_rule_test"]}
        for alert, ((first, last), evidence) in known.items():
            assert alert in SPEC_ALERTS and evidence
            assert not any((alert, m) in checked for m in range(first, last + 1)), (case, alert)


def test_every_failure_names_alerts_that_exist_and_expects_them_to_fire(doc):
    failures = [t for t in doc["tests"] if not t["name"].startswith("clean ")]
    slugs = {t["name"].split(":")[0] for t in failures}
    assert slugs == {sc.slug for sc in ms.scenarios()}
    for test in failures:
        checks = test["alert_rule_test"]
        names = {c["alertname"] for c in checks}
        assert names and names <= SPEC_ALERTS, (test["name"], names - SPEC_ALERTS)
        for name in names:
            mine = [c for c in checks if c["alertname"] == name]
            assert any(c["exp_alerts"] == [] for c in mine), (test["name"], name, "no silent check")
            firing = [c for c in mine if c["exp_alerts"]]
            assert firing, (test["name"], name, "no firing check")
            for c in firing:
                for exp in c["exp_alerts"]:
                    assert exp["exp_labels"]["severity"] and set(exp["exp_annotations"]) == {
                        "summary", "description", "runbook_url"}


def test_a_new_or_a_fixed_false_alarm_is_refused(monkeypatch):
    """The script (run by the up-to-date test above) refuses to write the file when what promtool fires on a
    clean run, minute by minute, is not KNOWN_CLEAN_FIRING: a new false alarm, or a fixed one still listed."""
    case = "clean PPO run"
    monkeypatch.setattr(ms, "KNOWN_CLEAN_FIRING", {case: {}})
    assert ms.known_differences(case, {}) == []
    assert ms.known_differences(case, {"VerlGPULost": (30, 5)}) == ["VerlGPULost fires from 30m, 5 minutes "
                                                                    "(fix the rule)"]
    monkeypatch.setattr(ms, "KNOWN_CLEAN_FIRING", {case: {"VerlGPULost": ((30, 34), "evidence")}})
    assert ms.known_differences(case, {"VerlGPULost": (30, 5)}) == []
    assert ms.known_differences(case, {}) == ["VerlGPULost is listed as firing at 30-34m but fires no more"]
    assert ms.known_differences(case, {"VerlGPULost": (30, 9)})


def test_the_firing_check_waits_for_a_minute_both_range_semantics_agree_on():
    """3.x fires a minute earlier and, a window's edge apart, with another value at 2.x's first minute: the
    check is at the next minute where both expect the same alert; none by the bound, none at all."""
    def alert(value: str) -> list:
        return [({"alertname": "VerlStragglerRank", "rank": "2"}, {"summary": f"rank 2 at {value}"})]

    expected = {"2.x": {11: alert("0.59"), 12: alert("0.60"), 13: alert("0.61")},
                "3.x": {10: alert("0.57"), 11: alert("0.58"), 12: alert("0.60"), 13: alert("0.61")}}
    assert ms.agreed_minute(expected, until=20) == 12
    assert ms.agreed_minute(expected, until=11) is None
    expected["3.x"][12] = alert("0.59")
    assert ms.agreed_minute(expected, until=20) == 13
    assert ms.agreed_minute({"2.x": {11: alert("0.59")}, "3.x": {10: alert("0.57"), 12: alert("0.59")}}, 20) is None


def test_series_outside_the_spec_are_refused():
    spec = load_spec()
    run = ms.build_run(ms.PPO, length=20)
    ms.check_names(run, spec)
    labels = next(lab for name, lab in run.series if name == "verl_gpu_up")
    for key, match in ((("verl_no_such_metric", labels), "verl_no_such_metric is not in the spec"),
                       (("verl_gpu_up", labels + (("colour", "red"),)), "verl_gpu_up has labels")):
        bad = dataclasses.replace(run, series={**run.series, key: [1.0] * 20})
        with pytest.raises(SystemExit, match=match):
            ms.check_names(bad, spec)
    with pytest.raises(ValueError, match="verl_gpu_up has labels"):  # the node generator refuses them too
        nodes.Nodes(run.samples, "r", 20, spec, "1").key("verl_gpu_up", "0", gpu="0", colour="red")
