"""Pure formatting: alerts → robot messages (DingTalk markdown/text, WeCom markdown/text, Lark card/text).

Many alerts become one message: firing first (most severe first), then resolved. Every value that comes from
an alert (labels, annotations) is escaped so that an alert cannot inject markdown, links or @mentions; only
the relay itself adds mentions, and only for the people the target's config names. Those values come from
the metric data (ultimately a training log), so a runbook link is shown only when it points under one of the
target's ``runbook_urls``; any other is plain, defanged text. Messages respect the
robots' size limits in bytes: ``pack`` takes the longest run of alerts that fits one message (switching to
one line per alert when a full listing would not fit), and a single oversized alert is shortened, never cut
inside a UTF-8 character.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from functools import lru_cache
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from .config import Target
from .payload import Alert
from .summary import weight

Payload = dict[str, Any]  # a robot message's JSON body
Limits = dict[str, int]  # size limits by robot (and WeCom kind), in place of the robots' own (tests shrink them)
ViewCache = dict[tuple[int, int], "AlertView"]  # (id(alert), shrink): the alert's view

# Byte limits of the robot APIs: DingTalk counts the whole JSON body, WeCom the content string.
DINGTALK_MAX_BODY = 20000
WECOM_MAX_CONTENT = {"markdown": 4096, "text": 2048}
# Lark: a request body of at most 20 KB, 100 messages a minute and 5 a second per bot
# (https://open.feishu.cn/document/client-docs/bot-v3/add-custom-bot, "Usage limits"). 20,000 leaves the
# signature the sender adds (timestamp and sign, under 100 bytes) room inside 20 KB = 20,480.
LARK_MAX_BODY = 20000

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
DINGTALK_COLORS = {"critical": "#D93025", "warning": "#E37400", "info": "#1A73E8", "resolved": "#188038",
                   "": "#5F6368"}
# WeCom markdown knows three colours: warning (orange-red), info (green), comment (grey).
WECOM_COLORS = {"critical": "warning", "warning": "warning", "info": "comment", "resolved": "info",
                "": "comment"}
# Lark card markdown takes colour names in <font color>; the card header's `template` takes the same names.
LARK_COLORS = {"critical": "red", "warning": "orange", "info": "blue", "resolved": "green", "": "grey"}

# Characters that start markdown constructs (links, emphasis, headings, quotes, code, tables, HTML tags such
# as WeCom's <@userid> mention) are replaced by look-alikes that render as themselves.
_LOOKALIKES = str.maketrans({
    "[": "［", "]": "］", "(": "（", ")": "）", "*": "∗", "#": "＃", "<": "‹", ">": "›", "`": "ˋ",
    "|": "｜", "~": "∼", "\\": "＼", "&": "＆", "@": "＠", "!": "ǃ", "$": "＄",
})
# _ only emphasises at a word edge (node_1 stays as it is, _x_ does not).
_EDGE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
# Bare URLs are auto-linked by the robots' clients; a full-width colon keeps them readable but dead.
# (This and _DOTTED only start where a token starts, the look-behinds: a long value costs linear time.)
_SCHEME = re.compile(r"(?i)(?<![a-z0-9+.-])([a-z][a-z0-9+.-]*):(?=//)")
# So are bare host names (www.evil.example/login): a run of dotted labels whose last one could be a top-level
# domain (letters, or punycode), or an IPv4 address before a path. Their dots become middle dots, which no
# IDN mapping turns back into dots (unlike U+2024, U+FF0E or U+3002).
_DOTTED = re.compile(r"(?<![\w-])[\w-]+(?:\.[\w-]+)+")
_IPV4_PATH = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?=(?::\d+)?/)")
# Control characters (but newline and tab); format characters (Unicode's Cf: bidi marks such as U+061C and
# U+202E, zero-width ones) that can disguise text are dropped too, and lone surrogates (Cs: not encodable).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_HIDDEN = ("Cf", "Cs")
# A line of only - or = underlines the line above as a heading (setext) or is a rule.
_RULE_LINE = re.compile(r"[-=\s]+")
_RULE_LOOKALIKES = str.maketrans({"-": "‐", "=": "＝"})

# Field caps, so that one verbose alert cannot crowd out the others (the full text stays in Alertmanager).
SUMMARY_CHARS = 300
DESCRIPTION_CHARS = 800
VALUE_CHARS = 120
WHERE_LABELS = ("run", "rank", "instance")


class TemplateError(ValueError):
    pass


def escape(text: str, multiline: bool = False) -> str:
    """Neutralise alert-controlled text for any robot message kind (markdown or text)."""
    text = _CONTROL.sub("", text)
    if not text.isascii():
        text = "".join(c for c in text if unicodedata.category(c) not in _HIDDEN)
    lines = text.splitlines() if multiline else [text]
    lines = [" ".join(line.split()) for line in lines if line.strip()]
    text = "\n".join(ln.translate(_RULE_LOOKALIKES) if _RULE_LINE.fullmatch(ln) else ln for ln in lines)
    text = text.translate(_LOOKALIKES)
    text = _EDGE_UNDERSCORE.sub("＿", text)
    text = _SCHEME.sub(r"\1：", text)
    if "." in text:
        text = _DOTTED.sub(_defang_host, text)
        text = _IPV4_PATH.sub(lambda m: m.group().replace(".", "·"), text)
    return text


def _no_scheme(text: str) -> str:
    """A URL as text that no client links: javascript:x and mailto:x have no // for _SCHEME to find."""
    return text.replace(":", "：")


