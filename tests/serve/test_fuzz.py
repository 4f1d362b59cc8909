"""The gateway's front door, fuzzed: malformed and out-of-range requests to both APIs, over real
servers (one gateway serving gRPC and HTTP, a prefill and a decode worker, in this process).

HTTP: a request that is wrong in any way gets a 4xx answer in OpenAI's error shape, never a 5xx
and never a hang; a body with exactly one field out of range is a 400 naming that field.
gRPC: a request built from random field values ends OK, INVALID_ARGUMENT or NOT_FOUND (an unknown
model), never INTERNAL or UNKNOWN; one with exactly one field out of range is INVALID_ARGUMENT
naming it; raw bytes that protobuf cannot decode are INVALID_ARGUMENT ("the request does not
decode": pdserve's error interceptor says so; grpc's own answer would be UNKNOWN).
After each test the cluster still answers a greedy request exactly as the offline engine does,
no request is left running at the gateway or any worker, no KV block stays allocated, no request
was retried on another worker and none ended INTERNAL or UNKNOWN.

Bounded for CI: derandomized (the same examples on every run, no example database), a few hundred
examples per test, every request with a client-side timeout (a hang fails the test).
"""

from __future__ import annotations

import json
import math
import re
import socket

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pdserve.services.gateway.openai_http import json_content_type
from pdserve.services.gateway.prompt import MAX_MESSAGES

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from pdserve.rpc import MAX_MESSAGE_BYTES, MAX_STATUS_MESSAGE_CHARS
from pdserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)
from pdserve.v1 import common_pb2, generation_pb2
from pdserve.validation import MAX_REQUEST_ID_CHARS
from tests.helpers import assert_no_leaks
from tests.serve.conftest import start_cluster

CONTEXT = 4096  # the tiny model's max_model_len
VOCAB = 49152
TIMEOUT = 30  # seconds, per request: more is a hang

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

REFERENCE_PROMPT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir):
    c = start_cluster(tiny_model_dir, prefill=1, decode=1, http=True)
    llm = LLM(
        str(tiny_model_dir), dtype="float32", threads=1, cache=CacheConfig(kv_cache_bytes=8 << 20)
    )
    expected = llm.generate([REFERENCE_PROMPT], GREEDY)[0].token_ids
    yield c, list(expected)
    c.close()


@pytest.fixture(scope="module")
def http(fuzzed):
    with httpx.Client(base_url=f"http://{fuzzed[0].http_address}/v1", timeout=TIMEOUT) as h:
        yield h


@pytest.fixture(scope="module")
def channel(fuzzed):
    with grpc.insecure_channel(fuzzed[0].address) as ch:
        yield ch


def assert_still_serving(fuzzed) -> None:
    """A greedy request through each API equals the offline engine's output; nothing leaked."""
    c, expected = fuzzed
    with Client(c.address, timeout=TIMEOUT) as client:
        assert list(client.complete(REFERENCE_PROMPT, GREEDY).token_ids) == expected
    body = {"prompt": REFERENCE_PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"http://{c.http_address}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 12
    assert_no_leaks(c.live())
    assert c.gateway_metric("pdserve_requests_total", outcome="ok") > 0  # the names are right
    assert c.gateway_metric("pdserve_requests_running") == 0
    assert c.gateway_metric("pdserve_retries_total") == 0
    for outcome in ("internal", "unknown"):
        assert c.gateway_metric("pdserve_requests_total", outcome=outcome) == 0


# ---- values ----

EDGE_INTS = [0, -1, 1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**400]
SURROGATES = ["\ud800", "\udfff", "a\udc00b"]

not_int = st.one_of(  # nor null
    st.booleans(),
    st.floats(),  # NaN and infinities too (Python's JSON writes them)
    st.text(max_size=30),
    st.sampled_from(SURROGATES),
    st.just("x" * (MAX_STOP_CHARS + 1)),
)
json_leaf = st.none() | st.integers() | st.sampled_from(EDGE_INTS) | not_int
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "n",
    "ignore_eos",
    "presence_penalty",
    "logit_bias",
    "tools",
    "response_format",
    "echo",
    "user",
]
json_value = st.recursive(
    json_leaf,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)
# a generation a body may ask for stays short: a few tokens, or past the context (refused)
max_tokens_value = st.integers(1, 4) | st.integers(max_value=0) | st.integers(min_value=CONTEXT)


