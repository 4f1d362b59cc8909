"""A KV cache dtype of its own (``--kv-cache-dtype``, ``CacheConfig.kv_cache_dtype``): "auto" is
the activation dtype, except bf16 under an fp32 model with quantized projections on the CPU;
"bfloat16" under an fp32 model on the CPU allocates bf16 pools
(twice the blocks for the same bytes, half the KV bytes a step reads) and its greedy output stays
the fp32 cache's on the default model. Mixes no kernel takes are refused up front. Over UCX
between real processes: tests/e2e/test_kv_cache_dtype_ucx.py."""

from __future__ import annotations

import pytest
import torch
from pdserve.services.main import kv_layout

from pdserve import LLM, SamplingParams
from pdserve.cli import build_parser
from pdserve.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    resolve_kv_cache_dtype,
)
from pdserve.kv_cache.pool import bytes_per_block
from pdserve.model.fetch import DEFAULT_MODEL
from pdserve.roofline import MachineRates, for_engine
from pdserve.transfer import HeaderMismatchError
from pdserve.transfer.header import pack_address, unpack_address
from tests.engine.test_default_model import QUESTIONS

F32, BF16 = torch.float32, torch.bfloat16
KV_BYTES = 1 << 20
RATES = MachineRates(bandwidth=1e10, gemm_flops=1e11)


@pytest.mark.parametrize("name", ["float16", "int8", "", "BF16", "fp8"])
def test_a_kv_cache_dtype_outside_the_choices_is_refused_saying_what_is_allowed(name):
    with pytest.raises(ValueError) as err:
        CacheConfig(kv_cache_dtype=name)
    assert f"kv_cache_dtype {name!r} is not supported" in str(err.value)
    assert "use one of: auto, bfloat16, float32 (or bf16, fp32)" in str(err.value)
    with pytest.raises(SystemExit):  # argparse: invalid choice (it lists the choices)
        build_parser().parse_args(["decode", "--kv-cache-dtype", name or "x"])


def test_auto_is_the_activation_dtype_and_bf16_goes_under_fp32_on_the_cpu_only():
    for dtype in (F32, BF16):
        for device in ("cpu", "cuda", "cuda:1"):
            assert resolve_kv_cache_dtype("auto", dtype, device) == dtype
            assert resolve_kv_cache_dtype("auto", dtype, device, "none") == dtype
    # quantized projections under fp32 activations on the CPU (no native bf16): a bf16 cache
    for quantization in ("gguf", "int8", "q4_1"):
        assert resolve_kv_cache_dtype("auto", F32, "cpu", quantization) == BF16
        assert resolve_kv_cache_dtype("auto", BF16, "cpu", quantization) == BF16
    assert resolve_kv_cache_dtype("float32", F32, "cpu", "gguf") == F32  # asked for: kept
    for name in ("bfloat16", "bf16"):
        assert resolve_kv_cache_dtype(name, F32, "cpu") == BF16
        assert resolve_kv_cache_dtype(name, BF16, "cuda") == BF16  # the same dtype: fine anywhere
    for name in ("float32", "fp32"):
        assert resolve_kv_cache_dtype(name, F32, "cpu") == F32
    with pytest.raises(ValueError, match="a float32 KV cache with bfloat16 activations is not"):
        resolve_kv_cache_dtype("float32", BF16, "cpu")
    with pytest.raises(
        ValueError, match="bfloat16 KV cache with float32 activations is not .* cuda"
    ):
        resolve_kv_cache_dtype("bfloat16", F32, "cuda")
    # refused when the config is made, before any model or device is touched
    with pytest.raises(ValueError, match="on cuda:0: on CUDA the KV cache has the activation"):
        EngineConfig(
            "m", dtype="float32", device="cuda:0", cache=CacheConfig(kv_cache_dtype="bf16")
        )
    cfg = EngineConfig("m", dtype="float32", cache=CacheConfig(kv_cache_dtype="bfloat16"))
    assert (cfg.torch_dtype, cfg.kv_torch_dtype) == (F32, BF16)
    assert EngineConfig("m", dtype="float32").kv_torch_dtype is None  # auto: once weights load


