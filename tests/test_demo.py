"""The bundled demo run is reproducible from its script, and `verl-exporter demo` replays it end to end."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys

from conftest import REPO


def load_generator():
    spec = importlib.util.spec_from_file_location("make_demo_run", REPO / "scripts" / "make_demo_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bundled_run_is_what_the_script_generates():
    gen = load_generator()
    bundled = gzip.decompress((REPO / "exporter/verl_exporter/data/demo_run.jsonl.gz").read_bytes())
    assert bundled == gen.encode(gen.generate())


def test_bundled_run_carries_its_fault_as_verl_writes_it():
    gen = load_generator()
    rows = [json.loads(x) for x in gen.encode(gen.generate()).splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 301))
    nulls = {r["step"] for r in rows if r["data"]["actor/grad_norm"] is None}
    assert nulls and min(nulls) > gen.FAULT["start_step"]
    before = max(r["data"]["actor/grad_norm"] for r in rows if r["step"] < gen.FAULT["start_step"])
    peak = max(r["data"]["actor/grad_norm"] or 0 for r in rows)
    assert peak > 10 * before  # the explosion precedes the NaN, as in verl issue reports


def test_demo_command_replays_into_a_live_sidecar():
    proc = subprocess.run(
        [sys.executable, "-m", "verl_exporter", "demo", "--sidecar-only", "--rate", "400", "--exit-after-replay",
         "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "/metrics" in proc.stdout
    assert "replay finished: 300 lines parsed, latest step 300" in proc.stdout
    assert "verl_actor_grad_norm=3" in proc.stdout
