"""VerlValidationScoreDrop needs two low evaluations (issue 24): a small validation set dips on one evaluation
and the next takes it back (MATH at 0.51 -> 0.39 -> 0.51), which is no drop. Judged with promtool on the
generated rule, one sample a minute, a new evaluation every 20 minutes."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO
from promreplay import firing_minutes

pytestmark = pytest.mark.integration  # starts servers or programs

SERIES = 'verl_validation_score{job="verl", run="r1", kind="core", data_source="math", variable="acc", stat="mean@1"}'


def drop_expr() -> str:
    groups = yaml.safe_load((REPO / "rules" / "verl-alerts.yaml").read_text())["groups"]
    return next(r["expr"] for g in groups for r in g["rules"] if r.get("alert") == "VerlValidationScoreDrop")


def evaluations(*scores: float) -> list[float]:
    return [v for s in scores for v in [s] * 20]


@pytest.mark.parametrize("scores", [
    (0.51, 0.39, 0.51, 0.52),  # one dip, taken back by the next evaluation
    (-0.30, -0.31, -0.29, -0.32),  # a negative reward wandering within its noise: never 20% below its best
], ids=["one-dip", "negative-scores"])
def test_one_low_evaluation_or_noise_is_silent(tmp_path, scores):
    assert firing_minutes(tmp_path, SERIES, evaluations(*scores), drop_expr(), range(0, 80, 2)) == []


def test_a_drop_that_holds_on_the_next_evaluation_fires_from_it(tmp_path):
    fired = firing_minutes(tmp_path, SERIES, evaluations(0.51, 0.39, 0.37, 0.38), drop_expr(), range(0, 80, 2))
    assert fired and min(fired) == 40
