"""The prefix cache holds what a request generated, not only its prompt: a chat's next turn sends
the last prompt and its reply again, and finds both, on a colocated engine (it computes only the
new message) and on a decode engine (only the blocks after them are sent). The tokens are those
of an engine that reuses nothing, and every block is free once the requests end."""

from __future__ import annotations

from pdserve.engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from tests.engine.test_decode_prefix_reuse import PARAMS, A, serve_one_by_one, ship
from tests.engine.test_disaggregated_engine import engine, run_all

NEW_MESSAGE = [60, 61, 62]


def generate(e: LLMEngine, prompt: list[int], rid: str) -> tuple[list[int], int]:
    """Tokens of ``prompt`` on ``e`` alone, and the prompt tokens it took from its cache."""
    e.add_request(prompt, PARAMS, rid)
    tokens, cached = [], 0
    while e.has_unfinished_requests():
        for o in e.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    return tokens, cached


def test_a_colocated_engine_reuses_the_reply_of_the_turn_before(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e, plain = engine(folder), engine(folder, prefix_caching=False)
    reply, _ = generate(e, A, "turn-1")
    assert len(reply) == PARAMS.max_tokens == 6
    turn_2 = A + reply + NEW_MESSAGE  # 36 tokens
    tokens, cached = generate(e, turn_2, "turn-2")
    # KV of A (27) and the reply's first 5 (its last was never fed back): 32 tokens, 8 blocks
    assert cached == 32
    assert tokens == generate(plain, turn_2, "turn-2")[0]
    assert e.num_free_blocks == e.allocator.num_blocks
    # the blocks of turn 2's own reply are found in turn 3
    _, cached = generate(e, turn_2 + tokens + NEW_MESSAGE, "turn-3")
    assert cached == (36 + 5) // 4 * 4
    assert e.num_free_blocks == e.allocator.num_blocks


def test_a_decode_engine_holds_the_reply_and_is_sent_only_the_new_message(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    prefill, decode = engine(folder), engine(folder)
    _, _, first = ship(prefill, decode, A, "turn-1")
    reply = [first, *run_all(decode)["turn-1"]]
    turn_2 = A + reply + NEW_MESSAGE
    landing, sender, first_2 = ship(prefill, decode, turn_2, "turn-2")
    assert landing.num_cached_blocks == 8  # the prompt and the reply's KV, as far as written
    assert all(k.shape[0] == 1 for k, _ in sender.layers.values())  # one block sent
    tokens = [first_2, *run_all(decode)["turn-2"]]
    assert tokens == serve_one_by_one(folder, [turn_2], False)["0"]
    assert decode.num_free_blocks == decode.allocator.num_blocks
    assert prefill.num_free_blocks == prefill.allocator.num_blocks


def test_a_request_aborted_mid_decode_leaves_what_it_had_written(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    e.add_request(A, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), "long")
    tokens: list[int] = []
    while len(tokens) < 10:  # 27 + 9 tokens in the cache after the tenth
        for o in e.step():
            tokens += o.new_token_ids
    e.abort_request("long")
    assert e.num_free_blocks == e.allocator.num_blocks
    _, cached = generate(e, A + tokens + NEW_MESSAGE, "next")
    assert cached == 36
