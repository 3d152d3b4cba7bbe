"""The one way a long-running command (serve, relay, node, demo) learns that it should stop.

SIGINT and SIGTERM set an event that the main thread waits on; the command then stops its parts in order
(Kubernetes sends SIGTERM, a terminal Ctrl-C). Install it before anything starts, so that a signal that
arrives early still stops cleanly instead of killing the process half-started.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_event(event: threading.Event | None = None) -> threading.Event:
    """The event (a new one when none is given), set from now on by SIGINT or SIGTERM. Main thread only."""
    if event is None:
        event = threading.Event()
    for sig in SIGNALS:
        signal.signal(sig, lambda *_: event.set())
    return event


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


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a child the way the commands above stop: SIGTERM, then kill -9 if it has not exited in timeout."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
