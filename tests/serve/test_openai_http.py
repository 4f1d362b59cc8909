"""The gateway's OpenAI-compatible HTTP API, driven by the official ``openai`` client (and raw
httpx where the wire matters): the same outputs as the gRPC API, OpenAI's error shapes and status
codes, and no block left behind by a client that goes away mid-stream."""

from __future__ import annotations

import json
import socket

import grpc
import httpx
import openai
import pytest
from pdserve.services.gateway.gateway import GatewayError
from pdserve.services.gateway.openai_http import error_response

from pdserve import Client, SamplingParams
from pdserve.tokenizer import Tokenizer
from tests.helpers import assert_no_leaks, wait_until
from tests.serve.conftest import start_cluster

PROMPTS = ["Tell me about the sea.", "The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def http_cluster(tiny_model_dir):
    c = start_cluster(tiny_model_dir, prefill=1, decode=1, http=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def oai(http_cluster):
    with openai.OpenAI(
        base_url=f"http://{http_cluster.http_address}/v1", api_key="-", max_retries=0, timeout=30
    ) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(http_cluster):
    with Client(http_cluster.address, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_folder(tiny_model_dir)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
NO_EOS = {"ignore_eos": True}


def test_completions_greedy_equal_the_grpc_api_streamed_or_not(
    http_cluster, oai, grpc_client, tokenizer
):
    for prompt in [*PROMPTS, [5, 17, 300, 4000]]:
        expected = grpc_client.complete(prompt, GREEDY)
        whole = oai.completions.create(
            model=http_cluster.gateway.gateway.model_name,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body=NO_EOS,
        )
        chunks = list(
            oai.completions.create(
                model=whole.model,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=NO_EOS,
            )
        )
        assert whole.choices[0].text == expected.text
        assert whole.choices[0].finish_reason == "length"
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        n_prompt = len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))
        for usage in (whole.usage, chunks[-1].usage):
            assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
                n_prompt,
                12,
                n_prompt + 12,
            )
        assert not chunks[-1].choices  # include_usage: the usage rides alone, last
        assert all(c.usage is None for c in chunks[:-1])
    assert_no_leaks(http_cluster.live())


