"""``verl-exporter demo``: replay a bundled PPO run into a live sidecar, with no GPU and no verl.

The run comes from the replay engine's simulator (a healthy PPO run with every key verl 0.9.1 logs and a gradient
explosion injected at step 230); it is written line by line, in verl's file-logger format, to a temporary file
that a real sidecar follows, exactly as in production.

``python -m verl_exporter.tools.demo LOG RATE HANG_AT`` is the trainer of ``demo --hang``: a process of its own
(py-spy reads another process's stacks, not its own) that writes the run's first steps and then hangs in its
reward function, as in verl PR #6673. It starts on a line on stdin and says each step on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..core.httpserver import ListenError
from ..core.shutdown import GRACE_S, stop_event
from ..exposition.selfmetrics import SelfMetric
from ..sidecar.config import ServeConfig
from ..sidecar.sidecar import Sidecar
from .replay import Fault, simulate

LINES_PARSED = SelfMetric("verl_exporter_lines_parsed_total")

DEMO_FAULT = Fault("grad_explosion", at=230)


def demo_lines() -> list[bytes]:
    """The demo run as verl's file logger writes it: compact JSON lines, NaN as null."""
    return [json.dumps(line, separators=(",", ":"), allow_nan=False).encode() + b"\n"
            for line in simulate("ppo", DEMO_FAULT, every_key=True)]


def _nonfinite_steps(lines: list[bytes]) -> list[int]:
    steps = []
    for line in lines:
        obj = json.loads(line)
        if any(v is None for v in obj["data"].values()):
            steps.append(obj["step"])
    return steps


def run_demo(listen: str = "127.0.0.1:9477", rate: float = 10.0, exit_after_replay: bool = False,
             out=print) -> int:
    if not 0 < rate < float("inf"):
        raise ValueError(f"rate must be a positive number of steps per second, got {rate!r}")
    lines = demo_lines()
    bad_steps = _nonfinite_steps(lines)
    workdir = Path(tempfile.mkdtemp(prefix="verl-exporter-demo-"))
    log_path = workdir / "demo_run.jsonl"
    sidecar = Sidecar(ServeConfig(listen=listen, run="demo", rank=0, verl_log=str(log_path)))
    try:
        sidecar.start()
    except ListenError as e:
        out(f"verl-exporter demo: cannot listen on {listen}: {e.strerror} (try --listen 127.0.0.1:0)")
        return 2
    url = sidecar.server.url
    out(f"""
verl-exporter demo: replaying {len(lines)} steps of a PPO run at {rate:g} steps/s
  verl file log : {log_path}
  metrics       : {url}/metrics
  health        : {url}/healthz
Try, in another terminal:
  curl -s {url}/metrics | grep -E '^verl_(training_step|actor_grad_norm|critic_score|timing_seconds)'
  curl -s {url}/metrics | grep verl_training_nonfinite_values_total
The run has an injected fault: the actor's gradient norm explodes, then is NaN (null in verl's log) at
steps {', '.join(map(str, bad_steps)) or '-'}; watch verl_training_nonfinite_values_total count them.
""")
    done = stop_event(grace=GRACE_S)
    interval = 1.0 / rate
    with open(log_path, "wb", buffering=0) as f:  # like verl's FileLogger
        for line in lines:
            if done.is_set():
                break
            f.write(line)
            step = json.loads(line)["step"]
            if step in bad_steps[:1]:
                out(f"  step {step}: first NaN gradient norm (the explosion began a few steps earlier)")
            if done.wait(interval):
                break
    time.sleep(max(0.3, 3 * sidecar.config.poll_interval))  # let the follower read the last lines
    store = sidecar.store
    nonfinite = store.nonfinite_counts()
    parsed = sidecar.self_metrics.value(LINES_PARSED, source="file")
    out(f"replay finished: {parsed:g} lines parsed, latest step {store.step or 0:g}, NaN/Inf values counted: "
        + (", ".join(f"{name}={count:g}" for name, count in sorted(nonfinite.items())) or "none"))
    if not exit_after_replay and not done.is_set():
        out(f"still serving {url}/metrics — Ctrl-C to stop")
        done.wait()
    sidecar.stop()
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)  # the temporary log: leave nothing behind
    return 0


def compute_score(solution: str, ground_truth: str) -> float:
    """The hung trainer's reward function: it waits for a reward server that never answers."""
    while True:
        time.sleep(3600)


def hang_trainer(log_path: str, rate: float, hang_at: int) -> None:
    """Write the demo run's steps before hang_at at rate steps/s, then hang computing step hang_at's reward."""
    if sys.platform == "linux":  # let the demo's py-spy (a child of our parent) read us under Yama's ptrace_scope 1
        import ctypes

        ctypes.CDLL(None).prctl(0x59616D61, os.getppid(), 0, 0, 0)  # PR_SET_PTRACER
    sys.stdin.readline()  # the demo's go: Prometheus has loaded the rules
    with open(log_path, "wb", buffering=0) as f:  # like verl's FileLogger
        for line in demo_lines()[:hang_at - 1]:
            f.write(line)
            print(json.dumps({"step": json.loads(line)["step"]}), flush=True)
            time.sleep(1.0 / rate)
    print(json.dumps({"hang": hang_at}), flush=True)
    compute_score(f"<the rollout of step {hang_at}>", "<its answer>")


if __name__ == "__main__":
    hang_trainer(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
