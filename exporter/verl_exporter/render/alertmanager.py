"""Alertmanager configuration: routes by team and severity, grouping, inhibit rules, relay receivers.

Valid for Alertmanager 0.25 (Debian bookworm's): matchers lists, source_matchers/target_matchers, no
route labels, no inhibit-rule names. Every receiver is a webhook to the relay (verl-exporter relay) at the spec's
``rules.relay_url`` (``generate --relay-url`` overrides it), which delivers to DingTalk / WeCom robots; the
receiver's name is the last part of the URL path: ``<team>-<severity>`` unless an overrides file's
``global.routing`` names another for the team (or for one of its severities).

Each webhook carries at most ``rules.max_alerts`` alerts (``global.max_alerts`` in an overrides file;
Alertmanager 0.23+ counts the rest in the payload's ``truncatedAlerts``): a group of every rank of a
4,096-rank fleet would otherwise be a ~3 MiB body, which the relay refuses (413) on every retry.
"""

from __future__ import annotations

from ..spec import Spec
from ..spec.overrides import DEFAULT_TEAM
from ..spec.rules import SEVERITIES
from .templating import render

# Repeat critical pages hourly, warnings every 4 hours, information once a day.
REPEAT = {"critical": "1h", "warning": "4h", "info": "24h"}


def teams(spec: Spec) -> list[str]:
    return sorted({a.labels["team"] for a in spec.alerts() if "team" in a.labels})


def severities_of(spec: Spec, team: str | None) -> list[str]:
    """The severities the pack's alerts of a team (None: alerts without one) have, in SEVERITIES order.

    Only these get a route: a route no alert can reach is noise for whoever reads the config, and a sign
    that something was renamed without the other side.
    """
    present = {a.severity for a in spec.alerts() if a.labels.get("team") == team}
    return [s for s in SEVERITIES if s in present]


def inhibit_rules(spec: Spec) -> list[dict]:
    """A root-cause alert silences the symptom alerts it explains, on the same run.

    No blanket "critical silences warning of the same alertname": no alert of the pack exists at two
    severities, so such a rule could never fire.
    """
    out = []
    for alert in spec.alerts():
        if alert.inhibits:
            targets = "|".join(sorted(alert.inhibits))
            out.append({"source": [f'alertname="{alert.alert}"'], "target": [f'alertname=~"{targets}"'],
                        "equal": ["job", "run"]})
    return out


def receiver(spec: Spec, team: str | None, severity: str) -> str:
    """The receiver an alert of this team (None: no team label) and severity goes to."""
    team = team or DEFAULT_TEAM
    return spec.rules.routing.get(team, {}).get(severity, f"{team}-{severity}")


def render_alertmanager(spec: Spec) -> dict[str, str]:
    relay_url = spec.rules.relay_url.rstrip("/")
    team_routes = []
    for t in teams(spec):
        severities = severities_of(spec, t)
        receivers = {s: receiver(spec, t, s) for s in severities}
        # the parent's receiver only takes an alert of the team that no child matches (none of the pack's)
        fallback = "warning" if "warning" in severities else severities[0]
        team_routes.append({"team": t, "severities": severities, "receiver": receivers[fallback],
                            "receivers": receivers})
    default_severities = severities_of(spec, None)
    default_receivers = {s: receiver(spec, None, s) for s in default_severities}
    root = receiver(spec, None, "warning")  # takes alerts from outside the pack that no route matches
    receivers = [root] + list(default_receivers.values())
    receivers += [r for t in team_routes for r in t["receivers"].values()]
    receivers = list(dict.fromkeys(receivers))
    return {"alertmanager/alertmanager.yml": render(
        "alertmanager.yml.j2", repeat=REPEAT, root_receiver=root, default_severities=default_severities,
        default_receivers=default_receivers, team_routes=team_routes, receivers=receivers,
        inhibit_rules=inhibit_rules(spec), relay_url=relay_url, max_alerts=int(spec.rules.max_alerts))}
