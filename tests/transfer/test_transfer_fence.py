"""Fenced KV blocks (pdserve/transfer/fence.py): a transfer's id is the generation of the
reservation it lands in, and a message of a reservation that is over never lands in blocks that
were freed and handed to a new owner; it is dropped and counted. Real UCX (in-process pairs, and
a sender process stopped by SIGSTOP in the middle of a message) and the loopback transport."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import generate_latest

from pdserve.kv_cache.allocator import BlockAllocator
from pdserve.metrics import WorkerMetrics
from pdserve.transfer import (
    KVLayout,
    KVTransport,
    PoolDestination,
    TransferError,
    create_transport,
)
from pdserve.transfer.recv_transfer import RecvTransfer
from pdserve.transfer.ucx import UCXTransport
from tests.transfer import peers
from tests.transfer.peers import Pools, block_ids, default_layout, recv

KINDS = ["loopback", "ucx"]
NUM_BLOCKS = 32
POOL_BLOCKS = 48
TOKEN = 777
_seeds = itertools.count(100)


def wait_for(predicate, timeout: float = 10.0, what: str = "a condition") -> None:  # noqa: ANN001
    """Poll ``predicate`` (a state the transport's thread reaches) until true or ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVTransport, KVTransport]]:
    layout = default_layout(torch.bfloat16)
    sender = create_transport(request.param, layout)
    receiver = create_transport(request.param, layout)
    yield sender, receiver
    sender.close()
    receiver.close()


def send_all(sender: KVTransport, address: bytes, tid: int, seed: int, dst: torch.Tensor):  # noqa: ANN201
    """Send transfer ``seed``'s KV as the prefill worker does (from its pools, direct where the
    transport can) under transfer id ``tid`` to blocks ``dst``; returns the SendTransfer."""
    pools = Pools(sender.layout, POOL_BLOCKS)
    src = block_ids(POOL_BLOCKS, NUM_BLOCKS, seed, run=True)
    pools.fill(src, seed)
    tx = sender.start_send(
        sender.connect(address), tid, NUM_BLOCKS, timeout=20.0, dst_block_ids=dst.tolist()
    )
    for layer in range(sender.layout.num_layers):
        tx.send_pool_layer(layer, pools.k[layer], pools.v[layer], src)
    tx.finish(TOKEN)
    return tx


def test_a_late_sender_of_a_freed_reservation_cannot_touch_its_new_owner(pair) -> None:  # noqa: ANN001
    """Blocks reserved (generation g1), the transfer cancelled, the blocks freed and reserved
    again (g2) by a new owner whose KV lands; then the first reservation's sender, late, sends
    all of its KV. Every one of its messages is dropped and counted, and the new owner's blocks
    hold its own KV, bit for bit (and no other block of the pools was touched)."""
    sender, receiver = pair
    layout = receiver.layout
    allocator = BlockAllocator(POOL_BLOCKS)
    pools = Pools(layout, POOL_BLOCKS)

    ids = allocator.allocate(NUM_BLOCKS)  # one run: UCX lands it direct in the pools
    old = allocator.generation_of(ids[0])
    dst = torch.tensor(ids)
    old_rt = receiver.expect(old, PoolDestination(pools.k, pools.v, dst), timeout=20.0)
    old_rt.cancel("the request went away")
    with pytest.raises(TransferError, match="went away"):
        old_rt.wait()
    assert old_rt.settled.done()  # nothing was under way: free at once, no delay
    allocator.free(ids)

    again = allocator.allocate(NUM_BLOCKS)
    new = allocator.generation_of(again[0])
    assert again == ids and new > old  # the same blocks, a new owner, a new generation
    new_seed = next(_seeds)
    new_rt = receiver.expect(new, PoolDestination(pools.k, pools.v, dst), timeout=20.0)
    send_all(sender, receiver.address(), new, new_seed, dst).wait()
    assert new_rt.wait().num_layers == layout.num_layers and new_rt.token_id == TOKEN
    assert pools.mismatches(dst, new_seed) == []

    late = send_all(sender, receiver.address(), old, next(_seeds), dst)
    late.wait()  # taken and dropped by the receiver (UCX: drained), not left to time out
    messages = len(late._futures)
    wait_for(lambda: receiver.counters().stale_messages == messages, what="the stale count")
    assert pools.mismatches(dst, new_seed) == []  # bit for bit the new owner's KV, still
    counters = receiver.counters()
    assert (counters.unsettled_transfers, counters.unsettled_blocks) == (0, 0)
    metrics = WorkerMetrics()  # as a decode worker exposes them
    metrics.watch_transport(receiver.counters)
    scraped = generate_latest(metrics.registry).decode()
    assert f"pdserve_kv_stale_messages_total {float(messages)}" in scraped
    assert "pdserve_kv_unsettled_blocks 0.0" in scraped
    with pytest.raises(ValueError, match="in use|was"):  # a generation is never reused
        receiver.expect(old, PoolDestination(pools.k, pools.v, dst), timeout=1.0)
    allocator.free(again)
    assert allocator.num_free_blocks == POOL_BLOCKS


def test_blocks_of_a_transfer_that_has_not_settled_are_refused(pair) -> None:  # noqa: ANN001
    """The fence checks a new reservation against the blocks' current owner: blocks whose
    transfer has not settled cannot be handed to another transfer."""
    _, receiver = pair
    pools = Pools(receiver.layout, POOL_BLOCKS)
    first = receiver.expect(1, PoolDestination(pools.k, pools.v, range(0, 8)), timeout=20.0)
    with pytest.raises(ValueError, match="block 7 still belongs to transfer 1"):
        receiver.expect(2, PoolDestination(pools.k, pools.v, range(7, 15)), timeout=20.0)
    other = receiver.expect(3, PoolDestination(pools.k, pools.v, range(8, 16)), timeout=20.0)
    for rt in (first, other):
        rt.cancel()
        with pytest.raises(TransferError):
            rt.wait()
        assert rt.settled.done()
    receiver.expect(4, PoolDestination(pools.k, pools.v, range(7, 15)), timeout=20.0).cancel()


# -- a sender stopped in the middle of a message (UCX, separate process) ----------------------

BIG = KVLayout(
    "fence-test", torch.float32, block_size=16, num_layers=2, num_kv_heads=8, head_dim=128
)
BIG_BLOCKS = 256  # 64 KiB blocks: each K or V message is 16 MiB, long enough to stop half-way
BIG_POOL = 272


class StoppableSender:
    """A prefill-like sender process (peers.pool_sender_main) that the test can SIGSTOP."""

    def __init__(self, address: bytes) -> None:
        self.proc, self.conn = peers.spawn(peers.pool_sender_main, BIG, address, BIG_POOL)
        assert recv(self.conn) == ("ready",)

    def send(self, tid: int, seed: int, dst: torch.Tensor) -> None:
        self.conn.send(("send", tid, seed, dst.tolist()))

    def reply(self) -> tuple:
        reply = recv(self.conn)
        assert reply[0] != "crashed", reply[1]
        return reply

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # killed by the test, and reaped
            os.kill(self.proc.pid, signal.SIGCONT)
        peers.stop(self.proc)


STUCK_S = 0.2  # what a stopped sender had in its socket has landed by then (loopback)


def stop_landing(
    sender: StoppableSender, receiver: KVTransport, pools: Pools, dst, tid: int
) -> RecvTransfer:  # noqa: ANN001
    """Transfer ``tid`` into ``dst``, its sender stopped (SIGSTOP) once its first bytes landed."""
    for p in (*pools.k, *pools.v):
        p.zero_()
    rt = receiver.expect(tid, PoolDestination(pools.k, pools.v, dst), timeout=20.0)
    sender.send(tid, tid, dst)
    first = pools.k[0][int(dst[0])]
    wait_for(lambda: bool(first.any()) or rt.done(), what="the first bytes to land")
    os.kill(sender.proc.pid, signal.SIGSTOP)
    return rt


def stop_half_way(
    sender: StoppableSender, receiver: KVTransport, pools: Pools, dst
) -> RecvTransfer:  # noqa: ANN001
    """A transfer into ``dst`` whose sender is stopped (SIGSTOP) with a message half-way in, and
    which the receiver then cancelled: it is over, not settled. Retried when the stop happens to
    fall between two messages (rare: several 16 MiB messages are in flight at once), or when
    what the stopped sender had already written to the socket completes the message (CI saw one
    settle so, after the check below had found it unsettled: so it must stay so ``STUCK_S``)."""
    for attempt in range(1, 6):
        rt = stop_landing(sender, receiver, pools, dst, 10 + attempt)
        rt.cancel("the request went away")
        with contextlib.suppress(TransferError):  # unless it had landed whole already
            rt.wait()
        _, pending = concurrent.futures.wait([rt.settled], timeout=STUCK_S)
        if pending:
            return rt
        os.kill(sender.proc.pid, signal.SIGCONT)
        assert sender.reply()[0] == "posted" and sender.reply()[0] in ("sent", "failed")
    raise AssertionError("the sender was never stopped in the middle of a message")


def test_a_sender_stopped_half_way_keeps_the_blocks_fenced_until_its_write_ends() -> None:
    """UCX cannot cancel a receive it has matched: a sender stopped by SIGSTOP in the middle of
    a message writes the rest after SIGCONT. The failed transfer therefore settles only then;
    until it has, its blocks are refused to a new owner. Afterwards the new owner's KV lands and
    stays intact, bit for bit."""
    receiver = create_transport("ucx", BIG)
    sender = StoppableSender(receiver.address())
    pools = Pools(BIG, BIG_POOL)
    dst = torch.arange(8, 8 + BIG_BLOCKS)
    try:
        rt = stop_half_way(sender, receiver, pools, dst)
        tid = rt.transfer_id
        counters = receiver.counters()
        assert (counters.unsettled_transfers, counters.unsettled_blocks) == (1, BIG_BLOCKS)
        with pytest.raises(ValueError, match=f"still belongs to transfer {tid}"):
            receiver.expect(tid + 100, PoolDestination(pools.k, pools.v, dst), timeout=20.0)

        stopped = [p[dst].clone() for p in (*pools.k, *pools.v)]
        os.kill(sender.proc.pid, signal.SIGCONT)
        rt.settled.result(timeout=20.0)  # the half-way message completed: now free
        assert sender.reply()[0] == "posted" and sender.reply()[0] in ("sent", "failed")
        counters = receiver.counters()
        assert (counters.unsettled_blocks, counters.fences_expired, counters.late_writes) == (
            0,
            0,
            0,
        )
        late = [
            not torch.equal(p[dst], was)
            for p, was in zip((*pools.k, *pools.v), stopped, strict=True)
        ]
        assert any(late)  # the stopped sender did write after the cancel: into fenced blocks

        new = tid + 100  # the blocks' new owner
        rt2 = receiver.expect(new, PoolDestination(pools.k, pools.v, dst), timeout=20.0)
        sender.send(new, new, dst)
        assert sender.reply() == ("posted", new) and sender.reply() == ("sent", new)
        rt2.wait()
        assert pools.mismatches(dst, new) == []
    finally:
        sender.close()
        receiver.close()


def test_a_fence_held_past_its_timeout_is_given_up_and_a_late_write_is_counted() -> None:
    """A sender the receiver has no liveness connection from (here: the receiver listens for
    none) that never finishes its message cannot hold the blocks for ever: past
    ``fence_timeout_s`` the transfer settles (the blocks can be freed) and the expiry is counted;
    if the write does land after all, it is counted too (``late_writes``, the alarm
    ``pdserve_kv_fence_late_writes_total``)."""
    receiver = UCXTransport(BIG, fence_timeout_s=1.0, liveness_host=None)
    sender = StoppableSender(receiver.address())
    pools = Pools(BIG, BIG_POOL)
    dst = torch.arange(8, 8 + BIG_BLOCKS)
    try:
        rt = stop_half_way(sender, receiver, pools, dst)
        rt.settled.result(timeout=10.0)  # given up 1 s after the cancel
        assert rt.expired and receiver.counters().fences_expired == 1
        assert receiver.counters().unsettled_blocks == 0
        os.kill(sender.proc.pid, signal.SIGCONT)
        assert sender.reply()[0] == "posted" and sender.reply()[0] in ("sent", "failed")
        wait_for(lambda: receiver.counters().late_writes >= 1, what="the late write's count")
    finally:
        sender.close()
        receiver.close()


def test_a_sender_killed_half_way_frees_its_blocks_once_its_liveness_link_ends() -> None:
    """A sender SIGKILLed in the middle of a message never ends it, and UCX never says so; but
    the kernel closes its liveness connection (liveness.py). While it is only stopped the
    connection stays open and the blocks stay fenced, past the fence timeout too (its write may
    still come); once it is killed the transfer settles within the grace, with no late write,
    and the blocks can be reserved again."""
    receiver = UCXTransport(BIG, fence_timeout_s=0.5)  # not for senders with a link open
    sender = StoppableSender(receiver.address())
    pools = Pools(BIG, BIG_POOL)
    dst = torch.arange(8, 8 + BIG_BLOCKS)
    try:
        rt = stop_half_way(sender, receiver, pools, dst)
        assert receiver.live_senders() == 1  # stopped, not dead: its link is open
        with pytest.raises(concurrent.futures.TimeoutError):  # held past the fence timeout
            rt.settled.result(timeout=1.5)
        assert receiver.counters().unsettled_blocks == BIG_BLOCKS
        killed = time.monotonic()
        os.kill(sender.proc.pid, signal.SIGKILL)
        rt.settled.result(timeout=20.0)
        assert time.monotonic() - killed < 10.0  # the grace (1 s)
        assert rt.expired and receiver.live_senders() == 0
        counters = receiver.counters()
        assert (counters.unsettled_blocks, counters.fences_expired, counters.late_writes) == (
            0,
            1,
            0,
        )
        again = receiver.expect(rt.transfer_id + 100, PoolDestination(pools.k, pools.v, dst), 20.0)
        again.cancel()  # the blocks could be handed to a new owner: the fence let them go
        with pytest.raises(TransferError):
            again.wait()
        assert again.settled.done()
    finally:
        sender.close()
        receiver.close()


def test_a_transfer_that_fails_after_its_sender_died_is_given_up_within_the_grace() -> None:
    """The request is cancelled after its sender was killed half-way, before the liveness
    listener's notice of the death has reached the transport's thread (here it never does, as
    under a busy GIL): the transport still knows the sender is gone, and the blocks are given up
    a grace after the death, not at the fence timeout (a decode worker held them 120 s)."""
    receiver = UCXTransport(BIG, fence_timeout_s=60.0)
    receiver._liveness._on_gone = lambda sender, proven: None  # the notice is late: never here
    pools = Pools(BIG, BIG_POOL)
    dst = torch.arange(8, 8 + BIG_BLOCKS)
    try:
        for attempt in range(1, 6):
            sender = StoppableSender(receiver.address())
            try:
                rt = stop_landing(sender, receiver, pools, dst, 10 + attempt)
                os.kill(sender.proc.pid, signal.SIGKILL)
                wait_for(lambda: receiver.live_senders() == 0, what="the sender's link to end")
                rt.cancel("the request went away")
                with contextlib.suppress(TransferError):
                    rt.wait()
                if rt.settled.done():
                    continue  # killed between two messages: nothing was half-way in
                rt.settled.result(timeout=10.0)  # the grace (1 s), not fence_timeout_s
                assert rt.expired and receiver.counters().fences_expired == 1
                assert receiver.counters().unsettled_blocks == 0
                return
            finally:
                sender.close()
        raise AssertionError("the sender was never killed in the middle of a message")
    finally:
        receiver.close()
