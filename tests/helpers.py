"""Helpers shared by the tests and the benchmarks (bench/ puts tests/ on sys.path): plain functions that need
neither pytest nor a running server. The fake GPU node is in fake_pynvml.busy_node."""

from __future__ import annotations

import socket

RESULT_HEADER = ("measurement", "value", "baseline", "baseline value", "ratio", "goal", "verdict")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


def results_table(rows: list[tuple[str, ...]], header: tuple[str, ...] = RESULT_HEADER) -> str:
    """A benchmark's results as aligned text columns, header first."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def robot_target(kind: str, url: str, token: str, name: str = "t"):
    """A robot target as a relay config defines it, its token read from the environment it is given."""
    from verl_exporter.relay.config import parse_config

    doc = {"targets": {name: {"type": kind, "url": url, "token_env": "TOKEN"}}, "routes": [{"targets": [name]}]}
    return parse_config(doc, environ={"TOKEN": token}).targets[name]


def config_action(matchers: dict, action: str, url: str, token: str, cooldown_seconds: float = 1800.0):
    """A relay config's action, its token read from the environment."""
    from verl_exporter.relay.config import parse_config

    doc = {"targets": {"t": {"type": "console"}}, "routes": [{"targets": ["t"]}],
           "actions": [{"matchers": matchers, "action": action, "url": url, "token_env": "TOKEN",
                        "cooldown_seconds": cooldown_seconds}]}
    (out,) = parse_config(doc, environ={"TOKEN": token}).actions
    return out


def stop_action(url: str, token: str, cooldown_seconds: float = 1800.0):
    """A relay config's action that stops the run on VerlNumericalCollapse."""
    return config_action({"alertname": "VerlNumericalCollapse"}, "stop", url, token, cooldown_seconds)


def configure(ctx, **settings) -> None:
    """Change serve settings of a collectors Context in place: its collectors read ctx.config at each sample."""
    ctx.config = ctx.config.model_copy(update=settings)
