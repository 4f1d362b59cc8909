"""The model's last layer computes only the sampled rows (``OutputRows``): every step of a mixed,
chunked workload gives the logits that computing every row and then picking the sampled ones
gives. With the CPU backend's native kernels the arithmetic per row is the same (the GEMMs and
norms work row by row, a prefill row attends as one query with the same chunks), so they must be
equal bit for bit; torch's fallbacks may pick other kernels for other shapes: close there."""

from __future__ import annotations

import itertools
import random

import torch
from pdserve.kernels.cpu import gemm, ops

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.llm import LLM
from pdserve.runner import ModelRunner
from pdserve.sampling_params import SamplingParams


def test_sampled_rows_only_equal_every_row(default_model_dir, monkeypatch):
    llm = LLM(
        str(default_model_dir),
        dtype="bfloat16",
        device="cpu",
        threads=2,
        cache=CacheConfig(block_size=16, kv_cache_bytes=16 << 20),
        # the steps this workload is built to give (a chunk left unfinished, a step without a
        # sampled row) are those of arrival order
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=40, prompt_order="arrival"
        ),
    )
    engine = llm.engine
    model = engine.runner.model
    seen = {"steps": 0, "mixed": 0, "unfinished_chunk": 0, "no_rows": 0}
    pruned = ModelRunner.forward_logits
    native = gemm._packing() is not None and ops.attention_bf16_native()

    def checked(self, inputs, after_layer=None):
        logits = pruned(self, inputs, after_layer)
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, self.pool.kv_caches, inputs.meta)
            every = model.compute_logits(hidden[inputs.sample_indices]).cpu()
        assert logits.shape == every.shape == (len(inputs.sampling_seqs), model.config.vocab_size)
        if native:
            assert torch.equal(logits, every)
        else:
            torch.testing.assert_close(logits, every, rtol=0.02, atol=0.05)
        meta = inputs.meta
        for m in (meta, inputs.rows.meta):  # the bound a GPU kernel's grid is sized by, on the host
            if m.num_prefill_tokens:
                starts = m.prefill_query_start_loc.tolist()
                assert m.prefill_max_query_len == max(b - a for a, b in itertools.pairwise(starts))
            else:
                assert m.prefill_max_query_len is None
        seen["steps"] += 1
        seen["mixed"] += bool(meta.num_prefill_tokens and meta.decode_block_tables is not None)
        seen["unfinished_chunk"] += inputs.rows.meta.num_prefill_tokens < (
            0 if meta.prefill_context_lens is None else meta.prefill_context_lens.numel()
        )
        seen["no_rows"] += not inputs.sampling_seqs
        return logits

    monkeypatch.setattr(ModelRunner, "forward_logits", checked)
    rng = random.Random(3)
    for i in range(6):  # the first longer than two steps' token budget; on and off block boundaries
        engine.add_request(
            [rng.randrange(3, 49000) for _ in range(16 + 13 * (5 - i))],
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        )
    while engine.has_unfinished_requests():
        engine.step()
    assert seen["mixed"] and seen["unfinished_chunk"] and seen["no_rows"], seen
    assert engine.num_free_blocks == engine.runner.pool.num_blocks
