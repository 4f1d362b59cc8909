import time

import pytest

from pdserve.config import SchedulerConfig
from pdserve.kv_cache.allocator import BlockAllocator
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import Scheduler
from pdserve.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=16, max_num_seqs=8, budget=64, order="shortest"):
    alloc = BlockAllocator(num_blocks)
    config = SchedulerConfig(max_num_seqs, budget, prompt_order=order)
    return Scheduler(config, alloc, BS), alloc


def seq(rid, prompt_len, max_tokens=4, first=0):
    return Sequence(
        rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens)
    )


def run_step(s: Scheduler, token=1):
    """What the engine does around the model: schedule, (forward), postprocess, append tokens."""
    batch = s.schedule()
    s.postprocess(batch)
    for q in [q for q, _ in batch.prefills if not q.in_prefill] + batch.decodes:
        q.output_token_ids.append(token)
        reason = q.check_token_stop()
        if reason:
            s.finish(q, reason)
    return batch


def test_admission_reserves_the_whole_lifetime():
    s, alloc = make(num_blocks=16)
    q = seq("a", prompt_len=6, max_tokens=7)  # 6 + 7 - 1 = 12 KV tokens -> 3 blocks
    s.add(q)
    s.schedule()
    assert len(q.block_table) == 3 and alloc.num_used_blocks == 3


@pytest.mark.parametrize(
    ("order", "admitted", "left"), [("arrival", "ab", "c"), ("shortest", "cb", "a")]
)
def test_a_full_cache_keeps_requests_waiting_in_order_and_frees_everything(order, admitted, left):
    s, alloc = make(num_blocks=4, order=order)
    a, b, c = (
        seq("a", 8, 5),
        seq("b", 4, 1),
        seq("c", 2, 1),
    )  # blocks: a 12 tokens = 3, b 4 = 1, c 1
    for q in (a, b, c):
        s.add(q)
    first = run_step(s)
    assert [q.request_id for q, _ in first.prefills] == list(admitted)
    # no block left for it (arrival: c would fit, but nobody overtakes a)
    assert {"a": a, "b": b, "c": c}[left].status is SequenceStatus.WAITING
    later = set()
    while s.has_unfinished():
        later.update(q.request_id for q, _ in run_step(s).prefills)
    assert left in later and alloc.num_free_blocks == 4
    assert all(q.status is SequenceStatus.FINISHED for q in (a, b, c))


def test_requests_larger_than_the_cache_are_refused_at_once():
    s, _ = make(num_blocks=2)
    with pytest.raises(ValueError, match="needs 3 KV blocks .* whole cache has 2"):
        s.add(seq("big", prompt_len=9, max_tokens=2))


def test_chunked_prefill_respects_the_token_budget():
    s, alloc = make(budget=5)
    q = seq("a", prompt_len=12, max_tokens=2)
    s.add(q)
    chunks = []
    while q.in_prefill:
        batch = run_step(s)
        assert batch.num_tokens <= 5
        chunks.append(batch.prefills[0][1])
    assert chunks == [5, 5, 2]
    while s.has_unfinished():
        run_step(s)
    assert alloc.num_free_blocks == alloc.num_blocks


def test_decodes_come_first_and_max_num_seqs_caps_the_batch():
    s, alloc = make(max_num_seqs=2, budget=64)
    qs = [seq(str(i), 3, max_tokens=3) for i in range(3)]
    for q in qs:
        s.add(q)
    b1 = run_step(s)
    assert len(b1.prefills) == 2 and not b1.decodes
    b2 = run_step(s)
    assert len(b2.decodes) == 2 and not b2.prefills  # the third waits for a free seat
    while s.has_unfinished():
        run_step(s)
    assert alloc.num_free_blocks == alloc.num_blocks


def test_prefix_blocks_are_reused_and_shared_safely():
    s, alloc = make(num_blocks=16)
    a = seq("a", prompt_len=10, max_tokens=2)  # 2 full blocks of prompt
    s.add(a)
    run_step(s)  # prefill a fully; its two full prompt blocks get hashes
    b = seq("b", prompt_len=10, max_tokens=2)  # the same prompt
    s.add(b)
    batch = s.schedule()
    assert b.num_cached_tokens == 8 and batch.prefills == [(b, 2)]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert alloc.ref_count(a.block_table[0]) == 2
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert alloc.num_free_blocks == 16


def test_prefix_reuse_always_leaves_a_token_to_compute():
    s, _ = make()
    a = seq("a", prompt_len=8, max_tokens=2)  # exactly two full blocks
    s.add(a)
    run_step(s)
    b = seq("b", prompt_len=8, max_tokens=2)
    s.add(b)
    batch = s.schedule()
    assert b.num_cached_tokens == 4 and batch.prefills == [(b, 4)]


