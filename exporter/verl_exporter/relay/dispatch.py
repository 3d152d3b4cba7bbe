"""Delivery: one worker thread per target, between the webhook (which only queues) and the robot.

- Rate: at most ``rate_per_minute`` attempts in any window, counted from each attempt's end, so the robot
  (which counts arrivals) never sees more: DingTalk locks a robot for 10 minutes beyond 20 a minute.
- Merging: a message is built when the rate allows one, from as many queued alerts as fit, so a pile-up
  becomes fewer, fuller messages instead of drops. A newer state of an alert that is still queued replaces
  the older one in place (counted as superseded).
- Accounting: every alert accepted is delivered, or counted and logged as failed, or spooled at shutdown.
  An alert the formatter fails on costs only itself: the webhook checks each alert before accepting it,
  and a batch that still fails to pack is split to find the alert at fault (dropped as unrenderable).
- Shutdown: drain for a bounded time, then hand back what is left (``remaining``) for the spool.
- Restarts (with spool_dir): every accepted alert and every attempt is in the journal (journal.py) before
  it counts, so a killed relay resends what it had not delivered and keeps each robot's rate window.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..core.atomicfile import write_atomic
from ..core.models import read_json
from ..exposition.selfmetrics import SelfMetric
from .config import RelayConfig, Target, zone
from .format import Message, pack, unrenderable
from .journal import Journal, SpoolError
from .metrics import RelayMetrics
from .payload import Alert, Repair, parse_alert
from .senders import Sender, make_sender
from .summary import summarise

ALERTS = SelfMetric("verl_relay_alerts_total")
SEND_DURATION_SECONDS = SelfMetric("verl_relay_send_duration_seconds_total")
MESSAGES = SelfMetric("verl_relay_messages_total")
ROBOT_ERRORS = SelfMetric("verl_relay_robot_errors_total")
SPOOL_ERRORS = SelfMetric("verl_relay_spool_errors_total")
REPAIRED_VALUES = SelfMetric("verl_relay_repaired_values_total")

log = logging.getLogger(__name__)

# Alerts considered per message: enough to fill the biggest message in one-line form, cheap to render.
MAX_BATCH = 400
SPOOL_PREFIX = "relay-spool-"
MAX_SPOOL_BYTES = 1024**3  # refuses /dev/zero, not a spool: 10,000 queued alerts per target are ~40 MB


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


@dataclass
class Queued:
    alert: Alert
    receiver: str
    since: float  # monotonic time it was queued (for the oldest-age gauge)
    jid: int | None = None  # its id in the journal, None without one


# Robots that also count per second: a Lark bot takes at most 5 messages a second (and 100 a minute)
# (https://open.feishu.cn/document/client-docs/bot-v3/add-custom-bot, "Usage limits").
ROBOT_BURSTS = {"lark": (5, 1.0)}


class RateLimiter:
    """At most `limit` events in any `window` seconds (a sliding log: a token bucket refilled at limit/window
    with a full bucket would allow a burst that a robot's per-minute count rejects)."""

    def __init__(self, limit: int, window: float, clock: Callable[[], float] = time.monotonic,
                 burst: tuple[int, float] | None = None):
        self.limit, self.window, self.clock = limit, window, clock
        self.burst = burst  # (n, seconds): also at most n events in any such shorter window
        self._events: deque[float] = deque()

    def delay(self) -> float:
        """Seconds until the next event is allowed (0: now)."""
        now = self.clock()
        while self._events and self._events[0] <= now - self.window:
            self._events.popleft()
        wait = self._events[0] + self.window - now if len(self._events) >= self.limit else 0.0
        if self.burst is not None and len(self._events) >= self.burst[0]:
            wait = max(wait, self._events[-self.burst[0]] + self.burst[1] - now)
        return max(wait, 0.0)

    def record(self) -> None:
        self._events.append(self.clock())

    def preload(self, wall_times: list[float], now_wall: float) -> None:
        """Events of an earlier run (wall clock, sorted): they still count within the window."""
        now = self.clock()
        self._events = deque(sorted([now - (now_wall - t) for t in wall_times] + list(self._events))[-self.limit:])

    def saturate(self) -> None:
        """The robot says we were too fast (someone else shares it): treat the whole window as used."""
        now = self.clock()
        self._events = deque([now] * self.limit)


class TargetWorker:
    def __init__(self, target: Target, sender: Sender, config: RelayConfig, metrics: RelayMetrics):
        self.target = target
        self.robot_target = target.as_robot()  # what messages are formatted for (a console target: its style)
        self.sender = sender
        self.metrics = metrics
        self.delivery = config.delivery
        self.tz = zone(config.timezone)
        self.limiter = RateLimiter(target.rate_per_minute, self.delivery.rate_window_seconds,
                                   burst=ROBOT_BURSTS.get(target.robot))
        self._pending: deque[Queued] = deque()
        self._by_key: dict[str, Queued] = {}
        self._inflight: list[Queued] = []
        self._message: Message | None = None  # the message built for _inflight
        self._cond = threading.Condition()
        self._draining = False
        self._stop_now = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"verl-relay-{target.name}", daemon=True)
        self.last_success: float | None = None
        self.journal: Journal | None = None

    def _settled(self, items: list[Queued]) -> None:
        """These alerts are delivered, given up or replaced: the journal need not resend them."""
        if self.journal is not None:
            self.journal.done([q.jid for q in items])

    # ---- producer side (request threads)
    def room(self) -> int:
        with self._cond:
            return self.delivery.queue_max_alerts - len(self._pending)

    def offer(self, items: list[Queued], force: bool = False) -> None:
        """Queue alerts (a newer state replaces a queued older one); QueueFull when there is no room."""
        with self._cond:
            if self._draining and not force:
                raise Draining(self.target.name)
            fresh = [q for q in items if q.alert.key not in self._by_key]
            if not force and len(self._pending) + len(fresh) > self.delivery.queue_max_alerts:
                raise QueueFull(self.target.name)
            for q in items:
                old = self._by_key.get(q.alert.key)
                if old is not None:
                    self._settled([old])
                    old.alert, old.receiver, old.jid = q.alert, q.receiver, q.jid  # keeps its place in the queue
                    self.metrics.inc(ALERTS, target=self.target.name, result="superseded")
                else:
                    self._pending.append(q)
                    self._by_key[q.alert.key] = q
            self._cond.notify()

    def state(self) -> tuple[int, float]:
        with self._cond:
            depth = len(self._pending) + len(self._inflight)
            oldest = min((q.since for q in (*self._inflight, *self._pending)), default=None)
        return depth, 0.0 if oldest is None else time.monotonic() - oldest

    # ---- lifecycle
    def start(self) -> None:
        self._thread.start()

    def begin_drain(self) -> None:
        with self._cond:
            self._draining = True
            self._cond.notify()

    def stop_now(self) -> None:
        self._stop_now.set()
        with self._cond:
            self._cond.notify()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def idle(self) -> bool:
        with self._cond:
            return not self._pending and not self._inflight

    def remaining(self) -> list[Queued]:
        """What was not delivered: the message in flight (if its worker is still stuck) and the queue."""
        with self._cond:
            return [*self._inflight, *self._pending]

    # ---- the worker
    def _take_batch(self) -> list[Queued] | None:
        with self._cond:
            while True:
                while not self._pending and not self._stop_now.is_set():
                    if self._draining:
                        return None
                    self._cond.wait()
                if self._stop_now.is_set():
                    return None
                # Built under the lock so that no newer state can replace an alert between packing and removal.
                packed = self._pack_head()
                if packed is not None:
                    break
            message, used = packed
            batch = [self._pending.popleft() for _ in range(used)]
            for q in batch:
                self._by_key.pop(q.alert.key, None)
            self._inflight = batch
            self._message = message
            return self._inflight

    def _pack_head(self) -> tuple[Message, int] | None:
        """The message for the head of the queue (under the lock). Should packing fail, each alert of the batch
        is packed alone: those that fail alone are dropped, the rest is packed again; None when none is left."""
        batch = list(self._pending)[:MAX_BATCH]
        try:
            return self._pack([q.alert for q in batch])
        except Exception:
            pass
        good = []
        for q in batch:
            try:
                self._pack([q.alert])
            except Exception as e:
                self._drop_unrenderable(q, e)
            else:
                good.append(q)
        if not good:
            return None
        try:
            return self._pack([q.alert for q in good])  # the good ones are now the head of the queue
        except Exception:  # each packs alone but not together (a bug): one at a time still delivers them all
            return self._pack([good[0].alert])

    def _drop_unrenderable(self, q: Queued, e: Exception) -> None:
        self._pending.remove(q)
        self._by_key.pop(q.alert.key, None)
        self.metrics.inc(ALERTS, target=self.target.name, result="unrenderable")
        self._settled([q])
        log.error("target %s: alert %r (%r) cannot be formatted (%s: %s); dropped, the others are delivered",
                  self.target.name, q.alert.name[:100], q.alert.fingerprint[:40],
                  type(e).__name__, str(e)[:200])
        log.debug("target %s: why the alert cannot be formatted", self.target.name, exc_info=e)

    def _pack(self, alerts: list[Alert]) -> tuple[Message, int]:
        try:
            return pack(alerts, self.robot_target, self.tz)
        except Exception as e:  # a user template that fails on this alert: the default one still works
            if self.target.template is None and self.target.text_template is None:
                raise
            log.error("target %s: the custom template failed (%s: %s); using the default template",
                      self.target.name, type(e).__name__, e)
            return pack(alerts, self.robot_target.model_copy(update={"template": None, "text_template": None}), self.tz)

    def _requeue_inflight(self) -> None:
        with self._cond:
            for q in reversed(self._inflight):
                if q.alert.key not in self._by_key:  # a newer state arrived meanwhile: it wins
                    self._pending.appendleft(q)
                    self._by_key[q.alert.key] = q
                else:
                    self._settled([q])
            self._inflight = []

    def _wait(self, seconds: float) -> bool:
        """Sleep unless told to stop now; False when stopped."""
        return not self._stop_now.wait(max(seconds, 0.0))

    def _run(self) -> None:
        while True:
            delay = self.limiter.delay()
            if delay > 0 and not self._wait(delay):
                return
            try:
                batch = self._take_batch()
                if batch is None:
                    return
                if not self._deliver(batch):
                    self._requeue_inflight()
                    return
                self._settled(batch)
            except Exception:  # a bug must cost this message, not the worker (and every later alert)
                with self._cond:
                    lost = self._inflight
                    if not lost and self._pending:  # packing failed: drop the head, which caused it
                        lost = [self._pending.popleft()]
                        self._by_key.pop(lost[0].alert.key, None)
                self.metrics.inc(ALERTS, len(lost), target=self.target.name, result="failed")
                self._settled(lost)
                log.exception("target %s: %d alert(s) not delivered because of an internal error",
                              self.target.name, len(lost))
            with self._cond:
                self._inflight = []

    def _deliver(self, batch: list[Queued]) -> bool:
        """Attempt the built message until it is sent or given up; False when stopped midway."""
        name, message = self.target.name, self._message
        if message is None:
            raise RuntimeError("no message was built for the batch")
        started = time.monotonic()
        attempt = 0
        while True:
            delay = self.limiter.delay()
            if delay > 0 and not self._wait(delay):
                return False
            attempt += 1
            try_id = None
            if self.journal is not None:  # its latest possible arrival, in case we are killed during it
                try_id = self.journal.attempt(name, time.time() + self.delivery.request_timeout_seconds)
            t0 = time.perf_counter()
            result = self.sender.send(message.body)
            self.metrics.inc(SEND_DURATION_SECONDS, time.perf_counter() - t0, target=name)
            self.limiter.record()  # every attempt counts: the robot may have counted it
            if self.journal is not None:
                self.journal.attempt(name, time.time(), try_id)
            if result.ok:
                self.metrics.inc(MESSAGES, target=name, result="sent")
                self.metrics.inc(ALERTS, len(batch), target=name, result="delivered")
                self.last_success = time.time()
                return True
            self.metrics.inc(ROBOT_ERRORS, target=name, errcode=result.errcode)
            if result.rate_limited:
                self.limiter.saturate()
                if self.journal is not None:
                    self.journal.saturated(name, time.time())
            if self.delivery.should_retry(result, attempt, time.monotonic() - started):
                self.metrics.inc(MESSAGES, target=name, result="retried")
                backoff = self.delivery.backoff(attempt)
                log.warning("target %s: attempt %d of a message of %d alert(s) failed, retrying in %.1fs: %s",
                            name, attempt, len(batch), backoff, result.detail)
                if not self._wait(backoff):
                    return False
                continue
            self.metrics.inc(MESSAGES, target=name, result="failed")
            self.metrics.inc(ALERTS, len(batch), target=name, result="failed")
            why = "not retryable" if not result.retryable else f"gave up after {attempt} attempt(s)"
            log.error("target %s: a message of %d alert(s) (%s) was NOT delivered (%s): %s", name, len(batch),
                      _names(batch), why, result.detail)
            return True


