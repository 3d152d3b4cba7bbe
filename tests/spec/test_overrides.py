"""The overrides file (verl-exporter.yaml): validated with its lines, applied everywhere a knob matters.

One knob must change every place it applies: the rules and their promtool tests, the Alertmanager routes,
the PrometheusRule, the sidecar's step-domain detectors and the in-process breaker. The tuning page's example is
tests/fixtures/overrides/agentic.yaml, checked here to be that file, valid, and schema-valid.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, require_tool
from helpers import scaled
from verl_exporter.cli import main
from verl_exporter.spec import load_spec
from verl_exporter.spec.overrides import (
    OverridesError,
    apply_overrides,
    is_hard_safety,
    knob_table,
    load_effective_spec,
    load_overrides,
    parse_overrides,
)

FIXTURES = REPO / "tests" / "fixtures" / "overrides"
AGENTIC = FIXTURES / "agentic.yaml"


@pytest.fixture(scope="module")
def spec():
    return load_spec()


def effective(spec, doc: dict):
    return apply_overrides(spec, parse_overrides(doc, "test.yaml"))


def alert(spec, name: str):
    return next(a for a in spec.alerts() if a.alert == name)


def write(tmp_path: Path, text: str, name: str = "verl-exporter.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------- the file
def test_the_docs_example_is_the_fixture_and_applies(spec):
    page = (REPO / "docs/tuning-and-calibrate.md").read_text()
    block = re.search(r"```yaml\n(# verl-exporter.yaml for a tool-use agent run.*?)```", page, re.S)
    assert block and block.group(1) == AGENTIC.read_text()
    assert len(block.group(1).strip().splitlines()) <= 11  # the issue asks for about ten lines
    eff = apply_overrides(spec, load_overrides(AGENTIC))
    assert eff.rules.selector == 'job="verl-agent"' and eff.overrides == str(AGENTIC)
    assert eff.rules.routing["training"] == {"critical": "agent-oncall", "warning": "agent-oncall",
                                             "info": "agent-oncall"}
    clip = alert(eff, "VerlResponseClipRatioHigh")
    assert clip.knobs()["clip_ratio"].value == 0.32 and clip.for_ == "15m"
    assert clip.summary == "Over 32% of the latest step's responses hit the maximum response length."
    assert alert(eff, "VerlRewardDrop").k == 6
    assert {s.name: s.min_steps for s in eff.signals()}["score"] == 15
    assert alert(eff, "VerlGradNormSpike").severity == "info"


def test_the_json_schema_accepts_the_example_and_names_alerts_and_knobs(spec, capsys):
    jsonschema = pytest.importorskip("jsonschema")
    assert main(["schema", "overrides"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validator = jsonschema.Draft202012Validator(doc)
    assert not list(validator.iter_errors(yaml.safe_load(AGENTIC.read_text())))
    assert set(doc["properties"]["alerts"]["properties"]) == {a.alert for a in spec.alerts()}
    bad = {"alerts": {"VerlRewardDrops": {}, "VerlResponseClipRatioHigh": {"thresholds": {"clip_ratio": 2}},
                      "VerlRewardDrop": {"thresholds": {"kk": 1}}}, "global": {"bogus": 1}}
    messages = " ".join(e.message for e in validator.iter_errors(bad))
    assert "VerlRewardDrops" in messages and "maximum" in messages and "kk" in messages and "bogus" in messages


def test_every_problem_is_reported_with_its_line(tmp_path, spec):
    path = write(tmp_path, """version: 1
global:
  selector: job=verl
  routing: {training: {critical: pager, warnin: x}}
  bogus: 1
alerts:
  VerlRewardDrop: {thresholds: {k: "6"}, min_steps: 5, sevrity: info}
  VerlKLDrift: {for: 10}
  VerlGPULost: {labels: {severity: info}}
