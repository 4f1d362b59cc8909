"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Everything the forward pass needs is passed in: ``model(input_ids, positions, kv_caches, meta)``.
q/k/v and gate/up projections are fused into one matrix each (one GEMM instead of three/two).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pdserve import envs
from pdserve.model.attention import AttentionMetadata, OutputRows, paged_attention
from pdserve.model.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """``forward(x, residual)`` first adds x into the residual stream, then normalizes it: the
    backend does both in one pass (``ops.rms_norm``) and returns ``(normed, residual)``."""

    def __init__(self, dim: int, eps: float, ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class QuantizedEmbedding(nn.Module):
    """A tied embedding held quantized (as the lm_head's ``kernels.QuantizedWeight``): the lookup
    dequantizes the rows it needs (``ops.quantized_embedding``), in the model's dtype."""

    def __init__(self, weight, ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.ops = ops
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.quantized_embedding(input_ids, self.weight, self.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position, precomputed in fp32; rotate-half convention (as Hugging Face).
    Applied by ``ops.rope_write_kv``, together with the KV-cache write."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


def project(ops, x: torch.Tensor, linear: nn.Linear, prompt_rows: int) -> torch.Tensor:
    """``ops.linear`` of a step's rows: the first ``prompt_rows`` are prompt tokens and the rest
    generated ones, which a backend with ``linear_rows`` may multiply differently (the CPU's, for a
    bf16 model's Q4_1 weights: on their exact values)."""
    rows = getattr(ops, "linear_rows", None)
    if rows is None:
        return ops.linear(x, linear.weight, linear.bias)
    return rows(x, linear.weight, linear.bias, prompt_rows)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, ops) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = cfg.head_dim**-0.5
        self.rope = rope
        self.ops = ops

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache,
        meta: AttentionMetadata,
        rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Every token's K/V is written; the output is every token's, or only ``rows``'."""
        # [num_tokens, q_size + 2 * kv_size]
        qkv = project(self.ops, x, self.qkv_proj, meta.num_prefill_tokens)
        k_cache, v_cache = kv_cache
        # rotate q and k, write k and v into their slots; q: [num_tokens, heads, head_dim]
        q = self.ops.rope_write_kv(
            qkv,
            positions,
            self.rope.cos,
            self.rope.sin,
            self.num_heads,
            k_cache,
            v_cache,
            meta.slot_mapping,
        )
        if rows is not None:
            q, meta = q[rows.indices], rows.meta
        out = paged_attention(
            self.ops, q, kv_cache, meta, self.scale
        )  # [num_tokens, heads, head_dim]
        return project(self.ops, out.reshape(-1, self.q_size), self.o_proj, meta.num_prefill_tokens)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor, prompt_rows: int) -> torch.Tensor:
        """``x``'s first ``prompt_rows`` rows are prompt tokens, the rest generated ones."""
        gate_up = project(self.ops, x, self.gate_up_proj, prompt_rows)
        return project(self.ops, self.ops.silu_mul(gate_up), self.down_proj, prompt_rows)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, ops) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, rope, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, positions, x, residual, kv_cache, meta, rows: OutputRows | None = None):
        """``x`` is the previous layer's MLP output (or the embeddings), not yet added to the
        residual stream ``residual`` (None before the first layer): each norm adds, then
        normalizes, in one pass. Returns this layer's MLP output and the residual stream, of
        every token or (after writing every token's K/V) of ``rows`` only."""
        h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn(positions, h, kv_cache, meta, rows)
        if rows is not None:
            residual = residual[rows.indices]
        if attn.shape[0] == 0:
            return attn, residual
        h, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(h, (meta if rows is None else rows.meta).num_prefill_tokens), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.ops = ops

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
        rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """The final hidden states of every token, or of ``rows`` only (those whose logits are
        wanted: the last layer then skips the others' attention and MLP, which nothing reads;
        every layer still writes every token's K/V). ``after_layer(i)`` runs once layer i has
        written its KV (to ship it while i+1 computes). The backend's layer loop runs the layers
        where it has one (the same kernels, bit for bit), all but a pruned last layer."""
        if rows is not None and rows.indices.numel() == input_ids.shape[0]:
            rows = None  # every token sampled (the rows increase): nothing to prune
        last = len(self.layers) - 1
        loop = self._layer_loop()
        if loop is not None and loop.decode_only and meta.num_prefill_tokens:
            loop = None  # an fp32 loop runs decode-only steps
        if loop is not None:
            start = last + 1 if rows is None else last
            x, residual = loop(input_ids, positions, kv_caches, meta, start, after_layer)
        else:
            start, x, residual = 0, self.embed_tokens(input_ids), None  # [num_tokens, hidden]
        for i in range(start, last + 1):
            x, residual = self.layers[i](
                positions, x, residual, kv_caches[i], meta, rows if i == last else None
            )
            if after_layer is not None:
                after_layer(i)
        if x.shape[0] == 0:
            return x
        return self.norm(x, residual)[0]

    def _layer_loop(self):
        """The backend's compiled layer loop for this model (made on first use), or None."""
        if "_compiled_layer_loop" not in self.__dict__:
            compile_loop = getattr(self.ops, "compile_layer_loop", None)
            loop = (
                compile_loop(self)
                if compile_loop is not None and envs.layer_loop_enabled()
                else None
            )
            self.__dict__["_compiled_layer_loop"] = loop
        return self.__dict__["_compiled_layer_loop"]

    @contextlib.contextmanager
    def module_path(self) -> Iterator[None]:
        """Within it, steps take the module path even where a layer loop exists (to time the
        kernels at their Python entry points, or to compare the two)."""
        loop = self._layer_loop()
        self.__dict__["_compiled_layer_loop"] = None
        try:
            yield
        finally:
            self.__dict__["_compiled_layer_loop"] = loop

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(
            hidden, self.lm_head.weight, self.lm_head.bias
        ).float()  # [num_rows, vocab]


