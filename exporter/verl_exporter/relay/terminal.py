"""A robot message as its group chat would show it, rendered for a terminal.

The input is the exact payload the relay posts (DingTalk or WeCom, markdown or text); the output is what a
person sees in the chat: headings and **bold** as bold, ``<font color>`` as a terminal colour, links as
their text with the address after it, mentions as @names. Nothing is re-escaped or re-wrapped in meaning:
look-alike characters that the formatter put in alert text stay as they are, as they do in the chat.
With ``color=False`` the same lines come without escape codes (logs, files, tests, transcripts).
"""

from __future__ import annotations

import re
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
BOLD, UNDERLINE, RESET = "1", "4", "0"
# Terminal colours for the robots' colours: DingTalk takes any #rrggbb, WeCom three names.
NAMED = {"warning": "31", "info": "32", "comment": "90",  # WeCom
         "red": "31", "orange": "33", "blue": "34", "green": "32", "grey": "90"}  # Lark
BASIC = {"31": (0xD9, 0x30, 0x25), "33": (0xE3, 0x74, 0x00), "32": (0x18, 0x80, 0x38), "34": (0x1A, 0x73, 0xE8),
         "90": (0x5F, 0x63, 0x68), "35": (0xA1, 0x42, 0xF4), "36": (0x12, 0xB5, 0xCB)}
ROBOT_NAMES = {"dingtalk": "DingTalk", "wecom": "WeCom", "lark": "Lark"}

_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*)$")
_FONT = re.compile(r"<font\s+color\s*=\s*[\"']?([#\w]+)[\"']?\s*>(.*?)</font>", re.S | re.I)
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s]*)\)")
_WECOM_MENTION = re.compile(r"<@([^>\s]+)>")
_LARK_MENTION = re.compile(r"<at (?:id|user_id)=\"?([^>\s\"]+)\"?></at>")


def color_code(color: str) -> str | None:
    """The nearest basic terminal colour to a robot colour (#rrggbb or WeCom's name); None when unknown."""
    color = color.strip().lower()
    if color in NAMED:
        return NAMED[color]
    m = re.fullmatch(r"#?([0-9a-f]{6})", color)
    if not m:
        return None
    rgb = tuple(int(m.group(1)[i:i + 2], 16) for i in (0, 2, 4))
    return min(BASIC, key=lambda code: sum((a - b) ** 2 for a, b in zip(BASIC[code], rgb, strict=True)))


class _Style:
    def __init__(self, color: bool):
        self.color = color

    def __call__(self, text: str, *codes: str | None) -> str:
        given = [c for c in codes if c]
        if not self.color or not given or not text:
            return text
        return f"\x1b[{';'.join(given)}m{text}\x1b[{RESET}m"


def visible_len(text: str) -> int:
    return len(_ANSI.sub("", text))


def wrap(line: str, width: int) -> list[str]:
    """Word-wrap one line to `width` visible characters; escape codes are carried over the breaks. A word
    longer than the line (a URL) gets a line of its own, uncut, so that terminals still see the whole link."""
    if width <= 0 or visible_len(line) <= width:
        return [line]
    out: list[str] = []
    current, length, active = "", 0, ""
    for word in re.split(r"(\s+)", line):
        size = visible_len(word)
        if length + size > width and current.strip():
            out.append(current.rstrip() + ("\x1b[0m" if active else ""))
            current, length = active, 0
            if word.isspace():
                continue
        current += word
        length += size
        active = _active(active, word)
    if current.strip():
        out.append(current.rstrip())
    return out


def _active(active: str, text: str) -> str:
    """The escape codes in force after `text`, given those in force before it."""
    for code in _ANSI.findall(text):
        active = "" if code == "\x1b[0m" else active + code
    return active


