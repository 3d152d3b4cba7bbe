"""Foundation benchmark: what the exporter costs, each number a ratio against a baseline measured in this run.

    python bench/foundation.py [--quick] [--json FILE]

1. ``Monitor.log()`` with a 100-key verl-like dict vs 100 bare ``Gauge.set`` calls (goal <= 0.5x), and vs
   the seed's approach, one synchronous ``requests.post(url, json=data)`` per step to a loopback server.
2. ``/metrics`` latency (median, p99) of a real ``verl-exporter serve`` fed with the bundled demo run vs
   ``prometheus-node-exporter`` on the same machine (goal <= 1.0x).
3. Freshness: from appending a verl line to the step showing on /metrics (goal p99 <= 1 s).
4. The sidecar's idle CPU and RSS (file followed, no new lines, nobody scraping) vs node_exporter's.

Every subprocess is stopped on the way out, error or not. --quick shortens everything (~20 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split

import psutil
import requests
from helpers import free_port, percentile, results_table
from prometheus_client import CollectorRegistry, Gauge
from verl_exporter.core.shutdown import stop_process
from verl_exporter.tools.demo import demo_lines
from verl_exporter.trainer.monitor import Monitor

STEP_METRIC = "verl_training_step"
NODE_EXPORTER_NAMES = ("prometheus-node-exporter", "node_exporter")
N_KEYS = 100


# ---------------------------------------------------------------------------------------------- helpers
def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def verl_like_dict(n: int = N_KEYS) -> dict[str, float]:
    """The demo run's first step (numeric keys, as floats), padded with keys of later steps, then synthetic
    timing_s/<phase> keys, and trimmed to exactly n keys."""
    lines = [json.loads(line) for line in demo_lines()]
    data: dict[str, float] = {}
    for obj in lines:
        for key, value in obj["data"].items():
            if len(data) >= n:
                break
            if key not in data and isinstance(value, (int, float)) and not isinstance(value, bool):
                data[key] = float(value)
    i = 0
    while len(data) < n:
        data.setdefault(f"timing_s/extra_phase_{i}", 0.5 + i / 100)
        i += 1
    assert len(data) == n
    return data


class _Ok(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args):
        pass


def time_per_call_us(fn, iterations: int, repeats: int) -> tuple[float, list[float]]:
    """Median over repeats of (ns for `iterations` calls of fn) / iterations, in microseconds."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(iterations)
        samples.append((time.perf_counter_ns() - t0) / iterations / 1000)
    return statistics.median(samples), samples


# ---------------------------------------------------------------------------------------------- part 1
def bench_log(args, out) -> dict:
    data = verl_like_dict()
    repeats = args.repeats

    registry = CollectorRegistry()
    gauges = [Gauge(f"bench_gauge_{i}", "bench", registry=registry) for i in range(N_KEYS)]
    values = list(data.values())
    pairs = list(zip(gauges, values, strict=True))

    def gauge_loop(n):
        for _ in range(n):
            for g, v in pairs:
                g.set(v)

    gauge_loop(200)  # warm-up
    gauge_us, gauge_samples = time_per_call_us(gauge_loop, args.log_iters, repeats)
    out(f"  100 x Gauge.set            : {gauge_us:9.2f} us/step  (repeats {fmt_list(gauge_samples)})")

    monitor = Monitor(listen="127.0.0.1:0", run="bench", rank=0)
    try:
        def log_loop(n):
            log = monitor.log
            for step in range(n):
                log(data, step=step)

        log_loop(200)
        monitor.drain()
        samples = []
        for _ in range(repeats):
            # A fresh queue each repeat: the worker drains between repeats, as between training steps.
            monitor.drain()
            t0 = time.perf_counter_ns()
            log_loop(args.log_iters)
            samples.append((time.perf_counter_ns() - t0) / args.log_iters / 1000)
        log_us = statistics.median(samples)
        out(f"  Monitor.log (100 keys)     : {log_us:9.2f} us/step  (repeats {fmt_list(samples)}; the worker "
            "shares the GIL, so repeats vary with how much it drained meanwhile)")

        # Informative: what the worker pays per queued step (ingest of 100 keys into the store).
        batch = min(1000, monitor._maxlen)
        drain_samples = []
        for _ in range(repeats):
            monitor.drain()
            for step in range(batch):
                monitor.log(data, step=step)
            t0 = time.perf_counter_ns()
            monitor.drain()
            drain_samples.append((time.perf_counter_ns() - t0) / batch / 1000)
        drain_us = statistics.median(drain_samples)
        out(f"  Monitor worker drain/step  : {drain_us:9.2f} us/step  (off the training thread)")
        monitor.drain()
        dropped = monitor.sidecar.self_metrics.value("verl_exporter_monitor_dropped_total")
        out(f"  (queue overflow during the tight loop: {dropped:g} steps dropped and counted, as designed)")
        monitor_series = series_count(requests.get(monitor.url + "/metrics", timeout=5).text)
    finally:
        monitor.close()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_port}/log"
    try:
        def post_loop(n):
            for _ in range(n):
                requests.post(url, json=data, timeout=5).raise_for_status()

        post_loop(20)
        post_us, post_samples = time_per_call_us(post_loop, args.post_iters, repeats)
    finally:
        httpd.shutdown()
        httpd.server_close()
    out(f"  requests.post (seed)       : {post_us:9.2f} us/step  (repeats {fmt_list(post_samples)})")
    return {
        "keys": N_KEYS, "log_iterations": args.log_iters, "post_iterations": args.post_iters, "repeats": repeats,
        "gauge_set_100_us": gauge_us, "monitor_log_us": log_us, "monitor_log_repeats_us": samples,
        "requests_post_us": post_us,
        "monitor_drain_per_step_us": drain_us, "monitor_dropped_during_bench": dropped,
        "monitor_series": monitor_series,
        "ratio_log_vs_gauge": log_us / gauge_us, "ratio_log_vs_post": log_us / post_us,
    }


