"""The KVTransport contract, run against every CPU implementation with both sides in this process:
loopback, and real UCX (two workers talking over shared memory). Cross-process UCX and failure
of processes are in test_transfer_ucx.py."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.transfer import (
    CallbackDestination,
    HeaderMismatchError,
    KVLayout,
    KVTransport,
    LayerHeader,
    PeerUnreachableError,
    PoolDestination,
    SendTransfer,
    TransferError,
    TransferTimeoutError,
    create_transport,
)
from pdserve.transfer.header import pack_address, unpack_address
from tests.transfer.peers import Pools, block_ids, default_layout, layer_kv

KINDS = ["loopback", "ucx"]
NUM_BLOCKS = 32  # a 512-token prompt in blocks of 16
POOL_BLOCKS = 48
SLACK_S = 1.0
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def transports() -> Iterator[dict]:
    """(kind, dtype) -> (sender, receiver), made on first use, shared by the module's tests."""
    made: dict = {}
    yield made
    for sender, receiver in made.values():
        sender.close()
        receiver.close()


def pair(transports: dict, kind: str, dtype: torch.dtype) -> tuple[KVTransport, KVTransport]:
    if (kind, dtype) not in transports:
        layout = default_layout(dtype)
        transports[kind, dtype] = (create_transport(kind, layout), create_transport(kind, layout))
    return transports[kind, dtype]


class Source:
    """The sender's side of one transfer: its pools hold transfer ``seed``'s KV at its own ids."""

    def __init__(
        self,
        sender: KVTransport,
        peer: object,
        tid: int,
        seed: int,
        timeout: float = 20.0,
        device: str = "cpu",
    ) -> None:
        self.pools = Pools(sender.layout, POOL_BLOCKS, device)
        self.ids = block_ids(POOL_BLOCKS, NUM_BLOCKS, seed).to(device)
        self.pools.fill(self.ids, seed)
        self.start = lambda: sender.start_send(peer, tid, NUM_BLOCKS, timeout=timeout)  # type: ignore[arg-type]
        self._tx: SendTransfer | None = None

    @property
    def tx(self) -> SendTransfer:
        """Started at the first send: the deadline runs from there."""
        if self._tx is None:
            self._tx = self.start()
        return self._tx

    def send(self, layers: range, in_place: bool = True) -> list[concurrent.futures.Future[None]]:
        """Gather each layer (into the transport's buffers, or a new tensor) and push it."""
        futures = []
        for layer in layers:
            if in_place:
                k, v = self.tx.layer_buffers()
                torch.index_select(self.pools.k[layer], 0, self.ids, out=k)
                torch.index_select(self.pools.v[layer], 0, self.ids, out=v)
            else:
                k, v = self.pools.k[layer][self.ids], self.pools.v[layer][self.ids]
            futures.append(self.tx.send_layer(layer, k, v))
        return futures


def send_layers(
    sender: KVTransport, peer: object, tid: int, seed: int, layers: range, timeout: float = 20.0
) -> list[concurrent.futures.Future[None]]:
    return Source(sender, peer, tid, seed, timeout).send(layers)


def expect(  # noqa: ANN201
    receiver: KVTransport, tid: int, seed: int, timeout: float = 20.0, device: str = "cpu"
):
    pools = Pools(receiver.layout, POOL_BLOCKS, device)
    ids = block_ids(POOL_BLOCKS, NUM_BLOCKS, seed + 7919)  # not the sender's ids
    transfer = receiver.expect(tid, PoolDestination(pools.k, pools.v, ids), timeout)
    return transfer, pools, ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [True, False], ids=["gathered-in-place", "copied"])
