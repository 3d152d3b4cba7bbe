
"""The relay as a real process (`verl-exporter relay`), killed with SIGTERM or kill -9 at random points while
it delivers to the loopback robots (tests/robots.py), with an Alertmanager-like sender that posts each alert
until it gets a 200.

Invariants across all the restarts: no accepted alert is lost; none reaches a robot twice within the rate
window; no robot gets more than its limit of messages in any window (one "minute" is WINDOW seconds here).

Two duplicates are inherent to at-least-once delivery and the only ones allowed: a message the robot took
in the instant around a kill -9 (before the relay read the answer, or on its way when the kill came); and an
alert whose webhook request was cut by a kill, which the sender (like Alertmanager) posts again although the
relay may have kept it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import REPO, free_port, http_get, wait_for
from helpers import scaled
from robots import FakeDingTalk, FakeWeCom

pytestmark = pytest.mark.integration  # starts servers or programs

TOKEN, SECRET, WKEY = "dt-token-restart-41c7", "SECdt-secret-restart-9a2e", "wecom-key-restart-77d1"
ENV = {"DT_TOKEN": TOKEN, "DT_SECRET": SECRET, "WECOM_KEY": WKEY}
WINDOW = 4.0  # the robots' and the relay's "minute"
LIMIT = 20
ALERTS = 80
KILL_GRACE = 0.3  # a message the robot took this long (scaled) before or after a kill -9 may be sent again


class Sender:
    """Posts alerts 0..n-1 in order, each until the relay answers 200 (Alertmanager retries too)."""

    def __init__(self, url: str, n: int):
        self.url, self.n = url, n
        self.accepted: set[int] = set()
        self.ambiguous: set[int] = set()  # a request cut mid-way: the relay may have kept it
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sender:
        self._thread.start()
        return self

    def _run(self) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for i in range(self.n):
            alert = {"status": "firing", "labels": {"alertname": "VerlRestart", "severity": "critical",
                                                    "instance": f"node{i:04d}:9477"},
                     "annotations": {"summary": f"alert {i}"}, "startsAt": now, "fingerprint": f"fp{i:04d}"}
            body = json.dumps({"version": "4", "status": "firing", "receiver": "verl-critical",
                               "alerts": [alert]}).encode()
            while not self._post(i, body):
                time.sleep(0.05)
            time.sleep(0.04)
        self.done.set()

    def _post(self, i: int, body: bytes) -> bool:
        req = urllib.request.Request(self.url + "/alert/verl-critical", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=scaled(3)) as resp:
                ok = resp.status == 200
        except urllib.error.HTTPError as e:
            ok = False
            e.close()
        except OSError as e:
            if not isinstance(getattr(e, "reason", e), ConnectionRefusedError):
                self.ambiguous.add(i)
            return False
        if ok:
            self.accepted.add(i)
        return ok


def deliveries(robot) -> dict[int, list[float]]:
    """Alert number -> the robot's arrival time of each message that named it."""
    out: dict[int, list[float]] = {}
    for payload, at in zip(list(robot.messages), list(robot.accepted_times), strict=True):
        inner = payload[payload["msgtype"]]
        for n in set(re.findall(r"node(\d{4}):9477", inner.get("text", inner.get("content", "")))):
            out.setdefault(int(n), []).append(at)
    return out


