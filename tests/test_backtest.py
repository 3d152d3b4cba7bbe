"""`verl-exporter backtest`: the alert timeline of a recorded run, an HTML report, clear errors."""

from __future__ import annotations

from conftest import require_tool
from verl_exporter import replay as rp
from verl_exporter.cli import main


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
    assert "not a verl file-logger log" in out and "events.jsonl" in out
    assert main(["backtest", str(tmp_path / "missing.jsonl"), "--html-dir", ""]) == 2
    assert "No such file" in capsys.readouterr().out
