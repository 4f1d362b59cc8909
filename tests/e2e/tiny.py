"""A small random-weight Llama with a word-level tokenizer, for process tests that need workers
to start fast (no model hub on the GPU machines either): the model, its prompts, and a gateway
with one prefill and one decode worker serving it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.services.launcher import stop_processes

from bench.random_model import write_word_tokenizer
from tests.e2e.cluster import Cluster, start_cluster
from tests.engine.conftest import build_tiny_model

VOCAB = 512  # build_tiny_model's; ids 1 and 2 are its bos and eos
BLOCK = 16  # the workers' KV block size (the default)


def tiny_model_folder(tmp_path_factory, name: str) -> Path:
    folder = tmp_path_factory.mktemp(name)
    build_tiny_model(folder, "gqa_untied")
    write_word_tokenizer(folder, VOCAB)
    return folder


def prompt(seed: int, length: int) -> list[int]:
    """``length`` token ids (bos first), the same for the same seed."""
    return [1] + [3 + (seed * 7 + i * 13) % (VOCAB - 3) for i in range(length - 1)]


@contextmanager
def tiny_pair(model: Path, *worker_args: str) -> Iterator[Cluster]:
    """A gateway, a prefill and a decode worker on ``model`` (``worker_args`` for both), every
    process stopped when the block ends."""
    c = start_cluster("--model", str(model))
    try:
        for role in ("prefill", "decode"):
            c.start_worker(role, role, "--model", str(model), *worker_args)
        yield c
    finally:
        stop_processes(c.procs)
