"""A step's decoder layers in one C call (the CPU backend's ``compile_layer_loop``).

The module path (``pdserve/model/llama.py``) runs nine kernel entry points per layer, each
checking its inputs, allocating its output and converting its index tensors, through
``nn.Module`` calls: at batch 1 on the 2-core Zen 4 that Python took ~6 of a decode step's ~19 ms
(``pdserve bench offline --profile 1``: 16-40 us around each kernel call of a few us), and the
second OpenMP thread waits through it. Here the same C functions get the same arguments, with
everything that does not change within a step worked out once per step (buffers, index tensors,
thread count) and everything that does not change between steps once per model (packed weights,
norms, biases, shapes), and the layers run in ``layer_loop.c``, which calls the kernels through
function pointers: the logits are bit for bit the module path's (tests/engine/test_layer_loop.py).

Any step: its prefill tokens (prefill attention), then its decode tokens (decode attention);
``after_layer(i)`` (the prefill worker's KV shipping) is called back from C after each layer. It
covers what those kernels cover natively: bf16 weights and KV pools on a CPU with AVX512-BF16
(head_dim 64 or 128). The projections are all packed bf16 (``linear.c``), all Q4_1/Q8_0 as
``gemm.hybrid_weight``s (``pdserve_linear_hybrid_rows``: a prompt's rows from the blocks or the
packed copy by their count, a generated token's rows on Q4_1's exact values),
or all quantized (``quant.c``'s ``pdserve_qlinear_desc`` on a ``QDesc``). An fp32 model whose projections are all
quantized (the AVX2 machines' fast path: ``--quantization gguf`` or int8) runs its decode-only
steps here on any CPU, over fp32 or bf16 KV pools (``--kv-cache-dtype``; ``decode_only``: fp32
prefill attention is torch's, so steps with prefill tokens take the module path); at batch 1 on a 2-core Zen 3 the module path's Python and kernel
entry points were ~9 ms of a 27 ms step. ``compile_layer_loop(model)`` returns None otherwise
and the module path runs.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from pdserve.kernels.cpu import fused, gemm, ops, quant

_SOURCE = Path(__file__).with_name("layer_loop.c")
_P, _I64, _F32, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
_AFTER_LAYER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)
FAILED_ROPE, FAILED_DECODE, FAILED_PREFILL, STOPPED = range(4)  # layer_loop.c's kinds


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "ln1",
            "ln2",
            "qkv_w",
            "o_w",
            "gate_up_w",
            "down_w",
            "qkv_b",
            "o_b",
            "gate_up_b",
            "down_b",
            "k_cache",
            "v_cache",
        )
    ] + [("eps1", _F32), ("eps2", _F32)]


class _Part(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("tokens", "seqs", "bt_width", "bt_stride")] + [
        (name, _P) for name in ("block_tables", "query_start", "context_lens")
    ]


class _Step(ctypes.Structure):
    _fields_ = (
        [
            (name, _P)
            for name in (
                "rms_norm",
                "linear",
                "rope",
                "decode_attention",
                "prefill_attention",
                "silu_mul",
            )
        ]
        + [("after_layer", _AFTER_LAYER)]
        + [
            (name, _I64)
            for name in (
                "m",
                "hidden",
                "inter",
                "heads",
                "kv_heads",
                "head_dim",
                "width",
                "block_size",
                "num_blocks",
                "max_positions",
            )
        ]
        + [("scale", _F32), ("num_threads", _I32), ("prefill", _Part), ("decode", _Part)]
        + [
            (name, _P)
            for name in (
                "embeddings",
                "normed",
                "qkv",
                "attn",
                "o",
                "gate_up",
                "act",
                "down",
                "positions",
                "slots",
                "cos",
                "sin",
            )
        ]
        + [("is_bf16", _I32), ("kv_code", _I32), ("linear_rows", _P)]
    )


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = ops.load_or_warn(_SOURCE, "layer loop")
    if lib is not None:
        lib.pdserve_layers.argtypes = [
            ctypes.POINTER(_Step),
            ctypes.POINTER(_Layer),
            _I64,
            ctypes.POINTER(_I32),
            ctypes.POINTER(_I64),
        ]
        lib.pdserve_layers.restype = _I64
    return lib


def _address(fn) -> int:
    return ctypes.cast(fn, _P).value


def _part(tokens: int, block_tables, context_lens, query_start=None) -> tuple[_Part, list]:
    """A ``_Part`` and the tensors it points into (kept alive by the caller)."""
    if tokens == 0:
        return _Part(), []
    tables = ops.int32_rows(block_tables)
    lens = context_lens.to(torch.int32).contiguous()
    starts = None if query_start is None else query_start.to(torch.int32).contiguous()
    if tables.shape[0] != lens.shape[0] or (
        starts is not None and starts.shape[0] != lens.shape[0] + 1
    ):
        raise ValueError(
            f"{lens.shape[0]} context lengths for {tables.shape[0]} block table rows"
            + ("" if starts is None else f" and {starts.shape[0]} query starts")
        )
    part = _Part(
        tokens,
        lens.shape[0],
        tables.shape[1],
        tables.stride(0),
        tables.data_ptr(),
        None if starts is None else starts.data_ptr(),
        lens.data_ptr(),
    )
    return part, [tables, lens, starts]


def _projections(model) -> list:
    return [
        lin
        for layer in model.layers
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]


class LayerLoop:
    """``loop(input_ids, positions, kv_caches, meta, num_layers, after_layer)`` -> ``(x, residual)``
    after layers 0 .. num_layers-1, as ``LlamaForCausalLM.forward``'s module path leaves them
    (the last layer's MLP output, not yet added to the residual stream)."""

    def __init__(self, model, packing, fused_lib, attn_lib, loop_lib, quant_lib=None) -> None:
        cfg = model.config
        self.model = model
        self.dtype = next(model.parameters()).dtype  # bf16, or fp32 (quantized, decode only)
        self.decode_only = self.dtype == torch.float32
        self.packing, self.fused, self.lib = packing, fused_lib, loop_lib
        self.quantized = quant_lib is not None  # every projection quantized (else none)
        # a bf16 model of Q4_1/Q8_0 projections, multiplied as gemm.linear does (the hybrid)
        self.hybrid = (
            self.quantized
            and not self.decode_only
            and all(gemm.hybrid_weight(lin.weight) is not None for lin in _projections(model))
        )
        self.hidden, self.heads, self.kv_heads, self.head_dim = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.inter = cfg.intermediate_size
        self.qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        rope = model.layers[0].self_attn.rope
        self.cos, self.sin = rope.cos, rope.sin
        self.functions = (
            _address(fused_lib.pdserve_rms_norm),
            _address(
                packing.linear
                if quant_lib is None
                else packing.hybrid
                if self.hybrid
                else quant_lib.pdserve_qlinear_desc_f32
                if self.decode_only
                else quant_lib.pdserve_qlinear_desc
            ),
            _address(fused_lib.pdserve_rope_write_kv),
            _address(attn_lib.pdserve_paged_decode_attention),
            None if self.decode_only else _address(attn_lib.pdserve_prefill_attention_bf16),
            _address(fused_lib.pdserve_silu_mul),
        )
        # a hybrid's generated rows on Q4_1's exact values (gemm.linear_rows), as the module path
        self.linear_rows = _address(packing.hybrid_rows) if self.hybrid else None
        self._weights = list(model.parameters())
        self._key: tuple | None = None

    def _layers(self, kv_caches) -> ctypes.Array:
        """Per layer: the norms', packed projections', biases' and KV pools' addresses; rebuilt
        (and the pools checked) when a parameter was written in place (its version moves on, as
        for ``gemm``'s packing) or the pools are others."""
        pools = [t for pair in kv_caches for t in pair]
        key = (tuple(p._version for p in self._weights), tuple(map(id, pools)))
        if key == self._key:
            return self._array
        k0 = kv_caches[0][0]
        for k, v in kv_caches:
            if not (
                k.dtype == v.dtype == k0.dtype
                and ops.kv_code(self.dtype, k.dtype) is not None
                and k.shape == v.shape == k0.shape
                and k.is_contiguous()
                and v.is_contiguous()
            ):
                kinds = "bfloat16" if self.dtype == torch.bfloat16 else "float32 or bfloat16"
                raise ValueError(
                    f"layer loop: every KV pool must be {kinds} (one dtype), contiguous and of "
                    "one shape"
                )
        layers = (_Layer * len(self.model.layers))()
        keep = []
        for entry, layer, (k_cache, v_cache) in zip(
            layers, self.model.layers, kv_caches, strict=True
        ):
            attn, mlp = layer.self_attn, layer.mlp
            for name, lin in (
                ("qkv", attn.qkv_proj),
                ("o", attn.o_proj),
                ("gate_up", mlp.gate_up_proj),
                ("down", mlp.down_proj),
            ):
                if self.hybrid:  # the blocks and the packed bf16 copy, picked by rows of x
                    desc = gemm.hybrid_weight(lin.weight)
                    keep.append((desc, lin.weight))
                    setattr(entry, f"{name}_w", ctypes.addressof(desc))
                elif self.quantized:  # a descriptor of the blocks, for pdserve_qlinear_desc
                    desc = quant.descriptor(lin.weight)
                    keep.append((desc, lin.weight))
                    setattr(entry, f"{name}_w", ctypes.addressof(desc))
                else:
                    packed = gemm._packed_weight(self.packing, lin.weight)
                    keep.append(packed)
                    setattr(entry, f"{name}_w", packed.data_ptr())
                setattr(entry, f"{name}_b", None if lin.bias is None else lin.bias.data_ptr())
            entry.ln1 = layer.input_layernorm.weight.data_ptr()
            entry.ln2 = layer.post_attention_layernorm.weight.data_ptr()
            entry.eps1, entry.eps2 = layer.input_layernorm.eps, layer.post_attention_layernorm.eps
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        # the packed weights and the pools stay referenced while the array holds their addresses
        # (which also keeps the pools' ids in the key from being reused)
        self._array, self._keep, self._key = layers, (keep, pools), key
        return layers

    def __call__(
        self,
        input_ids,
        positions,
        kv_caches,
        meta,
        num_layers: int,
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = input_ids.shape[0]
        n = meta.num_prefill_tokens
        if n and self.decode_only:
            raise ValueError(
                "this layer loop runs decode-only steps; prefill takes the module path"
            )
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        if not positions.shape == slots.shape == (m,):
            raise ValueError(
                f"step of {m} tokens with {positions.numel()} positions and {slots.numel()} slots"
            )
        prefill, keep_p = _part(
            n, meta.prefill_block_tables, meta.prefill_context_lens, meta.prefill_query_start_loc
        )
        decode, keep_d = _part(m - n, meta.decode_block_tables, meta.decode_context_lens)
        if decode.seqs != m - n:
            raise ValueError(f"{m - n} decode tokens with {decode.seqs} context lengths")
        k0 = kv_caches[0][0]
        layers = self._layers(kv_caches)
        embed = self.model.embed_tokens
        if isinstance(embed.weight, torch.Tensor):  # then the residual stream
            emb = F.embedding(input_ids, embed.weight)
        else:  # a tied, quantized embedding: its rows dequantized
            emb = embed(input_ids).contiguous()
        H, inter, width = self.hidden, self.inter, self.qkv_width
        empty = lambda n: torch.empty(m, n, dtype=self.dtype)  # noqa: E731
        bufs = {
            "normed": empty(H),
            "qkv": empty(width),
            "attn": empty(self.heads * self.head_dim),
            "o": empty(H),
            "gate_up": empty(2 * inter),
            "act": empty(inter),
            "down": empty(H),
        }
        errors: list[BaseException] = []

        def hook(i: int) -> int:  # called from C; an exception stops the loop, then is raised here
            try:
                after_layer(i)
                return 0
            except BaseException as e:  # noqa: BLE001 - handed back to the caller below
                errors.append(e)
                return 1

        callback = _AFTER_LAYER(hook) if after_layer is not None else _AFTER_LAYER()
        step = _Step(
            *self.functions,
            callback,
            m,
            H,
            inter,
            self.heads,
            self.kv_heads,
            self.head_dim,
            width,
            k0.shape[1],
            k0.shape[0],
            self.cos.shape[0],
            self.model.layers[0].self_attn.scale,
            torch.get_num_threads(),
            prefill,
            decode,
            emb.data_ptr(),
            *(t.data_ptr() for t in bufs.values()),
            positions.data_ptr(),
            slots.data_ptr(),
            self.cos.data_ptr(),
            self.sin.data_ptr(),
            int(self.dtype == torch.bfloat16),
            ops.kv_code(self.dtype, k0.dtype),
            self.linear_rows,
        )
        kind, count = _I32(), _I64()
        failed = self.lib.pdserve_layers(
            ctypes.byref(step), layers, num_layers, ctypes.byref(kind), ctypes.byref(count)
        )
        del keep_p, keep_d, callback  # referenced until the call returned
        if failed >= 0:
            if kind.value == STOPPED:
                raise errors[0]
            if kind.value == FAILED_ROPE:
                raise fused.rope_error(count.value, self.cos.shape[0], k0.shape[0] * k0.shape[1])
            if kind.value == FAILED_PREFILL:
                raise ops.prefill_attention_error(count.value, k0.shape[0])
            raise ops.decode_attention_error(count.value, k0.shape[0])
        return bufs["down"], emb


def compile_layer_loop(model) -> LayerLoop | None:
    """A ``LayerLoop`` for ``model`` (a ``LlamaForCausalLM``), or None where its kernels do not
    all run natively (see the module docstring)."""
    packing = gemm._packing()
    fused_lib = fused._fused_library()
    loop_lib = _library()
    attn_lib = ops._library()
    if fused_lib is None or loop_lib is None or attn_lib is None:
        return None
    cfg = model.config
    params = list(model.parameters())
    projections = _projections(model)
    quantized = [not isinstance(lin.weight, torch.Tensor) for lin in projections]
    quant_lib = None
    if any(quantized):
        if not all(quantized) or not quant.available():
            return None  # mixed dense and quantized projections: the module path
        quant_lib = quant.library()
    dtype = params[0].dtype
    if dtype == torch.float32:  # decode steps of a quantized fp32 model, on any CPU
        if quant_lib is None:
            return None
    elif dtype != torch.bfloat16 or packing is None or not ops.attention_bf16_native():
        return None
    if cfg.head_dim not in (64, 128) or any(
        p.dtype != dtype or not p.is_cpu or not p.is_contiguous() for p in params
    ):
        return None
    rope = model.layers[0].self_attn.rope
    if rope.cos.dtype != torch.float32 or not (
        rope.cos.is_contiguous() and rope.sin.is_contiguous()
    ):
        return None
    return LayerLoop(model, packing, fused_lib, attn_lib, loop_lib, quant_lib)
