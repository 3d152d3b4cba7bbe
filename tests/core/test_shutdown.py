"""Every command stays responsive to SIGTERM, even while its main thread is busy: serve once grew to 24 GB
parsing a hostile file with SIGTERM ignored (the handler only set an event nobody was waiting on yet) until
the OOM killer came. Real processes, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import scaled
from verl_exporter.tools import replay as rp

pytestmark = pytest.mark.integration


def start(code: str) -> subprocess.Popen:
    """A Python child running code, once it has printed 'ready'."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def ended(proc: subprocess.Popen, within: float) -> int | None:
    """The exit status, or None (after killing it) when it was still running after `within` seconds (times the
    suite's timeout factor: a deadline for the exit, not a claim about how fast it comes)."""
    try:
        return proc.wait(timeout=scaled(within))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def test_a_command_busy_before_its_wait_exits_on_sigterm():
    # the grace (60 s) is far beyond the wait below: only the busy-start rule can end it in time
    proc = start("""
        from verl_exporter.core.shutdown import stop_event
        done = stop_event(grace=60)
        print("ready", flush=True)
        while True:  # a long start: the main thread never gets to done.wait()
            pass
    """)
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, 30) == 128 + signal.SIGTERM
    assert "still busy starting" in proc.stderr.read()


def test_a_stop_that_hangs_exits_after_the_grace():
    proc = start("""
        from verl_exporter.core.shutdown import stop_event
        done = stop_event(grace=3)
        print("ready", flush=True)
        done.wait()
        while True:  # an orderly stop that never ends
            pass
    """)
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, 30) == 128 + signal.SIGTERM
    assert "not stopped 3 s after the signal" in proc.stderr.read()


def test_a_second_signal_exits_at_once():
    proc = start("""
        import time
        from verl_exporter.core.shutdown import stop_event
        done = stop_event(grace=600)
        print("ready", flush=True)
        done.wait()
        print("stopping", flush=True)
        while True:
            time.sleep(0.01)
    """)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "stopping"
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, 30) == 128 + signal.SIGTERM
    assert "a second signal" in proc.stderr.read()



def test_a_signal_while_the_main_thread_holds_the_stop_events_lock_still_stops():
    """The handler runs in the main thread between two of its steps, which may be inside done.wait() with the
    event's lock held (or inside Thread.start()): a handler that set the event itself, or started its watchdog,
    waited for that lock forever, and SIGTERM, the grace and a second signal with it, did nothing (a relay on a
    loaded machine hung so until kill -9)."""
    proc = start("""
        import os, signal
        from verl_exporter.core.shutdown import stop_event
        done = stop_event(grace=60)
        print("ready", flush=True)
        with done._cond:  # what Event.wait() holds for a moment
            os.kill(os.getpid(), signal.SIGTERM)
            len("the handler runs here")
        assert done.wait(30)
        print("stopped in order", flush=True)
    """)
    assert ended(proc, 10) == 0, proc.stderr.read()
    assert proc.stdout.read().strip() == "stopped in order"



def test_a_signal_that_another_thread_took_stops_a_main_thread_that_waits_for_good():
    """Any thread may take a signal sent to the process; Python runs the handler only in the main thread, and on
    3.11 only once that thread runs again: one asleep in done.wait() slept on (a relay SIGTERMed as it started
    was still there 20 s later; the signal ran only with the next one)."""
    proc = start("""
        import signal, threading, time
        from verl_exporter.core.shutdown import stop_event
        done = stop_event(grace=60)

        def take_it():
            time.sleep(0.5)  # the main thread is asleep in done.wait() by then
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

        threading.Thread(target=take_it).start()
        print("ready", flush=True)
        done.wait()
        print("stopped in order", flush=True)
    """)
    assert ended(proc, 10) == 0, proc.stderr.read()
    assert proc.stdout.read().strip() == "stopped in order"


def test_an_orderly_stop_is_not_cut_short():
    proc = start("""
        import time
        from verl_exporter.core.shutdown import stop_event
        done = stop_event(grace=60)
        print("ready", flush=True)
        done.wait()
        time.sleep(3)  # longer than the busy-start allowance: a stop under way keeps its grace
        print("stopped in order", flush=True)
    """)
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, 30) == 0
    assert proc.stdout.read().strip() == "stopped in order"


def test_serve_stops_in_order_on_sigterm(tmp_path):
    from conftest import http_get, wait_for
    from helpers import free_port

    log = tmp_path / "run.jsonl"
    rp.write_jsonl(rp.simulate("ppo", steps=50), log)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "verl_exporter", "serve", "--listen", f"127.0.0.1:{port}",
                             "--verl-log", str(log)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def up() -> bool:
        assert proc.poll() is None, proc.stderr.read()
        try:
            return http_get(f"http://127.0.0.1:{port}/healthz", timeout=1)[0] == 200
        except OSError:
            return False

    wait_for(up, timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, 30) == 0, proc.stderr.read()
    assert "without an orderly stop" not in proc.stderr.read()


def test_backtest_stops_on_sigterm_and_leaves_no_promtool_behind(tmp_path):
    from conftest import require_tool

    require_tool("promtool")
    run = tmp_path / "long.jsonl"
    rp.write_jsonl(rp.simulate("ppo", steps=3000), run)
    proc = subprocess.Popen([sys.executable, "-m", "verl_exporter", "backtest", str(run), "--html-dir", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    promtool = None
    deadline = time.monotonic() + scaled(300)
    while promtool is None and proc.poll() is None and time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-P", str(proc.pid), "promtool"], capture_output=True, text=True)
        promtool = int(found.stdout.split()[0]) if found.stdout.strip() else None
        time.sleep(0.2)
    assert promtool is not None, "backtest never started promtool"
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, 30) == 128 + signal.SIGTERM
    assert "Traceback" not in proc.stderr.read()
    assert ended_pid(promtool, 10), "promtool still running after backtest stopped"


def ended_pid(pid: int, within: float) -> bool:
    """Whether the process is gone (or a zombie about to be reaped) within `within` seconds (scaled)."""
    deadline = time.monotonic() + scaled(within)
    while time.monotonic() < deadline:
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
        if not state.strip() or state.strip().startswith("Z"):
            return True
        time.sleep(0.1)
    return False


def test_a_one_shot_command_in_process_leaves_the_signal_handlers_as_they_were():
    from verl_exporter.core.shutdown import SIGNALS, exit_on_signal

    before = {s: signal.getsignal(s) for s in SIGNALS}
    with exit_on_signal():
        assert all(signal.getsignal(s) is not before[s] for s in SIGNALS)
    assert {s: signal.getsignal(s) for s in SIGNALS} == before
