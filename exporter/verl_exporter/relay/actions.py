"""Automated response from the relay: for chosen alerts, ask a sidecar's control endpoint to checkpoint
or stop the run (see ``verl_exporter/control.py``).

    actions:
      - matchers: {alertname: VerlNumericalCollapse}
        action: stop                       # or checkpoint
        url: http://rank0-node:9477        # the rank-0 sidecar; /control/<action> is appended
        token_env: VERL_CONTROL_TOKEN      # or token_file
        cooldown_seconds: 1800             # act at most once per alert (fingerprint) in this time

Off unless configured. Only firing alerts trigger; each call is logged and counted in
verl_relay_actions_total{action,result}; the token is a Secret and never logged. Calls run on their own
thread with a few retries, so a slow or absent trainer never holds up alert delivery.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger("verl_exporter.relay")

ACTIONS = ("checkpoint", "stop")
ACTION_KEYS = {"matchers", "action", "url", "token_env", "token_file", "cooldown_seconds"}


@dataclass(frozen=True)
class Action:
    matchers: tuple  # of config.Matcher
    action: str
    url: str
    token: object  # config.Secret
    cooldown_seconds: float = 1800.0

    def matches(self, labels: dict[str, str]) -> bool:
        return all(m.matches(labels) for m in self.matchers)

    def secrets(self) -> list[str]:
        return [self.token.reveal()] if self.token is not None and self.token.reveal() else []


def parse_actions(loader, raw, matcher_factory) -> tuple[Action, ...]:
    """Check the `actions:` list (problems go to the loader's list, naming the action)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        loader.problems.append("actions must be a list of {matchers, action, url, token_env | token_file}")
        return ()
    out = []
    for i, item in enumerate(raw):
        where = f"actions[{i}]"
        if not loader.mapping(where, item, ACTION_KEYS):
            continue
        action = item.get("action")
        if action not in ACTIONS:
            loader.problems.append(f"{where}: action must be one of {list(ACTIONS)}")
        url = str(item.get("url", ""))
        if not url.startswith(("http://", "https://")):
            loader.problems.append(f"{where}: url must be the sidecar's http(s)://HOST:PORT")
        matchers = matcher_factory(where, item.get("matchers"))
        if not matchers:
            loader.problems.append(f"{where}: matchers must select the alerts (e.g. {{alertname: VerlX}})")
        token = loader.secret(where, item, "token", required=True)
        cooldown = loader.number(where, item, "cooldown_seconds", 1800.0, minimum=0.0)
        if action in ACTIONS and url and matchers and token is not None:
            out.append(Action(tuple(matchers), action, url.rstrip("/"), token, float(cooldown)))
    return tuple(out)


class ActionRunner:
    """Calls the control endpoint for matching firing alerts, off the webhook's thread."""

    def __init__(self, actions: tuple[Action, ...], metrics, clock=time.monotonic, timeout: float = 10.0,
                 attempts: int = 3):
        self.actions = actions
        self._metrics = metrics
        self._clock = clock
        self._timeout = timeout
        self._attempts = attempts
        self._last: dict[tuple[int, str], float] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=1000)
        self._thread = threading.Thread(target=self._run, name="verl-relay-actions", daemon=True)
        if actions:
            self._thread.start()

    def consider(self, alerts) -> None:
        """Queue the actions that firing alerts of one webhook call for (deduplicated by cooldown)."""
        for alert in alerts:
            if alert.status != "firing":
                continue
            for i, act in enumerate(self.actions):
                if not act.matches(alert.labels):
                    continue
                key = (i, alert.fingerprint or json.dumps(alert.labels, sort_keys=True))
                now = self._clock()
                if now - self._last.get(key, -1e18) < act.cooldown_seconds:
                    self._metrics.inc("verl_relay_actions_total", action=act.action, result="cooldown")
                    continue
                self._last[key] = now
                try:
                    self._queue.put_nowait((act, alert.labels.get("alertname", "")))
                except queue.Full:
                    self._metrics.inc("verl_relay_actions_total", action=act.action, result="dropped")

    def _run(self) -> None:
        while True:
            act, alertname = self._queue.get()
            result = self._call(act, alertname)
            self._metrics.inc("verl_relay_actions_total", action=act.action, result=result)

    def _call(self, act: Action, alertname: str) -> str:
        body = json.dumps({"reason": alertname}).encode()
        for attempt in range(1, self._attempts + 1):
            req = urllib.request.Request(f"{act.url}/control/{act.action}", data=body, method="POST",
                                         headers={"Authorization": f"Bearer {act.token.reveal()}",
                                                  "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                    applied = json.loads(resp.read() or b"{}").get("applied", True)
                log.warning("action: asked %s to %s because of %s (%s)", act.url, act.action, alertname,
                            "applied" if applied else "already requested")
                return "done"
            except urllib.error.HTTPError as e:
                if e.code < 500:  # a wrong token or a disabled endpoint does not get better by retrying
                    log.error("action: %s/control/%s refused with HTTP %d (check the token and that the sidecar "
                              "has --control-token-*)", act.url, act.action, e.code)
                    return "refused"
            except (OSError, ValueError) as e:
                log.warning("action: %s/control/%s failed (attempt %d): %s", act.url, act.action, attempt,
                            type(e).__name__)
            time.sleep(min(2 ** attempt, 10))
        return "failed"
