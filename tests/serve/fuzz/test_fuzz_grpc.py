"""The gateway's front door, fuzzed (the gRPC API here, HTTP in test_fuzz_http.py): malformed and out-of-range requests to both APIs, over real
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

import math

import grpc
from hypothesis import event, given
from hypothesis import strategies as st
from pdserve.services.gateway.prompt import MAX_MESSAGES

from pdserve.rpc import MAX_STATUS_MESSAGE_CHARS
from pdserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)
from pdserve.v1 import common_pb2, generation_pb2
from pdserve.validation import MAX_REQUEST_ID_CHARS
from tests.serve.fuzz.conftest import (
    CONTEXT,
    FUZZ,
    TIMEOUT,
    TINY,
    VOCAB,
    assert_still_serving,
)

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


def _served_or_refused(code: grpc.StatusCode, got, req: generation_pb2.GenerateRequest) -> None:
    """OK (and served right), INVALID_ARGUMENT or NOT_FOUND: never INTERNAL or UNKNOWN."""
    allowed = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert code in allowed, (code, got)
    if code == grpc.StatusCode.OK:
        _check_served(req, got)


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
    _served_or_refused(code, got, req)
    if code == grpc.StatusCode.NOT_FOUND:
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
    _served_or_refused(code, got, req)


def test_grpc_after_the_fuzz_still_serves_and_nothing_leaked(fuzzed):
    assert_still_serving(fuzzed)
