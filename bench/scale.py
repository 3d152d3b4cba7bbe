"""Scale benchmark: 256 simulated ranks scraped by a real Prometheus that evaluates the generated rules.

    python bench/scale.py [--quick] [--json FILE] [--ranks N] [--warmup S] [--duration S] [--no-backfill]
                          [--host-procfs DIR] [--extrapolate-to N]

1. Builds what each rank's sidecar serves, with the real code: per rank a real ``Sidecar`` (not started) whose
   GPU collectors see a fake NVML node of 8 GPUs (tests/fake_pynvml.py, 18 NVLink links each as on H100/H200
   SXM; rank r gets GPU r % 8 of node r // 8), whose host collectors read a modelled procfs of an 8-GPU node
   (shared by its 8 ranks; the node-wide ones, cpu, disk, network and pressure, run on local rank 0 only), rank 0
   with the training series of the bundled demo run (plus the multi-turn and validation keys of bench/foundation.py)
   and a checkpoint directory. Each collector samples twice (the ratios need a delta), and the body is
   rendered by the real /metrics app (Sampler/TextRenderer, client_python for self-metrics and process_*),
   in the OpenMetrics format that Prometheus asks for. Its series are counted: rank 0 and an ordinary rank
   (goal <= 400 each), by family and by collector.
2. One process serves all ranks (an asyncio server listening on one loopback port per rank); each scrape
   re-renders that rank's body with gauges moved slightly, counters grown and timestamps current, so the TSDB
   sees changing samples of a fixed set of series (no churn). gzip when asked, as the sidecar does.
3. A real Prometheus (scrape and evaluation interval 5 s, one job ``verl`` with every rank as a static
   target, rules/verl-alerts.yaml and rules/verl-recording.yaml) scrapes for --warmup + --duration seconds.
   Before it starts, the series that the rules read through a range or an offset are backfilled (``promtool
   tsdb create-blocks-from openmetrics``) as far back as the rules look, so that rule evaluation reads full
   windows (e.g. [1h] = 720 samples per series) rather than the few samples of a short run; --no-backfill
   skips it. The slowest rules are then run again as queries with stats=all (samples read, engine time).
4. Reads Prometheus's own numbers: scrape_duration_seconds of every target (p50/p99/max over the run),
   prometheus_rule_group_last_duration_seconds per group and the per-rule times of /api/v1/rules (sampled at
   every evaluation), the prometheus_rule_evaluation_duration_seconds summary, missed iterations and failures,
   prometheus_tsdb_head_series, process_resident_memory_bytes and the process's RSS from psutil. The memory
   baseline (informative) is the same Prometheus before any target answered (same rules, same backfilled
   blocks, every target refusing connections).
5. Extrapolates to --extrapolate-to ranks (4096): series linearly per rank; memory growth and rule evaluation
   time linearly in head series (the assumption is printed with the numbers).
6. Unless --no-victoriametrics: Prometheus is stopped and the same fleet runs on VictoriaMetrics (the same
   backfill imported, two vmagent shards, victoria-metrics, vmalert with the same rules and intervals) for
   the same warm-up and duration; vmalert's per-group evaluation summary (median, max), series, RSS and CPU
   of every process, extrapolated the same way.

Only 127.0.0.1 is used. Every subprocess and server is stopped on the way out, error or not. The default
(about 3 min) measures 120 s after a 30 s warm-up (the first scrapes create every series: reported apart);
--quick (about 1 min) 25 s after 15 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gzip
import json
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from paths import BENCH, REPO  # noqa: E402, F401 - sets up imports of the package and the fake NVML

# isort: split

import psutil  # noqa: E402
import requests  # noqa: E402
import yaml  # noqa: E402
from fake_pynvml import FakeGpu, FakeNvml, busy_node, default_pci  # noqa: E402
from foundation import extra_keys_line, version_of  # noqa: E402
from helpers import free_port, percentile, results_table  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from verl_exporter.exposition.app import make_app  # noqa: E402
from verl_exporter.sidecar.config import build_config  # noqa: E402
from verl_exporter.sidecar.sidecar import Sidecar  # noqa: E402
from verl_exporter.spec import load_spec  # noqa: E402
from verl_exporter.tools.demo import demo_lines  # noqa: E402

RULE_FILES = [REPO / "rules" / "verl-alerts.yaml", REPO / "rules" / "verl-recording.yaml"]  # --rules DIR: others
JOB = "verl"
RUN = "scale"
GPUS_PER_NODE = 8
NVLINK_LINKS = 18  # H100 / H200 SXM
SERIES_GOAL = 400  # per rank
GROUP_EVAL_GOAL_S = 1.0  # per rule group
# What Prometheus 2.x sends (scrape/scrape.go): OpenMetrics first, text format as a fallback.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
TEXT_ACCEPT = "text/plain;version=0.0.4"
PER_TARGET_SERIES = 5  # up, scrape_duration_seconds, scrape_samples_scraped, _post_metric_relabeling, _series_added

# The modelled node (host collectors): an 8-GPU HGX/DGX-class server with local NVMe and InfiniBand (IPoIB).
NODE_DISKS = ["nvme0n1"] + [f"nvme{i}n1" for i in range(1, 9)] + ["md0"]  # OS disk, 8 data NVMe, their RAID0
NODE_PARTITIONS = ["nvme0n1p1", "nvme0n1p2", "loop0", "loop1"]  # skipped by the disk collector
NODE_NICS = ["eth0"] + [f"ib{i}" for i in range(8)]  # one Ethernet, 8 IPoIB
NODE_VIRTUAL_NICS = ["lo", "docker0", "veth1a2b3c"]  # skipped by the network collector


# ---------------------------------------------------------------------------------------------- the fleet
def write_procfs(root: Path, tick: int) -> None:
    """A procfs of the modelled node; ``tick`` advances its counters (the collectors' ratios need a delta)."""
    (root / "net").mkdir(parents=True, exist_ok=True)
    (root / "pressure").mkdir(exist_ok=True)
    cpus = 224
    user, system, iowait = 9_000_000 + 2000 * tick, 700_000 + 150 * tick, 40_000 + 5 * tick
    idle = 30_000_000 + 700 * tick
    (root / "stat").write_text(f"cpu  {user} 1200 {system} {idle} {iowait} 0 3100 0 0 0\n"
                               + "".join(f"cpu{i} 1 0 1 1 0 0 0 0 0 0\n" for i in range(cpus))
                               + "intr 1\nctxt 1\nbtime 1700000000\nprocesses 1\n")
    (root / "loadavg").write_text("38.12 37.90 36.55 41/5123 98765\n")
    (root / "meminfo").write_text("MemTotal:       2113535492 kB\nMemFree:         412345678 kB\n"
                                  "MemAvailable:   1650123456 kB\nBuffers:           123456 kB\n")
    lines = []
    for i, dev in enumerate(NODE_DISKS + NODE_PARTITIONS):
        # per tick: 100 reads in 50 ms, 50 writes in 100 ms, 50 ms busy (a few % of the sampling period)
        reads, writes, base = 10_000_000 * (i + 1) + 100 * tick, 5_000_000 * (i + 1) + 50 * tick, 1_000_000 * (i + 1)
        major = 9 if dev.startswith("md") else 7 if dev.startswith("loop") else 259
        lines.append(f" {major:4} {i:7} {dev} {reads} 10 {reads * 64} {base + 50 * tick} {writes} 5 {writes * 32} "
                     f"{base + 100 * tick} 1 {base + 50 * tick} {base + 150 * tick} 0 0 0 0 0 0\n")
    (root / "diskstats").write_text("".join(lines))
    lines = ["Inter-|   Receive                                                |  Transmit\n",
             " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls "
             "carrier compressed\n"]
    for i, nic in enumerate(NODE_VIRTUAL_NICS + NODE_NICS):
        b = 10**12 * (i + 1) + 10**9 * tick
        lines.append(f"{nic:>6}: {b} {b // 4000} 0 {i} 0 0 0 0 {b} {b // 4000} 0 0 0 0 0 0\n")
    (root / "net" / "dev").write_text("".join(lines))
    for resource in ("cpu", "io", "memory"):
        (root / "pressure" / resource).write_text(
            f"some avg10=0.50 avg60=0.40 avg300=0.30 total={123456789 + 1000 * tick}\n"
            f"full avg10=0.10 avg60=0.05 avg300=0.02 total={23456789 + 100 * tick}\n")


def fake_node(node: int) -> FakeNvml:
    """8 busy H200s with 18 NVLink links each and the trainer's process on each (UUIDs unique per node)."""
    gpus = [FakeGpu(uuid=f"GPU-{node:04x}{i:04x}-1e9b-25af-fbde-b4e7a3e7d4e0", pci_bus_id=default_pci(i))
            for i in range(GPUS_PER_NODE)]
    fake = busy_node(gpus, nvlink_links=NVLINK_LINKS)
    for i, g in enumerate(fake.gpus):
        g.temperature, g.mem_used, g.clock_reasons = 55 + i, 120 << 30, 0
    return fake


class NodeSidecar(Sidecar):
    """A real sidecar whose NVML is the fake node's and which ignores this machine's CUDA_VISIBLE_DEVICES."""

    def __init__(self, config, spec, nvml: FakeNvml):
        self._nvml = nvml
        super().__init__(config, spec=spec)

    def context(self):
        return dataclasses.replace(super().context(), nvml_loader=lambda: self._nvml, environ={})


def make_checkpoint_dir(root: Path) -> Path:
    for step in (100, 200):
        (root / f"global_step_{step}" / "actor").mkdir(parents=True)
        (root / f"global_step_{step}" / "actor" / "model_world_size_8_rank_0.pt").write_bytes(b"\0" * 4096)
    (root / "latest_checkpointed_iteration.txt").write_text("200")
    return root


def get_body(sidecar: Sidecar, accept: str) -> tuple[str, str]:
    """One scrape of the real /metrics app (what the sidecar's HTTP server would answer)."""
    app = make_app(sidecar.registry, sidecar.self_metrics, sidecar.health,
                   renderers=[sidecar.store.render, sidecar.sampler.render])
    seen: dict = {}
    body = app({"PATH_INFO": "/metrics", "HTTP_ACCEPT": accept, "HTTP_ACCEPT_ENCODING": ""},
               lambda status, headers: seen.update(status=status, headers=dict(headers)))
    if not seen.get("status", "").startswith("200"):
        raise RuntimeError(f"/metrics answered {seen.get('status')}")
    return b"".join(body).decode(), seen["headers"]["Content-Type"]


def build_bodies(args, workdir: Path, spec, out) -> dict:
    """Every rank's /metrics bodies (OpenMetrics and text), from real sidecars. Returns bodies and counts."""
    procfs = Path(args.host_procfs) if args.host_procfs else workdir / "proc"
    if not args.host_procfs:
        write_procfs(procfs, 0)
    checkpoint_dir = make_checkpoint_dir(workdir / "checkpoints")
    lines = demo_lines()
    lines.append(extra_keys_line(json.loads(lines[-1])["step"]))
    steps = [json.loads(line) for line in lines]
    nodes = [fake_node(n) for n in range(math.ceil(args.ranks / GPUS_PER_NODE))]
    sidecars: list[Sidecar] = []
    started = time.perf_counter()
    try:
        for rank in range(args.ranks):
            flags = {"listen": "127.0.0.1:0", "run": RUN, "rank": rank, "local_rank": rank % GPUS_PER_NODE,
                     "trainer_pid": os.getpid(), "procfs": str(procfs), "gpus": "auto"}
            if rank == 0:  # the driver's sidecar: verl's log and the checkpoint directory
                flags["checkpoint_dir"] = str(checkpoint_dir)
            sidecar = NodeSidecar(build_config({}, flags, origin="bench"), spec, nodes[rank // GPUS_PER_NODE])
            sidecars.append(sidecar)
            if rank == 0:
                for obj in steps:
                    sidecar.store.ingest(obj["step"], obj["data"], time.time())
        for tick in (1, 2):  # two samples, as a running sidecar has had (the second is the one measured)
            if not args.host_procfs:
                write_procfs(procfs, tick)
            for sidecar in sidecars:
                for c in sidecar.sampler.collectors:
                    sidecar.sampler.run_once(c, slow=tick == 1)
            time.sleep(0.2)
        bodies = []
        for sidecar in sidecars:
            get_body(sidecar, PROMETHEUS_ACCEPT)  # the first scrape; the second then has its duration gauge
            om, om_type = get_body(sidecar, PROMETHEUS_ACCEPT)
            text, text_type = get_body(sidecar, TEXT_ACCEPT)
            bodies.append({"om": om, "om_type": om_type, "text": text, "text_type": text_type})
        collectors = sorted(c.name for c in sidecars[-1].sampler.collectors)
        collectors0 = sorted(c.name for c in sidecars[0].sampler.collectors)
    finally:
        with ThreadPoolExecutor(max_workers=64) as pool:  # the XID threads each take up to 0.5 s to stop
            list(pool.map(lambda s: s.sampler.stop(), sidecars))
    out(f"  built {len(bodies)} rank bodies from real sidecars in {time.perf_counter() - started:.1f} s "
        f"(collectors rank 0: {', '.join(collectors0)}; others: {', '.join(collectors)})")
    own = None
    if not args.host_procfs and os.path.isdir("/proc/self"):
        own = count_own_machine_rank(spec, nodes[0])
    return {"bodies": bodies, "own_proc_series": own}


def count_own_machine_rank(spec, nvml: FakeNvml) -> int:
    """Series of an ordinary rank whose host collectors read this machine's procfs (for comparison)."""
    config = build_config({}, {"listen": "127.0.0.1:0", "run": RUN, "rank": 1, "local_rank": 1,
                               "trainer_pid": os.getpid(), "gpus": "auto"}, origin="bench")
    sidecar = NodeSidecar(config, spec, nvml)
    try:
        for slow in (True, False):
            for c in sidecar.sampler.collectors:
                sidecar.sampler.run_once(c, slow=slow)
            time.sleep(0.1)
        get_body(sidecar, PROMETHEUS_ACCEPT)
        return series_count(get_body(sidecar, PROMETHEUS_ACCEPT)[0])
    finally:
        sidecar.sampler.stop()


def series_count(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def sample_names(text: str) -> list[str]:
    return [line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"]


def source_of(spec, name: str) -> str:
    """Which part of the sidecar a series comes from: a collector, training, or the sidecar itself."""
    if name.startswith("process_"):
        return "self (process_*)"
    if name.startswith("verl_unmapped_") or name not in spec:
        return "training"
    metric = spec[name]
    if metric.instrumented_by == "exporter":
        return "self (verl_exporter_*)"
    return metric.collector or metric.instrumented_by or "training"


def breakdown(spec, text: str) -> dict:
    names = sample_names(text)
    by_family = Counter(names)
    by_source = Counter(source_of(spec, n) for n in names)
    return {"series": len(names), "families": dict(by_family.most_common()), "sources": dict(by_source.most_common())}


# ---------------------------------------------------------------------------------------------- templates
STATIC, GAUGE, GAUGE_INT, COUNTER, NOW, STEP, STEP_TIME = range(7)
STATIC_SUFFIXES = ("_total_bytes", "_limit_watts", "_max_fds", "_start_time_seconds", "_size_bytes", "_info",
                   "_kept", "_latest_step", "_latest_timestamp_seconds")
JITTER = 0.03  # gauges move within +-3 % ...
PERIOD_S = 300.0  # ... over a 5-minute sine
COUNTER_RATE = 1e-4  # counters grow by this fraction of their value per second
STEP_S = 60.0  # rank 0's training step advances once a minute


class Template:
    """One rank's body as static text and value slots; ``render(t)`` gives the body at wall time t.

    Gauges move slightly (a sine), counters that are not zero grow, last-*-timestamp gauges follow the clock,
    the training step advances; 0/1 flags, NaN, limits, totals and info series stay as they are. The same
    functions give the backfilled history, so history and live samples join up.
    """

    def __init__(self, text: str, content_type: str, t0: float):
        self.content_type = content_type
        self.t0 = t0
        self.parts: list[str] = []
        self.slots: list[tuple[int, int, float, float, bool]] = []  # (part index, kind, base, phase, clamp to 1)
        self.series: list[tuple[str, str, int, float, float, bool]] = []  # (name, prefix, kind, base, phase, clamp)
        types: dict[str, str] = {}
        static: list[str] = []
        for line in text.splitlines(keepends=True):
            if line.startswith("#"):
                fields = line.split()
                if len(fields) >= 4 and fields[1] == "TYPE":
                    types[fields[2]] = fields[3]
                static.append(line)
                continue
            prefix, _, raw = line.rstrip("\n").rpartition(" ")
            name = prefix.split("{", 1)[0].strip()
            base = float(raw)
            ftype = types.get(name) or (types.get(name[: -len("_total")]) if name.endswith("_total") else None)
            kind = self._kind(name, ftype, base)
            phase = (zlib.crc32(prefix.encode()) % 6283) / 1000.0
            clamp = name.endswith("_ratio")
            self.series.append((name, prefix, kind, base, phase, clamp))
            if kind == STATIC:
                static.append(line)
                continue
            static.append(prefix + " ")
            self.parts.append("".join(static))
            static = []
            self.slots.append((len(self.parts), kind, base, phase, clamp))
            self.parts.append("")  # the value goes here
            static.append("\n")
        self.parts.append("".join(static))

    @staticmethod
    def _kind(name: str, ftype: str | None, base: float) -> int:
        if not math.isfinite(base):
            return STATIC
        if name == "verl_training_step":
            return STEP
        if name == "verl_training_last_step_timestamp_seconds":
            return STEP_TIME
        if name.endswith("_timestamp_seconds") and "_last_" in name:
            return NOW
        if ftype == "counter" or name.endswith("_total"):
            return COUNTER if base > 0 else STATIC
        if base in (0.0, 1.0) or name.endswith(STATIC_SUFFIXES):
            return STATIC
        return GAUGE_INT if base.is_integer() else GAUGE

    def value(self, kind: int, base: float, phase: float, clamp: bool, t: float) -> float:
        if kind in (GAUGE, GAUGE_INT):
            v = base * (1.0 + JITTER * math.sin(2 * math.pi * t / PERIOD_S + phase))
            if clamp:
                v = min(v, 1.0)
            return float(round(v)) if kind == GAUGE_INT else v
        if kind == COUNTER:
            return max(0.0, base * (1.0 + COUNTER_RATE * (t - self.t0)))
        if kind == NOW:
            return t
        if kind == STEP:
            return max(0.0, base + math.floor((t - self.t0) / STEP_S))
        if kind == STEP_TIME:
            return self.t0 + math.floor((t - self.t0) / STEP_S) * STEP_S
        return base

    def render(self, t: float) -> bytes:
        parts = self.parts[:]
        value = self.value
        for index, kind, base, phase, clamp in self.slots:
            parts[index] = repr(value(kind, base, phase, clamp, t))
        return "".join(parts).encode()


# ---------------------------------------------------------------------------------------------- the server
class Fleet:
    """All ranks in one process: one asyncio loop, one loopback listening socket per rank.

    The sockets are bound at once (so their ports can go into Prometheus's configuration) but listen only
    after ``listen()``: until then every target refuses connections (the memory baseline).
    """

    def __init__(self, templates: list[tuple[Template, Template]]):
        self.templates = templates
        self.socks: list[socket.socket] = []
        for _ in templates:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            self.socks.append(s)
        self.ports = [s.getsockname()[1] for s in self.socks]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="scale-fleet", daemon=True)
        self.thread.start()
        self.servers: list[asyncio.AbstractServer] = []
        self.requests = 0
        self.errors = 0
        self.busy_s = 0.0  # time spent rendering and compressing bodies

    def listen(self) -> None:
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(timeout=30)

    async def _listen(self) -> None:
        for i, sock in enumerate(self.socks):
            self.servers.append(await asyncio.start_server(functools.partial(self._handle, i), sock=sock,
                                                           backlog=128, limit=65536))

    async def _handle(self, rank: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=120)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                    return
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for h in header_lines:
                    k, sep, v = h.partition(":")
                    if sep:
                        headers[k.strip().lower()] = v.strip()
                parts = request_line.split(" ")
                path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
                started = time.perf_counter()
                if path == "/metrics":
                    om = "application/openmetrics-text" in headers.get("accept", "")
                    template = self.templates[rank][0 if om else 1]
                    body = template.render(time.time())
                    extra = ""
                    if "gzip" in headers.get("accept-encoding", ""):
                        body = gzip.compress(body, compresslevel=1)  # as the sidecar does
                        extra = "Content-Encoding: gzip\r\n"
                    head_out = (f"HTTP/1.1 200 OK\r\nContent-Type: {template.content_type}\r\n{extra}"
                                f"Content-Length: {len(body)}\r\n\r\n")
                    self.requests += 1
                else:
                    body = b"not found\n"
                    head_out = f"HTTP/1.1 404 Not Found\r\nContent-Length: {len(body)}\r\n\r\n"
                    self.errors += 1
                self.busy_s += time.perf_counter() - started
                writer.write(head_out.encode() + body)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        except Exception:
            self.errors += 1
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def stop(self) -> None:
        async def close():
            for server in self.servers:
                server.close()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for t in tasks:
                t.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)

        try:
            if self.loop.is_running():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=10)
        finally:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.close()
            if not self.thread.is_alive():
                self.loop.close()


# ---------------------------------------------------------------------------------------------- backfill
_DURATION = re.compile(r"(\d+)([smhdwy])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{[^}]*\}\s*(\[[0-9smhdwy:]+\])?(\s+offset\s+[0-9smhdwy]+)?")
_RANGE = re.compile(r"\[([0-9smhdwy]+)(:[0-9smhdwy]*)?\]")
_OFFSET = re.compile(r"offset\s+([0-9smhdwy]+)")


def seconds(duration: str) -> float:
    return float(sum(int(n) * _UNITS[u] for n, u in _DURATION.findall(duration)))


def rule_lookbacks(paths) -> dict[str, float]:
    """Seconds of history each scraped metric needs for the rules: for every selector with a range or an
    offset, the rule's largest range plus its subquery ranges plus its largest offset (an over-estimate)."""
    need: dict[str, float] = {}
    for path in paths:
        for group in (yaml.safe_load(Path(path).read_text()) or {}).get("groups", []):
            for rule in group.get("rules", []):
                expr = str(rule.get("expr", ""))
                ranges = _RANGE.findall(expr)
                plain = [seconds(r) for r, sub in ranges if not sub]
                subquery = [seconds(r) for r, sub in ranges if sub]
                offsets = [seconds(o) for o in _OFFSET.findall(expr)]
                lookback = max(plain, default=0.0) + sum(subquery) + max(offsets, default=0.0)
                if lookback <= 0:
                    continue
                for name, rng, offset in _SELECTOR.findall(expr):
                    # recorded series (a:b:c) are not scraped; the per-series window aggregates of the
                    # once-a-minute group (rank:<metric>:<fn>_over_time_<w>) are backfilled from <metric>
                    if (rng or offset) and (":" not in name or _WINDOW_RECORD.fullmatch(name)):
                        need[name] = max(need.get(name, 0.0), lookback)
    return need


_WINDOW_RECORD = re.compile(r"rank:([a-zA-Z_][a-zA-Z0-9_]*):(?:avg|max|min)_over_time_[0-9]+[mh]")
WINDOW_RECORD_INTERVAL = 60.0  # the generated windows group's interval


def write_backfill(path: Path, templates: list[Template], ports: list[int], lookbacks: dict[str, float],
                   interval: float, end: float) -> dict:
    """OpenMetrics with timestamps for promtool: each series the rules look back on, at every scrape
    interval up to ``end``, with the job and instance labels Prometheus will give the live samples."""
    samples = 0
    series = 0
    per_metric: Counter = Counter()
    recorded: dict[str, list[tuple[str, float]]] = {}  # scraped metric -> its window recordings and look-backs
    for name, lookback in lookbacks.items():
        if m := _WINDOW_RECORD.fullmatch(name):
            recorded.setdefault(m.group(1), []).append((name, lookback))
    with open(path, "w", buffering=1 << 20) as f:
        write = f.write
        for template, port in zip(templates, ports, strict=True):
            target = f'job="{JOB}",instance="127.0.0.1:{port}"'
            for name, prefix, kind, base, phase, clamp in template.series:
                p = prefix.rstrip()
                p = f"{p[:-1]},{target}}} " if p.endswith("}") else f"{p}{{{target}}} "
                value = template.value
                plans = [(name, p, lookbacks[name], interval)] if name in lookbacks else []
                plans += [(rec, rec + p[len(name):], lb, WINDOW_RECORD_INTERVAL) for rec, lb in recorded.get(name, [])]
                for out_name, out_prefix, lookback, step in plans:
                    n = int(lookback // step) + 1
                    for k in range(n, 0, -1):
                        t = end - k * step
                        write(f"{out_prefix}{value(kind, base, phase, clamp, t)!r} {t:.3f}\n")
                    samples += n
                    series += 1
                    per_metric[out_name] += n
        write("# EOF\n")
    return {"samples": samples, "series": series, "bytes": path.stat().st_size,
            "samples_by_metric": dict(per_metric.most_common())}


# ---------------------------------------------------------------------------------------------- Prometheus
class Prometheus:
    def __init__(self, binary: str, workdir: Path, ports: list[int], args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = workdir / "data"
        self.data.mkdir(exist_ok=True)
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{args.scrape_interval:g}s",
                       "scrape_timeout": f"{min(args.scrape_interval, 10):g}s",
                       "evaluation_interval": f"{args.eval_interval:g}s"},
            "rule_files": [str(p) for p in RULE_FILES],
            "scrape_configs": [{"job_name": JOB,
                                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}],
        }, sort_keys=False))
        self.binary = binary
        self.log_path = workdir / "prometheus.log"
        self.popen: subprocess.Popen | None = None
        self.ps: psutil.Process | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.data}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=self._log, stdin=subprocess.DEVNULL)
        self.ps = psutil.Process(self.popen.pid)

    def wait_ready(self, session: requests.Session, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.popen.returncode}: {self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if session.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout:g} s: {self.log_tail()}")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        if hasattr(self, "_log"):
            self._log.close()

    def rss(self) -> float:
        return float(self.ps.memory_info().rss)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def own_metrics(self, session: requests.Session) -> dict:
        """The few of Prometheus's own /metrics that this benchmark reads."""
        text = session.get(f"{self.url}/metrics", timeout=10).text
        want = {"process_resident_memory_bytes", "prometheus_tsdb_head_series",
                "prometheus_rule_group_last_duration_seconds", "prometheus_rule_evaluation_duration_seconds",
                "prometheus_rule_group_iterations_missed_total", "prometheus_rule_evaluation_failures_total",
                "prometheus_tsdb_head_samples_appended_total", "prometheus_rule_group_iterations_total",
                "go_memstats_heap_inuse_bytes"}
        out: dict = defaultdict(dict)
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in want:
                    key = s.labels.get("rule_group") or s.labels.get("quantile") or ""
                    if s.name == "prometheus_rule_group_last_duration_seconds" or key:
                        out[s.name][_group_name(key)] = s.value
                    else:
                        out[s.name][""] = out[s.name].get("", 0.0) + s.value
        return out

    def query(self, session: requests.Session, expr: str) -> list:
        r = session.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def query_stats(self, session: requests.Session, expr: str) -> dict:
        """One instant query with the engine's own timings and sample counts (stats=all)."""
        started = time.perf_counter()
        r = session.get(f"{self.url}/api/v1/query", params={"query": expr, "stats": "all"}, timeout=60)
        wall = time.perf_counter() - started
        r.raise_for_status()
        data = r.json()["data"]
        stats = data.get("stats", {})
        return {"wall_s": wall, "result_series": len(data.get("result", [])), **stats.get("timings", {}),
                "total_queryable_samples": stats.get("samples", {}).get("totalQueryableSamples")}


