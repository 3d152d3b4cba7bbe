"""``verl-exporter demo``: replay a bundled PPO run into a live sidecar, with no GPU and no verl.

The run comes from the replay engine's simulator (a healthy PPO run with every key verl 0.9.1 logs and a gradient
explosion injected at step 230); it is written line by line, in verl's file-logger format, to a temporary file
that a real sidecar follows, exactly as in production.
"""

from __future__ import annotations

import json
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
