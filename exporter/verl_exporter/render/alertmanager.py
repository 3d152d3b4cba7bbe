"""Alertmanager configuration: routes by team and severity, grouping, inhibit rules, relay receivers.

Valid for Alertmanager 0.25 (Debian bookworm's): matchers lists, source_matchers/target_matchers, no
route labels, no inhibit-rule names. Every receiver is a webhook to the relay (verl-exporter relay) at the spec's
``rules.relay_url`` (``generate --relay-url`` overrides it), which delivers to DingTalk / WeCom robots; the
receiver's name is the last part of the URL path.
"""

from __future__ import annotations

from ..spec import Spec
from ..spec.rules import SEVERITIES
from .templating import render

DEFAULT_TEAM = "verl"
# Repeat critical pages hourly, warnings every 4 hours, information once a day.
REPEAT = {"critical": "1h", "warning": "4h", "info": "24h"}


def teams(spec: Spec) -> list[str]:
    return sorted({a.labels["team"] for a in spec.alerts() if "team" in a.labels})


def inhibit_rules(spec: Spec) -> list[dict]:
    """A root-cause alert silences the symptom alerts it explains, on the same run."""
    out = [{"source": ['severity="critical"'], "target": ['severity="warning"'],
            "equal": ["alertname", "job", "run"]}]
    for alert in spec.alerts():
        if alert.inhibits:
            targets = "|".join(sorted(alert.inhibits))
            out.append({"source": [f'alertname="{alert.alert}"'], "target": [f'alertname=~"{targets}"'],
                        "equal": ["job", "run"]})
    return out


def render_alertmanager(spec: Spec) -> dict[str, str]:
    relay_url = spec.rules.relay_url.rstrip("/")
    team_routes = [{"team": t, "receivers": {s: f"{t}-{s}" for s in SEVERITIES}} for t in teams(spec)]
    receivers = [f"{DEFAULT_TEAM}-{s}" for s in SEVERITIES]
    receivers += [r for t in team_routes for r in t["receivers"].values()]
    return {"alertmanager/alertmanager.yml": render(
        "alertmanager.yml.j2", severities=SEVERITIES, repeat=REPEAT, default_team=DEFAULT_TEAM,
        team_routes=team_routes, receivers=receivers, inhibit_rules=inhibit_rules(spec), relay_url=relay_url)}
