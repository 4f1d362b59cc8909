"""compose.yaml and the Dockerfile agree with the CLI, and compose validates them where it exists.

The cluster itself is brought up for real by scripts/compose-e2e (root and a Docker engine; not
part of this suite)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
OVERRIDE = ROOT / "deploy" / "compose.e2e.yaml"
TLS_OVERRIDE = ROOT / "deploy" / "compose.tls.yaml"
DOCKERFILE = ROOT / "Dockerfile"
ROLES = ("gateway", "prefill", "decode")
WORKERS = ("prefill", "decode")


class _ComposeLoader(yaml.SafeLoader):
    """Also reads compose's merge tags (!reset, !override) as the plain values they carry."""


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(
        _tag,
        lambda loader, node: (
            loader.construct_sequence(node)
            if isinstance(node, yaml.SequenceNode)
            else loader.construct_mapping(node)
            if isinstance(node, yaml.MappingNode)
            else None
        ),
    )


def _services(path: Path = COMPOSE) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)["services"]


def _parse(cmd: list[str]):
    assert cmd[0] == "pdserve", cmd
    return build_parser().parse_args(cmd[1:])  # SystemExit on a flag or value the CLI does not take


def _args(service: dict):
    return _parse(service["command"])


def _health_target(service: dict) -> str:
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "pdserve", "health"], test
    assert _parse(test[1:]).command == "health"
    return test[3]


def test_each_role_runs_its_own_command_with_flags_the_cli_accepts():
    services = _services()
    for role in ROLES:
        args = _args(services[role])
        assert args.command == role
        assert args.host == "0.0.0.0", f"{role} must listen beyond the container's loopback"
        assert args.log_format == "json"
        assert args.metrics_port == 9400
    for role in WORKERS:
        args = _args(services[role])
        assert args.threads == 1
        assert args.kv_cache_bytes == 256 << 20
        assert args.transport == "ucx"
        # Replicas must not share a fixed advertised address: each registers its container's IP.
        assert args.advertise is None


def test_ports_health_checks_and_addresses_match_the_commands():
    s = _services()
    gateway = _args(s["gateway"])
    # The gateway's port is the one published and health-checked; the workers dial it by service name.
    # Its OpenAI-compatible HTTP API is published too.
    assert gateway.http_port > 0
    assert s["gateway"]["ports"] == [
        f"{gateway.port}:{gateway.port}",
        f"{gateway.http_port}:{gateway.http_port}",
    ]
    assert _health_target(s["gateway"]) == f"127.0.0.1:{gateway.port}"
    for role in WORKERS:
        worker = _args(s[role])
        assert worker.port != 0, f"{role} needs a fixed port for its health check"
        assert worker.gateway == f"gateway:{gateway.port}"
        assert _health_target(s[role]) == f"127.0.0.1:{worker.port}"
        assert "ports" not in s[role] and "container_name" not in s[role], (
            f"{role} must stay scalable and internal"
        )
        assert s[role]["depends_on"]["gateway"]["condition"] == "service_healthy"
        assert s[role]["environment"]["UCX_TLS"] == "tcp", "shared memory does not cross containers"
    assert s["gateway"]["depends_on"]["jaeger"]["condition"] == "service_healthy"
    assert all(s[name].get("init") is True for name in s), "every service needs init: true"
    for role in ROLES:  # a crashed or killed process comes back (not only a nonzero exit)
        assert s[role]["restart"] == "unless-stopped", role
    assert all("healthcheck" in s[name] for name in s), "every service needs a health check"


def test_every_pdserve_service_gets_the_cluster_token_from_the_environment_only():
    s = _services()
    for role in ROLES:
        assert s[role]["environment"]["PDSERVE_CLUSTER_TOKEN"].startswith(
            "${PDSERVE_CLUSTER_TOKEN:?"
        ), "compose must refuse to start without a token"
        assert _args(s[role]).cluster_token is None, "a flag would show the token in ps"


def test_tls_override_runs_mutual_tls_with_the_registry_on_its_own_port():
    base, tls = _services(), _services(TLS_OVERRIDE)
    gateway = _args(tls["gateway"])
    assert (gateway.host, gateway.port) == ("0.0.0.0", _args(base["gateway"]).port)
    assert gateway.registry_port not in (None, gateway.port)
    assert gateway.http_port == _args(base["gateway"]).http_port, "the HTTP API stays, as HTTPS"
    mount = "/etc/pdserve/tls"
    for role in ROLES:
        args = _args(tls[role])
        assert args.command == role
        assert all(
            getattr(args, f).startswith(mount + "/") for f in ("tls_ca", "tls_cert", "tls_key")
        )
        assert [v.rsplit(":", 2)[1:] for v in tls[role]["volumes"]] == [[mount, "ro"]]
        # the health check speaks TLS with the same files
        test = tls[role]["healthcheck"]["test"]
        health = _parse(test[1:])
        assert (health.tls_ca, health.tls_cert, health.tls_key) == (
            args.tls_ca,
            args.tls_cert,
            args.tls_key,
        )
        assert test[3] == _health_target(base[role])
    for role in WORKERS:
        args = _args(tls[role])
        assert args.gateway == f"gateway:{gateway.registry_port}"
        assert args.tls_cert.endswith("/worker.pem") and args.tls_key.endswith("/worker.key")
        assert {k: v for k, v in vars(args).items() if not k.startswith(("tls_", "gateway"))} == {
            k: v
            for k, v in vars(_args(base[role])).items()
            if not k.startswith(("tls_", "gateway"))
        }, "the override changes the TLS flags and the registry address only"


