"""`verl-exporter generate`: render rules, promtool tests, dashboards, Alertmanager and Kubernetes files,
the monitoring mixin and the documentation's reference pages (metrics, alerts with their runbook, knobs, kinds)
from the spec. Deterministic: same spec, same bytes.

May import: spec/ only. No runtime module (sidecar/, trainer/, relay/) imports render/.
"""

from __future__ import annotations

from pathlib import Path

from ..spec import Spec
from .alertmanager import render_alertmanager
from .dashboards import render_dashboards
from .docs import render_docs
from .kubernetes import render_kubernetes
from .mixin import render_mixin
from .prometheus import render_prometheus
from .rules import render_rules
from .victoriametrics import render_victoriametrics

RENDERERS = (render_rules, render_dashboards, render_alertmanager, render_kubernetes, render_prometheus,
             render_victoriametrics, render_docs, render_mixin)


def render_all(spec: Spec, root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """{path relative to the repo root: content} for every generated file (and the extra ones given: the
    schemas, which come from models outside the generator)."""
    out: dict[str, str] = dict(extra or {})
    for renderer in RENDERERS:
        out.update(renderer(spec))
    return dict(sorted(out.items()))


def generate(spec: Spec, root: Path, check: bool = False, extra: dict[str, str] | None = None) -> list[str]:
    """Write the files (or, with check, compare only). Returns the paths that differed."""
    stale = []
    for rel, content in render_all(spec, root, extra).items():
        path = root / rel
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == content:
            continue
        stale.append(rel)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
    return stale
