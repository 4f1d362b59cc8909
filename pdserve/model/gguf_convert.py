"""Convert a llama.cpp GGUF file into a Hugging Face model folder.

Weights are dequantized with the ``gguf`` package and renamed through ``GGUF_TO_HF``; config and
generation config come from the GGUF metadata. Only the tokenizer goes through transformers (our
reference library), which rebuilds a ``tokenizer.json`` from the GGUF vocabulary and merges.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from pdserve.kernels import GGUF_TYPES, QuantizedWeight
from pdserve.model.gguf_index import read_index

# GGUF tensor name -> Hugging Face tensor name; "{bid}" is the decoder layer index.
GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{bid}.attn_norm.weight": "model.layers.{bid}.input_layernorm.weight",
    "blk.{bid}.attn_q.weight": "model.layers.{bid}.self_attn.q_proj.weight",
    "blk.{bid}.attn_k.weight": "model.layers.{bid}.self_attn.k_proj.weight",
    "blk.{bid}.attn_v.weight": "model.layers.{bid}.self_attn.v_proj.weight",
    "blk.{bid}.attn_output.weight": "model.layers.{bid}.self_attn.o_proj.weight",
    "blk.{bid}.ffn_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
    "blk.{bid}.ffn_gate.weight": "model.layers.{bid}.mlp.gate_proj.weight",
    "blk.{bid}.ffn_up.weight": "model.layers.{bid}.mlp.up_proj.weight",
    "blk.{bid}.ffn_down.weight": "model.layers.{bid}.mlp.down_proj.weight",
}

# llama.cpp's converter interleaves the rows of these for its RoPE layout; value = which head count.
PERMUTED_ROWS: dict[str, str] = {
    "blk.{bid}.attn_q.weight": "num_attention_heads",
    "blk.{bid}.attn_k.weight": "num_key_value_heads",
}

# HF config key -> GGUF metadata key ("{arch}" = general.architecture).
GGUF_CONFIG_KEYS: dict[str, str] = {
    "hidden_size": "{arch}.embedding_length",
    "intermediate_size": "{arch}.feed_forward_length",
    "num_hidden_layers": "{arch}.block_count",
    "num_attention_heads": "{arch}.attention.head_count",
    "num_key_value_heads": "{arch}.attention.head_count_kv",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "rope_theta": "{arch}.rope.freq_base",
    "max_position_embeddings": "{arch}.context_length",
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}

# tokenizer.ggml.pre values whose llama.cpp pre-tokenizer splits every digit on its own, which the
# transformers GGUF tokenizer conversion drops; the original tokenizer.json starts with this step.
SPLIT_DIGITS_PRE = {"smollm"}

SUPPORTED_ARCHITECTURES = ("llama",)


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape("{bid}"), r"(?P<bid>\d+)"))


_GGUF_PATTERNS = [(_compile(g), g, h) for g, h in GGUF_TO_HF.items()]


def hf_tensor_name(gguf_name: str) -> tuple[str, str] | None:
    """``(hf_name, gguf_pattern)`` for a GGUF tensor name, or None when the table has no entry."""
    for regex, pattern, hf in _GGUF_PATTERNS:
        m = regex.fullmatch(gguf_name)
        if m:
            return hf.format(**m.groupdict()), pattern
    return None


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)`` on q/k rows."""
    out_features = w.shape[0]
    # [num_heads, head_dim // 2, 2, in] -> [num_heads, 2, head_dim // 2, in]
    return (
        w.reshape(num_heads, out_features // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _field(reader: GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _config_from_metadata(reader: GGUFReader, tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError("GGUF files with RoPE scaling metadata are not supported")
    cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    for hf_key, gguf_key in GGUF_CONFIG_KEYS.items():
        value = _field(reader, gguf_key.format(arch=arch))
        if value is not None:
            cfg[hf_key] = value
    missing = [
        k
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"GGUF metadata lacks {', '.join(missing)}")
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    # GGUF stores floats as f32: 1e-5 reads back as 9.99999974e-06, so keep 7 significant digits.
    for key in ("rms_norm_eps", "rope_theta"):
        if key in cfg:
            cfg[key] = float(f"{cfg[key]:.7g}")
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = (
        _field(reader, f"{arch}.attention.key_length")
        or cfg["hidden_size"] // cfg["num_attention_heads"]
    )
    cfg.update(
        vocab_size=int(vocab_size),
        head_dim=int(head_dim),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=tied,
        torch_dtype=str(dtype).removeprefix("torch."),
        use_cache=True,
    )
    return cfg


def _generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: cfg[k] for k in keys if k in cfg}


def _convert_tensors(
    reader: GGUFReader, cfg: dict[str, Any], dtype: torch.dtype, progress: bool
) -> dict[str, torch.Tensor]:
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with rope_freqs (Llama-3.1 RoPE scaling) are not supported")
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not progress):
        mapped = hf_tensor_name(t.name)
        if mapped is None:
            raise ValueError(f"GGUF tensor {t.name!r} has no entry in GGUF_TO_HF")
        name, pattern = mapped
        # GGUF lists dims fastest-first ([in, out]); torch wants [out, in].
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(data)
        if pattern in PERMUTED_ROWS:
            w = unpermute_rows(w, cfg[PERMUTED_ROWS[pattern]])
        state[name] = w.to(dtype).contiguous()
    return state


