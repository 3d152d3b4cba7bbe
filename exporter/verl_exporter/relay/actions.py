"""Automated response from the relay: for chosen alerts, ask a sidecar's control endpoint to checkpoint
or stop the run (see ``verl_exporter/sidecar/control.py``).

    actions:
      - matchers: {alertname: VerlNumericalCollapse}
        action: stop                       # or checkpoint
        url: http://rank0-node:9477        # the rank-0 sidecar; /control/<action> is appended
        token_env: VERL_CONTROL_TOKEN      # or token_file
        cooldown_seconds: 1800             # act at most once per alert (fingerprint) in this time

``action: forensics`` (on the stall alerts) asks the sidecar to capture the trainer's stacks now
(sidecar/forensics.py, its --forensics-dir on); the sidecar answers with its verdict across the ranks it
captured and where the dumps are, and the relay sends that as a page of its own, the spec's notice
VerlHangForensics, to the receiver of the alert that asked (``on_evidence``), within the robots' limits as
every message.

Off unless configured (config.Action is the model of an entry). Only firing alerts trigger; each call
is logged and counted in verl_relay_actions_total{action,result}; the token is a Secret and never logged.
Calls run on their own thread with a few retries, so a slow or absent trainer never holds up alert
delivery. Redirects are never followed (the token would go to another address), and only an answer that
says the request was applied counts as done (``applied: false``: the sidecar could not deliver it, failed).
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from ..exposition.selfmetrics import SelfMetric
from ..spec import Spec
from .config import Action
from .metrics import RelayMetrics
from .nofollow import OPENER
from .payload import Alert

ACTIONS = SelfMetric("verl_relay_actions_total")

EVIDENCE_ALERT = "VerlHangForensics"  # the spec's notice (its severity and texts are declared there)

log = logging.getLogger(__name__)

# Cooldown entries kept at most (oldest dropped first): a flood of distinct alerts cannot grow memory.
MAX_COOLDOWN_KEYS = 10_000
# A sidecar's JSON answer to a control request.
Answer = dict[str, Any]


class ActionRunner:
    """Calls the control endpoint for matching firing alerts, off the webhook's thread."""

    def __init__(self, actions: tuple[Action, ...], metrics: RelayMetrics,
                 clock: Callable[[], float] = time.monotonic, timeout: float = 10.0, attempts: int = 3,
                 sleep: Callable[[float], object] = time.sleep,
                 on_evidence: Callable[[str, Alert, Answer], None] | None = None):
        """on_evidence(receiver, alert, answer): a forensics action's answer (verdict, path), to be paged."""
        self.actions = actions
        self._on_evidence = on_evidence
        self._metrics = metrics
        self._clock = clock
        self._timeout = timeout
        self._attempts = attempts
        self._sleep = sleep
        # (action index, alert) -> when it last acted, oldest first; entries past every cooldown are pruned
        self._last: OrderedDict[tuple[int, str], float] = OrderedDict()
        self._max_cooldown = max((a.cooldown_seconds for a in actions), default=0.0)
        self._lock = threading.Lock()  # webhooks arrive on several threads
        self._queue: queue.Queue[tuple[Action, Alert, str]] = queue.Queue(maxsize=1000)
        self._thread = threading.Thread(target=self._run, name="verl-relay-actions", daemon=True)
        if actions:
            self._thread.start()

    def consider(self, alerts: Iterable[Alert], receiver: str = "") -> None:
        """Queue the actions that firing alerts of one webhook call for (deduplicated by cooldown)."""
        with self._lock:
            self._consider(alerts, receiver)

    def _consider(self, alerts: Iterable[Alert], receiver: str) -> None:
        self._prune(self._clock())
        for alert in alerts:
            if alert.status != "firing":
                continue
            for i, act in enumerate(self.actions):
                if not act.matches(alert.labels):
                    continue
                key = (i, alert.fingerprint or json.dumps(alert.labels, sort_keys=True))
                now = self._clock()
                if now - self._last.get(key, -1e18) < act.cooldown_seconds:
                    self._metrics.inc(ACTIONS, action=act.action, result="cooldown")
                    continue
                self._last[key] = now
                self._last.move_to_end(key)
                while len(self._last) > MAX_COOLDOWN_KEYS:
                    self._last.popitem(last=False)
                try:
                    self._queue.put_nowait((act, alert, receiver))
                except queue.Full:
                    self._metrics.inc(ACTIONS, action=act.action, result="dropped")

    def _prune(self, now: float) -> None:
        """Forget the alerts whose every cooldown is over: they would act again anyway."""
        while self._last and now - next(iter(self._last.values())) >= self._max_cooldown:
            self._last.popitem(last=False)

    def _run(self) -> None:
        while True:
            act, alert, receiver = self._queue.get()
            try:
                result, answer = self._call(act, alert.labels.get("alertname", ""))
                if result == "done" and act.action == "forensics" and self._on_evidence is not None:
                    self._on_evidence(receiver, alert, answer)
            except Exception:  # a bug must cost this action, not the thread (and every later action)
                log.exception("action: the %s request to %s failed", act.action, act.url)
                result = "failed"
            self._metrics.inc(ACTIONS, action=act.action, result=result)

    def _call(self, act: Action, alertname: str) -> tuple[str, Answer]:
        body = json.dumps({"reason": alertname}).encode()
        where = f"{act.url}/control/{act.action}"
        for attempt in range(1, self._attempts + 1):
            if attempt > 1:  # back off between attempts, never after the last one
                self._sleep(min(2 ** (attempt - 1), 10))
            req = urllib.request.Request(where, data=body, method="POST",
                                         headers={"Authorization": f"Bearer {act.token.get_secret_value()}",
                                                  "Content-Type": "application/json"})
            try:
                with OPENER.open(req, timeout=self._timeout) as resp:
                    answer = json.loads(resp.read(65536) or b"{}")
            except urllib.error.HTTPError as e:
                e.close()
                if 300 <= e.code < 400:
                    log.error("action: %s answered HTTP %d (a redirect, not followed: the token goes to the "
                              "sidecar only); point url at the sidecar itself", where, e.code)
                    return "refused", {}
                if e.code < 500:  # a wrong token or a disabled endpoint does not get better by retrying
                    log.error("action: %s refused with HTTP %d (check the token and that the sidecar "
                              "has --control-token-*)", where, e.code)
                    return "refused", {}
                log.warning("action: %s failed (attempt %d): HTTP %d", where, attempt, e.code)
                continue
            # HTTPException: not an HTTP answer; RecursionError: JSON nested deeper than the parser goes
            except (OSError, ValueError, RecursionError, http.client.HTTPException) as e:
                log.warning("action: %s failed (attempt %d): %s", where, attempt, type(e).__name__)
                continue
            applied = answer.get("applied") if isinstance(answer, dict) else None
            if not isinstance(applied, bool):  # not the sidecar's control endpoint: nothing was requested
                log.error("action: %s answered without 'applied'; not a verl-exporter control endpoint, "
                          "so the %s was NOT requested", where, act.action)
                return "failed", {}
            if not applied:  # recorded where the trainer cannot read it: retrying would not change that
                why = "".join(c if c.isprintable() else " " for c in str(answer.get("error", ""))[:300])
                log.error("action: %s recorded the %s but says it is NOT applied (%s); the trainer will not see "
                          "it", where, act.action, why or "no reason given")
                return "failed", {}
            log.warning("action: asked %s to %s because of %s (applied, request %s)", act.url, act.action,
                        alertname, str(answer.get("id", "?"))[:40])
            return "done", answer
        log.error("action: %s failed %d time(s); the %s was NOT requested", where, self._attempts, act.action)
        return "failed", {}


def evidence_alert(alert: Alert, answer: Answer, spec: Spec) -> Alert:
    """The page a forensics answer becomes: the alert's labels under the name and severity of the spec's notice
    EVIDENCE_ALERT, its texts filled in with the answer (the verdict, how many processes, where the dumps are).

    The sidecar's answer is data from the node: format.py escapes it and keeps it within the robots' limits."""
    notice = spec.notice(EVIDENCE_ALERT)
    labels = {**alert.labels, "alertname": notice.alert, "severity": notice.severity}
    annotations = notice.texts({"alert": alert.name, "processes": answer.get("processes", 0),
                                "path": answer.get("path") or "", "instance": alert.labels.get("instance") or "?",
                                "verdict": answer.get("verdict", "")})
    return replace(alert, status="firing", labels=labels, annotations=annotations,
                   starts_at=datetime.now(timezone.utc), ends_at=None, generator_url="", fingerprint="")