def _names(batch: list[Queued], limit: int = 5) -> str:
    names = sorted({q.alert.name for q in batch})
    return ", ".join(names[:limit]) + (f" +{len(names) - limit}" if len(names) > limit else "")


class Dispatcher:
    """Routes alerts to the targets' workers; drains, spools and reloads the spool."""

    def __init__(self, config: RelayConfig, metrics: RelayMetrics,
                 senders: dict[str, Sender] | None = None):
        self.config = config
        self.metrics = metrics
        senders = senders or {}
        self.workers = {
            name: TargetWorker(t, senders.get(name) or make_sender(t, config.delivery.request_timeout_seconds),
                               config, metrics)
            for name, t in config.targets.items()}
        metrics.queue_state = lambda: {n: w.state() for n, w in self.workers.items()}
        self._draining = False
        self.tz = zone(config.timezone)
        self.journal: Journal | None = None
        if config.spool_dir is not None:
            self.journal = Journal(config.spool_dir, metrics, config.delivery.rate_window_seconds)
            for w in self.workers.values():
                w.journal = self.journal

    def start(self) -> None:
        for w in self.workers.values():
            w.start()

    def submit(self, receiver: str, alerts: list[Alert], truncated: int = 0) -> dict[str, int]:
        """Queue alerts for their targets; {target: alerts queued}. QueueFull/Draining: nothing was queued
        for a target that had no room (the caller answers 503 and Alertmanager sends the group again).
        A large group of one alertname (or one Alertmanager truncated) is queued as one summary alert."""
        if self._draining:
            raise Draining("shutting down")
        plan: dict[str, list[Queued]] = {}
        now = time.monotonic()
        for alert in alerts:
            why = unrenderable(alert, self.tz)
            if why is not None:  # parse_payload repairs what it knows; this alert would stall a queue
                self.metrics.inc(ALERTS, target="", result="unrenderable")
                log.error("webhook %s: alert %r cannot be formatted (%s); not accepted, the others are", receiver,
                          alert.name[:100], why)
                continue
            targets = self.config.targets_for(receiver, alert.labels)
            if not targets:
                self.metrics.inc(ALERTS, target="", result="unrouted")
            for t in targets:
                plan.setdefault(t, []).append(Queued(alert, receiver, now))
        summarised: dict[str, int] = {}
        for t, items in plan.items():  # summary.py: thousands of ranks down are one message, not hundreds
            merged, summarised[t] = summarise([q.alert for q in items], truncated)
            if summarised[t]:
                plan[t] = [Queued(a, receiver, now) for a in merged]
        for t, items in plan.items():  # check every target first, so a 503 mostly queues nothing
            if self.workers[t].room() < len(items):
                raise QueueFull(t)
        for t, items in plan.items():
            try:
                if self.journal is not None:  # kept before the 200, so a killed relay still has it
                    for q in items:
                        q.jid = self.journal.add(t, q.receiver, q.alert.to_dict())
                self.workers[t].offer(items)
            except Exception:
                if self.journal is not None:  # not queued (503, or a bug: 500): Alertmanager sends them again
                    self.journal.done([q.jid for q in items])
                raise
        for t, n in summarised.items():
            if n:
                self.metrics.inc(ALERTS, n, target=t, result="summarised")
        return {t: len(items) for t, items in plan.items()}

    def drain(self, seconds: float) -> dict[str, list[Queued]]:
        """Stop taking alerts, deliver for up to `seconds`, stop the workers; what is left, by target."""
        self._draining = True
        for w in self.workers.values():
            w.begin_drain()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(w.idle() for w in self.workers.values()):
            time.sleep(0.02)
        for w in self.workers.values():
            w.stop_now()
        grace = self.config.delivery.request_timeout_seconds + 1
        for w in self.workers.values():
            if not w.join(grace):
                log.warning("target %s: a send is still in flight at shutdown; its alerts are spooled too "
                            "(they may arrive twice)", w.target.name)
        return {name: w.remaining() for name, w in self.workers.items() if w.remaining()}

    # ---- spool
    def spool(self, left: dict[str, list[Queued]]) -> Path | None:
        """Write what is left to spool_dir as JSON (atomically, mode 0600); counted and logged either way.
        The journal keeps the robots' recent attempts (and the alerts, if the spool cannot be written)."""
        total = sum(len(v) for v in left.values())
        spool_dir = self.config.spool_dir
        if not total or spool_dir is None:
            if self.journal is not None:
                self.journal.close(keep_pending=False)
            if total:
                for t, items in left.items():
                    self.metrics.inc(ALERTS, len(items), target=t, result="failed")
                log.error("%d undelivered alert(s) lost at shutdown: set spool_dir to keep them for the next "
                          "start", total)
            return None
        doc = {"version": 1, "written_at": datetime.now(timezone.utc).isoformat(),
               "alerts": [{"target": t, "receiver": q.receiver, "alert": q.alert.to_dict()}
                          for t, items in left.items() for q in items]}
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        path = spool_dir / f"{SPOOL_PREFIX}{stamp}-{os.getpid()}.json"
        try:
            spool_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomic(path, json.dumps(doc, ensure_ascii=False), mode=0o600)
        except OSError as e:
            self.metrics.inc(SPOOL_ERRORS, operation="write")
            if self.journal is not None:
                self.journal.close(keep_pending=True)
            for t, items in left.items():
                self.metrics.inc(ALERTS, len(items), target=t, result="spooled")
            log.error("cannot write the spool in %s (%s): the %d undelivered alert(s) stay in %s and are sent at "
                      "the next start", spool_dir, e.strerror, total, self.journal.path.name if self.journal else "")
            return None
        if self.journal is not None:
            self.journal.close(keep_pending=False)
        for t, items in left.items():
            self.metrics.inc(ALERTS, len(items), target=t, result="spooled")
        log.info("spooled %d undelivered alert(s) to %s; they are sent at the next start", total, path)
        return path

    def load_spool(self) -> int:
        """Queue the alerts of the spool files and of the journal, and the robots' recent attempts.

        The spool files are removed only once their alerts are in the rewritten journal, and a journal entry
        only once its alert is delivered (or given up): a relay killed at any point resends, never loses.
        OSError when spool_dir cannot be used (the relay must not run believing it keeps alerts)."""
        spool_dir = self.config.spool_dir
        if self.journal is None or spool_dir is None:  # a journal only with a spool_dir
            return 0
        self.journal.acquire()  # one relay per spool_dir, before anything in it is read
        paths = sorted(spool_dir.glob(f"{SPOOL_PREFIX}*.json")) if spool_dir.is_dir() else []
        now = time.monotonic()
        loaded = 0
        for path in paths:
            try:
                doc = read_json(path, MAX_SPOOL_BYTES)  # a FIFO is refused, not opened: it would block the start
                entries = doc["alerts"] if isinstance(doc, dict) else None
                if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(entries, list):
                    raise ValueError("not a version 1 spool")
            except (OSError, ValueError, KeyError, TypeError) as e:  # FileError is a ValueError
                self.metrics.inc(SPOOL_ERRORS, operation="read")
                log.error("spool file %s cannot be read (%s); renamed to .bad", path.name, e)
                with contextlib.suppress(OSError):  # it is not read again either way: it is not a spool
                    path.rename(path.with_suffix(".bad"))
                continue
            for entry in entries:
                loaded += self._requeue(path.name, entry, now)
        journaled, sent = self.journal.recover()
        for entry in journaled:
            loaded += self._requeue(self.journal.path.name, vars(entry), now)
        wall = time.time()
        for name, w in self.workers.items():
            w.limiter.preload(sent.get(name, []), wall)
            full = self.journal.full_since().get(name)
            if full is not None:
                w.limiter.preload([full] * w.limiter.limit, wall)
        pending = [(name, q.receiver, q.alert.to_dict(), q) for name, w in self.workers.items()
                   for q in w.remaining()]
        try:
            self.journal.restart(pending)  # now the spool files' alerts are in the journal: they may go
            for path in paths:
                path.unlink(missing_ok=True)
        except OSError as e:
            raise SpoolError(f"cannot write {self.journal.path} ({e.strerror}); fix spool_dir or remove it "
                             "from the config") from None
        if loaded:
            log.info("resending %d alert(s) from the spool", loaded)
        return loaded

    def _requeue(self, source: str, entry: object, now: float) -> int:
        problems: list[str] = []
        repairs: list[Repair] = []
        entry = entry if isinstance(entry, dict) else {}
        alert = parse_alert("spooled alert", entry.get("alert"), problems, repairs)
        given = entry.get("target")
        target = given if isinstance(given, str) else ""  # no target is named "" (config.Name)
        known = target in self.workers
        if alert is not None and known:
            why = unrenderable(alert, self.tz)
            problems += [f"it cannot be formatted ({why})"] if why else []
        if alert is None or not known or problems:
            self.metrics.inc(ALERTS, target=target if known else "", result="failed")
            log.error("%s: an entry cannot be resent (%s)", source,
                      "; ".join(problems) or f"target {str(given)[:100]!r} is not configured")
            return 0
        for r in repairs:
            self.metrics.inc(REPAIRED_VALUES, reason=r.reason)
        if repairs:
            log.warning("%s: %s", source, "; ".join(map(str, repairs[:3]))[:600])
        self.workers[target].offer([Queued(alert, str(entry.get("receiver", "")), now)], force=True)
        return 1
