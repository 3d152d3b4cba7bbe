"""Run a real `verl-exporter serve` whose GPU collectors see a fake NVML (this machine has no GPU).

    python tests/fake_gpu_sidecar.py <the usual serve flags>

Two GPUs with NVLink, a few processes, a thermal-throttle reason active on GPU 1, and an XID 79 injected
on GPU 0 a moment after start: enough that every GPU panel and rule of the pack has data. Everything else
(the verl log follower, host and checkpoint collectors, control endpoint) is the real thing.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_pynvml import FakeNvml, busy_node  # noqa: E402
from verl_exporter import cli  # noqa: E402
from verl_exporter.sidecar.sidecar import Sidecar  # noqa: E402

HW_THERMAL_SLOWDOWN = 0x40


def fake_node() -> FakeNvml:
    fake = busy_node(2, nvlink_links=4)
    fake.gpus[1].clock_reasons = HW_THERMAL_SLOWDOWN
    return fake


def main() -> int:
    fake = fake_node()
    original = Sidecar.context
    Sidecar.context = lambda self: dataclasses.replace(original(self), nvml_loader=lambda: fake)

    def xid_later():
        # once the XID collector has registered GPU 0 (an event before that is lost, as on a real GPU)
        while not any(s.types.get(0) for s in fake.event_sets):
            time.sleep(0.05)
        fake.inject_xid(0, 79)

    threading.Thread(target=xid_later, daemon=True).start()
    return cli.main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
