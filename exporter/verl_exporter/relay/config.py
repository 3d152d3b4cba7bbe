"""The relay's configuration: typed models (core.models) of the YAML file, and the objects the relay runs on.

The models say what the file may hold (``verl-exporter schema relay`` writes their JSON Schema); every problem of
a file is reported at once as ``FILE:LINE: key.path: message``, unknown keys included. Secrets (robot tokens,
DingTalk signing secrets, the webhook bearer token, action tokens) are given as ``*_env`` (a variable's name)
or ``*_file`` (a path) and read while the file is validated into ``Secret`` (pydantic's SecretStr), which
prints as ``<secret>``: a config object can be logged, repr'd or put in an exception safely, and a message names
the variable or file, never a value. The validated models are what the relay runs on (a target's secrets as
``token`` and ``secret``, the webhook's as ``bearer_token``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timezone, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NoReturn, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    AfterValidator,
    Field,
    PlainValidator,
    PrivateAttr,
    SecretStr,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails
from typing_extensions import Self

from ..core.models import FileError, KeyPath, Lines, StrictModel, json_schema, read_yaml, validate
from ..exposition.app import parse_listen
from ..spec import RulesConfig
from ..spec.rules import Severity

if TYPE_CHECKING:
    from .senders import SendResult

ROBOT_TYPES = ("dingtalk", "wecom", "lark")
# A console target sends nothing: it writes each message as its `style` robot would show it (previews, the demo).
TARGET_TYPES = (*ROBOT_TYPES, "console")
DEFAULT_URLS = {
    "dingtalk": "https://oapi.dingtalk.com/robot/send",
    "wecom": "https://qyapi.weixin.qq.com/cgi-bin/webhook/send",
    # Feishu; Lark's is https://open.larksuite.com/open-apis/bot/v2/hook, the same API
    "lark": "https://open.feishu.cn/open-apis/bot/v2/hook",
}
# The query parameter that carries each robot's token; it must come from a secret, never from `url`.
# (A Lark robot's token is the last segment of its webhook's path: `url` + "/" + token.)
TOKEN_PARAM = {"dingtalk": "access_token", "wecom": "key", "lark": ""}
MiB = 1024 * 1024
# Where the generated rules' runbook_url annotations point: the only runbook links shown by default.
DEFAULT_RUNBOOK_URLS = (RulesConfig.model_fields["runbook_url"].default,)


def zone(name: str) -> tzinfo:
    """An IANA zone; UTC without the tz database (slim images may lack it)."""
    return timezone.utc if name in ("UTC", "Etc/UTC") else ZoneInfo(name)


class RelayConfigError(FileError):
    """A config that cannot be used; ``problems`` lists every problem, each with its place."""


class Secret(SecretStr):
    """A credential: pydantic's SecretStr (only ``get_secret_value()`` gives the value) that says where it came
    from, prints as ``<secret>`` like the log scrubber's replacement, and cannot be pickled."""

    def __init__(self, value: str, source: str = ""):
        super().__init__(value)
        self.source = source  # where it came from ("env DINGTALK_TOKEN"): safe to print

    def _display(self) -> str:
        return "<secret>"

    def __repr__(self) -> str:
        return "<secret>"

    def __reduce__(self) -> NoReturn:  # pickling would copy the value somewhere we do not control
        raise TypeError("a Secret cannot be pickled")


# ---------------------------------------------------------------------------------------------- the running form
@dataclass(frozen=True)
class Matcher:
    label: str
    value: str
    regex: re.Pattern[str] | None = None

    def matches(self, labels: dict[str, str]) -> bool:
        got = labels.get(self.label, "")
        return bool(self.regex.fullmatch(got)) if self.regex else got == self.value