def test_traces_go_to_the_jaeger_service_otlp_grpc_port():
    s = _services()
    assert s["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    assert s["jaeger"]["ports"] == ["16686:16686"], "only the UI is published"
    for role in ROLES:
        endpoint = urlsplit(s[role]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port) == ("jaeger", 4317)
        assert _args(s[role]).otlp_endpoint is None, "one place for the endpoint: the environment"
    # In the e2e override the OTLP receiver takes Jaeger's name and port.
    sink = _services(OVERRIDE)["jaeger"]
    assert sink["command"][:3] == ["python", "-m", "pdserve.otlp_sink"]
    assert sink["command"][sink["command"].index("--port") + 1] == "4317"
    assert "4317" in " ".join(sink["healthcheck"]["test"])


def test_e2e_override_publishes_the_gateway_on_loopback_only():
    s = _services(OVERRIDE)
    gateway_port = _args(_services()["gateway"]).port
    [published] = s["gateway"]["ports"]
    assert published.startswith("127.0.0.1:") and published.endswith(f":{gateway_port}")
    assert s["jaeger"]["ports"] == []
    assert set(s) == {"jaeger", "gateway"}, "the workers run exactly as in compose.yaml"


def test_the_image_default_command_and_ports_match_compose():
    text = DOCKERFILE.read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    args = _parse(cmd)
    gateway = _args(_services()["gateway"])
    assert (args.command, args.host, args.port, args.http_port) == (
        "gateway",
        "0.0.0.0",
        gateway.port,
        gateway.http_port,
    )
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()}
    s = _services()
    assert exposed == {_args(s[r]).port for r in ROLES} | {
        _args(s[r]).metrics_port for r in ROLES
    } | {gateway.http_port}
    # The model is baked in where the CLI looks for it: PDSERVE_CACHE_DIR, set in the runtime stage.
    runtime = text.rsplit("\nFROM ", 1)[1]
    assert "PDSERVE_CACHE_DIR=/var/cache/pdserve" in runtime
    assert "COPY --from=build /var/cache/pdserve /var/cache/pdserve" in runtime


def _compose_v2() -> list[str] | None:
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    return None


@pytest.mark.parametrize(
    "files",
    [[COMPOSE], [COMPOSE, OVERRIDE], [COMPOSE, TLS_OVERRIDE]],
    ids=["compose", "compose+e2e", "compose+tls"],
)
def test_compose_config_validates(files, tmp_path):
    client = _compose_v2()
    if client is None:
        # docker-compose v1 reads neither the top-level name nor !reset/!override: v2 or nothing.
        pytest.skip("no compose v2 client here (`docker compose`)")
    argv = [*client, *(a for f in files for a in ("-f", str(f))), "config", "-q"]
    env = {
        **os.environ,
        "E2E_SPANS_DIR": str(tmp_path),
        "E2E_BUILD_CONTEXT": str(tmp_path),
        "DOCKER_CONFIG": str(tmp_path / "docker-config"),
        "PDSERVE_CLUSTER_TOKEN": "test-token",
        "PDSERVE_TLS_DIR": str(tmp_path),
    }
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr


def test_compose_merges_the_e2e_override_as_intended(tmp_path):
    client = _compose_v2()
    if client is None:
        pytest.skip("no compose v2 client here (`docker compose`)")
    env = {
        **os.environ,
        "E2E_SPANS_DIR": str(tmp_path),
        "E2E_BUILD_CONTEXT": str(tmp_path / "ctx"),
        "E2E_GATEWAY_PORT": "50999",
        "DOCKER_CONFIG": str(tmp_path / "docker-config"),
        "PDSERVE_CLUSTER_TOKEN": "test-token",
    }
    argv = [*client, "-f", str(COMPOSE), "-f", str(OVERRIDE), "config", "--format", "json"]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    s = json.loads(result.stdout)["services"]
    assert [(p["host_ip"], p["published"], p["target"]) for p in s["gateway"]["ports"]] == [
        ("127.0.0.1", "50999", 50051)
    ]
    assert "ports" not in s["jaeger"] or s["jaeger"]["ports"] == []
    assert "JAEGER_LISTEN_HOST" not in (s["jaeger"].get("environment") or {})
    assert s["jaeger"]["image"] == "pdserve:latest"
    assert s["gateway"]["build"]["context"] == str(tmp_path / "ctx")
    assert s["gateway"]["build"]["args"]["BASE_IMAGE"] == "local/pdserve-python-base"
    assert s["decode"]["command"] == _services()["decode"]["command"]