RULE_QUERIES: dict[str, str] = {}  # rule name -> its expression, as /api/v1/rules shows it


def _group_name(rule_group: str) -> str:
    """'/path/to/verl-alerts.yaml;verl-exporter.training' -> 'verl-exporter.training'."""
    return rule_group.rpartition(";")[2]


def poll_rules(prom: Prometheus, session: requests.Session, since: float, evals: dict, rule_errors: dict) -> None:
    """Record each group evaluation that started after ``since`` once (by its lastEvaluation): its start, its
    duration and each rule's. Polled at half the evaluation interval, so that none is missed."""
    r = session.get(f"{prom.url}/api/v1/rules", timeout=10)
    r.raise_for_status()
    for group in r.json()["data"]["groups"]:
        last = group.get("lastEvaluation", "")
        seen = evals.setdefault(group["name"], {})
        if not last or last.startswith("0001") or last in seen:
            continue
        started = _rfc3339(last)
        if started < since:
            continue
        rules = {rule["name"]: float(rule.get("evaluationTime", 0.0)) for rule in group.get("rules", [])}
        for rule in group.get("rules", []):
            RULE_QUERIES.setdefault(rule["name"], rule.get("query", ""))
        seen[last] = (started, float(group.get("evaluationTime", 0.0)), rules)
        for rule in group.get("rules", []):
            if rule.get("lastError"):
                rule_errors[rule["name"]] = rule["lastError"]


