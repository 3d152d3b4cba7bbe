"""The generated dashboards against grafana/dashboard-linter's rules (its lint/rule_*.go, reimplemented: the
linter is a Go program no registry here ships). Each rule is a function of a dashboard returning its
problems; PromQL is parsed by promtool, as the linter parses it with Prometheus's own parser.

Left out: the rules for other datasources (LogQL) and for the v2 schema. One exclusion, as the linter's
`.lint` file would declare it: the Firing alerts table reads ALERTS, whose alerts on run-wide aggregates
carry no instance label, so it is filtered by job only (target-instance-rule).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest
import yaml
from conftest import REPO, require_tool
from verl_exporter.render.dashboards import TITLES

# dashboard-linter's globalVariables: what a variable reads as when the query is parsed
MAGIC = {"__rate_interval": "8869ms", "__interval": "4867ms", "__interval_ms": "4867", "__range": "6h",
         "__range_s": "21600", "__range_ms": "21600000", "__auto": "10m"}
# Grafana's unit ids for what this pack draws (valueFormats/categories.ts, as the linter enumerates them)
UNITS = {"none", "string", "short", "percent", "percentunit", "bytes", "decbytes", "bits", "Bps", "binBps", "bps",
         "watt", "kwatt", "joule", "celsius", "hertz", "ns", "µs", "ms", "s", "m", "h", "d", "dtdurations",
         "cps", "ops", "reqps", "rps", "wps", "iops", "cpm", "opm", "flops", "tflops", "bool"}
QUERY_PANELS = {"stat", "singlestat", "graph", "table", "timeseries", "gauge"}  # panel-units, title-description
DATASOURCE_PANELS = {"singlestat", "graph", "table", "timeseries"}  # panel-datasource-rule
NO_INSTANCE = {"Firing alerts"}


def dashboards() -> dict[str, dict]:
    return {name: json.loads((REPO / f"dashboards/verl-{name}.json").read_text()) for name in TITLES}


def panels(d: dict):
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its own


def variable(d: dict, name: str) -> dict | None:
    return next((v for v in d["templating"]["list"] if v["name"] == name), None)


def expand(expr: str, d: dict) -> str:
    """The expression as the linter parses it: Grafana's variables replaced by a value of their kind."""
    names = {v["name"] for v in d["templating"]["list"]}

    def value(m: re.Match) -> str:
        name = m[1] or m[2]
        return MAGIC[name] if name in MAGIC else ("value" if name in names else m[0])
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def template_datasource(d):
    ds = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    if not ds:
        return ["no templated data source"]
    if len(ds) == 1:
        ok = ds[0]["name"] == "datasource" and ds[0].get("label") == "Data source"
    else:
        ok = all(v["name"] == f"{v['query']}_datasource" for v in ds)
    return [] if ok else [f"data source variable {[v['name'] for v in ds]} is misnamed"]


def _template(d, name):
    t = variable(d, name)
    if t is None:
        return [f"is missing the {name} template"]
    bad = []
    if t.get("datasource", {}).get("uid") not in ("$datasource", "${datasource}"):
        bad.append(f"{name} template should use datasource '$datasource'")
    if t["type"] != "query":
        bad.append(f"{name} template should be a Prometheus query")
    if t.get("label") != name.title():
        bad.append(f"{name} template should be labeled {name.title()!r}")
    if not t.get("multi"):
        bad.append(f"{name} template should be a multi select")
    if t.get("allValue") != ".+":
        bad.append(f"{name} template allValue should be '.+'")
    return bad


def template_job(d):
    return _template(d, "job")


def template_instance(d):
    return _template(d, "instance")


def template_on_time_change_reload(d):
    return [f"variable {v['name']} does not refresh on time range change" for v in d["templating"]["list"]
            if v["type"] == "query" and v.get("refresh") != 2]


def panel_datasource(d):
    uids = {f"${v['name']}" for v in d["templating"]["list"] if v["type"] == "datasource"}
    uids |= {f"${{{u[1:]}}}" for u in uids}
    return [f"panel {p['title']!r} does not use a templated datasource" for p in panels(d)
            if p["type"] in DATASOURCE_PANELS and (p.get("datasource") or {}).get("uid") not in uids]


def panel_title_description(d):
    return [f"panel {p.get('id')} has no title or description" for p in panels(d)
            if p["type"] in QUERY_PANELS and not (p.get("title") and p.get("description"))]


def panel_units(d):
    return [f"panel {p['title']!r} has no or invalid units: {p['fieldConfig']['defaults'].get('unit')!r}"
            for p in panels(d) if p["type"] in QUERY_PANELS
            and p.get("fieldConfig", {}).get("defaults", {}).get("unit") not in UNITS]


def panel_no_targets(d):
    return [f"panel {p['title']!r} has no targets" for p in panels(d) if p["type"] != "row" and not p.get("targets")]


def targets(d):
    for p in panels(d):
        for t in p.get("targets", []):
            yield p, t


def target_rate_interval(d):
    # a range in rate()/irate() that is not $__rate_interval (other functions may take any range)
    bad = re.compile(r"\b(?:rate|irate)\((?:[^()\[]|\([^()]*\))*\[(?!\$__rate_interval\])[^\]]*\]\)")
    return [f"{t['expr']!r} should use $__rate_interval" for _, t in targets(d) if bad.search(t["expr"])]


