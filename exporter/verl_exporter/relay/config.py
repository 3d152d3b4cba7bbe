"""The relay's configuration: a strict YAML loader that reports every problem at once.

Each message names the target or route it is about. Secrets (robot tokens, DingTalk signing secrets, the
webhook bearer token) are read from the environment or from files at load time and held in ``Secret``,
which prints as ``<secret>``: a config object can be logged, repr'd or put in an exception safely. A missing
variable is an error that names the variable, never a value.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from datetime import timezone, tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml

from ..core.server import parse_listen
from .actions import parse_actions

ROBOT_TYPES = ("dingtalk", "wecom")
# A console target sends nothing: it writes each message as its `style` robot would show it (previews, the demo).
TARGET_TYPES = (*ROBOT_TYPES, "console")
CONSOLE_SHOW = ("rendered", "body")  # the message as the robot shows it, or the exact JSON body it would get
CONSOLE_COLOR = ("auto", "always", "never")
FORMATS = ("markdown", "text")
SEVERITIES = ("critical", "warning", "info")
DEFAULT_URLS = {
    "dingtalk": "https://oapi.dingtalk.com/robot/send",
    "wecom": "https://qyapi.weixin.qq.com/cgi-bin/webhook/send",
}
# The query parameter that carries each robot's token; it must come from a secret, never from `url`.
TOKEN_PARAM = {"dingtalk": "access_token", "wecom": "key"}

TOP_KEYS = {"listen", "bearer_token_env", "bearer_token_file", "max_body_bytes", "spool_dir", "timezone",
            "delivery", "targets", "routes", "actions"}
DELIVERY_KEYS = {"max_attempts", "initial_backoff_seconds", "max_backoff_seconds", "max_retry_seconds",
                 "request_timeout_seconds", "drain_seconds", "queue_max_alerts", "rate_window_seconds"}
TARGET_KEYS = {"type", "url", "token_env", "token_file", "secret_env", "secret_file", "mention_mobiles",
               "mention_userids", "mention_severities", "mention_all_severities", "format", "rate_per_minute",
               "template", "text_template", "style", "file", "show", "color"}
ROBOT_ONLY_KEYS = {"url", "token_env", "token_file", "secret_env", "secret_file"}
CONSOLE_ONLY_KEYS = {"style", "file", "show", "color"}
ROUTE_KEYS = {"receivers", "matchers", "targets", "continue"}

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
MOBILE_RE = re.compile(r"^\+?[0-9][0-9-]{4,19}$")
USERID_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

MiB = 1024 * 1024


def zone(name: str) -> tzinfo:
    """An IANA zone; UTC without the tz database (slim images may lack it)."""
    return timezone.utc if name in ("UTC", "Etc/UTC") else ZoneInfo(name)


class RelayConfigError(ValueError):
    """A config that cannot be used; ``problems`` lists every problem found, one sentence each."""

    def __init__(self, problems: list[str], origin: str = "relay config"):
        self.problems = problems
        super().__init__(f"{origin}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))


class Secret:
    """A credential. str/repr/format print ``<secret>``; only ``reveal()`` gives the value."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str = ""):
        self._value = value
        self.source = source  # where it came from ("env DINGTALK_TOKEN"): safe to print

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__

    def __reduce__(self):  # pickling would copy the value somewhere we do not control
        raise TypeError("a Secret cannot be pickled")


