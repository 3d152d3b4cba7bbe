"""Every route of the generated alertmanager.yml is reached by an alert of the pack, and every inhibit rule fires.

The alerts are the ones the generated promtool tests prove the rules raise, with the exact labels they carry
(rules/tests/generated-test.yaml's exp_alerts). Routing is simulated by amtool (`config routes test`), and
inhibition by a real Alertmanager: the source and target alerts are posted to it and its API must report the
target inhibited. A route or inhibit rule that nothing can reach fails here, as does an alert that lands
on another receiver than its team and severity say.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest
import yaml
from conftest import REPO, Proc, am_post_alerts, free_port, ready, require_tool, wait_for

AM_CONFIG = REPO / "alertmanager" / "alertmanager.yml"


def pack_alerts() -> dict[str, dict[str, str]]:
    """{alertname: the labels its promtool test expects it to fire with}."""
    tests = yaml.safe_load((REPO / "rules" / "tests" / "generated-test.yaml").read_text())
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


def routed_receiver(amtool: str, labels: dict[str, str]) -> str:
    args = [f"{k}={v}" for k, v in sorted(labels.items())]
    run = subprocess.run([amtool, "config", "routes", "test", f"--config.file={AM_CONFIG}", *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_pack_has_alert_tests_to_route():
    from verl_exporter.spec import load_spec

    assert set(pack_alerts()) == {a.alert for a in load_spec().alerts()}


@pytest.mark.integration
def test_every_alert_reaches_its_team_and_severity_and_every_route_is_reached():
    amtool = require_tool("amtool")
    config = yaml.safe_load(AM_CONFIG.read_text())
    reached = {}
    for name, labels in pack_alerts().items():
        receiver = routed_receiver(amtool, labels)
        assert receiver == f"{labels.get('team', 'verl')}-{labels['severity']}", name
        reached.setdefault(receiver, name)
    unreached = set(leaf_receivers(config["route"])) - set(reached)
    assert not unreached, f"routes no alert of the pack reaches: {sorted(unreached)}"
    named = {r["name"] for r in config["receivers"]}
    assert named - set(reached) <= {config["route"]["receiver"]}  # only the root's catch-all is extra


def _states(url: str, run: str) -> dict[str, tuple[str, list[str]]]:
    """{alertname: (fingerprint, fingerprints of the alerts that inhibit it)} of one run, as Alertmanager says."""
    with urllib.request.urlopen(f"{url}/api/v2/alerts", timeout=10) as r:
        alerts = json.loads(r.read())
    return {a["labels"]["alertname"]: (a["fingerprint"], a["status"]["inhibitedBy"]) for a in alerts
            if a["labels"].get("run") == run}


@pytest.mark.integration
def test_every_inhibit_rule_fires_in_a_real_alertmanager(tmp_path):
    binary = require_tool("prometheus-alertmanager")
    config = yaml.safe_load(AM_CONFIG.read_text())
    alerts = pack_alerts()
    rules = config["inhibit_rules"]
    assert rules, "the pack has root-cause alerts; expected inhibit rules"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc("alertmanager", [binary, f"--config.file={AM_CONFIG}", f"--storage.path={tmp_path}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="])
    try:
        wait_for(lambda: ready(f"{url}/-/ready", proc), timeout=30)
        never = []
        for rule in rules:
            (source,) = [m.split('"')[1] for m in rule["source_matchers"]]
            targets = rule["target_matchers"][0].split('"')[1].split("|")
            assert source in alerts and all(t in alerts for t in targets), rule
            # each rule on a run of its own: Alertmanager names only the first alert that inhibits a target
            run = f"inhibit-{len(never)}-{source}"
            am_post_alerts(url, [{"labels": {**alerts[name], "run": run}} for name in (source, *targets)])

            def inhibited_by_source(src=source, ts=targets, run=run):
                states = _states(url, run)
                return src in states and all(states[src][0] in states.get(t, ("", []))[1] for t in ts)

            try:
                wait_for(inhibited_by_source, timeout=15)
            except AssertionError:
                never.append(f"{source} -> {targets}: {_states(url, run)}")
                continue
            assert not _states(url, run)[source][1], f"{source} must not be inhibited itself"
        assert not never, "inhibit rules that never fired:\n" + "\n".join(never)
    finally:
        proc.stop()
