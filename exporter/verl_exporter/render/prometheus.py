"""A minimal prometheus.yml that scrapes the sidecars (static targets and file_sd) with the generated rules.

It is its own file, not verl's: verl's rollout Prometheus integration rewrites the prometheus.yml it
manages on every node, so our job and discovery file must live elsewhere.
"""

from __future__ import annotations

from ..spec import Spec
from .promql import equality_matchers
from .rules import ALERTS_FILE, RECORDING_FILE
from .templating import render


def render_prometheus(spec: Spec) -> dict[str, str]:
    job = equality_matchers(spec.rules.selector).get("job", "verl")
    rule_files = [f"/etc/prometheus/{RECORDING_FILE}", f"/etc/prometheus/{ALERTS_FILE}"]
    values = {"job": job, "rule_files": rule_files, "evaluation_interval": spec.rules.evaluation_interval}
    return {"docker/prometheus/prometheus.yml": render("prometheus.yml.j2", **values),
            "docker/prometheus/rl-insight.yml": render("rl_insight.yml.j2", **values)}