""")
    with pytest.raises(OverridesError) as e:
        load_overrides(path)
    text = str(e.value)
    for line, fragment in ((3, "global.selector: must be comma-separated label matchers"),
                           (4, "global.routing.training.warnin"), (5, "global.bogus: unknown key"),
                           (7, "alerts.VerlRewardDrop.thresholds.k: Input should be a valid number"),
                           (7, "alerts.VerlRewardDrop.min_steps: Input should be greater than or equal to 10"),
                           (7, "alerts.VerlRewardDrop.sevrity: unknown key"),
                           (8, "alerts.VerlKLDrift.for: must be a Prometheus duration like 10m"),
                           (9, "alerts.VerlGPULost.labels: severity is not a label to set here")):
        assert f"{path}:{line}: {fragment}" in text, (fragment, text)


def test_unknown_alerts_knobs_and_teams_are_errors_against_the_spec(tmp_path, spec):
    path = write(tmp_path, """version: 1
global:
  routing: {trainng: x}
alerts:
  VerlRewardDrops: {}
  VerlResponseClipRatioHigh: {thresholds: {cliprat: 0.3}}
  VerlEmptyResponses: {thresholds: {aborted: 1.5}}
  VerlNonFiniteLoss: {thresholds: {threshold: 1}}
  VerlRewardDrop: {min_steps: 20}
  VerlRewardCollapse: {min_steps: 15}
  VerlGPULost: {min_steps: 12}
  VerlMFUDrop: {min_steps: 40}
""")
    with pytest.raises(OverridesError) as e:
        apply_overrides(spec, load_overrides(path))
    problems = e.value.problems
    assert problems == sorted(problems, key=lambda p: int(p.split(":")[1]))  # in file order
    text = "\n".join(problems)
    assert f"{path}:3: global.routing.trainng: no alert has team 'trainng'" in text and "did you mean training" in text
    assert f"{path}:5: alerts.VerlRewardDrops: no such alert in the spec (did you mean VerlRewardDrop?)" in text
    assert "VerlResponseClipRatioHigh has no knob 'cliprat' (its knobs: clip_ratio)" in text
    assert "alerts.VerlEmptyResponses.thresholds.aborted: 1.5 is outside the knob's range [0.0, 1.0]" in text
    assert "VerlNonFiniteLoss has no knob 'threshold' (it has none; for, severity, enabled and labels still" in text
    assert "signal 'score' is also read by VerlRewardDrop, which sets min_steps 20" in text
    assert "VerlGPULost reads no step-domain signal" in text
    assert "40 exceeds the 30-step window of signal 'mfu'" in text


def test_yaml_1_2_floats_are_numbers(tmp_path, spec):
    path = write(tmp_path, "alerts:\n  VerlMemoryLeak: {thresholds: {growth_per_hour: 3e9}}\n")
    eff = apply_overrides(spec, load_overrides(path))
    assert alert(eff, "VerlMemoryLeak").knobs()["growth_per_hour"].value == 3e9


def test_an_empty_file_changes_nothing(tmp_path, spec):
    eff = apply_overrides(spec, load_overrides(write(tmp_path, "")))
    assert eff.alerts() == spec.alerts() and eff.rules.selector == spec.rules.selector


# ---------------------------------------------------------------------------------------------- every place
def test_a_knob_reaches_rules_texts_and_tests(spec):
    from verl_exporter.render.rule_tests import case_for
    from verl_exporter.render.rules import alert_rule

    eff = effective(spec, {"alerts": {"VerlHighKLDivergence": {"thresholds": {"kl_penalty": 1.5}},
                                      "VerlRewardDrop": {"thresholds": {"k": 6}},
                                      "VerlPPOClipFractionHigh": {"thresholds": {"threshold": 0.45}}}})
    kl = alert(eff, "VerlHighKLDivergence")
    rule = alert_rule(eff, kl)
    assert 'verl_detector_held_min{signal="kl_penalty", job="verl"} > 1.5' in rule["expr"]
    assert "in-reward KL above 1.5" in rule["annotations"]["summary"]
    case = case_for(eff, kl)
    assert case["input_series"][0]["values"] == "1.05x59 2.25x60"
    assert "sustained_drop_zscore" in alert_rule(eff, alert(eff, "VerlRewardDrop"))["expr"]
    assert "> 6" in alert_rule(eff, alert(eff, "VerlRewardDrop"))["expr"]
    clip = alert(eff, "VerlPPOClipFractionHigh")
    assert alert_rule(eff, clip)["expr"].endswith("> 0.45") and clip.summary == "Over 45% of tokens hit the PPO clip."


def test_disabling_alerts_removes_them_and_their_inhibit_rules(spec):
    from verl_exporter.render.alertmanager import inhibit_rules

    eff = effective(spec, {"alerts": {"VerlHighKLDivergence": {"enabled": False},
                                      "VerlDataLoadingBottleneck": {"enabled": False},
                                      "VerlRewardDrop": {"enabled": False}}})
    names = {a.alert for a in eff.alerts()}
    assert not names & {"VerlHighKLDivergence", "VerlDataLoadingBottleneck", "VerlRewardDrop"}
    rules = inhibit_rules(eff)
    sources = {r["source"][0] for r in rules}
    assert 'alertname="VerlKLDivergenceVeryHigh"' not in sources  # its only target is gone
    assert 'alertname="VerlDataLoadingBottleneck"' not in sources
    collapse = next(r for r in rules if r["source"] == ['alertname="VerlRewardCollapse"'])
    assert collapse["target"] == ['alertname=~"VerlAnswersCollapsed|VerlRewardDecline"']


def test_the_sidecar_detectors_and_the_breaker_read_the_same_knobs(tmp_path, spec):
    from verl_exporter.core.detect import Detectors
    from verl_exporter.sidecar.config import build_config
    from verl_exporter.sidecar.sidecar import Sidecar
    from verl_exporter.trainer.breaker import CircuitBreaker

    path = write(tmp_path, """alerts:
  VerlRewardCollapse: {thresholds: {k: 7}, min_steps: 20}
  VerlPPOClipFractionHigh: {severity: critical, thresholds: {threshold: 0.4}}
  VerlNonFiniteLoss: {enabled: false}
