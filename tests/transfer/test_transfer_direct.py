"""Direct transfers (plan.py, ucx_direct_send.py, ucx_direct_recv.py): K and V from the sender's
pools straight into the receiver's, over UCX between processes; the framed fallback for
fragmented destinations; the plan wire format. The receiver is a separate process
(tests/transfer/peers.py) that checks every byte it landed and that no other block of its pools
was touched."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.transfer import HeaderMismatchError, PoolDestination, TransferTimeoutError
from pdserve.transfer.header import HEADER_NBYTES, LayerHeader
from pdserve.transfer.plan import (
    TRAILER_SUB,
    fits_tags,
    pack_plan,
    plan_nbytes,
    segment_bounds,
    segment_starts,
    sub_tag,
    unpack_plan,
)
from pdserve.transfer.ucx import UCXTransport
from tests.transfer.peers import Pools, block_ids, default_layout
from tests.transfer.test_transfer_ucx import NUM_BLOCKS, POOL_BLOCKS, SLACK_S, RemoteReceiver

_ids = itertools.count(5000)
TOKEN = 4242


def test_segments_are_the_runs_of_the_destination_ids() -> None:
    assert segment_starts([7, 8, 9, 3, 4, 20]) == [0, 3, 5]
    assert segment_bounds([0, 3, 5], 6) == [(0, 3), (3, 2), (5, 1)]
    assert segment_starts([5]) == [0]
    assert segment_starts(list(range(10, 42))) == [0]


def test_every_message_of_a_transfer_has_its_own_sub_tag() -> None:
    layers, segments = 30, 3
    subs = {
        sub_tag(layers, segments, layer, kv, seg)
        for layer in range(layers)
        for kv in (0, 1)
        for seg in range(segments)
    }
    assert len(subs) == layers * 2 * segments
    assert min(subs) >= layers  # framed layer messages use 0 .. layers - 1
    assert max(subs) < TRAILER_SUB and fits_tags(layers, segments)
    assert not fits_tags(30, 0) and not fits_tags(0xFFFF, 1)


def test_plan_round_trips_and_rejects_what_does_not_fit() -> None:
    layout = default_layout(torch.bfloat16)
    header = LayerHeader.for_layer(layout, 77, 0, 32, traceparent="00-ab-cd-01")
    raw = pack_plan(header, [0, 16])
    assert len(raw) == plan_nbytes(2)
    got, starts = unpack_plan(raw, layout, 77, 32)
    assert starts == [0, 16] and got.traceparent == "00-ab-cd-01"
    with pytest.raises(HeaderMismatchError, match="belongs to transfer 77"):
        unpack_plan(raw, layout, 78, 32)
    with pytest.raises(HeaderMismatchError, match="32 reserved|31 reserved"):
        unpack_plan(raw, layout, 77, 31)
    with pytest.raises(HeaderMismatchError, match="do not cut"):
        unpack_plan(pack_plan(header, [0, 32]), layout, 77, 32)
    with pytest.raises(HeaderMismatchError, match="do not cut"):
        unpack_plan(pack_plan(header, [1, 16]), layout, 77, 32)
    with pytest.raises(HeaderMismatchError):  # another model: the layout hash differs
        unpack_plan(raw, default_layout(torch.bfloat16, model="other"), 77, 32)


@pytest.fixture(scope="module")
def sender() -> Iterator[UCXTransport]:
    transport = UCXTransport(default_layout(torch.bfloat16))
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[RemoteReceiver]:
    remote = RemoteReceiver(torch.bfloat16)
    yield remote
    remote.close()


def send_pools(
    sender: UCXTransport,
    receiver: RemoteReceiver,
    tid: int,
    src_run: bool | int,
    dst_run: bool | int,
    layers: range = range(30),
    timeout: float = 20.0,
):  # noqa: ANN201
    """Send transfer ``tid`` as the prefill worker does: each layer from the pools, then the
    token; the receiver's ids are told to the sender (``dst_block_ids``)."""
    pools = Pools(sender.layout, POOL_BLOCKS)
    src = block_ids(POOL_BLOCKS, NUM_BLOCKS, tid, src_run)
    pools.fill(src, seed=tid)
    dst = block_ids(POOL_BLOCKS, NUM_BLOCKS, tid + 7919, dst_run)  # what the receiver reserves
    tx = sender.start_send(
        sender.connect(receiver.address),
        tid,
        NUM_BLOCKS,
        timeout=timeout,
        dst_block_ids=dst.tolist(),
    )
    for layer in layers:
        tx.send_pool_layer(layer, pools.k[layer], pools.v[layer], src)
    if layers[-1] == 29:
        tx.finish(TOKEN)
    return tx


def direct_nbytes(layout, segments: int) -> int:  # noqa: ANN001
    return plan_nbytes(segments) + 30 * 2 * NUM_BLOCKS * layout.block_nbytes() + HEADER_NBYTES


