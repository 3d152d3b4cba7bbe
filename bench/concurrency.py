"""Concurrency benchmark: /metrics latency under many scrapers, and with slow clients, vs node_exporter.

    python bench/concurrency.py [--quick] [--clients 50] [--json FILE]

A real ``verl-exporter serve`` (fed with the bundled demo run) and ``prometheus-node-exporter`` (collectors
limited to about as many series) get the same load, one after the other:

1. ``--clients`` concurrent scrapers, each a new connection per scrape, back to back (goal: sidecar p99 <= 1.0x
   node_exporter's);
2. the same while ``--slow`` more clients hold half-sent requests (the partial-header attack).

The load comes from several processes (threads in each), so the client's own GIL weighs little. Every number
is printed next to node_exporter's from this run, with the ratio. The kernel's listen-queue overflow counter
(TcpExt ListenOverflows, whole machine) is printed for each phase.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split

import requests
from foundation import (
    NODE_EXPORTER_NAMES,
    Proc,
    demo_log_bytes,
    series_count,
    start_sidecar,
    step_of,
)
from helpers import free_port, percentile

# About the sidecar's series count with the demo run (checked and printed on each run).
NODE_COLLECTORS = ("cpu", "meminfo", "diskstats", "netdev", "filesystem", "vmstat", "loadavg", "stat")


def listen_overflows() -> int | None:
    """TcpExt ListenOverflows of this machine (None where /proc/net/netstat is absent)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(row.get("ListenOverflows", 0))
    return None


def _client(args: tuple[str, int, int, int]) -> tuple[list[float], int]:
    """One load process: `threads` threads, each `scrapes` GET /metrics on a new connection. (latencies, errors)"""
    import threading

    host, port, threads, scrapes = args
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def run():
        mine = []
        for _ in range(scrapes):
            t0 = time.perf_counter()
            try:
                conn = http.client.HTTPConnection(host, port, timeout=30)
                conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
                resp = conn.getresponse()
                resp.read()
                conn.close()
                if resp.status != 200:
                    raise RuntimeError(resp.status)
                mine.append(time.perf_counter() - t0)
            except Exception:
                with lock:
                    errors[0] += 1
        with lock:
            latencies.extend(mine)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return latencies, errors[0]


def load(url: str, clients: int, scrapes: int, processes: int) -> dict:
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    per = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
    before = listen_overflows()
    t0 = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        parts = pool.map(_client, [(host, int(port), n, scrapes) for n in per if n])
    wall = time.perf_counter() - t0
    after = listen_overflows()
    lat = [x for part, _ in parts for x in part]
    errors = sum(e for _, e in parts)
    return {"requests": len(lat), "errors": errors, "p50_ms": statistics.median(lat) * 1000,
            "p99_ms": percentile(lat, 99) * 1000, "max_ms": max(lat) * 1000, "per_s": len(lat) / wall,
            "listen_overflows": None if before is None or after is None else after - before}


def hold_slow(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        socks.append(s)
    return socks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer scrapes per client (~20 s), to prove it runs")
    parser.add_argument("--clients", type=int, default=50, help="concurrent scrapers (default 50)")
    parser.add_argument("--slow", type=int, default=20, help="clients holding half-sent requests in phase 2")
    parser.add_argument("--processes", type=int, default=5, help="load processes (default 5)")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    args = parser.parse_args(argv)
    scrapes = 10 if args.quick else 40
    out = print

    node_bin = next((b for b in map(shutil.which, NODE_EXPORTER_NAMES) if b), None)
    if not node_bin:
        out("prometheus-node-exporter not found: there is no baseline to compare with")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="verl-exporter-bench-"))
    log_path = workdir / "verl.jsonl"
    content, last_step = demo_log_bytes()
    log_path.write_bytes(content)
    procs: list[Proc] = []
    session = requests.Session()
    results: dict = {"clients": args.clients, "slow": args.slow, "scrapes_per_client": scrapes}
    try:
        sidecar = start_sidecar(procs, workdir, log_path)
        nport = free_port()
        # --web.max-requests=0: by default node_exporter answers 503 beyond 40 at once, which would flatter it
        node = Proc("node_exporter", [node_bin, f"--web.listen-address=127.0.0.1:{nport}", "--web.max-requests=0",
                                      "--collector.disable-defaults", *(f"--collector.{c}" for c in NODE_COLLECTORS)],
                    f"http://127.0.0.1:{nport}/metrics", workdir)
        procs.append(node)
        sidecar.wait_ready(session, until=lambda text: (step_of(text) or 0) >= last_step)
        node.wait_ready(session)
        for p in procs:
            results[f"{p.name}_series"] = series_count(session.get(p.url, timeout=5).text)
        out(f"series: sidecar {results['sidecar_series']}, node_exporter {results['node_exporter_series']} "
            f"(collectors {', '.join(NODE_COLLECTORS)})")

        for phase, slow in (("many", 0), ("many+slow", args.slow)):
            out(f"\n== {phase}: {args.clients} scrapers x {scrapes} scrapes" +
                (f", while {slow} clients hold half-sent requests" if slow else ""))
            rows = {}
            for p in procs:
                port_of = int(p.url.rsplit(":", 1)[1].split("/", 1)[0])
                held = hold_slow(port_of, slow)
                try:
                    rows[p.name] = row = load(p.url, args.clients, scrapes, args.processes)
                finally:
                    for s in held:
                        s.close()
                out(f"  {p.name:14}: p50 {row['p50_ms']:8.2f} ms  p99 {row['p99_ms']:8.2f} ms  "
                    f"max {row['max_ms']:8.2f} ms  {row['per_s']:7.1f} req/s  errors {row['errors']}  "
                    f"listen overflows {row['listen_overflows']}")
                time.sleep(0.5)
            s, n = rows["sidecar"], rows["node_exporter"]
            ratios = {k: s[k] / n[k] for k in ("p50_ms", "p99_ms", "max_ms")}
            out("  ratio sidecar/node_exporter: " + ", ".join(f"{k[:-3]} {v:.2f}x" for k, v in ratios.items())
                + ("  (goal p99 <= 1.0x)" if phase == "many" else ""))
            results[phase] = {**rows, "ratios": ratios}
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} died: {p.stderr_tail()}")
    finally:
        session.close()
        for p in procs:
            p.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
