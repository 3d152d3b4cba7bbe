"""Scrapes during a stack capture: /metrics latency while a long capture runs with requests queued behind it.

    python bench/capture_scrape.py [--capture-seconds 60] [--requests 12] [--json FILE]

A real `verl-exporter serve --forensics-dir` (the real CLI, loopback) whose py-spy is a stand-in that sleeps
--capture-seconds before answering (a real capture of many ranks, or one in uninterruptible I/O, takes that
long), a `sleep` process as the trainer. The same sidecar is scraped, one new connection per scrape every
SCRAPE_EVERY_S as Prometheus does at a short interval:

1. idle: for --capture-seconds, nothing else asked;
2. during a capture: --requests POST /control/forensics sent at once (the relay's retries, two HA relays, a
   person): one capture runs and the others wait for it; scraped until the capture answers.

It prints the p50/p99 of each phase and the ratio of the p99s (goal: within 1.5x of idle). Before control
requests had slots of their own, 9 requests waiting on an 8-s capture held all 8 app slots and a scrape took
the capture's length.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from paths import REPO  # noqa: F401 - sets up imports of the package and the test helpers

# isort: split

from conftest import ServeProcess, http_get, post_json, wait_for  # noqa: E402
from helpers import percentile, results_table  # noqa: E402

SCRAPE_EVERY_S = 0.05
TOKEN = "bench-token"
GOAL = 1.5


def scrapes(url: str, until: threading.Event | float) -> list[float]:
    """Seconds of each /metrics scrape until the event is set or the monotonic deadline passes."""
    times = []
    while not (until.is_set() if isinstance(until, threading.Event) else time.monotonic() >= until):
        t0 = time.perf_counter()
        status = http_get(url, timeout=120)[0]
        times.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        time.sleep(SCRAPE_EVERY_S)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture-seconds", type=float, default=60.0, help="how long the capture takes (default 60)")
    ap.add_argument("--requests", type=int, default=12, help="forensics requests sent at once (default 12)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        started = tmp_path / "started"
        fake = tmp_path / "py-spy"
        fake.write_text(f"#!/bin/sh\ntouch {started}\nsleep {args.capture_seconds}\necho '[]'\n")
        fake.chmod(0o755)
        trainer = subprocess.Popen(["sleep", str(int(args.capture_seconds * 3 + 120))])
        side = None
        try:
            side = ServeProcess("--trainer-pid", str(trainer.pid), "--forensics-dir", str(tmp_path / "forensics"),
                                "--forensics-py-spy", str(fake), "--no-forensics-native", "--forensics-timeout",
                                str(args.capture_seconds + 60), "--control-file", str(tmp_path / "control.json"),
                                "--control-token-env", "VERL_CTL", env={"VERL_CTL": TOKEN})
            url = side.url + "/metrics"
            scrapes(url, time.monotonic() + 2)  # warm up
            idle = scrapes(url, time.monotonic() + args.capture_seconds)
            answers: list[tuple[int, dict]] = []
            answered = threading.Event()

            def ask() -> None:
                answers.append(post_json(side.url + "/control/forensics", b'{"reason": "bench"}',
                                         {"Authorization": f"Bearer {TOKEN}"}, timeout=args.capture_seconds + 120))
                if len(answers) == args.requests:
                    answered.set()

            askers = [threading.Thread(target=ask, daemon=True) for _ in range(args.requests)]
            for a in askers:
                a.start()
            wait_for(started.exists, timeout=30)
            t0 = time.monotonic()
            busy = scrapes(url, answered)
            capture_s = time.monotonic() - t0
            for a in askers:
                a.join()
        finally:
            if side is not None:
                side.stop()
            trainer.kill()
            trainer.wait()
    paths = {a.get("path") for _, a in answers}
    ok = all(status == 200 and a.get("applied") for status, a in answers)
    idle_p99, busy_p99 = percentile(idle, 99) * 1000, percentile(busy, 99) * 1000
    ratio = busy_p99 / idle_p99
    rows = [("scrape p50, during the capture", f"{percentile(busy, 50) * 1000:.1f} ms", "idle p50",
             f"{percentile(idle, 50) * 1000:.1f} ms", f"{percentile(busy, 50) / percentile(idle, 50):.2f}x", "-", "-"),
            ("scrape p99, during the capture", f"{busy_p99:.1f} ms", "idle p99", f"{idle_p99:.1f} ms",
             f"{ratio:.2f}x", f"<= {GOAL}x", "ok" if ratio <= GOAL else "over"),
            ("scrape max, during the capture", f"{max(busy) * 1000:.1f} ms", "the capture", f"{capture_s:.1f} s",
             f"{max(busy) / capture_s:.4f}x", "-", "-"),
            ("requests answered with one capture", f"{len(answers)}", "captures written", f"{len(paths)}", "-", "1",
             "ok" if ok and len(paths) == 1 else "no")]
    print(f"{args.requests} forensics requests on a {args.capture_seconds:g}-s capture; {len(idle)} idle and "
          f"{len(busy)} busy scrapes")
    print(results_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "capture_seconds": args.capture_seconds, "requests": args.requests, "idle_p99_ms": idle_p99,
            "busy_p99_ms": busy_p99, "ratio": ratio, "idle_scrapes": len(idle), "busy_scrapes": len(busy),
            "captures": len(paths), "all_applied": ok}, indent=2))
    return 0 if ratio <= GOAL and ok and len(paths) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
