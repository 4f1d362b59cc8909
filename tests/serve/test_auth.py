"""API keys and per-key limits over real gRPC: a gateway with a key file and real workers.

Every key has a prompt of 3 token ids, so a request's reservation is 3 + max_tokens."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import grpc
import httpx
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.services.gateway.auth import KeyFileError, KeyLimits, add_key
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.server import GatewayOptions, GatewayServer
from prometheus_client import generate_latest

from pdserve import Client, SamplingParams
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.helpers import assert_no_leaks, seat_held, wait_until

PROMPT = [1, 2, 3]
COST = 3 + 20  # PROMPT + max_tokens 20
KEYS = {
    "free": KeyLimits(),
    "rpm": KeyLimits(rpm=2),
    "conc": KeyLimits(concurrency=1),
    "tpm": KeyLimits(tpm=80),  # ten requests of 3 + 5 tokens
    "stop": KeyLimits(tpm=2 * COST - 1),  # one full reservation, and one used in part
    "cancel": KeyLimits(tpm=2 * COST - 1),
    "http": KeyLimits(rpm=1),
}


def params(max_tokens: int = 20, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "keys.json"
    plain = {kid: add_key(path, kid, limits) for kid, limits in KEYS.items()}
    return path, plain


@pytest.fixture(scope="module")
def c(module_cluster, keys):
    return module_cluster(prefill=1, decode=1, decode_seqs=1, api_keys_file=str(keys[0]), http=True)


def client(c, key: str | None) -> Client:
    return Client(c.address, timeout=30, api_key=key)


def key_metric(c, name: str, key: str, **labels: str) -> float:
    return c.gateway_metric(name, key=key, **labels)


def window(c, key: str) -> int:
    """The key's tokens in the limiter's window, read in the servers' loop."""

    async def read() -> int:
        return c.gateway.gateway.limiter.window_tokens(key)

    return c.loop.run(read())


