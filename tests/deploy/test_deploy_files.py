"""The deployment files under docker/: the image, the compose stack, Grafana provisioning, Kubernetes manifests.

No Docker engine or cluster runs here, so nothing is deployed: the files are checked against what they use.
Every path compose mounts exists; Prometheus and Alertmanager get the generated configs, and everything those
reference (rules, file_sd, the relay's URL, the sidecar's address) is provided; every command line uses only
subcommands and flags the real CLI accepts; the relay configs load with the real loader and route every
receiver of the generated alertmanager.yml; the image's health check is run against a real sidecar and a real
relay; promtool and amtool check the configs as compose mounts them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from conftest import REPO, free_port, http_get, require_tool, wait_for
from helpers import scaled
from verl_exporter.cli import build_parser
from verl_exporter.relay.config import RelayConfig, load_config
from verl_exporter.render import render_all
from verl_exporter.sidecar.config import DEFAULT_PORT
from verl_exporter.spec import load_spec

DOCKER = REPO / "docker"
K8S = DOCKER / "kubernetes"
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
ALERTMANAGER_YML = yaml.safe_load((REPO / "alertmanager/alertmanager.yml").read_text())
RECEIVERS = [r["name"] for r in ALERTMANAGER_YML["receivers"]]
PYPROJECT = (REPO / "pyproject.toml").read_text()
VERSION = re.search(r'^version = "([^"]+)"', PYPROJECT, re.M).group(1)
OUR_IMAGE = f"verl-exporter:{VERSION}"
PINNED_TAG = re.compile(r"^v?\d+\.\d+\.\d+(?:[-.][A-Za-z0-9.]+)?$")


# ---------------------------------------------------------------------------------------------- helpers
def split_image(image: str) -> tuple[str, str]:
    name, _, tag = image.rpartition(":")
    return (name, tag) if name and "/" not in tag else (image, "")


def compose_env(value) -> str:
    """A compose environment value as it is with nothing set in the shell: ${VAR:-default} -> default."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", str(value))


def service_env(name: str) -> dict[str, str]:
    env = SERVICES[name].get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: compose_env(v) for k, v in env.items()}


def mounts(service: str) -> list[tuple[str, str, bool]]:
    """(source, target, is a bind mount) of each volume of a service, short or long syntax."""
    out = []
    for v in SERVICES[service].get("volumes") or []:
        if isinstance(v, dict):
            source, target = v.get("source", ""), v["target"]
            bind = v.get("type") == "bind"
        else:
            parts = v.split(":")
            source, target = parts[0], parts[1]
            bind = source.startswith((".", "/", "~"))
        out.append((source, target, bind))
    return out


def host_path(source: str) -> Path:
    """A bind mount's source: compose takes relative paths from the compose file's folder."""
    return (DOCKER / source).resolve()


def to_host(service: str, container_path: str) -> Path | None:
    """Where a path inside a service's container comes from on the host, through its bind mounts."""
    best = None
    for source, target, bind in mounts(service):
        target = target.rstrip("/")
        covers = container_path == target or container_path.startswith(target + "/")
        if bind and covers and (best is None or len(target) > len(best[1])):
            best = (source, target)
    if best is None:
        return None
    rest = container_path[len(best[1]):].lstrip("/")
    return host_path(best[0]) / rest if rest else host_path(best[0])


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def listen_port(argv: list[str]) -> int | None:
    value = flag_value(argv, "--listen")
    return int(value.rsplit(":", 1)[1]) if value else None


def sharing_netns_with(service: str) -> list[str]:
    return [n for n, s in SERVICES.items() if s.get("network_mode") == f"service:{service}"]


def ours(service: dict) -> bool:
    return split_image(service.get("image", ""))[0] == "verl-exporter"


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in (DOCKER / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def instructions(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def healthcheck_argv() -> list[str]:
    (args,) = instructions("HEALTHCHECK")
    argv = json.loads(args.split(" CMD ", 1)[1])
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]]


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """(is an exception '!', pattern) of docker/Dockerfile.dockerignore, in Docker's matching semantics."""
    rules = []
    for raw in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern, regex, i = line.lstrip("!").strip().strip("/"), "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negate, re.compile(regex + r"\Z")))
    return rules


