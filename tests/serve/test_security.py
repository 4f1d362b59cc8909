"""Who may register and serve, and TLS on every gRPC plane: real TLS handshakes with certificates
made for the test (pdserve.certs), in-process servers.

- mutual TLS: the gateway's Registry port and the workers' ports complete a handshake only with a
  certificate of the cluster CA; the public port serves TLS to any client that trusts the CA.
- cluster token: without mutual TLS, Register and Heartbeat need the token (UNAUTHENTICATED
  otherwise); a gateway with neither does not start.
"""

from __future__ import annotations

import os
import ssl
import stat

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from pdserve.services.gateway.server import GatewayOptions
from pdserve.services.main import RegistrationRefusedError, WorkerOptions, WorkerServer

from pdserve import Client, SamplingParams
from pdserve.certs import CertFiles, CertificateAuthority, make_cluster_certs
from pdserve.config import CacheConfig, EngineConfig
from pdserve.tls import TOKEN_METADATA_KEY, TLSConfig
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers import assert_no_leaks, worker_stats
from tests.serve.conftest import KV_CACHE_BYTES, start_cluster


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, CertFiles]:
    return make_cluster_certs(tmp_path_factory.mktemp("cluster-tls"))


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> CertFiles:
    """A certificate for the same hosts from a CA the cluster does not trust."""
    return CertificateAuthority(tmp_path_factory.mktemp("rogue-tls")).issue("rogue")


@pytest.fixture(scope="module")
def tls_cluster(tiny_model_dir, certs):
    """gateway (TLS on gRPC and HTTP; Registry on a mutual-TLS port, no token) + 1 prefill +
    1 decode (mutual TLS)."""
    c = start_cluster(tiny_model_dir, prefill=1, decode=1, certs=certs, http=True)
    yield c
    c.close()


def _mutual(files: CertFiles, ca: CertFiles | None = None) -> grpc.ChannelCredentials:
    """Present ``files``' certificate, trust ``ca``'s CA (default: the one that issued it)."""
    return grpc.ssl_channel_credentials(
        root_certificates=(ca or files).ca.read_bytes(),
        private_key=files.key.read_bytes(),
        certificate_chain=files.cert.read_bytes(),
    )


def _server_only(ca: CertFiles) -> grpc.ChannelCredentials:
    """Trust the cluster CA but present no certificate (what a public client has)."""
    return grpc.ssl_channel_credentials(root_certificates=ca.ca.read_bytes())


def _register(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    worker_id: str = "intruder",
    metadata: tuple[tuple[str, str], ...] = (),
    compat_hash: str = "x",
) -> worker_pb2.RegisterResponse:
    request = worker_pb2.RegisterRequest(
        worker_id=worker_id,
        role="decode",
        address="127.0.0.1:1",
        layout=common_pb2.KVLayout(model="tiny-llama", compat_hash=compat_hash),
    )
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        return worker_pb2_grpc.RegistryStub(channel).Register(
            request, timeout=10, metadata=metadata
        )


def _forget(cluster, worker_id: str) -> None:
    """Drop a worker a test registered by hand (its address serves nothing)."""

    async def forget() -> None:
        w = cluster.gateway.registry.workers.pop(worker_id)
        await w.channel.close()

    cluster.loop.run(forget())


def _layout(cluster) -> str:
    """The KV layout hash of the cluster's workers (a registration with another is refused)."""
    return next(iter(cluster.gateway.registry.workers.values())).compat_hash


def _registered(cluster) -> set[str]:
    return set(cluster.gateway.registry.workers)


def _alive(cluster) -> set[str]:
    return {i for i, w in cluster.gateway.registry.workers.items() if w.alive}


# --- mutual TLS ---------------------------------------------------------------------------------


