"""Our engine against Hugging Face transformers on small random-weight models of every variant,
on the CPU and (marked gpu) on CUDA, transformers running on the same device."""

from __future__ import annotations

import copy

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import CacheConfig
from tests.gpu import DEVICES

PROMPTS = [
    [1, 5, 9, 200, 33],
    [1] + list(range(40, 77)),
    [7] * 20,
    [1, 300, 301, 302, 17, 18, 19, 20, 21],
]
NEW_TOKENS = 24


def hf_greedy(model, prompt: list[int], n: int):
    """Greedy continuation and each step's log-softmax, from transformers."""
    with torch.no_grad():
        # eos_token_id=None: exactly n tokens, like ignore_eos (min_new_tokens would mask eos in the scores).
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1).cpu() for s in out.logits]
    return tokens, logprobs


def llm_and_hf(tiny_model, kind: str, dtype: str, device: str):
    """Our engine on ``device`` and the fixture's transformers model there (a copy: the
    fixture's stays on the CPU), both of the ``kind`` tiny model."""
    folder, hf = tiny_model(kind)
    llm = LLM(
        str(folder),
        dtype=dtype,
        device=device,
        cache=CacheConfig(block_size=4, kv_cache_bytes=1 << 22),
    )
    return llm, hf if device == "cpu" else copy.deepcopy(hf).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kind", ["gqa_untied", "mha_tied", "qwen2_qkv_bias", "llama_bias", "llama3_rope_scaling"]
)
def test_greedy_tokens_and_logprobs_match_transformers(tiny_model, kind, device):
    llm, hf = llm_and_hf(tiny_model, kind, "float32", device)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params)  # all prompts batched together
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.token_ids == ref_tokens
        for step, (ours, ref) in enumerate(zip(out.logprobs, ref_lps, strict=True)):
            top_ids = [t for t, _ in ours.top]
            assert top_ids == ref.topk(5).indices.tolist(), f"step {step}"
            # fp32 everywhere; only summation order differs.
            assert torch.allclose(
                torch.tensor([v for _, v in ours.top]), ref[top_ids], atol=1e-4
            ), f"step {step}"
    assert llm.engine.num_free_blocks == llm.engine.allocator.num_blocks


def test_long_context_exercises_rope_scaling(tiny_model):
    """Positions beyond original_max_position_embeddings, where llama3 scaling changes frequencies."""
    folder, hf = tiny_model("llama3_rope_scaling")
    prompt = [1] + [(i * 37) % 500 + 3 for i in range(150)]
    llm = LLM(
        str(folder), dtype="float32", cache=CacheConfig(block_size=16, kv_cache_bytes=1 << 22)
    )
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 16)[0]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_stays_close_to_fp32(tiny_model, device):
    llm, hf = llm_and_hf(tiny_model, "gqa_untied", "bfloat16", device)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    _, ref_lps = hf_greedy(hf, PROMPTS[1], 1)
    ours = dict(out.logprobs[0].top)
    ids = list(ours)
    # bf16 keeps 8 mantissa bits: logprobs within a few hundredths of fp32's.
    assert torch.allclose(torch.tensor([ours[i] for i in ids]), ref_lps[0][ids], atol=0.1)


def test_prompts_sharing_a_prefix_sent_together_compute_it_once(tiny_model):
    """The first computes the shared prefix; the others wait for it, reuse its blocks and still
    decode exactly what transformers does."""
    llm, hf = llm_and_hf(tiny_model, "gqa_untied", "float32", "cpu")
    shared = [1] + list(range(40, 77))  # 38 tokens: 9 full blocks of 4
    prompts = [shared + [300 + i, 17, 18 + i] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens, cached = [[] for _ in prompts], [0] * len(prompts)
    for i, out in llm.generate_stream(prompts, params):
        tokens[i] += out.new_token_ids
        cached[i] = max(cached[i], out.num_cached_tokens)
    assert cached == [0, 36, 36]
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == hf_greedy(hf, prompt, 8)[0]
    assert llm.engine.num_free_blocks == llm.engine.allocator.num_blocks
