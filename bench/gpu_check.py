"""Check the GPU collectors on a real NVIDIA machine: the sidecar's series at idle, under a torch matmul load
and after it, which NVML fields this GPU refuses, what a sample costs per GPU, and scrape latency.

    python bench/gpu_check.py --out gpu-check.json [--load-seconds 10]

1. Times the collectors in this process on the real NVML (gpu fast sample per GPU, its slow sample with
   the energy and PCIe reads, nvlink, gpu_processes).
2. Starts a load process (torch, every visible GPU, bf16 matmuls) that waits, then
   ``python -m verl_exporter serve --gpus all --gpu-pcie-throughput --interval 1 --trainer-pid <load pid>``.
3. Scrapes /metrics at idle, every second of the load, and after it; prints every verl_gpu_* series with
   its value, the fields with verl_gpu_field_supported 0, the sampler's cost per GPU per sample
   (verl_exporter_collector_duration_seconds / GPUs), and /metrics latency.
4. In the load process, reads torch's CUDA memory through verl_exporter.trainer.torch_helpers when it exists.

Without NVML (no driver) or without a GPU it says so, writes the summary with ok=false and exits 2; without
torch or CUDA it skips the load. Every subprocess is stopped on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from paths import REPO  # noqa: F401 - sets up imports of the package from this checkout

# isort: split

from helpers import free_port, percentile  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

FAST_GOAL_US_PER_GPU = 500.0

# The load process: waits for "go", runs matmuls on every visible GPU, reports, holds its memory until "exit".
LOAD_SCRIPT = r"""
import json, sys, time
def say(**kw):
    print(json.dumps(kw), flush=True)
try:
    import torch
except ImportError as e:
    say(event="error", reason=f"torch is not installed: {e}"); sys.exit(3)
if not torch.cuda.is_available():
    say(event="error", reason="torch sees no CUDA device"); sys.exit(3)
seconds, n = float(sys.argv[1]), int(sys.argv[2])
devices = list(range(torch.cuda.device_count()))
mats = [(torch.randn(n, n, device=d, dtype=torch.bfloat16), torch.randn(n, n, device=d, dtype=torch.bfloat16))
        for d in devices]
torch.cuda.synchronize()
say(event="ready", devices=len(devices), torch=torch.__version__)
if sys.stdin.readline().strip() != "go":
    sys.exit(0)
started, matmuls = time.monotonic(), 0
while time.monotonic() - started < seconds:
    for a, b in mats:
        a @ b
    matmuls += 1
    if matmuls % 16 == 0:
        torch.cuda.synchronize()  # keep the queue short so that the load ends on time
torch.cuda.synchronize()
elapsed = time.monotonic() - started
tflops = 2 * n ** 3 * matmuls * len(devices) / elapsed / 1e12
helpers = None
try:
    from verl_exporter.sidecar.collectors import Context
    from verl_exporter.exposition.selfmetrics import SelfMetrics
    from verl_exporter.spec import load_spec
    from verl_exporter.trainer.torch_helpers import TorchCollector
except ImportError as e:
    helpers = {"skipped": f"verl_exporter.trainer.torch_helpers is not available: {e}"}
if helpers is None:
    spec = load_spec()
    collector = TorchCollector(Context(spec=spec, self_metrics=SelfMetrics(spec)), memory=True, devices=devices)
    collector.sample()
    t0 = time.perf_counter()
    for _ in range(200):
        samples = collector.sample()
    helpers = {"samples": [[name, labels, value] for name, labels, value in samples],
               "sample_us": (time.perf_counter() - t0) / 200 * 1e6}
say(event="loaded", seconds=elapsed, tflops=tflops, torch_helpers=helpers,
    torch_memory={str(d): {"allocated": torch.cuda.memory_allocated(d), "reserved": torch.cuda.memory_reserved(d)}
                  for d in devices})
