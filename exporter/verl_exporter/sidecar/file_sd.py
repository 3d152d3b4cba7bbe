"""Self-registration for Prometheus file-based service discovery (Ray, Slurm: no Kubernetes).

Each sidecar owns one file, ``<dir>/verl-<host>-<port>.json``, so many sidecars on a shared filesystem
never write the same file: no locks, which NFS would not honour anyway. Writes go to a temporary file in
the same directory and are renamed over the target, so Prometheus never reads half a file. The file is
rewritten every ``refresh`` seconds (its mtime is a heartbeat) and removed on a clean exit. A sidecar that
dies leaves its file behind on purpose: Prometheus keeps scraping the dead target, ``up`` goes to 0 and
VerlExporterDown says so, instead of the rank silently vanishing from view.

This directory is ours alone: verl's rollout Prometheus integration rewrites the prometheus.yml it
manages, so registrations must not live there. The generated prometheus.yml reads
``/etc/prometheus/file_sd/verl-*.json``.

No target labels are written: run and rank are already on every series, and a target label of the same
name would push the exposed one aside (exported_rank).
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from ..core.atomicfile import make_dirs, write_atomic

DEFAULT_REFRESH_S = 60.0


def advertise_host() -> str:
    return socket.getfqdn() or socket.gethostname()


class FileSdRegistration:
    def __init__(self, directory: str, host: str, port: int, refresh: float = DEFAULT_REFRESH_S):
        self.dir = Path(directory)
        safe_host = re.sub(r"[^A-Za-z0-9_.-]", "_", host)
        self.path = self.dir / f"verl-{safe_host}-{port}.json"
        self._doc = [{"targets": [f"{host}:{port}"], "labels": {}}]
        self._refresh = refresh
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def write(self) -> None:
        """Write the registration atomically; world-readable, as Prometheus may run as another user."""
        make_dirs(self.dir, 0o755)  # not mkdir(parents=True): under umask 077 Prometheus could not get in
        write_atomic(self.path, json.dumps(self._doc), mode=0o644)

    def start(self, on_error: Callable[[OSError], None] | None = None) -> FileSdRegistration:
        self.write()

        def loop() -> None:
            while not self._stop.wait(self._refresh):
                try:
                    self.write()
                except OSError as e:  # a shared filesystem hiccup: count it, try again next time
                    self.errors += 1
                    if on_error:
                        on_error(e)

        self._thread = threading.Thread(target=loop, name="verl-exporter-file-sd", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Deregister (clean exit): stop refreshing and remove the file."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)
        self.path.unlink(missing_ok=True)