def ignored(rel: str) -> bool:
    """Is this path (relative to the build context) left out? The last matching rule wins; a rule matches a
    path when it matches the path or one of its parent folders."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for negate, regex in dockerignore_rules():
        if any(regex.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def k8s_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]


def k8s_doc(name: str, kind: str) -> dict:
    (doc,) = [d for d in k8s_docs(name) if d["kind"] == kind]
    return doc


def all_containers(pod_spec: dict) -> list[dict]:
    return list(pod_spec.get("initContainers") or []) + list(pod_spec.get("containers") or [])


SIDECAR_JOB = k8s_doc("sidecar.yaml", "Job")
SIDECAR_POD = SIDECAR_JOB["spec"]["template"]
(SIDECAR,) = [c for c in all_containers(SIDECAR_POD["spec"]) if c["image"].startswith("verl-exporter:")]
RELAY_DEPLOYMENT = k8s_doc("relay.yaml", "Deployment")
(RELAY_CONTAINER,) = RELAY_DEPLOYMENT["spec"]["template"]["spec"]["containers"]
RELAY_CONFIGMAP = k8s_doc("relay.yaml", "ConfigMap")


def k8s_relay_config(tmp_path: Path) -> tuple[RelayConfig, dict]:
    """The relay config of the ConfigMap, loaded with a dummy value for every variable the Deployment sets."""
    path = tmp_path / "relay.yaml"
    path.write_text(RELAY_CONFIGMAP["data"]["relay.yaml"])
    environ = {e["name"]: f"dummy-{e['name'].lower()}" for e in RELAY_CONTAINER.get("env", [])}
    return load_config(path, environ=environ), yaml.safe_load(path.read_text())


def env_names_used(doc) -> set[str]:
    """Every environment variable a relay config reads (*_env keys, at any depth)."""
    if isinstance(doc, dict):
        found = {v for k, v in doc.items() if k.endswith("_env") and isinstance(v, str)}
        return found.union(*(env_names_used(v) for v in doc.values()))
    if isinstance(doc, list):
        return set().union(*(env_names_used(v) for v in doc))
    return set()


def assert_routes_every_receiver(config: RelayConfig) -> None:
    unknown = [r for r in RECEIVERS if not config.knows_receiver(r)]
    assert not unknown, f"receivers of alertmanager.yml no relay route takes (they would get 404): {unknown}"
    for receiver in RECEIVERS:
        if receiver.endswith("-critical"):
            assert config.targets_for(receiver, {"severity": "critical"}), f"{receiver} pages nobody"


@cache
def cli_help(*sub: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "verl_exporter", *sub, "--help"], capture_output=True, text=True,
                          timeout=scaled(60))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def subcommands() -> set[str]:
    m = re.search(r"\{([a-z_,-]+)\}", cli_help())
    assert m, cli_help()
    return set(m.group(1).split(","))


def assert_cli_accepts(argv: list[str], where: str) -> None:
    """argv (after `verl-exporter`) uses a real subcommand and only flags its --help lists, and parses."""
    assert argv and argv[0] in subcommands(), f"{where}: {argv[:1]} is not a subcommand of {sorted(subcommands())}"
    sub, passthrough = argv[0], False
    for arg in argv[1:]:
        if arg == "--" and sub == "node":  # `node ... -- <serve flags>`: each child is a `serve`
            sub, passthrough = "serve", True
        elif arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", cli_help(sub)), \
                f"{where}: `verl-exporter {sub} --help` does not list {flag}"
    if passthrough:
        serve_args = argv[argv.index("--") + 1:]
        assert_cli_accepts(["serve", *serve_args], where)
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: verl-exporter's parser refuses {argv} (exit {e.code})")


def readme_commands() -> list[list[str]]:
    """The arguments after `verl-exporter` (or the image, `verl-exporter:<tag>`) in every shell line of the
    code blocks of docker/README.md, continuation lines joined."""
    out, in_code, pending = [], False, ""
    for line in (DOCKER / "README.md").read_text().splitlines():
        if line.strip().startswith("```"):
            in_code, pending = not in_code, ""
            continue
        if not in_code:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # not shell (JSON, YAML)
            continue
        for i, word in enumerate(words):
            tagged = i > 0 and words[i - 1] in ("-t", "--tag")  # `docker build -t verl-exporter:X .`
            if (word == "verl-exporter" or word.startswith("verl-exporter:")) and i + 1 < len(words) and not tagged:
                rest = words[i + 1:]
                if not rest[0].startswith("-"):
                    out.append(rest)
                break
    return out


# ------------------------------------------------------------------------------------------- the image
def test_dockerfile_base_is_a_pinned_slim_python():
    (base,) = instructions("FROM")
    name, tag = split_image(base.split()[0])
    assert name == "python" and re.match(r"^\d+\.\d+\.\d+-slim-[a-z]+$", tag), base


@pytest.mark.integration
def test_dockerfile_runs_the_cli_as_a_non_root_user():
    (entrypoint,) = instructions("ENTRYPOINT")
    (cmd,) = instructions("CMD")
    assert json.loads(entrypoint) == ["verl-exporter"]
    assert re.search(r'^verl-exporter = "verl_exporter\.cli:main"$', PYPROJECT, re.M), "the console script"
    assert_cli_accepts(json.loads(cmd), "Dockerfile CMD")
    (user,) = instructions("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: numeric and not root, so runAsNonRoot can check it"


def test_dockerfile_exposes_the_default_ports_and_enables_nvml():
    exposed = {int(p.split("/")[0]) for args in instructions("EXPOSE") for p in args.split()}
    relay_default_port = int(RelayConfig.model_fields["listen"].default.rsplit(":", 1)[1])
    assert exposed == {DEFAULT_PORT, relay_default_port} == {9477, 9095}
    env = dict(kv.split("=", 1) for args in instructions("ENV") for kv in shlex.split(args))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert env["VERL_EXPORTER_HEALTH_PORT"] == str(DEFAULT_PORT)
    assert f"'VERL_EXPORTER_HEALTH_PORT', '{DEFAULT_PORT}'" in instructions("HEALTHCHECK")[0], "its own default"


def test_dockerfile_installs_the_package_from_files_the_build_context_keeps():
    copied = [src for args in instructions("COPY") for src in shlex.split(args)[:-1] if not src.startswith("--")]
    assert {"pyproject.toml", "README.md", "exporter/"} <= set(copied)
    for src in copied:
        assert (REPO / src).exists(), src
        assert not ignored(src.rstrip("/")), f"{src} is copied but Dockerfile.dockerignore leaves it out"
    assert any("pip install --no-cache-dir ." in run for run in instructions("RUN"))
    for path in [".git/config", ".venv/bin/python", "tests/conftest.py", "bench/x.py", "exporter/x/__pycache__/y.pyc",
                 "exporter/verl_exporter.egg-info/PKG-INFO"]:
        assert ignored(path), f"{path} would be sent to the build"
    assert not ignored("exporter/verl_exporter/spec/metrics/00-spec.yaml")


@pytest.mark.integration
def test_the_build_context_is_enough_to_build_the_package(tmp_path):
    """What the image's `pip install .` sees (the COPY sources less the ignore list) builds a complete wheel."""
    pytest.importorskip("setuptools")
    context = tmp_path / "context"
    for src in ("pyproject.toml", "README.md"):
        (context / src).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / src, context / src)
    for path in (REPO / "exporter").rglob("*"):
        rel = path.relative_to(REPO).as_posix()
        if path.is_file() and not ignored(rel):
            (context / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, context / rel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(context)], capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("verl_exporter-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    spec_files = [p.relative_to(REPO / "exporter").as_posix()
                  for p in (REPO / "exporter/verl_exporter/spec/metrics").rglob("*.yaml")]
    for needed in ("verl_exporter/cli.py", *spec_files, "verl_exporter/tools/replay.py"):
        assert needed in names, f"{needed} missing from the wheel built from the image's context"
    assert any(n.startswith("verl_exporter/render/templates/") for n in names)


