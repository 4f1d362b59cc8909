"""The GGUF tensor index (``gguf_index``) against the ``gguf`` package's reader, its errors, and a
model built for loading (no random initial values) giving the same model."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from torch import nn

from pdserve.model.fetch import gguf_source
from pdserve.model.gguf_index import GGUFIndexError, read_index
from pdserve.model.llama import weights_to_be_loaded


@pytest.fixture(scope="module")
def model_gguf(default_model_dir: Path) -> Path:
    return gguf_source(default_model_dir)


def test_the_index_is_the_gguf_readers_tensors_byte_for_byte(model_gguf: Path) -> None:
    reader = GGUFReader(model_gguf)
    index = read_index(model_gguf)
    assert [e.name for e in index] == [t.name for t in reader.tensors]
    assert len(index) == 272  # 30 layers x 9 + the embedding and the final norm
    types = set()
    for entry, t in zip(index, reader.tensors, strict=True):
        assert entry.tensor_type == int(t.tensor_type), entry.name
        assert entry.shape == tuple(int(d) for d in t.shape), entry.name
        assert (entry.start, entry.nbytes) == (int(t.data_offset), int(t.n_bytes)), entry.name
        expected = np.asarray(t.data).view(np.uint8).reshape(-1)
        assert np.array_equal(entry.read(model_gguf).numpy(), expected), entry.name
        types.add(entry.tensor_type)
    assert types == {0, 3, 8}  # F32 norms, Q4_1 projections, the Q8_0 embedding


def _header(version: int = 3, meta: bytes = b"", n_meta: int = 0, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_meta) + meta


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def test_a_file_that_is_not_gguf_is_refused_with_what_it_starts_with(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(GGUFIndexError, match=r"not a GGUF file \(it does not start with b'GGUF'\)"):
        read_index(path)


def test_an_unknown_version_is_refused_with_the_versions_known(tmp_path: Path) -> None:
    path = tmp_path / "v9.gguf"
    path.write_bytes(_header(version=9))
    with pytest.raises(GGUFIndexError, match=r"GGUF version 9; this reader knows versions 2, 3"):
        read_index(path)


def test_a_cut_header_is_refused_not_read_past_its_end(model_gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_gguf.read_bytes()[:100_000])  # inside the tokenizer's strings
    with pytest.raises(GGUFIndexError, match=r"runs past the end|ends early"):
        read_index(path)


def test_a_tensor_past_the_end_of_the_file_is_refused(tmp_path: Path) -> None:
    tensor = _string("output.weight") + struct.pack("<I2QIQ", 2, 64, 4, 3, 0)  # Q4_1, 320 B
    path = tmp_path / "short.gguf"
    path.write_bytes(_header(n_tensors=1) + tensor)
    with pytest.raises(GGUFIndexError, match=r"tensor output.weight runs past the end"):
        read_index(path)


def test_metadata_of_every_kind_is_skipped_and_general_alignment_is_honoured(
    tmp_path: Path,
) -> None:
    meta = (
        _string("a.u8") + struct.pack("<IB", 0, 7)
        + _string("a.str") + struct.pack("<I", 8) + _string("hello")
        + _string("a.strs") + struct.pack("<IIQ", 9, 8, 2) + _string("x") + _string("yz")
        + _string("a.f32s") + struct.pack("<IIQ3f", 9, 6, 3, 1.0, 2.0, 3.0)
        + _string("general.alignment") + struct.pack("<II", 4, 64)
    )  # fmt: skip
    tensor = _string("t") + struct.pack("<I1QIQ", 1, 8, 0, 0)  # 8 fp32 values
    head = _header(meta=meta, n_meta=5, n_tensors=1) + tensor
    data_start = -(-len(head) // 64) * 64
    values = np.arange(8, dtype=np.float32)
    path = tmp_path / "kinds.gguf"
    path.write_bytes(head + b"\0" * (data_start - len(head)) + values.tobytes())
    (entry,) = read_index(path)
    assert (entry.name, entry.shape, entry.tensor_type) == ("t", (8,), 0)
    assert (entry.start, entry.nbytes) == (data_start, 32)
    assert np.array_equal(entry.read(path).numpy().view(np.float32), values)


def test_a_model_built_for_loading_draws_no_random_values_and_restores_the_init() -> None:
    linear_init, embedding_init = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    torch.manual_seed(0)
    with weights_to_be_loaded():
        nn.Linear(64, 64)
        nn.Embedding(100, 16)
    drawn_after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(drawn_after, torch.rand(1))  # nothing drew from the generator
    with pytest.raises(RuntimeError), weights_to_be_loaded():
        raise RuntimeError("a failed build")
    assert (nn.Linear.reset_parameters, nn.Embedding.reset_parameters) == (
        linear_init,
        embedding_init,
    )
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    assert not torch.equal(a.weight, b.weight)  # outside the block the init draws again
