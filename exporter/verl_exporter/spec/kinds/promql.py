"""PromQL text helpers the kinds build their expressions with (no spec, no rules: text in, text out)."""

from __future__ import annotations

import re

JOIN = "on (job, instance, run, rank)"  # how one sidecar's series of different metrics are matched
MATCHER_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def selector(*parts: str) -> str:
    """Join label matchers, skipping empty ones: selector('job="verl"', '') -> 'job="verl"'."""
    return ", ".join(p.strip() for p in parts if p and p.strip())


def vector(metric: str, *matchers: str) -> str:
    inner = selector(*matchers)
    return f"{metric}{{{inner}}}" if inner else metric


def matchers_text(labels: dict[str, str]) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in labels.items())


def fill(template: str, metric: str, sel: str) -> str:
    """Replace the spec's placeholders: <metric> and <sel> (a selector that may be empty)."""
    out = template.replace("<metric>", metric).replace("<sel>", sel)
    # An empty selector must not leave "{}", "{, x}" or "{x, }" behind.
    out = re.sub(r"\{\s*,\s*", "{", out)
    out = re.sub(r",\s*\}", "}", out)
    return out.replace("{}", "")


def num(x: float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x) if isinstance(x, float) else str(x)


def detector_gauge(stat: str, signal: str, sel: str) -> str:
    """The gauge a step-domain signal exports for one statistic (verl_exporter.core.detect)."""
    return vector(f"verl_detector_{stat}", sel, f'signal="{signal}"')


def selector_labels(sel: str) -> dict[str, str]:
    """Labels a test series needs for the selector to select it (job="verl" when it says nothing of job):
    an equality's value, the first alternative of a regex that matches it, "verl" where a negation allows.
    Raises ValueError for a selector no label value can be chosen for."""
    out: dict[str, str] = {"job": "verl"}
    for name, op, raw in MATCHER_RE.findall(sel):
        value = raw.encode().decode("unicode_escape")
        if op == "=":
            out[name] = value
        elif op == "=~":
            choices = ["verl", *value.split("|")]
            found = next((c for c in choices if _full(value, c)), None)
            if found is None:
                raise ValueError(f"no value of {name} could be chosen to match {name}=~{raw!r} in the generated "
                                 "tests; start the regex with a literal alternative")
            out[name] = found
        else:
            candidates = ["verl", "verl-exporter", "x"]
            ok = [c for c in candidates if (c != value if op == "!=" else not _full(value, c))]
            if not ok:
                raise ValueError(f"no value of {name} could be chosen for {name}{op}{raw!r}")
            out[name] = out[name] if name in out and out[name] in ok and name != "job" else ok[0]
    return out


def _full(pattern: str, text: str) -> bool:
    try:
        return re.fullmatch(pattern, text) is not None
    except re.error:
        return False


def keeps_label(expr: str, label: str) -> bool:
    """Whether an expression's result keeps a label of its input series: not when it is an aggregation
    `op by (...)` that does not list it (a heuristic enough for the spec's expr alerts)."""
    m = re.match(r"^\s*(?:sum|min|max|avg|count|quantile|stddev|stdvar|topk|bottomk|group)\s+by\s*\(([^)]*)\)",
                 expr)
    return m is None or label in [x.strip() for x in m.group(1).split(",")]
