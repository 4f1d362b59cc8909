"""Quantized projection weights at load (``--quantization``; modes: ``config.QUANTIZATIONS``).

After the dense model is loaded, each projection's weight (qkv, o, gate_up, down of every layer,
and the lm_head) is replaced by a ``kernels.QuantizedWeight``, which the backend's ``linear``
takes in place of a dense weight:

- ``gguf``: the model's own GGUF blocks (Q4_0, Q4_1, Q8_0), read from the GGUF file kept beside
  the converted folder (``fetch.gguf_source``), rows as the file has them (q/k unpermuted); a
  tensor of another GGUF type stays dense.
- ``int8``, ``q8_0``, ``q4_1``, ``q4_0``: the dense weights quantized here (``kernels.quantize``).
- ``auto`` (the default): ``gguf`` where the model was converted from a GGUF file and runs on
  the CPU, else ``none`` (``resolve_quantization``). With fp32 weights (no native bf16) every
  GGUF block the kernels read is used: on a 2-core AVX2 Zen 3 the default model's own Q4_1
  blocks decode one stream 3x faster than fp32 and batch 32 as fast. With bf16 weights (AVX512-
  BF16) only the Q4_1 and Q8_0 weights are (the default model: every projection Q4_1, the tied
  embedding and lm_head Q8_0): a prompt's rows are then multiplied from the blocks for up to
  ``gemm.HYBRID_MAX_ROWS`` rows of x and from a packed bf16 copy for more, with the outputs of
  that bf16 copy either way (``kernels/cpu/packed_q4.h``), so a prompt's tokens compute exactly
  what the dense bf16 model of the converted folder computes; a generated token's rows multiply
  Q4_1 on its exact values (``kernels/cpu/exact_q4.h``), reading the 4-bit blocks at any batch.
  Without native bf16 packing a bf16 model stays dense.

Tied embeddings are quantized with the lm_head (one copy), and the embedding lookup dequantizes
the rows it needs (``QuantizedEmbedding``); an untied embedding stays dense (only looked up).
Weights whose K is not a multiple of 32 stay dense.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from pdserve import kernels
from pdserve.model.llama import LlamaForCausalLM, QuantizedEmbedding


def _projections(model: LlamaForCausalLM) -> Iterator[tuple[nn.Linear, list[str]]]:
    """Each projection and the Hugging Face weights stacked into it."""
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        yield attn.qkv_proj, [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        yield attn.o_proj, [p + "self_attn.o_proj.weight"]
        yield mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        yield mlp.down_proj, [p + "mlp.down_proj.weight"]
    tied = model.config.tie_word_embeddings
    yield model.lm_head, ["model.embed_tokens.weight" if tied else "lm_head.weight"]


def _replace(linear: nn.Linear, weight: kernels.QuantizedWeight) -> None:
    delattr(linear, "weight")  # the dense parameter goes
    linear.weight = weight


def resolve_quantization(mode: str, folder: Path | None, dtype: torch.dtype, device) -> str:
    """``mode``, with "auto" made "gguf" (fp32 weights on the CPU of a model that kept its GGUF
    file) or "none"."""
    if mode != "auto":
        return mode
    from pdserve.model.fetch import GGUF_COPY

    cpu = torch.device(device).type == "cpu"
    kept = folder is not None and (Path(folder) / GGUF_COPY).is_file()
    if not (cpu and kept):
        return "none"
    if dtype == torch.float32:
        return "gguf"
    hybrid = getattr(kernels.get_backend(device), "hybrid_available", None)  # the CPU backend's
    return "gguf" if dtype == torch.bfloat16 and hybrid is not None and hybrid() else "none"


def quantize_model(model: LlamaForCausalLM, mode: str, folder: Path | None = None) -> str:
    """Replace ``model``'s projection weights by quantized ones (``mode``: see the module);
    returns the mode applied ("auto" resolved)."""
    dtype = model.norm.weight.dtype
    # auto on a bf16 model: its Q4_1 and Q8_0 weights only (the hybrid): the dense bf16 model's
    # outputs (but see PDSERVE_BF16_INTEGER_ROWS, gemm.hybrid_weight)
    hybrid_only = mode == "auto" and dtype == torch.bfloat16
    mode = resolve_quantization(mode, folder, dtype, model.norm.weight.device)
    if mode == "none":
        return mode
    source: dict[str, kernels.QuantizedWeight] | None = None
    if mode == "gguf":
        from pdserve.model.fetch import gguf_source
        from pdserve.model.gguf_convert import quantized_tensors

        source = quantized_tensors(gguf_source(Path(folder)), model.config)
    elif mode not in kernels.QTYPES:
        raise ValueError(f"quantization {mode!r} is not supported")
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for linear, names in _projections(model):
            weight = linear.weight
            if not isinstance(weight, torch.Tensor) or weight.shape[1] % 32:
                continue
            if source is not None:
                if not all(n in source for n in names):
                    continue  # a GGUF type we do not read: stays dense
                parts = [source[n] for n in names]
                qw = parts[0] if len(parts) == 1 else kernels.concat(parts)
                if hybrid_only and qw.name not in ("q4_1", "q8_0"):
                    continue  # stays dense: packed bf16 at every row count
            else:
                qw = kernels.quantize(weight, mode)
            if tuple(qw.shape) != tuple(weight.shape):
                raise ValueError(
                    f"{names}: quantized shape {qw.shape}, expected {tuple(weight.shape)}"
                )
            _replace(linear, qw)
            if linear is model.lm_head and tied:
                model.embed_tokens = QuantizedEmbedding(qw, model.ops, dtype)
    return mode


def weight_tiers(model: LlamaForCausalLM) -> tuple[tuple[int, int, bool], ...]:
    """``(rows, extra, prompt_only)``, ascending: a step of more than ``rows`` tokens (of more
    than ``rows`` prompt tokens, where ``prompt_only``) reads ``extra`` bytes more than
    ``weight_bytes`` counts, where a bf16 model's blocks give way to their copies (the CPU
    backend's ``hybrid_tier``; a Q4_1 weight's blocks serve generated tokens at any count)."""
    tier = getattr(model.ops, "hybrid_tier", None)  # the CPU backend's, for a bf16 model
    if tier is None:
        return ()
    extra: dict[tuple[int, bool], int] = {}
    seen: set[int] = set()
    for m in model.modules():
        if not _quantized(m) or id(m.weight) in seen:
            continue
        seen.add(id(m.weight))
        t = tier(m.weight)
        if t is not None:
            rows, more, prompt_only = t
            extra[rows, prompt_only] = extra.get((rows, prompt_only), 0) + more
    return tuple((rows, more, prompt_only) for (rows, prompt_only), more in sorted(extra.items()))


def _quantized(module) -> bool:
    return isinstance(getattr(module, "weight", None), kernels.QuantizedWeight)


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the weights a step reads: every parameter and quantized weight once, less an
    untied embedding table (only its looked-up rows are read); larger steps: ``weight_tiers``."""
    seen: set[int] = set()
    total = 0
    skip = set() if model.config.tie_word_embeddings else {id(model.embed_tokens.weight)}
    tensors = list(model.parameters()) + [m.weight for m in model.modules() if _quantized(m)]
    for t in tensors:
        if id(t) in seen or id(t) in skip:
            continue
        seen.add(id(t))
        if not isinstance(t, kernels.QuantizedWeight):
            total += t.numel() * t.element_size()
        else:
            total += t.nbytes
    return total
