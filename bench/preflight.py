"""The pre-flight on a node with 8 fake GPUs (fake NVML, 4 NVLink links each), 8 fabric ports (a fake sysfs
tree) and a checkpoint tree of sparse files, against `sha256sum` of the same files in the same run.

    python bench/preflight.py [--size-gb 100] [--files 16] [--dir DIR] [--out preflight.json]

1. Builds global_step_100/ of --size-gb GB in --files sparse shards (plus config and data.pt) and the tracker.
2. Baseline: `sha256sum` over every file of the checkpoint (one process, as a person would check by hand).
3. Run 1, no manifest yet: the pre-flight with --manifests-dir (one node) hashes every file to publish
   this node's view; its time over the baseline's is the ratio (about 1: both read and hash every byte).
4. The manifest is written (as the checkpoint callback does after a save), then run 2: the manifest is not
   hashed again, so the bytes hashed must be 0 and the time a small fraction of the baseline's.

The fabric check's error-counter sample is 0 s here (its knob default, 10 s, is a wait, not work). Sparse
files read as zeros from the page cache without disk I/O: this measures hashing, not the disk. At 100 GB
on two cores the baseline alone takes minutes; --size-gb 4 gives the figure in seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import REPO  # noqa: F401 - sets up imports of the package and the fakes

# isort: split

from fabric_tree import write_port  # noqa: E402
from fake_pynvml import FakeNvml  # noqa: E402
from verl_exporter.checkpoint import manifest  # noqa: E402
from verl_exporter.checkpoint.manifest import TRACKER_NAME, write_manifest  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.spec.overrides import PreflightKnobs  # noqa: E402
from verl_exporter.tools.preflight import resume  # noqa: E402
from verl_exporter.tools.preflight.cli import run_checks  # noqa: E402
from verl_exporter.tools.preflight.report import Options  # noqa: E402


def build(root: Path, size_gb: float, files: int) -> Path:
    step_dir = root / "ckpt" / "global_step_100"
    (step_dir / "actor" / "huggingface").mkdir(parents=True)
    shard = int(size_gb * 1e9 / files)
    for rank in range(files):
        with open(step_dir / "actor" / f"model_world_size_{files}_rank_{rank}.pt", "wb") as f:
            f.truncate(shard)  # sparse: no block written
    (step_dir / "actor" / "huggingface" / "config.json").write_text('{"model_type": "qwen2"}')
    (step_dir / "data.pt").write_bytes(b"\0" * 4096)
    (root / "ckpt" / TRACKER_NAME).write_text("100")
    sysfs = root / "sys"
    for device in range(8):
        write_port(sysfs, f"mlx5_{device}", 1)
    (root / "shared").mkdir()
    return step_dir


def timed_preflight(root: Path, nvml: FakeNvml, spec) -> tuple[float, int, dict]:
    """(seconds, bytes hashed, statuses) of one pre-flight run."""
    hashed = [0]
    real = manifest.sha256_stable

    def counting(path, *args):
        digest, size = real(path, *args)
        hashed[0] += size
        return digest, size

    manifest.sha256_stable = resume.sha256_stable = counting
    try:
        o = Options(spec=spec, node="bench-node", gpus=8, nvml_loader=lambda: nvml, sysfs_root=str(root / "sys"),
                    ports=8, fabric_sample_s=0.0, checkpoint_dir=str(root / "ckpt"), max_ckpt_to_keep=2,
                    manifests_dir=str(root / "shared"), nodes=1, kmsg=str(root / "no-kmsg"),
                    knobs=PreflightKnobs(nodes_wait="0s"))
        start = time.perf_counter()
        findings, statuses = run_checks(o, set())
        elapsed = time.perf_counter() - start
    finally:
        manifest.sha256_stable = resume.sha256_stable = real
    failed = [f.line for f in findings if not f.ok]
    if failed:
        raise SystemExit(f"the pre-flight failed on the bench node: {failed}")
    return elapsed, hashed[0], statuses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=100.0, help="checkpoint size in GB (default 100)")
    ap.add_argument("--files", type=int, default=16, help="shard files it is split into (default 16)")
    ap.add_argument("--dir", help="where to build the tree (default a temporary folder, removed after)")
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    if shutil.which("sha256sum") is None:
        print("sha256sum is not on PATH (coreutils)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="preflight-bench-", dir=args.dir))
    try:
        step_dir = build(root, args.size_gb, args.files)
        nvml = FakeNvml(8, nvlink_links=4)
        for g in nvml.gpus:
            g.set_nvlink(4)
        spec = load_spec()
        paths = sorted(str(p) for p in step_dir.rglob("*") if p.is_file())
        start = time.perf_counter()
        subprocess.run(["sha256sum", *paths], check=True, stdout=subprocess.DEVNULL)
        baseline = time.perf_counter() - start
        first, first_bytes, _ = timed_preflight(root, nvml, spec)
        write_manifest(step_dir)
        second, second_bytes, _ = timed_preflight(root, nvml, spec)
        figures = {"size_gb": args.size_gb, "files": len(paths), "gpus": 8, "ports": 8,
                   "sha256sum_s": round(baseline, 3),
                   "preflight_without_manifest_s": round(first, 3), "bytes_hashed_without_manifest": first_bytes,
                   "ratio_without_manifest": round(first / baseline, 3),
                   "preflight_with_manifest_s": round(second, 3), "bytes_hashed_with_manifest": second_bytes,
                   "ratio_with_manifest": round(second / baseline, 5)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for key, value in figures.items():
        print(f"{key:32} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    if second_bytes:
        print("FAIL: the second run hashed a checkpoint its manifest already vouches for", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
