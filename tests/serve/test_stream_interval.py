"""A worker's --stream-interval through the gateway: a request's tokens come in fewer messages
(the first at once, the last with the finish reason), the same tokens as the offline engine, the
usage right, and no block left behind."""

from __future__ import annotations

import openai
import pytest
from pdserve.services.main import WorkerOptions

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from tests.helpers import assert_no_leaks

PROMPT = [1, 5, 9, 200, 33, 7, 8, 9, 10, 11, 300, 12]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[int]:
    llm = LLM(
        str(tiny_model_dir), dtype="float32", threads=1, cache=CacheConfig(kv_cache_bytes=8 << 20)
    )
    return llm.generate([PROMPT], PARAMS)[0].token_ids


def messages(address: str) -> list:
    with Client(address, timeout=30) as client:
        return list(client.generate_stream(PROMPT, PARAMS))


@pytest.mark.parametrize(
    "roles, sizes",
    [
        # the first token comes from the prefill worker, the second is the decode worker's first
        (("prefill", "decode"), [1, 1, 10]),
        (("colocated",), [1, 11]),
    ],
)
def test_tokens_within_the_interval_come_in_one_message(cluster, expected, roles, sizes):
    c = cluster(prefill=0, decode=0)
    for role in roles:
        # an interval no test reaches: only the first and the last output go on
        interval = 3600.0 if role != "prefill" else 0.0
        c.start_worker(f"{role}-0", role, stream_interval_s=interval)
    got = messages(c.address)
    assert [len(m.token_ids) for m in got] == sizes
    assert [t for m in got for t in m.token_ids] == expected
    assert got[-1].finish_reason == "length"
    assert (got[-1].usage.prompt_tokens, got[-1].usage.completion_tokens) == (len(PROMPT), 12)
    assert_no_leaks(c.live())


def test_the_openai_api_streams_several_tokens_a_chunk_with_their_logprobs(cluster):
    """Over HTTP the chunk of several tokens is one SSE event: its text, and one logprobs entry a
    token; the same text and logprobs as the answer in one piece."""
    c = cluster(prefill=0, decode=0, http=True)
    c.start_worker("colocated-0", "colocated", stream_interval_s=3600.0)
    asked = dict(
        prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    with openai.OpenAI(
        base_url=f"http://{c.http_address}/v1", api_key="-", max_retries=0, timeout=30
    ) as oai:
        model = oai.models.list().data[0].id
        whole = oai.completions.create(model=model, **asked).choices[0]
        chunks = [ch.choices[0] for ch in oai.completions.create(model=model, stream=True, **asked)]
    assert [len(ch.logprobs.tokens) for ch in chunks] == [1, 11]
    assert "".join(ch.text for ch in chunks) == whole.text
    assert [t for ch in chunks for t in ch.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    assert [ch.finish_reason for ch in chunks] == [None, "length"]
    assert_no_leaks(c.live())


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="--stream-interval must be >= 0 ms, got -5"):
        WorkerOptions(role="decode", engine=None, stream_interval_s=-0.005)