def test_no_key_or_a_bad_key_is_unauthenticated_and_health_stays_open(c, keys):
    _, plain = keys
    cases = [
        (None, "missing API key: send the header (gRPC metadata) 'authorization: Bearer <key>'"),
        ("pds_not-a-key", "invalid API key"),
        (plain["free"] + "x", "invalid API key"),
    ]
    for key, message in cases:
        with client(c, key) as cl:
            for call in (lambda: cl.complete(PROMPT, params(2)), cl.list_models):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert (e.value.code(), e.value.details()) == (
                    grpc.StatusCode.UNAUTHENTICATED,
                    message,
                )
    with grpc.insecure_channel(c.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(
                generation_pb2.GenerateRequest(text="hi"),
                metadata=(("authorization", "Basic dXNlcjpwYXNz"),),
                timeout=10,
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert e.value.details() == "malformed authorization: expected 'Bearer <key>'"
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert c.gateway_metric("pdserve_auth_failures_total", reason="missing") == 2
    assert c.gateway_metric("pdserve_auth_failures_total", reason="invalid") == 4
    assert c.gateway_metric("pdserve_auth_failures_total", reason="malformed") == 1
    assert c.gateway_metric("pdserve_requests_total", outcome="unauthenticated") == 4


def test_a_good_key_is_served_and_counted_by_its_id(c, keys):
    _, plain = keys
    with client(c, plain["free"]) as cl:
        assert cl.list_models() == [c.model.name]
        out = cl.complete(PROMPT, params(5))
    assert (len(out.token_ids), out.finish_reason, out.usage.prompt_tokens) == (5, "length", 3)
    assert key_metric(c, "pdserve_key_requests_total", "free") == 1
    assert key_metric(c, "pdserve_key_tokens_reserved_total", "free") == 8
    assert key_metric(c, "pdserve_key_tokens_used_total", "free") == 8
    assert_no_leaks(c.live())


def test_over_requests_per_minute_is_resource_exhausted_with_retry_after(c, keys):
    _, plain = keys
    with client(c, plain["rpm"]) as cl:
        cl.complete(PROMPT, params(1))
        cl.complete(PROMPT, params(1))
        with pytest.raises(grpc.RpcError) as e:
            cl.complete(PROMPT, params(1))
    err = e.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("key 'rpm' is over its limit of 2 requests per minute")
    retry = dict(err.trailing_metadata())["retry-after"]
    assert 1 <= int(retry) <= 60
    assert key_metric(c, "pdserve_key_rejected_total", "rpm", reason="rpm") == 1
    assert key_metric(c, "pdserve_key_requests_total", "rpm") == 2


def test_over_concurrency_is_resource_exhausted_until_a_request_ends(c, keys):
    _, plain = keys
    with (
        client(c, plain["conc"]) as cl,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        with seat_held(c.live()["decode-0"][0]):  # the first request queues at the gateway
            first = pool.submit(cl.complete, PROMPT, params(2))
            wait_until(lambda: c.gateway_metric("pdserve_requests_waiting") == 1, 10, "queueing")
            assert key_metric(c, "pdserve_key_requests_running", "conc") == 1
            with pytest.raises(grpc.RpcError) as e:
                cl.complete(PROMPT, params(2))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details() == (
                "key 'conc' has 1 requests running, its limit; retry when one ends"
            )
            assert dict(e.value.trailing_metadata())["retry-after"] == "1"
        assert first.result(timeout=30).finish_reason == "length"
        assert cl.complete(PROMPT, params(2)).finish_reason == "length"
    assert key_metric(c, "pdserve_key_requests_running", "conc") == 0
    assert key_metric(c, "pdserve_key_rejected_total", "conc", reason="concurrency") == 1
    assert_no_leaks(c.live())


def test_tokens_per_minute_are_never_exceeded_by_32_concurrent_requests(c, keys):
    _, plain = keys

    def one(_: int) -> str:
        try:
            cl.complete(PROMPT, params(5))
            return "ok"
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert "over its limit of 80 tokens per minute" in e.details()
            assert 1 <= int(dict(e.trailing_metadata())["retry-after"]) <= 60
            return "refused"

    with client(c, plain["tpm"]) as cl, concurrent.futures.ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(one, range(32)))
    # each reserves 3 + 5 and uses all of it (ignore_eos): exactly 80 / 8 get in
    assert (outcomes.count("ok"), outcomes.count("refused")) == (10, 22)
    assert key_metric(c, "pdserve_key_tokens_reserved_total", "tpm") == 80
    assert key_metric(c, "pdserve_key_tokens_used_total", "tpm") == 80
    assert key_metric(c, "pdserve_key_rejected_total", "tpm", reason="tpm") == 22
    assert window(c, "tpm") == 80
    with client(c, plain["tpm"]) as cl, pytest.raises(grpc.RpcError) as e:
        cl.complete(PROMPT, params(78))  # 81 tokens: can never fit, retrying is pointless
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs 81 tokens (prompt 3 + max_tokens 78)" in e.value.details()
    assert_no_leaks(c.live())


def test_a_stop_string_refunds_the_unused_tokens_and_lets_the_next_request_in(c, keys):
    _, plain = keys
    with client(c, plain["free"]) as cl:
        head = cl.complete(PROMPT, params(3)).text  # greedy: the first 3 tokens' text
    assert head.strip(), "the tiny model's first tokens decode to text"
    with client(c, plain["stop"]) as cl:
        out = cl.complete(PROMPT, params(20, stop=(head[-2:],)))
        assert out.finish_reason == "stop" and len(out.token_ids) <= 3
        used = 3 + len(out.token_ids)
        assert key_metric(c, "pdserve_key_tokens_used_total", "stop") == used
        assert window(c, "stop") == used
        # without the refund the window would hold 23 and a second 23 would not fit in 45
        assert cl.complete(PROMPT, params(20)).finish_reason == "length"
        with pytest.raises(grpc.RpcError) as e:
            cl.complete(PROMPT, params(20))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_no_leaks(c.live())


def test_a_cancelled_request_refunds_what_it_did_not_use(c, keys):
    _, plain = keys
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=PROMPT),
        sampling=common_pb2.SamplingParams(max_tokens=20, ignore_eos=True),
    )
    md = (("authorization", f"Bearer {plain['cancel']}"),)
    with grpc.insecure_channel(c.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with seat_held(c.live()["decode-0"][0]):
            call = stub.Generate(request, metadata=md, timeout=30)
            wait_until(lambda: c.gateway_metric("pdserve_requests_waiting") == 1, 10, "queueing")
            assert window(c, "cancel") == COST
            call.cancel()
            wait_until(
                lambda: key_metric(c, "pdserve_key_requests_running", "cancel") == 0,
                10,
                "the cancelled request to end",
            )
        assert window(c, "cancel") == 3  # the prompt is charged
        assert key_metric(c, "pdserve_key_tokens_used_total", "cancel") == 3
        with client(c, plain["cancel"]) as cl:
            assert cl.complete(PROMPT, params(20)).finish_reason == "length"
    assert c.gateway_metric("pdserve_requests_total", outcome="cancelled") == 1
    assert_no_leaks(c.live())


def test_the_http_api_checks_the_same_keys_and_limits(c, keys):
    """OpenAI HTTP: no or a bad key is 401, a good one serves, over its rpm is 429 + Retry-After,
    all in OpenAI's error shape."""
    _, plain = keys
    url = f"http://{c.http_address}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=30) as h:
        for headers in ({}, {"Authorization": "Bearer pds_not-a-key"}):
            r = h.post(url, json=body, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "unauthenticated"
            assert h.get(f"http://{c.http_address}/v1/models", headers=headers).status_code == 401
        auth = {"Authorization": f"Bearer {plain['http']}"}
        r = h.post(url, json=body, headers=auth)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        r = h.post(url, json=body, headers=auth)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "resource_exhausted"
        assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert key_metric(c, "pdserve_key_rejected_total", "http", reason="rpm") == 1
    assert_no_leaks(c.live())


def test_metrics_name_the_key_id_never_the_key(c, keys):
    _, plain = keys
    text = generate_latest(c.gateway.gateway.metrics.registry).decode()
    assert 'pdserve_key_requests_total{key="free"}' in text
    for kid, key in plain.items():
        assert key not in text and key.removeprefix("pds_") not in text
        assert kid in text


def test_reload_adds_keys_and_a_bad_file_keeps_the_old_ones(c, keys):
    path, plain = keys
    saved = path.read_text()
    late = add_key(path, "late", KeyLimits())
    with client(c, late) as cl:
        with pytest.raises(grpc.RpcError) as e:
            cl.list_models()  # not reloaded yet
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

        async def reload() -> bool:
            return c.gateway.reload_keys()

        assert c.loop.run(reload())
        assert cl.list_models() == [c.model.name]
        try:
            path.write_text(json.dumps({"keys": [{"id": "x", "hash": "plaintext"}]}))
            with structlog.testing.capture_logs() as logs:
                assert not c.loop.run(reload())
            failed = [e for e in logs if e["event"] == "auth.reload_failed"]
            assert len(failed) == 1 and failed[0]["log_level"] == "error"
            assert "'hash' must be 'sha256:'" in failed[0]["error"]
            assert cl.list_models() == [c.model.name]  # the old keys stay
        finally:
            path.write_text(saved)
    with client(c, plain["free"]) as cl:
        assert cl.list_models() == [c.model.name]


def test_without_keys_the_gateway_is_open_and_says_so_loudly(cluster, tiny_model_dir):
    with structlog.testing.capture_logs() as logs:
        c = cluster(prefill=1, decode=1)
    warnings = [e for e in logs if e["event"] == "auth.disabled"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert "NO API KEYS CONFIGURED" in warnings[0]["message"]
    with client(c, None) as cl:
        assert cl.complete(PROMPT, params(2)).finish_reason == "length"
    with client(c, "pds_anything") as cl:  # a key is ignored, not refused
        assert cl.complete(PROMPT, params(2)).finish_reason == "length"
    assert_no_leaks(c.live())


def test_a_gateway_with_an_unreadable_key_file_does_not_start(tiny_model_dir, tmp_path):
    opts = GatewayOptions(
        model=str(tiny_model_dir),
        config=GatewayConfig(api_keys_file=str(tmp_path / "none.json")),
        metrics_port=-1,
        cluster_token="t",
    )
    with pytest.raises(KeyFileError, match=r"cannot read the API key file .*none.json"):
        asyncio.run(GatewayServer.start(opts))
