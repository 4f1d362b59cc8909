"""The default model on quantized weights (``--quantization``).

- ``gguf``: its own Q4_1 blocks (and the Q8_0 tied embedding / lm_head), through quant.c, give
  the same greedy tokens as the dense fp32 path, whose weights are the same file dequantized.
- ``int8`` (per output channel, at load): each projection's error against the dense fp32 layer
  and the first token's logprob against the dense model, printed and held under bounds.
- The layer loop (AVX512-BF16 machines) runs quantized projections bit for bit as the module path.
"""

from __future__ import annotations

import pytest
import torch
from pdserve.kernels import QuantizedWeight
from pdserve.kernels.cpu import gemm, ops, quant

from pdserve import LLM, SamplingParams
from pdserve.config import CacheConfig
from pdserve.model.fetch import DEFAULT_MODEL
from pdserve.scheduler import ScheduledBatch
from tests.engine.test_default_model import NEW_TOKENS, QUESTIONS  # the suite's prompts

# int8 bounds, measured on the default model (see test output): relative L2 error of each
# projection's output on real hidden states, and |first-token logprob difference| in nats.
# Measured (2026-11-25): worst projection 0.0118, first-token |diff| max 0.205 (mean 0.058) nats.
INT8_MAX_LAYER_ERROR = 0.03
INT8_MAX_LOGPROB_DIFF = 0.3


def make_llm(quantization: str, dtype: str = "float32") -> LLM:
    """The default model; an fp32 one keeps an fp32 KV cache (auto's is bf16 under quantized
    weights), so that comparisons with the dense model measure the weights alone."""
    kv = "float32" if dtype == "float32" else "auto"
    return LLM(
        DEFAULT_MODEL,
        dtype=dtype,
        quantization=quantization,
        threads=2,
        cache=CacheConfig(kv_cache_bytes=128 << 20, kv_cache_dtype=kv),
    )


@pytest.fixture(scope="module")
def dense():
    return make_llm("none")


def greedy(llm: LLM, logprobs: int | None = None, max_tokens: int = NEW_TOKENS):
    prompts = [llm.chat_prompt(q) for q in QUESTIONS]
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs
    )
    return llm.generate(prompts, params)


