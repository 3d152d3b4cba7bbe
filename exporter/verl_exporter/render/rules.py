"""Prometheus rule files (recording and alerting) and their promtool tests, from the spec."""

from __future__ import annotations

from ..spec import Spec
from ..spec.kinds import Alert
from .promql import WINDOW_GROUP, alert_expr, all_recordings
from .rule_tests import all_cases
from .templating import render

RECORDING_FILE = "rules/verl-recording.yaml"
ALERTS_FILE = "rules/verl-alerts.yaml"
TESTS_FILE = "rules/tests/generated-test.yaml"
# Alert groups by the layer of the metric they watch (cross-metric alerts have their own group).
GROUP_OF_LAYER = {"data": "training", "compute": "training", "resource": "resources", "fault": "faults",
                  "exporter": "exporter"}
# A collector whose alerts read one series per link or GPU of the whole fleet gets its own group: a group's
# rules run one after the other, groups run side by side, and each group must finish within its interval.
GROUP_OF_COLLECTOR = {"nvlink": "nvlink"}
WINDOW_INTERVAL = "1m"


def runbook_url(spec: Spec, alert: Alert) -> str:
    return spec.rules.runbook_link(alert.alert)


def alert_rule(spec: Spec, alert: Alert, keep_firing: bool = True) -> dict:
    """One alerting rule. ``keep_firing``: write the alert's keep_firing_for (Prometheus >= 2.42; vmalert
    1.79 refuses the key, see victoriametrics.py)."""
    rule = {
        "alert": alert.alert,
        "expr": alert_expr(alert, spec.rules.selector),
        "for": alert.for_,
        "labels": {**alert.labels, "severity": alert.severity},
        "annotations": {"summary": alert.summary, "description": alert.description,
                        "runbook_url": runbook_url(spec, alert)},
    }
    if keep_firing and alert.keep_firing_for:
        rule["keep_firing_for"] = alert.keep_firing_for
    return rule


def alert_groups(spec: Spec, keep_firing: bool = True) -> list[dict]:
    groups: dict[str, list[dict]] = {}
    for alert in spec.alerts():
        if alert.metric in spec:
            metric = spec[alert.metric]
            group = GROUP_OF_COLLECTOR.get(metric.collector) or GROUP_OF_LAYER.get(metric.layer, "cross-layer")
        else:
            group = "cross-layer"
        name = "verl-exporter." + group
        groups.setdefault(name, []).append(alert_rule(spec, alert, keep_firing))
    return [{"name": name, "rules": rules} for name, rules in groups.items()]


def recording_groups(spec: Spec) -> list[dict]:
    groups: dict[str, dict] = {}
    for r in all_recordings(spec):
        group = groups.setdefault(r.group, {"name": f"verl-exporter.{r.group}", "rules": []})
        if r.group == WINDOW_GROUP:
            group["interval"] = WINDOW_INTERVAL
        group["rules"].append({"record": r.record, "expr": r.expr})
    return list(groups.values())


def render_rules(spec: Spec) -> dict[str, str]:
    interval = spec.rules.evaluation_interval
    out = {
        RECORDING_FILE: render("rules.yaml.j2", groups=recording_groups(spec), interval=interval),
        ALERTS_FILE: render("rules.yaml.j2", groups=alert_groups(spec), interval=interval),
    }
    # Tests evaluate every minute whatever the production interval is: their timings are in minutes.
    out[TESTS_FILE] = render("rule_tests.yaml.j2", rule_files=["../verl-recording.yaml", "../verl-alerts.yaml"],
                             interval="1m", tests=all_cases(spec))
    return out