@st.composite
def junk_body(draw) -> dict:
    """The APIs' fields (and a few others) with any JSON values, max_tokens among them (without
    it chat asks for the rest of the context) and none asking for more than a few tokens."""
    body = draw(st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=8))
    body["max_tokens"] = draw(max_tokens_value | not_int)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = draw(max_tokens_value | not_int)
    return body


CONTENT_TYPES = [
    None,
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "\x7fjunk",
]


def _is_error(r: httpx.Response) -> dict:
    """The OpenAI error object of a 4xx answer."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    return err


def _headers(content_type: str | None) -> dict[str, str]:
    return {} if content_type is None else {"content-type": content_type}


# ---- HTTP ----


@st.composite
def near_valid(draw) -> tuple[str, dict]:
    """A valid request to either endpoint (options at random), up to two of its fields given any
    JSON value instead."""
    chat = draw(st.booleans())
    body = draw(_valid_sampling(chat))
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=20))}]
    else:
        body["prompt"] = draw(st.text(min_size=1, max_size=20))
    body["max_tokens"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=2, unique=True)):
        max_tokens = name in ("max_tokens", "max_completion_tokens")
        body[name] = draw(max_tokens_value | not_int if max_tokens else json_value)
    return ("/chat/completions" if chat else "/completions"), body


endpoints = st.sampled_from(["/completions", "/chat/completions"])


@FUZZ
@given(
    case=st.tuples(endpoints, json_value | junk_body()) | near_valid(),
    content_type=st.sampled_from(CONTENT_TYPES),
)
def test_http_any_json_body_is_served_or_refused_with_a_4xx(fuzzed, http, case, content_type):
    endpoint, body = case
    raw = json.dumps(body).encode()  # NaN, Infinity, \ud800 escapes: Python's JSON writes them
    r = http.post(endpoint, content=raw, headers=_headers(content_type))
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many were served
    if not json_content_type(content_type):
        assert r.status_code == 415 and _is_error(r)["code"] == "unsupported_media_type"
        return
    if r.status_code != 200:
        _is_error(r)
        return
    # a request that happens to be valid: served, to the end
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c]
        finish = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
        assert finish[-1] in ("stop", "length")
    else:
        answer = r.json()
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert 1 <= answer["usage"]["completion_tokens"] <= 4


@FUZZ
@given(
    endpoint=st.sampled_from(["/completions", "/chat/completions"]),
    raw=st.binary(max_size=300)
    | st.sampled_from(
        [
            b"",
            b"{",
            b'{"prompt": "Hi",}',
            b"\xff\xfe{}",
            b"[" * 5000,
            b"null",
            b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}",  # past Python's int digits
        ]
    ),
    content_type=st.sampled_from(CONTENT_TYPES),
)
def test_http_bytes_that_are_no_request_are_400(fuzzed, http, endpoint, raw, content_type):
    r = http.post(endpoint, content=raw, headers=_headers(content_type))
    err = _is_error(r)
    assert err["type"] == "invalid_request_error"
    assert r.status_code == (400 if json_content_type(content_type) else 415)


TINY = 2.0**-20  # below 0 by this much at least (an excluded 0 may still give -0.0)


def _outside(lo: float, hi: float, lo_open: bool = False):
    below = st.floats(max_value=lo if lo_open else lo - TINY, allow_nan=False)
    above = st.floats(min_value=hi, exclude_min=True, allow_nan=False)
    return below | above | st.just(math.nan)


# field -> values both endpoints refuse for it (a 400 naming the field)
HTTP_INVALID = {
    "temperature": _outside(0, MAX_TEMPERATURE) | st.text(max_size=5) | st.booleans(),
    "top_p": _outside(0, 1, lo_open=True) | st.text(max_size=5) | st.lists(st.floats(0.1, 1)),
    "top_k": st.integers(max_value=-2) | st.integers(min_value=2**32) | st.floats() | st.text(),
    "seed": st.integers(min_value=2**63) | st.integers(max_value=-(2**63) - 1) | st.floats(),
    "stop": st.lists(st.text("ab", min_size=1, max_size=3), min_size=MAX_STOP + 1, max_size=40)
    | st.text(min_size=MAX_STOP_CHARS + 1, max_size=400).map(lambda s: [s])
    | st.just([""])
    | st.lists(st.integers() | st.none(), min_size=1, max_size=3),
    "max_tokens": st.integers(max_value=0) | st.floats() | st.text(max_size=5),
    "ignore_eos": st.integers() | st.text(max_size=5),
    "stream": st.integers() | st.text(max_size=5),
    "n": st.integers(min_value=2) | st.integers(max_value=0),
    "model": st.integers() | st.lists(st.text(max_size=3), max_size=2),
    "presence_penalty": st.floats(min_value=0.01, max_value=2),
}
HTTP_INVALID_COMPLETION = HTTP_INVALID | {
    "logprobs": st.integers(max_value=-1) | st.integers(min_value=MAX_LOGPROBS + 1),
    "prompt": st.just([]) | st.integers() | st.lists(st.text(max_size=3), min_size=2, max_size=3),
}
HTTP_INVALID_CHAT = HTTP_INVALID | {
    "max_completion_tokens": st.integers(max_value=0) | st.text(max_size=5),
    "logprobs": st.integers() | st.text(max_size=5),
    "messages": st.just([])
    | st.just([{"role": "user", "content": "Hi"}] * (MAX_MESSAGES + 1))
    | st.lists(st.integers() | st.text(max_size=3), min_size=1, max_size=3),
}


def _valid_sampling(chat: bool):
    """Valid values of the optional fields, any subset."""
    fields = {
        "temperature": st.floats(0, MAX_TEMPERATURE),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(-1, 100),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=MAX_STOP_CHARS), max_size=MAX_STOP),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
    }
    if chat:
        fields["logprobs"] = st.booleans()
    else:
        fields["logprobs"] = st.integers(0, MAX_LOGPROBS)
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def one_field_out_of_range(draw):
    chat = draw(st.booleans())
    invalid = HTTP_INVALID_CHAT if chat else HTTP_INVALID_COMPLETION
    field = draw(st.sampled_from(sorted(invalid)))
    body = draw(_valid_sampling(chat))
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=20))}]
    else:
        body["prompt"] = draw(st.text(min_size=1, max_size=20))
    body["max_tokens"] = draw(st.integers(1, 4))
    body[field] = draw(invalid[field])
    return ("/chat/completions" if chat else "/completions"), field, body


@FUZZ
@given(case=one_field_out_of_range())
def test_http_one_field_out_of_range_is_400_naming_it(fuzzed, http, case):
    endpoint, field, body = case
    r = http.post(endpoint, content=json.dumps(body).encode())
    err = _is_error(r)
    assert r.status_code == 400
    assert err["param"] == field, (field, err)
    assert field in err["message"]


def test_http_bodies_over_the_limit_are_413_however_sent(fuzzed, http):
    big = json.dumps({"prompt": "a" * MAX_MESSAGE_BYTES}).encode()

    def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    for content in (big, chunks()):  # with a Content-Length, and chunked without one
        r = http.post("/completions", content=content)
        assert r.status_code == 413
        assert _is_error(r)["code"] == "request_too_large"
    # a Content-Length over the limit is refused before the body is read (none follows here: an
    # HTTP client would not send that, a socket does)
    c, _ = fuzzed
    host, port = c.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 99999999999\r\n\r\n{}"
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)[1])
        while len(body) < length:
            body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413 ")
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert_still_serving(fuzzed)


def test_http_after_the_fuzz_still_serves_and_nothing_leaked(fuzzed):
    assert_still_serving(fuzzed)


# ---- gRPC ----

float32 = st.floats(width=32)  # NaN and infinities too
uint32 = st.integers(0, 2**32 - 1)
text = st.text(max_size=40) | st.just("x" * (MAX_STOP_CHARS + 1))


@st.composite
def grpc_requests(draw) -> generation_pb2.GenerateRequest:
    """Random values of every field, within what the wire format holds: each field often one
    in range, so that many requests are served, with many combinations of options."""
    req = generation_pb2.GenerateRequest(
        model=draw(st.sampled_from(["", "", "tiny-llama", "gpt-4"])),
        request_id=draw(
            st.just("")
            | st.text("abc-0", max_size=10)
            | st.text(max_size=MAX_REQUEST_ID_CHARS + 10)
        ),
    )
    prompt = draw(st.sampled_from(["text", "token_ids", "chat", None]))
    if prompt == "text":
        req.text = draw(text)
    elif prompt == "token_ids":
        ids = st.integers(0, VOCAB - 1) | uint32
        req.token_ids.SetInParent()  # the oneof's choice, even with no ids
        req.token_ids.ids.extend(draw(st.lists(ids, max_size=20)))
    elif prompt == "chat":
        req.chat.SetInParent()
        role = st.sampled_from(["user", "assistant", "system"]) | st.text(max_size=8)
        for _ in range(draw(st.integers(0, 4))):
            req.chat.messages.add(role=draw(role), content=draw(text))
    if draw(st.booleans()):
        s = req.sampling
        s.SetInParent()
        # a generation stays short: a few tokens, or past the context (refused)
        max_tokens = st.integers(0, 4) | st.integers(CONTEXT, 2**32 - 1)
        optional = {
            "max_tokens": max_tokens,
            "temperature": st.sampled_from([0.0, 0.7]) | st.floats(0, 2, width=32) | float32,
            "top_p": st.floats(0, 1, exclude_min=True, width=32) | float32,
            "seed": st.integers(-(2**63), 2**63 - 1),
            "logprobs": st.integers(0, MAX_LOGPROBS + 2) | uint32,
        }
        for name, values in optional.items():
            if draw(st.booleans()):
                setattr(s, name, draw(values))
        s.top_k = draw(st.just(0) | st.integers(0, 100) | uint32)
        s.stop.extend(draw(st.lists(st.text(min_size=1, max_size=3), max_size=3) | st.lists(text)))
        many = st.integers(0, MAX_STOP_TOKEN_IDS + 5).map(lambda n: [7] * n)
        s.stop_token_ids.extend(draw(st.lists(uint32, max_size=5) | many))
        s.ignore_eos = draw(st.booleans())
    return req


def _call(channel, method: str, request: bytes):
    """A Generation method called with ``request`` as its bytes; (status, messages)."""
    path = f"/pdserve.v1.Generation/{method}"
    try:
        if method == "Complete":
            got = channel.unary_unary(path)(request, timeout=TIMEOUT)
            return grpc.StatusCode.OK, [generation_pb2.CompleteResponse.FromString(got)]
        stream = channel.unary_stream(path)(request, timeout=TIMEOUT)
        return grpc.StatusCode.OK, [generation_pb2.GenerateResponse.FromString(m) for m in stream]
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} hung"
        details = e.details() or ""
        assert len(details) <= MAX_STATUS_MESSAGE_CHARS
        return e.code(), details


def _check_served(req: generation_pb2.GenerateRequest, messages) -> None:
    tokens = sum(len(m.token_ids) for m in messages)
    max_tokens = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else 16
    assert 1 <= tokens <= max_tokens
    assert messages[-1].finish_reason in ("stop", "length")
    assert messages[-1].usage.completion_tokens == tokens


@FUZZ
@given(req=grpc_requests(), method=st.sampled_from(["Complete", "Generate"]))
def test_grpc_random_field_values_are_served_or_refused_as_invalid(fuzzed, channel, req, method):
    code, got = _call(channel, method, req.SerializeToString())
    event(code.name)  # --hypothesis-show-statistics: how many were served
    assert code in (
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
    ), (code, got)
    if code == grpc.StatusCode.OK:
        _check_served(req, got)
    elif code == grpc.StatusCode.NOT_FOUND:
        assert req.model not in ("", "tiny-llama") and "is not served here" in got
    else:
        assert got  # a message saying what was wrong


def _chat(n: int) -> generation_pb2.ChatMessages:
    return generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="user", content="Hi")] * n
    )


# field -> (values out of range, what the message names)
GRPC_INVALID = {
    "temperature": (
        st.floats(max_value=-TINY, width=32)
        | st.floats(min_value=MAX_TEMPERATURE, exclude_min=True, width=32)
        | st.just(math.nan),
        "temperature",
    ),
    "top_p": (
        st.floats(max_value=0, width=32)
        | st.floats(min_value=1, exclude_min=True, width=32)
        | st.just(math.nan),
        "top_p",
    ),
    "max_tokens": (st.just(0) | st.integers(CONTEXT, 2**32 - 1), "max_tokens"),
    "logprobs": (st.integers(MAX_LOGPROBS + 1, 2**32 - 1), "logprobs"),
    "stop": (
        st.lists(st.text("ab", min_size=1, max_size=3), min_size=MAX_STOP + 1, max_size=40)
        | st.text(min_size=MAX_STOP_CHARS + 1, max_size=400).map(lambda s: [s])
        | st.lists(st.text(min_size=1, max_size=5), max_size=3).map(lambda s: [*s, ""]),
        "stop",
    ),
    "stop_token_ids": (
        st.integers(MAX_STOP_TOKEN_IDS + 1, 2000).map(lambda n: [3] * n),
        "stop_token_ids",
    ),
    "request_id": (
        st.text(min_size=MAX_REQUEST_ID_CHARS + 1, max_size=300)
        | st.text(st.characters(categories=["Cc"]), min_size=1, max_size=5),
        "request_id",
    ),
    "text": (st.just(""), "prompt is empty"),
    "token_ids": (
        st.just([]) | st.lists(st.integers(VOCAB, 2**32 - 1), min_size=1, max_size=3),
        "prompt",
    ),
    "chat": (st.sampled_from([0, MAX_MESSAGES + 1]).map(_chat), "chat"),
}


@st.composite
def grpc_one_field_out_of_range(draw):
    field = draw(st.sampled_from(sorted(GRPC_INVALID)))
    values, names = GRPC_INVALID[field]
    sampling = common_pb2.SamplingParams(
        max_tokens=draw(st.integers(1, 4)),
        temperature=draw(st.floats(0, MAX_TEMPERATURE, width=32)),
        top_k=draw(st.integers(0, 100)),
        top_p=draw(st.floats(0, 1, exclude_min=True, width=32)),
        seed=draw(st.integers(-(2**63), 2**63 - 1)),
        stop=draw(st.lists(st.text(min_size=1, max_size=MAX_STOP_CHARS), max_size=MAX_STOP)),
        ignore_eos=draw(st.booleans()),
    )
    req = generation_pb2.GenerateRequest(text="Hi", sampling=sampling)
    value = draw(values)
    if field == "token_ids":
        req.token_ids.SetInParent()  # the oneof's choice, even with no ids
        req.token_ids.ids.extend(value)
    elif field == "chat":
        req.chat.SetInParent()
        req.chat.CopyFrom(value)
    elif field in ("text", "request_id"):
        setattr(req, field, value)
    elif field in ("stop", "stop_token_ids"):
        getattr(sampling, field)[:] = value
        req.sampling.CopyFrom(sampling)
    else:
        setattr(req.sampling, field, value)
    return req, names


@FUZZ
@given(case=grpc_one_field_out_of_range(), method=st.sampled_from(["Complete", "Generate"]))
def test_grpc_one_field_out_of_range_is_invalid_argument_naming_it(fuzzed, channel, case, method):
    req, names = case
    code, details = _call(channel, method, req.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert names in details


def _mutated(raw: bytes, at: int, junk: bytes) -> bytes:
    at %= len(raw) + 1
    return raw[:at] + junk + raw[at + len(junk) :]


VALID = generation_pb2.GenerateRequest(
    text="Hi", sampling=common_pb2.SamplingParams(max_tokens=2, stop=["x"])
).SerializeToString()


@FUZZ
@given(
    raw=st.binary(max_size=300)
    | st.builds(_mutated, st.just(VALID), st.integers(0, 100), st.binary(min_size=1, max_size=8)),
    method=st.sampled_from(["Complete", "Generate"]),
)
def test_grpc_raw_bytes_are_decoded_or_refused_as_invalid(fuzzed, channel, raw, method):
    try:
        req = generation_pb2.GenerateRequest.FromString(raw)
    except Exception:  # protobuf's DecodeError: the server's parser refuses these bytes too
        req = None
    code, got = _call(channel, method, raw)
    event("does not decode" if req is None else code.name)
    if req is None:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, got)
        assert got.startswith("the request does not decode: Error parsing message")
        return
    assert code in (
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
    ), (code, got)
    if code == grpc.StatusCode.OK:
        _check_served(req, got)


def test_grpc_after_the_fuzz_still_serves_and_nothing_leaked(fuzzed):
    assert_still_serving(fuzzed)