def _rfc3339(stamp: str) -> float:
    """Seconds since the epoch of Prometheus's RFC 3339 timestamps (nanoseconds trimmed to microseconds)."""
    from datetime import datetime

    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", stamp)
    if not m:
        return 0.0
    frac = (m.group(2) or ".0")[:7]
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(f"{m.group(1)}{frac}{zone}").timestamp()


# ---------------------------------------------------------------------------------------------- VictoriaMetrics
class VictoriaMetrics:
    """victoria-metrics, two vmagent shards scraping the fleet and vmalert with the generated rules."""

    SHARDS = 2

    def __init__(self, workdir: Path, ports: list[int], args):
        self.workdir, self.args = workdir / "vm", args
        self.workdir.mkdir(exist_ok=True)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.vmalert = f"http://127.0.0.1:{free_port()}"
        self.config = self.workdir / "vmagent.yml"
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{args.scrape_interval:g}s",
                       "scrape_timeout": f"{min(args.scrape_interval, 10):g}s"},
            "scrape_configs": [{"job_name": JOB,
                                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}],
        }, sort_keys=False))
        self.procs: dict[str, subprocess.Popen] = {}

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)

    def _wait(self, session: requests.Session, url: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.check()
            with contextlib.suppress(requests.RequestException):
                if session.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{url} not ready")

    def check(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited: {(self.workdir / f'{name}.log').read_text()[-2000:]}")

    def start_storage(self, session: requests.Session) -> None:
        self._start("victoria-metrics", [shutil.which("victoria-metrics"), f"-storageDataPath={self.workdir / 'data'}",
                                         f"-httpListenAddr={self.url[7:]}", "-loggerLevel=WARN"])
        self._wait(session, self.url + "/health")

    def start_rest(self, session: requests.Session) -> None:
        for member in range(self.SHARDS):
            addr = f"127.0.0.1:{free_port()}"
            self._start(f"vmagent-{member}", [
                shutil.which("vmagent"), f"-promscrape.config={self.config}", f"-httpListenAddr={addr}",
                f"-promscrape.cluster.membersCount={self.SHARDS}", f"-promscrape.cluster.memberNum={member}",
                f"-remoteWrite.url={self.url}/api/v1/write", f"-remoteWrite.tmpDataPath={self.workdir / str(member)}",
                "-loggerLevel=WARN"])
        self._start("vmalert", [shutil.which("vmalert"), *[f"-rule={p}" for p in RULE_FILES],
                                f"-httpListenAddr={self.vmalert[7:]}", f"-datasource.url={self.url}",
                                f"-remoteWrite.url={self.url}", "-notifier.url=http://127.0.0.1:1",
                                f"-evaluationInterval={self.args.eval_interval:g}s", "-loggerLevel=WARN"])
        self._wait(session, self.vmalert + "/health")

    def backfill(self, session: requests.Session, om_path: Path) -> None:
        """The OpenMetrics backfill (seconds) as Prometheus text with millisecond timestamps, in chunks."""
        chunk: list[str] = []

        def send():
            session.post(f"{self.url}/api/v1/import/prometheus", data="".join(chunk).encode(),
                         timeout=300).raise_for_status()
            chunk.clear()

        with open(om_path) as f:
            for line in f:
                if line.startswith("#"):
                    continue
                head, _, ts = line.rpartition(" ")
                chunk.append(f"{head} {int(float(ts) * 1000)}\n")
                if len(chunk) >= 200_000:
                    send()
        if chunk:
            send()
        session.get(f"{self.url}/internal/force_flush", timeout=60)

    def rss(self) -> dict[str, float]:
        return {name: float(psutil.Process(p.pid).memory_info().rss) for name, p in self.procs.items()}

    def cpu_s(self) -> float:
        return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in self.procs.values())

    def query(self, session: requests.Session, expr: str) -> list:
        r = session.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def group_durations(self, session: requests.Session) -> dict[str, dict[str, float]]:
        """vmalert's own summary of each group's evaluation time: {group: {quantile: seconds}}."""
        out: dict = defaultdict(dict)
        for fam in text_string_to_metric_families(session.get(f"{self.vmalert}/metrics", timeout=10).text):
            for s in fam.samples:
                if s.name == "vmalert_iteration_duration_seconds" and "quantile" in s.labels:
                    out[s.labels["group"]][s.labels["quantile"]] = s.value
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def run_victoriametrics(args, session, workdir: Path, fleet, templates, out) -> dict:
    """The same fleet on VictoriaMetrics: backfill (as for Prometheus), then scrape and evaluate for the same
    warm-up and duration; vmalert's per-group evaluation summary, series, memory and CPU of every process."""
    vm = VictoriaMetrics(workdir, fleet.ports, args)
    try:
        vm.start_storage(session)
        if args.backfill:
            started = time.perf_counter()
            om_path = workdir / "backfill-vm.om"
            write_backfill(om_path, [t[0] for t in templates], fleet.ports, rule_lookbacks(RULE_FILES),
                           args.scrape_interval, time.time())
            vm.backfill(session, om_path)
            om_path.unlink()
            out(f"  backfill imported in {time.perf_counter() - started:.1f} s")
        vm.start_rest(session)
        enabled = time.time()
        cpu0 = None
        while time.time() < enabled + args.warmup + args.duration:
            vm.check()
            if cpu0 is None and time.time() >= enabled + args.warmup:
                cpu0 = (time.time(), vm.cpu_s())
            time.sleep(1)
        cpu1 = (time.time(), vm.cpu_s())
        groups = vm.group_durations(session)
        series = float(vm.query(session, 'count({__name__=~".+"})')[0]["value"][1])
        scrape = [float(s["value"][1]) for s in vm.query(
            session, f'quantile_over_time(0.99, scrape_duration_seconds{{job="{JOB}"}}[{int(args.duration)}s])')]
        up = [float(s["value"][1]) for s in vm.query(session, f'up{{job="{JOB}"}}')]
        rss = vm.rss()
        result = {
            "series": series, "targets_up": sum(up), "targets": len(up),
            "scrape_p99_s": max(scrape, default=0.0),
            "groups": {_short(g): q for g, q in groups.items()},
            "worst_group_max_s": max((q.get("1", 0.0) for q in groups.values()), default=0.0),
            "worst_group_median_s": max((q.get("0.5", 0.0) for q in groups.values()), default=0.0),
            "rss_bytes": rss, "rss_total_bytes": sum(rss.values()),
            "cpu_cores": (cpu1[1] - cpu0[1]) / (cpu1[0] - cpu0[0]) if cpu0 else None,
        }
        out(f"  {len(up)} targets ({sum(up):.0f} up), {series:,.0f} series, scrape p99 "
            f"{result['scrape_p99_s'] * 1e3:.1f} ms, RSS {result['rss_total_bytes'] / 2**20:.0f} MiB in all "
            f"({', '.join(f'{k} {v / 2**20:.0f}' for k, v in rss.items())}), CPU {result['cpu_cores'] or 0:.2f} cores")
        for g, q in sorted(result["groups"].items()):
            out(f"  group {g:12}: median {q.get('0.5', 0) * 1e3:7.1f} ms, max {q.get('1', 0) * 1e3:7.1f} ms")
        return result
    finally:
        vm.stop()


# ---------------------------------------------------------------------------------------------- the run
def run(args, out) -> dict:
    prom_bin, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prom_bin or not promtool:
        raise SystemExit("this benchmark needs Prometheus and promtool (Debian: apt-get install prometheus; "
                         "scripts/test installs them)")
    env = environment(args, prom_bin, promtool)
    out("== environment")
    for key, value in env.items():
        out(f"  {key:18}: {value}")
    results: dict = {"env": env, "mode": env["mode"]}
    workdir = Path(tempfile.mkdtemp(prefix="verl-exporter-bench-scale-"))
    session = requests.Session()
    fleet: Fleet | None = None
    prom: Prometheus | None = None
    try:
        spec = load_spec()
        out(f"\n== 1. series per rank ({args.ranks} ranks, {GPUS_PER_NODE} per node, 1 GPU each, "
            f"{NVLINK_LINKS} NVLink links per GPU)")
        built = build_bodies(args, workdir, spec, out)
        bodies = built["bodies"]
        rank0, ordinary = breakdown(spec, bodies[0]["om"]), breakdown(spec, bodies[min(1, len(bodies) - 1)]["om"])
        text_counts = {series_count(b["text"]) for b in bodies[1:]}
        om_counts = [series_count(b["om"]) for b in bodies]
        results["per_rank"] = {
            "rank0": rank0, "ordinary": ordinary,
            "ordinary_min": min(om_counts[1:], default=om_counts[0]), "ordinary_max": max(om_counts[1:], default=0),
            "text_format_ordinary": sorted(text_counts), "total_body_series": sum(om_counts),
            "own_proc_ordinary": built["own_proc_series"],
            "host_model": "this procfs: " + args.host_procfs if args.host_procfs else
            f"modelled 8-GPU node: disks {','.join(NODE_DISKS)}; NICs {','.join(NODE_NICS)}",
            "bytes_rank0": len(bodies[0]["om"]), "bytes_ordinary": len(bodies[min(1, len(bodies) - 1)]["om"]),
        }
        print_breakdown(out, results["per_rank"])

        t0 = time.time()
        templates = [(Template(b["om"], b["om_type"], t0), Template(b["text"], b["text_type"], t0)) for b in bodies]
        del bodies, built
        fleet = Fleet(templates)
        prom = Prometheus(prom_bin, workdir, fleet.ports, args)
        check = subprocess.run([promtool, "check", "config", str(prom.config)], capture_output=True, text=True,
                               timeout=60)
        if check.returncode != 0:
            raise RuntimeError(f"promtool check config failed: {check.stdout}{check.stderr}")

        if args.backfill:
            out("\n== 2. backfill (history the rules look back on, so that windows are full from the start)")
            lookbacks = rule_lookbacks(RULE_FILES)
            started = time.perf_counter()
            om_path = workdir / "backfill.om"
            bf = write_backfill(om_path, [t[0] for t in templates], fleet.ports, lookbacks, args.scrape_interval,
                                time.time())
            written = time.perf_counter() - started
            # promtool reads the whole input once per block: blocks of up to 18 h (the 2 h default would make
            # several passes over the file for the 6 h look-backs) mean one or two passes.
            res = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet",
                                  "--max-block-duration=24h", str(om_path), str(prom.data)],
                                 capture_output=True, text=True, timeout=args.backfill_timeout)
            if res.returncode != 0:
                raise RuntimeError(f"promtool backfill failed: {(res.stdout + res.stderr)[-2000:]}")
            om_path.unlink()
            bf.update({"lookback_s": lookbacks, "write_s": written,
                       "promtool_s": time.perf_counter() - started - written})
            results["backfill"] = bf
            out(f"  {bf['series']} series, {bf['samples']:,} samples ({bf['bytes'] / 2**20:.0f} MiB of OpenMetrics) "
                f"written in {written:.1f} s, blocks made by promtool in {bf['promtool_s']:.1f} s")
            longest = sorted(lookbacks.items(), key=lambda kv: -kv[1])
            out("  look-back per metric: " + ", ".join(f"{n} {s / 60:g}m" for n, s in longest))
        else:
            results["backfill"] = None

        out(f"\n== 3. Prometheus: {args.ranks} targets, scrape every {args.scrape_interval:g} s, rules every "
            f"{args.eval_interval:g} s, {args.warmup:g} s warm-up + {args.duration:g} s measured")
        prom.start()
        prom.wait_ready(session)
        time.sleep(args.idle_s)  # every target refuses connections: Prometheus with rules, blocks and no data
        idle = {"rss_psutil": prom.rss(), **{k: v.get("", 0.0) for k, v in prom.own_metrics(session).items()
                                            if k in ("process_resident_memory_bytes", "prometheus_tsdb_head_series")}}
        results["idle"] = idle
        out(f"  before any target answered: RSS {idle['rss_psutil'] / 2**20:.0f} MiB, "
            f"{idle.get('prometheus_tsdb_head_series', 0):.0f} head series")

        fleet.listen()
        enabled = time.time()
        since = enabled + args.warmup  # the first scrapes create every series: a warm-up, reported apart
        evals: dict = {}
        rule_errors: dict = {}
        memory: list[tuple[float, float, float, float]] = []  # (t, psutil rss, process_resident_memory, head)
        cpu_marks: list[tuple] = [cpu_mark(prom)]
        end = since + args.duration
        next_report = enabled + 30
        while time.time() < end:
            if prom.popen.poll() is not None:
                raise RuntimeError(f"prometheus died: {prom.log_tail()}")
            poll_rules(prom, session, enabled, evals, rule_errors)
            own = prom.own_metrics(session)
            memory.append((time.time(), prom.rss(), own["process_resident_memory_bytes"].get("", 0.0),
                           own["prometheus_tsdb_head_series"].get("", 0.0)))
            if len(cpu_marks) == 1 and time.time() >= since:
                cpu_marks.append(cpu_mark(prom))
            if time.time() >= next_report:
                next_report += 30
                phase = "warm-up" if time.time() < since else "measuring"
                out(f"  t+{time.time() - enabled:4.0f} s ({phase}): head series {memory[-1][3]:,.0f}, RSS "
                    f"{memory[-1][1] / 2**20:.0f} MiB, scrapes served {fleet.requests}")
            time.sleep(min(args.eval_interval / 2, max(0.0, end - time.time())))
        poll_rules(prom, session, enabled, evals, rule_errors)
        cpu_marks.append(cpu_mark(prom))
        final = prom.own_metrics(session)
        results["prometheus"] = collect_results(args, prom, session, since, enabled, final, evals, rule_errors,
                                                memory, cpu_marks, fleet)
        if prom.popen.poll() is not None:
            raise RuntimeError(f"prometheus died: {prom.log_tail()}")
        log_lines = [line for line in prom.log_tail().splitlines() if "level=error" in line or "level=warn" in line]
        results["prometheus"]["log_warnings"] = log_lines[-5:]
        if args.victoriametrics:
            prom.stop()  # one engine at a time on the machine
            out(f"\n== 4. VictoriaMetrics: the same {args.ranks} targets, {VictoriaMetrics.SHARDS} vmagent shards, "
                f"victoria-metrics, vmalert with the same rules; {args.warmup:g} s warm-up + {args.duration:g} s")
            results["victoriametrics"] = run_victoriametrics(args, session, workdir, fleet, templates, out)
    finally:
        session.close()
        if prom is not None:
            with contextlib.suppress(Exception):
                prom.stop()
        if fleet is not None:
            with contextlib.suppress(Exception):
                fleet.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def cpu_mark(prom: Prometheus) -> tuple[float, float, float, float]:
    """(wall time, Prometheus CPU s, this process's CPU s, CPU s busy on the whole machine)."""
    own = psutil.Process().cpu_times()
    machine = psutil.cpu_times()
    busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
    return time.time(), prom.cpu_s(), own.user + own.system, busy