# Our parameter -> the Hugging Face tensors stacked into it (dim 0), in order.
STACKED_PARAMS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Our parameter prefix -> the Hugging Face prefix.
RENAMES = {
    "embed_tokens.": "model.embed_tokens.",
    "layers.": "model.layers.",
    "norm.": "model.norm.",
    "lm_head.": "lm_head.",
}


def _hf_parts(name: str) -> list[str]:
    """The Hugging Face tensors our parameter ``name`` is made of (stacked in that order)."""
    hf_name = next(h + name[len(o) :] for o, h in RENAMES.items() if name.startswith(o))
    for ours, theirs in STACKED_PARAMS.items():
        if ours in hf_name:
            return [hf_name.replace(ours, t) for t in theirs]
    return [hf_name]


def hf_names(model: LlamaForCausalLM) -> set[str]:
    """The Hugging Face tensors ``load_hf_state_dict`` reads for ``model``'s parameters (those a
    quantized weight replaced are no longer parameters)."""
    return {p for name, _ in model.named_parameters() for p in _hf_parts(name)}


def load_hf_state_dict(model: LlamaForCausalLM, hf: dict[str, torch.Tensor]) -> None:
    """Fill ``model`` from Hugging Face names (STACKED_PARAMS, RENAMES); every parameter must be found."""
    params = dict(
        model.named_parameters()
    )  # tied lm_head shares embed_tokens and is not listed twice
    missing = []
    with torch.no_grad():
        for name, param in params.items():
            parts = _hf_parts(name)
            if any(p not in hf for p in parts):
                missing.extend(p for p in parts if p not in hf)
                continue
            tensor = torch.cat([hf[p] for p in parts]) if len(parts) > 1 else hf[parts[0]]
            if tensor.shape != param.shape:
                raise ValueError(
                    f"weight {parts} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.copy_(tensor)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}")


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def weights_to_be_loaded() -> Iterator[None]:
    """Build a model whose every parameter ``load_hf_state_dict`` will fill (it refuses a
    checkpoint that lacks one) without drawing random initial values first: nn.Linear's and
    nn.Embedding's ``reset_parameters`` do nothing inside the block (their weights are left as
    allocated). For the default model that draw was ~1.3 s of a worker's start."""
    classes = (nn.Linear, nn.Embedding)
    with _INIT_LOCK:
        saved = [cls.__dict__["reset_parameters"] for cls in classes]
        for cls in classes:
            cls.reset_parameters = _leave_as_allocated
        try:
            yield
        finally:
            for cls, method in zip(classes, saved, strict=True):
                cls.reset_parameters = method


def _leave_as_allocated(self: nn.Module) -> None:
    pass
