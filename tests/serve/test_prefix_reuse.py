"""Decode-side prefix reuse through the services: a decode worker that already holds a prompt's
leading blocks asks the prefill worker for the rest only; the outputs are those of a cluster whose
decode worker reuses nothing, and ``cached_prompt_tokens`` reaches both public APIs."""

from __future__ import annotations

import random

import grpc
import openai
import pytest

from pdserve import Client, SamplingParams
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers import assert_no_leaks

BLOCK = 16  # the cluster's block size
rng = random.Random(15)
PREFIX = [rng.randrange(3, 49152) for _ in range(5 * BLOCK)]  # 80 tokens: 5 full blocks
FIRST = PREFIX + [rng.randrange(3, 49152) for _ in range(7)]  # 87 tokens: 6 blocks
SECOND = PREFIX + [rng.randrange(3, 49152) for _ in range(20)]  # 100 tokens: 7 blocks
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def start(cluster, reuse: bool):
    c = cluster(prefill=1, decode=0, http=True)
    c.start_worker("decode-0", "decode", prefix_caching=reuse)
    return c


def recv_bytes(c) -> float:
    metrics = c.workers["decode-0"].worker.metrics.registry
    return metrics.get_sample_value("pdserve_kv_transfer_bytes_sum", {"direction": "recv"}) or 0.0


def reused_tokens(c) -> float:
    metrics = c.workers["decode-0"].worker.metrics.registry
    return metrics.get_sample_value("pdserve_kv_prefix_reused_tokens_total", {}) or 0.0


