"""A real hang, end to end: two CPU ranks in a torch.distributed gloo group, one of which stops entering
all_reduce (it sits in a slow compute_score); a real `verl-exporter serve` following the run's verl-format log,
which stops; the sidecar's own stall trigger captures real py-spy stacks of both ranks and names the odd one.

The spec's stall floor (at_least: 300 s of VerlTrainingStalledRelative) would make the test wait five minutes,
so the sidecar reads an overrides file that sets that one knob to 3 s (--overrides), as a team with short steps
would: the trigger is still the spec's declaration and its judge, only with a shorter floor. The ranks' Flight
Recorder dumps are real too: torch 2.13 records gloo collectives (TORCH_FR_BUFFER_SIZE), and each rank writes its
dump with torch's _dump_fr_trace_json from a thread (a rank hung in a collective releases the GIL).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import http_get, sample, wait_for
from helpers import CONTROL_TOKEN as TOKEN
from helpers import TESTS, free_port, scaled
from helpers import control_post as post
from relay_helpers import am_alert, webhook
from relay_helpers import post as relay_post
from verl_exporter.relay.app import Relay
from verl_exporter.relay.config import parse_config

pytestmark = pytest.mark.integration
STEP_S = 0.1
HANG_AT = 15
FLOOR_S = 3


def short_floor_overrides(tmp_path: Path) -> Path:
    """An overrides file lowering VerlTrainingStalledRelative's floor (at_least) to FLOOR_S, nothing else."""
    path = tmp_path / "verl-exporter.yaml"
    path.write_text(f"alerts:\n  VerlTrainingStalledRelative: {{thresholds: {{at_least: {FLOOR_S}}}}}\n")
    return path


def test_a_gloo_hang_is_captured_with_real_stacks_and_the_odd_rank_named(tmp_path, serve):
    py_spy = Path(sys.executable).parent / "py-spy"
    if not py_spy.exists():
        pytest.skip("py-spy is not installed (pip install 'verl-exporter[forensics]')")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    log, forensics, fr = tmp_path / "run.jsonl", tmp_path / "forensics", tmp_path / "fr"
    fr.mkdir()
    launcher = subprocess.Popen([sys.executable, str(TESTS / "hang_gloo.py"), str(log), str(free_port()),
                                 str(HANG_AT), str(STEP_S), str(fr)])
    try:
        side = serve("--verl-log", str(log), "--run", "hang", "--rank", "0", "--trainer-pid", str(launcher.pid),
                     "--overrides", str(short_floor_overrides(tmp_path)), "--forensics-dir", str(forensics),
                     "--no-forensics-native", "--forensics-flight-recorder", str(fr / "fr_rank_"), "--control-file",
                     str(tmp_path / "control.json"), "--control-token-env", "VERL_CTL", env={"VERL_CTL": TOKEN})
        wait_for(lambda: sample(side.metrics(), "verl_training_step") == HANG_AT - 1, timeout=40)
        last_step = time.time()
        wait_for(lambda: list(forensics.glob("capture-*.json")), timeout=FLOOR_S + 15)
        captured = time.time()
        [path] = forensics.glob("capture-*.json")
        doc = json.loads(path.read_text())
        assert doc["trigger"] == "stall" and doc["reason"].startswith("VerlTrainingStalledRelative")
        ranks = {p["rank"]: p for p in doc["processes"] if p["rank"] is not None}
        assert sorted(ranks) == ["0", "1"] and all("threads" in p for p in ranks.values())
        assert doc["verdict"].startswith(
            "rank 0 waits in all_reduce (torch/distributed/distributed_c10d.py), called from rank_main "
            "(hang_gloo.py); rank 1 is in rank_main → compute_score (hang_gloo.py)")
        # torch's own dumps: rank 0 entered the all_reduce of step HANG_AT, rank 1 never did
        assert doc["flight_recorder"] == (f"Flight Recorder: ranks 0 entered collective #{HANG_AT} "
                                          f"(gloo:all_reduce); rank 1 never did (last: 1 at #{HANG_AT - 1})")
        # within the stall window: the floor, plus the 1 s check and the capture itself
        assert captured - last_step < FLOOR_S + scaled(10)

        health = json.loads(http_get(side.url + "/healthz")[2])
        assert health["forensics"]["last_capture"]["path"] == str(path)
        m = side.metrics()
        assert sample(m, "verl_exporter_forensics_captures_total", trigger="stall") == 1
        assert sample(m, "verl_exporter_forensics_last_capture_timestamp_seconds") == doc["time"]

        # the relay's forensics action: with the token only, and it answers with the verdict
        assert post(side.url + "/control/forensics")[0] == 401
        status, answer = post(side.url + "/control/forensics", TOKEN, b'{"reason": "VerlTrainingStalled"}')
        assert status == 200 and answer["applied"] and "rank 1 is in rank_main → compute_score" in answer["verdict"]
        assert answer["path"] == str(path)  # a request within MIN_REQUEST_GAP_S gets the capture just made

        # the page: a real relay whose forensics action on the stall alert asks this sidecar, then sends the
        # verdict (to a console target, which shows the very body a DingTalk robot would get)
        out = tmp_path / "console.jsonl"
        relay = Relay(parse_config({
            "targets": {"console": {"type": "console", "show": "body", "file": str(out)}},
            "routes": [{"targets": ["console"]}],
            "actions": [{"matchers": {"alertname": "VerlTrainingStalled"}, "action": "forensics", "url": side.url,
                         "token_env": "VERL_CTL"}]}, environ={"VERL_CTL": TOKEN}), listen="127.0.0.1:0").start()
        try:
            stalled = am_alert("VerlTrainingStalled", "critical", 0)
            assert relay_post(relay, "training-critical", webhook("training-critical", [stalled]), token=None)[0] == 200
            wait_for(lambda: "VerlHangForensics" in (out.read_text() if out.exists() else ""), timeout=20)
        finally:
            relay.stop(drain_seconds=1)
        page = [json.loads(line)["markdown"]["text"] for line in out.read_text().splitlines()
                if "VerlHangForensics" in line][0]
        assert "rank 1 is in rank_main → compute_score" in page and path.name.replace(".", "·") in page
    finally:
        children = psutil.Process(launcher.pid).children(recursive=True)
        launcher.kill()
        for c in children:
            c.kill()
        launcher.wait()