@pytest.mark.parametrize(
    ("src_run", "dst_run", "segments"),
    [(True, True, 1), (False, True, 1), (True, 2, 2), (False, 2, 2)],
    ids=["one-run-each", "random-src-one-run-dst", "two-run-dst", "random-src-two-run-dst"],
)
def test_direct_transfer_lands_byte_exact_in_the_reserved_blocks(
    sender: UCXTransport,
    receiver: RemoteReceiver,
    src_run: bool,
    dst_run: bool | int,
    segments: int,
) -> None:
    """Sent direct: the byte count is the plan's, payload and trailer (no framed headers), and
    the receiver's pools hold exactly the sender's blocks, nothing anywhere else."""
    tid = next(_ids)
    receiver.expect(tid, seed=tid, run=dst_run)
    tx = send_pools(sender, receiver, tid, src_run, dst_run)
    stats = tx.wait()
    kind, _, mismatches, nbytes, ids, token = receiver.result(tid)
    assert (kind, mismatches, token) == ("done", [], TOKEN)
    assert len(segment_starts(ids)) == segments
    assert nbytes == stats.nbytes == direct_nbytes(sender.layout, segments)


def test_a_fragmented_destination_is_sent_framed_byte_exact(
    sender: UCXTransport, receiver: RemoteReceiver
) -> None:
    """Random destination ids (a run per block): gathered and scattered as before."""
    tid = next(_ids)
    receiver.expect(tid, seed=tid, run=False)
    tx = send_pools(sender, receiver, tid, src_run=True, dst_run=False)
    stats = tx.wait()
    kind, _, mismatches, nbytes, _, token = receiver.result(tid)
    assert (kind, mismatches, token) == ("done", [], TOKEN)
    assert nbytes == stats.nbytes == 30 * sender.layout.message_nbytes(NUM_BLOCKS)


def test_direct_transfer_to_a_custom_on_layer_goes_through_it(
    sender: UCXTransport, receiver: RemoteReceiver
) -> None:
    """A receiver whose on_layer the transport cannot land for gets every layer through it."""
    tid = next(_ids)
    receiver.expect(tid, seed=tid, run=True, land=False)
    tx = send_pools(sender, receiver, tid, src_run=True, dst_run=True)
    stats = tx.wait()
    kind, _, mismatches, nbytes, _, token = receiver.result(tid)
    assert (kind, mismatches, token) == ("done", [], TOKEN)
    assert nbytes == stats.nbytes == direct_nbytes(sender.layout, 1)


def test_sender_with_other_destination_ids_fails_the_transfer(
    sender: UCXTransport, receiver: RemoteReceiver
) -> None:
    """The plan names segments that are not the runs of the reserved blocks."""
    tid = next(_ids)
    receiver.expect(tid, seed=tid, run=True)  # one run; the sender believes in two
    pools = Pools(sender.layout, POOL_BLOCKS)
    src = block_ids(POOL_BLOCKS, NUM_BLOCKS, tid, True)
    wrong = block_ids(POOL_BLOCKS, NUM_BLOCKS, tid, 2)
    tx = sender.start_send(
        sender.connect(receiver.address), tid, NUM_BLOCKS, timeout=5.0, dst_block_ids=wrong.tolist()
    )
    tx.send_pool_layer(0, pools.k[0], pools.v[0], src)
    kind, _, error, message = receiver.result(tid)
    assert (kind, error) == ("failed", "HeaderMismatchError") and "runs of the reserved" in message


def test_incomplete_direct_transfer_fails_at_its_deadline_and_settles_at_once() -> None:
    """The sender stops after 10 layers: the receiver's transfer fails at its deadline, its
    receives are cancelled (none was matched), so it has settled by then: no fixed delay."""
    layout = default_layout(torch.bfloat16)
    sender, receiver = UCXTransport(layout), UCXTransport(layout, drain_seconds=0)
    try:
        tid, timeout = next(_ids), 1.0
        pools = Pools(layout, POOL_BLOCKS)
        dst = block_ids(POOL_BLOCKS, NUM_BLOCKS, tid + 1, True)
        src_pools = Pools(layout, POOL_BLOCKS)  # made first: the deadline runs from expect
        src = block_ids(POOL_BLOCKS, NUM_BLOCKS, tid, True)
        src_pools.fill(src, seed=tid)
        start = time.monotonic()
        transfer = receiver.expect(tid, PoolDestination(pools.k, pools.v, dst), timeout)
        tx = sender.start_send(
            sender.connect(receiver.address()),
            tid,
            NUM_BLOCKS,
            timeout=5.0,
            dst_block_ids=dst.tolist(),
        )
        for layer in range(10):
            tx.send_pool_layer(layer, src_pools.k[layer], src_pools.v[layer], src)
        with pytest.raises(TransferTimeoutError, match="10/30 layers arrived"):
            transfer.wait()
        elapsed = time.monotonic() - start
        assert transfer.settled.done() and not transfer.unsettled
        assert timeout <= elapsed < timeout + SLACK_S
        assert receiver.counters().unsettled_transfers == 0
        landed = [layer for layer in range(30) if pools.k[layer][dst].any()]
        assert landed == list(range(10))
    finally:
        sender.close()
        receiver.close()