class Delivery(StrictModel):
    """Retry, drain and rate settings shared by every target."""

    max_attempts: int = Field(6, ge=1, description="attempts per message; then it is counted as failed and logged")
    initial_backoff_seconds: float = Field(1.0, gt=0, description="wait after the first retryable failure, "
                                                                  "doubled after each")
    max_backoff_seconds: float = Field(60.0, gt=0, description="the longest wait between attempts")
    max_retry_seconds: float = Field(300.0, ge=0, description="a message is given up after this long (the "
                                                              "robot's own lock-out lasts 10 minutes)")
    request_timeout_seconds: float = Field(10.0, gt=0, description="per request to a robot")
    drain_seconds: float = Field(10.0, ge=0, description="delivery time at shutdown before the rest is spooled; "
                                                         "keep below the pod's grace period (30 s by default)")
    queue_max_alerts: int = Field(10000, ge=1, description="per target; when full, webhooks get 503 and "
                                                           "Alertmanager retries")
    rate_window_seconds: float = Field(60.0, gt=0, description="the robots count messages per minute; tests "
                                                               "shrink it so a burst takes seconds")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based): doubling, capped."""
        return min(self.initial_backoff_seconds * 2.0 ** (attempt - 1), self.max_backoff_seconds)

    def should_retry(self, result: SendResult, attempt: int, elapsed: float) -> bool:
        """Retry a retryable failure while attempts and the total time per message allow it."""
        return (result.retryable and attempt < self.max_attempts
                and elapsed + self.backoff(attempt) <= self.max_retry_seconds)


# ---------------------------------------------------------------------------------------------- the file
# Validation context (parse_config): base_dir for relative paths, environ for *_env, secrets_needed (False for
# --preview: a secret that cannot be read is then an empty placeholder), targets (the names the file defines).
def _context(info: ValidationInfo) -> dict[str, Any]:
    return info.context or {"base_dir": Path("."), "environ": os.environ, "secrets_needed": True}


def _path(value: str, info: ValidationInfo) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else _context(info)["base_dir"] / path


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {str(path)!r}: {getattr(e, 'strerror', None) or 'not UTF-8 text'}") from None


def _env_secret(var: str, info: ValidationInfo) -> Secret:
    ctx = _context(info)
    value = ctx["environ"].get(var, "").strip()
    if value:
        return Secret(value, f"env {var}")
    if ctx["secrets_needed"]:
        raise ValueError(f"environment variable {var} is not set or empty")
    return Secret("", f"env {var} (not set)")


def _file_secret(name: str, info: ValidationInfo) -> Secret:
    path = _path(name, info)
    try:
        value = _read(path).strip()
    except ValueError:
        if _context(info)["secrets_needed"]:
            raise
        return Secret("", f"file {path} (not read)")
    if not value:
        raise ValueError(f"{str(path)!r} is empty")
    return Secret(value, f"file {path}")


def _template(name: str, info: ValidationInfo) -> str:
    from .format import TemplateError, check_template  # format imports this module

    path = _path(name, info)
    text = _read(path)
    try:
        check_template(text)
    except TemplateError as e:
        raise ValueError(f"{str(path)!r}: {e}") from None
    return text


def _console_file(name: str, info: ValidationInfo) -> Path:
    path = _path(name, info)
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory")
    return path


def _spool_dir(name: str, info: ValidationInfo) -> Path:
    path = _path(name, info)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory (alerts left at shutdown would be lost)")
    return path


def _match_value(value: Any) -> str | re.Pattern[str]:
    """A label value to match exactly, or {regex: ...} to full-match."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, dict) and set(value) == {"regex"} and isinstance(value["regex"], str):
        try:
            return re.compile(value["regex"])
        except re.error as e:
            raise ValueError(f"regex does not compile: {e}") from None
    raise ValueError('must be a value or {regex: "..."}')


T = TypeVar("T")
if TYPE_CHECKING:  # what a model holds: a tuple
    Listed = tuple[T, ...]
else:  # what the file gives: a list (strict validation takes no tuple from YAML)
    Listed = Annotated[list[T], AfterValidator(tuple)]
PathText = Annotated[str, StringConstraints(min_length=1)]
if TYPE_CHECKING:  # what the validators below make of the text
    EnvSecret = Secret
    FileSecret = Secret
    ConsoleFile = Path
    SpoolDir = Path
