"""ModelRunner: owns the model and its KV pool; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve import envs, kernels
from pdserve.config import CacheConfig, resolve_kv_cache_dtype
from pdserve.decode_graphs import DecodeGraphs
from pdserve.kv_cache.pool import KVCachePool, num_blocks_for
from pdserve.model.attention import AttentionMetadata, OutputRows
from pdserve.model.config import ModelConfig
from pdserve.model.llama import (
    LlamaForCausalLM,
    RotaryEmbedding,
    hf_names,
    load_hf_state_dict,
    weights_to_be_loaded,
)
from pdserve.model.quantize import (
    quantize_model,
    resolve_quantization,
    weight_bytes,
    weight_tiers,
)
from pdserve.model.weights import load_state_dict
from pdserve.outputs import TokenLogprobs
from pdserve.sampler import sample
from pdserve.scheduler import ScheduledBatch
from pdserve.sequence import Sequence

logger = logging.getLogger(__name__)

# on_layer(batch, layer index, k_cache, v_cache): called after each layer has written its KV.
LayerHook = Callable[[ScheduledBatch, int, torch.Tensor, torch.Tensor], None]


def load_model(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str = "none",
) -> LlamaForCausalLM:
    with weights_to_be_loaded():
        model = LlamaForCausalLM(cfg, kernels.get_backend(device), max_positions)
    # A GGUF's blocks take the projections' places before any dense weight is read, so only the
    # rest is (the default model: its norms) and the projections' dense memory is never written
    # (a start held it twice over: ~1.3 GB for a 135M model); other modes quantize what loaded.
    blocks_first = resolve_quantization(quantization, folder, dtype, device) == "gguf"
    if not blocks_first:
        load_hf_state_dict(model, load_state_dict(folder, dtype))
    model = model.to(device=device, dtype=dtype).eval()
    model.quantization = quantize_model(model, quantization, folder)  # "auto" resolved
    if blocks_first:
        load_hf_state_dict(model, load_state_dict(folder, dtype, names=hf_names(model)))
    prepack = getattr(model.ops, "prepack_linear", None)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):  # the rope tables stay fp32 (rounded at use)
            module.float()
        if (
            prepack is not None
            and isinstance(module, torch.nn.Linear)
            and isinstance(module.weight, (torch.Tensor, kernels.QuantizedWeight))
        ):
            # a backend's own weight layout, made before the first request (quantized blocks get
            # one by the model's dtype: a bf16 copy where bf16 is native, fp32's integer path's)
            prepack(module.weight, dtype)
    kernels.release_freed_heap()  # the dense copies the quantized blocks and packed layouts replaced
    return model


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the hidden states whose logits are sampled
    sampling_seqs: list[Sequence]
    rows: OutputRows  # the same rows, for the model's last layer


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A step input on ``device``. On a GPU through page-locked memory without waiting: a
    blocking copy (``torch.tensor(..., device=cuda)``) synchronises the stream, six times a step
    (the third GPU run's host profile: 0.23 ms of a batch-1 step's 0.6 ms of host work)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def _block_tables(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    width = max(len(s.block_table) for s in seqs)
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return _on(device, rows, torch.int32)


class ModelRunner:
    def __init__(
        self,
        folder: Path,
        cfg: ModelConfig,
        cache: CacheConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        quantization: str = "none",
        max_num_seqs: int = 256,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``kv_dtype``: the KV pools' (``EngineConfig.kv_torch_dtype``); None: "auto"'s for the
        loaded model (``resolve_kv_cache_dtype``)."""
        self.cfg = cfg
        self.device = device
        self.block_size = cache.block_size
        self.model = load_model(folder, cfg, dtype, device, max_model_len, quantization)
        if kv_dtype is None:
            kv_dtype = resolve_kv_cache_dtype("auto", dtype, device.type, self.model.quantization)
        self.pool = KVCachePool(
            cfg,
            num_blocks_for(cfg, cache, kv_dtype, device),
            cache.block_size,
            kv_dtype,
            device,
            resident=cache.resident,
        )
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from CUDA graphs
        graphs_ok = getattr(self.model.ops, "DECODE_GRAPHS", False)  # a backend that can
        if envs.cuda_graphs() and device.type == "cuda" and graphs_ok:
            self.graphs = DecodeGraphs(
                self.model,
                self.pool.kv_caches,
                max_num_seqs,
                -(-max_model_len // cache.block_size),
                device,
            )
            seconds = self.graphs.capture_all()
            logger.info(
                "captured CUDA graphs for decode batch sizes %s in %.1f s",
                self.graphs.buckets,
                seconds,
            )

    def weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads (each tensor once, quantized or dense)."""
        return weight_bytes(self.model)

    def weight_tiers(self) -> tuple[tuple[int, int, bool], ...]:
        """What larger steps read more (``roofline.ModelCost.weight_tiers``)."""
        return weight_tiers(self.model)

    def slot(self, seq: Sequence, position: int) -> int:
        return (
            seq.block_table[position // self.block_size] * self.block_size
            + position % self.block_size
        )

    def _decode_rows(self, seqs: list[Sequence]) -> tuple[list[int], list[int], list[int]]:
        """Token ids, positions and slots of decode sequences: each its last token."""
        positions = [seq.num_tokens - 1 for seq in seqs]
        ids = [seq.token_at(pos) for seq, pos in zip(seqs, positions, strict=True)]
        slots = [self.slot(seq, pos) for seq, pos in zip(seqs, positions, strict=True)]
        return ids, positions, slots

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        query_start = [0]
        prefill_context = []
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            ids.extend(seq.prompt_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.slot(seq, p) for p in range(start, start + n))
            query_start.append(query_start[-1] + n)
            prefill_context.append(start + n)
            if start + n == seq.num_prompt_tokens:
                sample_rows.append(len(ids) - 1)
                sampling_seqs.append(seq)
        num_prefill_tokens = len(ids)
        decode_ids, decode_positions, decode_slots = self._decode_rows(batch.decodes)
        ids.extend(decode_ids)
        positions.extend(decode_positions)
        slots.extend(decode_slots)
        sample_rows.extend(range(num_prefill_tokens, len(ids)))
        sampling_seqs.extend(batch.decodes)
        dev = self.device
        i32 = torch.int32
        prefill_seqs = [s for s, _ in batch.prefills]
        finishing = sampling_seqs[
            : len(sampling_seqs) - len(batch.decodes)
        ]  # prompts done this step
        meta = AttentionMetadata(
            slot_mapping=_on(dev, slots, torch.int64),
            num_prefill_tokens=num_prefill_tokens,
            prefill_block_tables=_block_tables(prefill_seqs, dev) if prefill_seqs else None,
            prefill_query_start_loc=_on(dev, query_start, i32) if prefill_seqs else None,
            prefill_context_lens=_on(dev, prefill_context, i32) if prefill_seqs else None,
            decode_block_tables=_block_tables(batch.decodes, dev) if batch.decodes else None,
            decode_context_lens=(
                _on(dev, [s.num_tokens for s in batch.decodes], i32) if batch.decodes else None
            ),
            prefill_max_query_len=max((n for _, n in batch.prefills), default=None),
        )
        sample_indices = _on(dev, sample_rows, torch.long)
        # the sampled rows alone: each finishing prompt's last token as a one-query prefill over
        # its whole context, then the decode tokens as they are
        rows_meta = AttentionMetadata(
            slot_mapping=sample_indices,  # unused
            num_prefill_tokens=len(finishing),
            prefill_block_tables=_block_tables(finishing, dev) if finishing else None,
            prefill_query_start_loc=(
                torch.arange(len(finishing) + 1, dtype=i32, device=dev) if finishing else None
            ),
            prefill_context_lens=(
                _on(dev, [s.num_prompt_tokens for s in finishing], i32) if finishing else None
            ),
            decode_block_tables=meta.decode_block_tables,
            decode_context_lens=meta.decode_context_lens,
            prefill_max_query_len=1 if finishing else None,
        )
        return ModelInputs(
            input_ids=_on(dev, ids, torch.long),
            positions=_on(dev, positions, torch.long),
            meta=meta,
            sample_indices=sample_indices,
            sampling_seqs=sampling_seqs,
            rows=OutputRows(sample_indices, rows_meta),
        )

    @torch.inference_mode()
    def forward_logits(
        self, inputs: ModelInputs, after_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Logits [num_sampling_seqs, vocab] fp32, on the model's device (``sample`` brings
        back from a GPU only what it must)."""
        hidden = self.model(
            inputs.input_ids,
            inputs.positions,
            self.pool.kv_caches,
            inputs.meta,
            after_layer,
            inputs.rows,
        )
        return self.model.compute_logits(hidden)

    def _graph_step(
        self, seqs: list[Sequence]
    ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]] | None:
        """A decode-only step replayed from its batch size's CUDA graph, its inputs written
        straight into the graphs' buffers (no ``prepare``); None if it cannot run so."""
        ids, positions, slots = self._decode_rows(seqs)
        hidden = self.graphs.run(
            ids, positions, slots, [s.block_table for s in seqs], [s.num_tokens for s in seqs]
        )
        if hidden is None:
            return None
        tokens, logprobs = sample(
            self.model.compute_logits(hidden), [s.sampler_row() for s in seqs]
        )
        return list(seqs), tokens, logprobs

    def run(
        self,
        batch: ScheduledBatch,
        on_layer: LayerHook | None = None,
    ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:
        """Forward the batch and sample; returns the sequences that got a token, their tokens, logprobs."""
        if self.graphs is not None and on_layer is None and batch.decodes and not batch.prefills:
            done = self._graph_step(batch.decodes)
            if done is not None:
                return done
        inputs = self.prepare(batch)
        after_layer = None
        if on_layer is not None:

            def after_layer(i: int) -> None:
                on_layer(batch, i, *self.pool.kv_caches[i])

        logits = self.forward_logits(inputs, after_layer)
        if not inputs.sampling_seqs:
            return [], [], []
        tokens, logprobs = sample(logits, [s.sampler_row() for s in inputs.sampling_seqs])
        return inputs.sampling_seqs, tokens, logprobs