def test_abort_of_waiting_and_running_frees_blocks():
    s, alloc = make(num_blocks=3)
    a, b = seq("a", 8, 2), seq("b", 8, 2)  # 3 blocks each: b must wait
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b, "abort")
    s.finish(a, "abort")
    s.finish(a, "abort")  # idempotent
    assert alloc.num_free_blocks == 3 and not s.has_unfinished()


def test_a_prompt_whose_prefix_is_being_computed_waits_for_it_and_reuses_it():
    s, alloc = make(num_blocks=32)
    a, b = seq("a", 10, 2), seq("b", 10, 2)  # the same prompt: 2 full blocks and 2 tokens
    c = seq("c", 6, 2, first=50)  # another prompt, behind b in the queue
    for q in (a, b, c):
        s.add(q)
    first = run_step(s)
    # b would compute a's prefix beside it: it keeps its place, c goes ahead
    assert sorted(q.request_id for q, _ in first.prefills) == ["a", "c"]
    assert b.status is SequenceStatus.WAITING and list(s.waiting) == [b]
    second = s.schedule()
    assert second.prefills == [(b, 2)] and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    for q in (a, b, c):
        s.finish(q, "abort")
    assert alloc.num_free_blocks == 32


def test_a_prompt_waiting_for_a_prefix_computes_it_when_its_computer_is_aborted():
    s, alloc = make(num_blocks=32, budget=4)  # a's 10 tokens take three steps
    a, b = seq("a", 10, 2), seq("b", 10, 2)
    s.add(a)
    s.add(b)
    run_step(s)  # a's first block computed (and cached); its second is still to come
    assert b.status is SequenceStatus.WAITING
    # the queue's estimate counts b's prefix as computed here: a computes it
    assert s.num_prompt_tokens_to_compute() == (10 - 4) + (10 - 8)
    s.finish(a, "abort")
    batch = s.schedule()
    assert batch.prefills == [(b, 4)] and b.num_cached_tokens == 4  # a's first block, kept
    s.finish(b, "abort")
    assert alloc.num_free_blocks == 32


def test_prompts_of_other_prefixes_are_admitted_together():
    s, _ = make(num_blocks=32)
    qs = [seq(str(i), 10, 2, first=100 * i) for i in range(3)]
    for q in qs:
        s.add(q)
    assert [q for q, _ in s.schedule().prefills] == qs


def test_a_local_prefill_waits_for_a_prefix_a_transfer_is_bringing():
    """On a decode worker: a prompt prefilled locally whose prefix a reserved request is
    receiving waits for that KV to land and reuses it; if the transfer fails (the reserved
    request ends), it computes the prefix itself."""
    for transfer_lands in (True, False):
        s, alloc = make(num_blocks=32)
        shipped = seq("shipped", 10, 2)
        assert s.reserve(shipped)  # its KV is on its way: 2 full blocks
        local = seq("local", 10, 2)
        s.add(local)
        assert not s.schedule() and local.status is SequenceStatus.WAITING
        assert s.num_prompt_tokens_to_compute() == 2
        other = seq("other", 6, 2, first=50)
        assert s.reserve(other)  # a request waiting for a prefix holds no reservation back
        if transfer_lands:
            s.activate(shipped)
            assert s.schedule().prefills == [(local, 2)] and local.num_cached_tokens == 8
        else:
            s.finish(shipped, "kv transfer failed")
            assert s.schedule().prefills == [(local, 10)] and local.num_cached_tokens == 0
        for q in (shipped, local, other):
            s.finish(q, "abort")
        assert alloc.num_free_blocks == 32


def test_a_reservation_goes_ahead_of_prompts_waiting_for_the_token_budget_only():
    """On a decode worker prefilling prompts itself: a prompt that waits for the step's token
    budget leaves room for a transfer's reservation (refusing it bounced disaggregated requests
    while a core sat idle); a reservation that would take the seat or the blocks a waiting prompt
    needs is refused, and nothing it tried to take stays allocated."""
    s, alloc = make(num_blocks=12, max_num_seqs=4, budget=8)
    first, second = seq("first", 8, 4), seq("second", 8, 4, first=100)  # 3 blocks each
    s.add(first)
    s.add(second)
    assert s.schedule().prefills == [(first, 8)]  # the budget is spent: second waits for it
    assert second.status is SequenceStatus.WAITING
    shipped = seq("shipped", 8, 4, first=200)
    assert s.reserve(shipped)  # 3 + 3 taken, 3 for second: room for all
    assert alloc.num_used_blocks == 6
    # 6 blocks free; second needs 3: a 5-block reservation would leave it 1
    big = seq("big", 16, 5, first=300)
    assert not s.reserve(big) and big.block_table == [] and alloc.num_used_blocks == 6
    assert s.reserve(seq("small", 8, 4, first=400))  # 3 blocks: 3 left, second's 3 fit
    assert not s.reserve(seq("seat", 2, 1, first=500))  # 3 seats taken + second's = max_num_seqs
    assert alloc.num_used_blocks == 9