def _inline(text: str, style: _Style, robot: str) -> str:
    text = _LINK.sub(lambda m: f"{style(m.group(1), UNDERLINE)} ({m.group(2)})" if m.group(2) else m.group(1), text)
    text = _FONT.sub(lambda m: style(m.group(2), color_code(m.group(1))), text)
    text = _BOLD.sub(lambda m: style(m.group(1), BOLD), text)
    if robot == "wecom":
        text = _WECOM_MENTION.sub(lambda m: style("@" + m.group(1), BOLD), text)
    return text


def markdown_lines(text: str, style: _Style, robot: str) -> list[str]:
    """The lines a chat shows for the robots' markdown subset (headings, bold, font colours, links, lists)."""
    out: list[str] = []
    for raw in text.splitlines():
        if not raw.strip():
            # DingTalk puts a blank line between paragraphs; a chat shows them as consecutive lines
            if robot == "wecom" and out and out[-1] != "":
                out.append("")
            continue
        m = _HEADING.match(raw)
        if m:
            out.append(style(_inline(m.group(1), _Style(False), robot), BOLD))
            continue
        line = raw.rstrip()
        if line.lstrip().startswith("> "):
            line = "│ " + line.lstrip()[2:]
        elif line.lstrip().startswith(("- ", "* ")):
            line = "• " + line.lstrip()[2:]
        out.append(_inline(line, style, robot))
    while out and out[-1] == "":
        out.pop()
    return out


def message_lines(payload: dict[str, Any], robot: str, color: bool = False) -> tuple[str, list[str]]:
    """(a one-line description of the message, the lines a chat shows) for a robot payload."""
    style = _Style(color)
    if "msg_type" in payload:
        return _lark_lines(payload, style)
    kind = payload.get("msgtype", "")
    inner = payload.get(kind) or {}
    name = ROBOT_NAMES.get(robot, robot)
    if kind == "markdown":
        text = inner.get("text", inner.get("content", ""))
        lines = markdown_lines(text, style, robot)
        head = f"{name} robot · markdown"
        if robot == "dingtalk" and inner.get("title"):
            head += f" · notification: {inner['title']}"
    else:
        lines = [ln.rstrip() for ln in str(inner.get("content", "")).splitlines()]
        head = f"{name} robot · text"
    at = payload.get("at") or {}
    rings = [f"@{m}" for m in inner.get("mentioned_mobile_list", [])]
    rings += [u if u.startswith("@") else f"@{u}" for u in inner.get("mentioned_list", [])]  # "@all" as is
    if at.get("isAtAll"):
        rings.append("@all")
    rings += [f"@{m}" for m in at.get("atMobiles", []) if f"@{m}" not in " ".join(lines)]
    if rings:
        lines.append(style("rings " + " ".join(rings), BOLD))
    return head, lines


def _lark_lines(payload: dict[str, Any], style: _Style) -> tuple[str, list[str]]:
    from .format import message_text

    rings = ["@" + m for m in _LARK_MENTION.findall(message_text(payload))]
    text = _LARK_MENTION.sub("", message_text(payload))
    if payload["msg_type"] == "interactive":
        header = payload["card"]["header"]
        head = f"Lark robot · card ({header['template']}) · {header['title']['content']}"
        lines = markdown_lines(text, style, "lark")
    else:
        head, lines = "Lark robot · text", [ln.rstrip() for ln in text.strip().splitlines()]
    if rings:
        lines.append(style("rings " + " ".join(rings), BOLD))
    return head, lines


def render(payload: dict[str, Any], robot: str, color: bool = False, width: int = 100) -> str:
    """The message framed for a terminal: a header line, then the chat's lines behind a bar."""
    head, lines = message_lines(payload, robot, color)
    bar = _Style(color)("│", "90")
    body = [f"{bar} {part}" if part else bar for line in lines for part in (wrap(line, width - 2) if line else [""])]
    top = [("╭─ " if i == 0 else "   ") + part for i, part in enumerate(wrap(head, width - 3))]
    return "\n".join([_Style(color)(top[0][:3], "90") + top[0][3:], *top[1:], *body, _Style(color)("╰─", "90")])