def start_node_exporter(node_bin: str | None, workdir: Path, procs: list, out) -> Proc | None:
    """The baseline: Debian's node_exporter on a free loopback port (None, said once, when it is missing)."""
    if not node_bin:
        out("\n!! prometheus-node-exporter not found: node_exporter baselines are skipped")
        return None
    nport = free_port()
    node = Proc("node_exporter", [node_bin, f"--web.listen-address=127.0.0.1:{nport}"],
                f"http://127.0.0.1:{nport}/metrics", workdir)
    procs.append(node)
    return node


def extra_keys_line(step: int) -> bytes:
    """Keys a multi-turn run with several validation sets adds, so the sidecar serves ~150 training series."""
    data: dict[str, float] = {}
    for stat in ("mean", "max", "min"):
        data[f"num_turns/{stat}"] = 3.0
        data[f"tool_call_counts/{stat}"] = 2.0
        for section in ("generate_sequences", "tool_calls"):
            data[f"timing_s/agent_loop/{section}/{stat}"] = 1.5
    for source in ("lighteval/MATH", "aime2024", "humaneval", "mbpp", "gpqa", "olympiad"):
        for metric in ("mean@4", "best@4/mean", "maj@4/mean", "std@4", "best@4/std", "worst@4/mean"):
            kind = "core" if metric in ("mean@4", "best@4/mean", "maj@4/mean") else "aux"
            data[f"val-{kind}/{source}/reward/{metric}"] = 0.5
    return json.dumps({"step": step, "data": data}, separators=(",", ":")).encode() + b"\n"


def demo_log_bytes() -> tuple[bytes, int]:
    """The bundled demo run plus the multi-turn extras, as the sidecar benches follow it, and its last step."""
    lines = demo_lines()
    last_step = json.loads(lines[-1])["step"]
    return b"".join(lines) + extra_keys_line(last_step), last_step


def start_sidecar(procs: list, workdir: Path, log_path: Path) -> Proc:
    """A real `verl-exporter serve` following log_path, on a free port; added to procs (stopped by the caller)."""
    port = free_port()
    sidecar = Proc("sidecar", [sys.executable, "-m", "verl_exporter", "serve", "--listen", f"127.0.0.1:{port}",
                               "--verl-log", str(log_path), "--run", "bench", "--rank", "0"],
                   f"http://127.0.0.1:{port}/metrics", workdir)
    procs.append(sidecar)
    return sidecar


def fmt_list(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


# ---------------------------------------------------------------------------------------------- processes
class Proc:
    def __init__(self, name: str, argv: list[str], url: str, workdir: Path):
        self.name = name
        self.url = url
        self.log_path = workdir / f"{name}.stderr"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self._log,
                                      stdin=subprocess.DEVNULL)
        self.ps = psutil.Process(self.popen.pid)

    def wait_ready(self, session: requests.Session, timeout: float = 30.0, until=None) -> str:
        deadline = time.monotonic() + timeout
        last_error = None
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}: {self.stderr_tail()}")
            try:
                r = session.get(self.url, timeout=2)
                if r.status_code == 200 and (until is None or until(r.text)):
                    return r.text
                last_error = f"HTTP {r.status_code}"
            except requests.RequestException as e:
                last_error = repr(e)
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout:g} s ({last_error}): {self.stderr_tail()}")

    def stderr_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        stop_process(self.popen, timeout=5)
        self._log.close()


