"""Run one model over one KV cache pool: batched runs of new tokens at explicit positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.backends import backend_of
from infer.backends.cuda_graphs import StepGraphs
from infer.cache.protocol import CachePoolProtocol, build_kv_batch, sequence_rows
from infer.core.request import Request
from infer.models.layers import AuxCapture, DecoderOnlyLM, block_mask_from


@dataclass
class RaggedPass:
    """A pass over runs of different lengths, packed: run b's rows are ``hidden[offsets[b]:offsets[b + 1]]``."""

    hidden: torch.Tensor  # [N, hidden]
    offsets: list[int]  # [B + 1] cumulative run lengths (vLLM's cu_num_tokens)
    rows: int  # token rows the forward computed: N, or B x the longest run where it ran padded
    aux: torch.Tensor | None = None  # [N, aux] the captured layer inputs (ModelRunner.aux_layers), row for row
    logits: torch.Tensor | None = None  # [N, vocab] float32, where the pass was asked for them (logits=True)

    def padded(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``x`` [N, ...] (a row per token, e.g. the logits of ``hidden``) as [B, longest run, ...],
        ``fill`` past each run's end."""
        lengths = [b - a for a, b in zip(self.offsets, self.offsets[1:], strict=False)]
        width = max(lengths)
        out = x.new_full((len(lengths) * width, *x.shape[1:]), fill)
        out[_packed_index(lengths, width, x.device)] = x
        return out.view(len(lengths), width, *x.shape[1:])

    def split(self, values: Sequence[int]) -> list[list[int]]:
        """A host list with one value per packed row (e.g. the argmax tokens, read once) as each run's
        own list: what ``padded`` does for a tensor, without the padding."""
        return [list(values[a:b]) for a, b in zip(self.offsets, self.offsets[1:], strict=False)]

    def rows_at(self, rows: Sequence[int]) -> torch.Tensor:
        """``hidden`` at row ``rows[b]`` of each run b: [B, hidden]."""
        index = [start + row for start, row in zip(self.offsets, rows, strict=False)]
        return self.hidden[torch.tensor(index, device=self.hidden.device)]


def _packed_index(lengths: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """Flat [B * width] positions of the runs' tokens, in order."""
    return torch.tensor([b * width + t for b, n in enumerate(lengths) for t in range(n)], dtype=torch.long,
                        device=device)


class ModelRunner:
    """The single place that turns (slot, start, tokens) runs into a model forward.

    Prefill chunks, decode steps, speculative verification, draft-model catch-up and tree
    verification are all "append these tokens to these sequences"; only the caller differs.
    """

    def __init__(self, model: DecoderOnlyLM, pool: CachePoolProtocol, tree_attention: str = "sdpa") -> None:
        self.model = model
        self.backend = backend_of(model)  # runs every pass of this model (Backend.forward)
        self.pool = pool
        self.tree_attention = tree_attention  # "flex": tree passes use FlexAttention with a block mask
        self.device = pool.device
        self.vocab_size = model.config.vocab_size
        # The threads of each kind of pass, as the backend's kernels want them (Backend.thread_policy).
        self._threads_for = self.backend.thread_policy(model)
        # Host work around the passes (sampling, a speculative round's drafting and rejection),
        # threaded as the backend wants it (Backend.host_policy).
        self.host_work = self.backend.host_policy(model)
        # Passes replayed as CUDA graphs, where the backend makes them (CudaBackend.step_graphs, given
        # the batch and widths by the engine); None: every pass eagerly.
        self.graphs: StepGraphs | None = None
        # Layer inputs every pass keeps (an EAGLE-3 drafter's, vLLM's layer ids: models.layers.AuxCapture);
        # the last pass's are ``last_aux`` ([B, T, aux] like its hidden states). CUDA graphs are not
        # replayed then (a graph returns the final hidden states only).
        self.aux_layers: tuple[int, ...] = ()
        self.last_aux: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], runs: Sequence[Sequence[int]] | torch.Tensor,
                positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``runs[b]`` to sequence ``slots[b]``; return hidden states [B, T, hidden] (padded).

        ``runs`` is a list of token lists, or a [B, T] tensor already on the device (equal-length
        runs, e.g. draft steps: no host round trip). ``positions`` (RoPE positions, [B, T]) default
        to the cache positions; tree verification passes depth-based positions and a ``tree_mask``.
        """
        if (self.graphs is not None and positions is None and tree_mask is None and not isinstance(runs, torch.Tensor)
                and not self.aux_layers):
            replayed = self.graphs.run(slots, runs)
            if replayed is not None:
                return replayed
        return self._forward(slots, runs, positions, tree_mask, ragged=False)[0]

    @torch.inference_mode()
    def forward_ragged(self, slots: Sequence[int], runs: Sequence[Sequence[int]],
                       positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                       logits: bool = False) -> RaggedPass:
        """``forward`` computing only the runs' own tokens: run b's hidden states are rows
        ``offsets[b] .. offsets[b + 1] - 1`` of a [N, hidden] tensor (vLLM's ``cu_num_tokens``
        layout), N = the runs' total length, where ``forward`` computes B x the longest run.
        Attention still sees each token's keys as a padded pass does, so every row is the same.
        A pass a CUDA graph replays stays padded (its shape is the graph's) and is packed after.
        ``logits``: every row's logits too (``RaggedPass.logits``), from the pass itself where the
        backend computes them there (``Backend.forward_logits``), else as ``logits`` computes them."""
        lengths = [len(r) for r in runs]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        if self.graphs is not None and positions is None and tree_mask is None and not self.aux_layers:
            replayed = self.graphs.run(slots, runs)
            if replayed is not None:
                index = _packed_index(lengths, replayed.shape[1], replayed.device)
                packed = replayed.flatten(0, 1)[index]
                return RaggedPass(packed, offsets, replayed.shape[0] * replayed.shape[1],
                                  logits=self.logits(packed) if logits else None)
        hidden, computed = self._forward(slots, runs, positions, tree_mask, ragged=True, logits=logits)
        aux = None if self.last_aux is None else self.last_aux.flatten(0, 1)
        flat = hidden.flatten(0, 1)
        if logits:
            computed = self.logits(flat) if computed is None else computed.flatten(0, 1)
        return RaggedPass(flat, offsets, hidden.shape[0] * hidden.shape[1], aux, computed)

    def _forward(self, slots: Sequence[int], runs: Sequence[Sequence[int]] | torch.Tensor,
                 positions: torch.Tensor | None, tree_mask: torch.Tensor | None, ragged: bool,
                 logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        starts = [self.pool.seq_len(s) for s in slots]
        if (len(slots) == 1 and positions is None and tree_mask is None and not isinstance(runs, torch.Tensor)
                and self.backend.takes_sequence(self.model, len(runs[0]), self.pool.k_layers[0])):
            # One sequence's chain of tokens (a decode step, a verification): the backend takes the
            # cache as rows and addresses, not the tensors build_kv_batch makes (the same bits).
            rows = sequence_rows(self.pool, slots[0], starts[0], len(runs[0]))
            aux = AuxCapture(self.aux_layers) if self.aux_layers else None
            with self._threads_for(len(runs[0]), "forward"):
                hidden, computed = self.backend.forward_sequence(self.model, runs[0], rows, logits, aux)
            self.last_aux = None if aux is None else aux.result()
            return hidden, computed
        if isinstance(runs, torch.Tensor):
            ids = runs
            lengths = [runs.shape[1]] * runs.shape[0]
        else:
            lengths = [len(r) for r in runs]
            width = max(lengths)
            padded = runs if all(n == width for n in lengths) else [list(r) + [0] * (width - len(r)) for r in runs]
            ids = torch.tensor(padded, dtype=torch.long).to(self.device, non_blocking=True)
        width = ids.shape[1]
        if positions is None:
            if len(starts) == 1:
                positions = torch.arange(starts[0], starts[0] + width, device=self.device).unsqueeze(0)
            else:
                positions = torch.tensor(starts, device=self.device).unsqueeze(1) + torch.arange(width, device=self.device)
        kv = build_kv_batch(self.pool, slots, starts, lengths, tree_mask, ragged=ragged)
        if tree_mask is not None and self.tree_attention == "flex":
            assert kv.mask is not None  # a tree pass always has one
            kv.block_mask = block_mask_from(kv.mask)
        if kv.packed is not None:  # only the real tokens go through the model: [1, N]
            ids, positions = kv.pack(ids), kv.pack(positions)
        aux = AuxCapture(self.aux_layers) if self.aux_layers else None
        with self._threads_for(ids.numel(), "forward"):
            hidden, computed = self.backend.forward_logits(self.model, ids, positions, kv, aux, logits)
        self.last_aux = None if aux is None else aux.result()
        return hidden, computed

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._threads_for(hidden.numel() // hidden.shape[-1], "logits"):
            return self.model.compute_logits(hidden).float()

    def warm_up(self, width: int) -> None:
        """Run each kind of pass a request meets once on scratch sequences (one sequence and two;
        a prefill, a decode step and a ``width``-token verification, and for two a ragged one), so a
        compiled model compiles its graphs now rather than in the middle of the first requests. The
        pool is left as found."""
        slots = [self.pool.allocate(), self.pool.allocate()]
        try:
            for batch in ([slots[0]], slots):
                self.logits(self.forward(batch, [[0] * 4] * len(batch))[:, -1])  # prefill
                self.forward_ragged(batch, [[0]] * len(batch), logits=True)  # decode step
                self.forward_ragged(batch, [[0] * width] * len(batch), logits=True)  # verification
                if len(batch) > 1 and width > 1:  # a verification whose requests drafted unequally
                    self.forward_ragged(batch, [[0] * width] + [[0]] * (len(batch) - 1), logits=True)
        finally:
            for slot in slots:
                self.pool.free(slot)

    @staticmethod
    def last_hidden(hidden: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """Hidden state of each row's last real token, [B, hidden]."""
        index = torch.tensor([n - 1 for n in lengths], device=hidden.device)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]

    def can_admit(self, request: Request, running: list[Request], slot_of: Callable[[Request], int | None],
                  extra: int = 0) -> bool:
        """Whether the pool can grow ``request`` and every running request to their most tokens plus
        ``extra`` (``slot_of`` names each request's sequence in this pool, None before it has one)."""
        def need(r: Request) -> int:
            return self.pool.kv_tokens_needed(slot_of(r), r.max_total_tokens + extra)

        return need(request) <= self.pool.free_kv_tokens() - sum(need(r) for r in running)
