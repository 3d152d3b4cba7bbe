"""Large groups become one summary: thousands of alerts of one alertname are one message, not hundreds.

When a whole fleet goes down, Alertmanager sends one group of every rank's ``VerlExporterDown`` (at most
``max_alerts`` of them; ``truncatedAlerts`` counts the rest). Listed one line per alert that would be dozens
of robot messages at 20 a minute, and fill the relay's queue. Instead, per target, the alerts of one
alertname and status in one webhook (``SUMMARY_MIN`` or more of them, or any when Alertmanager truncated the
group) become one summary alert: the labels they share, a summary that says how many, and a description that
lists what varies compactly (``ranks 0–4095 (4,096)``, ``instances node{0–4095}:9477``), bounded so that the
message fits the smallest robot limit (WeCom markdown, 4,096 bytes). It is an ordinary alert from then on
(queued, journaled, spooled, formatted), so the relay's guarantees hold for it unchanged; ``weight`` gives
the number of alerts it stands for, which the message title shows.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..spec.rules import SEVERITIES
from .payload import Alert

SUMMARY_MIN = 32  # alerts of one name in one webhook that become a summary: more than one WeCom message lists
COUNT = "verl_relay_alerts"  # the annotation holding how many alerts a summary stands for
LIST_CHARS = 160  # per listed label: the description stays within format's caps (800, 200 when shrunk)
LISTED = ("rank", "instance", "run")  # first, in this order; then the other labels that vary
MAX_LISTS = 5
MAX_WEIGHT_DIGITS = 9  # a summary stands for fewer than 10**9 alerts (truncatedAlerts is at most 10**7)


def weight(alert: Alert) -> int:
    """How many alerts this one stands for: a summary's count, else 1."""
    if not alert.fingerprint.startswith("summary-"):
        return 1
    count = alert.annotations.get(COUNT, "1")  # read back from the journal or spool, or sent by anyone
    if not (count.isascii() and count.isdigit() and len(count) <= MAX_WEIGHT_DIGITS):
        return 1
    return max(int(count), 1)


def summarise(alerts: Sequence[Alert], truncated: int = 0) -> tuple[list[Alert], int]:
    """The alerts with each large group of one alertname and status replaced by its summary, and how many
    alerts went into summaries. ``truncated`` (the payload's truncatedAlerts) is added to the largest group."""
    groups: dict[tuple[str, str], list[Alert]] = {}
    for a in alerts:
        groups.setdefault((a.name, a.status), []).append(a)
    largest = max(groups, key=lambda k: len(groups[k]), default=None)
    out: list[Alert] = []
    merged = 0
    for key, members in groups.items():
        left_out = truncated if key == largest else 0
        if len(members) >= SUMMARY_MIN or left_out:  # left out: the message must say how many there are
            out.append(summary_alert(members, left_out))
            merged += len(members)
        else:
            out.extend(members)
    if not merged:
        return list(alerts), 0
    return out, merged


def summary_alert(members: Sequence[Alert], truncated: int = 0) -> Alert:
    """One alert standing for members (one alertname and status) and `truncated` more that were not sent."""
    first = members[0]
    common = {k: v for k, v in first.labels.items() if all(m.labels.get(k) == v for m in members[1:])}
    ident = json.dumps([first.status, sorted(common.items())], ensure_ascii=False)  # before the severity
    highest = _highest_severity(m.severity for m in members)
    if highest:  # one critical among warnings makes the summary critical: its colour, mentions and routing
        common["severity"] = highest
    total = len(members) + truncated
    summary = _common(m.annotations.get("summary", "") for m in members)
    lines = []
    varying = sorted({k for m in members for k in m.labels} - set(common),
                     key=lambda k: (LISTED.index(k) if k in LISTED else len(LISTED), k))
    for label in varying[:MAX_LISTS]:
        values = sorted({m.labels[label] for m in members if label in m.labels})
        lines.append(f"{_plural(label)} {compact(values)} ({len(values):,})")
    if len(varying) > MAX_LISTS:
        lines.append("also varying: " + ", ".join(varying[MAX_LISTS:MAX_LISTS + 10]))
    if truncated:
        what = _plural(varying[0]) if varying else "alerts"
        lines.append(f"and {truncated:,} more {what} that Alertmanager did not list (max_alerts)")
    annotations = {"summary": f"{total:,} alerts of {first.name}" + (f": {summary}" if summary else ""),
                   "description": "\n".join(lines), COUNT: str(total)}
    runbook = _common(m.annotations.get("runbook_url", "") for m in members)
    if runbook:
        annotations["runbook_url"] = runbook
    resolved = [m.ends_at for m in members if m.ends_at is not None]
    return Alert(first.status, common, annotations, min(m.starts_at for m in members),
                 max(resolved) if first.status == "resolved" and resolved else None,
                 _common(m.generator_url for m in members),
                 "summary-" + hashlib.sha256(ident.encode()).hexdigest()[:16])