def run_healthcheck(port: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "VERL_EXPORTER_HEALTH_PORT": str(port)}
    return subprocess.run(healthcheck_argv(), env=env, capture_output=True, text=True, timeout=scaled(30))


@pytest.mark.integration
def test_the_image_healthcheck_passes_on_a_live_sidecar_and_fails_on_a_dead_port(serve):
    sidecar = serve()
    assert run_healthcheck(sidecar.port).returncode == 0
    assert run_healthcheck(free_port()).returncode != 0


# --------------------------------------------------------------------------------------- docker compose
def test_compose_has_the_stack_and_pins_every_image():
    assert set(SERVICES) == {"prometheus", "alertmanager", "grafana", "relay", "sidecar"}
    for name, service in SERVICES.items():
        _, tag = split_image(service.get("image", ""))
        assert tag and tag != "latest" and PINNED_TAG.match(tag), f"{name}: image {service.get('image')!r}"
        if ours(service):
            assert tag == VERSION, f"{name}: the image tag should be the package version {VERSION}"
            build = service["build"]
            assert host_path(build["context"]) == REPO and build["dockerfile"] == "docker/Dockerfile"
        else:
            assert "build" not in service, name
    assert {"relay", "sidecar"} == {n for n, s in SERVICES.items() if ours(s)}
    assert split_image(SERVICES["prometheus"]["image"])[1].startswith("v2.")
    assert split_image(SERVICES["alertmanager"]["image"])[1].startswith("v0.2")
    assert split_image(SERVICES["grafana"]["image"])[1].split(".")[0] in ("10", "11")


def test_compose_mounts_only_paths_that_exist_in_the_repo():
    declared = set(COMPOSE.get("volumes") or {})
    for name in SERVICES:
        for source, target, bind in mounts(name):
            assert target.startswith("/"), (name, target)
            if bind:
                path = host_path(source)
                assert path.is_relative_to(REPO), f"{name}: {source} is outside the repository"
                assert path.exists(), f"{name}: {source} does not exist (Docker would create an empty folder)"
            else:
                assert source in declared, f"{name}: named volume {source} is not declared"


def test_compose_publishes_ports_on_loopback_only():
    for name, service in SERVICES.items():
        for port in service.get("ports") or []:
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} would be reachable from the network"
        if "network_mode" in service:
            owner = service["network_mode"].removeprefix("service:")
            assert owner in SERVICES and "network_mode" not in SERVICES[owner], (name, service["network_mode"])
            assert "ports" not in service, f"{name} shares {owner}'s network: publish its ports there"


