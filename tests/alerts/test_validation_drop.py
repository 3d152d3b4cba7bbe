"""VerlValidationScoreDrop counts low evaluations (issues 24 and 37). An evaluation is a step at which the sidecar
saw the validation key arrive (verl_validation_evaluations_total), so a score that falls and then repeats exactly
the same value (a collapsed model scoring 0.0 each time, a small validation set) is two low evaluations; a dip
that the next evaluation takes back (MATH at 0.51 -> 0.39 -> 0.51) is one, and no drop. Judged with promtool on
the generated rule, one sample a minute, a new evaluation every 20 minutes."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO
from promreplay import firing_minutes

pytestmark = pytest.mark.integration  # starts servers or programs

LABELS = 'job="verl", run="r1", kind="core", data_source="math", variable="acc", stat="mean@1"'
SERIES = f"verl_validation_score{{{LABELS}}}"
COUNTER = f"verl_validation_evaluations_total{{{LABELS}}}"
EVERY = 20  # minutes between evaluations


def drop_expr() -> str:
    groups = yaml.safe_load((REPO / "rules" / "verl-alerts.yaml").read_text())["groups"]
    return next(r["expr"] for g in groups for r in g["rules"] if r.get("alert") == "VerlValidationScoreDrop")


def fired(tmp_path, *scores: float) -> list[int]:
    """The minutes the rule fires over these evaluations' scores, each held until the next one."""
    values = [v for s in scores for v in [s] * EVERY]
    counts = [n + 1 for n in range(len(scores)) for _ in range(EVERY)]
    return firing_minutes(tmp_path, SERIES, values, drop_expr(), range(0, len(values), 2), more={COUNTER: counts})


@pytest.mark.parametrize("scores", [
    (0.51, 0.39, 0.51, 0.52),  # one dip, taken back by the next evaluation
    (0.51, 0.0, 0.51, 0.52),  # a dip to 0.0, taken back
    (-0.30, -0.31, -0.29, -0.32),  # a negative reward wandering within its noise: never 20% below its best
], ids=["one-dip", "one-dip-to-zero", "negative-scores"])
def test_one_low_evaluation_or_noise_is_silent(tmp_path, scores):
    assert fired(tmp_path, *scores) == []


@pytest.mark.parametrize("scores", [
    (0.51, 0.39, 0.37, 0.38),  # falls and stays low, a little noise
    (0.51, 0.39, 0.39, 0.39),  # falls and repeats exactly the same value (issue 37: never alerted before)
    (0.51, 0.0, 0.0, 0.0),  # collapses to 0.0 and stays there
    (0.51, 0.39, 0.51, 0.39),  # two low evaluations with a good one between them
], ids=["falls-and-stays", "falls-and-repeats-the-value", "falls-to-zero", "low-good-low"])
def test_a_drop_seen_on_two_evaluations_fires_at_the_second(tmp_path, scores):
    second_low = EVERY * [i for i, s in enumerate(scores) if s < 0.8 * 0.51][1]
    minutes = fired(tmp_path, *scores)
    assert minutes and min(minutes) == second_low


def test_the_same_low_value_without_a_new_evaluation_stays_silent(tmp_path):
    """The gauge alone does not make an evaluation: a low value held for an hour with no key arriving is one."""
    values = [0.51] * EVERY + [0.39] * 3 * EVERY
    counts = [1] * EVERY + [2] * 3 * EVERY
    assert firing_minutes(tmp_path, SERIES, values, drop_expr(), range(0, len(values), 2), more={COUNTER: counts}) == []
