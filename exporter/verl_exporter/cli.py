"""Command line: argparse only; each subcommand hands over to the module that does the work."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from . import __version__
from .core.argtypes import bounded_float, whole_number
from .core.shutdown import GRACE_S, exit_on_signal, stop_event


def _serve_flags(p: argparse.ArgumentParser) -> None:
    from .sidecar.config import add_flags

    p.add_argument("--config", metavar="FILE", help="YAML file with any of the settings below (flags win)")
    add_flags(p)  # one flag per setting of ServeConfig, declared there


def _overrides_flag(p: argparse.ArgumentParser) -> None:
    from .sidecar.config import ServeConfig

    p.add_argument("--overrides", metavar="FILE", help=ServeConfig.model_fields["overrides"].description)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-exporter", description="Prometheus metrics, alerts and dashboards for verl training runs.")
    parser.add_argument("--version", action="version", version=f"verl-exporter {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the per-rank sidecar (/metrics, /healthz)")
    _serve_flags(serve)

    spec = sub.add_parser("spec", help="print the resolved metric spec (validates it)")
    spec.add_argument("--spec", metavar="PATH", help="a spec (file or directory) to check instead of the packaged one")
    spec.add_argument("--json", action="store_true", help="machine-readable output")
    _overrides_flag(spec)
    spec.add_argument("--knobs", action="store_true",
                      help="list every knob (default, effective value, where it came from) instead of the metrics; "
                           "implied by --overrides")
    spec.add_argument("--changed", action="store_true", help="with --knobs: only the knobs the overrides change")
    spec.add_argument("--breaker", action="store_true",
                      help="list the critical alerts: which the in-process circuit breaker judges, and why not the "
                           "others (with --overrides: of the effective spec)")

    gen = sub.add_parser("generate", help="render rules, tests, dashboards, Alertmanager and Kubernetes files")
    gen.add_argument("--out", default=".", metavar="DIR", help="repository root to write into (default .)")
    gen.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every stale file")
    gen.add_argument("--spec", metavar="PATH", help="render from this spec (file or directory), not the packaged one")
    _overrides_flag(gen)
    gen.add_argument("--relay-url", metavar="URL",
                     help="where Alertmanager's receivers post (default the spec's, http://127.0.0.1:9095: the "
                          "relay beside Alertmanager); e.g. http://verl-exporter-relay.monitoring.svc:9095")

    from .checkpoint import cli as checkpoint_cli
    from .relay import add_parser as relay_parser
    from .sidecar import node
    from .tools.preflight import cli as preflight_cli

    checkpoint_cli.add_parser(sub)
    preflight_cli.add_parser(sub)
    relay_parser(sub)
    node.add_parser(sub)

    demo = sub.add_parser("demo", help="replay a bundled PPO run (with one injected fault) through the whole alert "
                                       "path: sidecar, Prometheus, Alertmanager, relay, checkpoint")
    demo.add_argument("--listen", metavar="HOST:PORT",
                      help="the sidecar's address (default: a free loopback port; alone: 127.0.0.1:9477)")
    demo.add_argument("--rate", type=_positive_rate, default=10.0, help="steps replayed per second (default 10)")
    demo.add_argument("--exit-after-replay", action="store_true",
                      help="stop (and clean up) when the replay ends instead of serving until Ctrl-C")
    demo.add_argument("--prometheus", metavar="PATH", help="Prometheus server to start (default: prometheus on PATH)")
    demo.add_argument("--alertmanager", metavar="PATH",
                      help="Alertmanager to start (default: prometheus-alertmanager or alertmanager on PATH)")
    demo.add_argument("--robot", choices=["dingtalk", "wecom"], default="dingtalk",
                      help="show messages as this robot formats them (default dingtalk)")
    demo.add_argument("--sidecar-only", action="store_true",
                      help="serve the sidecar alone (no Prometheus, Alertmanager or relay)")
    demo.add_argument("--hang", action="store_true",
                      help="the trainer hangs in its reward function instead: the sidecar captures its stacks (py-spy, "
                           "the forensics extra) and the page carries the verdict")

    bt = sub.add_parser("backtest", help="replay recorded verl runs through the alert pack: timeline + HTML report")
    bt.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="verl file-logger logs")
    bt.add_argument("--step-seconds", type=float, help="step time when the log has no timing_s/step")
    bt.add_argument("--html-dir", default=".", help="where <run>.backtest.html is written ('' for none)")
    bt.add_argument("--rules", metavar="DIR", help="rule files to judge (default: generated from the spec)")
    bt.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _max_steps_flag(bt)
    _overrides_flag(bt)

    cal = sub.add_parser("calibrate", help="propose an overrides file that keeps your healthy runs silent")
    cal.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="verl file-logger logs of healthy runs")
    cal.add_argument("--margin", type=_margin, default=0.2,
                     help="headroom a moved knob keeps above the runs' highest value (default 0.2 = 20%%)")
    cal.add_argument("--out", default="verl-exporter.yaml", metavar="FILE",
                     help="where the proposal is written (default verl-exporter.yaml; '-' for stdout)")
    cal.add_argument("--force", action="store_true", help="overwrite --out when it exists")
    cal.add_argument("--step-seconds", type=float, help="step time when the logs have no timing_s/step")
    cal.add_argument("--no-verify", action="store_true",
                     help="do not evaluate the proposal's rules over the runs (needs no promtool)")
    cal.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _max_steps_flag(cal)
    _overrides_flag(cal)

    fx = sub.add_parser("forensics", help="one verdict across ranks from the sidecars' stack captures (a shared "
                                          "--forensics-dir, or copies of several)")
    fx.add_argument("paths", nargs="+", metavar="DIR|FILE", help="forensics folders or capture-*.json files")
    fx.add_argument("--flight-recorder", metavar="PREFIX",
                    help="also read the ranks' Flight Recorder JSON dumps (PREFIX<rank>)")
    fx.add_argument("--json", action="store_true", help="machine-readable output")

    sch = sub.add_parser("schema", help="print the JSON Schema of a file verl-exporter reads")
    from .tools.schemas import SCHEMAS

    sch.add_argument("kind", choices=list(SCHEMAS),
                     help="; ".join(f"{kind}: {what}" for kind, (what, _) in SCHEMAS.items()))
    sch.add_argument("--spec", metavar="PATH", help="the spec whose alerts and knobs it names (default packaged)")

    docs = sub.add_parser("docs", help="serve the documentation site locally (MkDocs, from a checkout; no internet "
                                       "needed)")
    docs.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="where to serve it")
    docs.add_argument("--build", metavar="DIR", help="write the site as static files into DIR instead")
    return parser


def _max_steps_flag(p: argparse.ArgumentParser) -> None:
    from .tools.replay import MAX_STEPS

    p.add_argument("--max-steps", type=whole_number, default=MAX_STEPS, metavar="N",
                   help=f"judge at most the last N steps of a run, with a warning (default {MAX_STEPS:,}; 0: all, "
                        "in time and memory that grow with the steps)")


def cmd_serve(args) -> int:
    from .core.httpserver import ListenError
    from .sidecar.config import ConfigError, build_config, flag_values, read_config_file
    from .sidecar.sidecar import Sidecar
    from .spec import SpecError

    flags = flag_values(vars(args))
    done = stop_event(grace=GRACE_S)
    try:
        # the file alone is checked (with its lines) by read_config_file: what fails here came with the flags
        config = build_config(read_config_file(args.config), flags,
                              origin=f"{args.config} + flags" if args.config else "flags")
        sidecar = Sidecar(config)
        sidecar.start()
    except (ConfigError, SpecError, ValueError) as e:
        print(f"verl-exporter: {e}", file=sys.stderr)
        return 2
    except ListenError as e:
        print(f"verl-exporter: cannot listen on {config.listen}: {e.strerror}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. --file-sd in a folder that cannot be written
        print(f"verl-exporter: {_os_error(e)}", file=sys.stderr)
        return 2
    done.wait()
    sidecar.stop()
    return 0


def _os_error(e: OSError) -> str:
    """'PATH: reason' for an OSError, without Python's [Errno N] prefix."""
    return f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e.strerror or e)


