"""``verl-exporter backtest RUN.jsonl [...]``: would the alert pack have caught this run's failure, and how noisy
is it on a healthy one? Each run is replayed with the replay engine (real follower, store and detectors on a
simulated clock; the step time from ``timing_s/step`` or ``--step-seconds``) and the rules are evaluated by
promtool; the alert timeline is printed and an HTML report with the key curves and the alerts is written.
"""

from __future__ import annotations

import html
import math
import sys
import tempfile
import time
from pathlib import Path

from . import replay as rp

# Curves drawn in the report: (title, verl keys tried in order).
CURVES = [
    ("Score (critic/score/mean)", ("critic/score/mean",)),
    ("Entropy (actor/entropy)", ("actor/entropy", "actor/entropy_loss")),
    ("Response length (mean tokens)", ("response_length/mean",)),
    ("Clipped responses (ratio)", ("response_length/clip_ratio",)),
    ("KL to the reference", ("actor/kl_loss", "actor/reward_kl_penalty", "critic/kl")),
    ("Gradient norm", ("actor/grad_norm",)),
    ("Throughput (tokens/s/GPU)", ("perf/throughput",)),
    ("Peak GPU memory reserved (GiB)", ("perf/max_memory_reserved_gb",)),
    ("Step time (s)", ("timing_s/step", "timing/step")),
]
COLOURS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


def _progress(label: str):
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] > 0.2:
            last[0] = now
            width = 30
            filled = int(width * done / max(total, 1))
            sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return show


def timeline(samples: rp.Samples, fired: list[rp.Firing]) -> list[dict]:
    out = []
    for f in sorted(fired, key=lambda f: (f.minute, f.severity != "critical", f.alert)):
        labels = dict(f.labels)
        out.append({"step": rp.step_at(samples, f.minute), "minute": f.minute, "alert": f.alert,
                    "severity": f.severity, "value": f.value, "signal": labels.get("signal", "")})
    return out


def _fmt_time(minute: int) -> str:
    return f"{minute // 60}:{minute % 60:02d}"


def _svg(title: str, xs: list[int], ys: list[float], marks: list[dict]) -> str:
    w, h, pad = 640, 160, 36
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
    if not pts:
        return ""
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(y for _, y in pts), max(y for _, y in pts)
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1

    def sx(x):
        return pad + (x - x0) / (x1 - x0) * (w - 2 * pad)

    def sy(y):
        return h - pad / 2 - (y - y0) / (y1 - y0) * (h - pad)

    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img">',
             f'<title>{html.escape(title)}</title>',
             f'<text x="{pad}" y="12" font-size="12">{html.escape(title)}</text>',
             f'<text x="2" y="{sy(y1) + 4:.0f}" font-size="9">{y1:.3g}</text>',
             f'<text x="2" y="{sy(y0):.0f}" font-size="9">{y0:.3g}</text>',
             f'<text x="{pad}" y="{h - 2}" font-size="9">step {x0}</text>',
             f'<text x="{w - pad - 40}" y="{h - 2}" font-size="9">step {x1}</text>',
             f'<polyline fill="none" stroke="#333" stroke-width="1.2" points="{path}"/>']
    for m in marks:
        if m["step"] is None:
            continue
        x = sx(m["step"])
        colour = COLOURS.get(m["severity"], "#888")
        lines.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="16" y2="{h - pad / 2}" stroke="{colour}" '
                     f'stroke-dasharray="3,2"><title>{html.escape(m["alert"])} at step {m["step"]}</title></line>')
    lines.append("</svg>")
    return "\n".join(lines)


def report_html(name: str, lines: list[dict], events: list[dict]) -> str:
    xs = [int(ln["step"]) for ln in lines]
    parts = [f"<!doctype html><meta charset='utf-8'><title>backtest {html.escape(name)}</title>",
             "<style>body{font-family:sans-serif;margin:1em}td,th{padding:2px 8px;text-align:left}</style>",
             f"<h1>verl-exporter backtest: {html.escape(name)}</h1>",
             f"<p>{len(lines)} steps; {len(events)} alert starts "
             f"({sum(e['severity'] == 'critical' for e in events)} critical). Dashed lines: alerts "
             "(<span style='color:#d62728'>critical</span>, <span style='color:#ff7f0e'>warning</span>).</p>"]
    for title, keys in CURVES:
        key = next((k for k in keys if any(k in ln["data"] for ln in lines)), None)
        if key is None:
            continue
        ys = [ln["data"].get(key) for ln in lines]
        ys = [float(y) if isinstance(y, (int, float)) and not isinstance(y, bool) else None for y in ys]
        parts.append(_svg(f"{title} [{key}]", xs, ys, events))
    parts.append("<h2>Alert timeline</h2><table><tr><th>step</th><th>time</th><th>alert</th><th>severity</th>"
                 "<th>signal</th><th>value</th></tr>")
    for e in events:
        parts.append(f"<tr><td>{e['step']}</td><td>{_fmt_time(e['minute'])}</td><td>{html.escape(e['alert'])}</td>"
                     f"<td>{e['severity']}</td><td>{html.escape(e['signal'])}</td><td>{e['value']:.4g}</td></tr>")
    parts.append("</table>")
    return "\n".join(parts) + "\n"