def test_requests_over_tls_succeed_with_the_ca_and_every_hop_is_mutual_tls(tls_cluster, certs):
    c = tls_cluster
    assert c.gateway.registry_port != c.gateway.port
    assert {w.role for w in c.gateway.registry.workers.values()} == {"prefill", "decode"}
    with Client(c.address, timeout=30, tls_ca=str(certs["gateway"].ca)) as client:
        out = client.complete([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out.token_ids) == 6
        assert client.list_models() == ["tiny-llama"]
    assert_no_leaks(c.live(), credentials=_mutual(certs["gateway"]))


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate", "plaintext"])
def test_registry_refuses_a_client_without_the_cluster_certificate(tls_cluster, certs, rogue, who):
    c = tls_cluster
    before = _registered(c)
    credentials = {
        "no certificate": _server_only(certs["gateway"]),
        "another CA's certificate": _mutual(rogue, ca=certs["gateway"]),
        "plaintext": None,
    }[who]
    with pytest.raises(grpc.RpcError) as e:
        _register(c.gateway.registry_address, credentials)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no RPC ran
    assert _registered(c) == before
    # the Registry keeps serving the cluster's own certificate holders
    ok = _register(c.gateway.registry_address, _mutual(certs["worker"]), "ok", (), _layout(c))
    assert ok.lease_ms > 0
    _forget(c, "ok")


def test_a_worker_certificate_registers_and_no_token_is_needed_with_mutual_tls(tls_cluster, certs):
    c = tls_cluster
    worker = _mutual(certs["worker"])
    resp = _register(c.gateway.registry_address, worker, "by-certificate", (), _layout(c))
    assert resp.lease_ms == int(c.gateway.registry.lease_s * 1000)
    assert "by-certificate" in _registered(c)
    _forget(c, "by-certificate")


def test_the_public_port_does_not_serve_the_registry_when_it_has_its_own(tls_cluster, certs):
    c = tls_cluster
    with pytest.raises(grpc.RpcError) as e:
        _register(c.address, _mutual(certs["worker"]))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_to_a_tls_port_fails_cleanly_and_the_port_keeps_serving(tls_cluster, certs):
    c = tls_cluster
    with Client(c.address, timeout=5) as plaintext, pytest.raises(grpc.RpcError) as e:
        plaintext.list_models()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with Client(c.address, timeout=30, tls_ca=str(certs["gateway"].ca)) as client:
        assert len(client.complete("Hi", SamplingParams(max_tokens=3)).token_ids) > 0
    assert_no_leaks(c.live(), credentials=_mutual(certs["gateway"]))


def test_the_openai_api_serves_https_with_the_gateway_certificate(tls_cluster, certs):
    c = tls_cluster
    ca = str(certs["gateway"].ca)
    with Client(c.address, timeout=30, tls_ca=ca) as client:
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        want = client.complete([5, 6, 7, 8], greedy)
    verify = ssl.create_default_context(cafile=ca)
    http = httpx.Client(verify=verify)
    api = openai.OpenAI(base_url=f"https://{c.http_address}/v1", api_key="-", http_client=http)
    with api:
        got = api.completions.create(
            model="tiny-llama",
            prompt=[5, 6, 7, 8],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == 6
    assert_no_leaks(c.live(), credentials=_mutual(certs["gateway"]))


def test_plaintext_http_to_the_https_port_fails_cleanly_and_it_keeps_serving(tls_cluster, certs):
    c = tls_cluster
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{c.http_address}/v1/models", timeout=5)
    with pytest.raises(httpx.ConnectError):  # an HTTPS client that does not trust the CA
        httpx.get(f"https://{c.http_address}/v1/models", timeout=5)
    verify = ssl.create_default_context(cafile=str(certs["gateway"].ca))
    r = httpx.get(f"https://{c.http_address}/v1/models", timeout=5, verify=verify)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["tiny-llama"]


def test_a_client_that_does_not_trust_the_ca_is_refused(tls_cluster, rogue):
    with Client(tls_cluster.address, timeout=5, tls_ca=str(rogue.ca)) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.list_models()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate", "plaintext"])
def test_worker_ports_serve_only_cluster_certificate_holders(tls_cluster, certs, rogue, who):
    c = tls_cluster
    credentials = {
        "no certificate": _server_only(certs["gateway"]),
        "another CA's certificate": _mutual(rogue, ca=certs["gateway"]),
        "plaintext": None,
    }[who]
    for address, role in c.live().values():
        with pytest.raises(grpc.RpcError) as e:
            worker_stats(address, role, credentials=credentials)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert worker_stats(address, role, credentials=_mutual(certs["gateway"])).num_total_blocks


def test_certificates_are_for_loopback_and_keys_are_private(certs):
    for files in certs.values():
        assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "localhost" in san.get_values_for_type(x509.DNSName)
        assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1"}


# --- cluster token ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "message"),
    [(None, "no cluster token"), ("wrong", "wrong cluster token"), ("", "no cluster token")],
)
def test_registration_without_the_right_token_is_unauthenticated(cluster, token, message):
    c = cluster(prefill=0, decode=0)
    metadata = () if token is None else ((TOKEN_METADATA_KEY, token),)
    with pytest.raises(grpc.RpcError) as e:
        _register(c.gateway.registry_address, None, metadata=metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert e.value.details().startswith(message)
    assert _registered(c) == set()
    # Heartbeats need it too (else anyone could keep a dead worker listed)
    with grpc.insecure_channel(c.gateway.registry_address) as ch, pytest.raises(grpc.RpcError) as e:
        worker_pb2_grpc.RegistryStub(ch).Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="x"), timeout=10, metadata=metadata
        )
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_deregistration_needs_the_token_so_nobody_else_can_evict_a_worker(cluster):
    c = cluster(prefill=0, decode=1)
    (worker_id,) = _registered(c)
    request = worker_pb2.DeregisterRequest(worker_id=worker_id, reason="evil")
    with grpc.insecure_channel(c.gateway.registry_address) as ch:
        stub = worker_pb2_grpc.RegistryStub(ch)
        for metadata in ((), ((TOKEN_METADATA_KEY, "wrong"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Deregister(request, timeout=10, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _alive(c) == {worker_id}
        ok = stub.Deregister(request, timeout=10, metadata=((TOKEN_METADATA_KEY, c.token),))
    assert ok.known


def test_registration_with_the_token_works(cluster):
    c = cluster(prefill=0, decode=0)
    metadata = ((TOKEN_METADATA_KEY, c.token),)
    assert _register(c.address, None, "with-token", metadata).lease_ms > 0
    assert _registered(c) == {"with-token"}
    _forget(c, "with-token")


def test_a_worker_with_a_wrong_token_is_refused_and_stops(cluster, tiny_model_dir):
    c = cluster(prefill=0, decode=0)
    opts = WorkerOptions(
        role="decode",
        engine=EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            threads=1,
            cache=CacheConfig(kv_cache_bytes=KV_CACHE_BYTES),
        ),
        gateway=c.gateway.registry_address,
        transport="loopback",
        metrics_port=-1,
        cluster_token="not-" + c.token,
    )
    with pytest.raises(RegistrationRefusedError, match="wrong cluster token"):
        c.loop.run(WorkerServer.start(opts))
    assert _registered(c) == set()


# --- configuration ------------------------------------------------------------------------------


def test_a_gateway_with_neither_token_nor_mutual_tls_registry_does_not_start(certs):
    g = certs["gateway"]
    server_tls = TLSConfig(cert=str(g.cert), key=str(g.key))
    mutual = TLSConfig(cert=str(g.cert), key=str(g.key), ca=str(g.ca))
    for opts in (
        dict(),
        dict(tls=server_tls, registry_port=0),  # TLS, but no client certificates asked for
        dict(tls=mutual),  # client certificates are not required on the public port
    ):
        with pytest.raises(ValueError, match="worker registration must be authenticated"):
            GatewayOptions(model="m", **opts)
    GatewayOptions(model="m", tls=mutual, registry_port=0)
    GatewayOptions(model="m", cluster_token="t")


def test_tls_options_are_checked_together(certs):
    g = certs["gateway"]
    with pytest.raises(ValueError, match="give both or neither"):
        TLSConfig(cert=str(g.cert))
    with pytest.raises(ValueError, match="needs this process's own certificate"):
        TLSConfig(ca=str(g.ca))
    with pytest.raises(ValueError, match="a worker's TLS is mutual"):
        WorkerOptions(
            role="decode", engine=EngineConfig("m"), tls=TLSConfig(str(g.cert), str(g.key))
        )
