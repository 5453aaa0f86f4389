"""Run one model over one KV cache pool: batched runs of new tokens at explicit positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.backends import backend_of
from infer.backends.backend import PassOutput
from infer.backends.cuda_graphs import StepGraphs
from infer.cache.protocol import CachePoolProtocol
from infer.core.request import Request
from infer.models.layers import DecoderOnlyLM


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


class Admission:
    """One scheduling step's admission checks against one pool: whether the pool can grow a request
    and every running request to their most tokens plus ``extra``. Nothing is allocated while a step
    admits, and ``running`` only grows (each admitted request appended), so the running requests'
    tokens are summed once per ``extra`` and extended by the newcomers: admitting n requests costs
    O(n) look-ups, not O(n^2). Valid for the step that made it."""

    def __init__(self, pool: CachePoolProtocol, running: list[Request], slot_of: Callable[[Request], int | None]) -> None:
        self.pool, self.running, self.slot_of = pool, running, slot_of
        self.free = pool.free_kv_tokens()
        self.reserved: dict[int, tuple[int, int]] = {}  # extra: (running requests counted, their tokens)

    def need(self, request: Request, extra: int) -> int:
        return self.pool.kv_tokens_needed(self.slot_of(request), request.max_total_tokens + extra)

    def fits(self, request: Request, extra: int = 0) -> bool:
        counted, total = self.reserved.get(extra, (0, 0))
        assert counted <= len(self.running), "a request left the running set during admission"
        for r in self.running[counted:]:
            total += self.need(r, extra)
        self.reserved[extra] = (len(self.running), total)
        return self.need(request, extra) <= self.free - total

    def __call__(self, request: Request) -> bool:
        return self.fits(request)


class ModelRunner:
    """The single place that turns (slot, start, tokens) runs into a model forward.

    Prefill chunks, decode steps, speculative verification, draft-model catch-up and tree
    verification are all "append these tokens to these sequences"; only the caller differs.
    """

    def __init__(self, model: DecoderOnlyLM, pool: CachePoolProtocol) -> None:
        self.model = model
        # Runs every pass of this model and decides how (Backend.run_pass: graph replay, the
        # one-sequence path, masks, threads) and its LM head (Backend.compute_logits).
        self.backend = backend_of(model)
        self.pool = pool
        self.device = pool.device
        self.vocab_size = model.config.vocab_size
        # Host work around the passes (sampling, a speculative round's drafting and rejection),
        # threaded as the backend wants it (Backend.host_policy).
        self.host_work = self.backend.host_policy(model)
        # The CUDA graphs of this model over this pool, where the backend makes them (CudaBackend.step_graphs,
        # given the batch and widths by the engine); the backend replays a pass one holds. None: every pass eagerly.
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
        return self._run(slots, runs, positions, tree_mask, ragged=False).hidden

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
        out = self._run(slots, runs, positions, tree_mask, ragged=True, logits=logits)
        if out.replayed:
            index = _packed_index(lengths, out.hidden.shape[1], out.hidden.device)
            packed = out.hidden.flatten(0, 1)[index]
            return RaggedPass(packed, offsets, out.hidden.shape[0] * out.hidden.shape[1],
                              logits=self.logits(packed) if logits else None)
        aux = None if out.aux is None else out.aux.flatten(0, 1)
        flat = out.hidden.flatten(0, 1)
        computed = out.logits
        if logits:
            computed = self.logits(flat) if computed is None else computed.flatten(0, 1)
        return RaggedPass(flat, offsets, out.hidden.shape[0] * out.hidden.shape[1], aux, computed)

    def _run(self, slots: Sequence[int], runs: Sequence[Sequence[int]] | torch.Tensor,
             positions: torch.Tensor | None, tree_mask: torch.Tensor | None, ragged: bool,
             logits: bool = False) -> PassOutput:
        out = self.backend.run_pass(self.model, self.pool, slots, runs, positions, tree_mask, ragged, logits,
                                    self.aux_layers, self.graphs)
        if not out.replayed:  # a replayed pass keeps no layer inputs (none were asked for)
            self.last_aux = out.aux
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backend.compute_logits(self.model, hidden)

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

    def admission(self, running: list[Request], slot_of: Callable[[Request], int | None]) -> Admission:
        """The admission checks of one scheduling step against this runner's pool (``slot_of`` names
        each request's sequence in it, None before it has one)."""
        return Admission(self.pool, running, slot_of)