def _write_tokenizer(gguf_path: Path, out_dir: Path, reader: GGUFReader) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            "converting a GGUF tokenizer needs transformers (a pdserve dependency); install it with: pip install transformers"
        ) from None
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    tokenizer_json = out_dir / "tokenizer.json"
    if _field(reader, "tokenizer.ggml.pre") in SPLIT_DIGITS_PRE:
        spec = json.loads(tokenizer_json.read_text())
        spec["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, spec["pre_tokenizer"]],
        }
        tokenizer_json.write_text(json.dumps(spec, ensure_ascii=False, indent=2))

    # One place for the chat template: tokenizer_config.json (transformers 5 writes a .jinja file).
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    template = _field(reader, "tokenizer.chat_template")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    if template:
        tok_config["chat_template"] = template
    tok_config.pop("is_local", None)
    tok_config.pop("local_files_only", None)
    # transformers 5 writes "TokenizersBackend", which 4.x cannot load; this alias reads in both.
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    context_length = _field(reader, f"{_field(reader, 'general.architecture')}.context_length")
    if context_length:
        tok_config["model_max_length"] = int(context_length)
    config_path.write_text(json.dumps(tok_config, ensure_ascii=False, indent=2))
    special = {
        k: tok_config[k]
        for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        if tok_config.get(k)
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def convert_gguf(
    gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16, progress: bool = True
) -> None:
    """Write a Hugging Face folder for ``gguf_path`` into ``out_dir`` (created if needed).

    Raises ValueError when the file is not a readable GGUF or holds an unsupported model.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # the reader raises anything from struct errors to ValueError
        detail = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(
            f"cannot read GGUF file {gguf_path}; it is truncated or corrupt ({detail})"
        ) from None
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    cfg = _config_from_metadata(reader, tied, dtype)
    state = _convert_tensors(reader, cfg, dtype, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config(cfg), indent=2))
    _write_tokenizer(gguf_path, out_dir, reader)


def quantized_tensors(gguf_path: Path, cfg) -> dict[str, QuantizedWeight]:
    """The GGUF file's Q4_0/Q4_1/Q8_0 tensors under their Hugging Face names, as the file holds
    their blocks (one uint8 row per output row; q/k rows unpermuted like the dense conversion);
    ``cfg``: the model's ``ModelConfig``. Tensors of other types are left out. Read through the
    file's tensor index alone (``gguf_index``): a worker's start does not decode the metadata."""
    heads = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    out: dict[str, QuantizedWeight] = {}
    for t in read_index(gguf_path):
        mapped = hf_tensor_name(t.name)
        if mapped is None or t.tensor_type not in GGUF_TYPES or len(t.shape) != 2:
            continue
        name, pattern = mapped
        shape = (t.shape[1], t.shape[0])  # GGUF lists [in, out]
        data = t.read(gguf_path).reshape(shape[0], -1)
        if pattern in PERMUTED_ROWS:
            data = unpermute_rows(data, heads[PERMUTED_ROWS[pattern]])
        out[name] = QuantizedWeight(data.contiguous(), t.tensor_type, shape)
    return out
