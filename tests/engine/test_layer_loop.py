"""The CPU backend's flat layer loop (kernels/cpu/layer_loop.py) against the module path: the
same kernels with the same arguments, so the logits must be equal bit for bit, in decode, prefill
and mixed steps; its after_layer callback; its refusals. bf16 models need AVX512-BF16; fp32 models
with quantized projections (decode steps only) run on any CPU with a C compiler."""

from __future__ import annotations

import random

import pytest
import torch
from pdserve.kernels.cpu import compile_layer_loop, gemm, ops, quant
from pdserve.kernels.cpu.layer_loop import LayerLoop

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.llm import LLM
from pdserve.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import ScheduledBatch

needs_bf16 = pytest.mark.skipif(
    gemm._packing() is None or not ops.attention_bf16_native(),
    reason="the bf16 layer loop needs AVX512-BF16 (packed linear, native attention)",
)
needs_quant = pytest.mark.skipif(not quant.available(), reason="quant.c could not be built")


def decoding_engine(
    model: str,
    num_seqs: int,
    prompt_len: int,
    vocab: int,
    dtype: str = "bfloat16",
    quantization: str = "none",
):
    """An engine whose ``num_seqs`` sequences have all been prefilled and decode."""
    llm = LLM(
        model,
        dtype=dtype,
        quantization=quantization,
        threads=2,
        cache=CacheConfig(block_size=16, kv_cache_bytes=64 << 20),
    )
    engine = llm.engine
    rng = random.Random(num_seqs)
    for i in range(num_seqs):  # ragged contexts: on and off block boundaries
        engine.add_request(
            [rng.randrange(3, vocab) for _ in range(prompt_len + 5 * i)],
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        )
    for _ in range(3):
        engine.step()
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    return engine


