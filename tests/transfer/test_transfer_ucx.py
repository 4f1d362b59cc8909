"""UCX between real processes on loopback (worker address + tags over shared memory), including
processes that die. The other side runs in a spawned process (tests/transfer/peers.py)."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.transfer import (
    CallbackDestination,
    HeaderMismatchError,
    PeerUnreachableError,
    PoolDestination,
    TransferTimeoutError,
    create_transport,
    gather_into,
)
from pdserve.transfer.header import pack_address, unpack_address
from pdserve.transfer.ucx import UCXTransport
from tests.transfer import peers
from tests.transfer.peers import Pools, block_ids, default_layout, recv
from tests.transfer.test_transfer_interface import Source

NUM_BLOCKS = 32  # a 512-token prompt in blocks of 16
POOL_BLOCKS = 48
SLACK_S = 1.0
_ids = itertools.count(1000)


class RemoteReceiver:
    """A receiver process; ``expect`` asks it to receive a transfer and check every byte."""

    def __init__(self, dtype: torch.dtype, device: str = "cpu") -> None:
        self.layout = default_layout(dtype)
        self.proc, self.conn = peers.spawn(peers.receiver_main, self.layout, POOL_BLOCKS, device)
        reply = recv(self.conn)
        assert reply[0] == "address", reply
        self.address = reply[1]
        self.replies: dict[int, tuple] = {}

    def expect(
        self, tid: int, seed: int, timeout: float = 20.0, run: bool | int = False, land: bool = True
    ) -> None:
        """``run``: into consecutive block ids (else random ones), or that many runs of them;
        ``land`` False: through a custom scatter (see peers.receiver_main)."""
        self.conn.send((tid, NUM_BLOCKS, seed, timeout, run, land))
        self.result(tid, "expecting")

    def result(self, tid: int, kind: str = "result") -> tuple:
        """The next reply about ``tid`` (replies about other transfers are kept for later)."""
        key = (tid, kind)
        while key not in self.replies:
            reply = recv(self.conn)
            assert reply[0] != "crashed", reply[1]
            self.replies[reply[1], "expecting" if reply[0] == "expecting" else "result"] = reply
        return self.replies.pop(key)

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(peers.TIMEOUT)
        peers.stop(self.proc)


@pytest.fixture(scope="module")
def senders() -> Iterator[dict]:
    made: dict = {}
    yield made
    for transport in made.values():
        transport.close()


@pytest.fixture(scope="module")
def receivers() -> Iterator[dict]:
    made: dict = {}
    yield made
    for receiver in made.values():
        receiver.close()


def sender_for(senders: dict, dtype: torch.dtype) -> UCXTransport:
    if dtype not in senders:
        senders[dtype] = UCXTransport(default_layout(dtype))
    return senders[dtype]


def receiver_for(receivers: dict, dtype: torch.dtype) -> RemoteReceiver:
    if dtype not in receivers:
        receivers[dtype] = RemoteReceiver(dtype)
    return receivers[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_30_layers_of_a_512_token_prompt_land_byte_exact(
    senders: dict, receivers: dict, dtype: torch.dtype
) -> None:
    sender, receiver = sender_for(senders, dtype), receiver_for(receivers, dtype)
    tid = next(_ids)
    receiver.expect(tid, seed=tid)
    source = Source(sender, sender.connect(receiver.address), tid, seed=tid)
    source.send(range(30))
    stats = source.tx.wait()
    kind, _, mismatches, nbytes, _ = receiver.result(tid)[:5]
    assert (kind, mismatches) == ("done", [])
    assert nbytes == stats.nbytes == 30 * sender.layout.message_nbytes(NUM_BLOCKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_in_one_run_on_both_sides_land_byte_exact(
    senders: dict, receivers: dict, dtype: torch.dtype
) -> None:
    """As workers with fresh allocators do it: the prefill side gathers one run of blocks per
    layer (gather_into), the decode side lands each message in one run of its own
    (PoolDestination): a copy per pool in C."""
    sender, receiver = sender_for(senders, dtype), receiver_for(receivers, dtype)
    tid = next(_ids)
    receiver.expect(tid, seed=tid, run=True)
    pools = Pools(sender.layout, POOL_BLOCKS)
    ids = block_ids(POOL_BLOCKS, NUM_BLOCKS, tid, run=True)
    pools.fill(ids, seed=tid)
    tx = sender.start_send(sender.connect(receiver.address), tid, NUM_BLOCKS, timeout=20.0)
    for layer in range(30):
        k, v = tx.layer_buffers()
        gather_into(pools.k[layer], pools.v[layer], ids, k, v)
        tx.send_layer(layer, k, v)
    tx.wait()
    kind, _, mismatches, _, landed_ids = receiver.result(tid)[:5]
    assert (kind, mismatches) == ("done", [])
    assert landed_ids == list(range(landed_ids[0], landed_ids[0] + NUM_BLOCKS))


def test_four_concurrent_transfers_do_not_mix(senders: dict, receivers: dict) -> None:
    sender, receiver = sender_for(senders, torch.bfloat16), receiver_for(receivers, torch.bfloat16)
    peer = sender.connect(receiver.address)
    tids = [next(_ids) for _ in range(4)]
    for tid in tids:
        receiver.expect(tid, seed=tid)
    sources = [Source(sender, peer, tid, seed=tid) for tid in tids]
    for layer in reversed(range(30)):  # interleaved, and in the reverse of receive order
        for source in sources:
            source.send(range(layer, layer + 1))
    for tid in tids:
        assert receiver.result(tid)[:3] == ("done", tid, [])


def test_receiver_rejects_another_layout_and_version(senders: dict, receivers: dict) -> None:
    receiver = receiver_for(receivers, torch.float32)
    wrong = default_layout(torch.float32, model="another-model")
    other = UCXTransport(wrong)
    try:
        with pytest.raises(HeaderMismatchError):
            other.connect(receiver.address)
        tid = next(_ids)
        receiver.expect(tid, seed=tid)
        forged = pack_address(wrong, unpack_address(receiver.address, receiver.layout))
        Source(other, other.connect(forged), tid, seed=tid).send(range(1))
        kind, _, error, message = receiver.result(tid)
        assert (kind, error) == ("failed", "HeaderMismatchError")
        assert wrong.compat_hash in message and receiver.layout.compat_hash in message
    finally:
        other.close()


def test_sender_killed_halfway_times_out_at_the_deadline() -> None:
    layout = default_layout(torch.float32)
    receiver = UCXTransport(layout)
    proc, conn = peers.spawn(peers.sender_main, layout, receiver.address(), POOL_BLOCKS)
    try:
        assert recv(conn) == ("ready",)
        tid, timeout = next(_ids), 2.0
        start = time.monotonic()
        transfer, _, _ = expect_local(receiver, tid, timeout)
        conn.send(("send", tid, NUM_BLOCKS, tid, range(10)))
        assert recv(conn)[0] == "posted"
        assert recv(conn) == ("sent", tid, 10)
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(TransferTimeoutError, match="10/30 layers arrived"):
            transfer.wait()
        elapsed = time.monotonic() - start
        assert timeout <= elapsed < timeout + SLACK_S
        assert transfer.layers_received == 10
    finally:
        peers.stop(proc)
        receiver.close()


def test_sender_killed_with_messages_in_flight_fails_cleanly_and_receiver_lives_on(
    senders: dict,
) -> None:
    """The sender posted every layer of three transfers, then died before any was expected.
    (Under UCX's default get_zcopy rendezvous this crashed the receiver.)"""
    layout = default_layout(torch.float32)
    receiver = UCXTransport(layout)
    proc, conn = peers.spawn(peers.sender_main, layout, receiver.address(), POOL_BLOCKS)
    try:
        assert recv(conn) == ("ready",)
        tids = [next(_ids) for _ in range(3)]
        for tid in tids:  # not expected yet: all wait for the receiver
            conn.send(("send", tid, NUM_BLOCKS, tid, range(30), False))
            assert recv(conn) == ("posted", tid, 30)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(peers.TIMEOUT)
        timeout = 1.0
        start = time.monotonic()
        transfers = [
            receiver.expect(t, CallbackDestination(NUM_BLOCKS, lambda *_: None), timeout)
            for t in tids
        ]
        for transfer in transfers:
            with pytest.raises(TransferTimeoutError):
                transfer.wait()
        assert time.monotonic() - start < timeout + SLACK_S

        # the receiver still works, for another sender
        tid = next(_ids)
        transfer, pools, ids = expect_local(receiver, tid)
        sender = sender_for(senders, torch.float32)
        Source(sender, sender.connect(receiver.address()), tid, seed=tid).send(range(30))
        transfer.wait()
        assert pools.mismatches(ids, seed=tid) == []
    finally:
        peers.stop(proc)
        receiver.close()


def expect_local(receiver: UCXTransport, tid: int, timeout: float = 20.0):  # noqa: ANN201
    pools = Pools(receiver.layout, POOL_BLOCKS)
    ids = block_ids(POOL_BLOCKS, NUM_BLOCKS, seed=tid + 7919)
    return (
        receiver.expect(tid, PoolDestination(pools.k, pools.v, ids), timeout),
        pools,
        ids,
    )


def test_sends_to_a_receiver_that_is_gone_fail_within_their_timeout(senders: dict) -> None:
    sender = sender_for(senders, torch.float32)
    receiver = RemoteReceiver(torch.float32)
    try:
        peer = sender.connect(receiver.address)
        tid = next(_ids)
        receiver.expect(tid, seed=tid)
        Source(sender, peer, tid, seed=tid).send(range(30))
        assert receiver.result(tid)[0] == "done"
        os.kill(receiver.proc.pid, signal.SIGKILL)
        receiver.proc.join(peers.TIMEOUT)

        # a peer we had talked to: its memory is still mapped, sends just never complete
        timeout = 1.0
        source = Source(sender, peer, next(_ids), seed=1, timeout=timeout)  # before the clock
        start = time.monotonic()
        futures = source.send(range(3))
        for fut in futures:
            with pytest.raises((TransferTimeoutError, PeerUnreachableError)):
                fut.result(timeout + SLACK_S)
        assert time.monotonic() - start < timeout + SLACK_S
        assert not peer.alive
        with pytest.raises(PeerUnreachableError, match="connect again"):
            Source(sender, peer, next(_ids), seed=1).send(range(1))

        # a fresh connection fails at once: in connect, or at its first send
        kv = Pools(sender.layout, POOL_BLOCKS)  # made before the clock starts (a loaded box)
        start = time.monotonic()
        with pytest.raises((PeerUnreachableError, TransferTimeoutError)):
            fresh = sender.connect(receiver.address)
            tx = sender.start_send(fresh, next(_ids), NUM_BLOCKS, timeout=timeout)
            k, v = kv.k[0][:NUM_BLOCKS].clone(), kv.v[0][:NUM_BLOCKS].clone()
            tx.send_layer(0, k, v).result(timeout + SLACK_S)
        assert time.monotonic() - start < timeout + SLACK_S
    finally:
        receiver.close()


def test_late_messages_of_a_failed_transfer_are_drained() -> None:
    """A sender that is late, not dead, completes (its messages are dropped) instead of
    timing out and having its endpoint aborted."""
    layout = default_layout(torch.bfloat16)
    sender, receiver = UCXTransport(layout), UCXTransport(layout, drain_seconds=5.0)
    try:
        tid = next(_ids)
        landed = threading.Event()
        transfer = receiver.expect(
            tid, CallbackDestination(NUM_BLOCKS, lambda *_: landed.set()), timeout=0.2
        )
        with pytest.raises(TransferTimeoutError):
            transfer.wait()
        peer = sender.connect(receiver.address())
        futures = Source(sender, peer, tid, seed=tid, timeout=5.0).send(range(30))
        for fut in futures:
            fut.result(5.0 + SLACK_S)
        assert peer.alive and not landed.is_set()
        with pytest.raises(ValueError, match="in use"):
            receiver.expect(tid, CallbackDestination(NUM_BLOCKS, lambda *_: None), timeout=1.0)
    finally:
        sender.close()
        receiver.close()


def test_idle_transport_costs_no_cpu() -> None:
    transport = create_transport("ucx", default_layout())
    try:
        thread = transport._ucx._thread  # type: ignore[attr-defined]
        start = time.thread_time()
        before = _thread_cpu(thread.native_id)
        time.sleep(1.0)  # measuring idleness, not synchronising
        assert _thread_cpu(thread.native_id) - before < 0.05
        assert time.thread_time() - start < 0.05
    finally:
        transport.close()


def _thread_cpu(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
