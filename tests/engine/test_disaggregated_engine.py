"""Prefill in one engine, ship each layer's KV blocks, decode in another: same tokens as one engine."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import AdmissionError, LLMEngine
from pdserve.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 200, 33, 7, 8, 9, 10], [1] + list(range(40, 77)), [7] * 20]


def engine(folder, kv_bytes=1 << 22, block_size=4):
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            cache=CacheConfig(block_size=block_size, kv_cache_bytes=kv_bytes),
        )
    )


def run_all(e: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_layerwise_shipped_kv_decodes_like_one_engine(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    whole = engine(folder)
    for i, p in enumerate(PROMPTS):
        whole.add_request(p, params, request_id=str(i))
    expected = run_all(whole)

    prefill, decode = engine(folder), engine(folder)
    destinations = {
        str(i): decode.reserve_request(p, params, str(i)) for i, p in enumerate(PROMPTS)
    }
    shipped: dict[str, dict[int, tuple]] = {rid: {} for rid in destinations}

    def on_layer(batch, layer, k_cache, v_cache):
        # What the prefill worker sends: for each prompt completed by this forward, its blocks of this layer.
        for seq, n in batch.prefills:
            if seq.num_computed_tokens + n == seq.num_prompt_tokens:
                ids = torch.tensor(seq.block_table[: len(destinations[seq.request_id])])
                shipped[seq.request_id][layer] = (
                    k_cache.index_select(0, ids),
                    v_cache.index_select(0, ids),
                )

    first = {}
    for i, p in enumerate(PROMPTS):
        prefill.add_request(p, SamplingParams(max_tokens=1, temperature=0), request_id=str(i))
    while prefill.has_unfinished_requests():
        for o in prefill.step(on_layer=on_layer):
            first[o.request_id] = o.new_token_ids[0]
    assert (
        prefill.num_free_blocks == prefill.allocator.num_blocks
    )  # prefill frees right after shipping

    got: dict[str, list[int]] = {}
    for rid, layers in shipped.items():
        assert sorted(layers) == list(range(decode.model_config.num_layers))
        ids = torch.tensor(destinations[rid])
        for layer, (k, v) in layers.items():
            k_cache, v_cache = decode.runner.pool.kv_caches[layer]
            k_cache.index_copy_(0, ids, k)
            v_cache.index_copy_(0, ids, v)
        got[rid] = decode.activate_request(rid, first[rid]).new_token_ids
    for rid, toks in run_all(decode).items():
        got[rid] += toks
    assert got == expected
    assert decode.num_free_blocks == decode.allocator.num_blocks


def test_decode_admission_refuses_at_once_when_full_and_frees_on_abort(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    from pdserve.kv_cache.pool import bytes_per_block
    from pdserve.model.config import ModelConfig

    cfg = ModelConfig.from_file(folder / "config.json")
    e = engine(folder, kv_bytes=6 * bytes_per_block(cfg, 4, torch.float32))  # 6 blocks of 4 tokens
    params = SamplingParams(max_tokens=8, temperature=0)
    blocks = e.reserve_request(
        list(range(1, 10)), params, "a"
    )  # 9 + 7 = 16 tokens: 4 blocks, prompt 3
    assert len(blocks) == 3 and e.num_free_blocks == 2
    with pytest.raises(AdmissionError, match="decode worker full: 2 KV blocks free"):
        e.reserve_request(list(range(1, 10)), params, "b")
    e.abort_request("a")
    assert e.num_free_blocks == 6
    e.reserve_request(list(range(1, 10)), params, "b")  # now it fits
    e.abort_request("b")
    assert e.num_free_blocks == 6