else:
    EnvSecret = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$"), AfterValidator(_env_secret)]
    FileSecret = Annotated[PathText, AfterValidator(_file_secret)]
    ConsoleFile = Annotated[PathText, AfterValidator(_console_file)]
    SpoolDir = Annotated[PathText, AfterValidator(_spool_dir)]
TemplateFile = Annotated[PathText, AfterValidator(_template)]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
LabelName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$")]
Mobile = Annotated[str, StringConstraints(pattern=r"^\+?[0-9][0-9-]{4,19}$")]
UserId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")]
HttpUrl = Annotated[str, StringConstraints(pattern=r"^https?://\S+$")]
MatchValue = Annotated[Any, PlainValidator(_match_value), WithJsonSchema({"anyOf": [
    {"type": ["string", "number"], "description": "the label's exact value"},
    {"type": "object", "properties": {"regex": {"type": "string"}}, "required": ["regex"],
     "additionalProperties": False, "description": "a regex the whole value must match"}]})]


def _matchers(raw: dict[str, str | re.Pattern[str]]) -> tuple[Matcher, ...]:
    return tuple(Matcher(k, v.pattern, v) if isinstance(v, re.Pattern) else Matcher(k, v) for k, v in raw.items())


if TYPE_CHECKING:
    Matchers = tuple[Matcher, ...]
else:  # given as {label: value or {regex: ...}}
    Matchers = Annotated[dict[LabelName, MatchValue], AfterValidator(_matchers)]


class _Secrets(StrictModel):
    """Each secret STEM is given as STEM_env or STEM_file, never both; those in ``_required`` must be given."""

    _required: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        for stem in ("token", "secret", "bearer_token"):
            env, file = f"{stem}_env", f"{stem}_file"
            if env not in type(self).model_fields:
                continue
            given = [k for k in (env, file) if getattr(self, k) is not None]
            if len(given) == 2:
                raise ValueError(f"give {env} or {file}, not both")
            if not given and stem in self._required:
                raise ValueError(f"give {env} (an environment variable) or {file}")
        return self

    def secret_of(self, stem: str) -> Secret | None:
        secret: Secret | None = getattr(self, f"{stem}_env", None) or getattr(self, f"{stem}_file", None)
        return secret

    def required_secret(self, stem: str) -> Secret:
        """A secret of ``_required``, which validation made sure is given."""
        secret = self.secret_of(stem)
        if secret is None:
            raise RuntimeError(f"{stem} was not validated")
        return secret


class _Token(_Secrets):
    _required: ClassVar[tuple[str, ...]] = ("token",)

    token_env: EnvSecret | None = Field(None, description="the environment variable holding the token")
    token_file: FileSecret | None = Field(None, description="the file holding the token (relative to this file)")


class _TargetBase(StrictModel):
    """What every target has: a console target formats exactly as its robot."""

    mention_mobiles: Listed[Mobile] = Field(
        default_factory=tuple, description="mobiles @-mentioned (DingTalk; WeCom in text messages)")
    mention_severities: Listed[Severity] = Field(
        ("critical",), description="mention only when a firing alert of these severities is in the message")
    mention_all_severities: Listed[Severity] = Field(
        default_factory=tuple, description="@all for these severities")
    format: Literal["markdown", "text"] = "markdown"
    rate_per_minute: int = Field(20, ge=1, le=20, description="messages a minute; over 20 DingTalk locks the "
                                                              "robot for 10 minutes")
    template: TemplateFile | None = Field(None, description="Jinja template (relative to this file) replacing "
                                                            "the default listing; checked at load")
    text_template: TemplateFile | None = Field(None, description="the same for the text fallback")
    # Not keys of the target: its name under `targets:` and the file's runbook_urls (a runbook_url under none of
    # these is not linked), given by the RelayConfig that holds it.
    _name: str = PrivateAttr("")
    _runbook_urls: tuple[str, ...] = PrivateAttr(DEFAULT_RUNBOOK_URLS)

    if TYPE_CHECKING:  # declared by each kind of target
        type: str

        @property
        def style(self) -> str: ...

        @property
        def token(self) -> Secret: ...

        @property
        def secret(self) -> Secret | None: ...

    @property
    def name(self) -> str:
        return self._name

    @property
    def runbook_urls(self) -> tuple[str, ...]:
        return self._runbook_urls

    def secrets(self) -> list[str]:
        """The values to scrub from any text before it is logged."""
        return [s.get_secret_value() for s in (self.token, self.secret) if s is not None and s.get_secret_value()]

    @property
    def robot(self) -> str:
        """The robot whose message format this target uses (dingtalk or wecom)."""
        return self.style or self.type

    def as_robot(self) -> Self:
        """This target as its robot for formatting: a console target formats exactly as its `style` robot."""
        return self.model_copy(update={"type": self.style}) if self.type == "console" else self


