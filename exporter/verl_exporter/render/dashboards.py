"""Grafana dashboards from the spec's panel hints.

Each dashboard: a stable uid, schemaVersion 39, one `datasource` template variable that every query uses
(no `__inputs`: file provisioning cannot resolve ${DS_...} inputs, and the import dialog would ask for one
that nothing uses), job / instance / run / rank variables (and gpu on the GPU dashboard), `$__rate_interval`
in every rate(), a unit and a description on every panel: what grafana/dashboard-linter checks. Panels are
laid out in rows, in spec order, on the 24-column grid.
"""

from __future__ import annotations

from ..spec import SCRAPED_FROM, Spec
from ..spec.kinds.promql import vector
from ..spec.panels import Panel
from .promql import fill
from .templating import render

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TITLES = {
    "overview": "verl / Overview",
    "training": "verl / Training",
    "gpu": "verl / GPUs",
    "host": "verl / Host, disk and checkpoints",
    "engines": "verl / Rollout engines",
}
GRAFANA_UNITS = {"seconds": "s", "bytes": "bytes", "ratio": "percentunit", "watts": "watt", "joules": "joule",
                 "celsius": "celsius", "hertz": "hertz", "bytes_per_second": "Bps", "tokens": "short",
                 "tokens_per_second": "short", "": "short"}
# Every dashboard filters by these; the GPU dashboard adds gpu for metrics that have that label.
VARIABLES = ("job", "instance", "run", "rank")
# Every scraped series has a job and an instance, so "All" may require one (the linter's allValue); a run or
# rank label is not on every series.
ALL_VALUES = {"job": ".+", "instance": ".+"}
SOURCE_OF_VARIABLES = "verl_exporter_build_info"
# The rollout engines' series come from the engines' own targets (no rank; their job is the scrape job's), so
# that dashboard's variables are read from those targets.
ENGINES = "engines"
ENGINE_VARIABLES = ("job", "instance", "run")
ENGINE_TARGETS = f'rollout_engine=~"{"|".join(SCRAPED_FROM)}"'  # on up, the targets the scrape config labels


def dashboard_variables(dashboard: str) -> tuple[str, ...]:
    if dashboard == ENGINES:
        return ENGINE_VARIABLES
    return (*VARIABLES, "gpu") if dashboard == "gpu" else VARIABLES


def dashboard_selector(dashboard: str, labels: tuple[str, ...]) -> str:
    parts = [f'{v}=~"${v}"' for v in dashboard_variables(dashboard) if v != "gpu"]
    if dashboard == "gpu" and "gpu" in labels:
        parts.append('gpu=~"$gpu"')
    return ", ".join(parts)


def panel_queries(spec: Spec, panel: Panel) -> list[dict]:
    metric = spec[panel.metric]
    expr = fill(panel.query, metric.name, dashboard_selector(panel.dashboard, metric.labels))
    if panel.rate:
        expr = f"rate({expr}[$__rate_interval])"
    targets = [{"refId": "A", "expr": expr, "legendFormat": panel.legend or "__auto", "datasource": DATASOURCE}]
    if panel.moving_average:
        targets.append({"refId": "B", "expr": f"avg_over_time(({expr})[{panel.moving_average}:])",
                        "legendFormat": f"{panel.legend or '{{rank}}'} ({panel.moving_average} avg)",
                        "datasource": DATASOURCE})
    if panel.type == "table":
        for t in targets:
            t.update({"instant": True, "format": "table"})
    return targets


def panel_json(spec: Spec, panel: Panel, pid: int, x: int, y: int) -> dict:
    metric = spec[panel.metric]
    unit = panel.unit or ("Bps" if panel.rate and metric.unit == "bytes" else GRAFANA_UNITS.get(metric.unit, "short"))
    if panel.rate and metric.unit == "":
        unit = panel.unit or "ops"
    ptype = "timeseries" if panel.type == "bars" else panel.type
    defaults: dict = {"unit": unit}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if ptype == "timeseries":
        defaults["custom"] = {"drawStyle": "bars" if panel.type == "bars" else "line",
                              "fillOpacity": 60 if panel.type == "bars" or panel.stack else 10,
                              "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
                              "showPoints": "never"}
    options: dict = {"tooltip": {"mode": "multi", "sort": "desc"},
                     "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
    if ptype == "heatmap":
        options = {"calculate": False, "rowsFrame": {"layout": "auto"}, "color": {"scheme": "Spectral",
                   "mode": "scheme", "steps": 64}, "yAxis": {"axisPlacement": "left"}, "cellGap": 1,
                   "tooltip": {"mode": "single", "yHistogram": False}, "legend": {"show": True}}
    elif ptype == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    elif ptype == "bargauge":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "orientation": "horizontal", "displayMode": "gradient"}
    elif ptype == "table":
        options = {"showHeader": True}
    return {
        "id": pid, "type": ptype, "title": panel.title, "description": panel.description or metric.help,
        "datasource": DATASOURCE, "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
        "targets": panel_queries(spec, panel),
    }