def _stats(values: list[float]) -> dict:
    return {"n": len(values), "median_s": statistics.median(values) if values else float("nan"),
            "p99_s": percentile(values, 99), "max_s": max(values, default=float("nan"))}


def collect_results(args, prom, session, since, enabled, final, evals, rule_errors, memory, cpu_marks,
                    fleet) -> dict:
    window = int(time.time() - enabled) + 1
    durations: list[tuple[float, float]] = []  # (timestamp, seconds) of every scrape of every target
    for series in prom.query(session, f'scrape_duration_seconds{{job="{JOB}"}}[{window}s]'):
        durations.extend((float(t), float(v)) for t, v in series["values"])
    scraped = [float(s["value"][1]) for s in prom.query(session, f'scrape_samples_scraped{{job="{JOB}"}}')]
    up = [float(s["value"][1]) for s in prom.query(session, f'up{{job="{JOB}"}}')]
    families = {s["metric"]["__name__"]: int(float(s["value"][1]))
                for s in prom.query(session, f'count by (__name__) ({{job="{JOB}"}})')}
    alerts = {f'{s["metric"].get("alertname")} ({s["metric"].get("alertstate")})': int(float(s["value"][1]))
              for s in prom.query(session, "count by (alertname, alertstate) (ALERTS)")}
    merged = None
    if args.backfill:
        # Backfilled and live samples must be one series each: same labels, or the rules would see two.
        lookbacks = rule_lookbacks(RULE_FILES)
        span = int(time.time() - enabled) + int(max(lookbacks.values())) + 600
        both, live = {}, {}
        for name in sorted(lookbacks):
            selector = f'{name}{{job="{JOB}"}}'
            both[name] = sum(int(float(s["value"][1]))
                             for s in prom.query(session, f"count(count_over_time({selector}[{span}s]))"))
            live[name] = sum(int(float(s["value"][1])) for s in prom.query(session, f"count({selector})"))
        merged = {"history_plus_live": both, "live": live, "ok": both == live}
    groups = {}
    rule_times: dict = defaultdict(list)
    for name, seen in sorted(evals.items()):
        steady = [(t, d) for t, d, _ in seen.values() if t >= since]
        warm = [d for t, d, _ in seen.values() if t < since]
        for t, _, rules in seen.values():
            if t >= since:
                for rule, d in rules.items():
                    rule_times[(name, rule)].append(d)
        groups[name] = {**_stats([d for _, d in steady]), "warmup": _stats(warm),
                        "sequence": [[round(t - enabled, 1), d] for t, d, _ in sorted(seen.values())],
                        "last_duration_metric_s": final["prometheus_rule_group_last_duration_seconds"].get(name),
                        "missed_iterations": final["prometheus_rule_group_iterations_missed_total"].get(name, 0.0),
                        "failures": final["prometheus_rule_evaluation_failures_total"].get(name, 0.0)}
    top_rules = sorted(((max(v), statistics.median(v), g, r) for (g, r), v in rule_times.items() if v), reverse=True)
    summary = {q: v for q, v in final["prometheus_rule_evaluation_duration_seconds"].items() if q}
    # Why the slowest rules are slow: their expressions again, with the engine's timings and sample counts.
    explain = []
    for _, _, g, rule in top_rules[:3]:
        expr = RULE_QUERIES.get(rule)
        if expr:
            runs = [prom.query_stats(session, expr) for _ in range(3)]
            best = min(runs, key=lambda x: x["wall_s"])
            explain.append({"rule": rule, "group": g, "runs": runs, "best": best})
    steady_memory = [m for m in memory if m[0] >= since] or memory
    (t0, c0, _, _), (t1, c1, own1, busy1), (t2, c2, own2, busy2) = cpu_marks[0], cpu_marks[1], cpu_marks[-1]
    # This machine may be shared: CPU that neither Prometheus nor this process (the fleet) used meanwhile.
    others = 100 * ((busy2 - busy1) - (c2 - c1) - (own2 - own1)) / (t2 - t1) if t2 > t1 else float("nan")
    return {
        "scrape_duration": {**_stats([d for t, d in durations if t >= since]),
                            "warmup": _stats([d for t, d in durations if t < since])},
        "scrape_samples_scraped": {"min": min(scraped, default=0), "max": max(scraped, default=0),
                                   "sum": sum(scraped)},
        "targets_up": sum(1 for v in up if v == 1.0), "targets": len(up),
        "groups": groups,
        "top_rules": [{"group": g, "rule": r, "max_s": mx, "median_s": md} for mx, md, g, r in top_rules[:8]],
        "rule_errors": rule_errors,
        "rule_evaluation_duration_summary_s": summary, "slowest_rules_explained": explain,
        "head_series": final["prometheus_tsdb_head_series"].get("", 0.0),
        "rss_psutil_end": memory[-1][1] if memory else prom.rss(),
        "rss_psutil_max_steady": max(m[1] for m in steady_memory), "rss_psutil_max": max(m[1] for m in memory),
        "process_resident_memory_bytes_end": final["process_resident_memory_bytes"].get("", 0.0),
        "go_heap_inuse_bytes_end": final["go_memstats_heap_inuse_bytes"].get("", 0.0),
        "samples_appended": final["prometheus_tsdb_head_samples_appended_total"].get("", 0.0),
        "cpu_pct_of_core": 100 * (c2 - c1) / (t2 - t1) if t2 > t1 else float("nan"),
        "cpu_pct_of_core_warmup": 100 * (c1 - c0) / (t1 - t0) if t1 > t0 else float("nan"),
        "fleet_process_cpu_pct_of_core": 100 * (own2 - own1) / (t2 - t1) if t2 > t1 else float("nan"),
        "other_processes_cpu_pct_of_core": others, "measured_s": t2 - t1, "warmup_s": t1 - t0, "since_start_s": t2 - t0,
        "families_in_tsdb": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "alerts": alerts, "backfill_merge": merged,
        "fleet": {"scrapes_served": fleet.requests, "errors": fleet.errors,
                  "ms_per_scrape": 1000 * fleet.busy_s / fleet.requests if fleet.requests else None},
    }


