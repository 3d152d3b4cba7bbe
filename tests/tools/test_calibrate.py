"""`verl-exporter calibrate`: an overrides file fitted to the user's healthy runs, checked end to end.

A simulated healthy agentic run whose long answers clip near the length cap (as the public long-answer agent
runs in tests/data/real_runs do) trips VerlResponseClipRatioHigh with the defaults; calibrate must propose a
line that keeps it silent with the stated margin, and `backtest --overrides` must show the faulty runs (answers
at the cap, a collapse, NaN) still firing. Hard-safety alerts are never loosened.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from conftest import require_tool
from verl_exporter.cli import main
from verl_exporter.spec import load_spec
from verl_exporter.spec.overrides import apply_overrides, load_overrides
from verl_exporter.tools import calibrate as cb
from verl_exporter.tools import replay as rp

# The agentic profile (7-minute steps, answers growing to ~2,500 tokens) with a 3k-token cap: healthy runs
# clip up to ~26% of their answers, which the default line (20%) calls a fault.
LONG_ANSWERS = dataclasses.replace(rp.PROFILES["agentic"], max_len=3072)


@pytest.fixture(scope="module")
def spec():
    return load_spec()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    paths = {}
    for name, profile, fault in (("agentic", "agentic", None), ("healthy", LONG_ANSWERS, None),
                                 ("clipped", LONG_ANSWERS, rp.Fault("clip", 30)),
                                 ("collapse", LONG_ANSWERS, rp.Fault("collapse", 30)),
                                 ("nan", LONG_ANSWERS, rp.Fault("nan", 30))):
        paths[name] = folder / f"{name}.jsonl"
        rp.write_jsonl(rp.simulate(profile, fault), paths[name])
    return paths


@pytest.mark.integration
def test_the_plain_agentic_run_needs_no_change(spec, runs):
    result, _ = cb.calibrate([str(runs["agentic"])], spec)
    assert not [k for k in result.knobs if k.changed or k.refused]
    clip = next(k for k in result.knobs if (k.alert, k.knob) == ("VerlResponseClipRatioHigh", "clip_ratio"))
    assert clip.reason.startswith("kept: highest 0.01") and "headroom" in clip.reason
    assert result.overrides_doc() == {"version": 1}


@pytest.mark.integration
def test_a_knob_moves_only_as_far_as_the_runs_need(spec, runs):
    result, _ = cb.calibrate([str(runs["healthy"])], spec, margin=0.2)
    moved = {(k.alert, k.knob): k for k in result.knobs if k.changed}
    assert list(moved) == [("VerlResponseClipRatioHigh", "clip_ratio")]
    clip = moved[("VerlResponseClipRatioHigh", "clip_ratio")]
    highest = float(re.search(r"highest ([0-9.]+)", clip.reason).group(1))
    assert 0.2 < highest < 0.3 and clip.default == 0.2
    assert highest * 1.2 <= clip.proposed <= highest * 1.2 + 0.01  # the margin, rounded to 2 digits upwards
    assert "healthy.jsonl step" in clip.reason and "p99.5" in clip.reason and "+20% margin" in clip.reason
    wider, _ = cb.calibrate([str(runs["healthy"])], spec, margin=0.5)
    assert next(k for k in wider.knobs if k.changed).proposed > clip.proposed


@pytest.mark.integration
def test_calibrate_backtest_generate(spec, runs, tmp_path, capsys, monkeypatch):
    """The workflow the README recommends: calibrate -> backtest -> generate."""
    require_tool("promtool")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_EXPORTER_OVERRIDES", raising=False)
    assert main(["calibrate", str(runs["healthy"]), "--no-progress"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if "VerlResponseClipRatioHigh.clip_ratio" in line)
    assert row[1:3] == ["0.2", "0.32"]
    assert "healthy.jsonl: before VerlResponseClipRatioHigh; with the proposal none" in out
    assert "wrote verl-exporter.yaml (1 knob(s) moved)" in out
    proposal = tmp_path / "verl-exporter.yaml"
    doc = yaml.safe_load(proposal.read_text())
    assert doc == {"version": 1, "alerts": {"VerlResponseClipRatioHigh": {"thresholds": {"clip_ratio": 0.32}}}}
    assert "# default 0.2: clip_ratio held_min, highest" in proposal.read_text()
    eff = apply_overrides(spec, load_overrides(proposal))
    assert next(a for a in eff.alerts() if a.alert == "VerlResponseClipRatioHigh").knobs()["clip_ratio"].value == 0.32

    # backtest --overrides: the healthy run is silenced, the faulty ones still fire (./verl-exporter.yaml is
    # found without the flag, as every command finds it)
    assert main(["backtest", str(runs["healthy"]), str(runs["clipped"]), str(runs["collapse"]), str(runs["nan"]),
                 "--html-dir", "", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "with overrides verl-exporter.yaml" in out
    per_run = dict(re.findall(r"(\w+)\.jsonl: .*?overrides vs defaults: ([^\n]*)", out, re.S))
    assert per_run["healthy"].startswith("silenced VerlResponseClipRatioHigh")
    sections = re.split(r"\n(?=\S+\.jsonl: )", out)

    def alerts_of(name):
        section = next(s for s in sections if f"{name}.jsonl:" in s.split("\n")[0])
        return {line.split()[2]: int(line.split()[0]) for line in section.splitlines()[2:]
                if re.match(r"\s+\d+\s", line)}

    assert alerts_of("healthy") == {}
    assert alerts_of("clipped")["VerlResponseClipRatioHigh"] == 30  # the answers at the cap: at onset
    collapse = alerts_of("collapse")
    assert collapse["VerlRewardCollapse"] <= 33 and collapse["VerlResponseLengthCollapse"] <= 32
    assert alerts_of("nan") == {"VerlNonFiniteGradNorm": 30}  # and no more clip warnings around it
    assert "silenced VerlResponseClipRatioHigh" in per_run["nan"]

    # generate: the same file, the same line in the rules
    assert main(["generate", "--out", str(tmp_path / "deploy")]) == 0
    rules = (tmp_path / "deploy" / "rules" / "verl-alerts.yaml").read_text()
    assert 'verl_detector_held_min{signal="clip_ratio", job="verl"} > 0.32' in rules


@pytest.mark.integration
def test_hard_safety_alerts_are_never_loosened(spec, runs, tmp_path, capsys):
    require_tool("promtool")
    # a run the user calls healthy, with NaN gradients at step 30
    assert main(["calibrate", str(runs["nan"]), "--out", str(tmp_path / "p.yaml"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"VerlNonFiniteGradNorm \(hard safety\) fires on nan.jsonl at step 30: calibrate never "
                     r"loosens or disables it", out)
    assert "VerlNonFiniteGradNorm" not in (tmp_path / "p.yaml").read_text()


def test_a_hard_safety_knob_is_refused_with_the_reason(spec):
    lost = next(a for a in spec.alerts() if a.alert == "VerlGPULost")
    knob = cb.propose_knob(spec, lost, "threshold", lost.knobs()["threshold"],
                           cb.Extreme(0.0, "r.jsonl", 12, 0.0, 100), 0.2)
    assert knob.refused and not knob.changed and knob.proposed == 1
    assert "REFUSED" in knob.reason and "hard-safety alert" in knob.reason and "never loosens" in knob.reason
    clip = next(a for a in spec.alerts() if a.alert == "VerlResponseClipRatioHigh")
    knob = cb.propose_knob(spec, clip, "clip_ratio", clip.knobs()["clip_ratio"],
                           cb.Extreme(0.95, "r.jsonl", 5, 0.9, 100), 0.2)
    assert not knob.changed and "past the knob's limit 1" in knob.reason and "enabled: false" in knob.reason


def test_a_less_than_knob_is_loosened_downwards(spec):
    answers = next(a for a in spec.alerts() if a.alert == "VerlAnswersCollapsed")
    param = answers.knobs()["tokens"]
    knob = cb.propose_knob(spec, answers, "tokens", param, cb.Extreme(5.5, "r.jsonl", 3, 6.0, 10), 0.2)
    assert knob.changed and knob.proposed == 4.5  # 5.5 / 1.2 = 4.58, rounded down
    assert cb._round_loose(0.3123, ">") == 0.32 and cb._round_loose(1610612736 * 1.37, ">") == 2.3e9


@pytest.mark.integration
def test_calibrate_keeps_the_base_overrides_and_refuses_to_overwrite(spec, runs, tmp_path, capsys):
    base = tmp_path / "base.yaml"
    base.write_text("global:\n  selector: 'job=\"verl-agent\"'\nalerts:\n  VerlGradNormSpike: {severity: info}\n")
    out = tmp_path / "proposal.yaml"
    argv = ["calibrate", str(runs["healthy"]), "--overrides", str(base), "--out", str(out), "--no-verify",
            "--no-progress"]
    assert main(argv) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["global"] == {"selector": 'job="verl-agent"'}
    assert doc["alerts"]["VerlGradNormSpike"] == {"severity": "info"}
    assert doc["alerts"]["VerlResponseClipRatioHigh"]["thresholds"]["clip_ratio"] == 0.32
    capsys.readouterr()
    assert main(argv) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main([*argv, "--force", "--out", "-"]) == 0
    assert "clip_ratio: 0.32" in capsys.readouterr().out
    assert main(["calibrate", str(tmp_path / "missing.jsonl"), "--out", "-", "--no-verify"]) == 2


def test_the_proposal_keeps_every_section_of_the_base_overrides(tmp_path):
    """A base file's code sets and preflight knobs are in the proposal as they were (not only global and
    alerts): the proposed file replaces the base."""
    base = tmp_path / "base.yaml"
    base.write_text("global:\n  selector: 'job=\"verl-agent\"'\nalerts:\n  VerlGradNormSpike: {severity: info}\n"
                    "codes:\n  critical_xids: [79, 48]\npreflight:\n  saves_ahead: 3\n")
    loaded = load_overrides(base)
    result = cb.Calibration(runs=[], margin=0.2, knobs=[], base=loaded)
    proposal = yaml.safe_load(cb.render_overrides(result))
    assert proposal == {**yaml.safe_load(base.read_text()), "version": 1}
    assert load_overrides(base).model == cb.parse_overrides(proposal).model
