"""Every route of the generated alertmanager.yml is reached by an alert of the pack, and every inhibit rule fires.

The alerts are the ones the generated promtool tests prove the rules raise, with the exact labels they carry
(rules/tests/generated-test.yaml's exp_alerts). Routing is simulated by amtool (`config routes test`), and
inhibition by a real Alertmanager: the source and target alerts are posted to it and its API must report the
target inhibited. A route or inhibit rule that nothing can reach fails here, as does an alert that lands
on another receiver than its team and severity say. Each check runs on the committed files and again on a pack
generated with an overrides file (tests/fixtures/overrides/routing.yaml) that reroutes teams, moves alerts to
other teams and severities and disables an inhibit rule's source and another's target.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest
import yaml
from conftest import REPO, Proc, am_post_alerts, free_port, ready, require_tool, wait_for
from helpers import scaled

AM_CONFIG = REPO / "alertmanager" / "alertmanager.yml"
TESTS = REPO / "rules" / "tests" / "generated-test.yaml"
ROUTING_OVERRIDES = REPO / "tests" / "fixtures" / "overrides" / "routing.yaml"


@pytest.fixture(scope="module", params=["committed", "overrides"])
def pack(request, tmp_path_factory):
    """(alertmanager.yml, generated promtool tests, the effective spec): as committed, and as `generate
    --overrides` writes them."""
    from verl_exporter.spec import load_spec
    from verl_exporter.spec.overrides import apply_overrides, load_overrides

    if request.param == "committed":
        return AM_CONFIG, TESTS, load_spec()
    from verl_exporter.cli import main

    out = tmp_path_factory.mktemp("pack")
    assert main(["generate", "--overrides", str(ROUTING_OVERRIDES), "--out", str(out)]) == 0
    return (out / "alertmanager" / "alertmanager.yml", out / "rules" / "tests" / "generated-test.yaml",
            apply_overrides(load_spec(), load_overrides(ROUTING_OVERRIDES)))


def pack_alerts(tests_file=TESTS) -> dict[str, dict[str, str]]:
    """{alertname: the labels its promtool test expects it to fire with}."""
    tests = yaml.safe_load(tests_file.read_text())
    out: dict[str, dict[str, str]] = {}
    for case in tests["tests"]:
        for rule_test in case.get("alert_rule_test", []):
            for expected in rule_test.get("exp_alerts", []):
                out.setdefault(rule_test["alertname"], {"alertname": rule_test["alertname"],
                                                        **{k: str(v) for k, v in expected["exp_labels"].items()}})
    return out


def leaf_receivers(route: dict) -> list[str]:
    children = route.get("routes", [])
    if not children:
        return [route["receiver"]]
    return [r for child in children for r in leaf_receivers(child)]


def routed_receiver(amtool: str, labels: dict[str, str], config=AM_CONFIG) -> str:
    args = [f"{k}={v}" for k, v in sorted(labels.items())]
    run = subprocess.run([amtool, "config", "routes", "test", f"--config.file={config}", *args],
                         capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_pack_has_alert_tests_to_route(pack):
    _, tests, spec = pack
    assert set(pack_alerts(tests)) == {a.alert for a in spec.alerts()}


def test_the_overrides_change_what_the_routing_checks_see(pack):
    _, tests, spec = pack
    alerts = pack_alerts(tests)
    if spec.overrides:  # the fixture reroutes, relabels, changes severities and disables alerts
        assert "VerlGPUPowerCapped" not in alerts and "VerlHighKLDivergence" not in alerts
        assert alerts["VerlGradNormSpike"]["team"] == "research" and alerts["VerlGradNormSpike"]["severity"] == "info"
        assert alerts["VerlMFUDrop"]["severity"] == "critical"


@pytest.mark.integration
def test_every_alert_reaches_its_team_and_severity_and_every_route_is_reached(pack):
    from verl_exporter.render.alertmanager import receiver as expected_receiver

    am_config, tests, spec = pack
    amtool = require_tool("amtool")
    config = yaml.safe_load(am_config.read_text())
    reached = {}
    for name, labels in pack_alerts(tests).items():
        receiver = routed_receiver(amtool, labels, am_config)
        assert receiver == expected_receiver(spec, labels.get("team"), labels["severity"]), name
        if not spec.overrides:
            assert receiver == f"{labels.get('team', 'verl')}-{labels['severity']}", name
        reached.setdefault(receiver, name)
    unreached = set(leaf_receivers(config["route"])) - set(reached)
    assert not unreached, f"routes no alert of the pack reaches: {sorted(unreached)}"
    named = {r["name"] for r in config["receivers"]}
    assert named - set(reached) <= {config["route"]["receiver"]}  # only the root's catch-all is extra


def _states(url: str, run: str) -> dict[str, tuple[str, list[str]]]:
    """{alertname: (fingerprint, fingerprints of the alerts that inhibit it)} of one run, as Alertmanager says."""
    with urllib.request.urlopen(f"{url}/api/v2/alerts", timeout=scaled(10)) as r:
        alerts = json.loads(r.read())
    return {a["labels"]["alertname"]: (a["fingerprint"], a["status"]["inhibitedBy"]) for a in alerts
            if a["labels"].get("run") == run}


@pytest.mark.integration
def test_every_inhibit_rule_fires_in_a_real_alertmanager(pack, tmp_path):
    am_config, tests, spec = pack
    binary = require_tool("prometheus-alertmanager")
    config = yaml.safe_load(am_config.read_text())
    alerts = pack_alerts(tests)
    rules = config["inhibit_rules"]
    assert rules, "the pack has root-cause alerts; expected inhibit rules"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc("alertmanager", [binary, f"--config.file={am_config}", f"--storage.path={tmp_path}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="])
    try:
        wait_for(lambda: ready(f"{url}/-/ready", proc), timeout=30)
        never = []
        for i, rule in enumerate(rules):
            (source,) = [m.split('"')[1] for m in rule["source_matchers"]]
            targets = rule["target_matchers"][0].split('"')[1].split("|")
            assert source in alerts and all(t in alerts for t in targets), rule
            for target in targets:
                # each pair on a run of its own: Alertmanager names only the first alert that inhibits a target,
                # and a target may have several sources (VerlAnswersCollapsed: two collapse pages)
                run = f"inhibit-{i}-{source}-{target}"
                am_post_alerts(url, [{"labels": {**alerts[name], "run": run}} for name in (source, target)])

                def inhibited_by_source(src=source, t=target, run=run):
                    states = _states(url, run)
                    return src in states and states[src][0] in states.get(t, ("", []))[1]

                try:
                    wait_for(inhibited_by_source, timeout=15)
                except AssertionError:
                    never.append(f"{source} -> {target}: {_states(url, run)}")
                    continue
                assert not _states(url, run)[source][1], f"{source} must not be inhibited itself"
        assert not never, "inhibit rules that never fired:\n" + "\n".join(never)
    finally:
        proc.stop()
