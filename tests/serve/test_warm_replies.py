"""Warm replies through the services (``--warm-replies``): once a disaggregated request has ended,
the gateway sends its prompt and reply to the prefill worker that computed the prompt, which
keeps their KV; a chat's next turn then finds the reply there too and computes only the new
message. Tokens as without it; every block free; off by default."""

from __future__ import annotations

import random

import grpc
import pytest

from pdserve import Client, SamplingParams
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers import assert_no_leaks, wait_until

BLOCK = 16  # the cluster's block size
rng = random.Random(41)
FIRST = [rng.randrange(3, 49152) for _ in range(87)]  # 5 full blocks and 7 tokens
MESSAGE = [rng.randrange(3, 49152) for _ in range(7)]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
WITHOUT_PROBES = {"probe_interval_s": 0.0, "outage_wait_s": 0.0}


def start(cluster, warm: bool):
    return cluster(prefill=1, decode=1, config={**WITHOUT_PROBES, "warm_replies": warm})


def warm_replies(c, outcome: str) -> float:
    registry = c.gateway.gateway.metrics.registry
    return registry.get_sample_value("pdserve_warm_replies_total", {"outcome": outcome}) or 0.0


def warmed_tokens(c) -> float:
    registry = c.workers["prefill-0"].worker.metrics.registry
    return registry.get_sample_value("pdserve_prefill_warm_tokens_total", {}) or 0.0


def two_turns(c, warm: bool) -> tuple[list[list[int]], list[int]]:
    """FIRST, then FIRST + its reply + MESSAGE: each turn's tokens and cached prompt tokens."""
    outputs, cached = [], []
    with Client(c.address, timeout=30) as client:
        prompt = FIRST
        for turn in range(2):
            r = client.complete(prompt, PARAMS)
            outputs.append(list(r.token_ids))
            cached.append(r.usage.cached_prompt_tokens)
            if warm:
                n = turn + 1
                wait_until(lambda n=n: warm_replies(c, "done") == n, 30, "the reply warmed")
            prompt = prompt + outputs[-1] + MESSAGE
    assert_no_leaks(c.live())
    return outputs, cached


def test_the_next_turn_finds_the_reply_on_the_prefill_worker(cluster):
    """The prefill worker computed FIRST (87 tokens: 5 full blocks); warmed with FIRST and 9 of
    its 10 reply tokens (96 tokens, 6 blocks) it computes one block more, and the next turn
    (104 tokens) finds 96 there where it would find 80; its tokens are those without it."""
    c = start(cluster, warm=True)
    outputs, cached = two_turns(c, warm=True)
    assert cached == [0, 6 * BLOCK]
    assert warmed_tokens(c) == 2 * BLOCK  # one block a turn: the reply's last token is left out
    assert warm_replies(c, "failed") == warm_replies(c, "refused") == 0
    outputs_without, cached_without = two_turns(start(cluster, warm=False), warm=False)
    assert cached_without == [0, 5 * BLOCK]
    assert outputs == outputs_without


def test_a_reply_that_fills_no_block_is_not_sent(cluster):
    c = start(cluster, warm=True)
    with Client(c.address, timeout=30) as client:
        # 87 + 8 = 95 tokens: still 5 full blocks, as the prompt alone
        client.complete(FIRST, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
        client.complete(FIRST, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    wait_until(lambda: warm_replies(c, "done") == 1, 30, "the second reply warmed")
    assert warmed_tokens(c) == BLOCK  # the first sent nothing; the second one block
    assert_no_leaks(c.live())


def test_a_cache_only_prefill_of_a_bad_prompt_is_refused_clearly(cluster):
    c = start(cluster, warm=True)
    with grpc.insecure_channel(c.workers["prefill-0"].address) as ch:
        stub = worker_pb2_grpc.PrefillStub(ch)
        for ids, detail in (
            ([], "prompt is empty"),
            ([5, 10**9], "token id"),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id="w", prompt_token_ids=ids, cache_only=True
                    ),
                    timeout=30,
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert detail in e.value.details()
        # and a good one answers with what it found cached (nothing: a cold worker)
        r = stub.Prefill(
            worker_pb2.PrefillRequest(request_id="w", prompt_token_ids=FIRST, cache_only=True),
            timeout=30,
        )
        assert r.cached_prompt_tokens == 0 and not r.HasField("first_token")
    assert warmed_tokens(c) == len(FIRST)
    assert_no_leaks(c.live())
