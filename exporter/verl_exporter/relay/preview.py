"""``verl-exporter relay --config FILE --preview ALERT.json``: what each target would post, without sending.

The webhook payload is routed and formatted by the same code as a live relay (routes, templates, mentions,
size limits and splitting), and each message is shown as its robot's chat would show it (or, with
``--body``, as the exact JSON body). Actions that the alerts would trigger are listed, not called.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .config import RelayConfig, zone
from .format import format_messages
from .payload import Alert, WebhookPayload
from .summary import summarise
from .terminal import render


def preview(config: RelayConfig, payload: WebhookPayload, out: Callable[[str], None] = print,
            body: bool = False, color: bool = False, width: int = 100) -> int:
    """Print every message the relay would post for this payload; 1 when no route takes its receiver."""
    receiver = payload.receiver
    if not config.knows_receiver(receiver):
        out(f"no route of the relay config takes receiver {receiver!r}: the relay would answer 404")
        return 1
    per_target: dict[str, list[Alert]] = {}
    unrouted = []
    for alert in payload.alerts:
        targets = config.targets_for(receiver, alert.labels)
        if not targets:
            unrouted.append(alert.name)
        for t in targets:
            per_target.setdefault(t, []).append(alert)
    n = len(payload.alerts)
    out(f"receiver {receiver}: {n} alert(s) ({sum(a.status == 'firing' for a in payload.alerts)} firing); "
        "nothing is sent")
    for r in payload.repairs:  # as the relay would log them
        out(f"repaired {r}")
    for name, alerts in per_target.items():
        target = config.targets[name]
        queued, _ = summarise(alerts, payload.truncated_alerts)  # a large group is one summary, as when live
        messages = format_messages(queued, target.as_robot(), zone(config.timezone))
        kind = f"console as {target.robot}" if target.type == "console" else target.type
        out(f"\ntarget {name} ({kind}, {target.format}): {len(alerts)} alert(s) in {len(messages)} message(s)")
        for msg in messages:
            out(msg.body.decode("utf-8") if body else render(msg.payload, target.robot, color=color, width=width))
    if unrouted:
        out(f"\nnot routed (no target): {', '.join(sorted(set(unrouted)))}")
    for act in config.actions:
        hits = sorted({a.name for a in payload.alerts if a.status == "firing" and act.matches(a.labels)})
        if hits:
            out(f"\naction: would ask {act.url}/control/{act.action} because of {', '.join(hits)} (not called)")
    return 0


def read_payload(path: str, limit: int) -> bytes:
    """The file's bytes ('-': standard input), read no further than the relay's body limit: a payload the
    live relay would refuse with 413 is refused here too, and /dev/zero cannot fill the memory."""
    if path == "-":
        raw = sys.stdin.buffer.read(limit + 1)
    else:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    if len(raw) > limit:
        raise PayloadTooLarge(f"larger than max_body_bytes ({limit}): the relay would answer 413")
    return raw


class PayloadTooLarge(ValueError):
    """A --preview payload over the relay's max_body_bytes."""
