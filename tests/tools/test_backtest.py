"""`verl-exporter backtest`: the alert timeline of a recorded run, an HTML report, clear errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import require_tool
from verl_exporter.cli import main
from verl_exporter.tools import replay as rp

pytestmark = pytest.mark.integration  # starts servers or programs


def test_backtest_prints_the_timeline_and_writes_the_report(tmp_path, capsys):
    require_tool("promtool")
    run = tmp_path / "collapsed.jsonl"
    rp.write_jsonl(rp.simulate("grpo", rp.Fault("collapse", 100), steps=130), run)
    assert main(["backtest", str(run), "--html-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "130 steps" in out and "130/130 steps" in err  # the progress bar ends on the last step
    rows = [line.split() for line in out.splitlines() if "VerlRewardCollapse" in line]
    assert rows and rows[0][0] == "103" and rows[0][-2] == "critical"
    page = (tmp_path / "collapsed.backtest.html").read_text()
    assert page.count("<svg") >= 6 and "VerlRewardCollapse at step 103" in page


def test_backtest_takes_the_step_time_when_the_log_has_none(tmp_path, capsys):
    require_tool("promtool")
    lines = rp.simulate("ppo", steps=40)
    for ln in lines:
        ln["data"].pop("timing_s/step")
    run = tmp_path / "untimed.jsonl"
    rp.write_jsonl(lines, run)
    assert main(["backtest", str(run), "--step-seconds", "600", "--html-dir", "", "--no-progress"]) == 0
    assert "40 steps over 6.7 h" in capsys.readouterr().out


def test_a_file_that_is_not_a_verl_log_gets_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "events.jsonl"
    bad.write_text('{"time": 1, "msg": "hello"}\nnot json\n')
    assert main(["backtest", str(bad), "--html-dir", ""]) == 2
    out = capsys.readouterr().out
    assert "not a verl log" in out and "events.jsonl" in out
    assert main(["backtest", str(tmp_path / "missing.jsonl"), "--html-dir", ""]) == 2
    assert "No such file" in capsys.readouterr().out


def test_console_logs_are_read_as_verl_runs(tmp_path):
    """verl's console logger lines (as committed logs and wandb output.log files hold them) convert to records."""
    log = tmp_path / "train.log"
    log.write_text("\x1b[36m(TaskRunner pid=7)\x1b[0m step:1 - actor/grad_norm:np.float64(0.41) - "
                   "critic/score/mean:0.025 - actor/lr(1e-4):0.010 - note:hello\n"
                   "some other output\n"
                   "step:2 - actor/grad_norm:nan - critic/score/mean:0.5 - timing/step:12.5\n")
    lines = rp.read_jsonl(log)
    assert lines == [{"step": 1, "data": {"actor/grad_norm": 0.41, "critic/score/mean": 0.025,
                                          "actor/lr(1e-4)": 0.01, "note": "hello"}},
                     {"step": 2, "data": {"actor/grad_norm": None, "critic/score/mean": 0.5, "timing/step": 12.5}}]
    import subprocess
    import sys

    from conftest import REPO
    out = subprocess.run([sys.executable, str(REPO / "scripts/verl_console_to_jsonl.py"), str(log)],
                         capture_output=True, text=True, check=True).stdout
    assert [json.loads(x) for x in out.splitlines()] == lines


def test_older_verls_step_time_sets_the_replay_clock_and_the_detectors_step_seconds():
    """verl before 2025 logged the step time as timing/step: the replay and the hang detector must use it."""
    from verl_exporter.core.detect import Detectors
    from verl_exporter.spec import load_spec

    old = [{"step": s, "data": {"timing/step": 420.0, "critic/score/mean": 0.1}} for s in range(1, 4)]
    assert rp.step_period(old) == [420.0, 420.0, 420.0]  # not the 60 s default
    detectors = Detectors.from_spec(load_spec())
    for line in old:
        detectors.observe(line["step"], line["data"], seen_at=None)
    assert detectors.step_seconds() == 420.0


def test_the_report_directory_is_created_and_an_unwritable_one_is_a_clear_error(tmp_path, capsys):
    require_tool("promtool")
    run = tmp_path / "short.jsonl"
    rp.write_jsonl(rp.simulate("ppo", steps=12), run)
    assert main(["backtest", str(run), "--html-dir", str(tmp_path / "new" / "dir"), "--no-progress"]) == 0
    assert (tmp_path / "new" / "dir" / "short.backtest.html").is_file()
    (tmp_path / "file").write_text("")
    assert main(["backtest", str(run), "--html-dir", str(tmp_path / "file" / "sub"), "--no-progress"]) == 2
    assert "cannot write the report" in capsys.readouterr().out


RECORDING = """groups:
- name: r
  rules:
  - record: x:avg10m
    expr: avg_over_time(verl_x[10m])
"""
ALERTS = """groups:
- name: a
  rules:
  - alert: XHighForAWhile
    expr: x:avg10m > 1
    for: 5m
    labels: {severity: warning}
  - alert: XVeryHigh
    expr: verl_x > 2.5
    labels: {severity: critical}
  - alert: XDroppedRecently
    expr: verl_x < (verl_x offset 15m) - 1
    for: 2m
    labels: {severity: warning}
"""