""")
    eff = apply_overrides(spec, load_overrides(path))
    # the breaker: k of the detector rule, a new critical threshold rule, no rule for a disabled alert
    breaker = CircuitBreaker.from_spec(eff)
    judged = {a.alert: a for a in breaker.alerts}
    assert judged["VerlRewardCollapse"].k == 7
    assert judged["VerlPPOClipFractionHigh"].knob_values()["threshold"] == 0.4
    assert "VerlNonFiniteLoss" not in judged
    # the new critical condition trips it on the key that feeds the metric, once over the line for 3 steps
    # (held in steps: the breaker's clock plays no part)
    trips = [breaker.observe(step, {"actor/pg_clipfrac": 0.5}, now=1.0 * step)[1] for step in range(1, 5)]
    assert trips[:2] == [None, None] and trips[2].alert == "VerlPPOClipFractionHigh" and trips[3] is None
    assert breaker.detectors.by_name["score"].spec.min_steps == 20
    # the sidecar's step-domain detectors: the score signal judges no step before 20 came before it
    detectors = Detectors.from_spec(eff)
    for step in range(1, 21):
        detectors.observe(step, {"critic/score/mean": 0.1 * (step % 3), "timing_s/step": 60.0})
    assert "zscore" not in detectors.by_name["score"].stats
    detectors.observe(21, {"critic/score/mean": 0.1, "timing_s/step": 60.0})
    assert "zscore" in detectors.by_name["score"].stats
    # the serve config (and --overrides) hands the file to the sidecar
    from verl_exporter.sidecar.collectors import REGISTRY

    flags = {"listen": "127.0.0.1:0", "collectors": {name: False for name in REGISTRY}}
    sidecar = Sidecar(build_config({"overrides": str(path)}, flags))
    try:
        assert sidecar.spec.overrides == str(path)
        assert sidecar.store.detectors.by_name["score"].spec.min_steps == 20
    finally:
        sidecar.stop()


def test_the_monitor_breaker_takes_the_overrides(tmp_path):
    from verl_exporter.trainer.monitor import Monitor

    path = write(tmp_path, "alerts:\n  VerlRewardCollapse: {thresholds: {k: 8}}\n")
    m = Monitor(sidecar_file=str(tmp_path / "m.jsonl"), breaker=True, overrides=str(path))
    try:
        assert [a.k for a in m.breaker.alerts if a.alert == "VerlRewardCollapse"] == [8]
    finally:
        m.close()


def test_the_file_is_found_by_flag_environment_or_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_EXPORTER_OVERRIDES", raising=False)
    assert load_effective_spec().overrides == ""
    write(tmp_path, "alerts:\n  VerlRewardDrop: {thresholds: {k: 6}}\n")
    assert load_effective_spec().overrides == "verl-exporter.yaml"
    assert load_effective_spec(overrides="").overrides == ""  # '' turns the lookup off
    other = write(tmp_path, "alerts:\n  VerlRewardDrop: {thresholds: {k: 7}}\n", "other.yaml")
    monkeypatch.setenv("VERL_EXPORTER_OVERRIDES", str(other))
    assert alert(load_effective_spec(), "VerlRewardDrop").k == 7
    assert alert(load_effective_spec(overrides="verl-exporter.yaml"), "VerlRewardDrop").k == 6


def test_hard_safety_alerts(spec):
    hard = {a.alert for a in spec.alerts() if is_hard_safety(spec, a)}
    assert {"VerlNonFiniteLoss", "VerlNonFiniteGradNorm", "VerlTrainingStalled", "VerlTrainingStalledRelative",
            "VerlGPULost", "VerlGPUUncorrectableECC", "VerlGPUXidCritical", "VerlNVLinkDown"} <= hard
    assert not hard & {"VerlRewardDrop", "VerlResponseClipRatioHigh", "VerlHighKLDivergence", "VerlMemoryLeak"}


# ---------------------------------------------------------------------------------------------- commands
def test_spec_shows_each_knob_its_value_and_where_it_came_from(capsys):
    assert main(["spec", "--overrides", str(AGENTIC), "--changed"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "job=\"verl-agent\"" in rows["global.selector"] and f"{AGENTIC}:4" in rows["global.selector"]
    assert rows["VerlResponseClipRatioHigh.clip_ratio"].split()[1:3] == ["0.32", "0.2"]
    assert f"{AGENTIC}:7" in rows["VerlResponseClipRatioHigh.clip_ratio"]
    assert "VerlRewardCollapse.min_steps[score]" in rows  # min_steps applies to every alert on the signal
    assert "VerlRewardDrop.enabled" not in rows  # --changed
    assert main(["spec", "--knobs", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    nan = next(r for r in table if r["knob"] == "VerlNonFiniteLoss.enabled")
    assert nan["source"] == "spec" and nan["note"] == "hard safety"


def test_knob_table_covers_every_alert(spec):
    rows = knob_table(spec)
    assert {r.knob.split(".")[0] for r in rows} >= {a.alert for a in spec.alerts()}
    assert all(r.source == "spec" and r.default == r.value for r in rows)


def test_bad_overrides_make_every_command_fail_clearly(tmp_path, capsys):
    path = write(tmp_path, "alerts:\n  VerlNope: {}\n")
    for argv in (["spec", "--overrides", str(path)], ["generate", "--overrides", str(path), "--out", str(tmp_path)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert f"{path}:2: alerts.VerlNope: no such alert" in err
    assert main(["backtest", "--overrides", str(path), str(tmp_path / "x.jsonl"), "--html-dir", ""]) == 2
    assert "no such alert" in capsys.readouterr().out


def _shift(duration: str, minutes: int) -> str:
    from verl_exporter.spec.rules import duration_seconds

    return f"{max(0, duration_seconds(duration) // 60 + minutes)}m"


def _scaled(a, factor: float) -> dict[str, float]:
    from verl_exporter.spec.rules import in_range

    return {n: p.value * factor for n, p in a.knobs().items() if p.value and in_range(p, p.value * factor)}


SWEEPS = {
    # every alert's `for` 10 minutes longer and every knob doubled (within its range); `for` cut to zero and
    # every knob halved (promtool needs ~40 s of CPU for the pack's tests: two sweeps, not four)
    "for+10m, knobs x2": lambda a: {"for": _shift(a.for_, 10), "thresholds": _scaled(a, 2)},
    "for 0m, knobs x0.5": lambda a: {"for": "0m", "thresholds": _scaled(a, 0.5)},
}


@pytest.fixture(scope="module")
def promtool_results(tmp_path_factory, spec):
    """promtool's verdict on the tests generated with each fixture file (by `generate --overrides`) and with
    each sweep (with a selector that adds a label), run side by side: the pack's tests take ~45 s each."""
    from concurrent.futures import ThreadPoolExecutor

    from verl_exporter.render.rules import render_rules

    promtool = require_tool("promtool")
    files = {}
    for name in ("agentic.yaml", "routing.yaml"):
        out = tmp_path_factory.mktemp(name.split(".")[0])
        assert main(["generate", "--overrides", str(FIXTURES / name), "--out", str(out)]) == 0
        files[name] = (out, out / "rules" / "tests" / "generated-test.yaml")

    for sweep, change in SWEEPS.items():
        alerts = {}
        for a in spec.alerts():
            entry = {k: v for k, v in change(a).items() if v}
            if entry:
                alerts[a.alert] = entry
        eff = effective(spec, {"global": {"selector": 'job="verl-agent", cluster="c1"'}, "alerts": alerts})
        out = tmp_path_factory.mktemp("sweep")
        (out / "tests").mkdir()
        for rel, text in render_rules(eff).items():
            (out / ("tests" if "/tests/" in rel else "") / Path(rel).name).write_text(text)
        files[sweep] = (out, out / "tests" / "generated-test.yaml")

    def run(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True,
                              timeout=scaled(600))

    # routing.yaml's point is its Alertmanager config (tests/render/test_alertmanager_routing.py): no promtool run
    checked = [name for name in files if name != "routing.yaml"]
    with ThreadPoolExecutor(max_workers=len(checked)) as pool:
        done = dict(zip(checked, pool.map(run, [files[n][1] for n in checked]), strict=True))
    return {name: (out, done.get(name)) for name, (out, _) in files.items()}