sys.stdin.readline()  # hold the memory until told to exit
"""


# ---------------------------------------------------------------------------------------------- helpers
def scrape(url: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return time.perf_counter() - t0, body


def log_tail(f, chars: int = 2000) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-chars:]


def parse(text: str) -> list[tuple[str, dict, float]]:
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def values(samples, name: str, **labels) -> list[float]:
    want = {k: str(v) for k, v in labels.items()}
    return [v for n, lab, v in samples if n == name and want.items() <= lab.items()]


def gpu_series(samples) -> list[tuple[str, dict, float]]:
    return sorted(((n, {k: v for k, v in lab.items() if k not in ("run", "rank")}, v)
                   for n, lab, v in samples if n.startswith("verl_gpu_")), key=lambda r: (r[0], sorted(r[1].items())))


def fmt_labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class LineReader:
    """Lines of a subprocess's stdout on a thread, so that reading can time out."""

    def __init__(self, stream):
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def json_event(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no answer from the load process within {timeout:g} s") from None
            if line is None:
                raise RuntimeError("the load process ended")
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)


# ---------------------------------------------------------------------------------------------- parts
def time_in_process(args, out) -> dict:
    """The collectors' own cost on the real NVML, in this process."""
    from verl_exporter.exposition.selfmetrics import SelfMetrics
    from verl_exporter.sidecar.collectors import Context, Unavailable
    from verl_exporter.sidecar.collectors.gpu import GpuCollector
    from verl_exporter.sidecar.collectors.gpu_processes import GpuProcessesCollector
    from verl_exporter.sidecar.collectors.nvlink import NvlinkCollector
    from verl_exporter.sidecar.config import ServeConfig
    from verl_exporter.spec import load_spec

    spec = load_spec()
    ctx = Context(spec=spec, self_metrics=SelfMetrics(spec), config=ServeConfig(gpus="all", gpu_pcie_throughput=True),
                  environ=dict(os.environ))
    try:
        gpu = GpuCollector(ctx)
    except Unavailable as e:
        return {"unavailable": str(e)}
    result: dict = {"gpus": len(gpu.session.gpus)}
    try:
        n_gpus = len(gpu.session.gpus)
        import pynvml

        with contextlib.suppress(Exception):
            result["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        result["models"] = sorted({g.model for g in gpu.session.gpus})
        for c in (gpu, NvlinkCollector, GpuProcessesCollector):
            try:
                c = c if c is gpu else c(ctx)
                c.sample()  # first sample: discovery (NVLink links, NotSupported fields)
                per_call = []
                for _ in range(args.timing_samples):
                    t0 = time.perf_counter_ns()
                    c.sample()
                    per_call.append((time.perf_counter_ns() - t0) / 1000 / n_gpus)
                row = {"median_us_per_gpu": statistics.median(per_call), "p99_us_per_gpu": percentile(per_call, 99)}
                if c is gpu:
                    slow = []
                    for _ in range(3):
                        t0 = time.perf_counter_ns()
                        c.sample_slow()
                        slow.append((time.perf_counter_ns() - t0) / 1000 / n_gpus)
                    row["slow_median_us_per_gpu"] = statistics.median(slow)
                result[c.name] = row
                out(f"  {c.name:14}: fast sample {row['median_us_per_gpu']:8.1f} us per GPU (p99 "
                    f"{row['p99_us_per_gpu']:.1f})" + (f", slow sample {row['slow_median_us_per_gpu'] / 1000:.1f} ms "
                                                      "per GPU (energy + PCIe)" if "slow_median_us_per_gpu" in row
                                                      else ""))
            finally:
                if c is not gpu and not isinstance(c, type):
                    c.close()
    finally:
        gpu.close()
    return result


def run_check(args, out) -> dict:
    summary: dict = {"ok": False, "python": sys.version.split()[0], "load_seconds": args.load_seconds}
    out("== 1. collectors in this process, real NVML")
    timing = time_in_process(args, out)
    summary["in_process"] = timing
    if "unavailable" in timing:
        summary["reason"] = f"NVML unavailable: {timing['unavailable']}"
        out(f"!! {summary['reason']}")
        return summary

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "exporter"), env.get("PYTHONPATH")) if p)
    procs: list[subprocess.Popen] = []
    load = reader = sidecar_log = None
    try:
        load = subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT, str(args.load_seconds), str(args.matrix)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(load)
        reader = LineReader(load.stdout)
        try:
            ready = reader.json_event(timeout=120)
        except (TimeoutError, RuntimeError) as e:
            ready = {"event": "error", "reason": str(e)}
        if ready.get("event") != "ready":
            out(f"!! no load: {ready.get('reason')}")
            summary["load"] = {"skipped": ready.get("reason")}
            load = None
        port = free_port()
        url = f"http://127.0.0.1:{port}/metrics"
        cmd = [sys.executable, "-m", "verl_exporter", "serve", "--listen", f"127.0.0.1:{port}", "--gpus", "all",
               "--gpu-pcie-throughput", "--interval", "1", "--slow-interval", "5", "--run", "gpu-check",
               "--rank", "0"] + (["--trainer-pid", str(load.pid)] if load else [])
        # a file, not a pipe: a pipe nobody reads would fill and block the sidecar's logging; closed below
        sidecar_log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        sidecar = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sidecar_log, text=True, env=env)
        procs.append(sidecar)
        deadline = time.monotonic() + 30
        idle = []
        while time.monotonic() < deadline:
            if sidecar.poll() is not None:
                raise RuntimeError(f"the sidecar exited: {log_tail(sidecar_log)}")
            with contextlib.suppress(OSError):
                idle = parse(scrape(url)[1])
                if values(idle, "verl_gpu_up") and values(idle, "verl_gpu_energy_joules_total"):
                    break
            time.sleep(0.2)
        if not values(idle, "verl_gpu_up"):
            summary["reason"] = f"the sidecar serves no verl_gpu_up series; its log: {log_tail(sidecar_log)}"
            out(f"!! {summary['reason']}")
            return summary
        n_gpus = len(values(idle, "verl_gpu_up"))
        summary["gpus"] = n_gpus
        out(f"\n== 2. sidecar up with {n_gpus} GPU(s)")

        during: list[list] = []
        if load:
            load.stdin.write("go\n")
            load.stdin.flush()
            out(f"  load: bf16 {args.matrix}x{args.matrix} matmuls for {args.load_seconds:g} s")
            end = time.monotonic() + args.load_seconds
            while time.monotonic() < end:
                time.sleep(1.0)
                with contextlib.suppress(OSError):
                    during.append(parse(scrape(url)[1]))
            loaded = reader.json_event(timeout=60)
            summary["load"] = {k: v for k, v in loaded.items() if k != "event"}
            time.sleep(2.5)  # a sample with the load gone, memory still held
            held = parse(scrape(url)[1])
            load.stdin.write("exit\n")
            load.stdin.flush()
            load.wait(timeout=30)
        else:
            held = idle
        time.sleep(2.5)
        after = parse(scrape(url)[1])

        latencies = []
        for _ in range(args.scrapes):
            latency, text = scrape(url)
            latencies.append(latency * 1000)
        summary["scrape_ms"] = {"median": statistics.median(latencies), "p99": percentile(latencies, 99),
                                "requests": args.scrapes, "series": sum(1 for _ in parse(text))}
        final = parse(text)
        report(summary, out, idle, during, held, after, final, n_gpus)
        summary["sidecar_warnings"] = [line for line in log_tail(sidecar_log, 20000).splitlines()
                                       if "WARNING" in line or "ERROR" in line]
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        if sidecar_log is not None:
            sidecar_log.close()
    return summary


