"""`verl-exporter relay --config FILE [--listen HOST:PORT] [--check-config | --preview ALERT.json]` (argparse only).

The main command line adds it with add_parser(subparsers) and run(args); `python -m verl_exporter.relay`
uses main().
"""

from __future__ import annotations

import argparse
import logging
import sys

DESCRIPTION = ("Relay Alertmanager webhooks (POST /alert/<receiver>) to DingTalk and WeCom group robots, "
               "within their rate and size limits. Also serves /healthz and /metrics.")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser("relay", help="relay Alertmanager webhooks to DingTalk / WeCom group robots",
                              description=DESCRIPTION)
    _flags(p)
    return p


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help="relay config (see alertmanager/relay.example.yaml)")
    p.add_argument("--listen", metavar="HOST:PORT", help="address to serve on (default: the config's, 127.0.0.1:9095)")
    p.add_argument("--check-config", action="store_true",
                   help="load the config (secrets and templates included), print a summary, and exit")
    p.add_argument("--preview", metavar="ALERT.json",
                   help="route and format this Alertmanager webhook payload ('-': stdin) and print each target's "
                        "messages as the robot would show them; sends nothing, needs no secrets")
    p.add_argument("--body", action="store_true", help="with --preview: print the exact JSON bodies instead")


def run(args: argparse.Namespace) -> int:
    from ..core.httpserver import ListenError, parse_listen
    from ..core.shutdown import GRACE_S, stop_event
    from .app import Relay
    from .config import RelayConfigError, load_config
    from .journal import SpoolError, check_spool_dir, spool_in_use

    if getattr(args, "preview", None):
        return _preview(args)
    try:
        config = load_config(args.config)
        if args.listen:
            parse_listen(args.listen)
    except (RelayConfigError, ValueError) as e:
        print(f"verl-exporter relay: {e}", file=sys.stderr)
        return 2
    if args.check_config:
        problem = check_spool_dir(config.spool_dir) if config.spool_dir is not None else None
        if problem:
            print(f"verl-exporter relay: {args.config}: {problem}", file=sys.stderr)
            return 2
        # Not an error: this is also how one checks a change to the config of the relay that runs on it.
        busy = spool_in_use(config.spool_dir) if config.spool_dir is not None else None
        if busy:
            print(f"verl-exporter relay: {args.config}: note: {busy} (a relay started with this config now "
                  "would refuse to start)", file=sys.stderr)
        for name, t in config.targets.items():
            signed = ", signed" if t.secret is not None else ""
            if t.type == "console":
                where = str(t.file) if t.file is not None else "standard output"
                print(f"target {name}: console as {t.robot} {t.format} ({t.show}), to {where}")
                continue
            print(f"target {name}: {t.type} {t.format}{signed}, {t.rate_per_minute}/min, token from {t.token.source}")
        for i, r in enumerate(config.routes):
            cond = (f"receivers {list(r.receivers)}" if r.receivers else "any receiver") + (
                f" and {len(r.matchers)} matcher(s)" if r.matchers else "")
            print(f"route {i}: {cond} -> {list(r.targets) or 'nowhere'}{' (continue)' if r.continue_ else ''}")
        print("config ok")
        return 0
    # before the start: an early SIGTERM still stops cleanly; the grace leaves the drain its time
    done = stop_event(grace=config.delivery.drain_seconds + GRACE_S)
    relay = Relay(config, listen=args.listen)
    try:
        relay.start()
    except SpoolError as e:
        print(f"verl-exporter relay: {e}", file=sys.stderr)
        return 2
    except ListenError as e:
        print(f"verl-exporter relay: cannot listen on {args.listen or config.listen}: {e.strerror}", file=sys.stderr)
        return 2
    except OSError as e:  # the spool folder, say: not a listen problem
        why = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
        print(f"verl-exporter relay: cannot start: {why}", file=sys.stderr)
        return 2
    done.wait()
    left = relay.stop()
    logging.getLogger(__name__).info("relay stopped; %d alert(s) left over", sum(left.values()))
    return 0


def _preview(args: argparse.Namespace) -> int:
    import os

    from .config import RelayConfigError, load_config
    from .payload import PayloadError, parse_payload
    from .preview import PayloadTooLarge, preview, read_payload

    try:
        config = load_config(args.config, secrets_needed=False)  # nothing is sent: no secret is needed
    except RelayConfigError as e:
        print(f"verl-exporter relay: {e}", file=sys.stderr)
        return 2
    try:
        payload = parse_payload(read_payload(args.preview, config.max_body_bytes))
    except OSError as e:
        print(f"verl-exporter relay: cannot read {args.preview}: {e.strerror}", file=sys.stderr)
        return 2
    except PayloadTooLarge as e:
        print(f"verl-exporter relay: {args.preview} is {e}", file=sys.stderr)
        return 2
    except PayloadError as e:
        problems = "\n  - ".join(e.problems[:10])
        print(f"verl-exporter relay: {args.preview} is not an Alertmanager webhook payload (version 4):\n  - "
              f"{problems}", file=sys.stderr)
        return 2
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    return preview(config, payload, body=args.body, color=color)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-exporter relay", description=DESCRIPTION)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    _flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)