def test_kills_at_random_points_lose_nothing_duplicate_nothing_and_keep_the_rate(tmp_path):
    seed = int(os.environ.get("RELAY_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"\nseed {seed} (RELAY_FAULT_SEED reruns it)")
    dt = FakeDingTalk(TOKEN, SECRET, limit=LIMIT, window=WINDOW).start()
    wc = FakeWeCom(WKEY, limit=LIMIT, window=WINDOW).start()
    port = free_port()
    doc = {"listen": f"127.0.0.1:{port}", "spool_dir": str(tmp_path / "spool"),
           # a robot's answer that is late (a loaded machine) is a resend, an inherent duplicate: the waits scale
           "delivery": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.2, "max_retry_seconds": 60,
                        "max_attempts": 1000, "request_timeout_seconds": scaled(1), "drain_seconds": scaled(0.5),
                        "rate_window_seconds": WINDOW},
           "targets": {"dingtalk": {"type": "dingtalk", "url": dt.url, "token_env": "DT_TOKEN",
                                    "secret_env": "DT_SECRET"},
                       "wecom": {"type": "wecom", "url": wc.url, "token_env": "WECOM_KEY"}},
           "routes": [{"receivers": ["verl-critical"], "targets": ["dingtalk", "wecom"]}]}
    (tmp_path / "relay.yaml").write_text(yaml.safe_dump(doc))
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(REPO / "exporter"),
                                                               os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "verl_exporter", "relay", "--config", str(tmp_path / "relay.yaml")]
    url = f"http://127.0.0.1:{port}"
    kills: list[float] = []  # when each kill -9 was sent (robot clock: time.time)
    stops: list[tuple[float, str]] = []  # every stop, for the message of a failure
    outputs: list[str] = []

    def start() -> subprocess.Popen:
        path = tmp_path / f"relay-{len(outputs)}.log"
        outputs.append(str(path))
        with open(path, "w") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: proc.poll() is None and _up(url), timeout=20)
        return proc

    sender = Sender(url, ALERTS).start()
    started = time.monotonic()
    rounds = []
    try:
        while not sender.done.is_set() or len(rounds) < 5:
            proc = start()
            if rng.random() < 0.3:  # the robots fail for a while too
                (dt if rng.random() < 0.5 else wc).fail_next(rng.randint(1, 4), rng.choice(["500", "drop"]))
            time.sleep(rng.uniform(0.1, 1.2))
            how = rng.choice(["SIGTERM", "SIGKILL"])
            stops.append((time.time(), how))
            if how == "SIGKILL":
                kills.append(time.time())
                proc.kill()
            else:
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=scaled(20)) in (0, -signal.SIGKILL), _tail(outputs[-1])
            rounds.append(how)
            assert time.monotonic() - started < scaled(90), "the sender never finished"
        proc = start()  # the last one delivers everything that is left
        # At the robots' limit, what is left may need ALERTS / LIMIT windows (all of them, if the earlier relays
        # delivered little on a loaded machine): 4 windows was exactly that, with no slack.
        for robot in (dt, wc):
            wait_for(lambda r=robot: set(deliveries(r)) >= sender.accepted, timeout=(ALERTS / LIMIT + 3) * WINDOW)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled(20)) == 0, _tail(outputs[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
        dt.stop()
        wc.stop()

    logs = "".join(Path(name).read_text() for name in outputs)
    assert not any(s in logs for s in (TOKEN, SECRET, WKEY))
    print(f"{len(rounds)} kills ({rounds.count('SIGKILL')} kill -9), {len(dt.messages)} + {len(wc.messages)} "
          f"messages, {time.monotonic() - started:.1f}s")
    assert sender.accepted == set(range(ALERTS))
    for robot in (dt, wc):
        got = deliveries(robot)
        assert set(got) == sender.accepted  # none lost
        for n, times in got.items():
            for a, b in zip(times, times[1:], strict=False):
                inherent = n in sender.ambiguous or any(abs(k - a) <= scaled(KILL_GRACE) for k in kills)
                near = [(how, round(t - a, 2)) for t, how in stops if -WINDOW < t - a < WINDOW]
                assert b - a >= WINDOW or inherent, (f"alert {n} delivered twice within the window, {b - a:.2f} s "
                                                     f"apart; the stops around the first, after it: {near}", seed)
        assert robot.rate_rejections == 0, (robot.errcodes(), seed)
        times = robot.accepted_times
        assert all(b - a >= WINDOW * 0.999 for a, b in zip(times, times[LIMIT:], strict=False)), seed


def _up(url: str) -> bool:
    try:
        return http_get(url + "/healthz", timeout=1)[0] == 200
    except OSError:
        return False


def _tail(path: str) -> str:
    return Path(path).read_text()[-3000:]
