"""The mixin (rules/mixin/), rendered by a real jsonnet (the jsonnet wheel, in-process): with its default
_config it gives the generated rules and dashboards; with knobs set in _config, what the generator gives with
the same knobs in an overrides file."""

from __future__ import annotations

import json
import random

import pytest
import yaml
from conftest import REPO
from verl_exporter.render.mixin import render_mixin
from verl_exporter.render.rules import ALERTS_FILE, RECORDING_FILE, render_rules
from verl_exporter.spec import load_spec
from verl_exporter.spec.overrides import apply_overrides
from verl_exporter.spec.rules import fmt_knob, in_range

_jsonnet = pytest.importorskip("_jsonnet")
# In-process, but each test evaluates the whole pack in jsonnet: seconds, not a unit test's milliseconds.
pytestmark = pytest.mark.integration

SPEC = load_spec()
MIXIN = REPO / "rules/mixin"


def evaluate(config: dict | None = None, root=MIXIN) -> dict:
    """The mixin's three outputs, with ``config`` merged into _config the way a user writes it."""
    merge = f"{{ _config+:: {to_jsonnet_merge(config)} }}" if config else "{}"
    snippet = (f"local m = (import 'mixin.libsonnet') + {merge};\n"
               "{ alerts: m.prometheusAlerts, rules: m.prometheusRules, dashboards: m.grafanaDashboards }")
    return json.loads(_jsonnet.evaluate_snippet("test", snippet, jpathdir=[str(root)]))


def to_jsonnet_merge(value) -> str:
    """An object as nested `+:` merges (a user sets one knob, the rest keep their defaults)."""
    if not isinstance(value, dict):
        return json.dumps(value)
    return "{ " + ", ".join(f"{json.dumps(k)}+: {to_jsonnet_merge(v)}" if isinstance(v, dict) else
                            f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()) + " }"


def generated(spec) -> tuple[dict, dict]:
    out = render_rules(spec)
    return yaml.safe_load(out[ALERTS_FILE]), yaml.safe_load(out[RECORDING_FILE])


def moved(p, value: float) -> float:
    """Another in-range value for a knob (0 moves off zero: a detector's change gate appears)."""
    for new in (round(value * 1.25, 4), round(value * 0.8, 4), (p.min or 0) + 0.1, 0.1):
        if new != value and in_range(p, new):
            return new
    raise AssertionError(f"no other value for {p}")


def test_default_config_gives_the_generated_rules_and_dashboards():
    out = evaluate()
    assert out["alerts"] == yaml.safe_load((REPO / ALERTS_FILE).read_text())
    assert out["rules"] == yaml.safe_load((REPO / RECORDING_FILE).read_text())
    assert out["dashboards"] == {path.name: json.loads(path.read_text())
                                 for path in sorted((REPO / "dashboards").glob("*.json"))}


def test_every_knob_set_in_config_changes_the_rules_as_the_overrides_file_does(tmp_path):
    """Every threshold of every alert and every code set moved, a few for/severity/labels/enabled and the
    selector set, both ways: the mixin's _config and an overrides file given to the generator."""
    alerts = SPEC.alerts()
    overrides: dict = {"global": {"selector": 'job="verl-agent", cluster=~"a|b"',
                                  "runbook_url": "https://wiki.example/verl"}, "alerts": {}}
    for a in alerts:
        thresholds = {name: moved(p, p.value) for name, p in a.knobs().items()}
        if thresholds:
            overrides["alerts"][a.alert] = {"thresholds": thresholds}
    overrides["alerts"].setdefault(alerts[0].alert, {})["for"] = "7m"
    overrides["alerts"].setdefault(alerts[1].alert, {})["severity"] = "info"
    overrides["alerts"].setdefault(alerts[2].alert, {})["labels"] = {"team": "agent", "extra": "x"}
    overrides["alerts"].setdefault(alerts[3].alert, {})["enabled"] = False
    overrides["codes"] = {name: [c + 1 for c in codes] for name, codes in SPEC.code_values().items()}
    config = {"selector": overrides["global"]["selector"], "runbook_url": overrides["global"]["runbook_url"],
              "alerts": overrides["alerts"], "codes": overrides["codes"]}

    want_alerts, want_rules = generated(apply_overrides(SPEC, overrides))
    out = evaluate(config)
    assert out["alerts"] != yaml.safe_load((REPO / ALERTS_FILE).read_text())
    assert out["alerts"] == want_alerts
    assert out["rules"] == want_rules


def test_a_knob_back_to_zero_drops_what_zero_drops(tmp_path):
    """A detector's change gate exists only for a non-zero change: the mixin of a spec where it is set, with
    0 in _config, gives what the generator gives with 0 in an overrides file."""
    detector = next(a for a in SPEC.alerts() if a.kind == "detector" and a.knob_values()["change"] == 0)
    spec = apply_overrides(SPEC, {"alerts": {detector.alert: {"thresholds": {"change": 0.3}}}})
    for path, text in render_mixin(spec).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text, encoding="utf-8")
    root = tmp_path / "rules/mixin"
    assert evaluate(root=root)["alerts"] == generated(spec)[0]
    back = {detector.alert: {"thresholds": {"change": 0}}}
    assert evaluate({"alerts": back}, root)["alerts"] == generated(apply_overrides(spec, {"alerts": back}))[0]


def test_knobs_print_as_the_rules_renderer_prints_them():
    values = [0.2, 0.05, 1.5, 1800, 1e-6, 1.25e-7, 1.5e13, 123456789012345, -2.5e14, 0.1 + 0.2, 2 / 3,
              123.456789012345, 0.0, 7, -0.35, 1000, 0.001, 99.99999999999]
    rng = random.Random(27)
    values += [round(rng.uniform(1, 10) * 10 ** rng.randint(-8, 14), rng.randint(0, 12)) for _ in range(100)]
    snippet = f"local lib = import 'lib.libsonnet'; [[lib.fmt(x), lib.pct(x), lib.min(x)] for x in " \
              f"{json.dumps(values)}]"
    got = json.loads(_jsonnet.evaluate_snippet("test", snippet, jpathdir=[str(MIXIN)]))
    assert got == [[fmt_knob(v), fmt_knob(round(v * 100, 10)), fmt_knob(round(v / 60, 10))] for v in values]


def test_an_unknown_knob_in_config_is_an_error():
    a = next(a for a in SPEC.alerts() if a.knobs())
    with pytest.raises(RuntimeError, match=f"alerts.{a.alert}.thresholds: its knobs are"):
        evaluate({"alerts": {a.alert: {"thresholds": {"no_such_knob": 1}}}})


def test_an_unknown_alert_in_config_is_an_error():
    with pytest.raises(RuntimeError, match="no such alert in the pack: .*VerlRewardDrops"):
        evaluate({"alerts": {"VerlRewardDrops": {"thresholds": {"k": 6}}}})
