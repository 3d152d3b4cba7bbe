"""`verl-exporter node --ranks N [serve flags]`: one sidecar per local rank on a node (Ray, Slurm).

Each child is a plain `verl-exporter serve` with --local-rank i (which picks its GPU), --rank
offset + i and the port after the previous one's. The driver-only sources (--verl-log, --checkpoint-dir,
the control endpoint) go to local rank 0 alone, so a node does not export them eight times. A child that
dies is restarted with a growing pause; SIGTERM/SIGINT stop them all, and each removes its file_sd
registration on the way out.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..core.shutdown import stop_event
from ..exposition.app import parse_listen
from .config import DEFAULT_PORT, env_int

# Flags (and whether they take a value) that only local rank 0 gets.
RANK0_ONLY = {"--verl-log": True, "--checkpoint-dir": True, "--checkpoint-verify": False,
              "--control-token-env": True, "--control-token-file": True, "--control-file": True,
              "--control-file-mode": True}
MAX_BACKOFF_S = 60.0
SHUTDOWN_S = 30.0  # from SIGTERM to exit: the children are signalled at once and waited for
HEALTHY_RUN_S = 300.0  # a child that ran this long was healthy: its next crash restarts after the first pause


def split_rank0_only(argv: list[str]) -> tuple[list[str], list[str]]:
    """(flags for every child, flags for local rank 0 only)."""
    common, rank0, i = [], [], 0
    while i < len(argv):
        flag, _, inline = argv[i].partition("=")
        if flag in RANK0_ONLY:
            takes_value = RANK0_ONLY[flag] and not inline
            rank0 += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            common.append(argv[i])
            i += 1
    return common, rank0


def child_argv(i: int, ranks_offset: int, host: str, base_port: int, common: list[str],
               rank0: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "verl_exporter", "serve", "--local-rank", str(i), "--rank", str(ranks_offset + i),
            "--listen", f"{host}:{base_port + i}", *common]
    return argv + rank0 if i == 0 else argv


class Supervisor:
    def __init__(self, argvs: list[list[str]], backoff: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.argvs = argvs
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(argvs)
        self.restarts = [0] * len(argvs)
        self._first_backoff = backoff
        self._backoff = [backoff] * len(argvs)
        self._next_start = [0.0] * len(argvs)
        self._started = [0.0] * len(argvs)
        self._clock = clock
        self.stopping = threading.Event()  # set by stop() or by SIGINT/SIGTERM

    def start(self, i: int) -> None:
        self.procs[i] = subprocess.Popen(self.argvs[i])
        self._started[i] = self._clock()

    def exited(self, i: int) -> float:
        """Schedule the restart of child i, which has just exited; returns the pause before it."""
        now = self._clock()
        if now - self._started[i] >= HEALTHY_RUN_S:
            self._backoff[i] = self._first_backoff  # a crash after a healthy run starts the backoff afresh
        pause = self._backoff[i]
        self._next_start[i] = now + pause
        self._backoff[i] = min(pause * 2, MAX_BACKOFF_S)
        return pause

    def run(self, poll: float = 0.5) -> int:
        for i in range(len(self.argvs)):
            self.start(i)
        while not self.stopping.wait(poll):
            now = self._clock()
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() is None:
                    continue
                if p is not None:
                    self.procs[i] = None
                    pause = self.exited(i)
                    print(f"verl-exporter node: local rank {i} exited with {p.returncode}; restarting in "
                          f"{pause:.0f} s", file=sys.stderr)
                elif now >= self._next_start[i]:
                    self.restarts[i] += 1
                    self.start(i)
        return self.shutdown()

    def stop(self) -> None:
        self.stopping.set()

    def shutdown(self) -> int:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            if p is not None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("node", help="run one sidecar per local rank on this node (Ray, Slurm)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, required=True, help="local ranks (GPUs) on this node")
    p.add_argument("--rank-offset", type=int,
                   help="global rank of local rank 0 (default: $NODE_RANK x --ranks, else 0)")
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help="address of local rank 0; rank i listens on PORT + i")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="every other flag is passed to each `verl-exporter serve` (after --)")


def rank_offset(given: int | None, ranks: int) -> int:
    """--rank-offset, else $NODE_RANK x ranks (a number of at most 9 digits), else 0."""
    if given is not None:
        return given
    node_rank = env_int("NODE_RANK")
    return node_rank * ranks if node_rank is not None else 0


def run(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        print("verl-exporter node: --ranks must be at least 1", file=sys.stderr)
        return 2
    try:
        host, port = parse_listen(args.listen)
    except ValueError as e:
        print(f"verl-exporter node: {e}", file=sys.stderr)
        return 2
    offset = rank_offset(args.rank_offset, args.ranks)
    if offset < 0:  # every child would refuse its --rank and be restarted for ever
        print(f"verl-exporter node: --rank-offset must be at least 0, got {offset}", file=sys.stderr)
        return 2
    passthrough = [a for a in args.serve_args if a != "--"]
    forbidden = [a for a in passthrough if a.partition("=")[0] in ("--rank", "--local-rank", "--listen")]
    if forbidden:
        print(f"verl-exporter node: {forbidden[0]} is set per child; drop it", file=sys.stderr)
        return 2
    common, rank0 = split_rank0_only(passthrough)
    sup = Supervisor([child_argv(i, offset, host, port, common, rank0) for i in range(args.ranks)])
    stop_event(sup.stopping, grace=SHUTDOWN_S)  # the children get SIGTERM and up to 10 s each
    return sup.run()
