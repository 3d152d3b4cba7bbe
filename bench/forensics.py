"""Hang forensics benchmark: how soon the stacks of a hung run are on disk, what a capture costs, how big it is.

    python bench/forensics.py [--dumps N] [--json FILE]

A real hang (tests/hang_gloo.py: two CPU ranks in a gloo group under a launcher, rank 1 stuck in a slow
compute_score from step 15, step time 0.1 s) followed by a real `verl-exporter serve --forensics-dir` with an
overrides file lowering VerlTrainingStalledRelative's floor to 3 s (as tests/sidecar/test_forensics_hang.py does),
then, on the hung ranks:

1. stall to captured stacks: the seconds from the last step line to the capture file on disk, against the
   alert's own limit (the floor): the rest is the sidecar's (its 1 s check, and the dumps, --native on);
2. capture cost per rank: py-spy dump's wall time and CPU time (its own, from the children's rusage), with and
   without --native, median of N dumps, against one scrape of this sidecar's /metrics in the same run;
3. dump size: the capture file's bytes, per process.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import REPO  # noqa: F401 - sets up imports of the package and the test helpers

# isort: split

import psutil  # noqa: E402
import requests  # noqa: E402
from conftest import ServeProcess, sample, wait_for  # noqa: E402
from helpers import free_port, results_table  # noqa: E402
from test_forensics_hang import FLOOR_S, HANG_AT, HERE, STEP_S, short_floor_overrides  # noqa: E402


def dump_cost(py_spy: str, pid: int, native: bool, n: int) -> dict:
    walls, cpus = [], []
    for _ in range(n):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        cmd = [py_spy, "dump", "--json", *(["--native"] if native else []), "--pid", str(pid)]
        subprocess.run(cmd, capture_output=True, check=True, timeout=60)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {"wall_ms": statistics.median(walls) * 1000, "cpu_ms": statistics.median(cpus) * 1000}


def scrape_ms(url: str, n: int = 20) -> float:
    with requests.Session() as s:
        s.get(url, timeout=5)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            s.get(url, timeout=5).raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dumps", type=int, default=5, help="py-spy dumps per rank and mode (default 5)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    py_spy = str(Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        log, forensics, fr = tmp_path / "run.jsonl", tmp_path / "forensics", tmp_path / "fr"
        fr.mkdir()
        launcher = subprocess.Popen([sys.executable, str(HERE / "hang_gloo.py"), str(log), str(free_port()),
                                     str(HANG_AT), str(STEP_S), str(fr)])
        side = None
        try:
            side = ServeProcess("--verl-log", str(log), "--run", "bench", "--rank", "0", "--trainer-pid",
                                str(launcher.pid), "--overrides", str(short_floor_overrides(tmp_path)),
                                "--forensics-dir", str(forensics), "--forensics-flight-recorder", str(fr / "fr_rank_"))
            wait_for(lambda: sample(side.metrics(), "verl_training_step") == HANG_AT - 1, timeout=60)
            wait_for(lambda: list(forensics.glob("capture-*.json")), timeout=FLOOR_S + 30)
            [path] = forensics.glob("capture-*.json")
            doc = json.loads(path.read_text())
            last_step = log.stat().st_mtime
            ranks = {p["rank"]: p for p in doc["processes"] if p["rank"] is not None}
            cost = {(r, native): dump_cost(py_spy, p["pid"], native, args.dumps)
                    for r, p in sorted(ranks.items()) for native in (False, True)}
            scrape = scrape_ms(side.url + "/metrics")
            sizes = {r: len(json.dumps(p)) for r, p in ranks.items()}
            file_bytes, stacks_at = path.stat().st_size, path.stat().st_mtime
            verdict = doc["verdict"]
        finally:
            children = psutil.Process(launcher.pid).children(recursive=True)
            launcher.kill()
            for c in children:
                c.kill()
            if side is not None:
                side.stop()
        stall_to_stacks = stacks_at - last_step
    detected = doc["time"] - last_step
    rows = [("stall to the trigger", f"{detected:.2f} s", "the alert's floor", f"{FLOOR_S} s",
             f"{detected / FLOOR_S:.2f}x", "floor + 1 s", "ok" if detected <= FLOOR_S + 1 else "over"),
            ("trigger to stacks on disk (--native)", f"{stall_to_stacks - detected:.2f} s", "", "", "", "-", "-"),
            ("stall to captured stacks", f"{stall_to_stacks:.2f} s", "the alert's floor", f"{FLOOR_S} s",
             f"{stall_to_stacks / FLOOR_S:.2f}x", "-", "-")]
    for (rank, native), c in cost.items():
        mode = "--native" if native else "Python only"
        rows.append((f"py-spy dump, rank {rank}, {mode}: wall", f"{c['wall_ms']:.0f} ms", "one /metrics scrape",
                     f"{scrape:.1f} ms", f"{c['wall_ms'] / scrape:.0f}x", "-", "-"))
        rows.append((f"py-spy dump, rank {rank}, {mode}: CPU", f"{c['cpu_ms']:.0f} ms", "one /metrics scrape",
                     f"{scrape:.1f} ms", f"{c['cpu_ms'] / scrape:.0f}x", "-", "-"))
    rows.append(("capture file", f"{file_bytes} B", "processes in it", f"{len(doc['processes'])}",
                 f"{file_bytes / len(doc['processes']):.0f} B each", "< 1 MiB", "ok" if file_bytes < 2**20 else "over"))
    print(results_table(rows))
    print(f"\nverdict: {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "stall_to_stacks_s": stall_to_stacks, "stall_to_trigger_s": detected, "floor_s": FLOOR_S,
            "scrape_ms": scrape,
            "dumps": {f"rank{r}{'_native' if n else ''}": c for (r, n), c in cost.items()},
            "capture_bytes_per_process": sizes, "verdict": verdict}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
