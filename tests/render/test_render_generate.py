"""The generated tree: up to date, deterministic, valid for promtool/amtool, and consistent with the spec."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, require_tool
from helpers import scaled
from verl_exporter.render import generate, render_all
from verl_exporter.render.promql import all_recordings
from verl_exporter.render.rule_tests import expand, go_printf
from verl_exporter.spec import SCRAPED_FROM, SpecError, load_spec, parse_spec, spec_document

SPEC = load_spec()
METRIC_RE = re.compile(r"\b((?:[a-z_]+:)?verl_[a-z0-9_]+(?::[a-z0-9_]+)?)\b")
PROMETHEUS_OWN = {"up", "ALERTS", "time"}


@pytest.mark.integration
def test_committed_output_is_up_to_date():
    proc = subprocess.run([sys.executable, "-m", "verl_exporter", "generate", "--check"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_check_names_stale_files_and_generate_repairs_them(tmp_path):
    assert generate(SPEC, tmp_path) != []  # first write: everything is new
    assert generate(SPEC, tmp_path, check=True) == []
    alerts = tmp_path / "rules/verl-alerts.yaml"
    alerts.write_text(alerts.read_text().replace("> 0.2", "> 0.3"))
    (tmp_path / "dashboards/verl-gpu.json").unlink()
    knobs = tmp_path / "docs/reference/knobs.md"  # a reference page edited by hand is stale too
    knobs.write_text(knobs.read_text().replace("| <code>0.2</code> |", "| <code>0.25</code> |", 1))
    assert sorted(generate(SPEC, tmp_path, check=True)) == ["dashboards/verl-gpu.json", "docs/reference/knobs.md",
                                                             "rules/verl-alerts.yaml"]
    generate(SPEC, tmp_path)
    assert generate(SPEC, tmp_path, check=True) == []


def test_rendering_is_deterministic():
    assert render_all(load_spec(), REPO) == render_all(load_spec(), REPO)


@pytest.mark.integration
def test_promtool_checks_and_tests_the_rules():
    promtool = require_tool("promtool")
    rules = sorted(str(p) for p in (REPO / "rules").glob("*.yaml"))
    check = subprocess.run([promtool, "check", "rules", *rules], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = [str(REPO / "rules/tests/generated-test.yaml")]  # the scenarios have their own test
    run = subprocess.run([promtool, "test", "rules", *tests], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_generated_tests_cover_every_alert_firing_and_silent():
    doc = yaml.safe_load((REPO / "rules/tests/generated-test.yaml").read_text())
    seen: dict[str, set] = {}
    for case in doc["tests"]:
        for t in case["alert_rule_test"]:
            seen.setdefault(t["alertname"], set()).add("fires" if t["exp_alerts"] else "silent")
    assert {a.alert for a in SPEC.alerts()} == set(seen)
    assert all(kinds == {"fires", "silent"} for kinds in seen.values()), seen


@pytest.mark.integration
def test_a_broken_threshold_makes_promtool_fail(tmp_path):
    """The generated tests have teeth: rules that disagree with their spec fail them."""
    promtool = require_tool("promtool")
    shutil.copytree(REPO / "rules", tmp_path / "rules")
    alerts = tmp_path / "rules/verl-alerts.yaml"
    text = alerts.read_text()
    broken = text.replace('signal="pg_clip_ratio", job="verl"} > 0.3', 'signal="pg_clip_ratio", job="verl"} > 5')
    assert broken != text
    alerts.write_text(broken)
    run = subprocess.run([promtool, "test", "rules", str(tmp_path / "rules/tests/generated-test.yaml")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "VerlPPOClipFractionHigh" in run.stdout + run.stderr


@pytest.mark.integration
def test_amtool_accepts_the_alertmanager_config():
    amtool = require_tool("amtool")
    run = subprocess.run([amtool, "check-config", str(REPO / "alertmanager/alertmanager.yml")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.integration
def test_promtool_accepts_the_example_prometheus_config(tmp_path):
    promtool = require_tool("promtool")
    text = (REPO / "docker/prometheus/prometheus.yml").read_text().replace("/etc/prometheus/", "")
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copytree(REPO / "rules", tmp_path / "rules")
    run = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_prometheusrule_carries_the_same_groups():
    crd = yaml.safe_load((REPO / "rules/kubernetes/verl-exporter.prometheusrule.yaml").read_text())
    assert crd["apiVersion"] == "monitoring.coreos.com/v1" and crd["kind"] == "PrometheusRule"
    files = [yaml.safe_load((REPO / f"rules/{n}").read_text()) for n in ("verl-recording.yaml", "verl-alerts.yaml")]
    assert crd["spec"]["groups"] == [g for f in files for g in f["groups"]]


# ---------------------------------------------------------------------------- lint of the generated output
def all_rules():
    for name in ("verl-recording.yaml", "verl-alerts.yaml"):
        for group in yaml.safe_load((REPO / "rules" / name).read_text())["groups"]:
            yield from group["rules"]


def test_alert_rules_follow_the_conventions():
    by_name = {a.alert: a for a in SPEC.alerts()}
    for rule in all_rules():
        if "record" in rule:
            level, metric, ops = rule["record"].split(":")
            assert level and ops and metric.startswith(("verl_", *(f"{e}_" for e in SCRAPED_FROM))), rule["record"]
            continue
        name = rule["alert"]
        assert re.fullmatch(r"Verl[A-Z][A-Za-z0-9]+", name)
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
        assert rule["annotations"]["runbook_url"] == f"{SPEC.rules.runbook_url}#{name.lower()}"
        spec_for = by_name[name].for_
        assert rule.get("for", "0m") == spec_for


def used_names(expr: str) -> set[str]:
    return set(METRIC_RE.findall(expr))


def test_every_metric_a_rule_or_panel_uses_is_in_the_spec():
    recorded = {r.record for r in all_recordings(SPEC)}
    exprs = [r["expr"] for r in all_rules()]
    for path in (REPO / "dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            exprs += [t["expr"] for t in panel.get("targets", [])]
    assert exprs
    for expr in exprs:
        for name in used_names(expr):
            assert name in SPEC or name in recorded, f"{name} (in {expr}) is neither in the spec nor recorded"


def test_the_runbook_page_has_a_section_per_alert_where_its_rule_points():
    text = (REPO / "docs/reference/alerts.md").read_text()
    assert SPEC.rules.runbook_url.endswith("/docs/reference/alerts.md")
    for a in SPEC.alerts():
        assert f"\n## {a.alert}\n" in text  # the anchor #<alert in lower case>, on GitHub and the docs site
        assert f"| [`{a.alert}`](#{a.alert.lower()}) | {a.severity} |" in text


def test_runbook_names_on_each_alert_the_alerts_that_silence_or_may_explain_it():
    from verl_exporter.render.docs import render_docs

    text = render_docs(SPEC)["docs/reference/alerts.md"]
    sections = {s.split("\n", 1)[0]: s for s in text.split("\n## ")[1:]}
    for a in SPEC.alerts():
        for target in a.inhibits:
            assert re.search(rf"Silenced on the same run by: [^\n]*\b{a.alert}\b", sections[target]), (a.alert, target)
        for target in a.explains:
            assert re.search(rf"Look first at these on the same run [^\n]*\b{a.alert}\b", sections[target]), \
                (a.alert, target)
    # the hang alerts name the fabric's causes without being silenced by them
    stalled = sections["VerlTrainingStalled"]
    assert "VerlFabricPortDown" in stalled and "Silenced on the same run by" not in stalled


# ---------------------------------------------------------------------------- dashboards
@pytest.mark.parametrize("name", ["overview", "training", "gpu", "host", "engines"])
def test_dashboards_are_importable_as_they_are(name):
    d = json.loads((REPO / f"dashboards/verl-{name}.json").read_text())
    assert d["uid"] == f"verl-{name}" and d["schemaVersion"] >= 39
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    # the engines' series have no rank
    assert {"job", "instance", "run"} | ({"rank"} if name != "engines" else set()) <= set(variables)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            if "rate(" in t["expr"] or "increase(" in t["expr"]:
                assert "[$__rate_interval]" in t["expr"] or re.search(r"\[\d+[mh]\]", t["expr"]), t["expr"]
            if t["expr"].startswith("ALERTS"):
                continue
            assert 'job=~"$job"' in t["expr"], t["expr"]


def test_dashboards_cover_what_the_issue_asks_for():
    titles = {name: {p["title"] for p in json.loads((REPO / f"dashboards/verl-{name}.json").read_text())["panels"]}
              for name in ("overview", "training", "gpu", "host")}
    assert "Firing alerts" in titles["overview"]
    assert {"Reward (score mean) with moving average", "Step time by phase", "Throughput (tokens/s/GPU)",
            "Entropy", "Response length", "Responses clipped at max length"} <= titles["training"]
    assert {"GPU utilisation by rank", "GPU memory used by rank", "Power", "Temperature", "NVLink traffic",
            "XID errors (1h)"} <= titles["gpu"]
    assert {"Disk busy", "Checkpoint age"} <= titles["host"]


# ---------------------------------------------------------------------------- the alert part of the spec
def spec_with_alert(**alert) -> dict:
    doc = spec_document()
    entry = next(m for m in doc["metrics"] if m["name"] == "verl_actor_entropy")
    entry["alerts"] = [{"alert": "VerlX", "kind": "threshold", "severity": "warning", "threshold": 1,
                        "summary": "S.", "description": "D.", **alert}]
    return doc


@pytest.mark.parametrize("change,fragment", [
    ({"alert": "HighThing"}, "start with Verl"),
    ({"kind": "magic"}, "kind: must be one of"),
    ({"severity": "page"}, "severity: must be one of"),
    ({"for": "five minutes"}, "Prometheus duration"),
    ({"threshold": "high"}, "threshold: must be a number"),
    ({"threshold": None}, "threshold: must be a number"),
    ({"description": "{{ $value }} raw"}, "may be used in annotations"),
    ({"inhibits": ["VerlNoSuchAlert"]}, "inhibits unknown alert"),
    ({"explains": ["VerlNoSuchAlert"]}, "explains unknown alert"),
    ({"colour": "red"}, "alerts.0.colour: unknown key"),
    ({"alert": "VerlHighKLDivergence"}, "declared twice"),
])
def test_bad_alerts_are_rejected(change, fragment):
    with pytest.raises(SpecError, match=re.escape(fragment)):
        parse_spec(spec_with_alert(**change))


def test_bad_panels_are_rejected():
    doc = copy.deepcopy(spec_with_alert())
    entry = next(m for m in doc["metrics"] if m["name"] == "verl_actor_entropy")
    entry["panels"] = [{"dashboard": "training", "title": "x", "query": "rate(<metric>[5m])"}]
    with pytest.raises(SpecError) as err:
        parse_spec(doc)
    assert "must use <sel>" in str(err.value) and "$__rate_interval" in str(err.value)


def test_annotation_expansion_matches_go():
    assert go_printf("%.3g", 0.5) == "0.5" and go_printf("%.3g", float("nan")) == "NaN"
    assert go_printf("%.0f", 1860.0) == "1860" and go_printf("%.3g", float("inf")) == "+Inf"
    text = 'v={{ $value | printf "%.2f" }} on {{ $labels.rank }}{{ $labels.missing }}'
    assert expand(text, 1.234, {"rank": "3"}) == "v=1.23 on 3"


@pytest.mark.integration
def test_relay_url_can_be_pointed_elsewhere(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "verl_exporter", "generate", "--out", str(tmp_path),
                           "--relay-url", "http://verl-exporter-relay.monitoring.svc:9095/"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    am = yaml.safe_load((tmp_path / "alertmanager/alertmanager.yml").read_text())
    urls = {h["url"] for r in am["receivers"] for h in r["webhook_configs"]}
    assert urls and all(u.startswith("http://verl-exporter-relay.monitoring.svc:9095/alert/") for u in urls)


NASTY = "it's \"quoted\", C:\\path: {{ not_jinja }}\n* second line #not a comment"


def test_spec_text_reaches_the_yaml_exactly_whatever_it_holds():
    # every value goes through a serialising filter: quotes, a backslash, ': ', '{{', a newline and a
    # leading '*' (a YAML alias) come back as written

    from verl_exporter.render.alertmanager import render_alertmanager
    from verl_exporter.render.rules import ALERTS_FILE, render_rules

    metric = next(m for m in SPEC.metrics if m.alerts)
    alert = metric.alerts[0].model_copy(update={"summary": "*" + NASTY, "description": NASTY,
                                                "labels": {**metric.alerts[0].labels, "team": NASTY}})
    changed = metric.model_copy(update={"alerts": (alert, *metric.alerts[1:])})
    spec = SPEC.model_copy(update={"metrics": tuple(changed if m is metric else m for m in SPEC.metrics)})
    rules = yaml.safe_load(render_rules(spec)[ALERTS_FILE])
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert.alert]
    assert rule["annotations"]["summary"] == "*" + NASTY and rule["annotations"]["description"] == NASTY
    assert rule["labels"]["team"] == NASTY
    am = yaml.safe_load(render_alertmanager(spec)["alertmanager/alertmanager.yml"])
    matchers = [m for r in am["route"]["routes"] for m in r["matchers"]]
    assert "team=" + json.dumps(NASTY) in matchers  # the matcher's value in Alertmanager's escapes


# ---------------------------------------------------------------------------- keep_firing_for
def _write_rules(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def spec_adding_alert(**alert) -> dict:
    """The packaged spec with one more threshold alert, VerlX (entropy above 1), on verl_actor_entropy."""
    doc = spec_document()
    entry = next(m for m in doc["metrics"] if m["name"] == "verl_actor_entropy")
    entry["alerts"].append({"alert": "VerlX", "kind": "threshold", "severity": "warning", "threshold": 1,
                            "summary": "S.", "description": "D.", **alert})
    return doc


def _only_case(tests_yaml: str, alert: str) -> str:
    doc = yaml.safe_load(tests_yaml)
    doc["tests"] = [t for t in doc["tests"] if t["alert_rule_test"][0]["alertname"] == alert]
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.mark.integration
def test_keep_firing_for_reaches_the_rule_and_holds_the_alert_after_its_condition_stops(tmp_path):
    """A spec's keep_firing_for is written into the rule (Prometheus >= 2.42), promtool accepts it, and the
    alert's generated test sees it firing for keep_firing_for after its threshold is no longer crossed; the
    same test fails on the rule without it, so the hold is keep_firing_for's doing."""
    from verl_exporter.render.rules import ALERTS_FILE, TESTS_FILE, render_rules

    promtool = require_tool("promtool")
    held = render_rules(parse_spec(spec_adding_alert(keep_firing_for="10m")))
    (rule,) = [r for g in yaml.safe_load(held[ALERTS_FILE])["groups"] for r in g["rules"] if r.get("alert") == "VerlX"]
    assert rule["keep_firing_for"] == "10m"
    case = _only_case(held[TESTS_FILE], "VerlX")
    (evals,) = [t["alert_rule_test"] for t in yaml.safe_load(case)["tests"]]
    firing = [int(e["eval_time"].removesuffix("m")) for e in evals if e["exp_alerts"]]
    silent = [int(e["eval_time"].removesuffix("m")) for e in evals if not e["exp_alerts"]]
    assert len(firing) == 2 and firing[1] - firing[0] == 10 and max(silent) == firing[1] + 1, evals

    for name, files in (("held", held), ("plain", render_rules(parse_spec(spec_adding_alert())))):
        root = tmp_path / name
        _write_rules(root, {**files, TESTS_FILE: case})
        check = subprocess.run([promtool, "check", "rules", str(root / ALERTS_FILE)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        run = subprocess.run([promtool, "test", "rules", str(root / TESTS_FILE)], capture_output=True, text=True)
        if name == "held":
            assert run.returncode == 0, run.stdout + run.stderr
        else:
            assert run.returncode != 0 and "VerlX" in run.stdout + run.stderr


def test_no_packaged_alert_changes_its_rule_for_keep_firing_for():
    # keep_firing_for is written only where an alert sets it: the packaged rules carry none
    assert not any(a.keep_firing_for for a in SPEC.alerts())
    assert "keep_firing_for" not in (REPO / "rules/verl-alerts.yaml").read_text()


@pytest.mark.integration
def test_vmalert_gets_the_alerts_without_keep_firing_for_which_it_refuses(tmp_path):
    """vmalert 1.79 loads no file with a keep_firing_for rule; a spec that sets one gives vmalert its own copy of
    the alerts without it (the manifest points there), and the packaged spec, which sets none, gives none."""
    from verl_exporter.render.rules import ALERTS_FILE, RECORDING_FILE
    from verl_exporter.render.victoriametrics import KUBERNETES_FILE, VM_ALERTS_FILE, render_victoriametrics

    vmalert = require_tool("vmalert")
    files = render_all(parse_spec(spec_adding_alert(keep_firing_for="10m")), REPO)
    _write_rules(tmp_path, files)

    def dry_run(*rules: str) -> subprocess.CompletedProcess:
        return subprocess.run([vmalert, "-dryRun", *[f"-rule={tmp_path / r}" for r in rules]],
                              capture_output=True, text=True, timeout=scaled(60))

    refused = dry_run(RECORDING_FILE, ALERTS_FILE)
    assert refused.returncode != 0 and "keep_firing_for" in refused.stdout + refused.stderr
    accepted = dry_run(RECORDING_FILE, VM_ALERTS_FILE)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    vm_rules = [r for g in yaml.safe_load(files[VM_ALERTS_FILE])["groups"] for r in g["rules"]]
    assert "VerlX" in {r["alert"] for r in vm_rules} and not any("keep_firing_for" in r for r in vm_rules)
    assert f"--from-file={VM_ALERTS_FILE}" in files[KUBERNETES_FILE]
    assert VM_ALERTS_FILE not in render_victoriametrics(SPEC)
