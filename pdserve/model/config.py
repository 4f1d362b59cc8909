"""Architecture of a Llama-family model, read once from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# model_type values whose forward pass is the Llama block (RMSNorm, RoPE, GQA, SwiGLU).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); ``None`` on the config means none."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def o_proj_bias(self) -> bool:
        """Llama puts ``attention_bias`` on o_proj too; Qwen2 biases only q/k/v."""
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``."""
        try:
            num_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            # transformers >= 5 writes "rope_parameters" (rope_theta inside); older: rope_scaling + rope_theta.
            scaling = d.get("rope_parameters") or d.get("rope_scaling") or None
            rope_theta = float((scaling or {}).get("rope_theta", d.get("rope_theta", 10000.0)))
            rope_scaling = None
            if scaling is not None:
                kind = scaling.get("rope_type", scaling.get("type"))
                if kind in ("default", None):
                    rope_scaling = None
                elif kind == "llama3":
                    rope_scaling = RopeScaling(
                        factor=float(scaling["factor"]),
                        low_freq_factor=float(scaling["low_freq_factor"]),
                        high_freq_factor=float(scaling["high_freq_factor"]),
                        original_max_position_embeddings=int(
                            scaling["original_max_position_embeddings"]
                        ),
                    )
                else:
                    raise ValueError(
                        f"rope_scaling type {kind!r} is not supported; supported: llama3"
                    )
            model_type = d.get("model_type", "llama")
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
                rope_scaling=rope_scaling,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {path}: {e}") from None
        return cls.from_hf_dict(d)