def alerts_panel(pid: int, y: int) -> dict:
    """Firing alerts of the pack, from Prometheus's own ALERTS series (not a metric of ours). Filtered by job
    only: an alert on a run-wide aggregate carries no instance label."""
    return {
        "id": pid, "type": "table", "title": "Firing alerts", "datasource": DATASOURCE,
        "description": "Alerts of the verl pack that are firing now, with their labels.",
        "gridPos": {"h": 8, "w": 24, "x": 0, "y": y},
        "fieldConfig": {"defaults": {"unit": "none"}, "overrides": []}, "options": {"showHeader": True},
        "targets": [{"refId": "A", "expr": 'ALERTS{alertname=~"Verl.*", alertstate="firing", job=~"$job"}',
                     "instant": True, "format": "table", "legendFormat": "__auto", "datasource": DATASOURCE}],
    }


def layout(spec: Spec, dashboard: str) -> list[dict]:
    """Rows in order of first appearance; panels flow left to right and wrap at 24 columns."""
    panels = [p for p in spec.panels() if p.dashboard == dashboard]
    rows: dict[str, list[Panel]] = {}
    for p in panels:
        rows.setdefault(p.row or "Panels", []).append(p)
    out: list[dict] = []
    pid, y = 1, 0
    if dashboard == "overview":
        out.append(alerts_panel(pid, y))
        pid, y = pid + 1, y + 8
    for row, members in rows.items():
        out.append({"id": pid, "type": "row", "title": row, "collapsed": False, "panels": [],
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        x, row_height = 0, 0
        for p in members:
            if x + p.width > 24:
                x, y = 0, y + row_height
                row_height = 0
            out.append(panel_json(spec, p, pid, x, y))
            pid, x, row_height = pid + 1, x + p.width, max(row_height, p.height)
        y += row_height
    return out


def variables(dashboard: str) -> list[dict]:
    out = [{"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}]
    chain = dashboard_variables(dashboard)
    for i, name in enumerate(chain):
        source, base = ("verl_gpu_info", "") if name == "gpu" else ("up", ENGINE_TARGETS) if dashboard == ENGINES \
            else (SOURCE_OF_VARIABLES, "")
        matchers = ", ".join(f'{v}=~"${v}"' for v in chain[:i])
        query = f"label_values({vector(source, base, matchers)}, {name})"
        out.append({"name": name, "label": "GPU" if name == "gpu" else name.title(), "type": "query",
                    "datasource": DATASOURCE, "definition": query, "query": {"query": query, "refId": f"var-{name}"},
                    "refresh": 2, "includeAll": True, "allValue": ALL_VALUES.get(name, ".*"), "multi": True, "sort": 3,
                    "current": {}, "hide": 0, "options": [], "regex": ""})
    return out


def dashboard_json(spec: Spec, dashboard: str) -> dict:
    return {
        "annotations": {"list": []},
        "description": "Generated by verl-exporter from its metric spec.",
        "editable": True,
        "graphTooltip": 1,
        "links": [{"title": title, "type": "link", "url": f"/d/verl-{name}"} for name, title in TITLES.items()
                  if name != dashboard],
        "panels": layout(spec, dashboard),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["verl", "verl-exporter"],
        "templating": {"list": variables(dashboard)},
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": TITLES[dashboard],
        "uid": f"verl-{dashboard}",
        "version": 1,
    }


def render_dashboards(spec: Spec) -> dict[str, str]:
    return {f"dashboards/verl-{name}.json": render("dashboard.json.j2", dashboard=dashboard_json(spec, name))
            for name in TITLES}
