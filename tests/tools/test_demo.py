"""The bundled demo run is reproducible from its script, and `verl-exporter demo` replays it end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import scaled
from verl_exporter.tools.demo import DEMO_FAULT, demo_lines


def test_demo_run_is_reproducible():
    assert demo_lines() == demo_lines()


def test_demo_run_carries_its_fault_as_verl_writes_it():
    rows = [json.loads(x) for x in demo_lines()]
    assert [r["step"] for r in rows] == list(range(1, 301))
    nulls = {r["step"] for r in rows if r["data"]["actor/grad_norm"] is None}
    assert nulls == {DEMO_FAULT.at + 5, DEMO_FAULT.at + 6, DEMO_FAULT.at + 7}
    assert all(rows[s - 1]["data"]["actor/pg_loss"] is None for s in nulls)
    before = max(r["data"]["actor/grad_norm"] for r in rows if r["step"] < DEMO_FAULT.at)
    peak = max(r["data"]["actor/grad_norm"] or 0 for r in rows)
    assert peak > 10 * before  # the explosion precedes the NaN, as in verl issue reports
    assert rows[-1]["data"]["response_length/mean"] < 0.1 * rows[DEMO_FAULT.at - 2]["data"]["response_length/mean"]


def test_demo_run_has_the_quirks_of_real_files():
    rows = [json.loads(x)["data"] for x in demo_lines()]
    assert all(isinstance(d["perf/total_num_tokens"], int) and isinstance(d["training/global_step"], int)
               for d in rows)
    val_steps = [i for i, d in enumerate(rows, 1) if any(k.startswith("val-core/") for k in d)]
    assert val_steps == list(range(20, 301, 20))
    assert [i for i, d in enumerate(rows, 1) if "timing_s/save_checkpoint" in d] == [50, 100, 150, 200, 250, 300]
    assert [(i, d["training/note"]) for i, d in enumerate(rows, 1) if "training/note" in d] == \
        [(100, "resumed-from-ckpt")]


@pytest.mark.integration
def test_demo_command_replays_into_a_live_sidecar():
    proc = subprocess.run(
        [sys.executable, "-m", "verl_exporter", "demo", "--sidecar-only", "--rate", "400", "--exit-after-replay",
         "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr
    assert "/metrics" in proc.stdout
    assert "replay finished: 300 lines parsed, latest step 300" in proc.stdout
    assert "verl_actor_grad_norm=3" in proc.stdout