def environment(args, prom_bin: str, promtool: str) -> dict:
    def first_line(cmd):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            return ((res.stdout or res.stderr).splitlines() or ["?"])[0].strip()
        return "?"

    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "prometheus": first_line([prom_bin, "--version"]), "promtool": first_line([promtool, "--version"]),
        "prometheus_client": version_of("prometheus_client"), "verl_exporter": version_of("verl-exporter"),
        "ranks": args.ranks, "scrape_interval_s": args.scrape_interval, "eval_interval_s": args.eval_interval,
        "warmup_s": args.warmup, "duration_s": args.duration, "backfill": args.backfill,
        "mode": "quick" if args.quick else "full",
    }


# ---------------------------------------------------------------------------------------------- reporting
def print_breakdown(out, per_rank: dict) -> None:
    out(f"  host series from: {per_rank['host_model']}")
    for label, b in (("rank 0 (driver: training + checkpoint)", per_rank["rank0"]),
                     ("ordinary rank", per_rank["ordinary"])):
        out(f"  {label}: {b['series']} series")
        out("    by source : " + ", ".join(f"{k} {v}" for k, v in b["sources"].items()))
        top = list(b["families"].items())[:8]
        out("    top families: " + ", ".join(f"{k} {v} ({100 * v / b['series']:.0f}%)" for k, v in top))
    out(f"  ordinary ranks range {per_rank['ordinary_min']}..{per_rank['ordinary_max']} series; text format "
        f"{per_rank['text_format_ordinary']}; all bodies together {per_rank['total_body_series']:,} series")
    if per_rank.get("own_proc_ordinary") is not None:
        out(f"  (an ordinary rank whose host collectors read this machine's own procfs: "
            f"{per_rank['own_proc_ordinary']} series)")


