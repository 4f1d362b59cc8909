"""A decode step's decoder layers as a flat loop of C calls (the CPU backend's ``decode_loop``).

The module path (``pdserve/model/llama.py``) runs nine kernel entry points per layer, each
checking its inputs, allocating its output and converting its index tensors, through
``nn.Module`` calls: at batch 1 on the 2-core Zen 4 that Python took ~8 of a step's ~19 ms
(``pdserve bench offline --profile 1``: 16-40 us around each kernel call of a few us). Here the
same C functions get the same arguments, with everything that does not change within a step
worked out once per step (buffers, index tensors, thread count) and everything that does not
change between steps once per model (packed weights, norms, biases, shapes): the logits are bit
for bit the module path's (tests/engine/test_decode_loop.py).

It covers what those kernels cover natively: bf16 weights and KV pools on a CPU with
AVX512-BF16 (head_dim 64 or 128), decode-only batches. ``compile_decode_loop(model)`` returns
None otherwise and the module path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import fused, gemm, ops


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeLoop:
    """``loop(input_ids, positions, kv_caches, meta)`` -> the final norm's output, as
    ``LlamaForCausalLM.forward`` for a decode-only batch."""

    def __init__(self, model, packing, fused_lib, attn_lib) -> None:
        cfg = model.config
        self.model = model
        self.packing, self.fused, self.attn = packing, fused_lib, attn_lib
        self.hidden, self.heads, self.kv_heads, self.head_dim = (
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.inter = cfg.intermediate_size
        self.qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        rope = model.layers[0].self_attn.rope
        self.cos, self.sin = rope.cos, rope.sin
        self.scale = model.layers[0].self_attn.scale
        self.eps = [(layer.input_layernorm.eps, layer.post_attention_layernorm.eps) for layer in model.layers]
        self.final_eps = model.norm.eps
        self._versions: list[int] | None = None
        self._weights = [p for p in model.parameters()]

    def _layer_pointers(self) -> list[tuple]:
        """Per layer: the norms', packed projections' and biases' addresses; rebuilt when any
        parameter was written in place (its version moves on, as for ``gemm``'s packing)."""
        versions = [p._version for p in self._weights]
        if versions == self._versions:
            return self._pointers
        packed = lambda lin: gemm._packed_weight(self.packing, lin.weight)  # noqa: E731
        self._packed_keep = []  # the packed tensors, alive while their addresses are used
        pointers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            entry = []
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                p = packed(lin)
                self._packed_keep.append(p)
                entry += [p.data_ptr(), _ptr(lin.bias)]
            pointers.append((layer.input_layernorm.weight.data_ptr(),
                             layer.post_attention_layernorm.weight.data_ptr(), *entry))
        self._pointers, self._versions = pointers, versions
        return pointers

    def __call__(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        m = input_ids.shape[0]
        hd, heads, kvh, width = self.head_dim, self.heads, self.kv_heads, self.qkv_width
        block_tables = ops.int32_rows(meta.decode_block_tables)
        lens = meta.decode_context_lens.to(torch.int32).contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        if not (positions.shape == slots.shape == lens.shape == (m,) and block_tables.shape[0] == m):
            raise ValueError(
                f"decode step of {m} tokens with {positions.numel()} positions, {slots.numel()} "
                f"slots, {lens.numel()} context lengths and {block_tables.shape[0]} block table rows")
        k0 = kv_caches[0][0]
        num_blocks, block_size = k0.shape[0], k0.shape[1]
        for k, v in kv_caches:
            if not (k.dtype == v.dtype == torch.bfloat16 and k.shape == v.shape == k0.shape
                    and k.is_contiguous() and v.is_contiguous()):
                raise ValueError("decode loop: every KV pool must be bf16, contiguous and of one shape")
        threads = torch.get_num_threads()
        emb = F.embedding(input_ids, self.model.embed_tokens.weight)
        residual = emb  # layer 0 normalizes the embeddings; from then on they are the residual stream
        x = emb
        empty = lambda n: torch.empty(m, n, dtype=torch.bfloat16)  # noqa: E731
        normed, qkv, out, o, gate_up, act, down = (
            empty(self.hidden), empty(width), empty(heads * hd), empty(self.hidden),
            empty(2 * self.inter), empty(self.inter), empty(self.hidden))
        lin = self.packing.linear
        rms, rope, silu = self.fused.pdserve_rms_norm, self.fused.pdserve_rope_write_kv, self.fused.pdserve_silu_mul
        decode = self.attn.pdserve_paged_decode_attention
        H, I = self.hidden, self.inter  # noqa: E741
        p_normed, p_qkv, p_out, p_o, p_gu, p_act, p_down = (
            normed.data_ptr(), qkv.data_ptr(), out.data_ptr(), o.data_ptr(), gate_up.data_ptr(),
            act.data_ptr(), down.data_ptr())
        p_res, p_pos, p_slots = residual.data_ptr(), positions.data_ptr(), slots.data_ptr()
        p_bt, p_lens, bt_width, bt_stride = (block_tables.data_ptr(), lens.data_ptr(),
                                            block_tables.shape[1], block_tables.stride(0))
        p_cos, p_sin, max_pos = self.cos.data_ptr(), self.sin.data_ptr(), self.cos.shape[0]
        num_slots = num_blocks * block_size
        for i, (ln1, ln2, qkv_w, qkv_b, o_w, o_b, gu_w, gu_b, down_w, down_b) in enumerate(self._layer_pointers()):
            eps1, eps2 = self.eps[i]
            k_cache, v_cache = kv_caches[i]
            rms(x.data_ptr() if i == 0 else p_down, None if i == 0 else p_res, ln1, p_normed, m, H, eps1, 1, threads)
            lin(p_normed, qkv_w, qkv_b, p_qkv, m, width, H, threads)
            bad = rope(p_qkv, m, width, heads, kvh, hd, p_pos, p_cos, p_sin, max_pos, k_cache.data_ptr(),
                       v_cache.data_ptr(), p_slots, num_slots, 1, threads)
            if bad:
                raise ValueError(f"rope_write_kv: {bad} tokens have a position outside [0, {max_pos}) or a "
                                 f"slot outside [0, {num_slots}); nothing was written for them")
            bad = decode(p_qkv, k_cache.data_ptr(), v_cache.data_ptr(), p_bt, p_lens, p_out, m, heads, kvh,
                         hd, block_size, num_blocks, bt_width, bt_stride, width, hd, self.scale, 1, threads)
            if bad:
                raise ValueError(f"paged_decode_attention: {bad} (sequence, kv head) tasks have a context_len "
                                 f"beyond their block table row or block ids outside [0, {num_blocks})")
            lin(p_out, o_w, o_b, p_o, m, H, heads * hd, threads)
            rms(p_o, p_res, ln2, p_normed, m, H, eps2, 1, threads)
            lin(p_normed, gu_w, gu_b, p_gu, m, 2 * I, H, threads)
            silu(p_gu, p_act, m, I, 1, threads)
            lin(p_act, down_w, down_b, p_down, m, H, I, threads)
        final = torch.empty(m, H, dtype=torch.bfloat16)
        rms(p_down, p_res, self.model.norm.weight.data_ptr(), final.data_ptr(), m, H, self.final_eps, 1, threads)
        return final


def compile_decode_loop(model) -> DecodeLoop | None:
    """A ``DecodeLoop`` for ``model`` (a ``LlamaForCausalLM``), or None where its kernels do not
    all run natively (see the module docstring)."""
    packing = gemm._packing()
    fused_lib = fused._fused_library()
    if packing is None or fused_lib is None or not ops.attention_bf16_native():
        return None
    cfg = model.config
    params = list(model.parameters())
    if cfg.head_dim not in (64, 128) or any(
        p.dtype != torch.bfloat16 or not p.is_cpu or not p.is_contiguous() for p in params
    ):
        return None
    rope = model.layers[0].self_attn.rope
    if rope.cos.dtype != torch.float32 or not (rope.cos.is_contiguous() and rope.sin.is_contiguous()):
        return None
    return DecodeLoop(model, packing, fused_lib, ops._library())
