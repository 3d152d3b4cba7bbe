"""VictoriaMetrics deployment files: vmagent's scrape configs (the same job and discovery as the generated
prometheus.yml, and pod discovery for Kubernetes) and the Kubernetes manifest of vmagent shards,
victoria-metrics and vmalert with the generated rules."""

from __future__ import annotations

from ..spec import Spec
from .promql import equality_matchers
from .rules import ALERTS_FILE, RECORDING_FILE, alert_groups
from .templating import render

VMAGENT_FILE = "docker/victoriametrics/vmagent.yml"
KUBERNETES_FILE = "docker/kubernetes/victoriametrics.yaml"
# vmalert 1.79 refuses a rule with keep_firing_for (an unknown field: it loads none of the file), so a spec
# whose alerts set it gets this copy of the alerts without it for vmalert; there those alerts resolve as soon
# as their condition stops. Written only then: the packaged spec sets none, and vmalert reads ALERTS_FILE.
VM_ALERTS_FILE = "rules/vmalert/verl-alerts.yaml"


def render_victoriametrics(spec: Spec) -> dict[str, str]:
    job = equality_matchers(spec.rules.selector).get("job", "verl")
    out: dict[str, str] = {}
    rule_files = [RECORDING_FILE, ALERTS_FILE]
    if any(a.keep_firing_for for a in spec.alerts()):
        out[VM_ALERTS_FILE] = render("rules.yaml.j2", groups=alert_groups(spec, keep_firing=False),
                                     interval=spec.rules.evaluation_interval)
        rule_files = [RECORDING_FILE, VM_ALERTS_FILE]
    rule_names = [f.rsplit("/", 1)[1] for f in rule_files]
    k8s_scrape = render("vmagent-kubernetes.yml.j2", job=job)
    return {
        **out,
        VMAGENT_FILE: render("vmagent.yml.j2", job=job),
        KUBERNETES_FILE: render("victoriametrics.k8s.yaml.j2", scrape=k8s_scrape, rule_names=rule_names,
                                rule_files=rule_files, evaluation_interval=spec.rules.evaluation_interval),
    }