_positive_rate = bounded_float(lambda v: 0 < v <= 10_000, "must be a number of steps per second in (0, 10000]")
_margin = bounded_float(lambda v: 0 <= v <= 10, "must be a share in [0, 10] (0.2 = 20%)")


def _announce(path: str) -> None:
    print(f"verl-exporter: using overrides {path}", file=sys.stderr)


def _load_with_overrides(spec_path, overrides):
    """The spec with the overrides file (spec.overrides.SpecWithOverrides), or None after printing why they
    cannot be used."""
    from .spec import SpecError
    from .spec.overrides import OverridesError, load_with_overrides

    try:
        return load_with_overrides(spec_path, overrides, _announce)
    except (SpecError, OverridesError) as e:
        print(f"verl-exporter: {e}", file=sys.stderr)
        return None


def _load_spec(path):
    """The spec, or None after printing why it cannot be used."""
    from .spec import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as e:
        print(f"verl-exporter: {e}", file=sys.stderr)
        return None


def cmd_spec(args) -> int:
    from .spec import FEEDS

    if args.breaker:
        return _cmd_breaker(args)
    if args.knobs or args.overrides is not None or args.changed:
        return _cmd_knobs(args)
    spec = _load_spec(args.spec)
    if spec is None:
        return 1
    if args.json:
        json.dump({"version": spec.version, "target_labels": list(spec.target_labels),
                   "metrics": [m.as_dict() for m in spec.metrics]}, sys.stdout, indent=2)
        print()
        return 0
    rows = []
    for m in spec.metrics:
        if m.source:
            feeds = ", ".join(s.pattern for s in m.source)
        else:
            feeds = next(f"{k}:{getattr(m, k)}" for k in FEEDS if k != "source" and getattr(m, k))
        rows.append((m.name, m.type, m.unit or "-", m.layer, ",".join(m.labels) or "-", feeds))
    widths = [max(len(r[i]) for r in rows + [("name", "type", "unit", "layer", "labels", "")])
              for i in range(5)]
    header = ("name", "type", "unit", "layer", "labels", "fed by")
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths, strict=False)) + "  " + row[5])
    print(f"\n{len(spec.metrics)} metrics; target labels: {', '.join(spec.target_labels)}")
    return 0


