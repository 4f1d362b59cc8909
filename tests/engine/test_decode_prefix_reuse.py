"""Decode-side prefix reuse: a reservation shares the prompt's leading full blocks that the decode
engine already holds (finished or running requests' prompts), the prefill engine sends only the
blocks after them, and the tokens are those of a decode engine that reuses nothing."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from tests.engine.test_disaggregated_engine import CopySender, engine, run_all

BLOCK = 4
PREFIX = [1] + list(range(100, 123))  # 24 tokens: 6 full blocks of 4
A = PREFIX + [7, 8, 9]  # 27 tokens: 7 blocks, the last one partial
B = PREFIX + [50, 51, 52, 53, 54, 55]  # 30 tokens: shares A's 6 full blocks
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def ship(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], rid: str):
    """Reserve on ``decode``, prefill on ``prefill`` sending what the landing asks for, land it,
    activate: returns the landing, the sender and the first token."""
    landing = decode.reserve_request(prompt, PARAMS, rid)
    sender = CopySender(len(landing.block_ids))
    prefill.add_prefill(prompt, PARAMS, rid, sender, skip_blocks=landing.num_cached_blocks)
    first = None
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            first = o.new_token_ids[0]
    ids = torch.tensor(landing.block_ids)
    for layer, (k, v) in sender.layers.items():
        assert k.shape[0] == len(landing.block_ids)  # only the blocks the landing asked for
        landing.k_pools[layer].index_copy_(0, ids, k)
        landing.v_pools[layer].index_copy_(0, ids, v)
    decode.activate_request(rid, first)
    return landing, sender, first


def serve_one_by_one(folder, prompts, prefix_caching: bool) -> dict[str, list[int]]:
    prefill, decode = engine(folder), engine(folder, prefix_caching=prefix_caching)
    tokens = {}
    for i, prompt in enumerate(prompts):
        _, _, first = ship(prefill, decode, prompt, str(i))
        tokens[str(i)] = [first, *run_all(decode)[str(i)]]
    assert decode.num_free_blocks == decode.allocator.num_blocks
    assert prefill.num_free_blocks == prefill.allocator.num_blocks
    return tokens


def test_a_finished_requests_prompt_blocks_are_reused_and_only_the_rest_is_sent(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    prefill, decode = engine(folder), engine(folder)
    a, sent_a, _ = ship(prefill, decode, A, "a")
    assert a.num_cached_blocks == 0 and len(a.block_ids) == 7
    run_all(decode)
    assert decode.num_free_blocks == decode.allocator.num_blocks  # a's blocks free, still cached

    b, sent_b, _ = ship(prefill, decode, B, "b")
    table = decode.scheduler.running[0].block_table
    assert b.num_cached_blocks == 6 and table[:6] == list(a.block_ids[:6])  # exactly those
    assert b.block_ids == tuple(table[6:8])  # 30 tokens: blocks 6 and 7 land, fresh
    assert not set(b.block_ids) & set(a.block_ids[:6])
    assert b.generation == decode.allocator.generation_of(b.block_ids[0]) > a.generation
    assert all(decode.allocator.ref_count(blk) == 1 for blk in table)
    # the prefill engine sent 2 blocks per layer instead of 8
    assert all(k.shape[0] == 2 for k, _ in sent_b.layers.values())
    assert all(k.shape[0] == 7 for k, _ in sent_a.layers.values())
    run_all(decode)
    assert decode.num_free_blocks == decode.allocator.num_blocks


def test_a_running_requests_prompt_blocks_are_shared_with_refcounts(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    prefill, decode = engine(folder), engine(folder)
    a, _, first_a = ship(prefill, decode, A, "a")  # activated, not finished
    b, _, first_b = ship(prefill, decode, B, "b")
    shared = a.block_ids[:6]
    assert b.num_cached_blocks == 6
    assert all(decode.allocator.ref_count(blk) == 2 for blk in shared)
    # a request aborted while its transfer has not settled holds its landing blocks only: the
    # shared ones are never written by a transfer
    c = decode.reserve_request(B, PARAMS, "c")  # a's 6 blocks, and b's 7th (full) one
    assert c.num_cached_blocks == 7 and len(c.block_ids) == 1  # its last block: fresh
    assert all(decode.allocator.ref_count(x) == 3 for x in shared)
    assert decode.allocator.ref_count(b.block_ids[0]) == 2
    free = decode.num_free_blocks
    decode.hold_landing("c")
    decode.abort_request("c")
    assert all(decode.allocator.ref_count(x) == 2 for x in shared)
    assert decode.allocator.ref_count(b.block_ids[0]) == 1
    assert all(decode.allocator.ref_count(x) == 1 for x in c.block_ids)  # held
    assert decode.num_free_blocks == free + 1  # c's block for its max_tokens: freed
    decode.release_held("c")

    got = run_all(decode)
    assert [first_a, *got["a"]] == serve_one_by_one(folder, [A], False)["0"]
    assert [first_b, *got["b"]] == serve_one_by_one(folder, [B], False)["0"]
    assert decode.num_free_blocks == decode.allocator.num_blocks


def test_outputs_equal_those_without_reuse(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    prompts = [A, B, A, B + [3, 4], PREFIX[:9]]
    assert serve_one_by_one(folder, prompts, True) == serve_one_by_one(folder, prompts, False)


def test_the_block_with_the_last_prompt_token_is_always_sent(tiny_model):
    """A prompt of whole blocks, all cached: its last block is sent again, carrying the first
    token (the transfer is never empty)."""
    folder, _ = tiny_model("gqa_untied")
    prefill, decode = engine(folder), engine(folder)
    ship(prefill, decode, PREFIX, "a")
    run_all(decode)
    again, sender, _ = ship(prefill, decode, PREFIX, "b")
    assert again.num_cached_blocks == 5 and len(again.block_ids) == 1 and sender.token is not None
    run_all(decode)
    assert decode.num_free_blocks == decode.allocator.num_blocks


def test_without_prefix_caching_nothing_is_reused(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    prefill, decode = engine(folder), engine(folder, prefix_caching=False)
    ship(prefill, decode, A, "a")
    run_all(decode)
    b, sender, _ = ship(prefill, decode, B, "b")
    assert b.num_cached_blocks == 0 and len(b.block_ids) == 8
    assert all(k.shape[0] == 8 for k, _ in sender.layers.values())
    run_all(decode)
    assert decode.num_free_blocks == decode.allocator.num_blocks


@pytest.mark.parametrize(
    ("skip", "num_blocks", "message"),
    [
        (7, 1, "destination holds 7 of the prompt's 7 blocks already; it may hold 0 to 6"),
        (-1, 8, "destination holds -1 of the prompt's 7 blocks already"),
        (6, 2, "destination has 2 blocks; the prompt fills 7, 6 of them held there already"),
    ],
)
def test_a_bad_number_of_skipped_blocks_is_refused(tiny_model, skip, num_blocks, message):
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    with pytest.raises(ValueError, match=message):
        e.add_prefill(A, PARAMS, "a", CopySender(num_blocks), skip_blocks=skip)
    assert not e.has_unfinished_requests() and e.num_free_blocks == e.allocator.num_blocks


def test_a_direct_sender_holds_only_the_blocks_it_sends(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    e.add_prefill(B, PARAMS, "b", CopySender(2, direct=True), skip_blocks=6)
    while e.has_unfinished_requests():
        e.step()
    assert e.num_free_blocks == e.allocator.num_blocks - 2
    e.release_held("b")
    assert e.num_free_blocks == e.allocator.num_blocks


def test_a_local_prefill_waiting_for_a_prefix_in_transfer_idles_the_engine_thread(tiny_model):
    """On a decode worker, a prompt prefilled locally that shares a prefix with a request whose
    KV is on its way waits for it: the engine thread then has nothing to run and blocks for the
    next command (no empty steps spinning on a core), and runs it once the prefix lands, reusing
    it — the same tokens as a decode engine that reuses nothing."""
    import asyncio

    from pdserve.engine_loop import EngineLoop

    folder, _ = tiny_model("gqa_untied")
    prefill, decode = engine(folder), engine(folder)
    expected = serve_one_by_one(folder, [A, B], prefix_caching=False)

    async def scenario() -> tuple[list[int], int]:
        loop = EngineLoop(decode, warm_up=False)
        loop.start(asyncio.get_running_loop())
        try:
            landing = await loop.call(lambda e: e.reserve_request(A, PARAMS, "shipped"))
            stream = loop.open_stream("local")
            await loop.call(lambda e: e.add_request(B, PARAMS, "local"))
            steps = loop.num_steps
            for _ in range(20):  # each command is a chance to step: nothing to run
                await loop.call(lambda e: None)
            assert loop.num_steps == steps
            assert [s.request_id for s in decode.scheduler.waiting] == ["local"]
            # the prefix lands
            sender = CopySender(len(landing.block_ids))
            prefill.add_prefill(A, PARAMS, "shipped", sender)
            first = run_all(prefill)["shipped"][0]
            ids = torch.tensor(landing.block_ids)
            for layer, (k, v) in sender.layers.items():
                landing.k_pools[layer].index_copy_(0, ids, k)
                landing.v_pools[layer].index_copy_(0, ids, v)
            await loop.call(lambda e: e.activate_request("shipped", first))
            tokens, cached = [], 0
            while True:
                out = await stream.get()
                tokens += out.new_token_ids
                cached = max(cached, out.num_cached_tokens)
                if out.finish_reason:
                    return tokens, cached
        finally:
            loop.stop()

    tokens, cached = asyncio.run(scenario())
    assert cached == 24 and tokens == expected["1"]
    run_all(decode)
    assert decode.num_free_blocks == decode.allocator.num_blocks
