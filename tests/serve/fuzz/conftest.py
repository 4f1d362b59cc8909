"""What the two fuzz files share: the cluster they fuzz (one per module), its clients, the
check that it still serves afterwards, and the values both feed the APIs."""

from __future__ import annotations

import math

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from pdserve.sampling_params import (
    MAX_STOP_CHARS,
)
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


TINY = 2.0**-20  # below 0 by this much at least (an excluded 0 may still give -0.0)


def _outside(lo: float, hi: float, lo_open: bool = False):
    below = st.floats(max_value=lo if lo_open else lo - TINY, allow_nan=False)
    above = st.floats(min_value=hi, exclude_min=True, allow_nan=False)
    return below | above | st.just(math.nan)