@pytest.mark.parametrize("argv", [["prefill"], ["up"], ["bench", "offline"], ["generate", "hi"]])
def test_every_engine_command_takes_the_kv_cache_dtype(argv):
    args = build_parser().parse_args([*argv, "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
    assert build_parser().parse_args(argv).kv_cache_dtype == CacheConfig.kv_cache_dtype == "auto"


def test_an_llm_kwarg_disagreeing_with_the_cache_config_is_refused(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    with pytest.raises(ValueError, match="disagree"):
        LLM(str(folder), cache=CacheConfig(kv_cache_dtype="float32"), kv_cache_dtype="bfloat16")
    cache = CacheConfig(kv_cache_bytes=KV_BYTES, kv_cache_dtype="bf16")  # an alias agrees
    llm = LLM(str(folder), dtype="float32", threads=1, cache=cache, kv_cache_dtype="bfloat16")
    assert llm.engine.kv_dtype == BF16


@pytest.fixture(scope="module")
def tiny_engines(tiny_model):
    """The tiny fp32 model with its KV cache in fp32 ("auto") and in bf16, the same budget."""
    folder, _ = tiny_model("gqa_untied")

    def make(kv: str) -> LLM:
        cache = CacheConfig(block_size=16, kv_cache_bytes=KV_BYTES, kv_cache_dtype=kv)
        return LLM(str(folder), dtype="float32", threads=1, cache=cache)

    return make("auto"), make("bfloat16")


def test_bf16_pools_under_an_fp32_model_hold_twice_the_blocks_for_the_same_bytes(tiny_engines):
    auto, bf16 = (llm.engine for llm in tiny_engines)
    cfg = auto.model_config
    assert auto.dtype == bf16.dtype == F32  # the activations stay fp32
    assert (auto.kv_dtype, bf16.kv_dtype) == (F32, BF16)
    assert next(bf16.runner.model.parameters()).dtype == F32
    for engine, dtype in ((auto, F32), (bf16, BF16)):
        assert engine.runner.pool.dtype == dtype
        assert all(k.dtype == v.dtype == dtype for k, v in engine.runner.pool.kv_caches)
        assert engine.allocator.num_blocks == KV_BYTES // bytes_per_block(cfg, 16, dtype)
    assert bytes_per_block(cfg, 16, BF16) * 2 == bytes_per_block(cfg, 16, F32)
    assert bf16.allocator.num_blocks == 2 * auto.allocator.num_blocks
    # what is sized from the pools follows them: the roofline's KV bytes, the transfer layout
    assert for_engine(bf16, RATES).cost.kv_bytes_per_token * 2 == (
        for_engine(auto, RATES).cost.kv_bytes_per_token
    )
    layouts = kv_layout(auto, "tiny"), kv_layout(bf16, "tiny")
    assert (layouts[0].dtype, layouts[1].dtype) == (F32, BF16)
    assert layouts[1].block_nbytes() * 2 == layouts[0].block_nbytes()
    assert layouts[0].compat_hash != layouts[1].compat_hash


def test_tiny_model_with_bf16_kv_reuses_prefixes_and_frees_every_block(tiny_engines):
    auto, bf16 = tiny_engines
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1] + list(range(40, 80)), [1] + list(range(40, 72)) + [9, 9, 9]]  # 2 blocks shared
    want = [o.token_ids for o in auto.generate(prompts, params)]
    engine = bf16.engine
    # random weights with peaky logits: greedy far from ties, bf16 K/V do not change a token
    assert bf16.generate(prompts[:1], params)[0].token_ids == want[0]
    assert engine.num_free_blocks == engine.allocator.num_blocks  # nothing leaked
    second = engine.add_request(prompts[1], params)
    cached, tokens = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == second:
                cached.append(o.num_cached_tokens)
                tokens += o.new_token_ids
    assert max(cached) == 32  # the 2 blocks it shares with the first prompt: from the cache
    assert tokens == want[1]  # and decoded over them as over its own
    assert engine.num_free_blocks == engine.allocator.num_blocks


def test_workers_with_other_kv_cache_dtypes_cannot_reach_each_other(tiny_engines):
    """The decode worker's published address carries its layout hash: a prefill worker whose
    pools are of another dtype refuses to connect, naming the option."""
    f32, bf16 = (kv_layout(llm.engine, "tiny") for llm in tiny_engines)
    assert unpack_address(pack_address(bf16, b"ucx"), bf16) == b"ucx"
    with pytest.raises(HeaderMismatchError, match=r"KV float32 .*--kv-cache-dtype"):
        unpack_address(pack_address(bf16, b"ucx"), f32)


# The default model, dense fp32, on the suite's 8 chat prompts: bf16 K/V against fp32 K/V.
# Measured here (AVX-512 without BF16, 2 cores, 64 tokens each): all 8 greedy continuations
# identical; |delta logprob| of the chosen token 0.8e-3 to 1.8e-2 on the first token (mean
# 7.2e-3), at most 4.0e-2 (mean 3.2e-3) over the 512 tokens. A KV written or read wrong is off
# by nats, and an fp32 cache mistaken for bf16 by exactly 0. On a Zen 4 (2026-11-30) one
# continuation parts at its second token, a near tie: fp32 KV -1.8995 / -1.9094 for its two
# best tokens (0.0099 apart), bf16 KV the same two swapped (0.0069 apart). So a continuation may
# part where the fp32 run's two best tokens are within TIE_BOUND and the bf16 run took the other.
NEW_TOKENS = 24
FIRST_TOKEN_BOUND = 0.06  # 3x the largest first-token difference seen
ANY_TOKEN_BOUND = 0.12  # 3x the largest difference seen on any token
TIE_BOUND = 0.03  # 3x the near tie seen


@pytest.fixture(scope="module")
def default_model_outputs(default_model_dir):
    """Greedy outputs with top-1 logprobs of the default model in fp32, per KV cache dtype."""
    outs = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(
            DEFAULT_MODEL,
            dtype="float32",
            quantization="none",
            threads=2,
            cache=CacheConfig(kv_cache_bytes=64 << 20),
            scheduler=SchedulerConfig(max_num_seqs=8),
            kv_cache_dtype=kv,
        )
        prompts = [llm.chat_prompt(q) for q in QUESTIONS]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
        engine = llm.engine
        outs[kv] = (llm.generate(prompts, params), engine.runner.pool.dtype)
        assert engine.num_free_blocks == engine.allocator.num_blocks  # no block leaked
        del llm
    return outs


def test_default_model_greedy_tokens_with_bf16_kv_equal_fp32_kv(default_model_outputs):
    f32, f32_pool = default_model_outputs["auto"]
    bf16, bf16_pool = default_model_outputs["bfloat16"]
    assert (f32_pool, bf16_pool) == (F32, BF16)
    first, every, parted = [], [], 0
    for a, b in zip(f32, bf16, strict=True):
        same = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
            NEW_TOKENS,
        )
        if same < NEW_TOKENS:  # only at a near tie of the fp32 run's two best tokens
            parted += 1
            top = dict(a.logprobs[same].top)
            theirs = b.token_ids[same]
            assert theirs in top, (a.text, b.text)
            assert a.logprobs[same].logprob - top[theirs] < TIE_BOUND, (a.text, b.text)
        diffs = [
            abs(x.logprob - y.logprob)
            for x, y in zip(a.logprobs[:same], b.logprobs[:same], strict=True)
        ]
        first.append(abs(a.logprobs[0].logprob - b.logprobs[0].logprob))
        every += diffs
    print(
        f"bf16 vs fp32 KV, {len(f32)} prompts x {NEW_TOKENS} tokens: {len(f32) - parted} "
        f"identical, {parted} parted at a near tie; |dlogprob| first token max {max(first):.2e} "
        f"mean {sum(first) / len(first):.2e}, every token before a parting max "
        f"{max(every):.2e} mean {sum(every) / len(every):.2e}"
    )
    assert parted <= len(f32) // 4
    assert max(first) < FIRST_TOKEN_BOUND
    assert max(every) < ANY_TOKEN_BOUND
    assert max(every) > 0  # the bf16 rounding is there: the pools really are bf16


def test_the_default_model_keeps_a_bf16_kv_cache_by_default(default_model_dir):
    """With every default (fp32 and its GGUF blocks where the CPU lacks native bf16, bf16
    activations where it has them), the KV cache is bf16 on every CPU."""
    llm = LLM(DEFAULT_MODEL, threads=1, cache=CacheConfig(kv_cache_bytes=8 << 20))
    engine = llm.engine
    assert engine.kv_dtype == engine.runner.pool.dtype == BF16
    assert engine.dtype == BF16 or engine.runner.model.quantization != "none"
