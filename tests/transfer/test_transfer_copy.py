"""gather_into (sender: pools -> message buffer) and a PoolDestination's landing (receiver:
message -> pools, pool_copy.layer_callback): the C block copy and its torch fallback land the
same bytes; ids out of range fail loudly."""

from __future__ import annotations

import pytest
import torch
from pdserve.kernels.cpu import block_copy

from pdserve.transfer import CallbackDestination, LayerHeader, PoolDestination, gather_into
from pdserve.transfer.pool_copy import layer_callback
from tests.transfer.peers import Pools, default_layout, layer_kv

POOL_BLOCKS = 48
IDS = {
    "random": torch.randperm(POOL_BLOCKS, generator=torch.Generator().manual_seed(5))[:32],
    "allocator": torch.arange(9, 41),  # one run, as a fresh allocator hands blocks out
    "runs": torch.tensor([*range(0, 10), 47, *range(20, 41)]),
}


def land_in(k_pools, v_pools, block_ids):  # noqa: ANN001, ANN201
    """What a receiver calls per message of a transfer into these pools."""
    return layer_callback(PoolDestination(k_pools, v_pools, block_ids))


@pytest.fixture(params=["native", "torch"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setattr(block_copy, "library", lambda: None)
    elif block_copy.library() is None:
        pytest.skip("no C compiler")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_gather_then_scatter_moves_every_byte(copy_path: str, dtype: torch.dtype, ids: str) -> None:
    layout = default_layout(dtype)
    sender, receiver = Pools(layout, POOL_BLOCKS), Pools(layout, POOL_BLOCKS)
    src = IDS[ids]
    dst = IDS["random" if ids != "random" else "allocator"]
    sender.fill(src, seed=3)
    on_layer = land_in(receiver.k, receiver.v, dst.tolist())
    for layer in range(layout.num_layers):
        k = torch.empty(32, *layout.block_shape, dtype=dtype)
        v = torch.empty_like(k)
        gather_into(sender.k[layer], sender.v[layer], src, k, v)
        want_k, want_v = layer_kv(layout, 32, 3, layer)
        assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), want_v.view(torch.uint8))
        on_layer(LayerHeader.for_layer(layout, 1, layer, 32), k, v)
    assert receiver.mismatches(dst, seed=3) == []


def test_chunks_land_at_their_block_offset(copy_path: str) -> None:
    layout = default_layout(torch.bfloat16)
    receiver = Pools(layout, POOL_BLOCKS)
    dst = IDS["runs"]
    on_layer = land_in(receiver.k, receiver.v, dst)
    for layer in range(layout.num_layers):
        k, v = layer_kv(layout, 32, 4, layer)
        for start, stop in ((0, 20), (20, 32)):
            header = LayerHeader.for_layer(layout, 1, layer, stop - start, block_offset=start)
            on_layer(header, k[start:stop].contiguous(), v[start:stop])  # v: a view, not a copy
    assert receiver.mismatches(dst, seed=4) == []


def test_ids_outside_the_pools_fail_and_write_nothing(copy_path: str) -> None:
    layout = default_layout(torch.bfloat16)
    receiver = Pools(layout, POOL_BLOCKS)
    on_layer = land_in(receiver.k, receiver.v, [*range(31), POOL_BLOCKS])
    k, v = layer_kv(layout, 32, 1, 0)
    with pytest.raises((IndexError, RuntimeError)):
        on_layer(LayerHeader.for_layer(layout, 1, 0, 32), k, v)
    if copy_path == "native":  # checked before the first copy (index_copy_ may write some)
        assert not receiver.k[0].any() and not receiver.v[0].any()
    with pytest.raises((IndexError, RuntimeError)):
        gather_into(receiver.k[0], receiver.v[0], torch.tensor([0, -1]), k[:2], v[:2])


def test_a_message_beyond_the_block_ids_fails() -> None:
    layout = default_layout(torch.float32)
    receiver = Pools(layout, POOL_BLOCKS)
    on_layer = land_in(receiver.k, receiver.v, torch.arange(8))
    k, v = layer_kv(layout, 4, 1, 0)
    with pytest.raises((IndexError, RuntimeError)):
        on_layer(LayerHeader.for_layer(layout, 1, 0, 4, block_offset=6), k, v)


def test_pools_the_c_copy_does_not_cover_use_index_copy() -> None:
    """Strided pools keep working (and keep their semantics); a callback gets the messages."""
    layout = default_layout(torch.float32)
    big = torch.zeros(POOL_BLOCKS, 2, *layout.block_shape)
    k_pools = [big[:, 0]] * layout.num_layers  # not contiguous
    v_pools = [big[:, 1]] * layout.num_layers
    dst = IDS["random"]
    on_layer = land_in(k_pools, v_pools, dst)
    k, v = layer_kv(layout, 32, 2, 0)
    on_layer(LayerHeader.for_layer(layout, 1, 0, 32), k, v)
    assert torch.equal(big[dst, 0], k) and torch.equal(big[dst, 1], v)

    calls = []
    dest = CallbackDestination(32, lambda header, k, v: calls.append((header.layer, len(k))))
    layer_callback(dest)(LayerHeader.for_layer(layout, 1, 3, 32), k, v)
    assert calls == [(3, 32)] and dest.num_blocks == 32