def _cmd_breaker(args) -> int:
    from .trainer.breaker import judged_alerts

    loaded = _load_with_overrides(args.spec, args.overrides)
    if loaded is None:
        return 1
    judged, blind = judged_alerts(loaded.effective)
    if args.json:
        json.dump({"judged": [{"alert": a.alert, "kind": a.kind, "for": a.for_} for a in judged],
                   "not_judged": [{"alert": name, "why": why} for name, why in blind.items()]}, sys.stdout, indent=2)
        print()
        return 0
    width = max((len(a.alert) for a in judged), default=5)
    print("judged by the breaker (trips when one fires, as the pack would page it):")
    for a in judged:
        print(f"  {a.alert:<{width}}  {a.kind:<9}  for {a.for_}")
    print("not judged (Prometheus pages them; a trainer process cannot see what they watch):")
    for name, why in blind.items():
        print(f"  {name}: {why}")
    print(f"\n{len(judged)} of {len(judged) + len(blind)} critical alerts judged in process")
    return 0


def _cmd_knobs(args) -> int:
    from .spec.overrides import knob_table

    loaded = _load_with_overrides(args.spec, args.overrides)
    if loaded is None:
        return 1
    rows = knob_table(loaded.declared, loaded.overrides)
    if args.changed:
        rows = [r for r in rows if r.source != "spec"]
    if args.json:
        json.dump([r.__dict__ for r in rows], sys.stdout, indent=2)
        print()
        return 0
    header = ("knob", "effective", "default", "unit", "from", "meaning")
    cells = [(r.knob, r.value, r.default, r.unit or "-", r.source + (f"  ({r.note})" if r.note else ""), r.meaning)
             for r in rows]
    widths = [min(40, max(len(c[i]) for c in [header, *cells])) for i in range(5)]
    for c in [header, *cells]:
        print("  ".join(x.ljust(w) for x, w in zip(c[:5], widths, strict=True)) + "  " + c[5])
    changed = sum(r.source != "spec" for r in rows)
    origin = loaded.overrides.origin if loaded.overrides else "nothing (the spec's defaults)"
    print(f"\n{changed} knob(s) set by {origin}" + ("" if args.changed else f", of {len(rows)}"))
    return 0


def cmd_generate(args) -> int:
    from pathlib import Path

    from .render import generate
    from .tools.schemas import schema_files

    loaded = _load_with_overrides(args.spec, args.overrides)
    if loaded is None:
        return 1
    spec = loaded.effective
    if args.relay_url:
        spec = spec.model_copy(update={"rules": spec.rules.model_copy(update={"relay_url": args.relay_url})})
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"verl-exporter: --out {args.out} is not a directory", file=sys.stderr)
        return 2
    try:
        stale = generate(spec, out, check=args.check, extra=schema_files(spec))
    except OSError as e:
        print(f"verl-exporter: cannot write the generated files: {_os_error(e)}", file=sys.stderr)
        return 2
    if args.check:
        if stale:
            print("generated files are stale (run `verl-exporter generate`):", file=sys.stderr)
            for path in stale:
                print(f"  {path}", file=sys.stderr)
            return 1
        print("generated files are up to date")
        return 0
    for path in stale:
        print(f"wrote {path}")
    return 0


def cmd_demo(args) -> int:
    from .tools.demo_stack import run

    return run(listen=args.listen, rate=args.rate, exit_after_replay=args.exit_after_replay,
               prometheus=args.prometheus, alertmanager=args.alertmanager, sidecar_only=args.sidecar_only,
               robot=args.robot, hang=args.hang)


def cmd_checkpoint(args) -> int:
    from .checkpoint import cli as checkpoint_cli

    return checkpoint_cli.run(args)