@pytest.mark.integration
@pytest.mark.parametrize("overrides", ["agentic.yaml", "routing.yaml"])
def test_generate_with_overrides_writes_every_output_and_its_tests_pass(promtool_results, overrides):
    amtool = require_tool("amtool")
    path = FIXTURES / overrides
    out, proc = promtool_results[overrides]
    assert proc is None or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    eff = apply_overrides(load_spec(), load_overrides(path))
    alerts_file = (out / "rules" / "verl-alerts.yaml").read_text()
    assert eff.rules.selector in alerts_file and 'job="verl"' not in alerts_file
    k8s = yaml.safe_load((out / "rules" / "kubernetes" / "verl-exporter.prometheusrule.yaml").read_text())
    names = {r["alert"] for g in k8s["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert names == {a.alert for a in eff.alerts()}
    assert (out / "dashboards" / "verl-training.json").exists()
    prom = yaml.safe_load((out / "docker" / "prometheus" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["job_name"] == "verl-agent"
    run = subprocess.run([amtool, "check-config", str(out / "alertmanager" / "alertmanager.yml")],
                         capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stderr
    assert main(["generate", "--overrides", str(path), "--out", str(out), "--check"]) == 0


@pytest.mark.integration
@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_generated_tests_follow_every_alerts_for_and_knobs(promtool_results, sweep):
    """The promtool tests `generate --overrides` writes pass whatever `for` and thresholds are set (within a
    `for` that leaves the alert able to fire), with a selector that adds a label."""
    _, proc = promtool_results[sweep]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