def extrapolate(r: dict, target: int) -> dict:
    """Series linear in ranks; memory growth and each group's evaluation time linear in head series."""
    p, n = r["prometheus"], r["env"]["ranks"]
    per_rank = r["per_rank"]["ordinary"]["series"] + PER_TARGET_SERIES
    head = p["head_series"]
    fixed = head - n * per_rank  # rank 0's extra, recording-rule outputs, ALERTS
    series = fixed + target * per_rank
    factor = series / head if head else float("nan")
    idle_rss = r["idle"]["rss_psutil"]
    return {"ranks": target, "series": series, "series_factor": factor, "series_per_rank": per_rank,
            "series_fixed": fixed, "rss_bytes": idle_rss + (p["rss_psutil_end"] - idle_rss) * factor,
            "bytes_per_series": (p["rss_psutil_end"] - idle_rss) / head if head else float("nan"),
            "group_eval_max_s": {g: v["max_s"] * factor for g, v in p["groups"].items()},
            "group_eval_median_s": {g: v["median_s"] * factor for g, v in p["groups"].items()},
            "samples_per_s": series / r["env"]["scrape_interval_s"],
            "cpu_pct_of_core": p["cpu_pct_of_core"] * factor}


def _short(group: str) -> str:
    return group.removeprefix("verl-exporter.")


