"""`verl-exporter preflight`: its flags, the order the checks run in, the output and the exit status.

Exit status: 0 every check passed (or was skipped), 1 a check failed (each failure on its own line), 2 bad
usage (flags, the overrides file, a --manifests-dir that is not a folder).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from ...core.argtypes import bounded_float, whole_number
from ...sidecar.collectors.preflight import CHECKS
from . import disk, fabric, gpus, paging, resume
from .report import Finding, Options, UsageError, default_node, document, render_text, status_of, write_result

RUNNERS: dict[str, Callable[[Options], list[Finding]]] = {
    "gpu": gpus.check, "fabric": fabric.check, "disk": disk.check, "checkpoint": resume.check_checkpoint,
    "agreement": resume.check_agreement, "paging": paging.check}
assert tuple(RUNNERS) == CHECKS  # the sidecar bounds its check label by CHECKS


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("preflight", help="check this node before a run starts or resumes (GPUs, fabric, "
                                                "disk, the checkpoint to resume, across nodes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=whole_number, metavar="N", help="GPUs this node must have")
    p.add_argument("--ports", type=whole_number, metavar="N", help="InfiniBand/RoCE ports this node must have")
    p.add_argument("--port-rate", type=_positive, metavar="GBPS",
                   help="the rate every port must run at (default: the fastest port of the same link layer)")
    p.add_argument("--fabric-sample", type=_seconds, metavar="SECONDS",
                   help="how long to watch the ports' error counters (default the knob preflight.fabric_sample)")
    p.add_argument("--sysfs-root", default="/sys", metavar="DIR", help="where sysfs is mounted (default /sys)")
    p.add_argument("--procfs", default="/proc", metavar="DIR", help="where /proc is mounted (default /proc)")
    p.add_argument("--kmsg", default="/dev/kmsg", metavar="PATH", help="the kernel log read for XIDs")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="verl's trainer.default_local_dir")
    p.add_argument("--max-ckpt-to-keep", type=whole_number, metavar="N", help="verl's trainer.max_actor_ckpt_to_keep")
    p.add_argument("--deep", action="store_true", help="hash every checkpoint file, even those its manifest "
                                                       "vouches for (unchanged since it was written)")
    p.add_argument("--manifests-dir", metavar="DIR", help="a folder every node shares: each node writes "
                                                          "<node>.json there and compares with the others")
    p.add_argument("--node", default=None, metavar="NAME", help="this node's name there (default the host name)")
    p.add_argument("--nodes", type=whole_number, metavar="N", help="nodes to wait for in --manifests-dir")
    p.add_argument("--relay-url", metavar="URL", help="check that the relay answers and has targets")
    p.add_argument("--prometheus-url", metavar="URL", help="check Prometheus has the rules and the targets up")
    p.add_argument("--run", metavar="NAME", help="the run label of the targets to find in Prometheus")
    p.add_argument("--state-dir", metavar="DIR", help="write the result there (preflight.json) for the "
                                                      "sidecar's --preflight-result")
    p.add_argument("--skip", action="append", default=[], choices=CHECKS, metavar="CHECK",
                   help=f"do not run this check (repeatable): {', '.join(CHECKS)}")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout, for schedulers")
    p.add_argument("--overrides", metavar="FILE", help="an overrides file with a preflight: section of knobs "
                                                       "(default $VERL_EXPORTER_OVERRIDES, ./verl-exporter.yaml)")
    p.add_argument("--spec", metavar="PATH", help="a metric spec to use, not the packaged one")
    return p


_positive = bounded_float(lambda v: 0 < v < 1e6, "must be over 0")
_seconds = bounded_float(lambda v: 0 <= v <= 3600, "must be seconds in [0, 3600]", "a number of seconds")


def run_checks(o: Options, skip: set[str]) -> tuple[list[Finding], dict[str, str]]:
    """Every check not skipped, in order; a check that raises fails with its error instead of the run."""
    findings: list[Finding] = []
    o.cache.clear()  # what the checks share is of this run
    for name, runner in RUNNERS.items():
        if name in skip:
            continue
        try:
            findings += runner(o)
        except UsageError:
            raise
        except Exception as e:  # a bug in one check must not hide the others' results
            findings.append(Finding(name, False, f"the check itself failed ({type(e).__name__}: {e}); report it, "
                                                 f"and --skip {name} meanwhile"))
    return findings, {name: status_of(findings, name, skip) for name in CHECKS}


def run(args: argparse.Namespace) -> int:
    from ...spec import SpecError
    from ...spec.overrides import OverridesError, PreflightKnobs, load_with_overrides

    try:
        loaded = load_with_overrides(args.spec, args.overrides)
        knobs = loaded.overrides.model.preflight if loaded.overrides else PreflightKnobs()
        spec = loaded.effective  # the paging check looks for the effective alerts
    except (SpecError, OverridesError) as e:
        print(f"verl-exporter preflight: {e}", file=sys.stderr)
        return 2
    o = Options(spec=spec, knobs=knobs, node=args.node or default_node(), gpus=args.gpus, procfs=args.procfs,
                kmsg=args.kmsg, sysfs_root=args.sysfs_root, ports=args.ports, port_rate_gbps=args.port_rate,
                fabric_sample_s=args.fabric_sample, checkpoint_dir=args.checkpoint_dir,
                max_ckpt_to_keep=args.max_ckpt_to_keep, deep=args.deep, manifests_dir=args.manifests_dir,
                nodes=args.nodes, relay_url=args.relay_url, prometheus_url=args.prometheus_url, run=args.run)
    return finish(o, set(args.skip), args.json, args.state_dir)


def finish(o: Options, skip: set[str], as_json: bool, state_dir: str | None) -> int:
    """Run the checks, print the result, write the result file; the exit status."""
    try:
        findings, statuses = run_checks(o, skip)
    except UsageError as e:
        print(f"verl-exporter preflight: {e}", file=sys.stderr)
        return 2
    doc = document(findings, statuses, o.node, o.clock())
    print(json.dumps(doc, indent=1) if as_json else render_text(findings, statuses))
    if state_dir:
        try:
            write_result(state_dir, doc)
        except OSError as e:
            print(f"verl-exporter preflight: cannot write the result into {state_dir}: {e.strerror}", file=sys.stderr)
            return 1
    return 0 if doc["passed"] else 1
