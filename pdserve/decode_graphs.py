"""Decode-only steps replayed from CUDA graphs: one launch a step instead of one per kernel.

The first GPU run found a batch-1 decode step bound by the host launching kernels (an H100 VM:
~1 ms a layer; docs/benchmarks.md, "GPU"), as vLLM and SGLang found before and answered with
CUDA graphs. A step of n decode tokens runs the graph captured for the smallest batch size
B >= n of ``BUCKETS`` (up to the engine's ``max_num_seqs``), on static inputs: the step's token
ids, positions, slots, block tables and context lengths fill the first n rows, the other B - n
rows are padding that reads and writes nothing (slot -1, which the Triton ``rope_write_kv``
skips; context length 0, for which decode attention reads no block). Block tables have one fixed
width, the most blocks a sequence can hold. The runner hands a step's inputs over as host lists
(``ModelRunner._graph_step``, no ``prepare``): they are written into host twins of the static
buffers (page-locked) and go over in two copies, where the runner's tensors took six copies to
the device, five into the static buffers and two fills (the fourth GPU run's host profile:
the host's own ~0.5 ms of a 1.35 ms batch-1 step is what the device waits for).

On by default since the second H100 run (2026-11-28: the graph steps gave the eager steps' tokens,
and a 135M-shape decode step took 4.4 ms against 8.6 at batch 1, 5.6 against 10.3 at batch 32);
``PDSERVE_CUDA_GRAPHS=0`` turns it off. Only on CUDA, with the Triton backend, for steps with no
prefill tokens and no per-layer hook (a prefill worker's KV sends).
Every batch size's graph is captured when the engine starts (``capture_all``), so that serving
never waits for one. A batch size whose capture fails is run eagerly from then on, with a warning.

``replay`` is the one place a CUDA graph is touched: tests on the CPU pass ``graph_factory`` an
eager stand-in, which exercises everything else (the static buffers, the padding) under the
Triton interpreter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pdserve.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class EagerGraph:
    """What ``DecodeGraphs`` needs of a graph, run eagerly (tests on the CPU): ``capture(fn)``
    records ``fn`` and returns its output, ``replay()`` runs it again on the same static inputs
    and writes the result into that same output, as a CUDA graph's replay does."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn = fn
        self._out = fn()
        return self._out

    def replay(self) -> None:
        self._out.copy_(self._fn())


class CUDAGraph:
    """``fn`` captured once into a CUDA graph after two warm-up runs on a side stream (as
    torch.cuda.graphs asks); ``replay`` runs it on the current stream, filling the tensor that
    ``capture`` returned."""

    def __init__(self, pool) -> None:  # noqa: ANN001 - a torch.cuda graph memory pool handle
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    def __init__(
        self,
        model,  # noqa: ANN001 - LlamaForCausalLM
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        graph_factory: Callable[[], object] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_blocks = max_blocks
        self.top = top = self.buckets[-1]
        # The static inputs, in two device buffers: int64 rows of token ids, positions and slots;
        # int32 context lengths then block tables (a step's rows of both are one run). Their
        # twins on the host (page-locked on a GPU) are where a step writes its inputs, which then
        # go over in two copies (six copies to the device, five into these buffers and two fills
        # a step before).
        pin = device.type == "cuda"
        self._dev64 = torch.zeros(3, top, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(top * (1 + max_blocks), dtype=torch.int32, device=device)
        self._host64 = torch.zeros(3, top, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(top * (1 + max_blocks), dtype=torch.int32, pin_memory=pin)
        self._dev64[2] = -1  # padding rows write nothing (slot -1) and read nothing (length 0)
        self._host64[2] = -1
        self.ids, self.positions, self.slots = self._dev64.unbind(0)
        self.context_lens = self._dev32[:top]
        self.block_tables = self._dev32[top:].view(top, max_blocks)
        self._h64 = self._host64.numpy()
        self._h_lens = self._host32[:top].numpy()
        self._h_tables = self._host32[top:].view(top, max_blocks).numpy()
        self._last_rows = 0  # rows of the host buffers that the last step wrote
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = lambda: CUDAGraph(pool)  # noqa: E731
        self.graph_factory = graph_factory
        self.graphs: dict[int, tuple[object, torch.Tensor] | None] = {}  # None: capture failed

    def capture_all(self) -> float:
        """Captures every batch size's graph now, the largest first (the smaller ones reuse its
        memory), so that no step while serving waits for a capture or for a kernel's compilation:
        captured on first use, the first step of each new batch size stalled every running
        stream (~0.4 s at batch 32 on the fourth GPU run). Returns the seconds it took."""
        t = time.perf_counter()
        for b in reversed(self.buckets):
            self._graph(b)
        return time.perf_counter() - t

    def bucket(self, n: int) -> int | None:
        """The batch size a step of ``n`` decode tokens runs as, or None (more than the top)."""
        return next((b for b in self.buckets if b >= n), None)

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b],
            num_prefill_tokens=0,
            prefill_block_tables=None,
            prefill_query_start_loc=None,
            prefill_context_lens=None,
            decode_block_tables=self.block_tables[:b],
            decode_context_lens=self.context_lens[:b],
        )
        return self.model(self.ids[:b], self.positions[:b], self.kv_caches, meta)

    def _graph(self, b: int) -> tuple[object, torch.Tensor] | None:
        if b not in self.graphs:
            graph = self.graph_factory()
            self.slots.fill_(-1)  # a step's rows back to padding: the capture's runs write no KV
            self.context_lens.zero_()
            try:
                self.graphs[b] = (graph, graph.capture(lambda: self._forward(b)))
            except Exception as exc:  # noqa: BLE001 - this batch size runs eagerly from now on
                logger.warning("CUDA graph capture for batch %d failed (%r): eager steps", b, exc)
                self.graphs[b] = None
        return self.graphs[b]

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
    ) -> torch.Tensor | None:
        """The final hidden states [n, hidden] of a decode-only step of n sequences (one row each,
        host lists), from its batch size's graph; None where the step cannot run so (the caller
        runs it eagerly). The host buffers are rewritten at the next call: the caller must have
        waited for this step's results by then (it does: it samples them), so that the copies
        out of them have completed."""
        n = len(ids)
        b = self.bucket(n)
        if b is None or any(len(t) > self.max_blocks for t in block_tables):
            return None
        made = self._graph(b)
        if made is None:
            return None
        graph, out = made
        h64, lens, tables, last = self._h64, self._h_lens, self._h_tables, self._last_rows
        h64[2, :last] = -1  # the last step's rows back to padding
        lens[:last] = 0
        h64[0, :n], h64[1, :n], h64[2, :n], lens[:n] = ids, positions, slots, context_lens
        for row, table in zip(tables, block_tables, strict=False):
            row[: len(table)] = table  # the rest of a row is never read (its length bounds it)
        self._last_rows = n
        self._dev64.copy_(self._host64, non_blocking=True)
        used = self.top + b * self.max_blocks  # the lengths and this batch size's tables
        self._dev32[:used].copy_(self._host32[:used], non_blocking=True)
        graph.replay()
        return out[:n]