def cmd_relay(args) -> int:
    from .relay import run

    return run(args)


def cmd_node(args) -> int:
    from .sidecar.node import run

    return run(args)


def cmd_backtest(args) -> int:
    from .tools.backtest import run_backtest

    with exit_on_signal():
        return run_backtest(args.runs, step_seconds=args.step_seconds, html_dir=args.html_dir or None,
                            rules_dir=args.rules, progress=not args.no_progress, overrides=args.overrides,
                            max_steps=args.max_steps)


def cmd_calibrate(args) -> int:
    with exit_on_signal():
        return _calibrate(args)


def _calibrate(args) -> int:
    import shutil
    from pathlib import Path

    from .spec.overrides import OverridesError, resolve_path
    from .tools import calibrate as cb
    from .tools.backtest import _progress
    from .tools.replay import NotAVerlLog

    out_path = None if args.out == "-" else Path(args.out)
    base_path = resolve_path(args.overrides)
    if out_path is not None and out_path.exists() and not args.force:
        print(f"verl-exporter: {out_path} exists; pass --force to overwrite it, or --out elsewhere"
              + (" (it is the base the proposal builds on)" if base_path and Path(base_path) == out_path else ""),
              file=sys.stderr)
        return 2
    if not args.no_verify and shutil.which("promtool") is None:
        print("verl-exporter: checking the proposal needs promtool (Debian: apt-get install prometheus); "
              "or pass --no-verify", file=sys.stderr)
        return 2
    loaded = _load_with_overrides(None, base_path or "")
    if loaded is None:
        return 2
    spec = loaded.declared
    try:
        progress = None if args.no_progress else (lambda name: _progress(name))
        result, runs = cb.calibrate(args.runs, spec, loaded.overrides, margin=args.margin,
                                    step_seconds=args.step_seconds, progress=progress, max_steps=args.max_steps)
    except OverridesError as e:
        print(f"verl-exporter: {e}", file=sys.stderr)
        return 2
    except (OSError, NotAVerlLog) as e:
        print(f"verl-exporter calibrate: {_os_error(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 2
    if not args.no_verify:
        cb.verify(result, spec, runs)
    cb.report(result)
    text = cb.render_overrides(result)
    if out_path is None:
        sys.stdout.write(text)
    else:
        out_path.write_text(text, encoding="utf-8")
        moved = sum(k.changed for k in result.knobs)
        print(f"wrote {out_path} ({moved} knob(s) moved); next: verl-exporter backtest --overrides {out_path} "
              "HEALTHY.jsonl FAULTY.jsonl, then verl-exporter generate --overrides " + str(out_path))
    return 0


def cmd_schema(args) -> int:
    from .tools.schemas import schema

    spec = _load_spec(args.spec)
    if spec is None:
        return 1
    json.dump(schema(args.kind, spec), sys.stdout, indent=2)
    print()
    return 0


COMMANDS = {"serve": cmd_serve, "spec": cmd_spec, "generate": cmd_generate, "demo": cmd_demo,
            "checkpoint": cmd_checkpoint, "relay": cmd_relay, "node": cmd_node, "backtest": cmd_backtest,
            "calibrate": cmd_calibrate, "schema": cmd_schema}


def cmd_forensics(args) -> int:
    from .core.verdict import flight_recorder_verdict, merge, read_captures, read_flight_recorder, verdict
    from .exposition.selfmetrics import one_line

    errors: list[str] = []  # one line per file that is no capture: the others still make the verdict
    captures = read_captures(args.paths, errors)
    dumps = read_flight_recorder(args.flight_recorder, errors) if args.flight_recorder else {}
    for line in errors:
        print(f"verl-exporter forensics: skipped {one_line(line)}", file=sys.stderr)
    if not captures:
        print(f"no capture-*.json in {', '.join(args.paths)}", file=sys.stderr)
        return 1
    processes = merge(captures)
    out = {"verdict": verdict(processes), "captures": len(captures), "processes": len(processes),
           "flight_recorder": flight_recorder_verdict(dumps) if args.flight_recorder else None}
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
    else:
        print(out["verdict"])
        if out["flight_recorder"]:
            print(out["flight_recorder"])
    return 0


COMMANDS["forensics"] = cmd_forensics


def cmd_docs(args) -> int:
    from .tools.docs import serve

    return serve(args.listen, args.build)


COMMANDS["docs"] = cmd_docs
def cmd_preflight(args) -> int:
    from .tools.preflight import cli as preflight_cli

    return preflight_cli.run(args)


COMMANDS["preflight"] = cmd_preflight


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        # `verl-exporter spec | head`: the reader left; stop quietly, and keep Python's exit-time flush of
        # stdout from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