def test_chat_greedy_equals_the_grpc_api_streamed_or_not(http_cluster, oai, grpc_client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    expected = grpc_client.complete(messages, GREEDY)
    whole = oai.chat.completions.create(
        model="", messages=messages, max_completion_tokens=12, temperature=0, extra_body=NO_EOS
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
    assert whole.usage.completion_tokens == 12
    chunks = list(
        oai.chat.completions.create(
            model="",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body=NO_EOS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # without max_tokens, chat may run to the end of the context (4,096 tokens here)
    long = [{"role": "user", "content": "a " * 4000}]
    free = oai.chat.completions.create(model="", messages=long, temperature=0, extra_body=NO_EOS)
    assert free.choices[0].finish_reason == "length"
    assert free.usage.total_tokens == 4096
    assert_no_leaks(http_cluster.live())


def test_logprobs_match_the_grpc_api(http_cluster, oai, grpc_client):
    prompt = PROMPTS[0]
    expected = grpc_client.complete(
        prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    )
    got = oai.completions.create(
        model="", prompt=prompt, max_tokens=6, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in expected.logprobs])
    assert len(lp.tokens) == 6 and all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    chat = oai.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    assert_no_leaks(http_cluster.live())


def test_stop_string_ends_the_output_before_it(http_cluster, oai):
    prompt = PROMPTS[0]
    full = oai.completions.create(
        model="", prompt=prompt, max_tokens=24, temperature=0, extra_body=NO_EOS
    )
    text = full.choices[0].text
    start = next(
        i
        for i in range(len(text) // 2, len(text) - 3)
        if text.find(text[i : i + 3]) == i and text[i : i + 3].isprintable()
    )
    for stop in (text[start : start + 3], ["\x00never", text[start : start + 3]]):
        out = oai.completions.create(
            model="", prompt=prompt, max_tokens=24, temperature=0, stop=stop, extra_body=NO_EOS
        )
        assert (out.choices[0].text, out.choices[0].finish_reason) == (text[:start], "stop")
    assert_no_leaks(http_cluster.live())


def _error(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_n_other_than_1_is_400_in_openai_error_shape(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="", prompt="Hi", max_tokens=2, n=2)
    err = _error(e.value)
    assert e.value.status_code == 400
    assert (err["param"], err["type"], err["code"]) == (
        "n",
        "invalid_request_error",
        "invalid_argument",
    )


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 404
    assert "gpt-4" in _error(e.value)["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_k", -5),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("logprobs", 99),
        ("seed", "x"),
        ("seed", 2**70),
        ("top_k", 2**40),
        ("stop", [1, 2]),
        ("stop", ["s"] * 17),
        ("stop", ["s" * 257]),
        ("stop", ["a", ""]),
        ("stop", ""),
        ("temperature", 2.5),
        ("top_p", 1.01),
        ("logprobs", -1),
        ("logprobs", True),
        ("ignore_eos", "yes"),
        ("stream", "yes"),
        ("presence_penalty", 0.5),
        ("prompt", []),
        ("prompt", ["a", "b"]),
        ("prompt", {"text": "x"}),
        ("user", 5),
    ],
)
def test_a_bad_value_is_400_naming_the_field(http_cluster, oai, field, value):
    body = {"model": "", "prompt": "Hi", "max_tokens": 2, field: value}
    with pytest.raises(openai.BadRequestError) as e:
        oai.post("/completions", cast_to=object, body=body)
    err = _error(e.value)
    assert err["param"] == field
    assert field in err["message"]
    assert_no_leaks(http_cluster.live())


@pytest.mark.parametrize(
    "extra, param, message",
    [
        (dict(max_completion_tokens=0), "max_completion_tokens", "max_completion_tokens must be"),
        (dict(max_tokens=-3), "max_tokens", "max_tokens must be an integer >= 1, got -3"),
        (
            dict(logprobs=True, top_logprobs=21),
            "top_logprobs",
            "top_logprobs must be None or an integer in [0, 20], got 21",
        ),
        (dict(stop=["s"] * 17), "stop", "stop takes at most 16 strings, got 17"),
        (
            dict(messages=[{"role": "user", "content": "Hi"}] * 4097),
            "messages",
            "chat has 4097 messages; at most 4096 are allowed",
        ),
    ],
)
def test_a_bad_chat_value_is_400_naming_the_field_as_the_request_does(
    http_cluster, oai, extra, param, message
):
    body = {"model": "", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | extra
    with pytest.raises(openai.BadRequestError) as e:
        oai.post("/chat/completions", cast_to=object, body=body)
    err = _error(e.value)
    assert err["param"] == param
    assert message in err["message"]
    assert_no_leaks(http_cluster.live())


def test_the_user_field_is_the_affinity_key_and_a_bad_one_is_400(http_cluster):
    base = f"http://{http_cluster.http_address}/v1"
    body = {"prompt": "Hi", "max_tokens": 2}
    with httpx.Client(timeout=30) as h:
        r = h.post(f"{base}/completions", json=body | {"user": "u" * 129})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == ("user has 129 characters; at most 128 are allowed")
        r = h.post(f"{base}/completions", json=body | {"user": "session-7"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert_no_leaks(http_cluster.live())


def test_a_bad_request_id_header_is_400(http_cluster):
    base = f"http://{http_cluster.http_address}/v1"
    body = {"prompt": "Hi", "max_tokens": 2}
    with httpx.Client(timeout=30) as h:
        r = h.post(f"{base}/completions", json=body, headers={"x-request-id": "r" * 129})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "the X-Request-Id header has 129 characters; at most 128 are allowed"
        )
        r = h.post(f"{base}/completions", json=body, headers={"x-request-id": "r" * 128})
        assert r.status_code == 200 and r.json()["id"] == "cmpl-" + "r" * 128
    assert_no_leaks(http_cluster.live())


def test_a_prompt_past_the_context_or_vocabulary_is_400(oai):
    for prompt, words in (([5] * 4090, "exceeds"), ([10**7], "outside the vocabulary")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="", prompt=prompt, max_tokens=16)
        assert words in _error(e.value)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="", messages=[])
    assert _error(e.value)["param"] == "messages"


def test_malformed_json_too_large_body_and_unknown_routes(http_cluster):
    base = f"http://{http_cluster.http_address}/v1"
    with httpx.Client(timeout=30) as h:
        for raw in (b"{not json", b"\xff\xfe", b"[" * 100_000, b"[1, 2]"):
            r = h.post(f"{base}/completions", content=raw)
            assert r.status_code == 400, raw[:10]
            assert r.json()["error"]["type"] == "invalid_request_error"
        big = json.dumps({"prompt": "a" * (5 << 20)})
        r = h.post(f"{base}/completions", content=big)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        for raw in (b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "\\udc00"}]}'):
            r = h.post(f"{base}/chat/completions", content=raw)
            assert r.status_code == 400, raw
            assert "not valid Unicode" in r.json()["error"]["message"]
        r = h.post(f"{base}/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')
        assert r.status_code == 200  # a surrogate pair is a character (an emoji)
        for temperature in (b"NaN", b"Infinity", b"1e400"):  # the last one reads as inf
            raw = b'{"prompt": "Hi", "temperature": %s}' % temperature
            r = h.post(f"{base}/completions", content=raw)
            assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = h.get(f"{base}/completions")
        assert r.status_code == 405 and "error" in r.json()
        r = h.get(f"{base}/nothing")
        assert r.status_code == 404 and "error" in r.json()


def test_the_servers_connections_send_without_waiting_for_acks(http_cluster):
    """Nagle's algorithm is off (TCP_NODELAY) on the server's side of a connection: with it on,
    an answer's body (or a streamed token) waits on the client's delayed ACK of what went
    before, some 40 ms an answer."""
    host, port = http_cluster.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"max_model_len" not in answer:
            answer += sock.recv(65536)

        async def nodelay() -> list[int]:  # the connections uvicorn holds open (this one)
            connections = http_cluster.gateway.http._server.server_state.connections
            return [
                c.transport.get_extra_info("socket").getsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY
                )
                for c in connections
            ]

        flags = http_cluster.loop.run(nodelay())
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert flags and all(flags), flags


def test_models_lists_the_served_model(http_cluster, oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [http_cluster.gateway.gateway.model_name]


def test_raw_sse_stream_ends_with_done(http_cluster):
    body = {"prompt": "Hi", "max_tokens": 4, "stream": True, "ignore_eos": True, "temperature": 0}
    url = f"http://{http_cluster.http_address}/v1/completions"
    with httpx.Client(timeout=30) as h, h.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_client_disconnect_mid_stream_cancels_the_request(http_cluster):
    c = http_cluster
    body = {"prompt": "Hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    url = f"http://{c.http_address}/v1/completions"
    cancelled = c.gateway_metric("pdserve_requests_total", outcome="cancelled")
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url, json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
        # leaving the block closed the connection, with 3,999 tokens to go
    wait_until(
        lambda: c.gateway_metric("pdserve_requests_total", outcome="cancelled") == cancelled + 1,
        10,
        "the gateway to cancel the request",
    )
    assert_no_leaks(c.live())


def test_a_client_gone_before_its_answer_cancels_the_request(http_cluster):
    """A non-streaming request whose client leaves while the gateway collects its tokens:
    cancelled there (not generated to the end for nobody), nothing leaked, and the gateway
    serves the next request."""
    c = http_cluster
    body = {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}
    url = f"http://{c.http_address}/v1/completions"
    cancelled = c.gateway_metric("pdserve_requests_total", outcome="cancelled")
    ok = c.gateway_metric("pdserve_requests_total", outcome="ok")
    with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post(url, json=body)
    wait_until(
        lambda: c.gateway_metric("pdserve_requests_total", outcome="cancelled") == cancelled + 1,
        10,
        "the gateway to cancel the request",
    )
    assert c.gateway_metric("pdserve_requests_total", outcome="ok") == ok
    assert_no_leaks(c.live())
    with httpx.Client(timeout=30) as h:
        r = h.post(url, json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_no_worker_is_503_and_a_full_cluster_is_429_with_retry_after(tiny_model_dir):
    c = start_cluster(tiny_model_dir, prefill=0, decode=0, http=True)
    try:
        with openai.OpenAI(
            base_url=f"http://{c.http_address}/v1", api_key="-", max_retries=0
        ) as oai_:
            with pytest.raises(openai.InternalServerError) as e:
                oai_.completions.create(model="", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503
        assert _error(e.value)["code"] == "unavailable"
    finally:
        c.close()
    # the status table, for the codes a loopback cluster does not produce cheaply
    for code, status in (
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ):
        r = error_response(GatewayError(code, "x"))
        assert r.status_code == status
        assert ("retry-after" in r.headers) == (status == 429)
    assert error_response(RuntimeError("boom")).status_code == 500


def test_what_the_gateway_adds_is_measured_for_each_streamed_request(
    http_cluster, oai, grpc_client
):
    """pdserve_gateway_added_seconds{phase}: one observation per successful request and phase
    (arrival to first worker call, plus worker message to client connection), never more than
    the request's own TTFT (first) and latency (last) at the gateway."""
    c = http_cluster

    def count(phase: str) -> float:
        return c.gateway_metric("pdserve_gateway_added_seconds_count", phase=phase)

    def total(phase: str) -> float:
        return c.gateway_metric("pdserve_gateway_added_seconds_sum", phase=phase)

    before = {p: (count(p), total(p)) for p in ("first", "last")}
    ttft_before = c.gateway_metric("pdserve_ttft_seconds_sum")
    list(grpc_client.generate_stream("The capital of France is", GREEDY))
    stream = oai.completions.create(
        model="", prompt="1, 2, 3,", max_tokens=12, stream=True, extra_body=NO_EOS
    )
    assert len([ch for ch in stream]) >= 12
    ttft = c.gateway_metric("pdserve_ttft_seconds_sum") - ttft_before
    for phase in ("first", "last"):
        assert count(phase) - before[phase][0] == 2
        assert 0 < total(phase) - before[phase][1]
    assert total("first") - before["first"][1] < ttft


def test_a_finished_stream_counts_as_ok_not_cancelled(http_cluster, oai):
    c = http_cluster
    ok = c.gateway_metric("pdserve_requests_total", outcome="ok")
    cancelled = c.gateway_metric("pdserve_requests_total", outcome="cancelled")
    for chat in (False, True):
        if chat:
            messages = [{"role": "user", "content": "Hi"}]
            stream = oai.chat.completions.create(
                model="", messages=messages, max_tokens=4, stream=True, extra_body=NO_EOS
            )
        else:
            stream = oai.completions.create(
                model="", prompt="Hi", max_tokens=4, stream=True, extra_body=NO_EOS
            )
        assert [ch for ch in stream][-1].choices[-1].finish_reason == "length"
    assert c.gateway_metric("pdserve_requests_total", outcome="ok") == ok + 2
    assert c.gateway_metric("pdserve_requests_total", outcome="cancelled") == cancelled