def _highest_severity(values: Iterable[str]) -> str:
    """The highest of the pack's severities among values; the one value when all share it; else ""."""
    distinct = set(values)
    known = [s for s in SEVERITIES if s in distinct]  # SEVERITIES is highest first
    return known[0] if known else _common(distinct)


def _common(values: Iterable[str]) -> str:
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else ""


def _plural(label: str) -> str:
    if label.endswith("y") and label[-2:-1] not in ("a", "e", "o", "u", ""):
        return label[:-1] + "ies"  # severities
    return label + ("es" if label.endswith(("s", "x", "ch", "sh")) else "s")


# A digit run is a number only up to 20 digits (any 64-bit integer); a longer one stays text: int() refuses
# more than 4,300 digits (one such label lost the whole webhook) and costs quadratic time below that.
MAX_NUMBER_DIGITS = 20
_DIGITS = re.compile(rf"(?<!\d)(\d{{1,{MAX_NUMBER_DIGITS}}})(?!\d)")


@dataclass(frozen=True)
class _Shape:
    """A value cut at its digit runs: the text around them and the runs (node12:9477 -> node, 12, :, 9477)."""

    texts: tuple[str, ...]
    numbers: tuple[str, ...]


def _shape(value: str) -> _Shape:
    parts = _DIGITS.split(value)
    return _Shape(tuple(parts[0::2]), tuple(parts[1::2]))


def compact(values: Sequence[str], chars: int = LIST_CHARS) -> str:
    """Values as ranges where they differ in one number (0–4095, node{0–17,19}:9477), within about chars.

    Values of one shape (the same text around their numbers) that differ in a single number are written
    once with that number as ranges; the rest are listed. What does not fit ends in "… +N more".
    """
    by_shape: dict[tuple[tuple[str, ...], int], list[_Shape]] = {}
    for v in values:
        s = _shape(v)
        by_shape.setdefault((s.texts, len(s.numbers)), []).append(s)
    out: list[str] = []
    used = shown = 0
    for shapes in sorted(by_shape.values(), key=len, reverse=True):  # the odd ones out are what is cut
        for text, n in _compress(shapes, chars - used):
            if not n or (out and used + len(text) + 2 > chars):
                break
            out.append(text)
            used += len(text) + 2
            shown += n
    rest = len(values) - shown
    return ", ".join(out) + (f" … +{rest:,} more" if rest else "")


def _compress(shapes: list[_Shape], chars: int) -> list[tuple[str, int]]:
    """[(text, values it covers)] for values of one shape; a range list is cut at about chars."""
    width = len(shapes[0].numbers)
    varying = [i for i in range(width) if len({s.numbers[i] for s in shapes}) > 1]
    if len(varying) != 1:
        return [(_join(s.texts, s.numbers), 1) for s in sorted(shapes, key=lambda s: s.numbers)]
    i = varying[0]
    digits = sorted({s.numbers[i] for s in shapes}, key=lambda d: (int(d), d))
    plain = width == 1 and not any(shapes[0].texts)  # plain numbers (ranks): no braces
    around = 0 if plain else len(_join(shapes[0].texts, ["" for _ in shapes[0].numbers])) + 2
    ranges, covered = _ranges(digits, max(chars - around, 1))
    if plain:
        return [(ranges, covered)]
    numbers = list(shapes[0].numbers)
    numbers[i] = "{" + ranges + "}"
    return [(_join(shapes[0].texts, numbers), covered)]


def _ranges(digits: list[str], chars: int) -> tuple[str, int]:
    """("0", "1", "2", "5") -> ("0–2,5", 4): runs of consecutive numbers (zero-padded ones keep their width),
    as many as fit in chars (the first always), and how many numbers they cover."""
    runs: list[list[str]] = []
    for d in digits:
        last = runs[-1] if runs else None
        # 9, 10 is a run; 09, 010 is not (zero-padded values keep their width)
        if last and int(d) == int(last[-1]) + 1 and (len(d) == len(last[-1]) or d[0] != "0" != last[-1][0]):
            last.append(d)
        else:
            runs.append([d])
    out: list[str] = []
    used = covered = 0
    for run in runs:
        text = run[0] if len(run) == 1 else f"{run[0]}–{run[-1]}"
        if out and used + len(text) + 1 > chars:
            break
        out.append(text)
        used += len(text) + 1
        covered += len(run)
    return ",".join(out), covered


def _join(texts: Sequence[str], numbers: Sequence[str]) -> str:
    out = [texts[0]]
    for n, t in zip(numbers, texts[1:], strict=True):
        out += [n, t]
    return "".join(out)
