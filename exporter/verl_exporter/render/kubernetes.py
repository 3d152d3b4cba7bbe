"""The Prometheus Operator PrometheusRule carrying the same rule groups as rules/*.yaml."""

from __future__ import annotations

from ..spec import Spec
from .rules import alert_groups, recording_groups
from .templating import render


def render_kubernetes(spec: Spec) -> dict[str, str]:
    groups = recording_groups(spec) + alert_groups(spec)
    return {"rules/kubernetes/verl-exporter.prometheusrule.yaml": render("prometheusrule.yaml.j2", groups=groups)}
