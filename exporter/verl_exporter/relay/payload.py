"""A typed copy of Alertmanager's webhook payload (version 4): core.models models, parsed strictly.

Every problem of a body is reported at once, each naming the field (``alerts.3.labels``), so that a 400 tells
the sender exactly what is wrong. Unknown keys are ignored: Alertmanager may add fields in a later release,
and refusing them would turn an upgrade into lost notifications. The relay works on ``Alert`` dataclasses
(built cheaply, also from the spool); the same dataclass, validated, checks what arrives.

Values that are well-formed but that no message could show are repaired here, where they enter, so that
nothing reaches the queues or the journal that the formatter cannot render (and one such alert never costs
the others of its webhook, which Alertmanager would not send again after a 200 or a 400): a time outside
the range every time zone can show is clamped, a lone surrogate (a ``\\udXXX`` escape that pairs with
nothing: not encodable text) becomes U+FFFD. Each repair is a ``Repair`` naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
)
from pydantic_core import ErrorDetails

from ..core.models import FileError, KeyPath, StrictModel
from ..core.models import problems as problem_lines

# Alertmanager writes Go's RFC 3339 with up to nine fractional digits; datetime takes six.
_TIME_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")
# Go's zero time: an alert that is still firing has this endsAt.
ZERO_TIME = datetime(1, 1, 1, tzinfo=timezone.utc)
# A huge broken body should not produce a huge 400.
MAX_PROBLEMS, MAX_PROBLEM_CHARS = 20, 300

# Why a body was refused: the `reason` label of verl_relay_rejected_payloads_total (a closed set).
REASONS = ("not_json", "too_deep", "not_webhook", "too_large", "bad_length")
# What was repaired in an accepted alert: the `reason` label of verl_relay_repaired_values_total.
REPAIRS = ("time_out_of_range", "bad_unicode")
# The times every zone can show: UTC offsets stay under a day, so a day inside datetime's range is enough.
EARLIEST = datetime(1, 1, 2, tzinfo=timezone.utc)
LATEST = datetime(9999, 12, 30, tzinfo=timezone.utc)
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # after json.loads, a surrogate left alone had no partner
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class Repair:
    """A value of an accepted alert changed so that it can be delivered."""

    reason: str  # one of REPAIRS
    field: str  # alerts.5.startsAt
    detail: str  # one sentence: what it was and what it became

    def __str__(self) -> str:
        return f"{self.field}: {self.detail}"


class PayloadError(FileError):
    """A body that is not a usable webhook payload; ``problems`` lists every problem, one sentence each,
    ``reason`` is one of REASONS."""

    def __init__(self, problems: list[str], reason: str = "not_webhook"):
        super().__init__(problems, "webhook payload")
        self.reason = reason


def parse_time(text: str) -> datetime:
    """RFC 3339 as Alertmanager writes it (nanoseconds allowed) → an aware datetime; ValueError otherwise."""
    m = _TIME_RE.match(text)
    if not m:
        raise ValueError(f"not an RFC 3339 time: {text[:40]!r}")
    base, frac, zone = m.groups()
    frac = (frac or "0")[:6].ljust(6, "0")
    zone = "+00:00" if zone == "Z" else zone
    return datetime.fromisoformat(f"{base}.{frac}{zone}")


def _time(value: Any) -> Any:
    return parse_time(value) if isinstance(value, str) else value  # anything else: not a datetime


Time = Annotated[datetime, BeforeValidator(_time)]
Status = Literal["firing", "resolved"]
Labels = dict[str, str]


def _named(labels: Labels) -> Labels:
    if not labels.get("alertname"):
        raise ValueError("has no alertname")
    return labels


@dataclass(frozen=True)
class Alert:
    """One element of a webhook's ``alerts``. The relay builds and copies these directly (cheaply, also from the
    spool); what arrives is checked by ALERT, the validator of the same fields (strict, unknown keys ignored)."""

    __pydantic_config__ = ConfigDict(extra="ignore", populate_by_name=True)

    status: Status
    labels: Annotated[Labels, AfterValidator(_named), Field(strict=True)]
    annotations: Annotated[Labels, Field(default_factory=dict, strict=True)]
    starts_at: Annotated[Time, Field(alias="startsAt", strict=True)]
    ends_at: Annotated[Time | None, Field(None, alias="endsAt", strict=True)]  # None: still firing (Go's zero time)
    generator_url: Annotated[str, Field(alias="generatorURL", strict=True)] = ""
    fingerprint: Annotated[str, Field(strict=True)] = ""

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


def _fmt_time(t: datetime) -> str:
    if t == ZERO_TIME:
        return "0001-01-01T00:00:00Z"
    # isoformat, not strftime: %Y writes year 5 as "5", which parse_time (four digits) would refuse
    return t.astimezone(timezone.utc).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def _clamp(t: datetime, where: str, repairs: list[Repair]) -> datetime:
    if EARLIEST <= t <= LATEST:
        return t
    bound = EARLIEST if t < EARLIEST else LATEST
    repairs.append(Repair("time_out_of_range", where, f"{t.isoformat()} cannot be shown in every time zone; "
                                                      f"clamped to {_fmt_time(bound)}"))
    return bound


def _mend(value: Any, where: str, repairs: list[Repair]) -> Any:
    """value with every lone surrogate of its strings (names too) replaced by U+FFFD."""
    if isinstance(value, str):
        if not _SURROGATE.search(value):
            return value
        repairs.append(Repair("bad_unicode", where or "(top)", "a lone surrogate (not encodable text) replaced "
                                                               "by U+FFFD"))
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = _mend(k, _child(where, "(a name)"), repairs)
            out[key] = _mend(v, _child(where, key[:40]), repairs)
        return out
    if isinstance(value, list):
        return [_mend(v, _child(where, str(i)), repairs) for i, v in enumerate(value)]
    return value


def _child(where: str, name: str) -> str:
    name = name if name.isprintable() else ascii(name)  # the path is logged: no newline or escape from a key
    return f"{where}.{name}" if where else name


def _may_hold_surrogates(body: bytes | str) -> bool:
    """False when the JSON text cannot decode to a lone surrogate: most bodies need no walk through them."""
    if isinstance(body, bytes):
        try:
            body = body.decode("utf-8")  # strict: no surrogate comes through but as a \udXXX escape
        except UnicodeDecodeError:  # UTF-16/32, or surrogates encoded raw: json.loads takes those too
            return True
    return bool(_SURROGATE_ESCAPE.search(body) or _SURROGATE.search(body))


class _Webhook(StrictModel):
    model_config = ConfigDict(extra="ignore")


ALERT: TypeAdapter[Alert] = TypeAdapter(Alert)


def _clamped(alert: Alert, where: str, repairs: list[Repair]) -> Alert:
    """The alert, its times clamped to what every zone can show (each clamp added to repairs)."""
    starts_at = _clamp(alert.starts_at, f"{where}.startsAt", repairs)
    ends_at = alert.ends_at
    ends_at = None if ends_at is None or ends_at <= ZERO_TIME else _clamp(ends_at, f"{where}.endsAt", repairs)
    return alert if (starts_at, ends_at) == (alert.starts_at, alert.ends_at) else \
        replace(alert, starts_at=starts_at, ends_at=ends_at)


def _alerts(alerts: list[Alert], info: ValidationInfo) -> tuple[Alert, ...]:
    repairs = (info.context or {}).get("repairs", [])
    return tuple(_clamped(a, f"alerts.{i}", repairs) for i, a in enumerate(alerts))


if TYPE_CHECKING:
    Alerts = tuple[Alert, ...]
else:  # as posted, each made an Alert
    Alerts = Annotated[list[Alert], Field(min_length=1), AfterValidator(_alerts)]


# Alerts one group may have left out: ten million, 100x one alert on every GPU of the largest fleet (~100k), so
# a real Alertmanager never comes near it. A larger count is no Alertmanager's: refused (10**30 was counted and
# printed as a 31-digit number).
MAX_TRUNCATED_ALERTS = 10**7


class WebhookPayload(_Webhook):
    """The body Alertmanager posts; ``alerts`` holds Alert dataclasses once validated."""

    version: Literal["4"]
    group_key: str = Field("", alias="groupKey")
    truncated_alerts: int = Field(0, ge=0, le=MAX_TRUNCATED_ALERTS, alias="truncatedAlerts")
    status: Status
    receiver: str
    group_labels: Labels = Field(default_factory=dict, alias="groupLabels")
    common_labels: Labels = Field(default_factory=dict, alias="commonLabels")
    common_annotations: Labels = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str = Field("", alias="externalURL")
    alerts: Alerts
    _repairs: list[Repair] = PrivateAttr(default_factory=list)

    @property
    def repairs(self) -> list[Repair]:
        """What parse_payload changed so that the alerts can be delivered (count and log them)."""
        return self._repairs


def _hint(err: ErrorDetails, path: KeyPath) -> str | None:
    if path == ("version",):
        return 'must be "4" (Alertmanager\'s webhook payload)'
    if err["type"] in ("model_type", "dict_type", "dataclass_type"):
        return f"must be an object, got {_kind(err['input'])}"
    return None


def _problems(e: ValidationError, origin: str) -> list[str]:
    """At most MAX_PROBLEMS short lines (a body's keys may be huge)."""
    errors = e.errors(include_url=False)
    out = [p[:MAX_PROBLEM_CHARS] for p in problem_lines(errors[:MAX_PROBLEMS], origin, {}, _hint)]
    return out + (["... (further problems not listed)"] if len(errors) > MAX_PROBLEMS else [])


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def parse_alert(where: str, raw: Any, problems: list[str], repairs: list[Repair] | None = None) -> Alert | None:
    """One element of ``alerts`` (or a spooled alert); problems are appended, None when it cannot be used.
    Values repaired as in a webhook are added to repairs."""
    repairs = [] if repairs is None else repairs
    try:
        return _clamped(ALERT.validate_python(_mend(raw, where, repairs)), where, repairs)
    except ValidationError as e:
        problems.extend(_problems(e, where))
        return None
    except RecursionError:  # nested too deeply for the walk that mends strings
        problems.append(f"{where}: nested too deeply to be an alert")
        return None


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
    repairs: list[Repair] = []
    try:
        if _may_hold_surrogates(body):
            doc = _mend(doc, "", repairs)
    except RecursionError:
        raise PayloadError(["the body is nested too deeply to be a webhook payload"], "too_deep") from None
    try:
        payload = WebhookPayload.model_validate(doc, context={"repairs": repairs})
    except ValidationError as e:
        raise PayloadError(_problems(e, "body")) from None
    payload._repairs = repairs
    return payload
