"""VictoriaMetrics deployment files: vmagent's scrape configs (the same job and discovery as the generated
prometheus.yml, and pod discovery for Kubernetes) and the Kubernetes manifest of vmagent shards,
victoria-metrics and vmalert with the generated rules."""

from __future__ import annotations

from ..spec import Spec
from .promql import equality_matchers
from .rules import ALERTS_FILE, RECORDING_FILE
from .templating import render

VMAGENT_FILE = "docker/victoriametrics/vmagent.yml"
KUBERNETES_FILE = "docker/kubernetes/victoriametrics.yaml"


def render_victoriametrics(spec: Spec) -> dict[str, str]:
    job = equality_matchers(spec.rules.selector).get("job", "verl")
    rule_names = [f.rsplit("/", 1)[1] for f in (RECORDING_FILE, ALERTS_FILE)]
    k8s_scrape = render("vmagent-kubernetes.yml.j2", job=job)
    return {
        VMAGENT_FILE: render("vmagent.yml.j2", job=job),
        KUBERNETES_FILE: render("victoriametrics.k8s.yaml.j2", scrape=k8s_scrape, rule_names=rule_names,
                                evaluation_interval=spec.rules.evaluation_interval),
    }