def series_count(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.startswith("#"))


def step_of(text: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(STEP_METRIC + "{") or line.startswith(STEP_METRIC + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def scrape_latency(proc: Proc, session: requests.Session, n: int, warmup: int) -> dict:
    for _ in range(warmup):
        session.get(proc.url, timeout=5).raise_for_status()
    samples = []
    body = ""
    for _ in range(n):
        t0 = time.perf_counter()
        r = session.get(proc.url, timeout=5)
        body = r.content
        samples.append(time.perf_counter() - t0)
        r.raise_for_status()
    text = body.decode()
    return {"median_ms": statistics.median(samples) * 1000, "p99_ms": percentile(samples, 99) * 1000,
            "requests": n, "series": series_count(text), "bytes": len(body)}


def idle_usage(procs: list[Proc], window: float) -> dict:
    before = {p.name: p.ps.cpu_times() for p in procs}
    t0 = time.monotonic()
    time.sleep(window)
    wall = time.monotonic() - t0
    result = {}
    for p in procs:
        b, a = before[p.name], p.ps.cpu_times()
        cpu = (a.user + a.system) - (b.user + b.system)
        result[p.name] = {"cpu_pct_of_core": 100 * cpu / wall, "rss_mib": p.ps.memory_info().rss / 2**20,
                          "window_s": wall}
    return result


def freshness(proc: Proc, session: requests.Session, log_file, first_step: int, samples: int) -> dict:
    lag = []
    template = json.loads(demo_lines()[-1])["data"]
    step = first_step
    for _ in range(samples):
        time.sleep(random.uniform(0.0, 0.25))  # not aligned with the follower's 0.1 s poll
        step += 1
        line = json.dumps({"step": step, "data": template}, separators=(",", ":")).encode() + b"\n"
        t0 = time.perf_counter()
        log_file.write(line)
        deadline = t0 + 10.0
        while True:
            r = session.get(proc.url, timeout=5)
            now = time.perf_counter()
            seen = step_of(r.text)
            if seen is not None and seen >= step:
                lag.append(now - t0)
                break
            if now > deadline:
                raise RuntimeError(f"step {step} did not appear on /metrics within 10 s")
    return {"samples": samples, "median_s": statistics.median(lag), "p99_s": percentile(lag, 99),
            "max_s": max(lag), "last_step": step}


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (~20 s), to prove it runs")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.log_iters, args.post_iters, args.repeats = 2000, 100, 3
        args.scrapes, args.warmup, args.fresh, args.idle = 100, 10, 15, 3.0
    else:
        args.log_iters, args.post_iters, args.repeats = 20000, 500, 5
        args.scrapes, args.warmup, args.fresh, args.idle = 300, 30, 50, 10.0

    out = print
    node_bin = next((b for b in map(shutil.which, NODE_EXPORTER_NAMES) if b), None)
    node_version = "missing"
    if node_bin:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            res = subprocess.run([node_bin, "--version"], capture_output=True, text=True, timeout=10)
            node_version = ((res.stdout or res.stderr).splitlines() or ["?"])[0].strip()
    env = {
        "python": platform.python_version(), "implementation": platform.python_implementation(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "prometheus_client": version_of("prometheus_client"), "requests": version_of("requests"),
        "psutil": version_of("psutil"), "verl_exporter": version_of("verl-exporter"),
        "node_exporter": node_version, "mode": "quick" if args.quick else "full",
    }
    out("== environment")
    for key, value in env.items():
        out(f"  {key:18}: {value}")

    started = time.monotonic()
    results: dict = {"env": env}

    out("\n== 1. Monitor.log() cost (per step, 100-key dict)")
    results["log"] = bench_log(args, out)

    workdir = Path(tempfile.mkdtemp(prefix="verl-exporter-bench-"))
    log_path = workdir / "verl.jsonl"
    content, last_step = demo_log_bytes()
    log_file = open(log_path, "wb", buffering=0)  # noqa: SIM115 - like verl's FileLogger; closed below
    log_file.write(content)
    procs: list[Proc] = []
    session = requests.Session()
    try:
        sidecar = start_sidecar(procs, workdir, log_path)
        node = start_node_exporter(node_bin, workdir, procs, out)

        sidecar.wait_ready(session, until=lambda text: (step_of(text) or 0) >= last_step)
        if node:
            node.wait_ready(session)

        out(f"\n== 4. idle CPU and RSS over {args.idle:g} s (file followed, no new lines, nobody scraping)")
        time.sleep(1.0)  # let the ready-check scrape settle
        idle = idle_usage(procs, args.idle)
        for name, row in idle.items():
            out(f"  {name:14}: {row['cpu_pct_of_core']:6.2f} % of a core, RSS {row['rss_mib']:6.1f} MiB")
        results["idle"] = idle

        out(f"\n== 2. /metrics latency ({args.scrapes} requests, persistent session, after {args.warmup} warm-up)")
        results["scrape"] = {}
        for p in procs:
            row = scrape_latency(p, session, args.scrapes, args.warmup)
            results["scrape"][p.name] = row
            out(f"  {p.name:14}: median {row['median_ms']:7.2f} ms, p99 {row['p99_ms']:7.2f} ms, "
                f"{row['series']} series, {row['bytes']} bytes")

        out(f"\n== 3. freshness ({args.fresh} appends; poll /metrics until the step shows)")
        results["freshness"] = freshness(sidecar, session, log_file, last_step, args.fresh)
        fr = results["freshness"]
        out(f"  median {fr['median_s']:.3f} s, p99 {fr['p99_s']:.3f} s, max {fr['max_s']:.3f} s")
        if sidecar.popen.poll() is not None:
            raise RuntimeError(f"sidecar died: {sidecar.stderr_tail()}")
        warnings = [line for line in sidecar.stderr_tail().splitlines() if "WARNING" in line or "ERROR" in line]
        results["sidecar_warnings"] = warnings
    finally:
        session.close()
        for p in procs:
            with contextlib.suppress(Exception):
                p.stop()
        log_file.close()
        shutil.rmtree(workdir, ignore_errors=True)

    results["elapsed_s"] = time.monotonic() - started
    table = build_table(results)
    out("\n== results (ratio = measured / baseline, both measured in this run)")
    out(table)
    if results.get("sidecar_warnings"):
        out("sidecar warnings: " + " | ".join(results["sidecar_warnings"][:5]))
    out(f"elapsed {results['elapsed_s']:.1f} s ({env['mode']} mode)")
    if args.json:
        results["table"] = table
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


def build_table(r: dict) -> str:
    rows = []
    log = r["log"]

    def verdict(ratio, goal):
        if goal is not None and ratio is None:
            return "SKIP"
        return "-" if goal is None else ("PASS" if ratio <= goal else "FAIL")

    def add(name, value, baseline_name, baseline, ratio, goal):
        rows.append((name, value, baseline_name, baseline, "-" if ratio is None else f"{ratio:.3f}",
                     "-" if goal is None else f"<= {goal:g}", verdict(ratio, goal)))

    add("Monitor.log, 100 keys", f"{log['monitor_log_us']:.2f} us", "100x Gauge.set",
        f"{log['gauge_set_100_us']:.2f} us", log["ratio_log_vs_gauge"], 0.5)
    add("Monitor.log, 100 keys", f"{log['monitor_log_us']:.2f} us", "requests.post/step (seed)",
        f"{log['requests_post_us']:.2f} us", log["ratio_log_vs_post"], None)
    scrape = r["scrape"]
    side = scrape["sidecar"]
    node = scrape.get("node_exporter")
    for stat in ("median", "p99"):
        key = f"{stat}_ms"
        add(f"/metrics {stat} ({side['series']} series)", f"{side[key]:.2f} ms",
            f"node_exporter ({node['series']} series)" if node else "node_exporter (missing)",
            f"{node[key]:.2f} ms" if node else "-", side[key] / node[key] if node else None, 1.0)
    fr = r["freshness"]
    add("freshness median", f"{fr['median_s']:.3f} s", "goal", "1 s", fr["median_s"] / 1.0, None)
    add("freshness p99", f"{fr['p99_s']:.3f} s", "goal", "1 s", fr["p99_s"] / 1.0, 1.0)
    idle = r["idle"]
    s, n = idle["sidecar"], idle.get("node_exporter")
    idle_ratio = None
    if n:
        idle_ratio = s["cpu_pct_of_core"] / n["cpu_pct_of_core"] if n["cpu_pct_of_core"] > 0 else float("inf")
    add("sidecar idle CPU", f"{s['cpu_pct_of_core']:.2f} %core", "node_exporter idle CPU",
        f"{n['cpu_pct_of_core']:.2f} %core" if n else "-", idle_ratio, None)
    add("sidecar RSS", f"{s['rss_mib']:.1f} MiB", "node_exporter RSS", f"{n['rss_mib']:.1f} MiB" if n else "-",
        s["rss_mib"] / n["rss_mib"] if n else None, None)
    rows.append(("Monitor worker drain/step", f"{log['monitor_drain_per_step_us']:.2f} us", "(informative)",
                 "-", "-", "-", "-"))

    return results_table(rows)


if __name__ == "__main__":
    sys.exit(main())
