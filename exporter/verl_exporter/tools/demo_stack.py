"""``verl-exporter demo`` with the whole alert path, when Prometheus and Alertmanager are installed.

On loopback, on free ports, in one temporary folder: the pack is generated (rules, Alertmanager config,
dashboards, ...); a sidecar follows the bundled run as the demo's trainer writes it; a real Prometheus
scrapes the sidecar and evaluates the generated rules; a real Alertmanager with the generated config
posts to the relay; the relay formats each message exactly as for the DingTalk (or WeCom) robot and shows it
on the terminal through a console target, and asks the sidecar's control endpoint for a checkpoint (and a
stop); the trainer loop reads the control file at each step, as verl's callback does, and acts on it.

Only timings are compressed: the run's steps (about a minute each) are replayed at ``--rate`` steps a
second, so every rule's ``for:``, Alertmanager's grouping and the robots' rate window are divided by the same
factor, and Prometheus scrapes and evaluates every 0.25 s. The rules, routes and messages are the generated ones.

Without the two programs the demo says how to get them and serves the sidecar alone (``demo.run_demo``).

``--hang``: the trainer is a process of its own (``demo.hang_trainer``) that hangs in its reward function; the
sidecar, its forensics on, captures its stacks (py-spy) when the spec's stall condition holds, and the relay's
forensics action on the stall alert pages the verdict. The stall alerts' limits are compressed like the `for:`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from ..core.shutdown import StopEvent, stop_process, stopping
from ..relay.actions import EVIDENCE_ALERT
from ..sidecar.forensics import find_py_spy
from ..spec import Spec
from .demo import _nonfinite_steps, demo_lines, run_demo

INSTALL_HINT = "sudo apt-get update && sudo apt-get install -y prometheus prometheus-alertmanager"
SIDECAR_ONLY_LISTEN = "127.0.0.1:9477"
# The automated response the demo's relay is configured with (as in the README's example).
CHECKPOINT_ON = "VerlNonFiniteGradNorm"
STOP_ON = "VerlRewardCollapse"  # a collapse confirmed by two signals
FORENSICS_ON = "VerlTrainingStalled"  # --hang: the relay's forensics action, as in the README's example
HANG_AT = 60  # --hang: the step whose reward the trainer never computes
PY_SPY_HINT = "pip install 'verl-exporter[forensics]'"
FOR_EXAMPLE = "VerlExporterDown"  # the compression shown on one rule's `for:`
CONTROL_TOKEN_ENV = "VERL_DEMO_CONTROL_TOKEN"
SCRAPE_S = 0.25  # Prometheus' scrape and evaluation interval in the demo: 2.5 steps at 10 steps/s
FLAP_SHOWN = 2  # an alert's starts shown as they happen; later ones are only counted (a flapping alert)
SETTLE_MAX_S = 15.0  # after the last step, how long --exit-after-replay waits for alerts and actions in flight

class DemoError(Exception):
    """The stack could not be started; the message says why."""


# ------------------------------------------------------------------------------------------ entry point
def find_programs(prometheus: str | None, alertmanager: str | None) -> tuple[str | None, str | None]:
    """The Prometheus and Alertmanager executables: the given paths, else Debian's names (or upstream's) on
    PATH; None for one that is not found."""
    def locate(given: str | None, names: tuple[str, ...]) -> str | None:
        if given:
            return shutil.which(given) or (given if os.access(given, os.X_OK) and Path(given).is_file() else None)
        return next((p for p in map(shutil.which, names) if p), None)

    return (locate(prometheus, ("prometheus",)),
            locate(alertmanager, ("prometheus-alertmanager", "alertmanager")))


def run(listen: str | None = None, rate: float = 10.0, exit_after_replay: bool = False,
        prometheus: str | None = None, alertmanager: str | None = None, sidecar_only: bool = False,
        robot: str = "dingtalk", hang: bool = False, out=print) -> int:
    """The whole path when Prometheus and Alertmanager are found, else the sidecar-only demo."""
    if not 0 < rate < float("inf"):
        raise ValueError(f"rate must be a positive number of steps per second, got {rate!r}")
    if hang and find_py_spy() is None:
        out(f"verl-exporter demo --hang: py-spy not found; the stacks of the hung trainer are captured with it: "
            f"{PY_SPY_HINT}")
        return 2
    if sidecar_only and hang:
        out("verl-exporter demo: --hang shows the page of the whole alert path; it cannot be --sidecar-only")
        return 2
    if sidecar_only:
        return run_demo(listen=listen or SIDECAR_ONLY_LISTEN, rate=rate, exit_after_replay=exit_after_replay,
                        out=out)
    prom, am = find_programs(prometheus, alertmanager)
    for given, found, flag in ((prometheus, prom, "--prometheus"), (alertmanager, am, "--alertmanager")):
        if given and not found:
            out(f"verl-exporter demo: {flag} {given}: not an executable program")
            return 2
    if prom is None or am is None:
        missing = " and ".join(n for n, p in (("Prometheus", prom), ("Alertmanager", am)) if p is None)
        if hang:
            out(f"verl-exporter demo --hang: {missing} not found; the hang page comes through them: {INSTALL_HINT}")
            return 2
        out(f"verl-exporter demo: {missing} not found, so this shows the sidecar only; for the whole alert path "
            f"(rule → Alertmanager → robot message → checkpoint): {INSTALL_HINT} (or --prometheus/--alertmanager)")
        return run_demo(listen=listen or SIDECAR_ONLY_LISTEN, rate=rate, exit_after_replay=exit_after_replay,
                        out=out)
    return FullDemo(prom, am, listen=listen or "127.0.0.1:0", rate=rate, exit_after_replay=exit_after_replay,
                    robot=robot, hang=hang, out=out).run()


# ------------------------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # loopback only, URLs we built
        return json.loads(resp.read())


def first_page(base: str, *paths: str) -> str:
    """The first of these pages that the server has, after redirects (else the first)."""
    for path in paths:
        with contextlib.suppress(OSError), urllib.request.urlopen(base + path, timeout=2) as resp:
            if resp.status == 200:
                return resp.geturl()  # where its redirects lead
    return base + paths[0]


def _die_with_parent():
    """A preexec_fn that has the kernel send the child SIGTERM when the demo dies (even by kill -9), so no
    process is left behind; None where that is not available. prctl is looked up here, in the parent: the
    child, forked from a threaded process, must only call it."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Program:
    """Prometheus or Alertmanager, its output in a log file (shown when it fails)."""

    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        try:  # its own session: Ctrl-C reaches the demo only, which then stops everything in order
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent())
        except OSError as e:
            self._log.close()
            raise DemoError(f"cannot start {name} ({argv[0]}): {e.strerror or e}") from None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, url: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DemoError(f"{self.name} exited (code {self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise DemoError(f"{self.name} did not become ready within {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def compress_for(rules_yaml: str, factor: float) -> tuple[str, dict[str, tuple[str, str]]]:
    """The rules with every ``for:`` divided by factor (at least 1 ms), and {alert: (for, demo for)}. A group's
    own interval (the once-a-minute window recordings) is dropped: every group runs on the demo's clock."""
    from ..spec.rules import duration_seconds

    doc = _yaml_load(rules_yaml)
    fors: dict[str, tuple[str, str]] = {}
    for group in doc["groups"]:
        group.pop("interval", None)
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            original = str(rule.get("for", "0s"))
            if duration_seconds(original):
                rule["for"] = compress_duration(original, factor)
                fors[rule["alert"]] = (original, _fmt_seconds(duration_seconds(original) / factor))
            else:
                fors[rule["alert"]] = ("", "")
    head = (f"# The generated alert rules with every `for:` divided by {factor:g}: the demo replays its run "
            f"{factor:g} times faster than it ran.\n")
    return head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=200), fors


def compress_duration(text: str, factor: float) -> str:
    """A Prometheus duration divided by factor, in milliseconds (at least 1)."""
    from ..spec.rules import duration_seconds

    return f"{max(1, round(duration_seconds(text) * 1000 / factor))}ms"


def compress_grouping(am_config: dict, factor: float) -> dict[str, tuple[str, str]]:
    """Alertmanager's group_wait and group_interval divided by factor, on every route that sets them (in
    place); {setting: (pack value, demo value)} of the top route. repeat_interval stays: repeats are not what
    the demo shows."""
    from ..spec.rules import duration_seconds

    shown: dict[str, tuple[str, str]] = {}

    def walk(route: dict, top: bool) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route:
                original = str(route[key])
                route[key] = compress_duration(original, factor)
                if top:
                    shown[key] = (original, _fmt_seconds(duration_seconds(original) / factor))
        for child in route.get("routes") or []:
            walk(child, False)

    walk(am_config["route"], True)
    return shown


def _fmt_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f}ms"
    return f"{s:.2g}s" if s < 10 else f"{s:.0f}s"


