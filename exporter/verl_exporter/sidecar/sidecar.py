"""One sidecar: the spec, the stores, the sources and the HTTP server, wired together."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.process_collector import ProcessCollector

from ..exposition.app import HttpServer, SafeCollector, health_handler, make_app
from ..exposition.selfmetrics import SelfMetric, SelfMetrics
from ..spec import Spec
from ..spec.kinds.stall import StallAlert
from ..spec.overrides import AlertOverride, LoadedOverrides, Overrides, apply_overrides, load_effective_spec
from .collectors import Context
from .collectors.sampler import Sampler, build_collectors
from .config import ServeConfig, flag_name
from .control import PATH_PREFIX as CONTROL_PATH
from .control import ControlState, default_control_file, make_control_app, parse_file_mode, read_token
from .engines_sd import EnginesSd
from .file_sd import FileSdRegistration, advertise_host
from .forensics import Forensics, ForensicsSettings, StallWatch, hang_alerts
from .progress import Progress
from .sources.verl_file import VerlFileFollower
from .store import TrainingStore

CONTROL_REQUESTS = SelfMetric("verl_exporter_control_requests_total")
COLLECTOR_SUCCESS = SelfMetric("verl_exporter_collector_success")

log = logging.getLogger(__name__)
RECOVERY_WAIT_S = 30.0  # the longest a restarted sidecar waits for its log's recovery before it serves
FIRST_SAMPLE_WAIT_S = 5.0  # the longest it waits for its collectors' first samples (a checkpoint hash can be slow)


class Sidecar:
    def __init__(self, config: ServeConfig, spec: Spec | None = None, before_scrape: Callable[[], object] | None = None,
                 control_token: str | None = None, control_file: str | None = None):
        self.config = config
        self.spec = hang_flags(spec or load_effective_spec(config.spec, config.overrides), config)
        self.hang_alerts = hang_alerts(self.spec)
        if (config.healthz_hang or config.hang_factor) and not self.hang_alerts:
            log.warning("--healthz-hang: the spec has no critical stall alert (disabled by the overrides?); "
                        "/healthz judges no hang")
        labels = config.const_labels(self.spec.target_labels)
        self.self_metrics = SelfMetrics(self.spec, labels)
        self.store = TrainingStore(self.spec, self.self_metrics, labels, max_unmapped=config.max_unmapped)
        self.registry = CollectorRegistry(auto_describe=False)
        if before_scrape is not None:  # registered first: it runs before every other collector
            self.registry.register(_BeforeScrape(before_scrape))
        self.registry.register(SafeCollector(self.self_metrics, "exporter", self.self_metrics))
        # client_python's standard process_* series: the sidecar's own CPU and memory.
        ProcessCollector(registry=self.registry)
        self.sampler = Sampler(build_collectors(config.collectors, self.context()), self.spec, self.self_metrics,
                               labels, interval=config.interval, slow_interval=config.slow_interval)
        # The training store's and the sampler's series are rendered by exposition.py (fast, cached
        # prefixes); the registry keeps the sidecar's own health and client_python's process_* series.
        self.follower: VerlFileFollower | None = None
        if config.verl_log:
            self.follower = VerlFileFollower(
                config.verl_log, self.store, self.self_metrics, poll_interval=config.poll_interval,
                max_line_bytes=config.max_line_bytes, recover_bytes=config.recover_bytes)
        self.forensics: Forensics | None = None
        self.stall_watch: StallWatch | None = None
        c = config
        if c.forensics_dir:  # off by default: a capture attaches to the trainer (ptrace)
            self.forensics = Forensics(ForensicsSettings(
                c.forensics_dir, c.forensics_py_spy, c.forensics_native, c.forensics_max_files, c.forensics_max_bytes,
                c.forensics_timeout, c.forensics_flight_recorder), self.self_metrics, c.trainer_pid, labels)
            self.stall_watch = StallWatch(self.spec, self.store, self.forensics)
        self.progress: Progress | None = None
        if c.state_dir:
            self.progress = Progress(c.state_dir, self.store, self.self_metrics, c.trainer_pid, c.planned_steps,
                                     c.save_freq, c.deadline, c.max_ckpt_to_keep)
        self.server: HttpServer | None = None
        self.file_sd: FileSdRegistration | None = None
        self.engines_sd: EnginesSd | None = None
        self.control: ControlState | None = None
        # A Monitor passes its token directly; the CLI's sidecar reads it from env or file.
        self._control_token = control_token or read_token(config.control_token_env, config.control_token_file)
        if self._control_token:
            path = control_file or config.control_file or default_control_file(config.checkpoint_dir)
            if not path:
                raise ValueError("the control endpoint needs a control file (or a checkpoint directory)")
            self.control = ControlState(path, mode=parse_file_mode(config.control_file_mode))
            self.self_metrics.inc(CONTROL_REQUESTS, 0, action="checkpoint", result="accepted")

    def context(self) -> Context:
        return Context(spec=self.spec, self_metrics=self.self_metrics, config=self.config, environ=dict(os.environ))

    @property
    def judges_trainer(self) -> bool:
        """Does /healthz judge the trainer (--trainer-pid, --healthz-hang or the deprecated --hang-factor K)?"""
        c = self.config
        return c.trainer_pid is not None or c.healthz_hang or bool(c.hang_factor)

    def trainer_liveness(self, now: float | None = None) -> tuple[bool, str]:
        """Is the watched trainer alive and stepping? Its pid with --trainer-pid; with --healthz-hang, not hung:
        no critical stall alert (hang_alerts) holds on this store, judged as the breaker and the rules judge it."""
        c = self.config
        if c.trainer_pid is not None:
            try:
                os.kill(c.trainer_pid, 0)
            except ProcessLookupError:
                return False, f"trainer pid {c.trainer_pid} is gone"
            except PermissionError:
                pass  # exists, owned by someone else
        if c.healthz_hang or c.hang_factor:
            view = self.store.view(time.time() if now is None else now)
            for alert in self.hang_alerts:
                age = alert.judge(view)
                if age is None:
                    continue
                why = f"no new step for {age:.0f} s"
                if isinstance(alert, StallAlert):
                    why += f" (limit {alert.limit(view.stat(alert.signal, alert.stat)) or 0:.0f} s)"
                return False, f"{why}: {alert.alert} holds"
        return True, "ok"

    def sidecar_health(self) -> tuple[bool, dict[str, Any]]:
        """/healthz/sidecar: the process and its sources, never the trainer."""
        return self._health(check_trainer=False)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """/healthz: the sidecar, and the trainer's liveness when --healthz-hang / --trainer-pid ask for it."""
        return self._health(check_trainer=True)

    def _health(self, check_trainer: bool) -> tuple[bool, dict[str, Any]]:
        sources: dict[str, dict[str, str]] = {}
        collectors = {c.name: "ok" if self.self_metrics.value(COLLECTOR_SUCCESS, collector=c.name)
                      else "failing" for c in self.sampler.collectors}
        if self.follower:
            sources["verl_log"] = {"path": self.follower.path, "state": self.follower.status()}
        healthy = all(not s["state"].startswith("error") for s in sources.values())
        details: dict[str, Any] = {"sources": sources, "collectors": collectors, "step": self.store.step,
                                   "pid": os.getpid()}
        if self.forensics is not None:
            details["forensics"] = {"dir": self.config.forensics_dir, "last_capture": self.forensics.last}
        if check_trainer and self.judges_trainer:
            alive, why = self.trainer_liveness()
            details["trainer"] = why
            healthy = healthy and alive
        return healthy, details

    def start(self) -> Sidecar:
        rank = "-" if self.config.rank is None else self.config.rank
        summary = f"Serving verl training metrics (run={self.config.run or '-'}, rank={rank})."
        handlers = []
        if self.control and self._control_token:  # a ControlState only with a token
            handlers.append(make_control_app(self.control, self._control_token, self.self_metrics, self.forensics))
        handlers.append(health_handler("/healthz/sidecar", self.sidecar_health))
        app = make_app(self.registry, self.self_metrics, self.health, summary, handlers=handlers,
                       renderers=[self.store.render, self.sampler.render])
        # bound: the port is known, nothing served yet; /control/ in slots of its own (a capture takes long)
        self.server = HttpServer(app, self.config.listen, slow_paths=(CONTROL_PATH,), on_problem=lambda kind,
                                 message: self.self_metrics.problem("http", kind, message))
        if self.config.file_sd:  # registered before serving: once /healthz answers, discovery has us
            file_sd = self.file_sd = FileSdRegistration(self.config.file_sd,
                                                        self.config.advertise or advertise_host(), self.server.port)
            file_sd.start(on_error=lambda e: self.self_metrics.problem(
                "file_sd", "write", f"cannot write {file_sd.path}: {e}"))
        c = self.config
        if c.engines_from and c.file_sd and c.run:  # the config requires --file-sd and --run with it
            self.engines_sd = EnginesSd(c.engines_from, c.file_sd, c.run, c.rollout_engine,
                                        self.self_metrics.problem).start()
        if self.follower:
            # Recover from the file before serving: a scrape of a restarted sidecar must not see the NaN
            # counter back at nothing (a reset to Prometheus) or the training series missing for a moment.
            # Bounded, so that a huge or unreadable file delays the first scrape, not the sidecar forever.
            self.follower.start()
            if not self.follower.recovered.wait(RECOVERY_WAIT_S):
                log.warning("still recovering from %s after %.0f s; serving meanwhile", self.config.verl_log,
                            RECOVERY_WAIT_S)
        # Sample once before serving too: a first scrape without the GPU series would read as a gap.
        self.sampler.start()
        if still := self.sampler.wait_first_samples(FIRST_SAMPLE_WAIT_S):
            log.warning("collectors %s still on their first sample after %.0f s; serving meanwhile",
                        ", ".join(still), FIRST_SAMPLE_WAIT_S)
        if self.stall_watch:
            self.stall_watch.start()
        if self.progress:  # after the follower's recovery: the recovered step is compared with the saved one
            self.progress.update()
            self.progress.start()
        self.server.start()
        log.info("verl-exporter serving on %s/metrics%s", self.server.url,
                 f", following {self.config.verl_log}" if self.config.verl_log else "")
        return self

    def stop(self) -> None:
        if self.stall_watch:
            self.stall_watch.stop()
        if self.progress:
            self.progress.stop()
        if self.engines_sd:
            self.engines_sd.stop()
        if self.file_sd:
            self.file_sd.stop()
        if self.follower:
            self.follower.stop()
        self.sampler.stop()
        if self.server:
            self.server.stop()