class _Robot(_TargetBase, _Token):
    KIND: ClassVar[str]
    # what only a console target sets
    style: ClassVar[str] = ""
    file: ClassVar[Path | None] = None  # None: standard output
    show: ClassVar[str] = "rendered"
    color: ClassVar[str] = "auto"

    @property
    def token(self) -> Secret:
        return self.required_secret("token")

    @property
    def secret(self) -> Secret | None:
        return self.secret_of("secret")

    @field_validator("url", check_fields=False)
    @classmethod
    def _bare(cls, url: str) -> str:
        # Never print the URL: it may hold the very token we refuse to keep in a plain file.
        param = TOKEN_PARAM[cls.KIND] or "token"
        if re.search(rf"[?&]({param}|sign|timestamp)=", url):
            raise ValueError(f"must not carry {param}/sign/timestamp; put the token in token_env "
                             "or token_file (the relay adds it, and signs each request)")
        return url


class DingTalkTarget(_Robot):
    """A DingTalk custom robot, signed when secret_env/secret_file is given."""

    KIND: ClassVar[str] = "dingtalk"
    type: Literal["dingtalk"]
    url: HttpUrl = Field(DEFAULT_URLS["dingtalk"], description="the robot's endpoint, without access_token")
    secret_env: EnvSecret | None = Field(None, description="the environment variable holding the SEC... secret")
    secret_file: FileSecret | None = Field(None, description="the file holding the SEC... secret")
    mention_userids: ClassVar[tuple[str, ...]] = ()  # DingTalk mentions by mobile


class WeComTarget(_Robot):
    """A WeCom group robot (not signed)."""

    KIND: ClassVar[str] = "wecom"
    type: Literal["wecom"]
    url: HttpUrl = Field(DEFAULT_URLS["wecom"], description="the robot's endpoint, without key")
    mention_userids: Listed[UserId] = Field(default_factory=tuple,
                                                                            description="user ids @-mentioned")


class LarkTarget(_Robot):
    """A Feishu/Lark custom bot (open.feishu.cn or open.larksuite.com), signed when secret_env/secret_file is
    given; mentions by open_id (ou_...), or everyone."""

    KIND: ClassVar[str] = "lark"
    type: Literal["lark"]
    url: HttpUrl = Field(DEFAULT_URLS["lark"], description="the webhook without its token: .../open-apis/bot/v2/hook")
    secret_env: EnvSecret | None = Field(None, description="the environment variable holding the signing secret")
    secret_file: FileSecret | None = Field(None, description="the file holding the signing secret")
    mention_userids: Listed[UserId] = Field(
        default_factory=tuple, description="open_ids (ou_...) @-mentioned")

    @model_validator(mode="after")
    def _no_mobiles(self) -> Self:
        if self.mention_mobiles:
            raise ValueError("a Lark custom bot cannot mention by mobile; use mention_userids (open_ids)")
        return self

    @field_validator("url")
    @classmethod
    def _no_token(cls, url: HttpUrl) -> HttpUrl:
        if not str(url).rstrip("/").endswith("/hook"):
            raise ValueError("must end in /hook: the token (the last segment of the webhook) goes in token_env "
                             "or token_file")
        return url