def _defang_host(m: re.Match[str]) -> str:
    last = m.group().rsplit(".", 1)[1]
    if (len(last) >= 2 and last.isalpha()) or last.lower().startswith("xn--"):
        return str(m.group()).replace(".", "·")
    return str(m.group())


def clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: max(chars - 1, 0)].rstrip() + "…"


def cut_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of text that is at most max_bytes in UTF-8 (never half a character)."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    return raw[:max(max_bytes, 0)].decode("utf-8", "ignore")


def allowed_url(url: str, prefixes: Sequence[str]) -> bool:
    """Whether url is under one of prefixes: the same scheme, host and port, and a path at or below the
    prefix's (no user part, no dot segments that a browser would resolve to somewhere else)."""
    try:
        parts = urlsplit(url.strip())
        if parts.username is not None or parts.password is not None:
            return False
        segments = unquote(parts.path).replace("\\", "/").split("/")
        if "." in segments or ".." in segments:
            return False
        for prefix in prefixes:
            base = urlsplit(prefix)
            path = base.path.rstrip("/")
            if (parts.scheme.lower(), parts.hostname, parts.port) == (base.scheme.lower(), base.hostname, base.port) \
                    and (parts.path == path or parts.path.startswith(path + "/")):
                return True
    except ValueError:  # an unparsable URL or port
        return False
    return False


