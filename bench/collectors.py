"""Collector benchmark: what the resource collectors cost, each number set against a baseline of this run.

    python bench/collectors.py [--quick] [--json FILE]

1. Sampler CPU per interval with a fake NVML of 8 GPUs (NVLink on, 18 links each, processes listed) and
   every host collector that runs here: microseconds of CPU per sample, per collector, and % of one core at a
   1 s interval. Twice: with NVML calls free (this exporter's own Python cost), and with each call made to
   cost its median measured on an H200 (busy-waiting, as NVML's ioctls use CPU). The gpu collector's fast
   sample per GPU is set against the goal of 0.5 ms, and the whole interval against node_exporter's CPU per
   scrape (it collects on scrape).
2. /metrics latency (median, p99) of a sidecar serving 8 GPUs of series (fake NVML) and the bundled demo
   run's training series vs ``prometheus-node-exporter`` on loopback (goal <= 1.0x).

The sidecar of part 2 is this file run with --serve-fake (a sidecar whose collectors get the fake NVML of
tests/fake_pynvml.py). Every subprocess is stopped on the way out, error or not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from paths import BENCH, REPO  # noqa: E402, F401 - sets up imports of the package and the fake NVML

# isort: split

import requests  # noqa: E402
from fake_pynvml import PROBE_COSTS_US, FakeNvml, busy_node  # noqa: E402
from foundation import (  # noqa: E402
    NODE_EXPORTER_NAMES,
    Proc,
    demo_log_bytes,
    scrape_latency,
    start_node_exporter,
    step_of,
)
from helpers import free_port, results_table  # noqa: E402

N_GPUS = 8
NVLINK_LINKS = 18  # H100 / H200 SXM


def fake_node(costs: dict | None = None) -> FakeNvml:
    """8 GPUs with NVLink and a few processes each (our own pid: role lookups hit a real /proc)."""
    return busy_node(N_GPUS, nvlink_links=NVLINK_LINKS, costs_us=costs)


# ---------------------------------------------------------------------------------------------- part 1
def bench_sampler(args, out, costs: dict | None, label: str) -> dict:
    from fake_pynvml import make_context
    from verl_exporter.sidecar.collectors.sampler import Sampler, build_collectors

    fake = fake_node(costs)
    ctx = make_context(fake, gpus="all", trainer_pid=os.getpid(), gpu_pcie_throughput=True)
    collectors = build_collectors({}, ctx)  # every default-on collector that runs here
    sampler = Sampler(collectors, ctx.spec, ctx.self_metrics)
    try:
        for c in collectors:  # warm-up; the first sample of some collectors only primes deltas
            sampler.run_once(c, slow=True)
            for _ in range(args.warmup_samples):
                sampler.run_once(c, slow=False)
        per_collector = {}
        for c in collectors:
            cpu_samples = []
            for _ in range(args.repeats):
                t0 = time.thread_time_ns()
                for _ in range(args.samples):
                    sampler.run_once(c, slow=False)
                cpu_samples.append((time.thread_time_ns() - t0) / args.samples / 1000)
            t0, w0 = time.thread_time_ns(), time.perf_counter()
            sampler.run_once(c, slow=True)
            slow_cpu = (time.thread_time_ns() - t0) / 1000
            slow_wall = (time.perf_counter() - w0) * 1e6
            fast_us = statistics.median(cpu_samples)
            per_collector[c.name] = {"fast_cpu_us": fast_us, "slow_run_cpu_us": max(0.0, slow_cpu - fast_us),
                                     "slow_run_wall_us": max(0.0, slow_wall - fast_us)}
        failures = {c.name: ctx.self_metrics.value("verl_exporter_collector_success", collector=c.name)
                    for c in collectors}
        series = sum(len(rows) for _, rows in sampler.series())
    finally:
        sampler.stop()
    total_fast = sum(r["fast_cpu_us"] for r in per_collector.values())
    total_slow = sum(r["slow_run_cpu_us"] for r in per_collector.values())
    gpu_per_gpu = per_collector.get("gpu", {}).get("fast_cpu_us", float("nan")) / N_GPUS
    pct_core = 100 * total_fast / 1e6  # one sample a second
    out(f"  [{label}] {len(collectors)} collectors, {series} series")
    for name, r in sorted(per_collector.items()):
        out(f"    {name:14}: {r['fast_cpu_us']:9.1f} us CPU per sample; slow run +{r['slow_run_cpu_us']:9.1f} us CPU, "
            f"+{r['slow_run_wall_us'] / 1000:7.1f} ms wall")
    out(f"    all           : {total_fast:9.1f} us CPU per sample = {pct_core:.3f} % of a core at 1 s; "
        f"gpu collector {gpu_per_gpu:.1f} us per GPU")
    return {"collectors": per_collector, "total_fast_cpu_us": total_fast, "total_slow_run_cpu_us": total_slow,
            "pct_core_at_1s": pct_core, "gpu_fast_cpu_us_per_gpu": gpu_per_gpu, "series": series,
            "gpus": N_GPUS, "nvlink_links": NVLINK_LINKS, "samples": args.samples, "repeats": args.repeats,
            "collector_success": failures}


# ---------------------------------------------------------------------------------------------- part 2
def serve_fake(argv: list[str]) -> int:
    """--serve-fake: a real sidecar whose GPU collectors see a fake NVML of 8 GPUs; runs until signalled."""
    from verl_exporter.core.shutdown import stop_event
    from verl_exporter.sidecar.config import build_config
    from verl_exporter.sidecar.sidecar import Sidecar

    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--verl-log", required=True)
    a = p.parse_args(argv)
    fake = fake_node()
    original = Sidecar.context
    Sidecar.context = lambda self: dataclasses.replace(original(self), nvml_loader=lambda: fake)
    config = build_config({}, {"listen": a.listen, "verl_log": a.verl_log, "run": "bench", "rank": 0,
                               "gpus": "all", "interval": 1.0, "trainer_pid": os.getpid()}, origin="bench")
    done = stop_event()
    sidecar = Sidecar(config).start()
    done.wait()
    sidecar.stop()
    return 0


def cpu_per_scrape(proc: Proc, session: requests.Session, n: int) -> float:
    """CPU seconds the process spends per /metrics request, over n requests."""
    before = proc.ps.cpu_times()
    for _ in range(n):
        session.get(proc.url, timeout=5).raise_for_status()
    after = proc.ps.cpu_times()
    return ((after.user + after.system) - (before.user + before.system)) / n


def bench_scrape(args, out) -> dict:
    node_bin = next((b for b in map(shutil.which, NODE_EXPORTER_NAMES) if b), None)
    workdir = Path(tempfile.mkdtemp(prefix="verl-exporter-bench-collectors-"))
    log_path = workdir / "verl.jsonl"
    content, last_step = demo_log_bytes()
    log_path.write_bytes(content)
    procs: list[Proc] = []
    session = requests.Session()
    results: dict = {}
    try:
        port = free_port()
        sidecar = Proc("sidecar", [sys.executable, str(Path(__file__).resolve()), "--serve-fake",
                                   "--listen", f"127.0.0.1:{port}", "--verl-log", str(log_path)],
                       f"http://127.0.0.1:{port}/metrics", workdir)
        procs.append(sidecar)
        node = start_node_exporter(node_bin, workdir, procs, out)

        def ready(text: str) -> bool:
            return ((step_of(text) or 0) >= last_step and text.count("verl_gpu_up{") == N_GPUS
                    and "verl_gpu_energy_joules_total{" in text and "verl_gpu_nvlink_data_bytes_total{" in text)

        sidecar.wait_ready(session, until=ready)
        if node:
            node.wait_ready(session)
        results["scrape"] = {}
        for p in procs:
            row = scrape_latency(p, session, args.scrapes, args.warmup)
            row["cpu_ms_per_scrape"] = cpu_per_scrape(p, session, args.scrapes) * 1000
            results["scrape"][p.name] = row
            out(f"  {p.name:14}: median {row['median_ms']:7.2f} ms, p99 {row['p99_ms']:7.2f} ms, "
                f"{row['series']} series, {row['bytes']} bytes, {row['cpu_ms_per_scrape']:.2f} ms CPU per scrape")
        text = session.get(sidecar.url, timeout=5).text
        results["gpu_series"] = sum(1 for line in text.splitlines() if line.startswith("verl_gpu_"))
        if sidecar.popen.poll() is not None:
            raise RuntimeError(f"sidecar died: {sidecar.stderr_tail()}")
        results["sidecar_warnings"] = [line for line in sidecar.stderr_tail().splitlines()
                                       if "WARNING" in line or "ERROR" in line]
    finally:
        session.close()
        for p in procs:
            with contextlib.suppress(Exception):
                p.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


# ---------------------------------------------------------------------------------------------- main
def build_table(r: dict) -> str:
    rows = []

    def add(name, value, baseline_name, baseline, ratio, goal):
        verdict = "-" if goal is None else ("SKIP" if ratio is None else ("PASS" if ratio <= goal else "FAIL"))
        rows.append((name, value, baseline_name, baseline, "-" if ratio is None else f"{ratio:.3f}",
                     "-" if goal is None else f"<= {goal:g}", verdict))

    free, modeled = r["sampler_free"], r["sampler_modeled"]
    for label, s in (("free NVML", free), ("H200-cost NVML", modeled)):
        add(f"gpu collector per GPU ({label})", f"{s['gpu_fast_cpu_us_per_gpu']:.1f} us", "goal", "500 us",
            s["gpu_fast_cpu_us_per_gpu"] / 500, 1.0)
    scrape = r["scrape"]["scrape"]
    side, node = scrape["sidecar"], scrape.get("node_exporter")
    for label, s in (("free NVML", free), ("H200-cost NVML", modeled)):
        add(f"sampler CPU per 1 s interval ({label})", f"{s['total_fast_cpu_us'] / 1000:.2f} ms",
            "node_exporter CPU per scrape", f"{node['cpu_ms_per_scrape']:.2f} ms" if node else "-",
            s["total_fast_cpu_us"] / 1000 / node["cpu_ms_per_scrape"] if node and node["cpu_ms_per_scrape"] else None,
            None)
        rows.append((f"  = % of one core ({label})", f"{s['pct_core_at_1s']:.3f} %", "(informative)", "-", "-", "-",
                     "-"))
    for stat in ("median", "p99"):
        key = f"{stat}_ms"
        add(f"/metrics {stat} ({side['series']} series, {N_GPUS} GPUs)", f"{side[key]:.2f} ms",
            f"node_exporter ({node['series']} series)" if node else "node_exporter (missing)",
            f"{node[key]:.2f} ms" if node else "-", side[key] / node[key] if node else None, 1.0)
    return results_table(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-fake"]:
        return serve_fake(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (~15 s), to prove it runs")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.repeats, args.warmup_samples, args.scrapes, args.warmup = 50, 3, 3, 100, 10
    else:
        args.samples, args.repeats, args.warmup_samples, args.scrapes, args.warmup = 300, 5, 10, 300, 30
    out = print
    started = time.monotonic()
    results: dict = {"mode": "quick" if args.quick else "full", "python": sys.version.split()[0],
                     "cpu_count": os.cpu_count()}
    out(f"== 1. sampler CPU per sample ({N_GPUS} fake GPUs, {NVLINK_LINKS} NVLink links each, host collectors)")
    results["sampler_free"] = bench_sampler(args, out, None, "NVML calls free")
    # the fake busy-waits calls under 1 ms (CPU) and sleeps the energy and PCIe reads (wall time)
    results["sampler_modeled"] = bench_sampler(args, out, PROBE_COSTS_US, "NVML calls at H200 cost")
    out(f"\n== 2. /metrics latency ({args.scrapes} requests, persistent session, after {args.warmup} warm-up)")
    results["scrape"] = bench_scrape(args, out)
    results["elapsed_s"] = time.monotonic() - started
    table = build_table(results)
    out("\n== results (ratio = measured / baseline, both measured in this run)")
    out(table)
    if results["scrape"].get("sidecar_warnings"):
        out("sidecar warnings: " + " | ".join(results["scrape"]["sidecar_warnings"][:5]))
    out(f"elapsed {results['elapsed_s']:.1f} s ({results['mode']} mode)")
    if args.json:
        results["table"] = table
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
