"""Small random-weight Llama-family models, saved as Hugging Face safetensors folders."""

from __future__ import annotations

import pytest
import torch

TINY_CONFIGS = {
    # name: (config class name, kwargs)
    "gqa_untied": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "mha_tied": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "qwen2_qkv_bias": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "llama_bias": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, attention_bias=True),
    ),
    "llama3_rope_scaling": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
}


def build_tiny_model(path, kind: str, seed: int = 0):
    import transformers

    cls_name, extra = TINY_CONFIGS[kind]
    cfg = getattr(transformers, cls_name)(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,  # peaky logits: greedy choices are far from ties
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # biases start at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind) -> (folder, Hugging Face model in fp32)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            made[kind] = (path, build_tiny_model(path, kind))
        return made[kind]

    return get
