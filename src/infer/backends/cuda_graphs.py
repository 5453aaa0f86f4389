"""CUDA graphs of the passes a request repeats: decode steps and chain verifications.

A decode step of a small model on a GPU is hundreds of short kernels, each launched from Python;
replaying a captured graph launches them all at once. A graph fixes every tensor's shape and
address, so a pass is padded to a bucket (``cache.protocol.padded_kv_batch``): the batch to a
power of two, the context to a power of two (at least ``MIN_CONTEXT``) up to the pool's
``max_seq_len``, the width kept as it is (1 for a decode step, K + 1 for a verification). One graph
per (batch, width, context) bucket, captured on first use into one shared memory pool; a replay
copies the pass's ids, positions and cache description into the graph's input tensors. Padding
rows write to the pool's scratch row and never reach a real sequence.

Speculation and graphs mix: a verification of K + 1 tokens is one more width, so each K gets its
graphs as the decode step does, and a draft model's steps (their ids already on the device, a
``[batch, 1]`` tensor) replay their own graphs. Tree verification, prefill (wider than a
verification) and any pass that does not fit a bucket run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.backends.backend import backend_of
from infer.cache.protocol import CachePoolProtocol, KVBatch, padded_kv_batch
from infer.models.layers import DecoderOnlyLM

MIN_CONTEXT = 256  # the smallest context bucket: short sequences share one graph per batch and width


def bucket(n: int, smallest: int = 1) -> int:
    """The power of two at or above ``n`` (at least ``smallest``)."""
    size = smallest
    while size < n:
        size *= 2
    return size


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [batch, width] the inputs a replay overwrites
    positions: torch.Tensor
    kv: KVBatch
    hidden: torch.Tensor  # [batch, width, hidden] the output a replay overwrites


class StepGraphs:
    """Captures and replays the graphs of one model over one pool (``ModelRunner.graphs``; made by ``CudaBackend.step_graphs``)."""

    def __init__(self, model: DecoderOnlyLM, pool: CachePoolProtocol, max_batch: int, max_width: int,
                 progress: Callable[[str], None] | None = None) -> None:
        if pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this pool is on {pool.device}")
        self.model = model
        self.backend = backend_of(model)
        self.pool = pool
        self.max_batch = bucket(max_batch)
        self.max_width = max_width  # wider passes (prefill) run eagerly: each width is its own graph
        self.max_context = pool.max_seq_len
        self.progress = progress or (lambda _msg: None)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.memory = torch.cuda.graph_pool_handle()

    def shape_for(self, batch: int, width: int, end: int) -> tuple[int, int, int] | None:
        """The bucket of a pass of ``batch`` sequences, ``width`` new tokens each, reaching position
        ``end``; None when it exceeds the largest bucket."""
        if batch > self.max_batch or width > self.max_width or end > self.max_context:
            return None
        return bucket(batch), width, min(bucket(end, MIN_CONTEXT), self.max_context)

    def run(self, slots: Sequence[int], runs: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor | None:
        """Hidden states [len(slots), width, hidden] of the pass appending ``runs[b]`` to
        ``slots[b]`` (every run as long; host lists, or a ``[len(slots), width]`` tensor of ids on
        the device, which a draft model's steps pass on without a host read), by replaying its
        bucket's graph; None when the pass has runs of different lengths or fits no bucket (the
        caller runs it eagerly)."""
        width = runs.shape[1] if isinstance(runs, torch.Tensor) else len(runs[0])
        if not isinstance(runs, torch.Tensor) and any(len(r) != width for r in runs):
            return None
        starts = [self.pool.seq_len(s) for s in slots]
        shape = self.shape_for(len(slots), width, max(starts) + width)
        if shape is None:
            return None
        batch, _, context = shape
        kv = padded_kv_batch(self.pool, slots, starts, width, batch, context)
        device = self.pool.device
        ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        ids[: len(slots)] = runs if isinstance(runs, torch.Tensor) else \
            torch.tensor([list(r) for r in runs], dtype=torch.long).to(device, non_blocking=True)
        positions = torch.zeros(batch, width, dtype=torch.long, device=device)
        positions[: len(slots)] = (torch.tensor(starts).unsqueeze(1) + torch.arange(width)).to(device, non_blocking=True)
        graph = self.graphs.get(shape)
        if graph is None:
            graph = self.graphs[shape] = self._capture(ids, positions, kv)
        else:
            for static, new in ((graph.ids, ids), (graph.positions, positions), (graph.kv.write_index, kv.write_index),
                                (graph.kv.read_index, kv.read_index), (graph.kv.mask, kv.mask),
                                (graph.kv.seq_meta(), kv.seq_meta())):
                assert static is not None and new is not None
                static.copy_(new)
            graph.graph.replay()
        return graph.hidden[: len(slots)].clone()

    def _capture(self, ids: torch.Tensor, positions: torch.Tensor, kv: KVBatch) -> _Graph:
        """Record the pass on these inputs (which become the graph's). The warm-up run on a side
        stream (lazy cuBLAS and allocator set-up must not happen inside a capture) and the captured
        one both write this pass's keys and values: the same values, so nothing changes."""
        batch, width = ids.shape
        self.progress(f"CUDA graph: capturing a pass of {batch} x {width} tokens over {kv.context_len} positions")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.backend.forward(self.model, ids, positions, kv)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            hidden = self.backend.forward(self.model, ids, positions, kv)
        graph.replay()  # capturing records the kernels without running them
        return _Graph(graph, ids, positions, kv, hidden)