def serve(c) -> tuple[list, list[int], list[float], list[float]]:
    """FIRST and SECOND over gRPC, then SECOND again over HTTP: per request its token ids (gRPC)
    or text (HTTP), its cached_prompt_tokens, the KV bytes the decode worker received and the prompt tokens it reused."""
    outputs, cached, nbytes, reused = [], [], [], []

    def measured(run):
        before, reused_before = recv_bytes(c), reused_tokens(c)
        tokens, num_cached = run()
        outputs.append(tokens)
        cached.append(num_cached)
        nbytes.append(recv_bytes(c) - before)
        reused.append(reused_tokens(c) - reused_before)

    with Client(c.address, timeout=30) as client:
        for prompt in (FIRST, SECOND):

            def grpc_call(prompt=prompt):
                r = client.complete(prompt, PARAMS)
                return list(r.token_ids), r.usage.cached_prompt_tokens

            measured(grpc_call)
    with openai.OpenAI(
        base_url=f"http://{c.http_address}/v1", api_key="-", max_retries=0, timeout=30
    ) as oai:

        def http_call():
            r = oai.completions.create(
                model=c.gateway.gateway.model_name,
                prompt=SECOND,
                max_tokens=PARAMS.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.usage.completion_tokens == PARAMS.max_tokens
            return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

        measured(http_call)
    assert_no_leaks(c.live())
    return outputs, cached, nbytes, reused


def test_a_shared_prefix_is_sent_once_and_outputs_equal_a_cluster_without_reuse(cluster):
    with_reuse = start(cluster, reuse=True)
    layout = with_reuse.workers["decode-0"].worker.transport.layout
    outputs, cached, nbytes, reused = serve(with_reuse)

    def transfer(num_blocks: int) -> int:  # loopback sends each layer framed
        return layout.num_layers * layout.message_nbytes(num_blocks)

    # FIRST: nothing cached. SECOND: the decode worker has FIRST's 5 full prompt blocks (the
    # prefill worker its 5 as well); then SECOND again: its 6 full blocks (the 7th, with the last
    # prompt token, is always sent: it carries the first token)
    assert reused == [0, 5 * BLOCK, 6 * BLOCK]
    assert nbytes == [transfer(6), transfer(7 - 5), transfer(7 - 6)]
    assert cached == [0, 5 * BLOCK, 6 * BLOCK]

    without = start(cluster, reuse=False)
    outputs_without, cached_without, nbytes_without, reused_without = serve(without)
    assert outputs == outputs_without
    assert [len(tokens) for tokens in outputs[:2]] == [PARAMS.max_tokens] * 2
    assert outputs[2]  # the HTTP answer's text
    assert reused_without == [0, 0, 0]
    assert nbytes_without == [transfer(6), transfer(7), transfer(7)]
    # cached_prompt_tokens counts what the worker that computed the prompt took from its prefix
    # cache: the prefill worker's, which caches in both clusters
    assert cached_without == cached


def test_a_worker_that_prefills_locally_reports_its_own_cache_hits(cluster):
    c = cluster(prefill=0, decode=0, colocated=1)
    with Client(c.address, timeout=30) as client:
        first = client.complete(FIRST, PARAMS)
        responses = list(client.generate_stream(SECOND, PARAMS))
    assert first.usage.cached_prompt_tokens == 0
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    assert responses[-1].usage.prompt_tokens == len(SECOND)
    assert responses[-1].usage.cached_prompt_tokens == 5 * BLOCK
    assert_no_leaks(c.live())


def test_a_prefill_told_to_skip_too_many_blocks_is_refused_clearly(cluster):
    c = cluster(prefill=1, decode=1)
    d_addr, p_addr = c.workers["decode-0"].address, c.workers["prefill-0"].address
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0)
    with grpc.insecure_channel(d_addr) as dch, grpc.insecure_channel(p_addr) as pch:
        call = worker_pb2_grpc.DecodeStub(dch).Generate(
            worker_pb2.DecodeRequest(request_id="a", prompt_token_ids=FIRST, sampling=sampling),
            timeout=30,
        )
        dest = next(call).admitted.destination
        dest.num_cached_blocks = 6  # FIRST fills 6 blocks: the last one is always sent
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.PrefillStub(pch).Prefill(
                worker_pb2.PrefillRequest(
                    request_id="a", prompt_token_ids=FIRST, sampling=sampling, destination=dest
                ),
                timeout=30,
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == (
            "destination holds 6 of the prompt's 6 blocks already; it may hold 0 to 5 "
            "(the block with the last prompt token is always sent)"
        )
        call.cancel()
    assert_no_leaks(c.live())


def chat_turns(c) -> tuple[list[list[int]], list[float], list[float]]:
    """FIRST, then the next turn (FIRST, its reply, a new message) over gRPC: per turn its
    tokens, the KV bytes the decode worker received and the prompt tokens it reused."""
    outputs, nbytes, reused = [], [], []
    with Client(c.address, timeout=30) as client:
        prompt = FIRST
        for _ in range(2):
            before, reused_before = recv_bytes(c), reused_tokens(c)
            tokens = list(client.complete(prompt, PARAMS).token_ids)
            outputs.append(tokens)
            nbytes.append(recv_bytes(c) - before)
            reused.append(reused_tokens(c) - reused_before)
            prompt = prompt + tokens + [rng.randrange(3, 49152) for _ in range(7)]
    assert_no_leaks(c.live())
    return outputs, nbytes, reused


def test_a_decode_worker_holds_the_reply_and_is_sent_only_the_new_message(cluster):
    """The decode worker generated FIRST's reply: the next turn (104 tokens) finds FIRST and 9
    of the reply's 10 tokens there (96 tokens, 6 blocks; the last token was never fed back), and
    only its last block is sent; the tokens are those of a cluster that reuses nothing."""
    state = rng.getstate()
    with_reuse = start(cluster, reuse=True)
    layout = with_reuse.workers["decode-0"].worker.transport.layout
    outputs, nbytes, reused = chat_turns(with_reuse)
    assert reused == [0, 6 * BLOCK]
    assert nbytes[1] == layout.num_layers * layout.message_nbytes(1)
    rng.setstate(state)  # the same new message
    outputs_without, nbytes_without, reused_without = chat_turns(start(cluster, reuse=False))
    assert outputs == outputs_without and reused_without == [0, 0]
    assert nbytes_without[1] == layout.num_layers * layout.message_nbytes(7)


def test_a_colocated_worker_reports_the_reply_it_generated_as_cached(cluster):
    c = cluster(prefill=0, decode=0, colocated=1)
    with Client(c.address, timeout=30) as client:
        reply = list(client.complete(FIRST, PARAMS).token_ids)
        turn = client.complete(FIRST + reply + SECOND[-7:], PARAMS)
    assert turn.usage.prompt_tokens == 104 and turn.usage.cached_prompt_tokens == 6 * BLOCK
    assert_no_leaks(c.live())
