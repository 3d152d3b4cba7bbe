"""Cost of the relay's journal on the webhook path, as a ratio against the same webhooks without spool_dir.

    python bench/relay_journal.py [--webhooks N]

With spool_dir every accepted alert is written to the journal before the 200, so that a killed relay still
sends it. "Cheap enough" means: a webhook (parse, route, queue) costs at most a few times what it costs
without the journal; both are measured here, in the same run. The workers are not started (no sending).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time

import paths  # noqa: F401 - sets up imports of the package from this checkout

# isort: split
from verl_exporter.relay.app import RelayApp  # noqa: E402
from verl_exporter.relay.config import parse_config  # noqa: E402
from verl_exporter.relay.dispatch import Dispatcher  # noqa: E402
from verl_exporter.relay.metrics import RelayMetrics  # noqa: E402


def body(i: int) -> bytes:
    alert = {"status": "firing", "labels": {"alertname": "VerlBench", "severity": "warning", "rank": str(i)},
             "annotations": {"summary": "bench"}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": f"fp{i}"}
    return json.dumps({"version": "4", "status": "firing", "receiver": "verl-warning", "alerts": [alert]}).encode()


def per_webhook_us(spool_dir: str | None, n: int) -> float:
    doc = {"targets": {"dt": {"type": "dingtalk", "url": "http://127.0.0.1:9/robot/send", "token_env": "T"}},
           "routes": [{"targets": ["dt"]}], "delivery": {"queue_max_alerts": 10 * n}}
    if spool_dir:
        doc["spool_dir"] = spool_dir
    config = parse_config(doc, environ={"T": "t"})
    metrics = RelayMetrics()
    dispatcher = Dispatcher(config, metrics)
    dispatcher.load_spool()
    app = RelayApp(config, dispatcher, metrics)
    bodies = [body(i) for i in range(n)]
    t = time.perf_counter_ns()
    for b in bodies:
        environ = {"PATH_INFO": "/alert/verl-warning", "REQUEST_METHOD": "POST", "CONTENT_LENGTH": str(len(b)),
                   "wsgi.input": io.BytesIO(b)}
        app(environ, lambda *_: None)
    return (time.perf_counter_ns() - t) / n / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--webhooks", type=int, default=2000)
    args = parser.parse_args()
    bare, journaled = [], []
    for _ in range(5):
        bare.append(per_webhook_us(None, args.webhooks))
        with tempfile.TemporaryDirectory() as tmp:
            journaled.append(per_webhook_us(tmp, args.webhooks))
    b, j = statistics.median(bare), statistics.median(journaled)
    print(f"webhook without journal: {b:.1f} us; with journal: {j:.1f} us; ratio {j / b:.2f}")


if __name__ == "__main__":
    main()
