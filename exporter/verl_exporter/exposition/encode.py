"""Fast text exposition for series that are stable between scrapes (the training store's, the collectors').

client_python renders every sample through generic code on each scrape; with 8 GPUs (over a thousand
series) that alone made a scrape slower than node_exporter's. Series keys barely change between
scrapes, so the escaped ``name{labels} `` prefix of each series and each family's HELP/TYPE header are
cached; a scrape then only formats the values. The output is the same text format (0.0.4) or
OpenMetrics 1.0 that client_python writes, which the tests check with client_python's own parser and
``promtool check metrics``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..spec import MetricSpec

log = logging.getLogger(__name__)

_PREFIX_CACHE_LIMIT = 100_000
# What a label value must not carry: lone surrogates (UTF-8 cannot encode them: a JSON "\\ud800" escape, a
# name decoded from non-UTF-8 bytes with surrogateescape) and control characters (legal in the exposition, but
# they garble legends, alert texts and terminals). Both are written as Python's backslash escapes.
_UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape_char(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_label_value(value: str) -> tuple[str, str]:
    """(the value as it can be exported, why it was changed: "" when it was not, "not_utf8" or "control_char").

    Escapes lone surrogates as \\udcff and control characters as \\x1b, so the exposition always encodes.
    """
    if not _UNSAFE_TEXT.search(value):
        return value, ""
    reason = "not_utf8" if any("\ud800" <= c <= "\udfff" for c in value) else "control_char"
    return _UNSAFE_TEXT.sub(_escape_char, value), reason


def safe_text(value: str) -> str:
    """A label value or HELP text that the exposition can always encode (escaped as safe_label_value does)."""
    return _UNSAFE_TEXT.sub(_escape_char, value) if _UNSAFE_TEXT.search(value) else value


def _ranked(header: str | None) -> list[tuple[str, str]]:
    """(media type or coding, lowercased; the entry as sent) of an Accept* header, most preferred first.

    Entries with q=0 (or a q that is not a number) are left out: they say "never this".
    """
    ranked = []
    for i, entry in enumerate((header or "").split(",")):
        name, *params = entry.split(";")
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if name.strip() and q > 0:
            ranked.append((-q, i, name.strip().lower(), entry))
    return [(name, entry) for _, _, name, entry in sorted(ranked)]


def choose_format(accept: str | None) -> tuple[Callable[[Collector], bytes], str]:
    """(encoder, content type) from client_python for the scraper's most preferred format we serve."""
    for media, entry in _ranked(accept):
        if media in ("application/openmetrics-text", "text/plain"):
            return choose_encoder(entry)
    return choose_encoder("")


def gzip_wanted(accept_encoding: str | None) -> bool:
    """True when the client takes gzip: named with q > 0, or not named and "*" is taken."""
    taken = dict(_ranked(accept_encoding))
    named = {entry.split(";")[0].strip().lower() for entry in (accept_encoding or "").split(",")}
    return "gzip" in taken if "gzip" in named else "*" in taken


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str, openmetrics: bool) -> str:
    text = text.replace("\\", r"\\").replace("\n", r"\n")
    return text.replace('"', r"\"") if openmetrics else text


class TextRenderer:
    """Renders [(spec entry, {label values: value})] with cached HELP/TYPE headers and series prefixes.

    Label values and HELP texts are made safe (safe_text) when their prefix or header is cached, so whatever a
    source hands over, the text encodes; a family that still fails to render is left out on its own and
    reported to ``on_error(family name, error)``.
    """

    def __init__(self, const_labels: Mapping[str, str] | None = None,
                 on_error: Callable[[str, Exception], None] | None = None):
        self._const = {name: safe_text(str(value)) for name, value in (const_labels or {}).items()}
        self._on_error = on_error
        self._headers: dict[tuple[str, bool], str] = {}
        self._prefixes: dict[tuple[str, tuple[str, ...]], str] = {}

    def _header(self, metric: MetricSpec, name: str, openmetrics: bool) -> str:
        cached = self._headers.get((name, openmetrics))
        if cached is None:
            # OpenMetrics names a counter's family without the suffix
            family = name[: -len("_total")] if metric.type == "counter" and openmetrics else name
            cached = (f"# HELP {family} {safe_text(_escape_help(metric.help, openmetrics))}\n"
                      f"# TYPE {family} {metric.type}\n")
            self._headers[(name, openmetrics)] = cached
        return cached

    def _prefix(self, metric: MetricSpec, name: str, key: tuple[str, ...]) -> str:
        cached = self._prefixes.get((name, key))
        if cached is None:
            # Sorted by name, as client_python writes them.
            pairs = sorted([*zip(metric.labels, key, strict=True), *self._const.items()])
            labels = ",".join(f'{n}="{_escape_label(safe_text(v))}"' for n, v in pairs)
            cached = f"{name}{{{labels}}} " if labels else f"{name} "
            if len(self._prefixes) >= _PREFIX_CACHE_LIMIT:
                self._prefixes.clear()
            self._prefixes[(name, key)] = cached
        return cached

    def render(self, series: Iterable[tuple[MetricSpec, Mapping[tuple[str, ...], float]]],
               openmetrics: bool = False) -> str:
        out: list[str] = []
        for metric, rows in series:
            try:
                name = metric.name  # once per family: a spec model's attribute costs ~3x a local's
                family = [self._header(metric, name, openmetrics)]
                for key, value in sorted(rows.items()):
                    family.append(self._prefix(metric, name, key))
                    family.append(floatToGoString(value))
                    family.append("\n")
            except Exception as e:  # one bad family costs only itself
                if self._on_error is not None:
                    self._on_error(metric.name, e)
                else:
                    log.debug("family %s not rendered: %r", metric.name, e)
                continue
            out.extend(family)
        return "".join(out)
