"""The golden /metrics (node_exporter's end-to-end habit): a sidecar fed by a fixed verl log
(fixtures/golden/verl.jsonl), the fake /proc of fixtures/proc_t1 and a fake NVML node, scraped once, must
answer exactly fixtures/golden/metrics.txt: every name, label, type and help text, and every value that does
not depend on the clock or the machine (those are masked). A rename, a new series or a changed help shows up
as a diff of that file, to be reviewed with the change.

    # rewrite the file after a reviewed change
    VERL_EXPORTER_UPDATE_GOLDEN=1 pytest tests/sidecar/test_sidecar_golden_metrics.py
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

import pytest
from fake_pynvml import busy_node
from helpers import FIXTURES
from verl_exporter.exposition.app import make_app
from verl_exporter.sidecar.config import build_config
from verl_exporter.sidecar.sidecar import Sidecar

GOLDEN = FIXTURES / "golden" / "metrics.txt"
UPDATE = os.environ.get("VERL_EXPORTER_UPDATE_GOLDEN", "") not in ("", "0")
MASK = "<masked>"
# Series whose values change from run to run or machine to machine, with why.
TIME_VARYING = re.compile("|".join([
    r"process_\w+",  # client_python's view of this test process (CPU, memory, fds, start time)
    r"\w+_timestamp_seconds",  # wall-clock times: when a step was seen, a checkpoint saved, a collector ran
    r"verl_exporter_collector_duration_seconds", r"verl_exporter_last_scrape_duration_seconds",  # timings
    r"verl_trainer_resident_memory_bytes",  # this test process plays the trainer
    r"verl_host_filesystem_(size|avail)_bytes",  # the real filesystem holding the temporary checkpoint dir
    r"verl_checkpoint_age_seconds",
]))
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})? (?P<value>\S+)$")


class GoldenSidecar(Sidecar):
    """The real sidecar, its NVML the fake node's; this machine's CUDA_VISIBLE_DEVICES is not looked at."""

    def context(self):
        fake = busy_node(2, nvlink_links=4)
        return dataclasses.replace(super().context(), nvml_loader=lambda: fake, environ={})


def checkpoint_dir(root: Path) -> Path:
    """verl's layout: two saves of fixed sizes and the tracker naming the latest."""
    for step in (10, 20):
        actor = root / f"global_step_{step}" / "actor"
        actor.mkdir(parents=True)
        (actor / "model_world_size_1_rank_0.pt").write_bytes(b"\0" * 4096)
        (root / f"global_step_{step}" / "data.pt").write_bytes(b"\0" * 512)
    (root / "latest_checkpointed_iteration.txt").write_text("20")
    return root


def scrape(tmp_path: Path) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "verl.jsonl"
    shutil.copy(FIXTURES / "golden" / "verl.jsonl", log)
    config = build_config({}, {
        "listen": "127.0.0.1:0", "verl_log": str(log), "run": "golden", "rank": 0, "local_rank": 0, "gpus": "all",
        "procfs": str(FIXTURES / "proc_t1"), "checkpoint_dir": str(checkpoint_dir(tmp_path / "ckpt")),
        "trainer_pid": os.getpid()}, origin="golden")
    sidecar = GoldenSidecar(config)
    try:
        sidecar.follower.poll()  # the whole log, at once: no thread, no timing
        for collector in sidecar.sampler.collectors:
            assert sidecar.sampler.run_once(collector, slow=True), collector.name
        app = make_app(sidecar.registry, sidecar.self_metrics, sidecar.health,
                       renderers=[sidecar.store.render, sidecar.sampler.render])
        body = b""
        for _ in range(2):  # the second scrape also shows the first one's duration
            status = {}
            body = b"".join(app({"PATH_INFO": "/metrics", "HTTP_ACCEPT": "text/plain", "HTTP_ACCEPT_ENCODING": ""},
                                lambda s, h, status=status: status.update(code=s)))
            assert status["code"].startswith("200")
    finally:
        sidecar.sampler.stop()
    return body.decode().replace(str(tmp_path), "<tmp>")


def masked(text: str) -> str:
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and TIME_VARYING.fullmatch(m.group("name")):
            line = f"{m.group('name')}{m.group('labels') or ''} {MASK}"
        out.append(line)
    return "\n".join(out) + "\n"


def test_metrics_match_the_golden_file(tmp_path):
    got = masked(scrape(tmp_path))
    if UPDATE:
        GOLDEN.write_text(got, encoding="utf-8")
        pytest.skip(f"rewrote {GOLDEN.relative_to(FIXTURES.parent.parent)}: review its diff")
    assert GOLDEN.exists(), "no golden file yet: run with VERL_EXPORTER_UPDATE_GOLDEN=1"
    want = GOLDEN.read_text(encoding="utf-8")
    if got != want:
        import difflib

        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(GOLDEN), "/metrics"))
        pytest.fail("/metrics differs from the golden file (a rename or a new series? if intended, regenerate "
                    f"with VERL_EXPORTER_UPDATE_GOLDEN=1 and review the diff):\n{diff}")


def test_the_masked_values_are_the_only_ones_that_vary(tmp_path):
    """Two sidecars scraped a moment apart differ only where the golden file masks."""
    first = scrape(tmp_path / "a")
    second = scrape(tmp_path / "b")
    assert masked(first) == masked(second)
    assert first.count("\n") == second.count("\n")


def test_the_golden_file_covers_every_kind_of_series():
    text = GOLDEN.read_text(encoding="utf-8")
    for needle in ("# TYPE verl_training_step gauge", "verl_training_nonfinite_values_total{metric=",
                   "verl_unmapped_custom_my_metric", "verl_host_cpu_seconds_total{mode=\"iowait\"",
                   "verl_host_disk_io_time_seconds_total{device=\"nvme0n1\"", "verl_gpu_utilization_ratio{",
                   "verl_gpu_nvlink_link_up{", "verl_checkpoint_latest_step", "verl_exporter_build_info{",
                   "verl_detector_"):
        assert needle in text, needle
