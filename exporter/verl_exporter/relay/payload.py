"""A typed copy of Alertmanager's webhook payload (version 4), parsed strictly.

Every problem of a body is collected and reported at once, each naming the field (``alerts[3].labels``), so
that a 400 tells the sender exactly what is wrong. Unknown keys are ignored: Alertmanager may add fields in
a later release, and refusing them would turn an upgrade into lost notifications.
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

STATUSES = ("firing", "resolved")
# Alertmanager writes Go's RFC 3339 with up to nine fractional digits; datetime takes six.
_TIME_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")
# Go's zero time: an alert that is still firing has this endsAt.
ZERO_TIME = datetime(1, 1, 1, tzinfo=timezone.utc)


# Why a body was refused: the `reason` label of verl_relay_rejected_payloads_total (a closed set).
REASONS = ("not_json", "too_deep", "not_webhook", "too_large", "bad_length")


class PayloadError(ValueError):
    """A body that is not a usable webhook payload; ``problems`` lists every problem, one sentence each,
    ``reason`` is one of REASONS."""

    def __init__(self, problems: list[str], reason: str = "not_webhook"):
        self.problems = problems
        self.reason = reason
        super().__init__("; ".join(problems))


def parse_time(text: str) -> datetime:
    """RFC 3339 as Alertmanager writes it (nanoseconds allowed) → an aware datetime; ValueError otherwise."""
    m = _TIME_RE.match(text)
    if not m:
        raise ValueError(f"not an RFC 3339 time: {text[:40]!r}")
    base, frac, zone = m.groups()
    frac = (frac or "0")[:6].ljust(6, "0")
    zone = "+00:00" if zone == "Z" else zone
    return datetime.fromisoformat(f"{base}.{frac}{zone}")


@dataclass(frozen=True)
class Alert:
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: datetime
    ends_at: datetime | None  # None: still firing (Go's zero time)
    generator_url: str = ""
    fingerprint: str = ""

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")

    @property
    def key(self) -> str:
        """Identity of the alert across notifications: Alertmanager's fingerprint, else its label set."""
        return self.fingerprint or json.dumps(sorted(self.labels.items()), ensure_ascii=False)

    def to_dict(self) -> dict[str, Any]:
        """The webhook form (used for the spool), so that parse_alert(to_dict()) round-trips."""
        return {
            "status": self.status, "labels": dict(self.labels), "annotations": dict(self.annotations),
            "startsAt": _fmt_time(self.starts_at), "endsAt": _fmt_time(self.ends_at or ZERO_TIME),
            "generatorURL": self.generator_url, "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class WebhookPayload:
    version: str
    group_key: str
    truncated_alerts: int
    status: str
    receiver: str
    group_labels: dict[str, str]
    common_labels: dict[str, str]
    common_annotations: dict[str, str]
    external_url: str
    alerts: tuple[Alert, ...] = field(default_factory=tuple)


def _fmt_time(t: datetime) -> str:
    if t == ZERO_TIME:
        return "0001-01-01T00:00:00Z"
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _str_map(where: str, value: Any, problems: list[str]) -> dict[str, str]:
    if not isinstance(value, dict):
        problems.append(f"{where} must be an object of strings, got {_kind(value)}")
        return {}
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    if bad:
        problems.append(f"{where}: value(s) of {sorted(bad)[:5]} must be strings")
    return {k: v for k, v in value.items() if isinstance(v, str)}


def _short(value: Any) -> str:
    """A bounded repr: a value from the body may be huge or nested to the recursion limit."""
    return reprlib.repr(value)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _required_str(where: str, raw: dict, key: str, problems: list[str]) -> str:
    if key not in raw:
        problems.append(f"{where}{key} is missing")
        return ""
    if not isinstance(raw[key], str):
        problems.append(f"{where}{key} must be a string, got {_kind(raw[key])}")
        return ""
    return raw[key]


def _optional_str(where: str, raw: dict, key: str, problems: list[str]) -> str:
    value = raw.get(key, "")
    if not isinstance(value, str):
        problems.append(f"{where}{key} must be a string, got {_kind(value)}")
        return ""
    return value


def _time(where: str, raw: dict, key: str, problems: list[str], required: bool) -> datetime | None:
    if key not in raw and not required:
        return None
    text = _required_str(where, raw, key, problems)
    if not text:
        return None
    try:
        return parse_time(text)
    except ValueError as e:
        problems.append(f"{where}{key}: {e}")
        return None


def parse_alert(where: str, raw: Any, problems: list[str]) -> Alert | None:
    """One element of ``alerts``; problems are appended, None when it cannot be used."""
    if not isinstance(raw, dict):
        problems.append(f"{where} must be an object, got {_kind(raw)}")
        return None
    before = len(problems)
    status = _required_str(f"{where}.", raw, "status", problems)
    if status and status not in STATUSES:
        problems.append(f"{where}.status must be one of {list(STATUSES)}, got {status[:20]!r}")
    if "labels" not in raw:
        problems.append(f"{where}.labels is missing")
    labels = _str_map(f"{where}.labels", raw.get("labels", {}), problems)
    if "labels" in raw and isinstance(raw["labels"], dict) and not labels.get("alertname"):
        problems.append(f"{where}.labels has no alertname")
    annotations = _str_map(f"{where}.annotations", raw.get("annotations", {}), problems)
    starts_at = _time(f"{where}.", raw, "startsAt", problems, required=True)
    ends_at = _time(f"{where}.", raw, "endsAt", problems, required=False)
    generator_url = _optional_str(f"{where}.", raw, "generatorURL", problems)
    fingerprint = _optional_str(f"{where}.", raw, "fingerprint", problems)
    if len(problems) > before or starts_at is None:
        return None
    if ends_at is not None and ends_at <= ZERO_TIME:
        ends_at = None
    return Alert(status=status, labels=labels, annotations=annotations, starts_at=starts_at, ends_at=ends_at,
                 generator_url=generator_url, fingerprint=fingerprint)


def parse_payload(body: bytes | str) -> WebhookPayload:
    """A webhook body → WebhookPayload; PayloadError listing every problem otherwise."""
    try:
        doc = json.loads(body)
    except RecursionError:  # the C decoder recurses per nesting level: a hostile body hits the stack limit
        raise PayloadError(["the body is nested too deeply to be a webhook payload"], "too_deep") from None
    except ValueError as e:  # not UTF-8, not JSON, or an integer over Python's digit limit
        raise PayloadError([f"the body is not JSON: {str(e)[:200]}"], "not_json") from None
    if not isinstance(doc, dict):
        raise PayloadError([f"the body must be a JSON object, got {_kind(doc)}"])
    problems: list[str] = []
    version = doc.get("version")
    if version != "4":
        problems.append(f"version must be \"4\" (Alertmanager's webhook payload), got {_short(version)}"[:120])
    status = _required_str("", doc, "status", problems)
    if status and status not in STATUSES:
        problems.append(f"status must be one of {list(STATUSES)}, got {status[:20]!r}")
    receiver = _required_str("", doc, "receiver", problems)
    group_key = _optional_str("", doc, "groupKey", problems)
    external_url = _optional_str("", doc, "externalURL", problems)
    truncated = doc.get("truncatedAlerts", 0)
    if isinstance(truncated, bool) or not isinstance(truncated, int) or truncated < 0:
        problems.append(f"truncatedAlerts must be a non-negative integer, got {_kind(truncated)}")
        truncated = 0
    maps = {key: _str_map(key, doc.get(key, {}), problems)
            for key in ("groupLabels", "commonLabels", "commonAnnotations")}
    raw_alerts = doc.get("alerts")
    alerts: list[Alert] = []
    if not isinstance(raw_alerts, list) or not raw_alerts:
        problems.append("alerts must be a non-empty list" if raw_alerts is not None else "alerts is missing")
    else:
        for i, raw in enumerate(raw_alerts):
            alert = parse_alert(f"alerts[{i}]", raw, problems)
            if alert is not None:
                alerts.append(alert)
            if len(problems) >= 20:  # a huge broken body should not produce a huge 400
                problems.append("... (further problems not listed)")
                break
    if problems:
        raise PayloadError(problems)
    return WebhookPayload(version="4", group_key=group_key, truncated_alerts=truncated, status=status,
                          receiver=receiver, group_labels=maps["groupLabels"], common_labels=maps["commonLabels"],
                          common_annotations=maps["commonAnnotations"], external_url=external_url,
                          alerts=tuple(alerts))
