"""A Hugging Face model folder of random weights with a real model's shapes, for timing where the
real weights cannot be had (a GPU machine that reaches no package index: scripts/gpu-check).

    python bench/random_model.py OUT_DIR [--shape smollm2-135m|llama-1b] [--word-tokenizer]

A decode step reads the same bytes and runs the same kernels whatever the weights hold, so step
times and MBU measured on it are those of the real model; its tokens mean nothing. The folder has
no tokenizer (benchmarks send token ids) unless ``--word-tokenizer``: one word per token id,
split at white space (``pdserve bench serve``'s words and ``w<id>``; any other word is id 0), so
that the served path (the gateway tokenizes and detokenizes) runs on it: ``pdserve bench
serve``'s prompts of N words are N different-looking tokens.
Nothing here is a correctness reference.
"""

from __future__ import annotations

import argparse

import torch

COMMON = dict(
    model_type="llama",
    hidden_act="silu",
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=True,
    head_dim=64,
    max_position_embeddings=8192,
)
FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rope_theta",
)
SHAPES = {
    # the default model, SmolLM2-135M-Instruct (its config.json)
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, 100000.0),
    # Llama 3.2 1B's shapes (without its rope scaling): big enough that a batch-1 step is bound by
    # reading the weights rather than by launching kernels
    "llama-1b": (2048, 8192, 16, 32, 8, 128256, 500000.0),
}


def write_random_model(out: str, shape: str) -> None:
    import transformers

    config = transformers.LlamaConfig(**COMMON, **dict(zip(FIELDS, SHAPES[shape], strict=True)))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def write_word_tokenizer(
    folder, vocab_size: int, words: tuple[str, ...] = (), bos_id: int = 1, eos_id: int = 2
) -> None:
    """tokenizer.json and tokenizer_config.json in ``folder``: id i is the word ``w<i>``, but ids
    3, 4, ... are ``words`` (``pdserve bench serve``'s, so that its random prompts are as many
    different token ids as words, not one unknown id repeated, which the prefix cache would
    hold after the first prompt)."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    spelled = {3 + j: w for j, w in enumerate(words)}
    vocab = {spelled.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(folder) / "tokenizer.json"))
    config = {
        "bos_token": f"w{bos_id}",
        "eos_token": f"w{eos_id}",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument(
        "--word-tokenizer", action="store_true", help="a tokenizer of one word per token id"
    )
    args = parser.parse_args()
    write_random_model(args.out, args.shape)
    if args.word_tokenizer:
        from pdserve.bench_serve import WORDS

        vocab_size = SHAPES[args.shape][FIELDS.index("vocab_size")]
        write_word_tokenizer(args.out, vocab_size, tuple(WORDS))


if __name__ == "__main__":
    main()
