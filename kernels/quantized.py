"""Quantized projection weights: the container every backend's ``linear`` accepts in place of a
dense weight, the quantizers that make one at load, and a plain-torch dequantization (the spec
the C kernels are tested against).

Formats (``QuantizedWeight.qtype``; the GGUF ones keep GGUF's block bytes, rows contiguous):

=========  =====  ==================================================  ======================
name       code   one block of 32 values of a row                     value
=========  =====  ==================================================  ======================
``q4_0``   2      fp16 d, 16 bytes of nibbles (18 bytes)              (q - 8) * d
``q4_1``   3      fp16 d, fp16 m, 16 bytes of nibbles (20 bytes)      q * d + m
``q8_0``   8      fp16 d, 32 int8 (34 bytes)                          q * d
``int8``   100    32 int8 (32 bytes); one fp32 scale per output row   q * scale[n]
=========  =====  ==================================================  ======================

Nibble byte j of a block holds value j (low 4 bits) and value j + 16 (high 4 bits). ``int8`` is
symmetric per output channel: scale = max|w[n]| / 127, q = round(w / scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # values per block
QTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8, "int8": 100}
NAMES = {code: name for name, code in QTYPES.items()}
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 100: 32}
GGUF_TYPES = (2, 3, 8)  # the codes are GGML's own type ids


@dataclass(eq=False)
class QuantizedWeight:
    """A ``[N, K]`` weight as ``data`` (uint8 ``[N, K / 32 * block bytes]``) in format ``qtype``;
    ``scale`` (fp32 ``[N]``) for int8 only."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unknown quantized format {self.qtype}")
        if k % QK:
            raise ValueError(f"quantized weights need K % {QK} == 0, got K = {k}")
        want = (n, k // QK * BLOCK_BYTES[self.qtype])
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(
                f"data must be uint8 {want}, got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if (self.scale is None) != (self.qtype != QTYPES["int8"]):
            raise ValueError("int8 weights need a per-row scale, the block formats none")
        self.data = self.data.contiguous()
        if self.scale is not None:
            self.scale = self.scale.to(torch.float32).contiguous()

    @property
    def name(self) -> str:
        return NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.scale is None else 4 * self.scale.numel())

    @property
    def dtype(self) -> torch.dtype:  # what a dense weight would say; quantized data is uint8
        return torch.uint8

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_reference(self).to(dtype)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (a permutation or selection of output channels)."""
        return QuantizedWeight(
            self.data[index],
            self.qtype,
            (int(index.numel()), self.shape[1]),
            None if self.scale is None else self.scale[index],
        )


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one format and K stacked along the output rows (the fused qkv, gate_up)."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("stacked quantized weights must share format and K")
    scale = None if first.scale is None else torch.cat([p.scale for p in parts])
    n = sum(p.shape[0] for p in parts)
    return QuantizedWeight(
        torch.cat([p.data for p in parts]), first.qtype, (n, first.shape[1]), scale
    )


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[..., at : at + 2].contiguous().view(torch.float16).to(torch.float32)


def dequantize_reference(w: QuantizedWeight) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight, in plain torch: each value computed as the table says, one
    rounding per operation (the C kernels give the same bits)."""
    n, k = w.shape
    blocks = w.data.view(n, k // QK, BLOCK_BYTES[w.qtype])
    if w.qtype in (2, 3):
        qs = blocks[..., 4:] if w.qtype == 3 else blocks[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.float32)  # [n, blocks, 32]
        d = _f16(blocks, 0)
        out = (q - 8) * d if w.qtype == 2 else q * d + _f16(blocks, 2)
    elif w.qtype == 8:
        out = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(blocks, 0)
    else:
        out = blocks.contiguous().view(torch.int8).to(torch.float32) * w.scale[:, None, None]
    return out.reshape(n, k)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 of a dense ``[N, K]`` weight (K % 32 == 0)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.view(torch.uint8), QTYPES["int8"], tuple(w.shape), scale)


def quantize_blocks(weight: torch.Tensor, qtype: int) -> QuantizedWeight:
    """A dense ``[N, K]`` weight in a GGUF block format (q4_0, q4_1, q8_0), quantized by the
    ``gguf`` package's reference quantizer (as llama.cpp's tools would write the file)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = weight.detach().to(torch.float32).contiguous().numpy()
    data = np.ascontiguousarray(quantize(w, GGMLQuantizationType(qtype)))
    return QuantizedWeight(torch.from_numpy(data).view(torch.uint8), qtype, tuple(w.shape))


def quantize(weight: torch.Tensor, name: str) -> QuantizedWeight:
    """``weight`` in format ``name`` (``QTYPES``)."""
    if name == "int8":
        return quantize_int8(weight)
    return quantize_blocks(weight, QTYPES[name])


def embedding_reference(ids: torch.Tensor, w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the dequantized weight (an embedding lookup), in plain torch."""
    flat = ids.reshape(-1).to(torch.long)
    picked = w.rows(flat)
    return dequantize_reference(picked).to(dtype).reshape(*ids.shape, w.shape[1])