def test_a_finished_requests_generated_blocks_are_found_by_a_prompt_that_repeats_them():
    """A chat's next turn sends the last prompt and its reply again: the full blocks of the reply
    (and the prompt's last block, which it filled) are found, as far as their KV was written."""
    s, alloc = make(num_blocks=16)
    a = seq("a", prompt_len=6, max_tokens=7)  # blocks: [0..3] [4,5,o0,o1] [o2..o5] [o6: no KV]
    s.add(a)
    for t in range(7):
        run_step(s, token=50 + t)
    assert a.status is SequenceStatus.FINISHED and alloc.num_free_blocks == 16
    outputs = list(range(50, 57))
    turn = Sequence("b", list(range(6)) + outputs + [90, 91], SamplingParams(max_tokens=2))
    s.add(turn)
    s.schedule()
    # the KV of prompt + o0..o5 is in the cache (12 tokens: 3 full blocks); o6 was never fed back
    assert turn.num_cached_tokens == 12
    s.finish(turn, "abort")
    assert alloc.num_free_blocks == 16


def test_generated_blocks_match_only_the_same_tokens_in_the_same_place():
    s, _ = make(num_blocks=16)
    a = seq("a", prompt_len=6, max_tokens=7)
    s.add(a)
    for t in range(7):
        run_step(s, token=50 + t)
    # the reply's tokens differ from a's in the third block: the first two are found
    other_reply = Sequence(
        "b", list(range(6)) + [50, 51, 52, 99, 54, 55, 60], SamplingParams(max_tokens=2)
    )
    other_prompt = Sequence("c", [7] + list(range(1, 6)) + list(range(50, 57)), SamplingParams())
    for q in (other_reply, other_prompt):
        s.add(q)
    s.schedule()
    assert other_reply.num_cached_tokens == 8
    assert other_prompt.num_cached_tokens == 0  # same reply after another prompt: no match


def test_without_prefix_caching_nothing_generated_is_published():
    alloc = BlockAllocator(16)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), alloc, BS, False)
    a = seq("a", prompt_len=6, max_tokens=7)
    s.add(a)
    for t in range(7):
        run_step(s, token=50 + t)
    assert alloc.cached_hashes() == ()


def test_shortest_first_passes_a_long_prompt_over_between_its_chunks():
    s, alloc = make(num_blocks=32, budget=8)
    long, short = seq("long", 20, 2), seq("short", 5, 2, first=100)
    s.add(long)
    assert run_step(s).prefills == [(long, 8)]
    s.add(short)  # arrives while the long one is half-way
    assert run_step(s).prefills == [(short, 5), (long, 3)]
    step = run_step(s)
    assert step.decodes == [short] and step.prefills == [(long, 7)]
    while s.has_unfinished():
        run_step(s)
    assert alloc.num_free_blocks == 32


def test_arrival_order_finishes_the_running_prompt_first():
    s, _ = make(num_blocks=32, budget=8, order="arrival")
    long, short = seq("long", 20, 2), seq("short", 5, 2, first=100)
    s.add(long)
    run_step(s)
    s.add(short)
    assert run_step(s).prefills == [(long, 8)]
    assert run_step(s).prefills == [(long, 4), (short, 4)]


@pytest.mark.parametrize(("waited_s", "first"), [(0.8, "short"), (2.0, "long")])
def test_a_prompt_passed_over_long_enough_goes_before_later_shorter_ones(waited_s, first):
    """At 10 ms a token a 40-token prompt takes 0.4 s; passed over for ~4x that (PROMPT_AGING)
    it counts as shorter than a fresh 10-token one."""
    s, _ = make(num_blocks=64, budget=64)
    s.token_s = 0.01
    long, short = seq("long", 40, 2), seq("short", 10, 2, first=100)
    long.arrival = time.monotonic() - waited_s  # 40 - waited / (0.01 * 4): 20 or -10 tokens
    s.add(long)
    s.add(short)
    assert s.schedule().prefills[0][0].request_id == first


def test_nobody_is_admitted_past_a_shorter_prompt_that_does_not_fit():
    """A long reply's blocks (max_tokens) may not fit while a longer prompt's would: it is not
    overtaken, or prompts that fit would keep coming ahead of it."""
    s, alloc = make(num_blocks=8, budget=64)
    running = seq("running", 8, 13)  # 20 KV tokens: 5 blocks
    s.add(running)
    run_step(s)
    short, longer = seq("short", 4, 13, first=100), seq("longer", 8, 1, first=200)  # 4 and 2 blocks
    s.add(short)
    s.add(longer)
    assert s.schedule().prefills == [] and list(s.waiting) == [short, longer]
    s.finish(running, "abort")
    assert [q for q, _ in s.schedule().prefills] == [short, longer]
    for q in (short, longer):
        s.finish(q, "abort")
    assert alloc.num_free_blocks == 8


def test_an_unknown_prompt_order_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="prompt order 'sjf' is not one of shortest, arrival"):
        SchedulerConfig(prompt_order="sjf")
