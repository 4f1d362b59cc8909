"""Requests through the public API of one shared cluster (2 prefill + 2 decode): outputs, stop
strings, cancel, bad input. Each test leaves every worker idle, with every block free."""

from __future__ import annotations

import concurrent.futures
import random

import grpc
import pytest

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.helpers import assert_no_leaks, worker_stats


def test_greedy_outputs_equal_the_offline_engine(shared_cluster, tiny_model_dir):
    c = shared_cluster
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 70))] for _ in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(
        str(tiny_model_dir), dtype="float32", threads=1, cache=CacheConfig(kv_cache_bytes=8 << 20)
    )
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    with (
        Client(c.address, timeout=30) as client,
        concurrent.futures.ThreadPoolExecutor(6) as pool,
    ):
        got = list(pool.map(lambda p: list(client.complete(p, params).token_ids), prompts))
    assert got == expected
    assert_no_leaks(c.live())


def test_concurrent_streams_of_mixed_lengths_complete_and_release_every_block(shared_cluster):
    c = shared_cluster
    rng = random.Random(1)
    jobs = [
        ([rng.randrange(3, 49152) for _ in range(rng.randint(1, 90))], rng.randint(1, 40))
        for _ in range(32)
    ]

    def run(job):
        prompt, n = job
        with Client(c.address, timeout=30) as client:
            deltas = list(
                client.generate_stream(
                    prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                )
            )
        return sum(len(d.token_ids) for d in deltas), deltas[-1].finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    assert results == [(n, "length") for _, n in jobs]
    assert_no_leaks(c.live())


def test_stop_string_ends_the_output_before_it(shared_cluster):
    c = shared_cluster
    prompt = "Tell me about the sea."
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with Client(c.address, timeout=30) as client:
        full = client.complete(prompt, params).text
        # A piece of the output that first appears half way: the output must end right before it.
        start = next(
            i
            for i in range(len(full) // 2, len(full) - 3)
            if full.find(full[i : i + 3]) == i and full[i : i + 3].isprintable()
        )
        stop = full[start : start + 3]
        stopped = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
        out = client.complete(prompt, stopped)
        deltas = list(client.generate_stream(prompt, stopped))
    assert (out.text, out.finish_reason) == (full[:start], "stop")
    assert "".join(d.text for d in deltas) == full[:start]
    assert deltas[-1].finish_reason == "stop"
    assert_no_leaks(c.live())  # the decode worker was told to stop early: its blocks are free


def test_client_cancel_mid_stream_frees_blocks_on_both_workers(shared_cluster):
    c = shared_cluster
    with Client(c.address, timeout=30) as client:
        stream = client.generate_stream(
            "Tell me a very long story about the sea.",
            SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True),
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        used = {
            n: s.num_total_blocks - s.num_free_blocks
            for n, s in ((n, worker_stats(*a)) for n, a in c.live().items())
        }
        assert sum(used.values()) > 0, used  # the request holds decode blocks now
        stream.cancel()
    assert_no_leaks(c.live())


def _complete(gateway: str, **kw) -> generation_pb2.CompleteResponse:
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
            "exceeds this model's context of 4096 tokens",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature must be a number in [0, 2] (0 is greedy), got -1.0",
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
            dict(token_ids=generation_pb2.TokenIds(ids=[5] * 5000)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt has 5000 tokens",
        ),
        (
            dict(token_ids=generation_pb2.TokenIds(ids=[5, 49152])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt token id 49152 is outside the vocabulary [0, 49152)",
        ),
        (dict(text="x" * (10 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        (dict(), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
        # the HTTP API's limits (SamplingParams' and the prompt's: one place for both APIs)
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(temperature=2.5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature must be a number in [0, 2] (0 is greedy), got 2.5",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(temperature=float("inf"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature must be a number in [0, 2] (0 is greedy), got inf",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(temperature=float("nan"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "got nan",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(top_p=float("nan"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p must be a number in (0, 1], got nan",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(stop=["s"] * 17)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop takes at most 16 strings, got 17",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(stop=["s" * 257])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop strings may have at most 256 characters, got one of 257",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(stop=["a", ""])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop strings must be non-empty strings, got ''",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(stop_token_ids=[2] * 257)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop_token_ids takes at most 256 ids, got 257",
        ),
        (
            dict(text="hi", sampling=common_pb2.SamplingParams(logprobs=21)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "logprobs must be None or an integer in [0, 20], got 21",
        ),
        (
            dict(text="hi", request_id="r" * 129),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request_id has 129 characters; at most 128 are allowed",
        ),
        (
            dict(text="hi", request_id="a\nb"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request_id 'a\\nb' has a character that is not printable",
        ),
        (
            dict(
                chat=generation_pb2.ChatMessages(
                    messages=[generation_pb2.ChatMessage(role="user", content="hi")] * 4097
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat has 4097 messages; at most 4096 are allowed",
        ),
        (dict(text="hi", model="m" * 100_000), grpc.StatusCode.NOT_FOUND, "is not served here"),
        # more characters than 4096 tokens can stand for: refused before it is tokenized
        (
            dict(text="x" * (4096 * 81 + 1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt has 331777 characters: more than the model's context can hold in any "
            "tokenization (at most 331776: no token stands for more than 81 characters)",
        ),
        # long enough to be tokenized off the event loop, then too long for the context
        (
            dict(text="word " * 5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt has 5001 tokens and max_tokens is 16: 5017 exceeds",
        ),
    ],
)
def test_bad_input_gets_a_clear_status_and_the_cluster_keeps_serving(
    shared_cluster, kw, code, message
):
    c = shared_cluster
    with pytest.raises(grpc.RpcError) as err:
        _complete(c.address, **kw)
    assert err.value.code() == code
    assert message in err.value.details()
    assert len(err.value.details()) <= 512  # however large the request
    ok = _complete(
        c.address, text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0)
    )
    assert len(ok.token_ids) == 2
    assert_no_leaks(c.live())


def test_list_models(shared_cluster):
    with Client(shared_cluster.address) as client:
        assert client.list_models() == ["tiny-llama"]


def test_two_requests_with_the_same_client_id_at_once_are_both_served(shared_cluster):
    """The workers know each try by an id made unique per gateway and request."""
    c = shared_cluster
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with Client(c.address, timeout=60) as client:
        want = client.complete([5, 6, 7], params).token_ids
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(
                pool.map(
                    lambda _: _complete(
                        c.address,
                        token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
                        request_id="same-id",
                        sampling=common_pb2.SamplingParams(
                            max_tokens=24, temperature=0, ignore_eos=True
                        ),
                    ),
                    range(2),
                )
            )
    assert [list(g.token_ids) for g in got] == [list(want)] * 2
    assert_no_leaks(c.live())


def test_a_decode_worker_counts_a_request_as_ended_before_its_last_output_leaves(shared_cluster):
    """A client that has the last token and reads the worker's metrics finds the request there:
    the count must not wait for the stream's consumer to ask for more after the end."""
    c = shared_cluster
    worker = c.workers["decode-0"].worker
    before = c.served("decode-0")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def served_when_the_last_output_arrives() -> int:
        stream = worker.generate_local("count-at-end", [5, 6, 7], params)
        try:
            async for out in stream:
                if out.finished:
                    return c.served("decode-0")
        finally:
            await stream.aclose()
        raise AssertionError("the stream ended without a finished output")

    assert c.loop.run(served_when_the_last_output_arrives()) == before + 1
    assert_no_leaks(c.live())