def compress_stalls(spec, factor: float):
    """The spec with the stall alerts' limits (factor, at_least, before_baseline) divided by factor: a stall is
    the time since the last step against the run's own step time, both compressed alike, so this is the same
    condition on the demo's clock. The sidecar's stall trigger and the generated rules read this spec."""
    from ..spec.kinds.stall import StallAlert

    def one(a):
        if not isinstance(a, StallAlert):
            return a
        return a.model_copy(update={"factor": a.factor / factor, "at_least": a.at_least / factor,
                                    "before_baseline": a.before_baseline and a.before_baseline / factor})

    metrics = tuple(m.model_copy(update={"alerts": tuple(map(one, m.alerts))}) for m in spec.metrics)
    return spec.model_copy(update={"metrics": metrics, "global_alerts": tuple(map(one, spec.global_alerts))})


def median_step_seconds(lines: list[dict], spec=None) -> float:
    from .replay import step_period

    return statistics.median(step_period(lines, spec=spec)) if lines else 60.0


def _yaml_load(text: str):
    from ..core.models import parse_yaml

    return parse_yaml(text, "generated rules")[0]  # the one loader (libyaml, no aliases, caps)


# ---------------------------------------------------------------------------------------- the demo
@dataclasses.dataclass
class Event:
    t: float  # seconds since the demo started
    step: int  # the last step the trainer had written by then
    who: str
    text: str


@dataclasses.dataclass
class AlertLife:
    """One alert name in the live stack, for the timeline."""

    name: str
    severity: str
    pending: Event | None = None
    firing: Event | None = None
    starts: int = 0
    notified: float | None = None
    shown: float | None = None


class _LogToDemo(logging.Handler):
    """The sidecar's and the relay's own warnings (control requests, actions, problems) as demo events."""

    def __init__(self, demo: FullDemo):
        super().__init__(logging.WARNING)
        self.demo = demo

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.threadName == "verl-demo-backtest":
                return  # the replay engine's own follower: not the live stack
            who = "relay" if record.name.startswith("verl_exporter.relay") else "sidecar"
            self.demo.event(who, record.getMessage())
        except Exception:  # logging must never raise into the component
            self.handleError(record)