@pytest.mark.integration
def test_compose_commands_use_real_subcommands_and_flags():
    for name, service in SERVICES.items():
        if ours(service):
            assert isinstance(service["command"], list), f"{name}: give command as a list (no shell splitting)"
            assert_cli_accepts(service["command"], f"compose service {name}")
    sidecar = SERVICES["sidecar"]["command"]
    assert sidecar[0] == "demo" and "--exit-after-replay" not in sidecar, "the demo must keep serving"


def test_prometheus_gets_the_generated_config_and_everything_it_references():
    config_path = flag_value(SERVICES["prometheus"]["command"], "--config.file")
    source = to_host("prometheus", config_path)
    assert source == DOCKER / "prometheus/prometheus.yml"
    generated = render_all(load_spec(), REPO)
    assert source.read_text() == generated["docker/prometheus/prometheus.yml"], "not the generated file"
    config = yaml.safe_load(source.read_text())
    rule_files = set()
    for pattern in config["rule_files"]:
        host = to_host("prometheus", pattern)
        assert host is not None, f"{pattern}: no compose mount provides it"
        matched = sorted(host.parent.glob(host.name))
        assert matched, f"{pattern}: the mounted {host.parent} has no such file"
        rule_files.update(p.relative_to(REPO).as_posix() for p in matched)
    assert rule_files == {p for p in generated if p.startswith("rules/verl-") and p.endswith(".yaml")}
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            for pattern in sd["files"]:
                host = to_host("prometheus", pattern)
                assert host is not None and host.parent.is_dir(), f"{pattern}: no compose mount provides its folder"
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                if host in ("localhost", "127.0.0.1"):
                    listening = [n for n in sharing_netns_with("prometheus")
                                 if listen_port(SERVICES[n]["command"]) == int(port)]
                    assert listening, f"{target}: no service in Prometheus' network namespace listens there"
                else:
                    assert host in SERVICES, target
    for am in config["alerting"]["alertmanagers"]:
        for static in am["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in SERVICES and port == "9093", target


def test_alertmanager_gets_the_generated_config_and_reaches_the_relay():
    config_path = flag_value(SERVICES["alertmanager"]["command"], "--config.file")
    assert to_host("alertmanager", config_path) == REPO / "alertmanager/alertmanager.yml"
    relay_config = to_host("relay", flag_value(SERVICES["relay"]["command"], "--config"))
    listen = yaml.safe_load(relay_config.read_text())["listen"]
    for receiver in ALERTMANAGER_YML["receivers"]:
        for hook in receiver["webhook_configs"]:
            url = urlsplit(hook["url"])
            assert url.path == f"/alert/{receiver['name']}", hook["url"]
            assert url.port == int(listen.rsplit(":", 1)[1]), (hook["url"], listen)
            if url.hostname in ("127.0.0.1", "localhost"):
                assert SERVICES["relay"]["network_mode"] == "service:alertmanager"
                assert listen.rsplit(":", 1)[0] in ("0.0.0.0", "127.0.0.1"), listen
            else:
                assert url.hostname in SERVICES, hook["url"]


def test_the_compose_relay_config_loads_without_secrets_and_routes_every_receiver():
    path = to_host("relay", flag_value(SERVICES["relay"]["command"], "--config"))
    assert path == DOCKER / "relay/relay.yaml"
    env = service_env("relay")
    assert env["VERL_EXPORTER_HEALTH_PORT"] == yaml.safe_load(path.read_text())["listen"].rsplit(":", 1)[1]
    needed = env_names_used(yaml.safe_load(path.read_text()))
    assert needed <= set(env), f"relay.yaml reads {sorted(needed - set(env))}, which compose does not set"
    assert all(env[name] for name in needed), "every secret needs a default, so the stack starts without robots"
    config = load_config(path, environ=env)
    assert_routes_every_receiver(config)
    spool_volume = [t for s, t, bind in mounts("relay") if not bind]
    assert any(str(config.spool_dir).startswith(t) for t in spool_volume), "the spool is not on a volume"
    grace = SERVICES["relay"].get("stop_grace_period", "10s")
    assert config.delivery.drain_seconds < float(grace.removesuffix("s")), "killed before it can spool"


@pytest.mark.integration
def test_the_compose_relay_starts_healthy_without_secrets(tmp_path):
    """The relay as compose runs it (its config, the environment compose gives it with no secrets set)."""
    port = free_port()
    original = to_host("relay", flag_value(SERVICES["relay"]["command"], "--config"))
    # The same file, but with the spool in tmp_path: a stale spool on this machine must not be resent.
    spool = yaml.safe_load(original.read_text())["spool_dir"]
    config = tmp_path / "relay.yaml"
    config.write_text(original.read_text().replace(f"spool_dir: {spool}", f"spool_dir: {tmp_path / 'spool'}"))
    assert load_config(config, environ=service_env("relay")).spool_dir == tmp_path / "spool"
    env = {**os.environ, **service_env("relay")}
    argv = [sys.executable, "-m", "verl_exporter", *SERVICES["relay"]["command"], "--listen", f"127.0.0.1:{port}"]
    argv[argv.index("/etc/verl-relay/relay.yaml")] = str(config)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read().decode())
            try:
                return http_get(f"http://127.0.0.1:{port}/healthz", timeout=1)[0] == 200
            except OSError:
                return False

        wait_for(up, timeout=20)
        assert run_healthcheck(port).returncode == 0
        # Post only to receivers the config routes nowhere: nothing may leave this machine.
        loaded = load_config(config, environ=service_env("relay"))
        quiet = [r for r in RECEIVERS if not loaded.targets_for(r, {"severity": "info"}) and r.endswith("-info")]
        assert quiet
        body = json.dumps({"version": "4", "status": "firing", "receiver": quiet[0], "groupKey": "{}:{}",
                           "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "",
                           "alerts": [{"status": "firing", "labels": {"alertname": "VerlGPUPowerCapped",
                                                                      "severity": "info"},
                                       "annotations": {}, "startsAt": "2026-01-01T00:00:00Z",
                                       "endsAt": "0001-01-01T00:00:00Z"}]}).encode()
        for receiver, expected in ((quiet[0], 200), ("no-such-receiver", 404)):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/alert/{receiver}", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=scaled(5)) as resp:
                    status = resp.status
            except urllib.error.HTTPError as e:
                status = e.code
            assert status == expected, receiver
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=scaled(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_grafana_provisions_the_datasource_and_the_mounted_dashboards():
    provisioning = to_host("grafana", "/etc/grafana/provisioning")
    assert provisioning == DOCKER / "grafana/provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())["datasources"]
    assert datasource["uid"] == "prometheus" and datasource["type"] == "prometheus" and datasource["isDefault"]
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus" and url.port == 9090 and "prometheus" in SERVICES
    (provider,) = yaml.safe_load((provisioning / "dashboards/verl.yaml").read_text())["providers"]
    assert provider["type"] == "file"
    assert to_host("grafana", provider["options"]["path"]) == REPO / "dashboards"
    home = service_env("grafana")["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert to_host("grafana", home).is_file(), home
    assert service_env("grafana")["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def datasource_refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("datasource"), dict):
            yield node["datasource"]
        for value in node.values():
            yield from datasource_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from datasource_refs(value)


def test_every_dashboard_is_valid_json_on_the_datasource_variable():
    files = sorted((REPO / "dashboards").glob("*.json"))
    assert files
    for path in files:
        board = json.loads(path.read_text())
        assert board["uid"].startswith("verl-"), path.name
        variables = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
        assert [(v["name"], v["query"]) for v in variables] == [("datasource", "prometheus")], path.name
        for ref in datasource_refs(board):
            if ref.get("type") == "prometheus":
                assert ref.get("uid") == "${datasource}", f"{path.name}: {ref} cannot resolve under provisioning"


@pytest.mark.integration
def test_promtool_accepts_the_prometheus_config_as_compose_mounts_it(tmp_path):
    promtool = require_tool("promtool")
    for source, target, bind in mounts("prometheus"):
        if bind and target.startswith("/etc/prometheus/") and target != "/etc/prometheus/prometheus.yml":
            dest = tmp_path / target.removeprefix("/etc/prometheus/")
            if host_path(source).is_dir():
                shutil.copytree(host_path(source), dest)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(host_path(source), dest)
    config = to_host("prometheus", "/etc/prometheus/prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(config.replace("/etc/prometheus/", f"{tmp_path}/"))
    run = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS: 2 rule files found" in run.stdout + run.stderr


@pytest.mark.integration
def test_amtool_accepts_the_alertmanager_config_compose_mounts():
    amtool = require_tool("amtool")
    path = to_host("alertmanager", "/etc/alertmanager/alertmanager.yml")
    run = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stdout + run.stderr


def compose_cli() -> list[str] | None:
    """Docker Compose v2 (the plugin or a standalone binary): `config` needs no Docker engine."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]):
            proc = subprocess.run([*argv, "version"], capture_output=True, text=True, timeout=scaled(30))
            if proc.returncode == 0 and re.search(r"v?2\.\d+", proc.stdout):
                return argv
    return None


@pytest.mark.integration
def test_docker_compose_itself_accepts_the_file():
    argv = compose_cli()
    if argv is None:
        pytest.skip("Docker Compose v2 is not installed (optional: only `docker compose config` is run)")
    proc = subprocess.run([*argv, "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"], capture_output=True,
                          text=True, timeout=scaled(60),
                          env={k: v for k, v in os.environ.items() if not k.startswith("VERL_")})
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------- Kubernetes
def test_kubernetes_files_are_well_formed():
    files = sorted(K8S.glob("*.yaml"))
    assert {p.name for p in files} >= {"sidecar.yaml", "podmonitor.yaml", "relay.yaml", "relay-secret.example.yaml"}
    for path in files:
        for doc in k8s_docs(path.name):
            assert doc.get("apiVersion") and doc.get("kind"), path.name
            assert doc.get("metadata", {}).get("name"), f"{path.name}: {doc['kind']} has no metadata.name"
            assert doc["kind"] != "PrometheusRule", "the PrometheusRule is generated in rules/kubernetes/"
    rule = yaml.safe_load((REPO / "rules/kubernetes/verl-exporter.prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"


@pytest.mark.parametrize("pod_spec", [SIDECAR_POD["spec"], RELAY_DEPLOYMENT["spec"]["template"]["spec"]],
                         ids=["sidecar", "relay"])
@pytest.mark.integration
def test_kubernetes_probes_hit_healthz_on_a_declared_port(pod_spec):
    for c in all_containers(pod_spec):
        if not c["image"].startswith("verl-exporter:"):
            continue
        declared = {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
        probes = [c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c]
        assert {"livenessProbe", "readinessProbe"} <= set(c), c["name"]
        for probe in probes:
            assert probe["httpGet"]["path"].startswith("/healthz"), c["name"]
            assert probe["httpGet"]["port"] in declared, f"{c['name']}: probe port {probe['httpGet']['port']}"
        argv = c["args"]
        assert_cli_accepts(argv, f"kubernetes container {c['name']}")
        ports = [p["containerPort"] for p in c["ports"]]
        if argv[0] == "serve":
            assert listen_port(argv) in ports


@pytest.mark.integration
def test_the_sidecar_probe_paths_answer_on_a_live_sidecar(serve):
    sidecar = serve()
    kinds = ("startupProbe", "livenessProbe", "readinessProbe")
    for path in [SIDECAR[k]["httpGet"]["path"] for k in kinds if k in SIDECAR]:
        assert http_get(sidecar.url + path)[0] == 200, path


def non_root(pod_spec: dict, container: dict) -> tuple[bool, int | None]:
    merged = {**(pod_spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    return merged.get("runAsNonRoot") is True, merged.get("runAsUser")


@pytest.mark.parametrize("pod_spec", [SIDECAR_POD["spec"], RELAY_DEPLOYMENT["spec"]["template"]["spec"]],
                         ids=["sidecar", "relay"])
def test_kubernetes_runs_our_image_as_the_images_non_root_user(pod_spec):
    (user,) = instructions("USER")
    for c in all_containers(pod_spec):
        if c["image"].startswith("verl-exporter:"):
            assert c["image"] == OUR_IMAGE
            nonroot, uid = non_root(pod_spec, c)
            assert nonroot and uid == int(user.split(":")[0]), c["name"]
            assert c["securityContext"].get("allowPrivilegeEscalation") is False
            assert c.get("resources", {}).get("limits"), f"{c['name']}: no resource limits"


def test_the_sidecar_is_a_native_sidecar_with_its_rank_from_the_downward_api():
    assert SIDECAR in SIDECAR_POD["spec"]["initContainers"] and SIDECAR["restartPolicy"] == "Always"
    env = {e["name"]: e for e in SIDECAR["env"]}
    assert "fieldRef" in env["RANK"]["valueFrom"]
    labels = SIDECAR_POD["metadata"]["labels"]
    for e in SIDECAR["env"]:
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        m = re.match(r"metadata\.labels\['([^']+)'\]", field)
        if m and not m.group(1).startswith("batch.kubernetes.io/"):  # the Job controller sets its own
            assert m.group(1) in labels, f"{e['name']} reads pod label {m.group(1)}, which the template lacks"
    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(SIDECAR["args"])):
        assert ref in env, f"args use $({ref}), which only expands for a variable the container defines"
    trainer_mounts = {m["name"]: m["mountPath"] for c in SIDECAR_POD["spec"]["containers"]
                      for m in c.get("volumeMounts", [])}
    sidecar_mounts = {m["name"]: m["mountPath"] for m in SIDECAR["volumeMounts"]}
    for flag in ("--verl-log", "--checkpoint-dir"):
        path = flag_value(SIDECAR["args"], flag)
        (name,) = [n for n, p in sidecar_mounts.items() if path.startswith(p)]
        assert name in trainer_mounts, f"{flag} {path} is not on a volume shared with the trainer"


def test_the_podmonitor_scrapes_the_sidecar_port_as_the_job_the_rules_select():
    monitor = k8s_doc("podmonitor.yaml", "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= SIDECAR_POD["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (port,) = [p for p in SIDECAR["ports"] if p["containerPort"] == listen_port(SIDECAR["args"])]
    assert endpoint["port"] == port["name"] == "metrics"
    assert endpoint["interval"] == "15s"
    jobs = set(re.findall(r'job="([^"]+)"', (REPO / "rules/verl-alerts.yaml").read_text()))
    assert jobs == {"verl"}
    relabel = {r.get("targetLabel"): r.get("replacement") for r in endpoint["relabelings"]}
    assert relabel.get("job") == "verl", "the rules select job=\"verl\"; the Operator's default job would not match"
    dropped = [r["regex"] for r in endpoint["relabelings"] if r.get("action") == "labeldrop"]
    assert any(re.fullmatch(rx, "pod") for rx in dropped), "a per-pod label would stop the rules aggregating ranks"


def test_the_kubernetes_relay_config_loads_and_routes_every_receiver(tmp_path):
    config, raw = k8s_relay_config(tmp_path)
    assert_routes_every_receiver(config)
    assert config.bearer_token is not None, "a relay reachable in the cluster needs the webhook bearer token"
    port = int(config.listen.rsplit(":", 1)[1])
    (container_port,) = RELAY_CONTAINER["ports"]
    assert container_port["containerPort"] == port
    service = k8s_doc("relay.yaml", "Service")
    assert service["spec"]["selector"].items() <= RELAY_DEPLOYMENT["spec"]["template"]["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [container_port["name"]]
    config_dir = str(Path(flag_value(RELAY_CONTAINER["args"], "--config")).parent)
    volumes = {v["name"]: v for v in RELAY_DEPLOYMENT["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in RELAY_CONTAINER["volumeMounts"] if m["mountPath"] == config_dir]
    assert volumes[mount["name"]]["configMap"]["name"] == RELAY_CONFIGMAP["metadata"]["name"]
    assert any(str(config.spool_dir).startswith(m["mountPath"]) for m in RELAY_CONTAINER["volumeMounts"]
               if "emptyDir" in volumes[m["name"]] or "persistentVolumeClaim" in volumes[m["name"]])
    assert RELAY_DEPLOYMENT["spec"]["replicas"] == 1, "two relays would each spend the robots' rate limit"
    grace = RELAY_DEPLOYMENT["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    assert config.delivery.drain_seconds < grace, "killed before it can spool"


def test_the_kubernetes_relay_reads_secrets_only_from_the_secret(tmp_path):
    _, raw = k8s_relay_config(tmp_path)
    env = {e["name"]: e for e in RELAY_CONTAINER["env"]}
    assert env_names_used(raw) <= set(env)
    for e in RELAY_CONTAINER["env"]:
        assert "value" not in e, f"{e['name']} is a literal in the Deployment"
        assert set(e["valueFrom"]) == {"secretKeyRef"}, e["name"]
    assert "envFrom" not in RELAY_CONTAINER
    secret = k8s_doc("relay-secret.example.yaml", "Secret")
    keys = secret["stringData"]
    for e in RELAY_CONTAINER["env"]:
        ref = e["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys, e["name"]
    assert all(value == "REPLACE_ME" for value in keys.values()), "the example Secret holds placeholders only"
    assert "TEMPLATE" in (K8S / "relay-secret.example.yaml").read_text().splitlines()[0]


# ------------------------------------------------------------------------------------------------ README
@pytest.mark.integration
def test_docker_readme_commands_use_real_flags():
    commands = readme_commands()
    assert any(c[0] == "serve" for c in commands)
    for argv in commands:
        assert_cli_accepts(argv, f"docker/README.md: verl-exporter {' '.join(argv)}")


# ------------------------------------------------------------------------------------------ VictoriaMetrics
VM_COMPOSE = yaml.safe_load((DOCKER / "compose.victoriametrics.yaml").read_text())
VM_SERVICES: dict[str, dict] = VM_COMPOSE["services"]
VM_K8S = list(yaml.safe_load_all((K8S / "victoriametrics.yaml").read_text()))
SPEC_EVAL = load_spec().rules.evaluation_interval


def vm_host_path(service: str, container_path: str) -> Path:
    """Where a path inside a VictoriaMetrics compose service comes from on the host (its bind mounts)."""
    for v in VM_SERVICES[service].get("volumes") or []:
        source, target = v.split(":")[:2]
        if source.startswith(".") and (container_path == target or container_path.startswith(target + "/")):
            return host_path(source) / container_path[len(target):].lstrip("/")
    raise AssertionError(f"{service}: nothing mounted at {container_path}")


def vm_flags(argv: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.startswith(f"-{name}=")]


def vmagent_shards(services: dict[str, dict]) -> dict[str, list[str]]:
    return {n: s["command"] for n, s in services.items() if "vmagent" in s.get("image", "")}


def test_the_victoriametrics_compose_shards_scraping_and_wires_every_url():
    shards = vmagent_shards(VM_SERVICES)
    assert len(shards) == 2
    counts = {vm_flags(argv, "promscrape.cluster.membersCount")[0] for argv in shards.values()}
    assert counts == {str(len(shards))}, "every shard must agree on the number of shards"
    members = sorted(vm_flags(argv, "promscrape.cluster.memberNum")[0] for argv in shards.values())
    assert members == [str(i) for i in range(len(shards))], "each shard its own memberNum 0..N-1"
    listen = [vm_flags(argv, "httpListenAddr") for argv in shards.values()]
    assert len({tuple(x) for x in listen}) == len(shards), "shards sharing a namespace need their own ports"
    for name, argv in shards.items():
        (config,) = vm_flags(argv, "promscrape.config")
        assert vm_host_path(name, config) == REPO / "docker/victoriametrics/vmagent.yml"
        assert vm_flags(argv, "promscrape.fileSDCheckInterval"), "vmagent re-reads file_sd only every 5m otherwise"
        (url,) = vm_flags(argv, "remoteWrite.url")
        assert urlsplit(url).hostname in VM_SERVICES and urlsplit(url).port == 8428
        assert VM_SERVICES[name]["network_mode"] == "service:sidecar", "the static target localhost:9477"
    vmalert = VM_SERVICES["vmalert"]["command"]
    rules = [vm_host_path("vmalert", r) for r in vm_flags(vmalert, "rule")]
    assert rules == [REPO / "rules/verl-recording.yaml", REPO / "rules/verl-alerts.yaml"]
    assert vm_flags(vmalert, "evaluationInterval") == [SPEC_EVAL]
    for flag in ("datasource.url", "remoteWrite.url", "remoteRead.url", "notifier.url"):
        (url,) = vm_flags(vmalert, flag)
        assert urlsplit(url).hostname in VM_SERVICES, flag


@pytest.mark.integration
def test_vmagent_and_vmalert_accept_the_configs_compose_mounts(tmp_path):
    """vmagent's strict parser (it refuses fields it does not know, e.g. file_sd refresh_interval) and
    vmalert's dry run (the rules parse as MetricsQL) on the generated files."""
    vmagent, vmalert = require_tool("vmagent"), require_tool("vmalert")
    (name, argv), *_ = vmagent_shards(VM_SERVICES).items()
    config = vm_host_path(name, vm_flags(argv, "promscrape.config")[0])
    run = subprocess.run([vmagent, f"-promscrape.config={config}", "-promscrape.config.dryRun"],
                         capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stderr[-2000:]
    rules = [f"-rule={vm_host_path('vmalert', r)}" for r in vm_flags(VM_SERVICES["vmalert"]["command"], "rule")]
    run = subprocess.run([vmalert, "-dryRun", *rules], capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.integration
def test_the_victoriametrics_compose_commands_use_real_flags():
    for name, service in VM_SERVICES.items():
        if ours(service):
            assert_cli_accepts(service["command"], f"compose.victoriametrics.yaml {name}")


def vm_k8s(kind: str, name: str) -> dict:
    (doc,) = [d for d in VM_K8S if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.mark.integration
def test_the_kubernetes_victoriametrics_manifest_shards_and_loads_the_generated_rules(tmp_path):
    vmagent_set = vm_k8s("StatefulSet", "verl-vmagent")
    (agent,) = vmagent_set["spec"]["template"]["spec"]["containers"]
    assert vm_flags(agent["args"], "promscrape.cluster.membersCount") == [str(vmagent_set["spec"]["replicas"])]
    assert vm_flags(agent["args"], "promscrape.cluster.memberNum") == ["$(POD_NAME)"]  # verl-vmagent-<n>
    assert agent["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    service = vm_k8s("Service", "verl-victoria-metrics")
    for url in vm_flags(agent["args"], "remoteWrite.url"):
        assert urlsplit(url).hostname == service["metadata"]["name"]
    (alert,) = vm_k8s("Deployment", "verl-vmalert")["spec"]["template"]["spec"]["containers"]
    names = [Path(r).name for r in vm_flags(alert["args"], "rule")]
    assert names == ["verl-recording.yaml", "verl-alerts.yaml"] and all((REPO / "rules" / n).is_file() for n in names)
    header = (K8S / "victoriametrics.yaml").read_text()
    assert all(f"--from-file=rules/{n}" in header for n in names), "the ConfigMap command names every rule file"
    assert vm_flags(alert["args"], "evaluationInterval") == [SPEC_EVAL]
    vmagent = require_tool("vmagent")
    (tmp_path / "scrape.yml").write_text(vm_k8s("ConfigMap", "verl-vmagent")["data"]["scrape.yml"])
    run = subprocess.run([vmagent, f"-promscrape.config={tmp_path / 'scrape.yml'}", "-promscrape.config.dryRun"],
                         capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stderr[-2000:]
    (job,) = yaml.safe_load((tmp_path / "scrape.yml").read_text())["scrape_configs"]
    monitor = k8s_doc("podmonitor.yaml", "PodMonitor")
    label = next(iter(monitor["spec"]["selector"]["matchLabels"]))
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    sanitized = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)
    assert keeps[(sanitized,)] == monitor["spec"]["selector"]["matchLabels"][label], "selects what the PodMonitor does"
    assert keeps[("__meta_kubernetes_pod_container_port_name",)] == monitor["spec"]["podMetricsEndpoints"][0]["port"]
    assert job["job_name"] == "verl"