def _wavy_samples(minutes: int) -> rp.Samples:
    """One series that rises, drops, flaps and has a gap, so alerts start and stop on and across chunk edges."""
    values: list[float | None] = []
    for m in range(minutes):
        if 300 <= m < 312:
            values.append(None)
        elif 100 <= m < 250:
            values.append(3.0)
        else:
            values.append(2.0 if (m // 23) % 2 else 0.0 + (m % 7) / 10)
    key = ("verl_x", (("job", "verl"), ("instance", "i:1"), ("run", "r"), ("rank", "0")))
    return rp.Samples(60.0, {key: values})


@pytest.mark.integration
def test_a_long_run_is_evaluated_in_bounded_chunks_with_the_same_result(tmp_path, monkeypatch):
    require_tool("promtool")
    (tmp_path / "verl-recording.yaml").write_text(RECORDING)
    (tmp_path / "verl-alerts.yaml").write_text(ALERTS)
    warm = rp.warmup_minutes([RECORDING, ALERTS])
    assert warm >= 2 * (10 + 15) + 5 + 5  # windows and offsets twice, the longest for:, the 5-minute lookback
    samples = _wavy_samples(480)
    whole_minutes: dict[str, int] = {}
    whole = rp.evaluate(samples, tmp_path, minutes_firing=whole_minutes)
    assert {f.alert for f in whole} == {"XHighForAWhile", "XVeryHigh", "XDroppedRecently"}
    every = rp.evaluate(samples, tmp_path, every_minute=True)  # every minute it fires, not only its starts
    assert {a: len({f.minute for f in every if f.alert == a}) for a in whole_minutes} == whole_minutes
    assert all(f in every for f in whole) and len(every) > len(whole)

    sizes = []
    real_run = subprocess.run

    def promtool(cmd, **kwargs):
        doc = json.loads(Path(cmd[-1]).read_text())
        sizes.append(max(len(s["values"].split()) for s in doc["tests"][0]["input_series"]))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(rp.subprocess, "run", promtool)
    chunked_minutes: dict[str, int] = {}
    chunked = rp.evaluate(samples, tmp_path, minutes_firing=chunked_minutes, chunk_minutes=60)
    assert len(sizes) == 8  # 480 minutes in chunks of 60, each run with its warm-up only
    assert sorted(chunked, key=lambda f: (f.minute, f.alert)) == sorted(whole, key=lambda f: (f.minute, f.alert))
    assert chunked_minutes == whole_minutes


def test_step_at_is_the_latest_step_logged_by_that_minute():
    samples = rp.Samples(60.0, step_end_s=[(1, 30.0), (2, 60.0), (3, 150.0), (7, 400.0)])
    assert [rp.step_at(samples, m) for m in range(9)] == [None, 2, 2, 3, 3, 3, 3, 7, 7]


def test_a_long_log_is_read_to_its_last_steps_in_bounded_memory(tmp_path):
    path = tmp_path / "long.jsonl"
    rp.write_jsonl(({"step": i, "data": {"critic/score/mean": 0.5}} for i in range(1, 1001)), path)
    lines, total = rp.read_run(path, max_steps=100)
    assert total == 1000 and [ln["step"] for ln in lines] == list(range(901, 1001))
    assert rp.too_long(path, lines, total).startswith(f"{path}: 1,000 steps, more than --max-steps 100: judging "
                                                      "the last 100 (steps 901..1000)")
    lines, total = rp.read_run(path, max_steps=0)
    assert len(lines) == total == 1000 and rp.too_long(path, lines, total) is None


def test_backtest_of_a_run_over_max_steps_warns_and_judges_the_last_steps(tmp_path, capsys):
    require_tool("promtool")
    run = tmp_path / "long.jsonl"
    rp.write_jsonl(rp.simulate("ppo", steps=60), run)
    assert main(["backtest", str(run), "--max-steps", "40", "--html-dir", "", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "60 steps, more than --max-steps 40: judging the last 40 (steps 21..60)" in err, err
    assert f"{run}: 40 steps" in out, out


def test_an_alert_that_starts_after_a_day_is_placed_at_its_minute(tmp_path):
    """promtool writes an evaluation time past a day as 1d0h1m0s (and past a week with w): a run longer than a
    day (a 7-minute-step agent run reaches it at step 206) must keep every later start at its own minute."""
    from conftest import REPO

    minutes = 1500
    counter = [0.0] * 1450 + [1.0] * (minutes - 1450)  # a NaN logged in minute 1450 (24 h 10 min)
    key = ("verl_training_nonfinite_values_total", (("job", "verl"), ("instance", "node0:9477"), ("run", "r"),
                                                      ("rank", "0"), ("metric", "verl_actor_grad_norm")))
    up = ("up", (("job", "verl"), ("instance", "node0:9477")))
    samples = rp.Samples(60.0, {key: counter, up: [1.0] * minutes}, [(1, 60.0)])
    fired = rp.evaluate(samples, REPO / "rules", promtool=require_tool("promtool"))
    assert [(f.alert, f.minute) for f in fired] == [("VerlNonFiniteGradNorm", 1450)]