class FullDemo:
    def __init__(self, prometheus: str, alertmanager: str, listen: str, rate: float, exit_after_replay: bool,
                 robot: str, hang: bool = False, out=print):
        self.prometheus_bin, self.alertmanager_bin = prometheus, alertmanager
        self.hang = hang
        self.trainer: subprocess.Popen | None = None  # --hang: the trainer process
        self.hung: Event | None = None  # --hang: the trainer entered the reward function that never returns
        self.last_step_t: float | None = None  # --hang: when its last step was written
        self.page: Event | None = None  # --hang: the VerlHangForensics page shown
        self.listen, self.rate, self.exit_after_replay, self.robot = listen, rate, exit_after_replay, robot
        self._out = out
        self._lock = threading.RLock()
        self.t0 = time.monotonic()
        self.events: list[Event] = []
        self.step = 0
        self.done = StopEvent()  # Ctrl-C / SIGTERM (its wait wakes for a signal another thread took)
        self.color = out is print and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        self.width = max(min(shutil.get_terminal_size((110, 24)).columns, 120), 80)
        self.programs: list[Program] = []
        self.sidecar = self.relay = self.reader = None
        self.workdir: Path | None = None
        self.lives: dict[str, AlertLife] = {}
        self.alert_states: dict[str, str] = {}
        self.fors: dict[str, tuple[str, str]] = {}
        self.messages = 0
        self.quiet = 0  # notifications and messages of flapping alerts, not shown
        self.first_message: Event | None = None
        self.first_nan: Event | None = None
        self.acted: list[Event] = []  # what the trainer did on request
        self.stopped = False
        self.armed = threading.Event()  # Prometheus has scraped the sidecar and loaded the alert rules
        self.backtest: dict | None = None
        self._watch_stop = threading.Event()
        self._poll_lock = threading.Lock()
        self.closing = False
        self._threads: list[threading.Thread] = []

    # ---- output
    def say(self, text: str = "") -> None:
        with self._lock:
            self._out(text)

    def event(self, who: str, text: str, detail: str | None = None) -> Event:
        with self._lock:
            e = Event(time.monotonic() - self.t0, self.step, who, text)
            self.events.append(e)
            if self.closing:  # the report is out: what the shutdown brings (the relay draining) is not shown
                return e
            line = f"{e.t:6.1f}s  step {e.step:>3}  {who:<12} {text}"
            self._out("\n".join(textwrap.wrap(line, self.width, subsequent_indent=INDENT, break_long_words=False,
                                               break_on_hyphens=False)) or line)
            if detail:
                self._out("\n".join(INDENT + line for line in detail.splitlines()))
        return e

    # ---- the run
    def run(self) -> int:
        with stopping(self.done):
            return self._run()

    def _run(self) -> int:
        logger = logging.getLogger(__name__.partition(".")[0])  # the package's: every component's warnings
        saved = (logger.level, logger.propagate)
        hook = _LogToDemo(self)
        logger.addHandler(hook)
        logger.setLevel(logging.WARNING)
        logger.propagate = False  # the components' warnings are demo events now; their INFO lines are not shown
        status = 0
        try:
            self.start()
            if self.wait_armed():
                self.replay_hang() if self.hang else self.replay()
                self.settle()
                if not self.exit_after_replay and not self.done.is_set():
                    self.say(f"\nThe stack keeps running: look around at {self.prom_alerts} and\n"
                             f"{self.am_url}/#/alerts. Ctrl-C stops it and cleans up.")
                    self.done.wait()
                self.report()
        except DemoError as e:
            self.say(f"verl-exporter demo: {e}")
            status = 1
        finally:
            self.cleanup()
            logger.removeHandler(hook)
            logger.setLevel(saved[0])
            logger.propagate = saved[1]
        return status

    def start(self) -> None:
        self._load_run()
        token = secrets.token_hex(16)  # the sidecar's control token, given to the relay's actions
        self._start_sidecar(token)
        self._start_relay(token)
        self._generate_pack()
        self._start_servers()
        self._introduce()
        self._thread(self._watch, "verl-demo-watch")
        self._thread(self._arm, "verl-demo-arm")
        if not self.hang:  # a hung run has no end for the replay engine to judge
            self._thread(self._run_backtest, "verl-demo-backtest")

    def _load_run(self) -> None:
        """The demo run's lines and what the compression of time derives from them; the work folder."""
        from ..spec import load_spec

        self.spec = self.declared = load_spec()
        self.raw_lines = demo_lines()
        self.lines = [json.loads(x) for x in self.raw_lines]
        self.bad_steps = _nonfinite_steps(self.raw_lines)
        self.step_s = median_step_seconds(self.lines, self.spec)
        self.factor = max(self.rate * self.step_s, 1.0)
        work = self.workdir = Path(tempfile.mkdtemp(prefix="verl-exporter-demo-"))
        self.log_path = work / "demo_run.jsonl"
        self.ckpt = work / "checkpoints"
        self.ckpt.mkdir()
        self.sidecar_hang: dict[str, Any] = {}  # --hang: the sidecar watches the trainer process, forensics on
        if self.hang:
            self.spec = compress_stalls(self.spec, self.factor)
            self._start_trainer()
            self.sidecar_hang = {"trainer_pid": self.trainer.pid, "forensics_dir": str(work / "forensics")}

    def _start_sidecar(self, token: str) -> None:
        """The sidecar, with its control endpoint on (the relay's actions call it)."""
        from ..core.httpserver import ListenError
        from ..sidecar.config import ServeConfig
        from ..sidecar.sidecar import Sidecar

        self.sidecar = Sidecar(ServeConfig(listen=self.listen, run="demo", rank=0, verl_log=str(self.log_path),
                                           checkpoint_dir=str(self.ckpt), **self.sidecar_hang), spec=self.spec,
                               control_token=token)
        try:
            self.sidecar.start()
        except ListenError as e:
            raise DemoError(f"cannot listen on {self.listen}: {e.strerror} (try --listen 127.0.0.1:0)") from None
        self.sidecar_url = self.sidecar.server.url
        self.control_file = self.sidecar.control.path

    def _start_relay(self, token: str) -> None:
        """The relay: console targets that format exactly as the robot does (critical alerts to the on-call
        group, the rest to the team's), and the automated response."""
        from ..relay.app import Relay
        from ..relay.config import parse_config
        from ..relay.metrics import RelayMetrics
        from ..relay.senders import ConsoleSender

        style = {"type": "console", "style": self.robot, "color": "always" if self.color else "never"}
        relay_config = parse_config({
            "listen": "127.0.0.1:0",
            "targets": {"oncall": style, "team": style},
            "routes": [{"matchers": {"severity": "critical"}, "targets": ["oncall"]}, {"targets": ["team"]}],
            "actions": [{"matchers": {"alertname": CHECKPOINT_ON}, "action": "checkpoint", "url": self.sidecar_url,
                         "token_env": CONTROL_TOKEN_ENV},
                        {"matchers": {"alertname": STOP_ON}, "action": "stop", "url": self.sidecar_url,
                         "token_env": CONTROL_TOKEN_ENV}]
                       + ([{"matchers": {"alertname": FORENSICS_ON}, "action": "forensics", "url": self.sidecar_url,
                            "token_env": CONTROL_TOKEN_ENV}] if self.hang else []),
            # the robots' limit of 20 messages a minute, compressed like Alertmanager's grouping
            "delivery": {"drain_seconds": 2, "rate_window_seconds": 60 / self.factor},
        }, environ={CONTROL_TOKEN_ENV: token}, origin="the demo's relay config")
        width = max(self.width - len(INDENT), 60)
        senders = {name: ConsoleSender(t, write=lambda text, name=name: self._robot_message(name, text), width=width)
                   for name, t in relay_config.targets.items()}
        self.relay = Relay(relay_config, senders=senders, metrics=RelayMetrics(self.spec))
        self.relay.app.on_webhook = self._webhook
        self.relay.start()

    def _generate_pack(self) -> None:
        """The pack, generated as `verl-exporter generate --relay-url <the relay>` writes it, its times compressed."""
        from .. import render
        from ..render.rules import render_rules

        work = self.workdir
        pack = self.pack = work / "pack"

        def relayed(spec: Spec) -> Spec:
            return spec.model_copy(update={"rules": spec.rules.model_copy(update={"relay_url": self.relay.url})})

        render.generate(relayed(self.declared), pack)
        if self.spec is not self.declared:  # --hang: the rules Prometheus runs have the stall limits compressed
            for rel, text in render_rules(relayed(self.spec)).items():  # (their texts keep the real clock's)
                (pack / rel).write_text(text, encoding="utf-8")
        alerts_yaml, self.fors = compress_for((pack / "rules/verl-alerts.yaml").read_text(), self.factor)
        self.demo_rules = work / "demo-verl-alerts.yaml"
        self.demo_rules.write_text(alerts_yaml)
        self.demo_recording = work / "demo-verl-recording.yaml"
        self.demo_recording.write_text(compress_for((pack / "rules/verl-recording.yaml").read_text(), self.factor)[0])
        am_config = _yaml_load((pack / "alertmanager/alertmanager.yml").read_text())
        self.grouping = compress_grouping(am_config, self.factor)
        (work / "alertmanager.yml").write_text(yaml.safe_dump(am_config, sort_keys=False))

    def _start_servers(self) -> None:
        """A real Alertmanager and a real Prometheus (the alert rules come once it has scraped the sidecar)."""
        work = self.workdir
        aport, pport = free_port(), free_port()
        self.am_url, self.prom_url = f"http://127.0.0.1:{aport}", f"http://127.0.0.1:{pport}"
        self.am = Program("Alertmanager", [
            self.alertmanager_bin, f"--config.file={work / 'alertmanager.yml'}", f"--storage.path={work / 'am'}",
            f"--web.listen-address=127.0.0.1:{aport}", "--cluster.listen-address=", "--log.level=warn",
            f"--web.external-url={self.am_url}"], work / "alertmanager.log")
        self.programs.append(self.am)
        self._write_prometheus_config(alerts=False)
        self.prom = Program("Prometheus", [
            self.prometheus_bin, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{pport}", "--log.level=warn", f"--web.external-url={self.prom_url}"],
            work / "prometheus.log")
        self.programs.append(self.prom)
        self.am.wait_ready(self.am_url + "/-/ready")
        self.prom.wait_ready(self.prom_url + "/-/ready")
        # Debian's Prometheus serves only the classic UI (/classic/...), upstream's the new one
        self.prom_alerts = first_page(self.prom_url, "/alerts", "/classic/alerts")
        self.prom_graph = first_page(self.prom_url, "/graph", "/classic/graph", "/query")

    def _introduce(self) -> None:
        """What runs where, and how the demo's time is compressed."""
        pack = self.pack
        robot = _robot_name(self.robot)
        grouping = ", ".join(f"{k} {a} → {b}" for k, (a, b) in self.grouping.items())
        if self.hang:
            run = (f"the first {HANG_AT - 1} steps of a PPO run, written at {self.rate:g} steps/s by the demo's "
                   f"trainer process\n               (pid {self.trainer.pid}), which then hangs in its reward "
                   f"function compute_score\n  sidecar      {self.sidecar_url}/metrics  follows the run's log; "
                   f"captures the trainer's stacks (py-spy) into\n               {self.sidecar.config.forensics_dir} "
                   f"when it stalls; asked for them on {FORENSICS_ON}")
        else:
            run = (f"{len(self.lines)} steps of a PPO run, written at {self.rate:g} steps/s by the demo's trainer "
                   f"loop:\n               its gradient norm explodes, then is NaN at steps "
                   f"{', '.join(map(str, self.bad_steps)) or '-'}\n  sidecar      {self.sidecar_url}/metrics  "
                   "follows the run's log; control endpoint on")
        self.say(f"""
verl-exporter demo: the whole alert path on this machine, on loopback; everything stops and is removed at the end
  the run      {run}
  Prometheus   {self.prom_alerts}  the generated rules (graphs: {self.prom_graph})
  Alertmanager {self.am_url}/#/alerts  the generated config, posting to the relay
  relay        {self.relay.url}/metrics  console targets: each message as the {robot} robot shows it
               (not sent); asks the sidecar for a checkpoint on {CHECKPOINT_ON}, a stop on {STOP_ON}
  the pack     {pack}
""")
        self.say("\n".join(textwrap.wrap(
            f"Timings are compressed {self.factor:.0f}x, as the run's {self.step_s:.0f} s steps replay at "
            f"{self.rate:g} steps/s: each rule's `for:`, Alertmanager's grouping and the robots' "
            f"20-messages-a-minute window are divided by {self.factor:.0f} "
            f"({FOR_EXAMPLE} {self._for_text(FOR_EXAMPLE)}; "
            f"{grouping}), and Prometheus scrapes and evaluates every {SCRAPE_S:g} s. The rules, routes and "
            "messages are the generated ones.", self.width)))
        self.say("Waiting for Prometheus' first scrape of the sidecar (its service discovery starts after about "
                 "5 s) ...\n")

    def _start_trainer(self) -> None:
        """--hang: the trainer as a process of its own (py-spy cannot read the demo's own stacks); RANK as a
        launcher sets it, so that the verdict names the rank. It waits for the go (replay_hang)."""
        argv = [sys.executable, "-m", "verl_exporter.tools.demo", str(self.log_path), f"{self.rate!r}", str(HANG_AT)]
        try:
            self.trainer = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                            start_new_session=True, preexec_fn=_die_with_parent(),
                                            env={**os.environ, "RANK": "0"})
        except OSError as e:
            raise DemoError(f"cannot start the trainer ({argv[0]}): {e.strerror or e}") from None

    def _thread(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _write_prometheus_config(self, alerts: bool) -> None:
        interval = f"{round(SCRAPE_S * 1000)}ms"
        am, sidecar = urllib.parse.urlsplit(self.am_url).netloc, urllib.parse.urlsplit(self.sidecar_url).netloc
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": [str(self.demo_recording)] + ([str(self.demo_rules)] if alerts else []),
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am]}]}]},
            "scrape_configs": [{"job_name": "verl", "static_configs": [{"targets": [sidecar]}]}],
        }
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))

    def _arm(self) -> None:
        """Load the alert rules once Prometheus has scraped the sidecar: its service discovery starts after
        5 s, and the compressed `for:` of VerlExporterAbsent (10m) would otherwise page during that wait."""
        query = self.prom_url + "/api/v1/query?" + urllib.parse.urlencode({"query": 'up{job="verl"} == 1'})
        deadline = time.monotonic() + 30
        while not self._watch_stop.is_set():
            with contextlib.suppress(OSError, ValueError, KeyError):
                if http_json(query)["data"]["result"]:
                    break
            if time.monotonic() > deadline or self.prom.proc.poll() is not None:
                self.event("Prometheus", "has not scraped the sidecar within 30 s")
                return
            time.sleep(0.1)
        self._write_prometheus_config(alerts=True)
        self.prom.proc.send_signal(signal.SIGHUP)  # Prometheus reloads its config
        rules = self.prom_url + "/api/v1/rules?type=alert"
        while not self._watch_stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                n = sum(len(g["rules"]) for g in http_json(rules)["data"]["groups"])
                if n:
                    self.event("Prometheus", f"has scraped the sidecar; {n} alert rules loaded")
                    self.armed.set()
                    return
            time.sleep(0.1)

    def wait_armed(self) -> bool:
        while not self.armed.wait(0.1):
            if self.done.is_set() or not any(t.name == "verl-demo-arm" and t.is_alive() for t in self._threads):
                if not self.done.is_set():
                    raise DemoError(f"Prometheus did not load the alert rules:\n{self.prom.tail()}")
                return False
        return True

    def _for_text(self, alert: str) -> str:
        original, demo = self.fors.get(alert, ("", ""))
        return f"for: {original} → {demo}" if original else "no for:"

    # ---- the demo's trainer: writes the run as verl's file logger does, honours the control file
    def replay(self) -> None:
        from ..sidecar.control import ControlReader

        self.reader = ControlReader(str(self.control_file))
        interval = 1.0 / self.rate
        self.event("trainer", f"training starts, writing verl's file log at {self.rate:g} steps/s")
        with open(self.log_path, "wb", buffering=0) as f:  # like verl's FileLogger
            for raw, line in zip(self.raw_lines, self.lines, strict=True):
                if self.done.is_set():
                    return
                f.write(raw)
                self.step = int(line["step"])
                if self.bad_steps and self.step == self.bad_steps[0]:
                    self.first_nan = self.event("trainer", "logs a NaN gradient norm (null in verl's log); it had "
                                                           "been exploding for a few steps")
                if self.after_step():
                    return
                if self.done.wait(interval):
                    return
        self.event("trainer", f"training finished at step {self.step}")

    def replay_hang(self) -> None:
        """--hang: let the trainer process write its steps, then wait (SETTLE_MAX_S at most) for the page that
        carries the verdict on its stacks."""
        from ..sidecar.control import ControlReader

        self.reader = ControlReader(str(self.control_file))  # settle() honours it as for the default run
        self.event("trainer", f"training starts (pid {self.trainer.pid}), writing verl's file log at {self.rate:g} "
                              "steps/s")
        self.trainer.stdin.write("go\n")
        self.trainer.stdin.flush()
        for text in self.trainer.stdout:
            if self.done.is_set():
                return
            said = json.loads(text)
            if "step" in said:
                self.step, self.last_step_t = said["step"], time.monotonic() - self.t0
            else:
                self.hung = self.event("trainer", f"step {said['hang']}: the reward function compute_score waits "
                                                  "for a reward server that never answers; the run hangs (as in "
                                                  "verl PR #6673)")
                break
        if self.hung is None:
            raise DemoError(f"the trainer exited (code {self.trainer.wait()}) before it hung")
        deadline = time.monotonic() + SETTLE_MAX_S
        while self.page is None and time.monotonic() < deadline and not self.done.is_set():
            self.done.wait(0.1)

    def after_step(self) -> bool:
        """What verl's step-end hook does with the control file; True when the run must stop."""
        reader = self.reader
        reader.poll()
        if reader.take_checkpoint_request():
            path = self._save_checkpoint(self.step)
            self.acted.append(self.event("trainer", f"checkpoint requested ({reader.reason}): saved {path.name} "
                                                    f"after step {self.step}"))
        if reader.stop_requested and not self.stopped:
            self.stopped = True
            path = self._save_checkpoint(self.step)
            self.acted.append(self.event("trainer", f"stop requested ({reader.reason}): saved {path.name} and "
                                                    f"stopped after step {self.step}, as verl's fit() would"))
            return True
        return False

    def _save_checkpoint(self, step: int) -> Path:
        """verl's layout, in miniature: global_step_N/actor/..., then the tracker file."""
        path = self.ckpt / f"global_step_{step}"
        (path / "actor").mkdir(parents=True, exist_ok=True)
        (path / "actor" / "model_world_size_1_rank_0.pt").write_bytes(os.urandom(1024))
        (path / "data.pt").write_bytes(os.urandom(256))
        (self.ckpt / "latest_checkpointed_iteration.txt").write_text(str(step))
        return path

    def settle(self) -> None:
        """After the last step: let alerts and actions in flight arrive (at most SETTLE_MAX_S), still honouring
        the control file, as a trainer in its final validation would."""
        deadline = time.monotonic() + SETTLE_MAX_S
        quiet_since, seen = time.monotonic(), len(self.events)
        while time.monotonic() < deadline and not self.done.is_set():
            if not self.stopped:
                self.after_step()
            if len(self.events) != seen:
                seen, quiet_since = len(self.events), time.monotonic()
            pending = any(s == "pending" for s in self.alert_states.values())
            queued = sum(w.state()[0] for w in self.relay.dispatcher.workers.values())
            if not pending and not queued and time.monotonic() - quiet_since >= 2.0:
                return
            self.done.wait(0.1)

    # ---- what the stack does, as it happens
    def _watch(self) -> None:
        while not self._watch_stop.is_set():
            self.poll_alerts()
            self._watch_stop.wait(0.1)

    def poll_alerts(self) -> None:
        """Print the alerts' changes since the last look (also called before a notification is printed, so
        that Prometheus' side of the story comes first)."""
        with self._poll_lock, contextlib.suppress(OSError, ValueError, KeyError):
            self._alerts_seen(http_json(self.prom_url + "/api/v1/alerts", timeout=1.0)["data"]["alerts"])

    def _alerts_seen(self, alerts: list[dict]) -> None:
        now = {json.dumps(sorted(a["labels"].items())): (a.get("state", ""), a["labels"]) for a in alerts}
        changes: dict[str, list[tuple[str, AlertLife]]] = {}
        flapping: list[str] = []
        for key, (state, labels) in now.items():
            before = self.alert_states.get(key)
            if state == before:
                continue
            name = labels.get("alertname", "")
            life = self.lives.setdefault(name, AlertLife(name, labels.get("severity", "")))
            if state == "firing":
                life.starts += 1
                if life.starts == FLAP_SHOWN + 1:
                    flapping.append(name)
            kind = {"pending": "pending", "firing": "pending → firing" if before == "pending" else "firing"}.get(state)
            if kind:
                changes.setdefault(kind, []).append((self._alert_text(labels), life))
        for key in set(self.alert_states) - set(now):
            labels = dict(json.loads(key))
            life = self.lives.get(labels.get("alertname", ""))
            if life is not None:
                changes.setdefault("resolved", []).append((self._alert_text(labels), life))
        self.alert_states = {k: s for k, (s, _) in now.items()}
        for kind in ("pending", "pending → firing", "firing", "resolved"):
            shown = sorted({text for text, life in changes.get(kind, []) if life.starts <= FLAP_SHOWN
                            or (kind != "resolved" and life.name in flapping)},
                           key=lambda text: (not text.endswith("critical"), text))
            if shown:
                e = self.event("Prometheus", f"{kind}: {', '.join(shown)}")
            for _, life in changes.get(kind, []):
                if kind == "pending" and life.pending is None:
                    life.pending = e if shown else None
                elif kind != "resolved" and life.firing is None:
                    life.firing = e if shown else None
        for name in flapping:
            self.event("Prometheus", f"{name} keeps firing and resolving (its value hovers at the threshold); "
                                     "its further changes are counted in the timeline, not shown")

    def _alert_text(self, labels: dict) -> str:
        name = labels.get("alertname", "")
        text = name + (f" ({labels['signal']})" if labels.get("signal") else "")
        original, demo = self.fors.get(name, ("", ""))
        return f"{text} {labels.get('severity', '')}" + (f" [for: {original} → {demo}]" if original else "")

    def _webhook(self, receiver: str, payload) -> None:
        firing = sorted({a.name for a in payload.alerts if a.status == "firing"})
        resolved = sorted({a.name for a in payload.alerts if a.status == "resolved"})
        if not self._watch_stop.is_set():
            self.poll_alerts()
        t = time.monotonic() - self.t0
        for a in payload.alerts:
            life = self.lives.setdefault(a.name, AlertLife(a.name, a.severity))
            if a.status == "firing" and life.notified is None:
                life.notified = t
        if self._flapping(firing + resolved):
            self.quiet += 1
            return
        parts = ([f"firing {', '.join(firing)}"] if firing else []) + (
            [f"resolved {', '.join(resolved)}"] if resolved else [])
        self.event("Alertmanager", f"→ relay /alert/{receiver}: {'; '.join(parts)}")

    def _flapping(self, names: list[str]) -> bool:
        """Only alerts that fired more often than FLAP_SHOWN: their notifications are counted, not shown."""
        return bool(names) and all(n in self.lives and self.lives[n].starts > FLAP_SHOWN for n in names)

    def _robot_message(self, target: str, text: str) -> None:
        plain = [_strip(line) for line in text.splitlines()]
        body = [line[2:] for line in plain if line.startswith("│ ")]
        title = body[0].strip() if body else ""
        self.messages += 1
        names = sorted(set(re.findall(r"\b(Verl\w+)\b", " ".join(body))))
        t = time.monotonic() - self.t0
        for name in names:
            life = self.lives.get(name)
            if life is not None and life.shown is None and life.notified is not None:
                life.shown = t
        if self.closing or (self.first_message is not None and self._flapping(names)):
            self.quiet += 1
            return
        full = target == "oncall" or self.first_message is None
        group = "on-call group (critical)" if target == "oncall" else "team group"
        if full:
            e = self.event("relay", f"→ {group}, as the {_robot_name(self.robot)} robot shows it:", detail=text)
        else:
            e = self.event("relay", f"→ {group}: {title}")
        if self.first_message is None:
            self.first_message = e
        if EVIDENCE_ALERT in names and self.page is None:
            self.page = e

    # ---- the same run through the replay engine (simulated clock, promtool), for the final report
    def _run_backtest(self) -> None:
        from . import replay as rp
        from .backtest import timeline

        promtool = shutil.which("promtool") or str(Path(self.prometheus_bin).with_name("promtool"))
        if not os.access(promtool, os.X_OK):
            self.backtest = {"error": "promtool not found (Debian: it comes with the prometheus package)"}
            return
        try:
            samples = rp.replay(self.lines, self.spec, run="demo")
            fired = rp.evaluate(samples, self.pack / "rules", promtool=promtool)
            self.backtest = {"events": timeline(samples, fired)}
        except Exception as e:  # the report is extra: it must not break the demo
            self.backtest = {"error": f"{type(e).__name__}: {e}"}

    # ---- the end
    def report(self) -> None:
        self._watch_stop.set()
        self.say("\nTimeline of the live stack (seconds since the start; step = the last step written by then):")
        self.say(f"  {'alert':<38} {'severity':<9} {'pending':>14} {'firing':>14} {'starts':>6} {'notified':>8} "
                 f"{'shown':>7}")
        for life in sorted(self.lives.values(), key=lambda x: (x.firing or x.pending).t):
            def at(e: Event | None) -> str:
                return f"{e.t:.1f}s/{e.step}" if e else "-"

            def sec(x: float | None) -> str:
                return f"{x:.1f}s" if x is not None else "-"

            self.say(f"  {life.name:<38} {life.severity:<9} {at(life.pending):>14} {at(life.firing):>14} "
                     f"{life.starts:>6} {sec(life.notified):>8} {sec(life.shown):>7}")
        for e in self.acted:
            self.say("\n".join(textwrap.wrap(f"trainer at {e.t:.1f}s, step {e.step}: {e.text}", self.width,
                                              initial_indent="  ", subsequent_indent="    ")))
        self.say("\n".join(textwrap.wrap(
            f"{self.messages} robot messages" + (f"; {self.quiet} notifications and messages of flapping alerts not "
                                                 "shown" if self.quiet else "")
            + ". Not notified (-): inhibited by a root-cause alert, or resolved before its group was sent.",
            self.width, initial_indent="  ", subsequent_indent="  ")))
        if self.hang:
            self._report_hang()
            return
        self._report_path()
        self._report_backtest()

    def _report_path(self) -> None:
        total = time.monotonic() - self.t0
        parts = []
        nan_life = self.lives.get(CHECKPOINT_ON)
        if self.first_nan is not None:
            parts.append(f"NaN logged {self.first_nan.t:.1f}s (step {self.first_nan.step})")
        if nan_life is not None and nan_life.firing is not None:
            parts.append(f"{CHECKPOINT_ON} firing {nan_life.firing.t:.1f}s")
            if nan_life.notified is not None:
                parts.append(f"Alertmanager notified {nan_life.notified:.1f}s")
            if nan_life.shown is not None:
                parts.append(f"robot message {nan_life.shown:.1f}s")
        checkpoint = next((e for e in self.acted if "checkpoint requested" in e.text), None)
        if checkpoint is not None:
            parts.append(f"checkpoint {checkpoint.t:.1f}s (step {checkpoint.step})")
        stop = next((e for e in self.acted if "stop requested" in e.text), None)
        if stop is not None:
            parts.append(f"stop {stop.t:.1f}s (step {stop.step})")
        first = f"First robot message at {self.first_message.t:.1f}s; " if self.first_message else ""
        self.say("\n" + "\n".join(textwrap.wrap(f"The path: {' → '.join(parts) or 'nothing fired'}. {first}"
                                                f"{total:.1f}s in all.", self.width, subsequent_indent="  ")))

    def _report_hang(self) -> None:
        """--hang: the path from the last step to the stacks on disk and the page, and where the stacks are."""
        captured = next((e for e in self.events if e.who == "sidecar" and e.text.startswith("forensics: stacks")),
                        None)
        stalled = self.lives.get(FORENSICS_ON)
        marks = [] if self.last_step_t is None else [(self.last_step_t, f"last step {self.last_step_t:.1f}s "
                                                                       f"(step {self.step})")]
        for e, what in ((self.hung, "hung in compute_score"), (captured, "stacks captured"),
                        (stalled and stalled.firing, f"{FORENSICS_ON} firing"), (self.page, "page with the verdict")):
            if e is not None:
                marks.append((e.t, f"{what} {e.t:.1f}s"))
        path = " → ".join(text for _, text in sorted(marks)) or "no step"
        text = f"The path: {path}. {time.monotonic() - self.t0:.1f}s in all."
        if self.last_step_t is not None and captured is not None and self.page is not None:
            text += (f" From the last step to the stacks on disk {captured.t - self.last_step_t:.1f}s, to the page "
                     f"{self.page.t - self.last_step_t:.1f}s.")
        last = self.sidecar.forensics.last
        if last is not None:
            text += f" The capture: {last['path']}: {last['verdict']}."
        self.say("\n" + "\n".join(textwrap.wrap(text, self.width, subsequent_indent="  ", break_long_words=False,
                                                break_on_hyphens=False)))

    def _report_backtest(self) -> None:
        t = next((t for t in self._threads if t.name == "verl-demo-backtest"), None)
        if t is not None:
            t.join(timeout=60)
        bt = self.backtest
        if bt is None or "error" in bt:
            self.say(f"\nBacktest of the same run: not available ({bt['error'] if bt else 'still running after 60 s'})")
            return
        first: dict[str, dict] = {}
        count: dict[str, int] = {}
        for e in bt["events"]:
            first.setdefault(e["alert"], e)
            count[e["alert"]] = count.get(e["alert"], 0) + 1
        self.say("\n" + "\n".join(textwrap.wrap(
            f"Backtest of the same run: the replay engine, at the run's own step times, the pack's rules with their "
            f"real `for:` (promtool, minute by minute); `verl-exporter backtest` draws it as HTML. "
            f"{len(bt['events'])} alert starts:", self.width)))
        self.say(f"  {'alert':<38} {'severity':<9} {'first step':>10} {'starts':>6}  live demo")
        for name, e in sorted(first.items(), key=lambda kv: (kv[1]["step"] or 0, kv[0])):
            live = self.lives.get(name)
            mark = "fired" if live and live.firing else ("pending only" if live else "-")
            self.say(f"  {name:<38} {e['severity']:<9} {e['step'] if e['step'] is not None else '-':>10} "
                     f"{count[name]:>6}  {mark}")

    def cleanup(self) -> None:
        self._watch_stop.set()
        self.closing = True
        stopped = []
        for p in reversed(self.programs):
            p.stop()
            stopped.append(p.name)
        if self.relay is not None:
            self.relay.stop(drain_seconds=1)
            stopped.append("the relay")
        if self.trainer is not None:
            stop_process(self.trainer)
            stopped.append("the hung trainer")
        if self.sidecar is not None:
            self.sidecar.stop()
            stopped.append("the sidecar")
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.say(f"\nStopped {', '.join(stopped)}; removed {self.workdir}")


INDENT = " " * 26


def _robot_name(robot: str) -> str:
    return {"dingtalk": "DingTalk", "wecom": "WeCom"}.get(robot, robot)


def _strip(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
