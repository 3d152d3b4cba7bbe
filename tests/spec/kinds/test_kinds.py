"""The alert kinds (spec/kinds/): one declaration, two evaluators. Each kind writes the PromQL promtool judges
and the Python the in-process breaker judges; on the promtool test of every alert the breaker can judge, the
Python says the same as the rule: the condition holds where the test expects the alert, with its $value, and
not where the test expects silence (unless the alert is still pending there, within its `for`)."""

from __future__ import annotations

import pytest
from verl_exporter.spec import load_spec
from verl_exporter.spec.kinds import KINDS
from verl_exporter.spec.kinds.promtool import expand_series
from verl_exporter.spec.rules import duration_seconds, fill_test_text

SPEC = load_spec()
SERIES = __import__("re").compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}$')


class SeriesView:
    """A StepView over promtool input series at one minute: a metric's series by its labels, a signal's
    statistic as its verl_detector_<stat> gauge, the last step's time as the step-timestamp gauge."""

    def __init__(self, inputs: list[dict], minute: int):
        self.rows = []
        for s in inputs:
            name, body = SERIES.match(s["series"].strip()).groups()
            labels = dict(__import__("re").findall(r'(\w+)="([^"]*)"', body))
            values = expand_series(s["values"])
            value = values[minute][0] if minute < len(values) else None
            self.rows.append((name, labels, value))
        self.now = minute * 60.0
        self.last_step_at = self.value("verl_training_last_step_timestamp_seconds", {})

    def value(self, metric: str, labels: dict[str, str]) -> float | None:
        return next((v for n, lab, v in self.rows if n == metric and labels.items() <= lab.items()), None)

    def stat(self, signal: str, stat: str) -> float | None:
        return self.value(f"verl_detector_{stat}", {"signal": signal})


JUDGED = [a for a in SPEC.alerts() if a.blind_reason(SPEC) is None and a.kind != "nonfinite"]


@pytest.mark.parametrize("alert", JUDGED, ids=lambda a: a.alert)
def test_the_breakers_judge_says_what_the_rule_says_on_its_promtool_test(alert):
    case = alert.test_case(SPEC)
    for check in case["alert_rule_test"]:
        minute = duration_seconds(check["eval_time"]) // 60
        value = alert.judge(SeriesView(case["input_series"], minute))
        if check["exp_alerts"]:
            assert value is not None, (alert.alert, check["eval_time"])
            if alert.explicit_test and "value" in alert.test:  # the $value the test expects promtool to print
                expected = float(fill_test_text(str(alert.test["value"]), alert.knob_values()))
                assert value == pytest.approx(expected, rel=1e-6), (alert.alert, value, expected)
        elif duration_seconds(alert.for_) == 0:
            assert value is None, (alert.alert, check["eval_time"], value)


def test_every_kind_is_used_by_an_alert_of_the_spec():
    used = {a.kind for a in SPEC.alerts()}
    assert used == set(KINDS), f"kinds no alert uses: {set(KINDS) - used}"


def test_the_judged_kinds_cover_every_critical_training_alert():
    """A critical alert on verl's own values is judged in process; only what a trainer cannot see is not."""
    for a in SPEC.alerts():
        if a.severity == "critical" and a.blind_reason(SPEC) is not None:
            assert a.metric not in SPEC or SPEC[a.metric].collector or SPEC[a.metric].instrumented_by \
                or a.kind == "expr", a.alert