def build_table(r: dict) -> str:
    rows = []

    def add(name, value, baseline_name, baseline, ratio, goal, strict=False):
        if goal is None:
            verdict = "-"
        elif ratio is None or ratio != ratio:
            verdict = "SKIP"
        else:
            verdict = "PASS" if (ratio < goal if strict else ratio <= goal) else "FAIL"
        rows.append((name, value, baseline_name, baseline, "-" if ratio is None else f"{ratio:.3f}",
                     "-" if goal is None else f"{'<' if strict else '<='} {goal:g}", verdict))

    def info(name, value):
        rows.append((name, value, "(informative)", "-", "-", "-", "-"))

    pr, p, n, ex = r["per_rank"], r["prometheus"], r["env"]["ranks"], r["extrapolation"]
    add("series per rank, ordinary", str(pr["ordinary"]["series"]), "goal", str(SERIES_GOAL),
        pr["ordinary"]["series"] / SERIES_GOAL, 1.0)
    # Rank 0's training series are what the run logs (one per verl key, capped per family by max_series), not
    # the pack's choice: the budget holds the rest, and the training series are shown apart.
    training = pr["rank0"]["sources"].get("training", 0)
    own = pr["rank0"]["series"] - training
    add("series per rank, rank 0 (without training)", str(own), "goal", str(SERIES_GOAL), own / SERIES_GOAL, 1.0)
    info("  rank 0's training series (what the run logs)", str(training))
    add(f"head series, {n} ranks", f"{p['head_series']:,.0f}", f"goal x {n} ranks", f"{SERIES_GOAL * n:,}",
        p["head_series"] / (SERIES_GOAL * n), None)
    sd = p["scrape_duration"]
    timeout = min(r["env"]["scrape_interval_s"], 10)
    add(f"scrape duration p99 ({sd['n']} scrapes)", f"{sd['p99_s'] * 1000:.1f} ms", "scrape timeout",
        f"{timeout:g} s", sd["p99_s"] / timeout, None)
    add(f"  same, warm-up ({sd['warmup']['n']} scrapes)", f"{sd['warmup']['p99_s'] * 1000:.1f} ms", "scrape timeout",
        f"{timeout:g} s", sd["warmup"]["p99_s"] / timeout, None)
    for g, v in p["groups"].items():
        add(f"rule group {_short(g)}, max of {v['n']} evals", f"{v['max_s'] * 1000:.1f} ms", "goal",
            f"{GROUP_EVAL_GOAL_S:g} s", v["max_s"] / GROUP_EVAL_GOAL_S, 1.0, strict=True)
    if p["groups"]:
        g, v = max(p["groups"].items(), key=lambda kv: kv[1]["warmup"]["max_s"])
        add(f"  worst group in warm-up ({_short(g)})", f"{v['warmup']['max_s'] * 1000:.1f} ms", "goal",
            f"{GROUP_EVAL_GOAL_S:g} s", v["warmup"]["max_s"] / GROUP_EVAL_GOAL_S, None)
        g, worst = max(ex["group_eval_max_s"].items(), key=lambda kv: kv[1])
        add(f"worst group at {ex['ranks']} ranks ({_short(g)}, extrapolated)", f"{worst * 1000:.0f} ms", "goal",
            f"{GROUP_EVAL_GOAL_S:g} s", worst / GROUP_EVAL_GOAL_S, 1.0, strict=True)
    q99 = p["rule_evaluation_duration_summary_s"].get("0.99")
    if q99 is not None:
        add("rule evaluation p99 (summary, per rule)", f"{q99 * 1000:.2f} ms", "goal per group",
            f"{GROUP_EVAL_GOAL_S:g} s", q99 / GROUP_EVAL_GOAL_S, None)
    missed = sum(v["missed_iterations"] for v in p["groups"].values())
    failures = sum(v["failures"] for v in p["groups"].values())
    rows.append(("missed group iterations / failed evaluations", f"{missed:g} / {failures:g}", "(should be 0)", "-",
                 "-", "-", "PASS" if missed == 0 and failures == 0 else "FAIL"))
    idle = r["idle"]
    add("Prometheus RSS (psutil), end", f"{p['rss_psutil_end'] / 2**20:.0f} MiB", "same, no target answering",
        f"{idle['rss_psutil'] / 2**20:.0f} MiB", p["rss_psutil_end"] / idle["rss_psutil"], None)
    idle_prm = idle.get("process_resident_memory_bytes")
    add("process_resident_memory_bytes, end", f"{p['process_resident_memory_bytes_end'] / 2**20:.0f} MiB",
        "same, no target answering", f"{idle_prm / 2**20:.0f} MiB" if idle_prm else "-",
        p["process_resident_memory_bytes_end"] / idle_prm if idle_prm else None, None)
    info("RSS growth per head series", f"{ex['bytes_per_series']:.0f} B")
    info(f"Prometheus RSS at {ex['ranks']} ranks (extrapolated)", f"{ex['rss_bytes'] / 2**30:.2f} GiB")
    info("Prometheus CPU (after warm-up)", f"{p['cpu_pct_of_core']:.1f} % of a core")
    return results_table(rows)


def print_prometheus(out, r: dict) -> None:
    p = r["prometheus"]
    sd, sw = p["scrape_duration"], p["scrape_duration"]["warmup"]
    out(f"  measured {p['measured_s']:.0f} s after a {p['warmup_s']:.0f} s warm-up (the first scrapes create every "
        "series; figures of the warm-up are given apart)")
    out(f"  targets up {p['targets_up']}/{p['targets']}; scrape_samples_scraped per target "
        f"{p['scrape_samples_scraped']['min']:.0f}..{p['scrape_samples_scraped']['max']:.0f}")
    out(f"  scrape_duration_seconds: median {sd['median_s'] * 1000:.1f} ms, p99 {sd['p99_s'] * 1000:.1f} ms, max "
        f"{sd['max_s'] * 1000:.1f} ms over {sd['n']} scrapes (warm-up: p99 {sw['p99_s'] * 1000:.1f} ms, max "
        f"{sw['max_s'] * 1000:.1f} ms)")
    for g, v in p["groups"].items():
        last = v["last_duration_metric_s"]
        out(f"  group {_short(g):12}: {v['n']:3} evals, median {v['median_s'] * 1000:7.2f} ms, p99 "
            f"{v['p99_s'] * 1000:7.2f} ms, max {v['max_s'] * 1000:7.2f} ms; warm-up max "
            f"{v['warmup']['max_s'] * 1000:7.1f} ms; prometheus_rule_group_last_duration_seconds now "
            f"{last * 1000 if last is not None else float('nan'):.2f} ms")
    out("  slowest rules (max after warm-up): " + "; ".join(
        f"{t['rule']} {t['max_s'] * 1000:.1f} ms (median {t['median_s'] * 1000:.1f})" for t in p["top_rules"][:5]))
    for e in p["slowest_rules_explained"]:
        b = e["best"]
        samples = b.get("total_queryable_samples")
        out(f"    {e['rule']} run as a query (best of 3): {b['wall_s'] * 1000:.0f} ms, engine eval "
            f"{b.get('evalTotalTime', float('nan')) * 1000:.0f} ms (queue {b.get('execQueueTime', 0) * 1000:.1f} ms), "
            f"{samples if samples is not None else '?':,} samples read")
    summary = p["rule_evaluation_duration_summary_s"]
    out("  prometheus_rule_evaluation_duration_seconds (per rule, last 10 min): " + ", ".join(
        f"q{q} {v * 1000:.2f} ms" for q, v in sorted(summary.items())))
    top = list(p["families_in_tsdb"].items())[:6]
    out("  largest families in the TSDB: " + ", ".join(f"{k} {v:,}" for k, v in top))
    out(f"  head series {p['head_series']:,.0f}; RSS {p['rss_psutil_end'] / 2**20:.0f} MiB (max after warm-up "
        f"{p['rss_psutil_max_steady'] / 2**20:.0f}, overall {p['rss_psutil_max'] / 2**20:.0f}), "
        f"process_resident_memory_bytes {p['process_resident_memory_bytes_end'] / 2**20:.0f} MiB, Go heap in use "
        f"{p['go_heap_inuse_bytes_end'] / 2**20:.0f} MiB; CPU {p['cpu_pct_of_core']:.1f} % of a core "
        f"(warm-up {p['cpu_pct_of_core_warmup']:.0f} %); this process (the fleet) "
        f"{p['fleet_process_cpu_pct_of_core']:.1f} %; other processes on this machine "
        f"{p['other_processes_cpu_pct_of_core']:.1f} % of a core")
    out(f"  alerts: {p['alerts'] or 'none'}")
    if p["rule_errors"]:
        out(f"  !! rule errors: {p['rule_errors']}")
    if p.get("backfill_merge") is not None:
        ok = p["backfill_merge"]["ok"]
        out(f"  backfilled history and live samples form one series each: {'yes' if ok else 'NO'}"
            + ("" if ok else f" {p['backfill_merge']}"))
    f = p["fleet"]
    out(f"  fleet: {f['scrapes_served']} scrapes served, {f['errors']} errors, "
        f"{f['ms_per_scrape'] or 0:.2f} ms to render and gzip a body")
    if p.get("log_warnings"):
        out("  prometheus log: " + " | ".join(p["log_warnings"]))


