"""Gateway -> prefill -> KV over UCX -> decode, as real processes, driven through the public API."""

from __future__ import annotations

import concurrent.futures
import random

import grpc
import pytest

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 2 + 2?",
    "Say hello in French.",
    "What is a cat?",
    "Describe the sun in one sentence.",
    "What is Python?",
    "Why do birds sing?",
    "Give me a word that rhymes with tree.",
    "What is the tallest mountain?",
    "What is water made of?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Name a planet.",
    "What language is spoken in Spain?",
    "What do bees make?",
]


def test_greedy_outputs_equal_the_offline_engine(cluster):
    llm = LLM(threads=2, cache=CacheConfig(kv_cache_bytes=256 << 20))
    prompts = [llm.tokenizer.encode(llm.chat_prompt(q)) for q in QUESTIONS]
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    with (
        Client(cluster.gateway, timeout=120) as c,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        got = list(pool.map(lambda p: list(c.complete(p, params).token_ids), prompts))
    assert got == expected
    stats = cluster.wait_all_free(timeout=2)
    assert all(s.num_free_blocks == s.num_total_blocks for s in stats.values()), stats


def test_64_concurrent_streams_complete_and_free_every_block(cluster):
    rng = random.Random(0)
    words = "river stone light music engine garden paper cloud winter signal".split()
    jobs = [
        (" ".join(rng.choice(words) for _ in range(rng.randint(4, 300))), rng.randint(1, 32))
        for _ in range(64)
    ]

    def run(job):
        text, n = job
        with Client(cluster.gateway, timeout=300) as c:
            deltas = list(
                c.generate_stream(
                    text, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                )
            )
        return sum(len(d.token_ids) for d in deltas), deltas[-1].finish_reason

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, jobs))
    assert results == [(n, "length") for _, n in jobs]
    stats = cluster.wait_all_free(timeout=2)
    assert all(s.num_free_blocks == s.num_total_blocks for s in stats.values()), stats


def test_client_cancel_frees_blocks_on_both_sides_within_2s(cluster):
    with Client(cluster.gateway, timeout=120) as c:
        stream = c.generate_stream(
            "Tell me a very long story about the sea.",
            SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True),
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        busy = cluster.stats("decode")
        assert busy.num_free_blocks < busy.num_total_blocks  # the request holds blocks now
        stream.cancel()
    stats = cluster.wait_all_free(timeout=2)
    assert all(s.num_free_blocks == s.num_total_blocks for s in stats.values()), stats


def _call(gateway: str, **kw):
    with grpc.insecure_channel(gateway) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return stub.Complete(generation_pb2.GenerateRequest(**kw), timeout=30)


@pytest.mark.parametrize(
    "kw, code, message",
    [
        (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens must be an integer >= 1",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=100000)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds this model's context of 8192 tokens",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature must be >= 0",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(top_p=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(top_p=1.5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            dict(text="hi", model="gpt-17"),
            grpc.StatusCode.NOT_FOUND,
            "model 'gpt-17' is not served here",
        ),
        (
            dict(token_ids=generation_pb2.TokenIds(ids=[5] * 9000)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt has 9000 tokens",
        ),
        (dict(text="x" * (10 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        (dict(), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    ],
)
def test_bad_input_gets_a_clear_status_and_the_server_keeps_serving(cluster, kw, code, message):
    with pytest.raises(grpc.RpcError) as err:
        _call(cluster.gateway, **kw)
    assert err.value.code() == code
    assert message in err.value.details()
    ok = _call(
        cluster.gateway,
        text="Hello",
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0),
    )
    assert len(ok.token_ids) == 2


def test_list_models(cluster):
    with Client(cluster.gateway) as c:
        assert c.list_models() == ["SmolLM2-135M-Instruct"]
