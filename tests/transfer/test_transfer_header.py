"""Wire format: layout hash, header, message framing, address blob."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.transfer import HeaderMismatchError, KVLayout, LayerHeader, kv_layout_hash
from pdserve.transfer.header import (
    HEADER_NBYTES,
    PROTOCOL_VERSION,
    message_buffer_of,
    message_views,
    pack_address,
    read_header,
    unpack_address,
    write_header,
    write_message,
)
from tests.gpu import DEVICES
from tests.transfer.peers import default_layout, layer_kv

BASE = dict(
    model="SmolLM2-135M",
    dtype=torch.bfloat16,
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)


def test_layout_hash_is_stable_and_covers_every_field() -> None:
    h = kv_layout_hash(**BASE)
    assert h == kv_layout_hash(**{**BASE, "dtype": "bfloat16"}) == KVLayout(**BASE).compat_hash
    assert len(h) == 32 and int(h, 16) >= 0
    changed = dict(
        model="other",
        dtype=torch.float32,
        block_size=32,
        num_layers=31,
        num_kv_heads=4,
        head_dim=32,
    )
    for field, value in changed.items():
        assert kv_layout_hash(**{**BASE, field: value}) != h, field


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match="cannot be transferred"):
        KVLayout(**{**BASE, "dtype": torch.int64})
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        KVLayout(**{**BASE, "num_kv_heads": 0})


def test_header_roundtrip() -> None:
    layout = KVLayout(**BASE)
    header = LayerHeader.for_layer(
        layout, 2**48 - 1, 29, 32, block_offset=3, token_id=1234, traceparent="00-" + "a" * 32
    )
    raw = header.pack()
    assert len(raw) == HEADER_NBYTES
    assert LayerHeader.unpack(raw) == header
    header.check(layout)


def test_version_mismatch_is_rejected_with_a_clear_error() -> None:
    header = dataclasses.replace(LayerHeader.for_layer(KVLayout(**BASE), 1, 0, 4), version=99)
    with pytest.raises(HeaderMismatchError, match=f"v99, this worker v{PROTOCOL_VERSION}"):
        LayerHeader.unpack(header.pack())
    with pytest.raises(HeaderMismatchError, match="not a pdserve KV message"):
        LayerHeader.unpack(b"\0" * HEADER_NBYTES)


def test_layout_mismatch_names_both_layouts() -> None:
    sender = KVLayout(**{**BASE, "dtype": torch.float32})
    receiver = KVLayout(**BASE)
    header = LayerHeader.for_layer(sender, 5, 0, 4)
    with pytest.raises(HeaderMismatchError) as err:
        header.check(receiver)
    message = str(err.value)
    assert "transfer 5 layer 0" in message and "float32" in message and "bfloat16" in message
    assert sender.compat_hash in message and receiver.compat_hash in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_message_framing_is_byte_exact(dtype: torch.dtype) -> None:
    layout = default_layout(dtype)
    k, v = layer_kv(layout, 32, seed=3, layer=7)
    header = LayerHeader.for_layer(layout, 9, 7, 32)
    buf = torch.empty(layout.message_nbytes(32), dtype=torch.uint8)
    assert write_message(buf, header, k, v) == buf.numel()
    assert read_header(buf) == header
    got_k, got_v = message_views(buf, header)
    assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), v.view(torch.uint8))
    assert got_k.data_ptr() == buf.data_ptr() + HEADER_NBYTES  # views, not copies


def test_gathering_in_place_is_recognised() -> None:
    layout = default_layout(torch.bfloat16)
    buf = torch.empty(layout.message_nbytes(8), dtype=torch.uint8)
    header = LayerHeader.for_layer(layout, 1, 0, 8)
    k, v = message_views(buf, header)
    found = message_buffer_of(k, v)
    assert found is not None and found.data_ptr() == buf.data_ptr()
    assert found.numel() == buf.numel()
    write_header(found, header)
    assert read_header(buf) == header
    assert message_buffer_of(k.clone(), v) is None
    assert message_buffer_of(v, k) is None


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_made_in_inference_mode_are_framed_outside_it(device: str) -> None:
    """The engine's forward (inference mode) takes a message buffer to gather a layer into; the
    last layer is framed after sampling, outside it (LLMEngine.step called directly)."""
    layout = default_layout(torch.bfloat16)
    k, v = layer_kv(layout, 8, seed=5, layer=0)
    header = LayerHeader.for_layer(layout, 4, 0, 8, token_id=17)
    with torch.inference_mode():
        buf = torch.empty(layout.message_nbytes(8), dtype=torch.uint8, device=device)
    assert write_message(buf, header, k.to(device), v.to(device)) == buf.numel()
    write_header(buf, header)
    assert read_header(buf) == header
    got_k, _ = message_views(buf, header)
    assert torch.equal(got_k.cpu().view(torch.uint8), k.view(torch.uint8))


def test_message_shorter_than_its_header_announces() -> None:
    layout = default_layout()
    header = LayerHeader.for_layer(layout, 1, 0, 8)
    with pytest.raises(HeaderMismatchError, match="announces 8 blocks"):
        message_views(torch.empty(layout.message_nbytes(4), dtype=torch.uint8), header)


def test_address_blob_checks_layout() -> None:
    layout = default_layout()
    blob = pack_address(layout, b"worker-address")
    assert unpack_address(blob, layout) == b"worker-address"
    with pytest.raises(HeaderMismatchError, match="same model, dtype, block size"):
        unpack_address(blob, default_layout(torch.bfloat16))
    with pytest.raises(HeaderMismatchError, match="not a pdserve KV transport address"):
        unpack_address(b"garbage", layout)
