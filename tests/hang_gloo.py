"""A real two-rank hang for the forensics test: a launcher (the --trainer-pid, as torchrun would be) starts two
CPU ranks in a torch.distributed gloo group. Every step both all_reduce; from step HANG_AT on, rank 1 sits in a
slow ``compute_score`` (a reward function that never returns) and rank 0 waits in all_reduce. Rank 0 logs each
step to a verl file-logger JSONL, so the log stops when the run hangs. Each rank writes its Flight Recorder
dump (torch's JSON form) to FR_DIR/fr_rank_<rank> every 0.2 s from a thread, as a watchdog would.

    python hang_gloo.py LOG PORT HANG_AT STEP_SECONDS FR_DIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time


def compute_score(tensor):
    time.sleep(3600)  # the hang: a reward function that never returns
    return tensor


def dump_flight_recorder(path: str) -> None:
    from torch._C._distributed_c10d import _dump_fr_trace_json

    while True:
        with open(path + ".tmp", "wb") as f:
            f.write(_dump_fr_trace_json(True, True))
        os.replace(path + ".tmp", path)
        time.sleep(0.2)


def rank_main(log: str, port: str, hang_at: int, step_s: float, fr_dir: str) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "1000"  # Flight Recorder on: read when the process group is made
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    threading.Thread(target=dump_flight_recorder, args=(os.path.join(fr_dir, f"fr_rank_{rank}"),),
                     daemon=True).start()
    t = torch.ones(4)
    for step in range(1, 100000):
        started = time.time()
        if rank == 1 and step >= hang_at:
            compute_score(t)
        dist.all_reduce(t)
        time.sleep(step_s)
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"step": step, "data": {"timing_s/step": time.time() - started}}) + "\n")


def launcher(args: list[str]) -> None:
    ranks = [subprocess.Popen([sys.executable, __file__, *args], env={**os.environ, "RANK": str(r)}) for r in (0, 1)]
    try:
        for p in ranks:
            p.wait()
    finally:
        for p in ranks:
            p.kill()


if __name__ == "__main__":
    log, port, hang_at, step_s, fr_dir = sys.argv[1:6]
    if "RANK" in os.environ:
        rank_main(log, port, int(hang_at), float(step_s), fr_dir)
    else:
        launcher(sys.argv[1:6])