class ConsoleTarget(_TargetBase):
    """Sends nothing: writes each message as its `style` robot would get it."""

    type: Literal["console"]
    style: Literal["dingtalk", "wecom", "lark"] = Field("dingtalk", description="the robot whose format to show")
    show: Literal["rendered", "body"] = Field("rendered", description="as the chat shows it, or the JSON body")
    color: Literal["auto", "always", "never"] = "auto"
    file: ConsoleFile | None = Field(None, description="default: stdout")
    mention_userids: Listed[UserId] = Field(
        default_factory=tuple, description="user ids @-mentioned (style wecom; open_ids for style lark)")
    url: ClassVar[str] = ""  # it sends nothing: no endpoint, no secrets
    secret: ClassVar[None] = None

    @property
    def token(self) -> Secret:
        return Secret("", "none (console)")

    @model_validator(mode="after")
    def _userids(self) -> Self:
        if self.mention_userids and self.style == "dingtalk":
            raise ValueError("mention_userids is for WeCom; DingTalk robots mention by mobile")
        return self


Target = Annotated[DingTalkTarget | WeComTarget | LarkTarget | ConsoleTarget, Field(discriminator="type")]


class Route(StrictModel):
    """Matches when the receiver is in `receivers` (if given) and every matcher matches the alert's labels."""

    receivers: list[Name] = Field(default_factory=list, description="receiver names; none: any receiver")
    matchers: Matchers = Field(default=(), description="label: value, or label: {regex: ...}")
    targets: list[str] = Field(description="target names; [] delivers nowhere on purpose")
    continue_: bool = Field(False, alias="continue", description="let the routes below apply too")

    @model_validator(mode="after")
    def _known_targets(self, info: ValidationInfo) -> Self:
        known = (info.context or {}).get("targets")
        unknown = [] if known is None else [t for t in self.targets if t not in known]
        if unknown:
            raise ValueError(f"unknown target(s) {unknown} (targets: {sorted(known or ())})")
        return self

    def matches(self, receiver: str, labels: dict[str, str]) -> bool:
        if self.receivers and receiver not in self.receivers:
            return False
        return all(m.matches(labels) for m in self.matchers)


class Action(_Token):
    """For chosen alerts, ask a sidecar's control endpoint to checkpoint or stop the run (relay/actions.py)."""

    matchers: Matchers = Field(min_length=1, description="the alerts it acts on, e.g. {alertname: VerlX}")
    action: Literal["checkpoint", "stop", "forensics"] = Field(
        description="checkpoint or stop: asks the trainer (through its control file); forensics: the sidecar "
                    "captures the trainer's stacks and the relay pages its verdict (VerlHangForensics)")
    url: Annotated[HttpUrl, AfterValidator(lambda url: url.rstrip("/"))] = Field(
        description="the rank-0 sidecar, http(s)://HOST:PORT; /control/<action> is appended")
    cooldown_seconds: float = Field(1800.0, ge=0, description="act at most once per alert in this time")

    @property
    def token(self) -> Secret:
        return self.required_secret("token")

    def matches(self, labels: dict[str, str]) -> bool:
        return all(m.matches(labels) for m in self.matchers)

    def secrets(self) -> list[str]:
        return [self.token.get_secret_value()] if self.token.get_secret_value() else []


