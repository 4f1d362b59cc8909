"""Warm-ups on a prefill engine (``LLMEngine.add_warm``, ``Scheduler._schedule_warm``): a prompt
computed only to leave its KV in the prefix cache (a finished reply, sent back by the gateway's
``--warm-replies``) runs only in steps that compute no other prompt, ``WARM_CHUNK`` tokens at a
time, is not counted as queued work, and its blocks are then found by a prompt that repeats them;
every block is free once it ends."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pdserve.services.gateway.warm import warm_tokens

from pdserve.engine import LLMEngine
from pdserve.scheduler import WARM_CHUNK
from pdserve.sequence import Sequence, SequenceStatus
from tests.engine.test_decode_prefix_reuse import PARAMS, A, ship
from tests.engine.test_disaggregated_engine import CopySender, engine, run_all
from tests.engine.test_scheduler import BS, make, run_step, seq

FOLDER: list = []  # the tiny model's folder, for prefill_turn's fresh decode engines


def warm(rid: str, prompt_len: int, first: int = 0) -> Sequence:
    q = seq(rid, prompt_len, max_tokens=1, first=first)
    q.warm = True
    return q


def prefills(batch) -> list[tuple[str, int]]:
    return [(q.request_id, n) for q, n in batch.prefills]


def test_a_warm_up_runs_only_in_steps_that_compute_no_other_prompt():
    s, alloc = make(num_blocks=64, budget=64)
    w = warm("w", 2 * WARM_CHUNK + 8)
    s.add(w)
    assert s.has_unfinished() and s.num_prompt_tokens_to_compute() == 0
    assert prefills(run_step(s)) == [("w", WARM_CHUNK)]  # alone: one chunk a step
    assert s.num_prompt_tokens_to_compute() == 0  # it is not queued work
    s.add(seq("a", 40, first=1000))
    assert prefills(run_step(s)) == [("a", 40)]  # a request goes first: the warm-up waits
    assert prefills(run_step(s)) == [("w", WARM_CHUNK)]
    assert prefills(run_step(s)) == [("w", 8)]
    while s.has_unfinished():
        run_step(s)
    assert alloc.num_used_blocks == 0
    # its blocks (all full ones but the last token's) are cached, as a prefill's
    again = seq("b", 2 * WARM_CHUNK + 8)
    s.add(again)
    run_step(s)
    assert again.num_cached_tokens == (2 * WARM_CHUNK + 8 - 1) // BS * BS


def test_no_new_warm_up_is_admitted_while_a_request_waits():
    s, _ = make(num_blocks=6, budget=64)
    a = seq("a", 8, max_tokens=5)  # 12 KV tokens: 3 blocks
    b = seq("b", 16, max_tokens=1, first=100)  # 4 blocks: does not fit beside a
    s.add(a)
    s.add(b)
    s.add(warm("w", 4, first=200))  # 1 block: would fit
    assert prefills(run_step(s)) == [("a", 8)]
    assert prefills(run_step(s)) == []  # a decodes, b waits for room: the warm-up too
    while a.status is not SequenceStatus.FINISHED:
        run_step(s)
    assert prefills(run_step(s)) == [("b", 16)]
    assert prefills(run_step(s)) == [("w", 4)]


def test_a_request_does_not_wait_for_a_warm_ups_blocks():
    """A prompt whose prefix a warm-up is computing reuses what it computed and computes the
    rest itself (the warm-up might wait behind other prompts), in the same step."""
    s, alloc = make(num_blocks=64, budget=64)
    s.add(warm("w", 3 * WARM_CHUNK, first=500))
    run_step(s)  # the warm-up's first chunk
    c = seq("c", 3 * WARM_CHUNK, first=500)
    s.add(c)
    assert prefills(run_step(s)) == [("c", 2 * WARM_CHUNK)]
    assert c.num_cached_tokens == WARM_CHUNK
    while s.has_unfinished():
        run_step(s)
    assert alloc.num_used_blocks == 0


def test_a_warm_up_is_not_admitted_past_the_seats():
    s, _ = make(num_blocks=64, max_num_seqs=1, budget=64)
    a = seq("a", 8, max_tokens=3)
    s.add(a)
    s.add(warm("w", 8, first=50))
    run_step(s)  # a takes the only seat
    assert prefills(run_step(s)) == []  # a decodes; no seat for the warm-up
    while a.status is not SequenceStatus.FINISHED:
        run_step(s)
    assert prefills(run_step(s)) == [("w", 8)]


def prefill_turn(prefill: LLMEngine, prompt: list[int], rid: str):
    """Prefill ``prompt`` on ``prefill`` for a fresh decode engine (all its blocks sent): the
    output (first token, prompt tokens found cached) and the KV sent."""
    landing = engine(FOLDER[0]).reserve_request(prompt, PARAMS, rid)
    sender = CopySender(len(landing.block_ids))
    prefill.add_prefill(prompt, PARAMS, rid, sender)
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    return outs[-1], sender.layers


def test_a_warm_engine_keeps_a_reply_that_the_next_prompt_then_finds(tiny_model):
    """A prefill engine computed A for a decode engine, which generated the reply; warming the
    prefill engine with A + the reply (but its last token) leaves those blocks cached there, and
    the next turn computes only the new message. Tokens as without the warm-up; no block kept."""
    folder, _ = tiny_model("gqa_untied")
    FOLDER[:] = [folder]
    prefill, decode = engine(folder), engine(folder)
    _, _, first = ship(prefill, decode, A, "turn-1")
    reply = [first, *run_all(decode)["turn-1"]]
    assert len(reply) == PARAMS.max_tokens == 6
    tokens = warm_tokens(A, reply, 4)
    assert tokens == (A + reply)[:32]  # A (27) and 5 of the reply: 8 full blocks
    prefill.add_warm(tokens, "turn-1.warm")
    assert not prefill.prompts_for_idle_decode()  # its steps borrow no cores
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    assert [o.finished for o in outs] == [True]
    assert outs[0].num_cached_tokens == 24  # A's 6 full blocks, computed for turn 1
    assert prefill.num_free_blocks == prefill.allocator.num_blocks
    turn_2 = A + reply + [60, 61, 62]  # 36 tokens
    out, kv = prefill_turn(prefill, turn_2, "turn-2")
    assert out.num_cached_tokens == 32  # the prompt and the reply's KV: only the message computed
    cold_out, cold_kv = prefill_turn(engine(folder), turn_2, "turn-2")
    assert cold_out.num_cached_tokens == 0 and out.new_token_ids == cold_out.new_token_ids
    for layer, (k, v) in cold_kv.items():
        torch.testing.assert_close(kv[layer], (k, v), rtol=1e-5, atol=1e-5)
    assert prefill.num_free_blocks == prefill.allocator.num_blocks


def test_a_warm_up_is_checked_like_a_prompt(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e: LLMEngine = engine(folder)
    with pytest.raises(ValueError, match="token id"):
        e.add_warm([10**9], "bad")
    e.add_warm(A, "w")
    with pytest.raises(ValueError, match="already in use"):
        e.add_warm(A, "w")
    e.step()  # under way: then aborted (the gateway's call was cancelled)
    e.abort_request("w")
    assert not e.has_unfinished_requests()
    assert e.num_free_blocks == e.allocator.num_blocks


@pytest.mark.parametrize(
    ("prompt_len", "reply_len", "expected"),
    [
        (27, 6, 32),  # 27 + 5 = 32 tokens: 8 full blocks, 2 more than the prompt's 6
        (27, 2, 28),  # 28: 7 blocks, 1 more than the prompt's (its last, now full)
        (24, 1, 0),  # a one-token reply: its KV was never written
        (24, 4, 0),  # 27 tokens: no full block past the prompt's 6
        (24, 5, 28),
    ],
)
def test_what_a_reply_warms(prompt_len, reply_len, expected):
    prompt, reply = list(range(prompt_len)), list(range(1000, 1000 + reply_len))
    got = warm_tokens(prompt, reply, 4)
    assert len(got) == expected and got == (prompt + reply)[:expected]


def test_a_prefill_worker_refuses_warm_ups_beyond_the_ones_waiting(tiny_model):
    """With ``MAX_WARMING`` warm-ups waiting, another is refused at once (AdmissionError:
    RESOURCE_EXHAUSTED, which the gateway counts as ``refused``), before it reaches the engine."""
    from pdserve.services.main import kv_layout
    from pdserve.services.prefill.worker import MAX_WARMING, PrefillWorker

    from pdserve.engine import AdmissionError
    from pdserve.transfer import create_transport

    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    worker = PrefillWorker(e, create_transport("loopback", kv_layout(e, "tiny")))
    for i in range(MAX_WARMING):
        e.add_warm(A, f"w{i}")  # the worker's engine loop is not started: they stay waiting
    with pytest.raises(AdmissionError, match=f"{MAX_WARMING} warm-ups wait"):
        asyncio.run(worker.warm("one-more", A))
    assert len(e.scheduler.warming) == MAX_WARMING and "one-more" not in e.requests_in_flight()
    worker.transport.close()