def report(summary, out, idle, during, held, after, final, n_gpus) -> None:
    peak = max(during, key=lambda s: sum(values(s, "verl_gpu_utilization_ratio")), default=held)
    out("\n== 3. verl_gpu_* series at peak load (run/rank labels left out)")
    series = gpu_series(peak)
    for name, labels, value in series:
        out(f"  {name}{fmt_labels(labels)} {value:g}")
    summary["series_at_peak"] = [[n, lab, v] for n, lab, v in series]
    summary["series_names"] = sorted({n for n, _, _ in series})
    unsupported = sorted(f"gpu {lab['gpu']}: {lab['field']}" for n, lab, v in gpu_series(final)
                         if n == "verl_gpu_field_supported" and v == 0)
    summary["unsupported_fields"] = unsupported
    out("\n  fields NVML refuses (verl_gpu_field_supported 0): " + (", ".join(unsupported) or "none"))

    def key(samples, name, **labels):
        found = values(samples, name, **labels)
        return sum(found) / len(found) if found else None

    phases = {"idle": idle, "peak": peak, "load_gone_memory_held": held, "after": after}
    table = {}
    for label, name, extra in (("utilization", "verl_gpu_utilization_ratio", {}),
                               ("power W", "verl_gpu_power_watts", {}),
                               ("sm clock MHz", "verl_gpu_clock_hertz", {"clock": "sm"}),
                               ("temperature C", "verl_gpu_temperature_celsius", {}),
                               ("memory used GiB", "verl_gpu_memory_used_bytes", {}),
                               ("trainer memory GiB", "verl_gpu_process_memory_bytes", {"role": "trainer"}),
                               ("energy J", "verl_gpu_energy_joules_total", {})):
        row = {p: key(s, name, **extra) for p, s in phases.items()}
        if "hertz" in name:
            row = {p: v / 1e6 if v is not None else None for p, v in row.items()}
        if "bytes" in name:
            row = {p: v / 2**30 if v is not None else None for p, v in row.items()}
        table[label] = row
    out("\n  mean over GPUs      " + "".join(f"{p:>24}" for p in phases))
    for label, row in table.items():
        out(f"  {label:19} " + "".join(f"{'-' if v is None else f'{v:.3g}':>24}" for v in row.values()))
    summary["phases"] = table

    costs = {}
    for c in ("gpu", "nvlink", "gpu_processes", "xid"):
        found = values(final, "verl_exporter_collector_duration_seconds", collector=c)
        if found:
            costs[c] = {"seconds_last_sample": found[0], "us_per_gpu": found[0] * 1e6 / n_gpus}
    summary["sampler_cost"] = costs
    out("\n== 4. cost")
    for c, row in costs.items():
        out(f"  sidecar {c:14}: {row['us_per_gpu']:8.1f} us per GPU per sample (last sample, wall)")
    s = summary["scrape_ms"]
    out(f"  /metrics: median {s['median']:.2f} ms, p99 {s['p99']:.2f} ms, {s['series']} samples")
    load = summary.get("load", {})
    if "tflops" in load:
        out(f"  load: {load['tflops']:.0f} TFLOP/s bf16 over {load['seconds']:.1f} s; torch memory "
            f"{json.dumps(load.get('torch_memory'))}")
        helpers = load.get("torch_helpers") or {}
        out("  torch helpers: " + (helpers.get("skipped") or
                                   f"{len(helpers.get('samples', []))} samples, {helpers.get('sample_us', 0):.1f} us "
                                   f"per sample: {helpers.get('samples')}"))

    gpu_fast = summary["in_process"].get("gpu", {}).get("median_us_per_gpu")
    checks = {
        "all GPUs up": all(v == 1 for v in values(final, "verl_gpu_up")),
        "gpu fast sample <= 0.5 ms per GPU": gpu_fast is not None and gpu_fast <= FAST_GOAL_US_PER_GPU,
        "energy counter grew": (key(after, "verl_gpu_energy_joules_total") or 0)
        > (key(idle, "verl_gpu_energy_joules_total") or 0),
        "nvlink: supported series present": bool(values(final, "verl_gpu_nvlink_supported")),
    }
    if during:
        checks["utilization rose under load"] = (table["utilization"]["peak"] or 0) >= 0.5
        checks["power rose under load"] = (table["power W"]["peak"] or 0) > (table["power W"]["idle"] or 0)
        checks["trainer memory seen by role"] = (table["trainer memory GiB"]["load_gone_memory_held"] or 0) > 0
    summary["checks"] = checks
    out("\n== checks")
    for name, ok in checks.items():
        out(f"  {'PASS' if ok else 'FAIL'}  {name}")
    summary["ok"] = all(checks.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the JSON summary")
    parser.add_argument("--load-seconds", type=float, default=10.0)
    parser.add_argument("--matrix", type=int, default=8192, help="side of the bf16 matrices of the load")
    parser.add_argument("--scrapes", type=int, default=50, help="requests for the /metrics latency")
    parser.add_argument("--timing-samples", type=int, default=200, help="in-process samples timed per collector")
    args = parser.parse_args(argv)
    try:
        summary = run_check(args, print)
    except Exception as e:  # say what broke, still write what we have
        summary = {"ok": False, "reason": f"{type(e).__name__}: {e}"}
        print(f"!! {summary['reason']}")
    Path(args.out).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    print(f"\nsummary written to {args.out}: ok={summary['ok']}")
    if "unavailable" in summary.get("in_process", {}):
        return 2
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
