"""Backtest of real public verl runs (tests/data/real_runs): what the alert pack would have said on them.

Each run is replayed through the real follower, store, mapper and detectors on a simulated clock (its own
step times) and the generated rules are evaluated by promtool, exactly as ``verl-exporter backtest`` does.
corpus.yaml says what each run is; here: healthy runs raise no critical alert and no alert outside their
allow-list, faulty runs raise their expected alerts, the first within max_delay_steps of the fault's onset,
and nothing fires before the fault.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml
from conftest import REPO, require_tool

CORPUS = REPO / "tests" / "data" / "real_runs"
RUNS = yaml.safe_load((CORPUS / "corpus.yaml").read_text())["runs"]


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory):
    from verl_exporter.render.rules import render_rules
    from verl_exporter.spec import load_spec

    out = tmp_path_factory.mktemp("rules")
    for rel, text in render_rules(load_spec()).items():
        (out / Path(rel).name).write_text(text, encoding="utf-8")
    return out


@functools.cache
def replayed(name: str, rules_dir: Path):
    """(lines, samples, alert starts) of one corpus run, replayed once for every test of this module."""
    from verl_exporter.tools import replay

    run = next(r for r in RUNS if r["name"] == name)
    lines = replay.read_jsonl(CORPUS / run["file"])
    samples = replay.replay(lines, run=run["name"])
    return lines, samples, replay.evaluate(samples, rules_dir)


def first_steps(run: dict, rules_dir: Path) -> dict[str, tuple[int, str]]:
    """{alert: (first step it started at, severity)} for one corpus run."""
    from verl_exporter.tools.backtest import timeline

    _, samples, fired = replayed(run["name"], rules_dir)
    out: dict[str, tuple[int, str]] = {}
    for event in timeline(samples, fired):
        out.setdefault(event["alert"], (event["step"], event["severity"]))
    return out


@pytest.mark.integration
@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_the_breaker_agrees_with_the_pack_on_the_real_run(run, rules_dir):
    """The breaker trips iff the pack pages a critical alert it judges (at most MAX_LAG_STEPS steps after the
    page), and never on a healthy run; a collapse with 1-token answers and a KL blow-up trips it."""
    from verl_exporter.spec import load_spec
    from verl_exporter.tools import agreement as ag

    require_tool("promtool")
    lines, samples, fired = replayed(run["name"], rules_dir)
    a = ag.agreement(lines, samples, fired, load_spec())
    assert a.agrees, a
    if run["verdict"] == "healthy":
        assert a.trip is None


@pytest.mark.integration
@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_real_run_backtest(run, rules_dir):
    require_tool("promtool")
    fired = first_steps(run, rules_dir)
    known = set(run["expect_alerts"]) | set(run["allow_alerts"])
    assert not set(fired) - known, f"false alerts on {run['name']}: { {a: fired[a] for a in set(fired) - known} }"
    if run["verdict"] == "healthy":
        assert not [a for a, (_, severity) in fired.items() if severity == "critical"]
        return
    missed = set(run["expect_alerts"]) - set(fired)
    assert not missed, f"{run['name']}: expected alerts never fired: {sorted(missed)}"
    onset = run["fault_step"]
    assert all(step >= onset for step, _ in fired.values()), f"alerts before the fault at step {onset}: {fired}"
    first = min(fired[a][0] for a in run["expect_alerts"])
    assert first - onset <= run["max_delay_steps"], f"first expected alert at step {first}, fault at {onset}"