class RelayConfig(_Secrets):
    """relay.yaml: where Alertmanager's webhooks go (targets, routes) and what the relay does about them."""

    listen: str = Field("127.0.0.1:9095", description="HOST:PORT of the webhook, /healthz and /metrics")
    bearer_token_env: EnvSecret | None = Field(None, description="require this bearer token on webhooks")
    bearer_token_file: FileSecret | None = Field(None, description="the same, from a file")
    max_body_bytes: int = Field(MiB, ge=1024, description="larger webhook bodies get 413 (Alertmanager retries "
                                                          "them in vain): keep it over max_alerts x the largest "
                                                          "alert, 200 x ~2.2 KB in the generated config")
    spool_dir: SpoolDir | None = Field(
        None, description="journal of accepted alerts and leftovers at shutdown, resent at the next start")
    runbook_urls: Listed[HttpUrl] = Field(
        DEFAULT_RUNBOOK_URLS, description="an alert's runbook_url is a link only under one of these "
        "(same scheme, host and port; the path at or below); any other is shown as plain text. Default: the "
        "generated rules' runbook")
    timezone: str = Field("UTC", description="IANA zone of the times in messages, e.g. Asia/Shanghai")
    delivery: Delivery = Field(default_factory=Delivery)
    targets: dict[Name, Target] = Field(min_length=1, description="robots (and consoles) by name")
    routes: Listed[Route] = Field(
        min_length=1, description="evaluated per alert, in order; the first match decides unless it says "
                                  "continue: true")
    actions: Listed[Action] = Field(
        default_factory=tuple, description="checkpoint, stop and forensics requests")

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        try:
            parse_listen(value)
        except ValueError:
            raise ValueError(f"must be HOST:PORT, got {value!r}") from None
        return value

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            zone(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not a known IANA zone (e.g. UTC, Asia/Shanghai)") from None
        return value

    @field_validator("targets")
    @classmethod
    def _name_targets(cls, targets: dict[str, Target], info: ValidationInfo) -> dict[str, Target]:
        """Each target told its name and the runbook links it may show (set once, on targets just validated)."""
        urls = info.data.get("runbook_urls", DEFAULT_RUNBOOK_URLS)
        for name, t in targets.items():
            t._name, t._runbook_urls = name, urls
        return targets

    @property
    def bearer_token(self) -> Secret | None:
        return self.secret_of("bearer_token")

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
        if self.bearer_token is not None and self.bearer_token.get_secret_value():
            values.append(self.bearer_token.get_secret_value())
        values += [v for a in self.actions for v in a.secrets()]
        return values


def _hint(err: ErrorDetails, path: KeyPath) -> str | None:
    kind, last = err["type"], (path[-1] if path else "")
    if kind == "union_tag_invalid":
        return f"type must be one of {list(TARGET_TYPES)}, got {err['ctx']['tag']!r}"
    if kind == "union_tag_not_found":
        return f"type is missing (one of {list(TARGET_TYPES)})"
    if last == "[key]":
        return "not a label name" if "matchers" in path else "a name must be letters, digits, '.', '_' or '-'"
    if kind == "missing" and last == "targets" and path[0] == "routes":
        return "missing (use [] to deliver nowhere on purpose)"
    if kind == "less_than_equal" and last == "rate_per_minute":
        return (f"{err['input']} is over the robots' limit of 20 per minute (over it DingTalk locks the robot "
                "for 10 minutes)")
    if kind == "string_pattern_mismatch" and str(last).endswith("_env"):
        return "must be the name of an environment variable"
    if kind == "bool_type":
        return "must be true or false"
    return None


def _untagged(loc: KeyPath) -> KeyPath:
    """A location without the target type pydantic puts after the target's name."""
    if len(loc) > 2 and loc[0] == "targets" and loc[2] in TARGET_TYPES:
        return loc[:2] + loc[3:]
    return loc


def parse_config(doc: Any, base_dir: Path | str = ".", environ: dict[str, str] | None = None,
                 origin: str = "relay config", secrets_needed: bool = True,
                 lines: Lines | None = None) -> RelayConfig:
    """Validate a parsed YAML document; RelayConfigError listing every problem otherwise.

    Relative paths (token files, templates, spool_dir) are taken relative to base_dir (the config's folder).
    With secrets_needed=False (previews, which send nothing) a secret that is not set is left empty.
    """
    if not isinstance(doc, dict):
        raise RelayConfigError(["the document must be a mapping with 'targets' and 'routes'"], origin)
    targets = doc.get("targets")
    context = {"base_dir": Path(base_dir), "environ": os.environ if environ is None else environ,
               "secrets_needed": secrets_needed, "targets": set(targets) if isinstance(targets, dict) else set()}
    return validate(RelayConfig, doc, origin, lines, RelayConfigError, _hint, context, locate=_untagged)


def load_config(path: str | Path, environ: dict[str, str] | None = None, secrets_needed: bool = True) -> RelayConfig:
    doc, lines = read_yaml(path, RelayConfigError)
    return parse_config(doc, Path(path).parent, environ, str(path), secrets_needed, lines)


def schema() -> dict[str, Any]:
    """The JSON Schema of a relay config file."""
    return json_schema(RelayConfig, "verl-exporter relay config (relay.yaml)")