@dataclass(frozen=True)
class Delivery:
    """Retry, drain and rate settings shared by every target."""

    max_attempts: int = 6
    initial_backoff_seconds: float = 1.0
    max_backoff_seconds: float = 60.0
    # A message is given up (counted and logged) after this long; the robot's own lock-out lasts 10 minutes.
    max_retry_seconds: float = 300.0
    request_timeout_seconds: float = 10.0
    # Kubernetes' default grace period is 30 s: drain for 10 s, then spool what is left.
    drain_seconds: float = 10.0
    queue_max_alerts: int = 10000
    # The robots count messages per minute; tests shrink the window so a burst takes seconds.
    rate_window_seconds: float = 60.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based): doubling, capped."""
        return min(self.initial_backoff_seconds * 2 ** (attempt - 1), self.max_backoff_seconds)

    def should_retry(self, result, attempt: int, elapsed: float) -> bool:
        """Retry a retryable failure while attempts and the total time per message allow it."""
        return (result.retryable and attempt < self.max_attempts
                and elapsed + self.backoff(attempt) <= self.max_retry_seconds)


@dataclass(frozen=True)
class Target:
    name: str
    type: str
    url: str
    token: Secret
    secret: Secret | None = None
    mention_mobiles: tuple[str, ...] = ()
    mention_userids: tuple[str, ...] = ()
    mention_severities: tuple[str, ...] = ("critical",)
    mention_all_severities: tuple[str, ...] = ()
    format: str = "markdown"
    rate_per_minute: int = 20
    template: str | None = None  # template source text (read at load), replacing the default for `format`
    text_template: str | None = None  # for the text fallback (WeCom mentions that must ring)
    # console targets only: the robot whose formatting they reproduce, where and what they write
    style: str = ""
    file: Path | None = None  # None: standard output
    show: str = "rendered"
    color: str = "auto"

    def secrets(self) -> list[str]:
        """The values to scrub from any text before it is logged."""
        return [s.reveal() for s in (self.token, self.secret) if s is not None and s.reveal()]

    @property
    def robot(self) -> str:
        """The robot whose message format this target uses (dingtalk or wecom)."""
        return self.style or self.type

    def as_robot(self) -> Target:
        """This target as its robot for formatting: a console target formats exactly as its `style` robot."""
        return replace(self, type=self.style) if self.type == "console" else self


@dataclass(frozen=True)
class Matcher:
    label: str
    value: str
    regex: re.Pattern | None = None

    def matches(self, labels: dict[str, str]) -> bool:
        got = labels.get(self.label, "")
        return bool(self.regex.fullmatch(got)) if self.regex else got == self.value


@dataclass(frozen=True)
class Route:
    receivers: tuple[str, ...] = ()  # empty: any receiver
    matchers: tuple[Matcher, ...] = ()
    targets: tuple[str, ...] = ()
    continue_: bool = False

    def matches(self, receiver: str, labels: dict[str, str]) -> bool:
        if self.receivers and receiver not in self.receivers:
            return False
        return all(m.matches(labels) for m in self.matchers)


@dataclass(frozen=True)
class RelayConfig:
    targets: dict[str, Target]
    routes: tuple[Route, ...]
    listen: str = "127.0.0.1:9095"
    bearer_token: Secret | None = None
    max_body_bytes: int = MiB
    spool_dir: Path | None = None
    timezone: str = "UTC"
    delivery: Delivery = field(default_factory=Delivery)
    actions: tuple = ()  # of actions.Action: checkpoint/stop requests for chosen alerts

    def knows_receiver(self, receiver: str) -> bool:
        """A receiver is known when some route names it or some route takes any receiver."""
        return any(not r.receivers or receiver in r.receivers for r in self.routes)

    def targets_for(self, receiver: str, labels: dict[str, str]) -> list[str]:
        """Routes are evaluated in order; the first match wins unless it says `continue: true`."""
        out: list[str] = []
        for route in self.routes:
            if route.matches(receiver, labels):
                out.extend(t for t in route.targets if t not in out)
                if not route.continue_:
                    break
        return out

    def secrets(self) -> list[str]:
        values = [v for t in self.targets.values() for v in t.secrets()]
        if self.bearer_token is not None and self.bearer_token.reveal():
            values.append(self.bearer_token.reveal())
        values += [v for a in self.actions for v in a.secrets()]
        return values


class _Loader:
    """Holds the problem list while one document is checked."""

    def __init__(self, base_dir: Path, environ: dict[str, str], secrets_needed: bool = True):
        self.problems: list[str] = []
        self.base_dir = base_dir
        self.environ = environ
        # False for --preview, which sends nothing: a secret that is not set is then an empty placeholder
        self.secrets_needed = secrets_needed

    def secret(self, where: str, raw: dict, stem: str, required: bool) -> Secret | None:
        env_key, file_key = f"{stem}_env", f"{stem}_file"
        if env_key in raw and file_key in raw:
            self.problems.append(f"{where}: give {env_key} or {file_key}, not both")
            return None
        if env_key in raw:
            var = raw[env_key]
            if not isinstance(var, str) or not ENV_RE.match(var):
                self.problems.append(f"{where}: {env_key} must be the name of an environment variable")
                return None
            value = self.environ.get(var, "")
            if not value.strip() and not self.secrets_needed:
                return Secret("", f"env {var} (not set)")
            if not value.strip():
                self.problems.append(f"{where}: environment variable {var} ({env_key}) is not set or empty")
                return None
            return Secret(value.strip(), f"env {var}")
        if file_key in raw:
            path = self.path(where, file_key, raw[file_key])
            if path is None:
                return None
            try:
                value = path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                if not self.secrets_needed:
                    return Secret("", f"file {path} (not read)")
                reason = getattr(e, "strerror", None) or "not UTF-8 text"
                self.problems.append(f"{where}: cannot read {file_key} {str(path)!r}: {reason}")
                return None
            if not value:
                self.problems.append(f"{where}: {file_key} {str(path)!r} is empty")
                return None
            return Secret(value, f"file {path}")
        if required:
            self.problems.append(f"{where}: give {env_key} (an environment variable) or {file_key}")
        return None

    def path(self, where: str, key: str, value: Any) -> Path | None:
        if not isinstance(value, str) or not value:
            self.problems.append(f"{where}: {key} must be a path")
            return None
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.base_dir / path

    def number(self, where: str, raw: dict, key: str, default, kind=float, minimum=0.0, above=False):
        value = raw.get(key, default)
        ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
        if ok and (value <= minimum if above else value < minimum):
            ok = False
        if not ok:
            bound = f"> {minimum}" if above else f">= {minimum}"
            self.problems.append(f"{where}{key} must be a{'n integer' if kind is int else ' number'} {bound}, "
                                 f"got {value!r}")
            return default
        return kind(value)

    def str_list(self, where: str, raw: dict, key: str, pattern: re.Pattern | None = None,
                 allowed: tuple[str, ...] | None = None, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = raw.get(key, list(default))
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(v, (str, int)) for v in value):
            self.problems.append(f"{where}: {key} must be a list of strings")
            return default
        out = tuple(str(v) for v in value)
        for v in out:
            if pattern is not None and not pattern.match(v):
                self.problems.append(f"{where}: {key} has a malformed entry {v[:40]!r}")
            if allowed is not None and v not in allowed:
                self.problems.append(f"{where}: {key} entry {v!r} is not one of {list(allowed)}")
        return out

    def template(self, where: str, raw: dict, key: str) -> str | None:
        if key not in raw:
            return None
        path = self.path(where, key, raw[key])
        if path is None:
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or "not UTF-8 text"
            self.problems.append(f"{where}: cannot read {key} {str(path)!r}: {reason}")
            return None
        from .format import TemplateError, check_template

        try:
            check_template(text)
        except TemplateError as e:
            self.problems.append(f"{where}: {key} {str(path)!r}: {e}")
            return None
        return text

    def target(self, name: Any, raw: Any) -> Target | None:
        where = f"target {name!r}"
        if not isinstance(name, str) or not NAME_RE.match(name):
            self.problems.append(f"{where}: a target name must be letters, digits, '.', '_' or '-'")
            return None
        if not self.mapping(where, raw, TARGET_KEYS):
            return None
        kind = raw.get("type")
        if kind not in TARGET_TYPES:
            self.problems.append(f"{where}: type must be one of {list(TARGET_TYPES)}, got {kind!r}")
            return None
        if kind == "console":
            robot, url, token, secret, console = self.console(where, raw)
        else:
            robot, console = kind, {}
            extra = sorted(CONSOLE_ONLY_KEYS & set(raw))
            if extra:
                self.problems.append(f"{where}: {extra} are for console targets only")
            url, token, secret = self.robot_endpoint(where, raw, kind)
        fmt = raw.get("format", "markdown")
        if fmt not in FORMATS:
            self.problems.append(f"{where}: format must be one of {list(FORMATS)}, got {fmt!r}")
            fmt = "markdown"
        mobiles = self.str_list(where, raw, "mention_mobiles", MOBILE_RE)
        userids = self.str_list(where, raw, "mention_userids", USERID_RE)
        if userids and robot == "dingtalk":
            self.problems.append(f"{where}: mention_userids is for WeCom; DingTalk robots mention by mobile")
        mention_sev = self.str_list(where, raw, "mention_severities", allowed=SEVERITIES, default=("critical",))
        all_sev = self.str_list(where, raw, "mention_all_severities", allowed=SEVERITIES)
        rate = self.number(f"{where}: ", raw, "rate_per_minute", 20, kind=int, minimum=1)
        if rate > 20:
            self.problems.append(f"{where}: rate_per_minute {rate} is over the robots' limit of 20 per minute "
                                 "(over it DingTalk locks the robot for 10 minutes)")
        template = self.template(where, raw, "template")
        text_template = self.template(where, raw, "text_template")
        if token is None:
            return None
        return Target(name=name, type=kind, url=url, token=token, secret=secret, mention_mobiles=mobiles,
                      mention_userids=userids, mention_severities=mention_sev, mention_all_severities=all_sev,
                      format=fmt, rate_per_minute=rate, template=template, text_template=text_template,
                      **console)

    def robot_endpoint(self, where: str, raw: dict, kind: str) -> tuple[str, Secret | None, Secret | None]:
        """A robot target's URL, token and (DingTalk) signing secret."""
        url = raw.get("url", DEFAULT_URLS[kind])
        if not isinstance(url, str) or not re.match(r"^https?://[^\s]+$", url):
            self.problems.append(f"{where}: url must be an http(s) URL")
            url = DEFAULT_URLS[kind]
        elif re.search(rf"[?&]({TOKEN_PARAM[kind]}|sign|timestamp)=", url):
            # Never print the URL: it may hold the very token we refuse to keep in a plain file.
            self.problems.append(f"{where}: url must not carry {TOKEN_PARAM[kind]}/sign/timestamp; put the token "
                                 "in token_env or token_file (the relay adds it, and signs each request)")
        token = self.secret(where, raw, "token", required=True)
        secret = self.secret(where, raw, "secret", required=False)
        if secret is not None and kind == "wecom":
            self.problems.append(f"{where}: WeCom robots are not signed; remove secret_env/secret_file")
        return url, token, secret

    def console(self, where: str, raw: dict) -> tuple[str, str, Secret, None, dict]:
        """A console target: (robot style, url, token, secret, its own settings); it has no endpoint."""
        extra = sorted(ROBOT_ONLY_KEYS & set(raw))
        if extra:
            self.problems.append(f"{where}: a console target sends nothing; remove {extra}")
        style = raw.get("style", "dingtalk")
        if style not in ROBOT_TYPES:
            self.problems.append(f"{where}: style (the robot whose format to show) must be one of "
                                 f"{list(ROBOT_TYPES)}, got {style!r}")
            style = "dingtalk"
        show = raw.get("show", "rendered")
        if show not in CONSOLE_SHOW:
            self.problems.append(f"{where}: show must be one of {list(CONSOLE_SHOW)}, got {show!r}")
            show = "rendered"
        color = raw.get("color", "auto")
        if color not in CONSOLE_COLOR:
            self.problems.append(f"{where}: color must be one of {list(CONSOLE_COLOR)}, got {color!r}")
            color = "auto"
        path = self.path(where, "file", raw["file"]) if "file" in raw else None
        if path is not None and path.is_dir():
            self.problems.append(f"{where}: file {str(path)!r} is a directory")
        settings = {"style": style, "file": path, "show": show, "color": color}
        return style, "", Secret("", "none (console)"), None, settings

    def mapping(self, where: str, raw: Any, keys: set[str]) -> bool:
        """A mapping whose keys are all known (unknown ones are a problem, but the rest is still checked)."""
        if not isinstance(raw, dict):
            self.problems.append(f"{where}: must be a mapping")
            return False
        unknown = set(raw) - keys
        if unknown:
            self.problems.append(f"{where}: unknown key(s) {sorted(unknown)} (known: {sorted(keys)})")
        return True

    def matchers(self, where: str, raw_matchers: Any) -> list[Matcher]:
        """{label: value} for an exact match or {label: {regex: ...}} for a full-match regex."""
        matchers: list[Matcher] = []
        raw_matchers = raw_matchers or {}
        if not isinstance(raw_matchers, dict):
            self.problems.append(f"{where}: matchers must map label names to a value or {{regex: ...}}")
            raw_matchers = {}
        for label, want in raw_matchers.items():
            if not isinstance(label, str) or not LABEL_RE.match(label):
                self.problems.append(f"{where}: matchers: bad label name {label!r}")
                continue
            if isinstance(want, (str, int, float)) and not isinstance(want, bool):
                matchers.append(Matcher(label, str(want)))
            elif isinstance(want, dict) and set(want) == {"regex"} and isinstance(want["regex"], str):
                try:
                    matchers.append(Matcher(label, want["regex"], re.compile(want["regex"])))
                except re.error as e:
                    self.problems.append(f"{where}: matchers.{label}: regex does not compile: {e}")
            else:
                self.problems.append(f"{where}: matchers.{label} must be a value or {{regex: \"...\"}}")
        return matchers

    def route(self, i: int, raw: Any, targets: dict[str, Any]) -> Route | None:
        where = f"routes[{i}]"
        if not self.mapping(where, raw, ROUTE_KEYS):
            return None
        receivers = self.str_list(where, raw, "receivers", NAME_RE)
        if "targets" not in raw:
            self.problems.append(f"{where}: targets is missing (use [] to deliver nowhere on purpose)")
        route_targets = self.str_list(where, raw, "targets")
        for t in route_targets:
            if t not in targets:
                self.problems.append(f"{where}: unknown target {t!r} (targets: {sorted(targets)})")
        matchers = self.matchers(where, raw.get("matchers"))
        cont = raw.get("continue", False)
        if not isinstance(cont, bool):
            self.problems.append(f"{where}: continue must be true or false")
            cont = False
        return Route(receivers=receivers, matchers=tuple(matchers), targets=route_targets, continue_=cont)

    def delivery(self, raw: Any) -> Delivery:
        if raw is None:
            return Delivery()
        if not isinstance(raw, dict):
            self.problems.append("delivery must be a mapping")
            return Delivery()
        unknown = set(raw) - DELIVERY_KEYS
        if unknown:
            self.problems.append(f"delivery: unknown key(s) {sorted(unknown)} (known: {sorted(DELIVERY_KEYS)})")
        d = Delivery()
        return Delivery(
            max_attempts=self.number("delivery.", raw, "max_attempts", d.max_attempts, kind=int, minimum=1),
            initial_backoff_seconds=self.number("delivery.", raw, "initial_backoff_seconds",
                                                d.initial_backoff_seconds, minimum=0, above=True),
            max_backoff_seconds=self.number("delivery.", raw, "max_backoff_seconds", d.max_backoff_seconds,
                                            minimum=0, above=True),
            max_retry_seconds=self.number("delivery.", raw, "max_retry_seconds", d.max_retry_seconds, minimum=0),
            request_timeout_seconds=self.number("delivery.", raw, "request_timeout_seconds",
                                                d.request_timeout_seconds, minimum=0, above=True),
            drain_seconds=self.number("delivery.", raw, "drain_seconds", d.drain_seconds, minimum=0),
            queue_max_alerts=self.number("delivery.", raw, "queue_max_alerts", d.queue_max_alerts, kind=int,
                                         minimum=1),
            rate_window_seconds=self.number("delivery.", raw, "rate_window_seconds", d.rate_window_seconds,
                                            minimum=0, above=True),
        )