def test_all_layers_land_byte_exact_in_other_blocks(
    transports: dict, kind: str, dtype: torch.dtype, in_place: bool
) -> None:
    sender, receiver = pair(transports, kind, dtype)
    tid = next(_ids)
    transfer, pools, ids = expect(receiver, tid, seed=tid)
    peer = sender.connect(receiver.address())
    futures = Source(sender, peer, tid, seed=tid).send(range(30), in_place=in_place)
    stats = transfer.wait()
    for fut in futures:
        fut.result(10)
    assert pools.mismatches(ids, seed=tid) == []
    assert stats.nbytes == 30 * receiver.layout.message_nbytes(NUM_BLOCKS)
    assert stats.num_layers == 30 and stats.seconds > 0 and stats.gbps > 0
    assert transfer.layers_received == 30


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_transfers_do_not_mix(transports: dict, kind: str) -> None:
    sender, receiver = pair(transports, kind, torch.bfloat16)
    tids = [next(_ids) for _ in range(4)]
    expected = {tid: expect(receiver, tid, seed=tid) for tid in tids}
    peer = sender.connect(receiver.address())
    sources = {tid: Source(sender, peer, tid, seed=tid) for tid in tids}
    futures = []
    for layer in range(30):  # interleaved: layer 0 of each, then layer 1 of each, ...
        for tid in tids:
            futures += sources[tid].send(range(layer, layer + 1))
    for tid, (transfer, pools, ids) in expected.items():
        transfer.wait()
        assert pools.mismatches(ids, seed=tid) == [], tid
    assert all(f.exception(10) is None for f in futures)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_layers_and_first_token(transports: dict, kind: str) -> None:
    """A chunked prefill sends each layer in pieces (block_offset); the last carries the token."""
    sender, receiver = pair(transports, kind, torch.float32)
    layout = sender.layout
    tid = next(_ids)
    transfer, pools, ids = expect(receiver, tid, seed=tid)
    tx = sender.start_send(sender.connect(receiver.address()), tid, NUM_BLOCKS, timeout=10.0)
    for start, stop in ((0, 20), (20, NUM_BLOCKS)):
        for layer in range(30):
            k, v = layer_kv(layout, NUM_BLOCKS, tid, layer)
            last = stop == NUM_BLOCKS and layer == 29
            tx.send_layer(
                layer, k[start:stop], v[start:stop], block_offset=start, token_id=42 if last else -1
            )
    stats = transfer.wait()
    assert tx.wait().num_messages == 60 == stats.num_messages
    assert pools.mismatches(ids, seed=tid) == []
    assert transfer.token_id == 42


@pytest.mark.parametrize("kind", KINDS)
def test_connect_refuses_a_peer_with_another_layout(transports: dict, kind: str) -> None:
    _, receiver = pair(transports, kind, torch.float32)
    other = create_transport(kind, default_layout(torch.float32, model="another-model"))
    try:
        with pytest.raises(HeaderMismatchError, match="same model, dtype, block size"):
            other.connect(receiver.address())
    finally:
        other.close()


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_rejects_a_message_with_another_layout_hash(transports: dict, kind: str) -> None:
    """A sender that skipped the address check (an old build, say) still gets rejected."""
    _, receiver = pair(transports, kind, torch.float32)
    wrong = default_layout(torch.float32, model="another-model")
    sender = create_transport(kind, wrong)
    try:
        tid = next(_ids)
        transfer, _, _ = expect(receiver, tid, seed=tid)
        forged = pack_address(wrong, unpack_address(receiver.address(), receiver.layout))
        send_layers(sender, sender.connect(forged), tid, tid, range(1))
        with pytest.raises(HeaderMismatchError) as err:
            transfer.wait()
        assert wrong.compat_hash in str(err.value) and receiver.layout.compat_hash in str(err.value)
    finally:
        sender.close()


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_rejects_another_protocol_version(transports: dict, kind: str) -> None:
    sender, receiver = pair(transports, kind, torch.float32)
    tid = next(_ids)
    transfer, _, _ = expect(receiver, tid, seed=tid)
    header = LayerHeader.for_layer(sender.layout, tid, 0, NUM_BLOCKS)
    k, v = layer_kv(sender.layout, NUM_BLOCKS, tid, 0)
    peer = sender.connect(receiver.address())
    sender.send_layer(peer, dataclasses.replace(header, version=99), k, v, timeout=10.0)
    with pytest.raises(HeaderMismatchError, match="v99"):
        transfer.wait()