def print_extrapolation(out, r: dict) -> None:
    ex, n, p = r["extrapolation"], r["env"]["ranks"], r["prometheus"]
    out(f"\n== extrapolation to {ex['ranks']:,} ranks from {n} (ASSUMPTION: linear. Series grow linearly with "
        "ranks; Prometheus's memory growth and each rule group's evaluation time grow linearly with head series)")
    out(f"  head series   : {ex['series']:,.0f} = {ex['series_fixed']:,.0f} once (rank 0's training series, rule "
        f"outputs) + {ex['series_per_rank']} per rank ({r['per_rank']['ordinary']['series']} exported + "
        f"{PER_TARGET_SERIES} per target by Prometheus); x{ex['series_factor']:.1f}")
    out(f"  ingestion     : {ex['samples_per_s']:,.0f} samples/s at one scrape per "
        f"{r['env']['scrape_interval_s']:g} s")
    out(f"  Prometheus RSS: {ex['rss_bytes'] / 2**30:.2f} GiB (idle {r['idle']['rss_psutil'] / 2**20:.0f} MiB + "
        f"{ex['bytes_per_series']:.0f} B per head series, measured {p['since_start_s']:.0f} s after the first scrape)")
    for g in ex["group_eval_max_s"]:
        worst, median = ex["group_eval_max_s"][g], ex["group_eval_median_s"][g]
        verdict = "PASS" if worst < GROUP_EVAL_GOAL_S else "FAIL"
        out(f"  group {_short(g):12}: median {median * 1000:8.1f} ms, max {worst * 1000:8.1f} ms per evaluation "
            f"(goal < {GROUP_EVAL_GOAL_S:g} s: {verdict})")
    out(f"  Prometheus CPU: {ex['cpu_pct_of_core']:.0f} % of a core for ingestion and rules")
    out("  Caveats: a long run's head holds 2-3 h of samples; full head chunks are memory-mapped, so RSS follows the "
        "series count, with page cache on top. Rules over rank 0's training series do not grow with ranks, so the "
        "training and recording figures are upper bounds. Evaluation also scales with the samples in each window; "
        "the backfill makes windows full, so that part is already in the measurement.")

def extrapolate_vm(r: dict, target: int) -> dict:
    """Same method as for Prometheus: series linear in ranks; rule-group time and memory linear in series
    (the measured figures scaled by target / measured ranks)."""
    vm, ranks = r["victoriametrics"], r["env"]["ranks"]
    k = target / ranks
    return {"ranks": target, "series": vm["series"] * k, "worst_group_median_s": vm["worst_group_median_s"] * k,
            "worst_group_max_s": vm["worst_group_max_s"] * k, "rss_total_bytes": vm["rss_total_bytes"] * k}


def print_vm(out, r: dict, target: int) -> None:
    prom, vm = r["prometheus"], r["victoriametrics"]
    x = vm["extrapolation"]
    out(f"== VictoriaMetrics vs Prometheus, {r['env']['ranks']} ranks measured, {target} extrapolated "
        "(series linear in ranks, group time and memory linear in series)")
    out(f"  series: VictoriaMetrics {vm['series']:,.0f} (with rule results) -> {x['series']:,.0f}")
    out(f"  worst group: median {vm['worst_group_median_s'] * 1e3:.0f} ms, max {vm['worst_group_max_s'] * 1e3:.0f} ms "
        f"-> {x['worst_group_median_s']:.2f} s / {x['worst_group_max_s']:.2f} s "
        f"(Prometheus at {target}: worst max {max(r['extrapolation']['group_eval_max_s'].values()):.2f} s)")
    out(f"  memory, all VictoriaMetrics processes: {vm['rss_total_bytes'] / 2**20:.0f} MiB -> "
        f"{x['rss_total_bytes'] / 2**30:.2f} GiB; Prometheus {prom['rss_psutil_end'] / 2**20:.0f} MiB -> "
        f"{r['extrapolation']['rss_bytes'] / 2**30:.2f} GiB")


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 15 + 25 s run (~1 min in all), to prove it runs")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    parser.add_argument("--ranks", type=int, default=256, help="simulated ranks (default 256)")
    parser.add_argument("--duration", type=float, help="seconds measured after the warm-up (default 120; --quick 25)")
    parser.add_argument("--warmup", type=float, help="seconds of scraping before measuring (default 30; --quick 15)")
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--eval-interval", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--no-backfill", dest="backfill", action="store_false",
                        help="no history: rules read only what the run scraped (short windows)")
    parser.add_argument("--host-procfs", metavar="DIR",
                        help="read host series from this procfs (e.g. /proc) instead of the modelled 8-GPU node")
    parser.add_argument("--rules", metavar="DIR", help="judge the rule files in DIR (verl-alerts.yaml, "
                        "verl-recording.yaml) instead of the generated ones, e.g. an older version's")
    parser.add_argument("--extrapolate-to", type=int, default=4096, help="ranks to extrapolate to (default 4096)")
    parser.add_argument("--no-victoriametrics", dest="victoriametrics", action="store_false",
                        help="Prometheus only (by default the same fleet then runs on VictoriaMetrics too)")
    args = parser.parse_args(argv)
    if args.victoriametrics and not all(shutil.which(b) for b in ("victoria-metrics", "vmagent", "vmalert")):
        parser.error("VictoriaMetrics is not installed (Debian: apt-get install victoria-metrics); "
                     "or pass --no-victoriametrics")
    if args.ranks < 2:
        parser.error("--ranks must be at least 2 (rank 0 and an ordinary rank)")
    if args.rules:
        RULE_FILES[:] = [Path(args.rules) / "verl-alerts.yaml", Path(args.rules) / "verl-recording.yaml"]
        if missing := [str(p) for p in RULE_FILES if not p.is_file()]:
            parser.error(f"--rules: no {', '.join(missing)}")
    if args.duration is None:
        args.duration = 25.0 if args.quick else 120.0
    if args.warmup is None:
        args.warmup = 15.0 if args.quick else 30.0
    args.idle_s = 3.0
    args.backfill_timeout = 300
    out = print
    started = time.monotonic()
    results = run(args, out)
    results["extrapolation"] = extrapolate(results, args.extrapolate_to)
    if "victoriametrics" in results:
        results["victoriametrics"]["extrapolation"] = extrapolate_vm(results, args.extrapolate_to)
    out("")
    print_prometheus(out, results)
    print_extrapolation(out, results)
    if "victoriametrics" in results:
        print_vm(out, results, args.extrapolate_to)
    results["elapsed_s"] = time.monotonic() - started
    table = build_table(results)
    out("\n== results (ratio = measured / baseline, both measured in this run)")
    out(table)
    out(f"elapsed {results['elapsed_s']:.1f} s ({results['mode']} mode)")
    if args.json:
        results["table"] = table
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