# One pass over a query: strings, ranges and grouping label lists are skipped; a name not followed by "(" is a
# selector, with its matchers if it has any (an aggregation may put its by/without before the "(").
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[[^\]]*\]|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)'
                   r'|(?<![\w:.])([a-zA-Z_:][\w:]*)\s*(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?(\s*(?:\(|(?:by|without)\s*\([^)]*\)))?')
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def selectors(expr: str):
    """(metric, matcher text) of every vector selector in the query."""
    for m in TOKEN.finditer(expr):
        if m[1] and not m[3] and m[1] not in KEYWORDS:
            yield m[1], m[2] or ""


def _required_matcher(d, label):
    bad = []
    for p, t in targets(d):
        if label == "instance" and p["title"] in NO_INSTANCE:
            continue
        for metric, matchers in selectors(t["expr"]):
            if f'{label}=~"${label}"' not in matchers:
                bad.append(f"{metric} in {t['expr']!r} has no {label}=~\"${label}\"")
    return bad


def target_job(d):
    return _required_matcher(d, "job")


def target_instance(d):
    return _required_matcher(d, "instance")


def target_counter_agg(d):
    # a *_total series straight under rate, irate or increase
    bad = []
    for _, t in targets(d):
        for m in re.finditer(r"(?<![\w:])([a-zA-Z_:][\w:]*_total)\b", t["expr"]):
            before = t["expr"][:m.start()]
            if not re.search(r"\b(?:rate|irate|increase)\($", before):
                bad.append(f"counter {m[1]} in {t['expr']!r} is not under rate, irate or increase")
    return bad


DASHBOARD_RULES = [template_datasource, template_job, template_instance, template_on_time_change_reload,
                   panel_datasource, panel_title_description, panel_units, panel_no_targets, target_rate_interval,
                   target_job, target_instance, target_counter_agg]


@pytest.mark.parametrize("rule", DASHBOARD_RULES, ids=lambda r: r.__name__.replace("_", "-") + "-rule")
def test_every_dashboard_passes(rule):
    problems = {name: rule(d) for name, d in dashboards().items()}
    assert not any(problems.values()), problems


@pytest.mark.integration
def test_every_query_and_variable_query_is_valid_promql(tmp_path):
    """target-promql-rule and template-label-promql-rule: promtool parses each, variables expanded."""
    exprs = []
    for d in dashboards().values():
        exprs += [expand(t["expr"], d) for _, t in targets(d)]
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                m = re.fullmatch(r"label_values\((.*), (\w+)\)", v["query"]["query"])
                assert m, v["query"]
                exprs.append(expand(m[1], d))
    rules = [{"record": f"lint:expr_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "lint.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "lint", "rules": rules}]}))
    check = subprocess.run([require_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_no_unused_inputs():
    """Nothing references a ${DS_...} input, so the import dialog must not ask for one."""
    for name, d in dashboards().items():
        assert "__inputs" not in d and "${DS_" not in json.dumps(d), name


def _break(d: dict, how: str) -> dict:
    d = copy.deepcopy(d)
    panel = next(p for p in d["panels"] if p["type"] == "timeseries")
    target = panel["targets"][0]
    if how == "template_instance":
        d["templating"]["list"] = [v for v in d["templating"]["list"] if v["name"] != "instance"]
    elif how == "template_job":
        variable(d, "job")["allValue"] = ".*"
    elif how == "template_datasource":
        d["templating"]["list"][0]["name"] = "ds"
    elif how == "panel_units":
        panel["fieldConfig"]["defaults"]["unit"] = "furlongs"
    elif how == "panel_title_description":
        panel["description"] = ""
    elif how == "panel_datasource":
        panel["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}
    elif how == "target_rate_interval":
        target["expr"] = 'rate(verl_x_total{job=~"$job", instance=~"$instance"}[5m])'
    elif how == "target_instance":
        target["expr"] = target["expr"].replace(', instance=~"$instance"', "")
    elif how == "target_counter_agg":
        target["expr"] = 'verl_x_total{job=~"$job", instance=~"$instance"}'
    elif how == "target_job":
        target["expr"] = target["expr"].replace('job=~"$job", ', "")
    elif how == "panel_no_targets":
        panel["targets"] = []
    elif how == "template_on_time_change_reload":
        variable(d, "run")["refresh"] = 1
    return d


@pytest.mark.parametrize("rule", DASHBOARD_RULES, ids=lambda r: r.__name__)
def test_each_rule_catches_what_it_checks(rule):
    d = dashboards()["training"]
    assert rule(d) == [] and rule(_break(d, rule.__name__)) != []


def test_the_selector_scan_finds_every_metric():
    expr = 'sum by (run) (increase(verl_a_total{job=~"$job"}[1h])) / on (job) verl_b or vector(0)'
    assert [m for m, _ in selectors(expr)] == ["verl_a_total", "verl_b"]
    assert list(selectors('ALERTS{alertname=~"Verl.*"} and time() - 1e-9 * x offset 5m')) == [
        ("ALERTS", '{alertname=~"Verl.*"}'), ("x", "")]