def projections(llm: LLM):
    model = llm.engine.runner.model
    for i, layer in enumerate(model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            yield f"{i}.{name}", layer.get_submodule(name)
    yield "lm_head", model.lm_head


def dequantized_in_place(llm: LLM) -> LLM:
    """``llm`` (on ``gguf`` weights) turned into the dense fp32 model of exactly those weights:
    each QuantizedWeight replaced by its fp32 dequantization, the tied embedding by a dense one.
    (The converted folder holds the same file's weights rounded to bf16: not the same model.)"""
    model = llm.engine.runner.model
    with torch.no_grad():
        for _, lin in projections(llm):
            dense_weight = torch.nn.Parameter(lin.weight.dequantize(), requires_grad=False)
            del lin.weight
            lin.weight = dense_weight
        embed = torch.nn.Embedding(*model.lm_head.weight.shape)
        embed.weight = model.lm_head.weight
        model.embed_tokens = embed
    model.__dict__.pop("_compiled_layer_loop", None)
    return llm


def test_native_q4_1_greedy_equals_dequantized_fp32(dense):
    native = make_llm("gguf")
    held = {type(lin.weight).__name__ for _, lin in projections(native)}
    assert held == {"QuantizedWeight"}
    qtypes = {lin.weight.name for _, lin in projections(native)}
    assert qtypes == {"q4_1", "q8_0"}  # the file's own: Q4_1 layers, Q8_0 tied embedding
    # the integer path's copies are made at load, not in the first request's steps
    width = quant.library().pdserve_qv_available() if quant.available() else 0
    made = {name for name, lin in projections(native) if id(lin.weight) in quant._integer}
    want = {
        name
        for name, lin in projections(native)
        if width == 512 or (width and lin.weight.name == "q4_1")
    }
    assert made == want
    runner = native.engine.runner
    assert runner.weight_bytes() < dense.engine.runner.weight_bytes() / 5
    ours = greedy(native)
    theirs = greedy(dequantized_in_place(make_llm("gguf")))
    for q, a, b in zip(QUESTIONS, ours, theirs, strict=True):
        assert a.token_ids == b.token_ids, q
    assert "Paris" in ours[0].text


def test_native_weights_are_the_converted_weights(dense):
    """The blocks read from the GGUF, dequantized and rounded to bf16, are exactly the converted
    folder's weights (which the conversion stored as bf16): names and q/k row order agree."""
    native = make_llm("gguf")
    dense_lin = dict(projections(dense))
    for name, lin in projections(native):
        want = dense_lin[name].weight
        assert torch.equal(lin.weight.dequantize().bfloat16().float(), want), name


def test_a_gguf_model_reads_only_what_its_blocks_do_not_replace(dense, monkeypatch):
    """The GGUF's blocks take the projections' places before the dense folder is read, so the
    folder gives only the rest (the default model: its 61 norms), and those equal the dense's."""
    from pdserve import runner

    asked = []
    real = runner.load_state_dict

    def spy(folder, dtype, names=None):
        asked.append(names)
        return real(folder, dtype, names=names)

    monkeypatch.setattr(runner, "load_state_dict", spy)
    native = make_llm("gguf")
    (names,) = asked
    assert names is not None and len(names) == 61
    assert all(n.endswith("norm.weight") for n in names)
    theirs = dict(dense.engine.runner.model.named_parameters())
    for name, param in native.engine.runner.model.named_parameters():
        assert torch.equal(param, theirs[name]), name


def test_int8_error_bounds(dense):
    """Per-layer output error on the model's own hidden states, and the first token's logprob
    difference against the unquantized model, for the suite's prompts."""
    q8 = make_llm("int8")
    dense_lin = dict(projections(dense))
    # real activations: the inputs every projection sees on the prompts (module path hooks)
    seen: dict[str, torch.Tensor] = {}
    model = dense.engine.runner.model
    orig = model.ops.linear

    def record(x, weight, bias=None):
        for name, lin in dense_lin.items():
            if lin.weight is weight and name not in seen:
                seen[name] = x.detach().clone()
        return orig(x, weight, bias)

    orig_rows = model.ops.linear_rows  # the projections' entry point (a step's prompt rows first)
    model.ops.linear = record
    model.ops.linear_rows = lambda x, weight, bias, prompt_rows: record(x, weight, bias)
    try:
        with model.module_path():
            dense.generate(
                [dense.chat_prompt(q) for q in QUESTIONS[:2]], SamplingParams(max_tokens=1)
            )
    finally:
        model.ops.linear, model.ops.linear_rows = orig, orig_rows
    worst = 0.0
    for name, lin in projections(q8):
        assert isinstance(lin.weight, QuantizedWeight) and lin.weight.name == "int8"
        with torch.inference_mode():
            x = seen[name].double()
            ref = x @ dense_lin[name].weight.double().T
            err = float((ops_linear(x.float(), lin.weight).double() - ref).norm() / ref.norm())
        worst = max(worst, err)
        assert err < INT8_MAX_LAYER_ERROR, (name, err)
    ours, theirs = greedy(q8, logprobs=1, max_tokens=1), greedy(dense, logprobs=1, max_tokens=1)
    diffs = []
    for a, b in zip(ours, theirs, strict=True):
        # the dense model's first token, and its logprob under int8 (which picks it too)
        assert a.token_ids[0] == b.token_ids[0], "int8 changed a first token"
        diffs.append(abs(a.logprobs[0].logprob - b.logprobs[0].logprob))
    print(
        f"\nint8 vs fp32: worst projection output error {worst:.4f} (relative L2); first-token "
        f"logprob |diff| max {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f} nats"
    )
    assert max(diffs) < INT8_MAX_LOGPROB_DIFF


def ops_linear(x, weight):
    from pdserve.kernels import cpu

    return cpu.linear(x, weight)


@pytest.mark.skipif(
    gemm._packing() is None or not ops.attention_bf16_native(),
    reason="the layer loop needs AVX512-BF16; the module path runs",
)
def test_layer_loop_on_quantized_weights_equals_module_path():
    llm = make_llm("gguf", dtype="bfloat16")
    engine = llm.engine
    for q in QUESTIONS[:5]:
        engine.add_request(
            llm.chat_prompt(q), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        )
    for _ in range(3):
        engine.step()
    runner = engine.runner
    model = runner.model
    assert model._layer_loop() is not None
    inputs = runner.prepare(ScheduledBatch(decodes=list(engine.scheduler.running)))
    with_loop = runner.forward_logits(inputs)
    with model.module_path():
        without = runner.forward_logits(inputs)
    assert torch.equal(with_loop, without)


@pytest.mark.parametrize("kind", ["qwen2_qkv_bias", "mha_tied"])
@pytest.mark.parametrize("mode", ["int8", "q8_0", "q4_0", "q4_1"])
def test_quantized_at_load_on_small_models(tiny_model, kind, mode):
    """Any dense model quantizes at load: biases kept, an untied embedding stays dense, a tied
    one is held once, quantized, with the lm_head; with 8 bits the first greedy token is the
    dense one's (4 bits move these tiny random models' near ties: they only have to run)."""
    path = str(tiny_model(kind)[0])
    outs = {}
    for q in ("none", mode):
        llm = LLM(
            path,
            dtype="float32",
            quantization=q,
            threads=1,
            cache=CacheConfig(kv_cache_bytes=16 << 20, kv_cache_dtype="float32"),  # weights alone
        )
        model = llm.engine.runner.model
        if q != "none":
            assert all(isinstance(lin.weight, QuantizedWeight) for _, lin in projections(llm))
            tied = model.config.tie_word_embeddings
            assert isinstance(model.embed_tokens.weight, torch.Tensor) != tied
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        outs[q] = llm.generate([[5, 6, 7, 8, 9]], params)[0].token_ids
    assert len(outs[mode]) == 1
    if mode in ("int8", "q8_0"):
        assert outs[mode] == outs["none"]


def test_auto_quantization_takes_the_gguf_blocks_on_the_cpu(tmp_path):
    from pdserve.model.fetch import GGUF_COPY
    from pdserve.model.quantize import resolve_quantization

    kept, bare = tmp_path / "kept", tmp_path / "bare"
    kept.mkdir(), bare.mkdir()
    (kept / GGUF_COPY).write_bytes(b"GGUF")
    assert resolve_quantization("auto", kept, torch.float32, "cpu") == "gguf"
    bf16 = "gguf" if gemm.hybrid_available() else "none"  # the hybrid needs AVX512-BF16
    assert resolve_quantization("auto", kept, torch.bfloat16, "cpu") == bf16
    assert resolve_quantization("auto", kept, torch.float32, "cuda:0") == "none"
    assert resolve_quantization("auto", bare, torch.float32, "cpu") == "none"  # no GGUF source
    assert resolve_quantization("int8", bare, torch.bfloat16, "cpu") == "int8"  # asked for


# A bf16 model on the GGUF's blocks (generated tokens on Q4_1's exact values) against the fp32
# model of the same blocks dequantized (issue 14's reference), the suite's 8 prompts x 8 tokens.
# Measured on a Zen 4 (2026-11-30), every row on the exact values: 7 continuations identical, one
# parting at its second token, a near tie (the reference's two best 0.054 nats apart); the dense
# bf16 model (the folder's weights: the blocks rounded to bf16) parts on 2 of 8 there. So a
# continuation may part where the reference's two best tokens are within TIE_BOUND and the bf16
# run took the other; before that, chosen-token logprobs within LOGPROB_BOUND (a wrong weight or
# kernel is off by nats).
TIE_BOUND = 0.1
LOGPROB_BOUND = 0.25


def _parts_only_at_near_ties(outs, ref) -> tuple[int, list[float]]:
    """How many of ``outs`` part from ``ref``, each at a near tie; logprob diffs before that."""
    parted, diffs = 0, []
    for a, b in zip(ref, outs, strict=True):
        pairs = enumerate(zip(a.token_ids, b.token_ids, strict=True))
        same = next((i for i, (x, y) in pairs if x != y), None)
        if same is not None:
            parted += 1
            top = dict(a.logprobs[same].top)
            assert b.token_ids[same] in top, (a.text, b.text)
            assert a.logprobs[same].logprob - top[b.token_ids[same]] < TIE_BOUND, (a.text, b.text)
        before = zip(a.logprobs[:same], b.logprobs[:same], strict=True)
        diffs += [abs(x.logprob - y.logprob) for x, y in before]
    return parted, diffs


@pytest.mark.skipif(not gemm.hybrid_available(), reason="the hybrid needs AVX512-BF16")
def test_bf16_auto_runs_the_gguf_blocks_and_batches_change_nothing():
    """``auto`` on a bf16 model takes the GGUF's Q4_1 projections and Q8_0 lm_head, a prompt's
    rows multiplied on the blocks' bf16 rounding (the blocks for small steps, packed copies for
    large ones) and a generated token's rows on Q4_1's exact values. A prompt's tokens and
    logprobs are the same bits alone and among 16; the first token (a prompt's) is the dense bf16
    model's bit for bit; against the fp32 model of the same blocks dequantized, the greedy
    tokens part only at near ties. The tied embedding, looked up in the Q8_0 blocks, gives the
    dense rows too."""
    llm = make_llm("auto", dtype="bfloat16")
    model = llm.engine.runner.model
    assert model.quantization == "gguf"
    quantized = [
        lin.weight for _, lin in projections(llm) if not isinstance(lin.weight, torch.Tensor)
    ]
    assert len(quantized) == 4 * len(model.layers) + 1  # every layer's and the lm_head
    assert {w.name for w in quantized} == {"q4_1", "q8_0"}
    assert all(gemm.hybrid_weight(w) is not None for w in quantized)
    # what a step reads: the blocks up to 8 tokens, the packed copies beyond, but a Q4_1 weight's
    # blocks for a generated token's rows at any count
    extra = {
        name: sum(gemm.hybrid_tier(w)[1] for w in quantized if w.name == name)
        for name in ("q8_0", "q4_1")
    }
    assert extra["q4_1"] > 0 and extra["q8_0"] > 0
    assert llm.engine.runner.weight_tiers() == (
        (gemm.HYBRID_MAX_ROWS, extra["q8_0"], False),
        (gemm.HYBRID_MAX_ROWS, extra["q4_1"], True),
    )
    prompts = [llm.chat_prompt(q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    batch = llm.generate(prompts * 2, params)
    assert len(batch) > gemm.HYBRID_MAX_ROWS
    alone = [llm.generate([p], params)[0] for p in prompts]
    for got, among in zip(alone + batch[len(prompts) :], batch + batch, strict=False):
        assert got.token_ids == among.token_ids
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in among.logprobs]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=2)
    first = make_llm("none", dtype="bfloat16").generate(prompts, one)
    for got, ref in zip(batch, first, strict=False):
        assert got.token_ids[0] == ref.token_ids[0]
        assert got.logprobs[0].logprob == ref.logprobs[0].logprob
    ref = dequantized_in_place(make_llm("gguf")).generate(prompts, params)
    parted, diffs = _parts_only_at_near_ties(batch[: len(prompts)], ref)
    print(
        f"bf16 on the GGUF's blocks vs fp32 dequantized: {parted} of {len(prompts)} parted at a "
        f"near tie; |logprob diff| max {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f} nats "
        f"over {len(diffs)} tokens"
    )
    assert parted <= len(prompts) // 4
    assert max(diffs) < LOGPROB_BOUND
