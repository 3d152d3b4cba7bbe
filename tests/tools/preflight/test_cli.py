"""verl-exporter preflight: a healthy fake node passes; each injected fault fails its check with a line that
names it and says what to do; bad input is one clear line and the right exit status; nothing on disk
changes but what the preflight is asked to write."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fabric_tree import healthy_node, write_port
from fake_pynvml import NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, FakeNvml
from verl_exporter.checkpoint.manifest import TRACKER_NAME, write_manifest
from verl_exporter.cli import main
from verl_exporter.spec import load_spec
from verl_exporter.spec.overrides import PreflightKnobs, parse_overrides
from verl_exporter.tools.preflight.cli import finish, run_checks
from verl_exporter.tools.preflight.report import Options

SPEC = load_spec()
UPTIME_S = 100_000.0


def save(ckpt: Path, step: int, files: dict[str, bytes], manifest: bool = True, tracker: bool = True) -> Path:
    """A verl checkpoint folder global_step_<step> with these files (and its manifest, and the tracker)."""
    step_dir = ckpt / f"global_step_{step}"
    for rel, data in files.items():
        (step_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / rel).write_bytes(data)
    if manifest:
        write_manifest(step_dir)
    if tracker:
        (ckpt / TRACKER_NAME).write_text(str(step))
    return step_dir


FILES = {"actor/model_world_size_2_rank_0.pt": b"a" * 1000, "actor/huggingface/config.json": b"{}",
         "data.pt": b"d" * 100}


class Node:
    """A fake node: 8 GPUs with NVLink, 3 fabric ports, a kernel log, a checkpoint; Options over them."""

    def __init__(self, root: Path, name: str = "node-a", manifests: Path | None = None):
        self.root = root
        self.nvml = FakeNvml(8, nvlink_links=4)
        for g in self.nvml.gpus:
            g.set_nvlink(4)
        self.sysfs = healthy_node(root / "sys")
        (root / "proc").mkdir()
        (root / "proc" / "uptime").write_text(f"{UPTIME_S} 1.0\n")
        self.kmsg = root / "kmsg"
        self.kmsg.write_text("6,1,1000000,-;Linux version 6.1\n")
        self.ckpt = root / "ckpt"
        self.ckpt.mkdir()
        self.step_dir = save(self.ckpt, 100, FILES)
        self.ticks: list = []  # what happens to the node while the fabric check samples
        self.o = Options(spec=SPEC, node=name, gpus=8, nvml_loader=lambda: self.nvml, procfs=str(root / "proc"),
                         kmsg=str(self.kmsg), sysfs_root=str(self.sysfs), ports=3, fabric_sample_s=1.0,
                         checkpoint_dir=str(self.ckpt), max_ckpt_to_keep=2, sleep=self._sleep,
                         manifests_dir=str(manifests) if manifests else None,
                         knobs=PreflightKnobs(nodes_wait="0s"))

    def _sleep(self, seconds: float) -> None:
        for tick in self.ticks:
            tick()

    def run(self, skip: set[str] | None = None):
        findings, statuses = run_checks(self.o, skip or set())
        return findings, statuses

    def failures(self, check: str) -> list[str]:
        findings, _ = self.run()
        return [f.line for f in findings if f.check == check and not f.ok]


def tree(path: Path) -> dict[str, tuple[int, int] | None]:
    """Every entry, with size and mtime for files (a folder's mtime moves with the probe made and removed)."""
    return {str(p.relative_to(path)): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*"))}


def test_a_healthy_node_passes_every_check_and_changes_nothing(tmp_path):
    node = Node(tmp_path)
    before = tree(tmp_path)
    findings, statuses = node.run()
    assert statuses == {"gpu": "pass", "fabric": "pass", "disk": "pass", "checkpoint": "pass", "agreement": "pass",
                        "paging": "pass"}, [f.line for f in findings if not f.ok]
    lines = {f.check: f.line for f in findings}
    assert lines["gpu"].startswith("8 GPU(s) answer") and "32 NVLink link(s) up" in lines["gpu"]
    assert "3 port(s) ACTIVE and LinkUp" in lines["fabric"]
    assert "3 files match its manifest (3 unchanged since it was written, 0 hashed)" in lines["checkpoint"]
    assert tree(tmp_path) == before  # the writability probe is gone again


# ------------------------------------------------------------------------------------------ GPU faults
@pytest.mark.parametrize("fault, words", [
    (lambda f: f.lose(3), "1 of the 8 GPUs NVML counts do not answer (lost)"),
    (lambda f: setattr(f.gpu(2), "remapped_rows", (0, 0, 1, 0)),
     "GPU 2: A GPU has a row remapping waiting for a reset (VerlGPURowRemapPending, value 1)"),
    (lambda f: setattr(f.gpu(5), "remapped_rows", (0, 0, 0, 1)), "GPU 5:"),
    (lambda f: f.gpu(1).ecc.update({(NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC): 2}),
     "GPU 1: A GPU had an uncorrectable ECC memory error (VerlGPUUncorrectableECC: 2)"),
    (lambda f: f.gpu(4).nvlink_states.__setitem__(2, 0), "GPU 4: An NVLink link is down (VerlNVLinkDown, value 1)"),
    (lambda f: setattr(f.gpu(6), "clock_reasons", 0x40), "hw_thermal_slowdown"),
])
def test_each_gpu_fault_fails_the_gpu_check_naming_the_gpu(tmp_path, fault, words):
    node = Node(tmp_path)
    fault(node.nvml)
    lines = node.failures("gpu")
    assert len(lines) == 1 and words in lines[0], lines
    assert ";" in lines[0]  # followed by what to do (the alert's runbook action)


def test_fewer_gpus_than_expected_fail(tmp_path):
    node = Node(tmp_path)
    node.o.gpus = 16
    assert node.failures("gpu") == ["8 GPU(s) answer, --gpus expects 16; a GPU is missing or the node is not the "
                                    "one meant: drain it or fix --gpus"]


def test_a_recent_critical_xid_in_the_kernel_log_fails_an_old_one_or_a_harmless_one_does_not(tmp_path):
    node = Node(tmp_path)
    recent = int((UPTIME_S - 600) * 1e6)
    old = int((UPTIME_S - 3 * 86400 + 200_000) * 1e6) if UPTIME_S > 3 * 86400 else 1
    node.kmsg.write_text(
        f"4,10,{old},-;NVRM: Xid (PCI:0000:28:00): 79, pid=1, GPU has fallen off the bus.\n"
        f"4,11,{recent},-;NVRM: Xid (PCI:0000:38:00): 13, pid=1, Graphics Exception\n")
    assert node.failures("gpu") == []  # 79 is older than 24h (uptime 27.8 h); 13 is not critical
    node.kmsg.write_text(f"4,12,{recent},-;NVRM: Xid (PCI:0000:28:00): 79, pid=1, GPU has fallen off the bus.\n")
    (line,) = node.failures("gpu")
    assert line.startswith("GPU 1 (PCI 0000:28:00): critical XID 79 0.2 h ago (within 24h)")


def test_the_critical_xid_codes_are_the_alerts_not_a_copy():
    from verl_exporter.spec.overrides import apply_overrides
    from verl_exporter.tools.preflight.gpus import XID_ALERT, critical_xids

    codes = critical_xids(SPEC)
    assert {"48", "79", "119"} <= codes and "13" not in codes
    alert = next(a for a in SPEC.alerts() if a.alert == XID_ALERT)
    assert f'xid=~"{"|".join(str(c) for c in SPEC.codes["critical_xids"].codes)}"' in alert.promql("")
    # an overrides file's set is the one preflight checks, as the alert pages on it
    assert critical_xids(apply_overrides(SPEC, {"codes": {"critical_xids": [13, 79]}})) == {"13", "79"}


def test_no_nvml_fails_with_what_to_do(tmp_path):
    node = Node(tmp_path)
    node.o.nvml_loader = None  # the real binding: not on this machine
    (line,) = node.failures("gpu")
    assert line.startswith("NVML is not usable: ") and "--skip gpu" in line


# ------------------------------------------------------------------------------------------ fabric faults
def test_a_port_down_at_half_rate_or_with_rising_errors_fails(tmp_path):
    node = Node(tmp_path)
    write_port(node.sysfs, "mlx5_1", 2, state="1: DOWN", phys_state="3: Disabled", rate="100 Gb/sec (2X HDR)",
               link_layer="Ethernet")
    assert node.failures("fabric") == ["mlx5_1 port 2 is DOWN / Disabled, not ACTIVE / LinkUp: check its cable and "
                                       "switch port (ibstat), or drain the node"]
    node = Node(tmp_path / "b")
    write_port(node.sysfs, "mlx5_1", 1, rate="50 Gb/sec (2X HDR)", link_layer="Ethernet")
    (line,) = node.failures("fabric")
    assert line.startswith("mlx5_1 port 1 runs at 50 Gb/s, below 100 Gb/s: a degraded link")
    node = Node(tmp_path / "c")
    counters = node.sysfs / "class/infiniband/mlx5_0/ports/1/counters"
    node.ticks.append(lambda: (counters / "symbol_error").write_text("7\n"))
    node.ticks.append(lambda: (counters / "port_xmit_data").write_text("999999999\n"))  # traffic is fine
    assert node.failures("fabric") == ["mlx5_0 port 1: error counters rose in 1 s (symbol_error +7); a bad cable, "
                                       "transceiver or switch port: drain the node or fix the link"]


def test_bad_sysfs_input_is_one_clear_line_each(tmp_path):
    node = Node(tmp_path)
    port = node.sysfs / "class/infiniband/mlx5_0/ports/1"
    (port / "rate").unlink()
    (port / "phys_state").unlink()  # a port with half its files
    (port / "counters" / "link_downed").write_text("lots\n")  # a non-numeric counter
    (line,) = node.failures("fabric")
    assert line.startswith("mlx5_0 port 1: unreadable sysfs file(s): phys_state: No such file or directory; "
                           "rate: No such file or directory; counters/link_downed: not a counter: 'lots'")
    node.o.sysfs_root = str(tmp_path / "nowhere")  # a missing sysfs tree, ports expected
    (line,) = node.failures("fabric")
    assert line.startswith("no InfiniBand/RoCE device: ") and "--ports expects 3" in line
    node.o.ports = None
    assert node.failures("fabric") == []


# ------------------------------------------------------------------------------------------ disk faults
def test_a_disk_too_full_for_the_next_saves_fails(tmp_path, monkeypatch):
    node = Node(tmp_path)

    class Full:
        f_bavail, f_frsize = 1, 1000  # 1000 bytes free; the checkpoint has 1102

    monkeypatch.setattr(os, "statvfs", lambda path: Full)
    (line,) = node.failures("disk")
    assert "the next 1 save(s) of 0.0 GB need 0.0 GB (with a 10% margin)" in line
    assert "max_actor_ckpt_to_keep" in line


def test_a_read_only_checkpoint_folder_fails(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    node = Node(tmp_path)
    node.ckpt.chmod(0o555)
    try:
        (line,) = node.failures("disk")
    finally:
        node.ckpt.chmod(0o755)
    assert line.startswith(f"{node.ckpt} is not writable (Permission denied)")


# ------------------------------------------------------------------------------------------ the checkpoint
def test_a_tracker_naming_a_missing_step_fails(tmp_path):
    node = Node(tmp_path)
    (node.ckpt / TRACKER_NAME).write_text("120")
    assert node.failures("checkpoint") == [
        f"{TRACKER_NAME} names step 120, but {node.ckpt / 'global_step_120'} does not exist; the newest folder is "
        "global_step_100: point the tracker at a complete checkpoint"]


def test_a_garbled_tracker_or_partial_or_unreadable_checkpoint_fails(tmp_path):
    node = Node(tmp_path)
    (node.ckpt / TRACKER_NAME).write_text("step one hundred")
    (line,) = node.failures("checkpoint")
    assert line.startswith(f"{node.ckpt / TRACKER_NAME} does not hold a step number")
    node = Node(tmp_path / "b")
    (node.step_dir / "data.pt").write_bytes(b"d" * 10)  # a partial save
    (line,) = node.failures("checkpoint")
    assert line.startswith("global_step_100 does not match its manifest: data.pt has 10 bytes; the manifest says 100")
    if os.geteuid() != 0:
        node = Node(tmp_path / "c")
        (node.step_dir / "data.pt").chmod(0)  # an unreadable checkpoint file
        (line,) = node.failures("checkpoint")
        assert "data.pt cannot be read" in line and "Permission denied" in line


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir])
def test_a_fifo_or_folder_as_the_tracker_fails_without_blocking_the_preflight(tmp_path, make):
    """The tracker read itself never blocks; saying why it holds no step opened a FIFO and waited for ever."""
    import threading

    node = Node(tmp_path)
    tracker = node.ckpt / TRACKER_NAME
    tracker.unlink()
    make(tracker)
    got: list[list[str]] = []
    checks = threading.Thread(target=lambda: got.append(node.failures("checkpoint")), daemon=True)
    checks.start()
    checks.join(timeout=10)
    blocked = checks.is_alive()
    if blocked:  # let the blocked open() go before failing
        os.close(os.open(tracker, os.O_WRONLY | os.O_NONBLOCK))
        checks.join(timeout=10)
    assert not blocked
    assert got == [[f"{tracker} is not a regular file: fix it to name the step to resume (e.g. the newest "
                    "complete global_step_N)"]]


def test_a_manifest_already_written_is_not_hashed_again_but_a_changed_file_is(tmp_path, monkeypatch):
    from verl_exporter.checkpoint import manifest

    node = Node(tmp_path)
    hashed: list[str] = []
    real = manifest.sha256_stable
    monkeypatch.setattr(manifest, "sha256_stable", lambda path, *a: hashed.append(str(path)) or real(path, *a))
    node.run()
    assert hashed == []
    target = node.step_dir / "data.pt"
    target.write_bytes(b"e" * 100)  # same size, other bytes, written after the manifest
    later = (node.step_dir / manifest.MANIFEST_NAME).stat().st_mtime_ns + 10**9
    os.utime(target, ns=(later, later))
    (line,) = node.failures("checkpoint")
    assert hashed == [str(target)] and "data.pt does not match its SHA-256" in line


# ------------------------------------------------------------------------------------------ across nodes
def two_nodes(tmp_path) -> tuple[Node, Node, Path]:
    shared = tmp_path / "manifests"
    shared.mkdir()
    a, b = Node(tmp_path / "a", "node-a", shared), Node(tmp_path / "b", "node-b", shared)
    a.o.nodes = b.o.nodes = 2
    return a, b, shared


def test_two_healthy_nodes_agree(tmp_path):
    a, b, shared = two_nodes(tmp_path)
    b.run()
    assert a.failures("agreement") == []
    assert sorted(os.listdir(shared)) == ["node-a.json", "node-b.json"]


def test_a_partial_checkpoint_on_one_of_two_nodes_names_that_node(tmp_path):
    a, b, _ = two_nodes(tmp_path)
    (b.step_dir / "data.pt").write_bytes(b"d" * 10)
    assert b.failures("checkpoint")  # b's own check fails, and says so in what it publishes
    lines = a.failures("agreement")
    assert lines == ["node node-b's own checkpoint check failed on step 100 (its preflight names the problem): fix "
                     "that node or resume every node from an older step"]


def test_disagreeing_hashes_and_steps_name_the_odd_node(tmp_path):
    shared = tmp_path / "manifests"
    shared.mkdir()
    nodes = [Node(tmp_path / n, n, shared) for n in ("n0", "n1", "n2")]
    odd = nodes[2]
    # n2's manifest is whole and verifies, but it holds other bytes: no local check can see that
    (odd.step_dir / "actor/huggingface/config.json").write_bytes(b"[]")
    write_manifest(odd.step_dir)
    for n in nodes[1:]:
        n.run()
    nodes[0].o.nodes = 3
    assert nodes[0].failures("agreement") == [
        "node n2 differs from the others on 1 shared file(s) (actor/huggingface/config.json): its copy of step 100 "
        "is partial or corrupt; recopy it or resume every node from an older step"]
    save(odd.ckpt, 90, FILES)  # n2's tracker now names another step
    odd.run()
    (line,) = nodes[0].failures("agreement")
    assert line.startswith("node n2 would resume from step 90, the others from another (n0: 100, n1: 100)")


def test_a_node_with_no_manifest_or_a_hostile_one_fails(tmp_path):
    a, b, shared = two_nodes(tmp_path)
    assert a.failures("agreement") == [f"only 1 of 2 nodes published a manifest in {shared} within 0s (node-a): "
                                       "run the preflight on every node with the same --manifests-dir"]
    (shared / "node-b.json").write_text('{"format": "verl-exporter-preflight-node", "format_version": 1, '
                                        '"node": "node-b", "step": "100", "local_ok": true, "files": {}}')
    lines = a.failures("agreement")
    assert lines[0] == f"{shared / 'node-b.json'}: step is not a step number; remove it, or rerun the preflight on " \
                       "that node"


def test_without_manifests_the_nodes_are_compared_by_hashing(tmp_path):
    a, b, _ = two_nodes(tmp_path)
    for n in (a, b):
        (n.step_dir / "verl_exporter_manifest.json").unlink()
    (b.step_dir / "data.pt").write_bytes(b"x" * 100)
    b.run()
    findings, statuses = a.run()
    assert statuses["checkpoint"] == "pass" and "has no manifest" in next(f.line for f in findings
                                                                             if f.check == "checkpoint")
    assert statuses["agreement"] == "fail"


# ------------------------------------------------------------------------------------------ the command
def test_exit_status_json_skip_and_the_result_file(tmp_path, capsys):
    node = Node(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    node.o.nvml_loader = None
    assert finish(node.o, set(), True, str(state)) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is False and doc["checks"]["gpu"] == "fail"
    assert finish(node.o, {"gpu"}, False, str(state)) == 0
    out = capsys.readouterr().out
    assert "skip gpu: skipped (--skip gpu)" in out and out.rstrip().endswith("preflight: passed")
    from verl_exporter.sidecar.collectors.preflight import read_result

    assert read_result(str(state / "preflight.json"))["checks"] == {
        "gpu": "skip", "fabric": "pass", "disk": "pass", "checkpoint": "pass", "agreement": "pass", "paging": "pass"}


def test_the_command_line(tmp_path, capsys):
    node = Node(tmp_path)
    args = ["preflight", "--skip", "gpu", "--checkpoint-dir", str(node.ckpt), "--sysfs-root", str(node.sysfs),
            "--ports", "3", "--fabric-sample", "0", "--overrides", ""]
    assert main(args) == 0
    assert main(args[:-1] + [str(tmp_path / "none.yaml")]) == 2  # an overrides file that is not there
    with pytest.raises(SystemExit) as e:
        main(["preflight", "--skip", "gpus"])
    assert e.value.code == 2
    capsys.readouterr()


def test_knobs_come_from_the_overrides_file():
    loaded = parse_overrides({"preflight": {"xid_lookback": "2h", "free_space_margin": 0.5}})
    assert loaded.model.preflight.xid_lookback == "2h" and loaded.model.preflight.saves_ahead == 2
    from verl_exporter.spec.overrides import OverridesError

    with pytest.raises(OverridesError, match="preflight.xid_lookback"):
        parse_overrides({"preflight": {"xid_lookback": "soon"}})
    with pytest.raises(OverridesError, match="preflight.nope"):
        parse_overrides({"preflight": {"nope": 1}})


def test_with_three_nodes_a_file_every_other_node_holds_is_missed_on_the_one_that_lacks_it(tmp_path):
    shared = tmp_path / "manifests"
    shared.mkdir()
    nodes = [Node(tmp_path / n, n, shared) for n in ("n0", "n1", "n2")]
    (nodes[1].step_dir / "data.pt").unlink()
    write_manifest(nodes[1].step_dir)  # a manifest written after a partial save verifies locally
    for n in nodes[1:]:
        n.run()
    nodes[0].o.nodes = 3
    assert nodes[0].failures("agreement") == [
        "node n1 lacks 1 file(s) every other node holds (data.pt): a partial save; recopy it or resume from an older "
        "step"]


def test_a_bad_node_name_is_bad_usage(tmp_path, capsys):
    a, _, _ = two_nodes(tmp_path)
    a.o.node = "../etc"
    assert finish(a.o, {"gpu"}, False, None) == 2
    assert "--node '../etc': a node name is letters" in capsys.readouterr().err
