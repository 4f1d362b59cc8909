"""The gateway's front door, fuzzed (the HTTP API here, gRPC in test_fuzz_grpc.py): malformed and out-of-range requests to both APIs, over real
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
import re
import socket

from hypothesis import event, given
from hypothesis import strategies as st
from pdserve.services.gateway.openai_http import json_content_type
from pdserve.services.gateway.prompt import MAX_MESSAGES

from pdserve.rpc import MAX_MESSAGE_BYTES
from pdserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TEMPERATURE,
)
from tests.serve.fuzz.conftest import (
    CONTENT_TYPES,
    FIELDS,
    FUZZ,
    TIMEOUT,
    _headers,
    _is_error,
    _outside,
    assert_still_serving,
    json_value,
    junk_body,
    max_tokens_value,
    not_int,
)

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
