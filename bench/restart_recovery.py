"""What a sidecar restart costs on a long run's log, as ratios against reading the file once.

    python bench/restart_recovery.py [--mb N]

After a restart the follower exports the latest values from the file's tail and rebuilds the NaN counter
from the whole file, parsing only the lines that can hold a NaN. Compared here: reading the file
(baseline), that recovery, the NaN recount alone over the whole file (a restart with no tail), and parsing
every line with json.loads (what a full replay would at least cost).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from verl_exporter.exposition.selfmetrics import SelfMetrics  # noqa: E402
from verl_exporter.sidecar.sources.verl_file import VerlFileFollower  # noqa: E402
from verl_exporter.sidecar.store import TrainingStore  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.tools.demo import demo_lines  # noqa: E402


def write_log(path: str, megabytes: int) -> tuple[int, int]:
    """A demo run repeated to the size asked, with grad_norm null on one line in 500."""
    rng = random.Random(0)
    lines = [json.loads(x) for x in demo_lines()]
    n = nans = 0
    with open(path, "w") as fh:
        while fh.tell() < megabytes * 1024 * 1024:
            obj = lines[n % len(lines)]
            data = dict(obj["data"])
            if rng.random() < 1 / 500:
                data["actor/grad_norm"] = None
            nans += "actor/grad_norm" in data and data["actor/grad_norm"] is None
            fh.write(json.dumps({"step": n + 1, "data": data}) + "\n")
            n += 1
    return n, nans


def best_of(fn, repeats: int = 3) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    args = parser.parse_args()
    spec = load_spec()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        lines, nans = write_log(path, args.mb)

        def read():
            with open(path, "rb") as fh:
                while fh.read(1 << 20):
                    pass

        def recover():
            sm = SelfMetrics(spec)
            store = TrainingStore(spec, sm)
            VerlFileFollower(path, store, sm).poll()
            assert store.nonfinite_counts().get("verl_actor_grad_norm", 0) == nans

        def recount():
            sm = SelfMetrics(spec)
            store = TrainingStore(spec, sm)
            VerlFileFollower(path, store, sm, recover_bytes=0).poll()
            assert store.nonfinite_counts().get("verl_actor_grad_norm", 0) == nans

        def parse_all():
            with open(path, "rb") as fh:
                for raw in fh:
                    json.loads(raw)

        base = best_of(read)
        rec = best_of(recover)
        count = best_of(recount)
        full = best_of(parse_all, repeats=1)
    print(f"log: {args.mb} MiB, {lines} lines, {nans} NaN lines")
    print(f"read the file once       {base:8.3f} s  1.0x")
    print(f"restart recovery         {rec:8.3f} s  {rec / base:5.1f}x")
    print(f"NaN recount of the file  {count:8.3f} s  {count / base:5.1f}x")
    print(f"json.loads of every line {full:8.3f} s  {full / base:5.1f}x")


if __name__ == "__main__":
    main()
