"""The host and cpu collectors: CPU time counters from /proc/stat, load, memory, the trainer's RSS, the real /proc."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import require_tool
from helpers import FIXTURES, configure, scaled
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.collectors import REGISTRY, Context
from verl_exporter.sidecar.collectors.cpu import USER_HZ, CpuCollector
from verl_exporter.sidecar.collectors.host import HostCollector
from verl_exporter.sidecar.collectors.sampler import Sampler
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.spec import load_spec

T0, T1 = FIXTURES / "proc_t0", FIXTURES / "proc_t1"
KIB = 1024


@pytest.fixture
def ctx():
    spec = load_spec()
    return Context(spec=spec, self_metrics=SelfMetrics(spec), config=ServeConfig(procfs=str(T0)))


def by_series(samples) -> dict[tuple, float]:
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in samples}


def get(samples, name, **labels):
    return by_series(samples).get((name, tuple(sorted(labels.items()))))


def names(samples) -> set[str]:
    return {name for name, _, _ in samples}


def errors(ctx) -> float:
    return ctx.self_metrics.value("verl_exporter_source_errors_total", component="host")


MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_seconds(samples) -> dict[str, float]:
    return {labels["mode"]: value for name, labels, value in samples if name == "verl_host_cpu_seconds_total"}


def test_first_sample_has_cpu_counters_load_and_memory(ctx):
    first = list(CpuCollector(ctx).sample()) + list(HostCollector(ctx).sample())
    # The aggregate cpu line of proc_t0, in USER_HZ ticks: user nice system idle iowait irq softirq steal; the
    # guest columns (already in user and nice) are left out. Counters from the first sample on: no baseline.
    ticks = dict(zip(MODES, (34392, 0, 5468, 147360, 750, 0, 396, 113), strict=True))
    assert cpu_seconds(first) == {mode: t / USER_HZ for mode, t in ticks.items()}
    assert "verl_host_cpu_utilization_ratio" not in names(first)  # a ratio is a recording rule now
    assert get(first, "verl_host_load_average", period="1m") == 0.15
    assert get(first, "verl_host_load_average", period="5m") == 0.40
    assert get(first, "verl_host_load_average", period="15m") == 0.29
    assert get(first, "verl_host_memory_total_bytes") == 24683656 * KIB
    assert get(first, "verl_host_memory_available_bytes") == 24098832 * KIB
    assert get(first, "verl_host_memory_used_bytes") == (24683656 - 24098832) * KIB
    assert "verl_trainer_resident_memory_bytes" not in names(first)  # no --trainer-pid
    assert errors(ctx) == 0


def test_cpu_counters_follow_proc_stat(ctx):
    c, h = CpuCollector(ctx), HostCollector(ctx)
    c.sample()
    configure(ctx, procfs=str(T1))
    second = list(c.sample()) + list(h.sample())
    ticks = dict(zip(MODES, (34992, 0, 5668, 148360, 900, 0, 436, 123), strict=True))
    assert cpu_seconds(second) == {mode: t / USER_HZ for mode, t in ticks.items()}
    assert get(second, "verl_host_load_average", period="1m") == 1.52
    assert get(second, "verl_host_memory_used_bytes") == (24683656 - 23987100) * KIB


def test_iowait_going_backwards_is_held_so_that_rate_sees_no_reset(ctx, tmp_path):
    shutil.copytree(T1, tmp_path / "t1")
    stat = tmp_path / "t1" / "stat"
    stat.write_text(stat.read_text().replace("cpu  34992 0 5668 148360 900 ", "cpu  34992 0 5668 148360 700 "))
    c = CpuCollector(ctx)
    c.sample()  # iowait 750
    configure(ctx, procfs=str(tmp_path / "t1"))
    second = cpu_seconds(c.sample())
    # 750 -> 700 (proc(5): iowait may decrease) keeps 750, as node_exporter does: rate() would otherwise
    # read the step back as a counter reset and add the whole counter.
    assert second["iowait"] == 750 / USER_HZ
    assert second["user"] == 34992 / USER_HZ
    configure(ctx, procfs=str(T1))
    assert cpu_seconds(c.sample())["iowait"] == 900 / USER_HZ  # and moves on once the kernel passes it


def test_no_mode_ever_goes_down(ctx):
    configure(ctx, procfs=str(T1))
    c = CpuCollector(ctx)
    first = cpu_seconds(c.sample())
    configure(ctx, procfs=str(T0))  # every column lower
    second = cpu_seconds(c.sample())
    assert second == first
    assert errors(ctx) == 0


def test_one_unreadable_file_loses_only_its_own_metrics(ctx, tmp_path):
    shutil.copytree(T0, tmp_path / "p")
    (tmp_path / "p" / "loadavg").unlink()
    (tmp_path / "p" / "meminfo").write_text("MemTotal:       oops kB\nMemAvailable:   1000 kB\n")
    configure(ctx, procfs=str(tmp_path / "p"))
    c = HostCollector(ctx)
    c.sample()
    second = list(c.sample())
    assert "verl_host_load_average" not in names(second)
    assert get(second, "verl_host_memory_available_bytes") == 1000 * KIB
    assert "verl_host_memory_total_bytes" not in names(second)
    assert "verl_host_memory_used_bytes" not in names(second)
    assert cpu_seconds(CpuCollector(ctx).sample())["idle"] == 147360 / USER_HZ  # stat still read
    assert errors(ctx) == 4  # loadavg missing and one bad meminfo line, in each of the two samples


def test_memavailable_missing_on_old_kernels(ctx, tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:        1024 kB\nMemFree:          512 kB\n")
    shutil.copy(T0 / "stat", tmp_path / "stat")
    shutil.copy(T0 / "loadavg", tmp_path / "loadavg")
    configure(ctx, procfs=str(tmp_path))
    first = list(HostCollector(ctx).sample())
    assert get(first, "verl_host_memory_total_bytes") == 1024 * KIB
    assert "verl_host_memory_available_bytes" not in names(first)
    assert "verl_host_memory_used_bytes" not in names(first)


def test_no_such_trainer_pid_is_not_an_error(ctx):
    configure(ctx, trainer_pid=int(Path("/proc/sys/kernel/pid_max").read_text()) + 1)  # no process has it
    assert "verl_trainer_resident_memory_bytes" not in names(HostCollector(ctx).sample())
    assert errors(ctx) == 0


@pytest.mark.integration
def test_trainer_rss_sums_the_process_tree_and_goes_away_with_it(ctx):
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    trainer = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + scaled(10)
        while not psutil.Process(trainer.pid).children():
            assert time.monotonic() < deadline, "the trainer's child did not start"
            time.sleep(0.02)
        (child,) = psutil.Process(trainer.pid).children()
        configure(ctx, trainer_pid=trainer.pid)
        c = HostCollector(ctx)
        rss = get(c.sample(), "verl_trainer_resident_memory_bytes")
        parent_rss, child_rss = psutil.Process(trainer.pid).memory_info().rss, child.memory_info().rss
        assert rss == pytest.approx(parent_rss + child_rss, rel=0.1)
        assert rss > parent_rss
    finally:
        trainer.kill()
        trainer.wait()
    try:
        child.kill()  # orphaned by its parent's death
        child.wait(scaled(5))
    except psutil.NoSuchProcess:
        pass
    assert "verl_trainer_resident_memory_bytes" not in names(c.sample())
    # A process that later gets the same pid is not the trainer: the collector does not attach again.
    configure(ctx, trainer_pid=psutil.Process().pid)
    assert "verl_trainer_resident_memory_bytes" not in names(c.sample())
    assert errors(ctx) == 0


@pytest.mark.integration
def test_descendants_are_listed_again_every_refresh_period(ctx):
    from verl_exporter.sidecar.collectors.host import CHILDREN_REFRESH_S

    now = [1000.0]
    ctx.clock = lambda: now[0]
    configure(ctx, trainer_pid=psutil.Process().pid)  # this test process plays the trainer
    c = HostCollector(ctx)
    c.sample()
    child = subprocess.Popen(["sleep", "60"])
    try:
        now[0] += CHILDREN_REFRESH_S - 1  # listing every sample would cost ~20 us per process on the host
        c.sample()
        assert child.pid not in {p.pid for p in c._children}
        now[0] += 1
        c.sample()
        assert child.pid in {p.pid for p in c._children}
        now[0] -= 3600  # the wall clock stepped back: list again rather than wait an hour
        child.kill()
        child.wait()
        c.sample()
        assert child.pid not in {p.pid for p in c._children}
    finally:
        child.kill()
        child.wait()
    assert errors(ctx) == 0


def test_trainer_seen_from_this_process(ctx):
    configure(ctx, trainer_pid=psutil.Process().pid)
    rss = get(HostCollector(ctx).sample(), "verl_trainer_resident_memory_bytes")
    assert rss >= psutil.Process().memory_info().rss * 0.9


def test_real_proc_values_are_sane():
    spec = load_spec()
    ctx = Context(spec=spec, self_metrics=SelfMetrics(spec))
    c, h = CpuCollector(ctx), HostCollector(ctx)
    first = cpu_seconds(c.sample())
    time.sleep(0.1)
    raw = c.sample() + h.sample()
    second, after = by_series(raw), cpu_seconds(raw)
    assert set(after) == set(MODES)
    assert all(after[m] >= first[m] >= 0 for m in MODES)
    # all CPUs together: at least as many seconds as this machine has been up on one CPU, roughly
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert sum(after.values()) >= 0.5 * uptime
    total = second[("verl_host_memory_total_bytes", ())]
    available = second[("verl_host_memory_available_bytes", ())]
    assert total > 0
    assert 0 < available <= total
    assert second[("verl_host_memory_used_bytes", ())] == total - available
    assert total == pytest.approx(psutil.virtual_memory().total)
    for period in ("1m", "5m", "15m"):
        assert second[("verl_host_load_average", (("period", period),))] >= 0
    assert ctx.self_metrics.value("verl_exporter_source_errors_total", component="host") == 0


# ---------------------------------------------------------------------- all six collectors in a Sampler
HOST_COLLECTORS = ("cpu", "host", "pressure", "disk", "filesystem", "network")


@pytest.mark.parametrize("tree", ["fixtures", "real"])
@pytest.mark.integration
def test_sampler_with_all_host_collectors_passes_promtool(tree, tmp_path):
    promtool = require_tool("promtool")
    spec = load_spec()
    self_metrics = SelfMetrics(spec)
    now = [100.0]
    settings = ServeConfig(procfs=str(T0) if tree == "fixtures" else "/proc", trainer_pid=psutil.Process().pid,
                           checkpoint_dir=str(tmp_path), watch_paths=("/",))
    ctx = Context(spec=spec, self_metrics=self_metrics, config=settings,
                  clock=(lambda: now[0]) if tree == "fixtures" else time.time)
    registry = REGISTRY
    collectors = []
    for name in HOST_COLLECTORS:
        try:
            collectors.append(registry[name](ctx))
        except Exception as e:  # only PSI may be missing, and only on the real machine
            assert tree == "real" and name == "pressure", e
    sampler = Sampler(collectors, spec, self_metrics, {"run": "r1", "rank": "0"})
    for c in collectors:
        assert sampler.run_once(c)
    if tree == "fixtures":
        configure(ctx, procfs=str(T1))
        now[0] += 2.0
    else:
        time.sleep(0.2)
    for c in collectors:
        assert sampler.run_once(c)

    text = sampler.render()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr
    for name in HOST_COLLECTORS:
        assert self_metrics.value("verl_exporter_source_errors_total", component=name) == 0
    assert self_metrics.value("verl_exporter_series_dropped_total", reason="series_cap") == 0
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    declared = {m.name for c in HOST_COLLECTORS for m in spec.for_collector(c)}
    assert exported <= declared
    if tree == "fixtures":  # every metric the spec gives these collectors is produced
        assert exported == declared
    assert 'rank="0"' in text and 'run="r1"' in text