def both_paths(engine) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the running sequences' next decode step, through the loop, then the module path
    (the step writes the same K/V into the same slots both times)."""
    runner = engine.runner
    model = runner.model
    assert model._layer_loop() is not None, "the loop should cover this model"
    inputs = runner.prepare(ScheduledBatch(decodes=list(engine.scheduler.running)))
    with_loop = runner.forward_logits(inputs)
    with model.module_path():
        without = runner.forward_logits(inputs)
    return with_loop, without


def small_model_head_dim_64(path, bias: bool):
    """A random 2-layer Qwen2 (qkv bias) or Llama (no bias) with head_dim 64, as the loop needs."""
    import transformers

    kind = transformers.Qwen2Config if bias else transformers.LlamaConfig
    cfg = kind(
        vocab_size=300,
        hidden_size=256,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@needs_bf16
def test_default_model_loop_equals_module_path(default_model_dir):
    engine = decoding_engine(str(default_model_dir), num_seqs=7, prompt_len=30, vocab=49152)
    with_loop, without = both_paths(engine)
    assert with_loop.shape == (7, 49152)
    assert torch.equal(with_loop, without)
    # and the engine's own steps (through the loop) keep every block accounted for
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == engine.runner.pool.num_blocks


@needs_bf16
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_small_models_loop_equals_module_path(tmp_path, bias):
    engine = decoding_engine(
        small_model_head_dim_64(tmp_path, bias), num_seqs=5, prompt_len=17, vocab=300
    )
    with_loop, without = both_paths(engine)
    assert torch.equal(with_loop, without)


@needs_bf16
def test_in_place_weight_change_is_followed(tmp_path):
    engine = decoding_engine(
        small_model_head_dim_64(tmp_path, True), num_seqs=3, prompt_len=20, vocab=300
    )
    before, _ = both_paths(engine)
    model = engine.runner.model
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(3)
        model.layers[0].self_attn.qkv_proj.bias.add_(0.5)
    after, module_path = both_paths(engine)
    assert torch.equal(after, module_path)
    assert not torch.equal(after, before)


@needs_bf16
def test_bad_block_ids_are_refused_without_a_crash(tmp_path):
    engine = decoding_engine(
        small_model_head_dim_64(tmp_path, False), num_seqs=2, prompt_len=20, vocab=300
    )
    runner = engine.runner
    inputs = runner.prepare(ScheduledBatch(decodes=list(engine.scheduler.running)))
    inputs.meta.decode_block_tables[1, 0] = runner.pool.num_blocks + 5
    with pytest.raises(ValueError, match="block ids outside"):
        runner.forward_logits(inputs)


def test_fp32_model_is_not_covered(tmp_path):
    llm = LLM(
        small_model_head_dim_64(tmp_path, False),
        dtype="float32",
        cache=CacheConfig(block_size=16, kv_cache_bytes=16 << 20),
    )
    assert compile_layer_loop(llm.engine.runner.model) is None


@needs_bf16
def test_every_kind_of_step_equals_module_path(default_model_dir, monkeypatch):
    """A chunked, continuously batched workload: prefill-only, mixed and decode steps, each step's
    logits through the loop and through the module path."""
    llm = LLM(
        str(default_model_dir),
        dtype="bfloat16",
        threads=2,
        cache=CacheConfig(block_size=16, kv_cache_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48),
    )
    engine = llm.engine
    model = engine.runner.model
    kinds = set()
    through_loop = ModelRunner.forward_logits

    def both(self, inputs, after_layer=None):
        logits = through_loop(self, inputs, after_layer)
        with model.module_path():
            assert torch.equal(logits, through_loop(self, inputs, after_layer))
        kinds.add((inputs.meta.num_prefill_tokens > 0, inputs.meta.decode_block_tables is not None))
        return logits

    monkeypatch.setattr(ModelRunner, "forward_logits", both)
    rng = random.Random(5)
    for i in range(5):
        engine.add_request(
            [rng.randrange(3, 49000) for _ in range(70 - 11 * i)],
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        )
    while engine.has_unfinished_requests():
        engine.step()
    assert kinds == {(True, False), (True, True), (False, True)}
    assert engine.num_free_blocks == engine.runner.pool.num_blocks


def first_prefill(tmp_path):
    """A small model's engine with one 37-token prompt, and the batch that prefills it."""
    llm = LLM(
        small_model_head_dim_64(tmp_path, False),
        dtype="bfloat16",
        threads=2,
        cache=CacheConfig(block_size=16, kv_cache_bytes=16 << 20),
    )
    llm.engine.add_request(
        list(range(3, 40)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    )
    return llm.engine.runner, llm.engine.scheduler.schedule()


@needs_bf16
def test_after_layer_is_called_back_per_layer_and_its_error_stops_the_loop(tmp_path):
    runner, batch = first_prefill(tmp_path)
    assert batch.prefills and runner.model._layer_loop() is not None
    calls = []
    runner.run(batch, on_layer=lambda b, i, k, v: calls.append(i))
    assert calls == [
        0,
        1,
    ]  # the last layer (pruned to the sampled row) runs in Python after the loop

    class Stop(Exception):
        pass

    def stop_at_0(b, i, k, v):
        calls.append(i)
        raise Stop("transfer failed")

    calls.clear()
    with pytest.raises(Stop, match="transfer failed"):
        runner.run(batch, on_layer=stop_at_0)
    assert calls == [0]


@needs_bf16
def test_bad_prefill_block_ids_are_refused_without_a_crash(tmp_path):
    runner, batch = first_prefill(tmp_path)
    inputs = runner.prepare(batch)
    inputs.meta.prefill_block_tables[0, 1] = -3
    with pytest.raises(ValueError, match="prefill_attention: 1 sequences"):
        runner.forward_logits(inputs)


@needs_quant
@pytest.mark.parametrize(
    "which,quantization,kv",
    [("default", "gguf", "auto"), ("llama", "int8", "float32"), ("qwen2-bias", "q4_1", "auto")],
)
def test_quantized_fp32_decode_steps_run_the_loop_bit_for_bit(
    default_model_dir, tmp_path, monkeypatch, which, quantization, kv
):
    """An fp32 model with quantized projections (AVX2 machines' fast path): a continuously
    batched workload's decode steps go through the loop with the module path's logits bit for
    bit; steps with prefill tokens take the module path (fp32 prefill attention is torch's).
    Over bf16 KV pools (``auto`` for such a model) and fp32 ones."""
    model = (
        str(default_model_dir)
        if which == "default"
        else small_model_head_dim_64(tmp_path, which == "qwen2-bias")
    )
    llm = LLM(
        model,
        dtype="float32",
        quantization=quantization,
        threads=2,
        cache=CacheConfig(block_size=16, kv_cache_bytes=64 << 20, kv_cache_dtype=kv),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48),
    )
    engine = llm.engine
    assert engine.kv_dtype == (torch.float32 if kv == "float32" else torch.bfloat16)
    model = engine.runner.model
    loop = model._layer_loop()
    assert loop is not None and loop.decode_only
    loop_steps, decode_only, kinds = [], [], set()
    through_loop, loop_call = ModelRunner.forward_logits, LayerLoop.__call__

    def counted(self, input_ids, *args, **kwargs):
        loop_steps.append(input_ids.shape[0])
        return loop_call(self, input_ids, *args, **kwargs)

    def both(self, inputs, after_layer=None):
        logits = through_loop(self, inputs, after_layer)
        with model.module_path():
            assert torch.equal(logits, through_loop(self, inputs, after_layer))
        kinds.add((inputs.meta.num_prefill_tokens > 0, inputs.meta.decode_block_tables is not None))
        if not inputs.meta.num_prefill_tokens:
            decode_only.append(inputs.input_ids.shape[0])
        return logits

    monkeypatch.setattr(LayerLoop, "__call__", counted)
    monkeypatch.setattr(ModelRunner, "forward_logits", both)
    vocab = model.config.vocab_size
    rng = random.Random(7)
    for i in range(5):
        engine.add_request(
            [rng.randrange(3, vocab) for _ in range(70 - 11 * i)],
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        )
    while engine.has_unfinished_requests():
        engine.step()
    assert kinds == {(True, False), (True, True), (False, True)}
    # each decode-only step ran the loop (once with it, once without: the module path's call)
    assert loop_steps == decode_only
    assert engine.num_free_blocks == engine.runner.pool.num_blocks