def safe_url(url: str) -> str:
    """An http(s) URL made safe to put inside a markdown link, or "" when it is not one."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return ""
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return ""
    # Percent-encode whatever could close the link or start markup; keep the URL's own structure.
    return quote(url.strip(), safe="/:?&=%#+,;.-_~")


@dataclass(frozen=True)
class AlertView:
    """What a template sees of one alert: escaped, clipped, with its colour and formatted times."""

    status: str
    name: str
    severity: str
    color: str
    where: str
    summary: str
    description: str
    starts_at: str
    ends_at: str
    duration: str
    runbook_url: str  # "" unless it is under one of the target's runbook_urls
    runbook_text: str  # a runbook_url that is not: escaped and defanged, never a link
    source_url: str
    labels: dict[str, str]


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m" if minutes else f"{secs}s"


def _when(t: datetime | None, tz: tzinfo) -> str:
    return t.astimezone(tz).strftime("%Y-%m-%d %H:%M:%S %Z") if t is not None else ""


def view(alert: Alert, target_type: str, tz: tzinfo, description_chars: int = DESCRIPTION_CHARS,
         summary_chars: int = SUMMARY_CHARS, value_chars: int = VALUE_CHARS,
         runbooks: Sequence[str] = ()) -> AlertView:
    colors = {"wecom": WECOM_COLORS, "lark": LARK_COLORS}.get(target_type, DINGTALK_COLORS)
    color = colors["resolved"] if alert.status == "resolved" else colors.get(alert.severity, colors[""])
    where = " · ".join(f"{k} {clip(escape(alert.labels[k]), value_chars)}" for k in WHERE_LABELS
                       if alert.labels.get(k))
    ann = alert.annotations
    duration = ""
    if alert.status == "resolved" and alert.ends_at is not None:
        duration = _duration((alert.ends_at - alert.starts_at).total_seconds())
    runbook = ann.get("runbook_url", "")
    runbook_url = safe_url(runbook) if allowed_url(runbook, runbooks) else ""
    return AlertView(
        status=alert.status, name=clip(escape(alert.name), value_chars) or "(unnamed)",
        severity=clip(escape(alert.severity), 20), color=color, where=where,
        summary=clip(escape(ann.get("summary", "")), summary_chars),
        description=clip(escape(ann.get("description", ""), multiline=True), description_chars),
        starts_at=_when(alert.starts_at, tz), ends_at=_when(alert.ends_at, tz), duration=duration,
        runbook_url=runbook_url,
        runbook_text="" if runbook_url or not summary_chars else clip(_no_scheme(escape(runbook)), summary_chars),
        source_url=safe_url(alert.generator_url),
        labels={escape(k): clip(escape(v), value_chars) for k, v in sorted(alert.labels.items())},
    )


def order(alerts: Sequence[Alert]) -> list[Alert]:
    """Firing before resolved; most severe first; oldest first."""
    return sorted(alerts, key=lambda a: (a.status != "firing", SEVERITY_ORDER.get(a.severity, 3),
                                         a.starts_at, a.name))


def worst_severity(alerts: Sequence[Alert]) -> str | None:
    """The most severe severity among the firing alerts; None when none fires."""
    firing = [a.severity for a in alerts if a.status == "firing"]
    return min(firing, key=lambda s: SEVERITY_ORDER.get(s, 3)) if firing else None


def title(alerts: Sequence[Alert]) -> str:
    firing = [a for a in alerts if a.status == "firing"]
    resolved = sum(map(weight, alerts)) - sum(map(weight, firing))  # a summary counts the alerts it stands for
    parts = []
    if firing:
        top = worst_severity(firing)
        parts.append(f"FIRING {sum(map(weight, firing))}" + (f" {escape(top)}" if top else ""))
    if resolved:
        parts.append(f"RESOLVED {resolved}")
    names: list[str] = []
    for a in order(alerts):
        if a.name not in names:
            names.append(a.name)
    shown = ", ".join(clip(escape(n), 60) for n in names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")
    return f"[verl] {' · '.join(parts)}: {shown}"


# Default templates. Block tags sit on lines of their own (trim_blocks drops those lines); a line that must
# end in something optional uses an inline `if` expression, so its newline survives.
DEFAULT_MARKDOWN = """\
#### {{ title }}
{% for a in alerts %}
{% set state = "RESOLVED" if a.status == "resolved" else "FIRING" %}
{% if compact %}
- <font color="{{ a.color }}">{{ "RESOLVED" if a.status == "resolved" else a.severity | upper }}</font> \
**{{ a.name }}**{{ " · " ~ a.where if a.where }}{{ " · " ~ a.summary if a.summary }}\
{{ " · [runbook](" ~ a.runbook_url ~ ")" if a.runbook_url }}
{% else %}

<font color="{{ a.color }}">**{{ state }} · {{ a.severity | upper }} · {{ a.name }}**</font>
{% if a.where %}
{{ a.where }}
{% endif %}
{% if a.summary %}
**{{ a.summary }}**
{% endif %}
{% if a.description %}
{{ a.description }}
{% endif %}
{{ a.starts_at ~ " → " ~ a.ends_at ~ " (" ~ a.duration ~ ")" if a.status == "resolved" else "Since " ~ a.starts_at }}\
{{ " · [Runbook](" ~ a.runbook_url ~ ")" if a.runbook_url }}
{% if a.runbook_text %}
Runbook (not a configured address, not linked): {{ a.runbook_text }}
{% endif %}
{% endif %}
{% endfor %}
"""

DEFAULT_TEXT = """\
{{ title }}
{% for a in alerts %}
{% if compact %}
- {{ "RESOLVED" if a.status == "resolved" else a.severity | upper }} {{ a.name }}\
{{ " · " ~ a.where if a.where }}{{ " · " ~ a.summary if a.summary }}
{% else %}

