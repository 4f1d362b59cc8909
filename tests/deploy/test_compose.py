"""compose.yaml agrees with the CLI, and validates with a compose client where one exists.

The cluster itself is brought up for real by scripts/compose-e2e (root and a Docker engine; not
part of this suite)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
OVERRIDE = ROOT / "deploy" / "compose.e2e.yaml"
ROLES = ("gateway", "prefill", "decode")


class _ComposeLoader(yaml.SafeLoader):
    """Also reads compose's merge tags (!reset, !override) as plain values."""


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_multi_constructor(_tag, lambda loader, _suffix, node: (
        loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else None))


def _services(path: Path = COMPOSE) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)["services"]


def _args(service: dict):
    cmd = service["command"]
    assert cmd[0] == "pdserve", cmd
    return build_parser().parse_args(cmd[1:])  # exits (SystemExit) on a flag the CLI does not have


def test_each_role_runs_its_own_command_with_flags_the_cli_accepts():
    services = _services()
    for role in ROLES:
        args = _args(services[role])
        assert args.command == role
        assert args.host == "0.0.0.0", f"{role} must listen beyond the container's loopback"
        assert args.log_format == "json"
        assert args.metrics_port == 9400


def test_ports_and_addresses_match_the_commands():
    s = _services()
    gateway = _args(s["gateway"])
    # The gateway's port is the one published and health-checked; the workers dial it by service name.
    assert [p.split(":")[-1] for p in s["gateway"]["ports"]] == [str(gateway.port)]
    assert s["gateway"]["healthcheck"]["test"] == ["CMD", "pdserve", "health", f"127.0.0.1:{gateway.port}"]
    for role in ("prefill", "decode"):
        worker = _args(s[role])
        assert worker.gateway == f"gateway:{gateway.port}"
        assert s[role]["healthcheck"]["test"] == ["CMD", "pdserve", "health", f"127.0.0.1:{worker.port}"]
        assert "ports" not in s[role], f"{role} is internal: nothing published"
        assert s[role]["depends_on"]["gateway"]["condition"] == "service_healthy"
        assert s[role]["environment"]["UCX_TLS"] == "tcp"
    assert all(s[name].get("init") is True for name in s), "every service needs init: true"


def test_traces_go_to_the_jaeger_service_otlp_port():
    s = _services()
    assert "16686:16686" in s["jaeger"]["ports"]
    for role in ROLES:
        assert s[role]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    override = _services(OVERRIDE)["jaeger"]
    assert override["command"][:3] == ["python", "-m", "pdserve.otlp_sink"]
    assert override["command"][override["command"].index("--port") + 1] == "4317"


def _compose_client() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, OVERRIDE]], ids=["compose", "compose+e2e"])
def test_compose_config_validates(files, tmp_path):
    client = _compose_client()
    if client is None:
        pytest.skip("no compose client here (docker compose or docker-compose)")
    argv = [*client, *(a for f in files for a in ("-f", str(f))), "config", "-q"]
    env = {**os.environ, "E2E_SPANS_DIR": str(tmp_path)}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
