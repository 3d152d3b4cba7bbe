"""`verl-exporter demo --hang`: the demo's trainer, a process of its own, hangs in its reward function; the
sidecar's stall trigger captures its stacks with the real py-spy, and the relay's forensics action pages the
verdict through the real Prometheus and Alertmanager."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import REPO, require_tool
from helpers import demo_rate, run_demo, scaled, unwrap
from verl_exporter.spec import load_spec
from verl_exporter.tools import demo_stack
from verl_exporter.tools.docs import excerpt, in_page, kinds_in, message_of, with_excerpt


class View:
    """A StepView (spec/kinds/base.py): age seconds since the last step, the step-time statistic pace."""

    def __init__(self, age: float, pace: float | None):
        self.now, self.last_step_at, self.pace = age, 0.0, pace

    def value(self, metric, labels):
        return None

    def stat(self, signal, stat):
        return self.pace


def test_compressed_stall_limits_are_the_same_condition_on_the_demos_clock():
    spec = load_spec()
    stalls = {a.alert: a for a in spec.alerts() if a.judged_between_steps}
    compressed = {a.alert: a for a in demo_stack.compress_stalls(spec, 100.0).alerts() if a.judged_between_steps}
    assert set(stalls) == set(compressed) >= {"VerlTrainingStalled", "VerlTrainingStalledRelative"}
    for name, alert in stalls.items():
        for pace in (None, 30.0, 600.0):  # before the baseline, the floor, the run's own pace
            limit = next((age for age in range(1, 100_000) if alert.judge(View(age, pace)) is not None), None)
            if limit is None:  # no limit before a baseline (before_baseline unset): none on the demo's clock
                assert compressed[name].judge(View(1e9, pace)) is None
                continue
            # the run's step times stay as logged; only the time since the last step runs 100x faster
            assert compressed[name].judge(View((limit - 1) / 100, pace)) is None, (name, pace)
            assert compressed[name].judge(View(limit / 100, pace)) is not None, (name, pace)


@pytest.mark.parametrize("factor", [286.0, 1e5])
def test_compressed_stall_limits_still_render(factor):
    """Compressed limits lie off the knobs' ranges for users (a factor under 1, floors under a second): the
    rules the demo's Prometheus runs still render, with the stall's test moved to them."""
    from verl_exporter.render.rules import render_rules

    rules = render_rules(demo_stack.compress_stalls(load_spec(), factor))
    assert f"clamp_min({4 / factor!r} * verl_detector_window_max" in rules["rules/verl-alerts.yaml"]


def test_without_py_spy_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(demo_stack, "find_py_spy", lambda: None)
    said: list[str] = []
    assert demo_stack.run(hang=True, exit_after_replay=True, out=said.append) == 2
    assert said == ["verl-exporter demo --hang: py-spy not found; the stacks of the hung trainer are captured with "
                    "it: pip install 'verl-exporter[forensics]'"]


def test_the_hang_needs_the_whole_path(monkeypatch):
    monkeypatch.setattr(demo_stack, "find_py_spy", lambda: "py-spy")
    said: list[str] = []
    assert demo_stack.run(hang=True, sidecar_only=True, out=said.append) == 2
    assert said == ["verl-exporter demo: --hang shows the page of the whole alert path; it cannot be --sidecar-only"]
    said.clear()
    monkeypatch.setattr(demo_stack, "find_programs", lambda prometheus, alertmanager: (None, "alertmanager"))
    assert demo_stack.run(hang=True, out=said.append) == 2
    assert said == [f"verl-exporter demo --hang: Prometheus not found; the hang page comes through them: "
                    f"{demo_stack.INSTALL_HINT}"]


@pytest.mark.integration
def test_the_hang_page_carries_the_verdict_on_the_trainers_real_stacks():
    require_tool("prometheus")
    require_tool("prometheus-alertmanager")
    if demo_stack.find_py_spy() is None:
        pytest.skip("py-spy is not installed (pip install 'verl-exporter[forensics]')")
    proc, took = run_demo("--hang", "--exit-after-replay", "--rate", f"{demo_rate():g}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = unwrap(proc.stdout)
    hung = text.index(f"trainer      step {demo_stack.HANG_AT}: the reward function compute_score waits")
    captured = re.search(r"sidecar +forensics: stacks of 1 process\(es\) in (\S+/capture-\S+\.json): rank 0 is in "
                         r"hang_trainer → compute_score \(verl_exporter/tools/demo\.py\)", text)
    assert captured and hung < captured.start()
    # the page: the relay's forensics action on the stall alert, as the robot shows it, with where the dumps are
    page = text.index("│ FIRING · CRITICAL · VerlHangForensics")
    assert captured.start() < page
    body = text[page:text.index("╰─", page)]
    assert "rank 0 is in hang_trainer → compute_score" in body
    assert Path(captured.group(1)).name.replace(".", "·") in body
    assert len(re.findall(r"forensics: stacks of", text)) == 1  # the request got the stall's capture
    report = re.sub(r"\s+", " ", text[text.index("\nThe path: "):])  # one line, as wrapped for the terminal
    path = re.search(r"^ The path: last step [\d.]+s \(step (\d+)\) .*? From the last step to the stacks on disk "
                     r"([\d.]+)s, to the page ([\d.]+)s\.", report)
    assert path and int(path.group(1)) == demo_stack.HANG_AT - 1
    assert float(path.group(2)) <= float(path.group(3)) < 15
    assert "Backtest" not in text and "the hung trainer" in text
    workdir = re.search(r"removed (\S+)$", text, re.M).group(1)
    assert not Path(workdir).exists()
    assert took < scaled(120), f"the demo took {took:.0f} s"  # a bound on a stuck demo; its pace is not claimed here
    # docs/demo.md shows this path as a real run printed it (VERL_EXPORTER_UPDATE_DOCS=1 rewrites it from this one)
    fresh = excerpt(proc.stdout, "demo_hang")
    page = REPO / "docs/demo.md"
    if os.environ.get("VERL_EXPORTER_UPDATE_DOCS"):
        page.write_text(with_excerpt(page.read_text(encoding="utf-8"), fresh, "demo_hang"), encoding="utf-8")
    committed = in_page(page.read_text(encoding="utf-8"), "demo_hang")
    # the warning's firing and the sidecar's own capture race each other (Prometheus' evaluation against the
    # sidecar's stall check): their order is the run's, the rest is causal
    for kinds in (kinds_in(committed, "demo_hang"), kinds_in(fresh, "demo_hang")):
        assert sorted(kinds) == sorted(["hang", "stalled", "stacks", "hung", "page"]), kinds
        assert kinds[0] == "hang" and kinds[-1] == "page", kinds
    assert [re.sub(r"\d", "0", line) for line in message_of(committed, "VerlHangForensics")] == \
        [re.sub(r"\d", "0", line) for line in message_of(fresh, "VerlHangForensics")]