@pytest.mark.parametrize("kind", KINDS)
def test_incomplete_transfer_times_out_at_its_deadline(transports: dict, kind: str) -> None:
    sender, receiver = pair(transports, kind, torch.bfloat16)
    tid = next(_ids)
    timeout = 0.5
    source = Source(sender, sender.connect(receiver.address()), tid, tid)  # before the deadline
    start = time.monotonic()
    transfer, _, _ = expect(receiver, tid, seed=tid, timeout=timeout)
    for fut in source.send(range(10)):
        fut.result(10)
    with pytest.raises(TransferTimeoutError, match="10/30 layers arrived"):
        transfer.wait()
    assert time.monotonic() - start < timeout + SLACK_S
    assert transfer.layers_received == 10


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_and_callback_errors_fail_the_transfer(transports: dict, kind: str) -> None:
    sender, receiver = pair(transports, kind, torch.bfloat16)
    cancelled = receiver.expect(
        next(_ids), CallbackDestination(NUM_BLOCKS, lambda *_: None), timeout=10.0
    )
    cancelled.cancel("client went away")
    with pytest.raises(TransferError, match="client went away"):
        cancelled.wait()

    def broken(*_: object) -> None:
        raise RuntimeError("pool exploded")

    tid = next(_ids)
    transfer = receiver.expect(tid, CallbackDestination(NUM_BLOCKS, broken), timeout=10.0)
    send_layers(sender, sender.connect(receiver.address()), tid, tid, range(1))
    with pytest.raises(TransferError, match="pool exploded") as err:
        transfer.wait()
    assert isinstance(err.value.__cause__, RuntimeError)


@pytest.mark.parametrize("kind", KINDS)
def test_transfer_ids_and_shapes_are_checked(transports: dict, kind: str) -> None:
    sender, receiver = pair(transports, kind, torch.float32)
    tid = next(_ids)
    receiver.expect(tid, CallbackDestination(NUM_BLOCKS, lambda *_: None), timeout=10.0).cancel()
    with pytest.raises(ValueError, match=f"transfer id {tid} is in use"):
        receiver.expect(tid, CallbackDestination(NUM_BLOCKS, lambda *_: None), timeout=10.0)
    with pytest.raises(ValueError, match="transfer_id must be in"):
        receiver.expect(2**48, CallbackDestination(NUM_BLOCKS, lambda *_: None), timeout=10.0)
    tx = sender.start_send(sender.connect(receiver.address()), next(_ids), 4, timeout=10.0)
    with pytest.raises(ValueError, match=r"header and layout say torch.float32 \(4, 16, 3, 64\)"):
        tx.send_layer(0, torch.zeros(4, 16, 3, 32), torch.zeros(4, 16, 3, 32))


@pytest.mark.parametrize("kind", KINDS)
def test_sending_to_a_closed_receiver_fails_within_the_timeout(kind: str) -> None:
    layout = default_layout(torch.float32)
    sender, receiver = create_transport(kind, layout), create_transport(kind, layout)
    try:
        peer = sender.connect(receiver.address())
        tid = next(_ids)
        transfer, _, _ = expect(receiver, tid, seed=tid)
        for fut in send_layers(sender, peer, tid, tid, range(30)):
            fut.result(10)
        transfer.wait()
        receiver.close()
        source = Source(sender, peer, next(_ids), 1, timeout=1.0)  # before the clock starts
        start = time.monotonic()
        fut = source.send(range(1))[0]
        with pytest.raises((PeerUnreachableError, TransferTimeoutError)):
            fut.result(1.0 + SLACK_S)
        assert time.monotonic() - start < 1.0 + SLACK_S
    finally:
        sender.close()
        receiver.close()


def test_layout_of_every_kind_is_the_transport_layout() -> None:
    layout = KVLayout("m", torch.float32, 16, 2, 1, 8)
    with pytest.raises(ValueError, match="unknown KV transport 'tcp'"):
        create_transport("tcp", layout)
    with pytest.raises(ValueError, match="NCCL KV transport is experimental"):
        create_transport("nccl", layout)