def _render_rules_into(spec, folder: str) -> str:
    from ..render.rules import render_rules

    for rel, text in render_rules(spec).items():
        (Path(folder) / Path(rel).name).write_text(text, encoding="utf-8")
    return folder


def effect(default_events: list[dict], events: list[dict]) -> str:
    """What the overrides changed on a run: alerts they silence, add, or move (first start of each)."""
    first = {}
    for e in events:
        first.setdefault(e["alert"], e["step"])
    base = {}
    for e in default_events:
        base.setdefault(e["alert"], e["step"])
    parts = []
    gone = [f"{a} (step {s})" for a, s in base.items() if a not in first]
    new = [f"{a} (step {s})" for a, s in first.items() if a not in base]
    moved = [f"{a} step {base[a]} -> {s}" for a, s in first.items() if a in base and base[a] != s]
    if gone:
        parts.append("silenced " + ", ".join(gone))
    if new:
        parts.append("added " + ", ".join(new))
    if moved:
        parts.append("moved " + ", ".join(moved))
    return "; ".join(parts) or "no change"


def run_backtest(paths: list[str], step_seconds: float | None = None, html_dir: str | None = ".",
                 rules_dir: str | None = None, out=print, progress: bool = True,
                 overrides: str | None = None, max_steps: int | None = rp.MAX_STEPS) -> int:
    """overrides: an overrides file (None: $VERL_EXPORTER_OVERRIDES or ./verl-exporter.yaml if present, '' for
    none); the runs are judged with it, and each run's line says what it changed against the defaults. A run
    longer than max_steps (0 or None: no limit) is judged on its last max_steps steps, with a warning."""
    from ..spec.overrides import OverridesError, load_with_overrides

    try:
        loaded = load_with_overrides(None, overrides, lambda used: out(f"with overrides {used}"))
    except OverridesError as e:
        out(f"verl-exporter backtest: {e}")
        return 2
    default, spec = loaded.declared, loaded.effective
    same_signals = spec.signals() == default.signals()
    with tempfile.TemporaryDirectory(prefix="verl-exporter-rules-") as tmp:
        compare = loaded.overrides is not None and rules_dir is None
        if rules_dir is None:  # the rules generated from the spec (and overrides)
            rules_dir = _render_rules_into(spec, tmp)
        default_rules = _render_rules_into(default, tempfile.mkdtemp(dir=tmp)) if compare else None
        status = 0
        for path in paths:
            try:
                lines, total = rp.read_run(path, max_steps=max_steps)
            except (OSError, rp.NotAVerlLog) as e:
                out(f"verl-exporter backtest: {e}")
                status = 2
                continue
            warning = rp.too_long(path, lines, total)
            if warning:
                print(f"verl-exporter backtest: warning: {warning}", file=sys.stderr)
            started = time.monotonic()
            samples = rp.replay(lines, spec, run=Path(path).stem, period_s=step_seconds,
                                progress=_progress(Path(path).name) if progress else None)
            fired = rp.evaluate(samples, rules_dir)
            took = time.monotonic() - started
            events = timeline(samples, fired)
            out(f"{path}: {len(lines)} steps over {samples.length / 60:.1f} h; {len(events)} alert starts, "
                f"{sum(e['severity'] == 'critical' for e in events)} critical ({len(lines) / took:.0f} steps/s)")
            out(f"  {'step':>6}  {'time':>6}  {'alert':<34} {'severity':<9} value")
            for e in events:
                sig = f" ({e['signal']})" if e["signal"] else ""
                out(f"  {e['step'] if e['step'] is not None else '-':>6}  {_fmt_time(e['minute']):>6}  "
                    f"{e['alert'] + sig:<34} {e['severity']:<9} {e['value']:.4g}")
            if default_rules is not None:
                base_samples = samples if same_signals else rp.replay(lines, default, run=Path(path).stem,
                                                                      period_s=step_seconds)
                base_events = timeline(base_samples, rp.evaluate(base_samples, default_rules))
                out(f"  overrides vs defaults: {effect(base_events, events)} "
                    f"(defaults: {len(base_events)} alert starts, "
                    f"{sum(e['severity'] == 'critical' for e in base_events)} critical)")
            if html_dir:
                target = Path(html_dir) / f"{Path(path).stem}.backtest.html"
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(report_html(Path(path).name, lines, events), encoding="utf-8")
                except OSError as e:
                    out(f"verl-exporter backtest: cannot write the report {target}: {e.strerror or e}")
                    status = 2
                    continue
                out(f"  report: {target}")
    return status