def parse_config(doc: Any, base_dir: Path | str = ".", environ: dict[str, str] | None = None,
                 origin: str = "relay config", secrets_needed: bool = True) -> RelayConfig:
    """Validate a parsed YAML document; RelayConfigError listing every problem otherwise.

    Relative paths (token files, templates, spool_dir) are taken relative to base_dir (the config's folder).
    With secrets_needed=False (previews, which send nothing) a secret that is not set is left empty.
    """
    loader = _Loader(Path(base_dir), dict(os.environ if environ is None else environ), secrets_needed)
    problems = loader.problems
    if not isinstance(doc, dict):
        raise RelayConfigError(["the document must be a mapping with 'targets' and 'routes'"], origin)
    unknown = set(doc) - TOP_KEYS
    if unknown:
        problems.append(f"unknown top-level key(s) {sorted(unknown)} (known: {sorted(TOP_KEYS)})")
    listen = doc.get("listen", "127.0.0.1:9095")
    try:
        parse_listen(str(listen))
    except ValueError:
        problems.append(f"listen must be HOST:PORT, got {listen!r}")
    bearer = loader.secret("webhook auth", doc, "bearer_token", required=False)
    max_body = loader.number("", doc, "max_body_bytes", MiB, kind=int, minimum=1024)
    spool_dir = loader.path("spool_dir", "spool_dir", doc["spool_dir"]) if "spool_dir" in doc else None
    if spool_dir is not None and spool_dir.exists() and not spool_dir.is_dir():
        problems.append(f"spool_dir {str(spool_dir)!r} is not a directory (alerts left at shutdown would be lost)")
    tz = doc.get("timezone", "UTC")
    try:
        zone(str(tz))
    except (ZoneInfoNotFoundError, ValueError):
        problems.append(f"timezone {tz!r} is not a known IANA zone (e.g. UTC, Asia/Shanghai)")
        tz = "UTC"
    delivery = loader.delivery(doc.get("delivery"))
    raw_targets = doc.get("targets")
    if not isinstance(raw_targets, dict) or not raw_targets:
        problems.append("targets must be a non-empty mapping of name: {type: dingtalk|wecom, ...}")
        raw_targets = {}
    targets = {}
    for name, raw in raw_targets.items():
        target = loader.target(name, raw)
        if target is not None:
            targets[name] = target
    raw_routes = doc.get("routes")
    if not isinstance(raw_routes, list) or not raw_routes:
        problems.append("routes must be a non-empty list of {receivers | matchers, targets, continue}")
        raw_routes = []
    routes = [loader.route(i, raw, raw_targets) for i, raw in enumerate(raw_routes)]
    actions = parse_actions(loader, doc.get("actions"))
    if problems:
        raise RelayConfigError(problems, origin)
    return RelayConfig(targets=targets, routes=tuple(r for r in routes if r is not None), listen=str(listen),
                       bearer_token=bearer, max_body_bytes=max_body, spool_dir=spool_dir, timezone=str(tz),
                       delivery=delivery, actions=actions)


def load_config(path: str | Path, environ: dict[str, str] | None = None, secrets_needed: bool = True) -> RelayConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or "not UTF-8 text"
        raise RelayConfigError([f"cannot read the config: {reason}"], str(path)) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RelayConfigError([f"not valid YAML: {e}"], str(path)) from None
    return parse_config(doc, base_dir=path.parent, environ=environ, origin=str(path), secrets_needed=secrets_needed)