{{ "RESOLVED" if a.status == "resolved" else "FIRING" }} · {{ a.severity | upper }} · {{ a.name }}
{% if a.where %}
{{ a.where }}
{% endif %}
{% if a.summary %}
{{ a.summary }}
{% endif %}
{% if a.description %}
{{ a.description }}
{% endif %}
{{ a.starts_at ~ " → " ~ a.ends_at ~ " (" ~ a.duration ~ ")" if a.status == "resolved" else "Since " ~ a.starts_at }}
{% if a.runbook_url %}
Runbook: {{ a.runbook_url }}
{% elif a.runbook_text %}
Runbook (not a configured address, not linked): {{ a.runbook_text }}
{% endif %}
{% endif %}
{% endfor %}
"""

_ENV = SandboxedEnvironment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                            autoescape=False)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def _sample_alerts() -> list[Alert]:
    t = datetime(2026, 1, 1, tzinfo=timezone.utc)
    labels = {"alertname": "VerlExample", "severity": "critical", "run": "r", "rank": "0", "instance": "h:1"}
    ann = {"summary": "s", "description": "d", "runbook_url": "https://example.invalid/runbook#x"}
    return [Alert("firing", labels, ann, t, None, "", "a"), Alert("resolved", labels, ann, t, t, "", "b")]


def unrenderable(alert: Alert, tz: tzinfo) -> str | None:
    """Why an alert cannot be shown, nor kept in the journal (None: it can); what the webhook checks before it
    accepts one. Escaping cannot fail on text that encodes, so the times in the zone and the encoding of
    every value are what can (a full render would cost ten times more on every webhook)."""
    try:
        for t in (alert.starts_at, alert.ends_at):
            _when(t, tz)
        encode(alert.to_dict())
    except (ArithmeticError, ValueError, TypeError) as e:  # OverflowError, UnicodeEncodeError among them
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def check_template(source: str) -> None:
    """Compile a user template and render it once per mode with sample alerts; TemplateError otherwise."""
    try:
        template = _compile(source)
        for compact in (False, True):
            template.render(**_context(_sample_alerts(), "dingtalk", timezone.utc, compact))
    except jinja2.TemplateError as e:
        lineno = getattr(e, "lineno", None)  # a syntax error's; not every TemplateError has one
        where = f" (line {lineno})" if lineno else ""
        raise TemplateError(f"template does not render{where}: {e.message or e}") from None


def _context(alerts: Sequence[Alert], target_type: str, tz: tzinfo, compact: bool,
             shrink: int = 0, cache: ViewCache | None = None, runbooks: Sequence[str] = ()) -> dict[str, Any]:
    # shrink > 0 shortens free text, for the one alert that is too big for a message on its own.
    caps = [(DESCRIPTION_CHARS, SUMMARY_CHARS, VALUE_CHARS), (200, 200, 80), (0, 80, 40), (0, 0, 20)][shrink]
    cache = {} if cache is None else cache  # pack renders the same alerts many times: escape them once
    views = []
    for a in order(alerts):
        key = (id(a), shrink)
        if key not in cache:
            cache[key] = view(a, target_type, tz, *caps, runbooks=runbooks)
        views.append(cache[key])
    return {"title": title(alerts), "alerts": views, "firing": [v for v in views if v.status == "firing"],
            "resolved": [v for v in views if v.status == "resolved"], "compact": compact,
            "target_type": target_type}


@dataclass(frozen=True)
class Mentions:
    mobiles: tuple[str, ...] = ()
    userids: tuple[str, ...] = ()
    all: bool = False

    def __bool__(self) -> bool:
        return bool(self.mobiles or self.userids or self.all)


def mentions_for(alerts: Sequence[Alert], target: Target) -> Mentions:
    """Mentions ring people: only for firing alerts of the configured severities, never for resolutions."""
    severities = {a.severity for a in alerts if a.status == "firing"}
    named = bool(severities & set(target.mention_severities))
    return Mentions(mobiles=target.mention_mobiles if named else (),
                    userids=target.mention_userids if named else (),
                    all=bool(severities & set(target.mention_all_severities)))


@dataclass(frozen=True)
class Message:
    """One robot message, ready to post: ``body`` is exactly the bytes that will be sent."""

    target_type: str
    kind: str  # markdown | text
    payload: Payload
    body: bytes
    alerts: int  # how many alerts it lists

    @property
    def text(self) -> str:
        return message_text(self.payload)


def message_text(payload: Payload) -> str:
    """The text a robot payload shows (a Lark card's markdown element)."""
    if "msg_type" in payload:  # Lark
        if payload["msg_type"] == "interactive":
            return "\n".join(e.get("content", "") for e in payload["card"]["elements"])
        text: str = payload["content"]["text"]
        return text
    inner = payload[payload["msgtype"]]
    text = inner.get("text", inner.get("content", ""))
    return text


def kind_for(target: Target, mentions: Mentions) -> str:
    # On WeCom, markdown can mention user ids (<@id>) but not mobiles or @all: those need a text message.
    if target.type == "wecom" and target.format == "markdown" and (mentions.mobiles or mentions.all):
        return "text"
    return target.format


def _dingtalk_lines(text: str) -> str:
    # DingTalk's markdown joins single newlines into one paragraph; a blank line between lines keeps them apart.
    return "\n\n".join(line for line in text.splitlines() if line.strip())


def _plain_lines(text: str) -> str:
    """Blank lines collapsed to one (they separate alerts); none at either end."""
    return re.sub(r"\n\s*\n+", "\n\n", text.strip())


def _lark(kind: str, text: str, head: str, mentions: Mentions, severity: str) -> Payload:
    if kind == "markdown":  # an interactive card: the title in a header coloured by severity, then the listing
        text = _plain_lines(text.removeprefix(f"#### {head}"))
        ring = " ".join([f"<at id={u}></at>" for u in mentions.userids] + (["<at id=all></at>"] if mentions.all
                                                                           else []))
        return {"msg_type": "interactive", "card": {
            "config": {"wide_screen_mode": True},
            "header": {"title": {"tag": "plain_text", "content": head}, "template": LARK_COLORS[severity]},
            "elements": [{"tag": "markdown", "content": text + (f"\n{ring}" if ring else "")}]}}
    ring = " ".join([f'<at user_id="{u}"></at>' for u in mentions.userids]
                    + (['<at user_id="all"></at>'] if mentions.all else []))
    return {"msg_type": "text", "content": {"text": _plain_lines(text) + (f"\n{ring}" if ring else "")}}


def _headline(alerts: Sequence[Alert]) -> str:
    """The colour key of a message: its most severe firing alert, or resolved when none fires."""
    worst = worst_severity(alerts)
    return "resolved" if worst is None else worst if worst in LARK_COLORS else ""


def _assemble(target: Target, kind: str, text: str, head: str, mentions: Mentions,
              severity: str = "") -> Payload:
    if target.type == "lark":
        return _lark(kind, text, head, mentions, severity)
    if target.type == "dingtalk":
        at = {"atMobiles": list(mentions.mobiles), "isAtAll": mentions.all}
        ring = " ".join(f"@{m}" for m in mentions.mobiles)
        if kind == "markdown":
            text = _dingtalk_lines(text + (f"\n{ring}" if ring else ""))
            return {"msgtype": "markdown", "markdown": {"title": head, "text": text}, "at": at}
        return {"msgtype": "text", "text": {"content": _plain_lines(text) + (f"\n{ring}" if ring else "")},
                "at": at}
    if kind == "markdown":
        ring = " ".join(f"<@{u}>" for u in mentions.userids)
        return {"msgtype": "markdown", "markdown": {"content": _plain_lines(text) + (f"\n{ring}" if ring else "")}}
    inner: dict[str, Any] = {"content": _plain_lines(text)}
    users = list(mentions.userids) + (["@all"] if mentions.all else [])
    if users:
        inner["mentioned_list"] = users
    if mentions.mobiles:
        inner["mentioned_mobile_list"] = list(mentions.mobiles)
    return {"msgtype": "text", "text": inner}


def encode(payload: Payload) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def fits(target_type: str, kind: str, payload: Payload, body: bytes, limits: Limits | None = None) -> bool:
    if target_type == "dingtalk":
        return len(body) <= (limits or {}).get("dingtalk", DINGTALK_MAX_BODY)
    if target_type == "lark":
        return len(body) <= (limits or {}).get("lark", LARK_MAX_BODY)
    content = payload[payload["msgtype"]]["content"]
    return len(content.encode("utf-8")) <= (limits or {}).get(f"wecom_{kind}", WECOM_MAX_CONTENT[kind])


def render_message(alerts: Sequence[Alert], target: Target, tz: tzinfo | None = None, compact: bool = False,
                   shrink: int = 0, max_text_bytes: int | None = None, cache: ViewCache | None = None) -> Message:
    """One message listing these alerts (no size check; see pack for that).

    max_text_bytes cuts the rendered listing (not the mentions) at a character bound.
    """
    tz = tz or timezone.utc
    mentions = mentions_for(alerts, target)
    kind = kind_for(target, mentions)
    if kind == target.format and target.template:
        source = target.template
    elif kind == "text" and target.text_template:
        source = target.text_template
    else:
        source = DEFAULT_MARKDOWN if kind == "markdown" else DEFAULT_TEXT
    ctx = _context(alerts, target.type, tz, compact, shrink, cache, target.runbook_urls)
    text = _compile(source).render(**ctx)
    if max_text_bytes is not None and len(text.encode("utf-8")) > max_text_bytes:
        text = cut_utf8(text, max_text_bytes - 3) + "…"
    payload = _assemble(target, kind, text, ctx["title"], mentions, _headline(alerts))
    return Message(target.type, kind, payload, encode(payload), alerts=len(alerts))


def _fits(msg: Message, limits: Limits | None) -> bool:
    return fits(msg.target_type, msg.kind, msg.payload, msg.body, limits)


def _force_fit(alerts: Sequence[Alert], target: Target, tz: tzinfo | None, limits: Limits | None) -> Message:
    """Last resort (one huge alert, or a verbose user template): cut the listing until the message fits."""
    budget = DINGTALK_MAX_BODY
    while True:
        msg = render_message(alerts, target, tz, shrink=3, max_text_bytes=budget)
        if _fits(msg, limits) or budget <= 0:
            return msg
        budget = budget * 7 // 8 - 16


def _longest_fit(count: int, render: Callable[[int], Message], limits: Limits | None) -> tuple[int, Message | None]:
    """The largest n <= count whose render(n) fits, and that message (0, None when not even 1 does).

    Galloping then bisecting: the cost follows the size of the answer, not of the queue behind it.
    """
    lo, best, n = 0, None, 1
    while n <= count:
        msg = render(n)
        if not _fits(msg, limits):
            break
        lo, best = n, msg
        if n == count:
            return lo, best
        n = min(n * 2, count)
    hi = min(n, count + 1)  # render(hi) does not fit (or hi == count + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        msg = render(mid)
        if _fits(msg, limits):
            lo, best = mid, msg
        else:
            hi = mid
    return lo, best


def pack(alerts: Sequence[Alert], target: Target, tz: tzinfo | None = None,
         limits: Limits | None = None) -> tuple[Message, int]:
    """The message for the longest prefix of alerts that fits one robot message, and that prefix's length.

    All of them in full when they fit; otherwise one line per alert, as many as fit. A first alert that does
    not fit even alone is shortened. alerts must not be empty.
    """
    if not alerts:
        raise ValueError("pack needs at least one alert")
    cache: ViewCache = {}  # alerts stay alive for the whole call, so their ids are stable keys
    n, full = _longest_fit(len(alerts), lambda k: render_message(alerts[:k], target, tz, cache=cache), limits)
    if n == len(alerts) and full is not None:
        return full, n
    n, compact = _longest_fit(
        len(alerts), lambda k: render_message(alerts[:k], target, tz, compact=True, cache=cache), limits)
    if compact is not None and n > 1:
        return compact, n
    for shrink in range(4):  # one alert: full text shortened step by step, then cut at a byte bound
        msg = render_message(alerts[:1], target, tz, shrink=shrink)
        if _fits(msg, limits):
            return msg, 1
    return _force_fit(alerts[:1], target, tz, limits), 1


def format_messages(alerts: Sequence[Alert], target: Target, tz: tzinfo | None = None,
                    limits: Limits | None = None) -> list[Message]:
    """Every alert in as few messages as the limits allow (firing first): what --preview shows."""
    rest = order(alerts)
    out: list[Message] = []
    while rest:
        msg, used = pack(rest, target, tz, limits)
        out.append(msg)
        rest = rest[used:]
    return out