def hang_flags(spec: Spec, config: ServeConfig) -> Spec:
    """The spec with the deprecated --hang-factor / --hang-min-seconds set as the hang alerts' knobs (factor,
    at_least), as an overrides file would set them (and checked alike): /healthz and the forensics trigger judge
    that one declaration. A flag moves only this sidecar's judges, not Prometheus' rules: the deprecation line
    names the overrides key that moves both."""
    settings = {"factor": "hang_factor", "at_least": "hang_min_seconds"}  # knob: its deprecated setting
    given = {knob: value for knob, field in settings.items()
             if (value := getattr(config, field)) is not None and (value or knob != "factor")}  # factor 0 was off
    if not given:
        return spec
    names = [a.alert for a in hang_alerts(spec)]
    flags = " and ".join(flag_name(settings[knob]) for knob in given)
    keys = " and ".join(f"alerts.{name}.thresholds.{knob}" for name in names for knob in given)
    log.warning("%s %s deprecated: set %s in the overrides file (the rules follow it too) and --healthz-hang",
                flags, "is" if len(given) == 1 else "are", keys or "the critical stall alert's knobs")
    doc = Overrides(alerts={name: AlertOverride(thresholds=given) for name in names})
    return apply_overrides(spec, LoadedOverrides(doc, origin=flags))


class _BeforeScrape:
    """A collector that yields nothing and runs a hook (e.g. the Monitor draining its queue)."""

    def __init__(self, hook: Callable[[], object]):
        self._hook = hook

    def collect(self) -> Iterable[Metric]:
        self._hook()
        return []

