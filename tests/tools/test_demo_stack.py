"""`verl-exporter demo` with the whole alert path: a real Prometheus and Alertmanager, the relay and the demo's
trainer loop, end to end with --exit-after-replay; and the sidecar-only demo when the programs are missing."""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import REPO, require_tool
from helpers import demo_rate, run_demo, scaled, unwrap
from verl_exporter.tools.demo_stack import compress_for, compress_grouping, find_programs
from verl_exporter.tools.docs import excerpt, in_page, kinds_in, message_of, with_excerpt

pytestmark = pytest.mark.integration  # starts servers or programs

NAN_ALERT = "VerlNonFiniteGradNorm"


def line_of(out: list[str], pattern: str) -> int:
    """The index of the first line matching pattern (a regex)."""
    for i, line in enumerate(out):
        if re.search(pattern, line):
            return i
    raise AssertionError(f"no line matches {pattern!r}")


def refuses(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=scaled(2))
    except urllib.error.HTTPError:
        return False
    except OSError:
        return True
    return False


@pytest.fixture(scope="module")
def full_demo():
    require_tool("prometheus")
    require_tool("prometheus-alertmanager")
    require_tool("promtool")
    proc, took = run_demo("--exit-after-replay", "--rate", f"{demo_rate():g}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, took


def test_the_docs_demo_excerpt_is_what_the_demo_prints(full_demo):
    """docs/demo.md shows a real run's excerpt: the same path, and the NaN alert's message as the robot shows it
    today (its digits masked: times, ports, dates). VERL_EXPORTER_UPDATE_DOCS=1 rewrites it from this run."""
    fresh = excerpt(full_demo[0])
    page = REPO / "docs/demo.md"
    if os.environ.get("VERL_EXPORTER_UPDATE_DOCS"):
        page.write_text(with_excerpt(page.read_text(encoding="utf-8"), fresh, "demo_stack"), encoding="utf-8")
    committed = in_page(page.read_text(encoding="utf-8"), "demo_stack")

    def path(text):  # the stop depends on timing: the reward collapse is inhibited when the numerical one pages too
        return [k for k in kinds_in(text) if not k.startswith("stop")]

    assert path(committed) == path(fresh) == ["nan", "firing", "notified", "message", "checkpoint asked",
                                              "checkpoint action", "checkpoint taken"]
    assert [re.sub(r"\d", "0", line) for line in message_of(committed)] == \
        [re.sub(r"\d", "0", line) for line in message_of(fresh)], "run: VERL_EXPORTER_UPDATE_DOCS=1 pytest -k excerpt"
    assert "The path: NaN logged" in committed and "<demo folder>" not in message_of(committed)


def test_the_nan_travels_the_real_path_to_a_robot_message_and_a_checkpoint(full_demo):
    text, took = full_demo
    text = unwrap(text)
    out = text.splitlines()
    fired = line_of(out, rf"Prometheus +(pending → )?firing: .*\b{NAN_ALERT} critical")
    notified = line_of(out, rf"Alertmanager → relay /alert/training-critical: firing .*\b{NAN_ALERT}\b")
    # the message's first line (on a loaded machine another critical alert may share the notification)
    shown = line_of(out, rf"^ +│ \[verl\] FIRING \d+ critical: (.*, )?{NAN_ALERT}\b")
    assert any(line.lstrip().startswith("╭─ DingTalk robot · markdown · notification: [verl] FIRING")
               for line in out[shown - 3:shown])
    asked = line_of(out, rf"sidecar +control: checkpoint requested because {NAN_ALERT} \(applied\)")
    acted = line_of(out, rf"trainer +checkpoint requested \({NAN_ALERT}\): saved global_step_\d+ after step \d+")
    nan = line_of(out, r"trainer +logs a NaN gradient norm")
    assert nan < fired < notified < shown < asked < acted
    # the message as the robot shows it: its lines, no markup, no escape codes (not a terminal)
    message = out[shown:shown + 40]
    assert f"                          │ FIRING · CRITICAL · {NAN_ALERT}" in message
    assert any("│ run demo · rank 0 · instance 127.0.0.1:" in line for line in message)
    assert any("│ The actor's gradient norm is NaN or Inf." in line for line in message)
    assert "\x1b[" not in text and "**" not in text and "<font" not in text
    # the relay asked the sidecar, which wrote the control file the trainer loop acted on
    assert re.search(rf"relay +action: asked http://127\.0\.0\.1:\d+ to checkpoint because of {NAN_ALERT}", text)
    # compressed timings are said, and the final timeline and the backtest show what fired
    assert re.search(r"Timings are compressed \d+x", text)
    assert re.search(rf"^  {NAN_ALERT} +critical +- +[\d.]+s/\d+ +1 +[\d.]+s +[\d.]+s$", text, re.M)
    assert re.search(r"^The path: NaN logged .*?→ checkpoint [\d.]+s \(step \d+\)", text, re.M | re.S)
    assert re.search(rf"^  {NAN_ALERT} +critical +\d+ +1  fired$", text, re.M)  # the backtest, same run
    assert took < scaled(120), f"the demo took {took:.0f} s"  # a bound on a stuck demo; its pace is not claimed here


def test_the_demo_reports_its_links_and_cleans_up_after_itself(full_demo):
    text, _ = full_demo
    urls = {name: re.search(rf"^  {name} +(http://127\.0\.0\.1:\d+)", text, re.M).group(1)
            for name in ("sidecar", "Prometheus", "Alertmanager", "relay")}
    assert re.search(r"Prometheus +http://127\.0\.0\.1:\d+(/classic)?/alerts", text)  # Debian: classic UI only
    assert re.search(r"Alertmanager http://127\.0\.0\.1:\d+/#/alerts", text)
    workdir = re.search(r"removed (\S+)$", text, re.M).group(1)
    assert "verl-exporter-demo-" in workdir and not Path(workdir).exists()
    for name, url in urls.items():
        assert refuses(url + "/metrics"), f"{name} still answers at {url}"


def test_without_the_programs_it_says_how_to_get_them_and_serves_the_sidecar(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    proc, _ = run_demo("--rate", "400", "--exit-after-replay", "--listen", "127.0.0.1:0", env={"PATH": str(empty)})
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("verl-exporter demo: Prometheus and Alertmanager not found, so this shows the sidecar only")
    assert "sudo apt-get update && sudo apt-get install -y prometheus prometheus-alertmanager" in first
    assert "replay finished: 300 lines parsed, latest step 300" in proc.stdout
    workdir = re.search(r"verl file log : (\S+)/demo_run\.jsonl", proc.stdout).group(1)
    assert not Path(workdir).exists()


def test_a_program_given_that_does_not_exist_is_an_error(tmp_path):
    proc, _ = run_demo("--prometheus", str(tmp_path / "nope"), "--exit-after-replay")
    assert proc.returncode == 2
    assert f"--prometheus {tmp_path / 'nope'}: not an executable program" in proc.stdout


def test_programs_are_found_by_debian_or_upstream_name(tmp_path, monkeypatch):
    for name in ("prometheus", "alertmanager"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_programs(None, None) == (str(tmp_path / "prometheus"), str(tmp_path / "alertmanager"))
    assert find_programs(None, str(tmp_path / "nothing")) == (str(tmp_path / "prometheus"), None)


def test_for_and_grouping_are_divided_by_the_compression():
    rules = yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"alert": "A", "expr": "x > 1", "for": "5m", "annotations": {"d": "{{ $labels.run }}"}},
        {"alert": "B", "expr": "y > 1"}, {"record": "r", "expr": "z"}]}]})
    text, fors = compress_for(rules, 600)
    doc = yaml.safe_load(text.split("\n", 1)[1])
    assert [r.get("for") for r in doc["groups"][0]["rules"]] == ["500ms", None, None]
    assert doc["groups"][0]["rules"][0]["annotations"]["d"] == "{{ $labels.run }}"
    assert fors == {"A": ("5m", "500ms"), "B": ("", "")}
    am = {"route": {"group_wait": "30s", "group_interval": "5m", "repeat_interval": "4h",
                    "routes": [{"group_wait": "1m", "routes": [{"repeat_interval": "1h"}]}]}}
    shown = compress_grouping(am, 600)
    assert am["route"]["group_wait"] == "50ms" and am["route"]["group_interval"] == "500ms"
    assert am["route"]["repeat_interval"] == "4h" and am["route"]["routes"][0]["group_wait"] == "100ms"
    assert shown == {"group_wait": ("30s", "50ms"), "group_interval": ("5m", "500ms")}
