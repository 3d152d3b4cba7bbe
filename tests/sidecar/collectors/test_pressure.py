"""The pressure collector: PSI totals as seconds, cpu without `full`, PSI absent or off, the real /proc."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
from helpers import FIXTURES, configure
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.collectors import Context, Unavailable
from verl_exporter.sidecar.collectors.pressure import PressureCollector
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.spec import load_spec

T0, T1 = FIXTURES / "proc_t0", FIXTURES / "proc_t1"
STALL = "verl_host_pressure_stall_seconds_total"


@pytest.fixture
def ctx():
    spec = load_spec()
    return Context(spec=spec, self_metrics=SelfMetrics(spec), config=ServeConfig(procfs=str(T0)))


def stalls(samples) -> dict[tuple[str, str], float]:
    out = {}
    for name, labels, value in samples:
        assert name == STALL
        out[(labels["resource"], labels["kind"])] = value
    return out


def errors(ctx) -> float:
    return ctx.self_metrics.value("verl_exporter_source_errors_total", component="pressure")


def test_totals_in_seconds(ctx):
    c = PressureCollector(ctx)
    # total= is in microseconds: 13082395 us = 13.082395 s
    assert stalls(c.sample()) == pytest.approx({
        ("cpu", "some"): 13.082395, ("cpu", "full"): 0.0,
        ("io", "some"): 5.574146, ("io", "full"): 4.900503,
        ("memory", "some"): 0.001024, ("memory", "full"): 0.000512,
    })
    configure(ctx, procfs=str(T1))  # the files are read afresh each time; the counters only grow
    later = stalls(c.sample())
    assert later[("cpu", "some")] - 13.082395 == pytest.approx(0.5)
    assert later[("io", "full")] - 4.900503 == pytest.approx(0.8)


def test_cpu_without_full_line_on_older_kernels(ctx):
    configure(ctx, procfs=str(FIXTURES / "proc_old"))
    got = stalls(PressureCollector(ctx).sample())
    assert set(got) == {("cpu", "some"), ("io", "some"), ("io", "full"), ("memory", "some"), ("memory", "full")}
    assert got[("cpu", "some")] == pytest.approx(42.0)
    assert errors(ctx) == 0


def test_no_pressure_directory_is_unavailable(ctx, tmp_path):
    configure(ctx, procfs=str(tmp_path))
    with pytest.raises(Unavailable, match="PSI"):
        PressureCollector(ctx)


def test_psi_switched_off_is_unavailable(ctx, monkeypatch):
    # Booted with psi=0 the files exist but read() fails with EOPNOTSUPP.
    def refuse(*args, **kwargs):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(Unavailable, match="psi=0"):
        PressureCollector(ctx)


def test_a_bad_line_loses_only_itself(ctx, tmp_path):
    shutil.copytree(T0, tmp_path / "p")
    (tmp_path / "p" / "pressure" / "io").write_text(
        "some avg10=0.00 avg60=0.05 avg300=0.18 total=5574146\n"
        "full avg10=0.00 avg60=0.05 avg300=0.14 total=many\n"
        "half avg10=0.00 total=1\n")
    (tmp_path / "p" / "pressure" / "memory").unlink()  # absent at start: not read at all, not an error
    configure(ctx, procfs=str(tmp_path / "p"))
    c = PressureCollector(ctx)
    (tmp_path / "p" / "pressure" / "cpu").unlink()  # gone after start: that resource alone is lost
    got = stalls(c.sample())
    assert set(got) == {("io", "some")}
    assert errors(ctx) == 3  # full with a non-number, an unknown kind, the missing cpu file


def test_real_proc():
    spec = load_spec()
    ctx = Context(spec=spec, self_metrics=SelfMetrics(spec))
    try:
        c = PressureCollector(ctx)
    except Unavailable as e:
        pytest.skip(f"this kernel has no PSI: {e}")
    got = stalls(c.sample())
    assert ("cpu", "some") in got and ("io", "some") in got and ("memory", "some") in got
    assert all(v >= 0 for v in got.values())
    assert errors(ctx) == 0
