"""The one way a long-running command (serve, relay, node, demo) learns that it should stop.

SIGINT and SIGTERM set an event that the main thread waits on; the command then stops its parts in order
(Kubernetes sends SIGTERM, a terminal Ctrl-C). Install it before anything starts, so that a signal that
arrives early still stops cleanly instead of killing the process half-started.

A command that opts in with ``grace`` stays responsive even when its main thread is busy and cannot get to
its wait (a file that takes long to load, a stop that hangs): a second signal exits at once, a command still
starting BUSY_S after the signal exits then, and one that has not stopped ``grace`` seconds after it exits
then (below Kubernetes' 30 s before SIGKILL). serve and relay survive kill -9 by design (the follower's
offsets, the relay's journal), so an exit that skips the orderly stop loses nothing they keep.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 20.0  # for an orderly stop, from the signal on
BUSY_S = 2.0  # for the main thread to come to its wait, once signalled


WAKE_S = 0.5  # how often a main thread waiting on its stop event wakes (see StopEvent.wait)


class StopEvent(threading.Event):
    """The stop event; knows whether the main thread has come to wait on it (its start is over)."""

    waited = False

    def wait(self, timeout: float | None = None) -> bool:
        self.waited = True
        # In slices: any thread may take a signal sent to the process, and Python runs the handler in the main
        # thread only once that thread runs again (3.11); one asleep here for good never would.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
            if super().wait(max(0.0, left)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


def stop_event(event: threading.Event | None = None, grace: float | None = None) -> threading.Event:
    """The event (a new StopEvent when none is given), set from now on by SIGINT or SIGTERM. Main thread only.
    With grace (the commands pass it; code in a process it does not own must not): a second signal exits at
    once, and a watchdog exits if the command is still busy starting BUSY_S after the signal, or has not
    stopped grace seconds after it."""
    if event is None:
        event = StopEvent()
    # The handler runs in the main thread between two of its steps, maybe with the event's lock held (inside
    # Event.wait) or the threading module's (inside Thread.start): it takes no lock itself, and only hands the
    # signal to a thread of its own, which sets the event and keeps the watchdog.
    signalled: list[int] = []
    read_end, write_end = os.pipe()

    def handler(signum: int, _frame: FrameType | None) -> None:
        if grace is not None and signalled:
            _exit(signum, "a second signal")
        signalled.append(signum)
        os.write(write_end, bytes([signum]))

    def forward() -> None:
        while True:
            signum = os.read(read_end, 1)[0]
            event.set()
            if grace is not None:
                _watchdog(event, signum, grace)

    threading.Thread(target=forward, name="verl-exporter-stop-signals", daemon=True).start()
    for sig in SIGNALS:
        signal.signal(sig, handler)
    return event


def _watchdog(event: threading.Event, signum: int, grace: float) -> None:
    time.sleep(min(BUSY_S, grace))
    if isinstance(event, StopEvent) and not event.waited:
        _exit(signum, f"still busy starting {BUSY_S:g} s after the signal")
    time.sleep(max(0.0, grace - BUSY_S))
    _exit(signum, f"not stopped {grace:g} s after the signal")


def _exit(signum: int, why: str) -> NoReturn:
    """Exit now, as a process killed by the signal would report (128 + N)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write(f"verl-exporter: exiting without an orderly stop: {why}\n")
        sys.stderr.flush()
    os._exit(128 + signum)


@contextlib.contextmanager
def exit_on_signal() -> Iterator[None]:
    """For a one-shot command (backtest, calibrate), for the length of a block: SIGINT and SIGTERM raise
    SystemExit at once, so that the command stops promptly and its clean-up still runs (a promtool child is
    killed, temporary folders go); the previous handlers are restored after it."""
    def handler(signum: int, _frame: FrameType | None) -> NoReturn:
        raise SystemExit(128 + signum)

    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def stopping(event: threading.Event | None = None) -> Iterator[threading.Event]:
    """stop_event for the length of a block, the previous handlers restored after it (for a command that runs
    in a process it does not own, e.g. the demo run by a test)."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        yield stop_event(event)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Stop a child the way the commands above stop: SIGTERM, then kill -9 if it has not exited in timeout."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
