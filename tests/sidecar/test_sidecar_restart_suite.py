"""Fault suite: a real `verl-exporter serve` killed (SIGTERM and kill -9) and restarted while verl writes.

Invariants: the NaN counter never goes down across restarts, every step and every NaN written is on
/metrics in the end, and the scrapes, replayed through the generated alert rules with promtool, raise a
NaN alert only within its window after a NaN that was really written.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import pytest
from conftest import ServeProcess, sample
from helpers import scaled
from promreplay import NONFINITE, firing_minutes, nonfinite_alert_exprs

pytestmark = pytest.mark.integration  # starts servers or programs

STEPS = 800
RESTARTS = 4


class Writer(threading.Thread):
    """verl's file logger: one line per step, grad_norm null (NaN) or an overflowing literal (Inf) at a few
    steps, 10 ms apart. It writes at least STEPS steps and goes on until the test has done its restarts, so
    that every kill lands while verl writes however slow the machine is (a fixed count let a loaded machine
    finish writing before the kills)."""

    def __init__(self, path, rng: random.Random):
        super().__init__(daemon=True)
        self.path = path
        self.nan_steps = set(rng.sample(range(1, STEPS + 1), 9))
        self.written = 0
        self.restarts_done = threading.Event()

    def run(self):
        with open(self.path, "a") as fh:
            step = 0
            while step < STEPS or not self.restarts_done.is_set():
                step += 1
                data = {"actor/grad_norm": None if step in self.nan_steps else 0.4, "actor/pg_loss": 0.1,
                        "timing_s/step": 12.0}
                text = json.dumps({"step": step, "data": data})
                if step in self.nan_steps and step % 2:  # a float literal that reads as Inf, not a null
                    text = text.replace("null", "1" + "0" * 310 + ".0")
                fh.write(text + "\n")
                fh.flush()
                self.written = step
                time.sleep(0.01)


def scrape(side: ServeProcess) -> tuple[float | None, float]:
    m = side.metrics()
    return sample(m, "verl_training_step"), sample(m, NONFINITE, metric="verl_actor_grad_norm") or 0.0


@pytest.mark.parametrize("seed", [1, 2])
def test_kills_and_restarts_during_a_run_lose_nothing_and_page_for_nothing(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "run.jsonl"
    args = ("--verl-log", str(path), "--run", "r", "--rank", "0", "--recover-bytes", "3000")
    writer = Writer(path, rng)
    scrapes: list[tuple[float | None, float] | str] = []  # per scrape, or "restart"
    killed_at: list[int] = []  # the step written when each kill happened
    side = ServeProcess(*args)
    writer.start()
    for i in range(RESTARTS + 1):
        for _ in range(rng.randint(2, 5)):
            scrapes.append(scrape(side))
            time.sleep(rng.uniform(0.0, 0.3))
        if i == RESTARTS:
            break
        if rng.random() < 0.5:
            side.proc.send_signal(signal.SIGTERM)
        else:
            side.proc.kill()
        side.proc.wait(timeout=scaled(10))
        scrapes.append("restart")
        killed_at.append(writer.written)
        side = ServeProcess(*args)
    writer.restarts_done.set()
    writer.join(timeout=scaled(60))
    final = (float(writer.written), float(len(writer.nan_steps)))
    deadline = time.monotonic() + scaled(10)
    while scrape(side) != final and time.monotonic() < deadline:
        time.sleep(0.1)
    scrapes.append(scrape(side))
    side.stop()

    assert all(0 < k < writer.written for k in killed_at), f"a kill while verl was not writing: {killed_at}"
    # Every step and every NaN written is there in the end.
    assert scrapes[-1] == final
    # The step and the NaN counter never go down, across restarts too: a restart is not a counter reset.
    seen = [s for s in scrapes if s != "restart"]
    for (step_a, nan_a), (step_b, nan_b) in zip(seen, seen[1:], strict=False):
        assert nan_b >= nan_a
        assert step_a is None or (step_b is not None and step_b >= step_a)

    # Replay: one scrape a minute, a stale marker at each restart (the target was down for a minute).
    values: list = []
    real_nan_minutes = []
    for s in scrapes:
        if s == "restart":
            values.append("stale")
            continue
        if s[1] > next((v for v in reversed(values) if isinstance(v, float)), 0.0):
            real_nan_minutes.append(len(values))
        values.append(s[1])
    labels = 'job="verl", instance="n:9477", run="r", rank="0", metric="verl_actor_grad_norm"'
    expr = nonfinite_alert_exprs()["VerlNonFiniteGradNorm"]
    fired = firing_minutes(tmp_path, f"{NONFINITE}{{{labels}}}", values, expr, range(len(values)))
    for m in fired:
        assert any(m - 10 <= r <= m for r in real_nan_minutes), (
            f"alert at minute {m} with no new NaN in the 10 minutes before: {values}")


def test_a_restarted_sidecar_serves_the_recovered_nan_count_from_its_first_scrape(tmp_path):
    """The deterministic case behind the suite above: a sidecar (re)started on a long log answers its very first
    scrape with every NaN of the file counted, not with the counter missing while its follower still reads
    (which a scrape sees as the counter back at 0, a reset)."""
    path = tmp_path / "run.jsonl"
    nan_steps = set(range(7, 60_000, 6_000))
    with open(path, "w") as fh:
        for step in range(1, 60_001):
            grad = None if step in nan_steps else 0.4
            fh.write(json.dumps({"step": step, "data": {"actor/grad_norm": grad, "timing_s/step": 12.0}}) + "\n")
    side = ServeProcess("--verl-log", str(path), "--run", "r", "--rank", "0")
    try:
        assert scrape(side) == (60_000.0, float(len(nan_steps)))
    finally:
        side.stop()
