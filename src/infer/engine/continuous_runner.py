"""Prefill and plain decode for a continuously changing batch of requests (no speculation)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.cache.prefix import PrefixCache
from infer.cache.protocol import CachePoolProtocol
from infer.engine.model_runner import ModelRunner
from infer.engine.request import Request, StepOutput
from infer.sampling.sampler import sample_next_tokens

StepResult = list[tuple[Request, StepOutput]]
# Receives the target's final hidden state [B, hidden] of the position whose logits just produced
# each request's newest token (Medusa heads draft from it).
HiddenListener = Callable[[list[Request], torch.Tensor], None]


@dataclass
class PrefillChunk:
    """Feed ``num_tokens`` more prompt tokens of ``request`` this step."""

    request: Request
    num_tokens: int


def kv_tokens_needed(pool: CachePoolProtocol, slot: int | None, total_tokens: int) -> int:
    """Tokens ``pool`` must still supply for the sequence in ``slot`` (None: not yet allocated) to
    reach ``total_tokens`` (capped at the pool's max_seq_len)."""
    block = getattr(pool, "block_size", None)
    if block is None:  # slotted: a whole slot, already taken once allocated
        return 0 if slot is not None else pool.max_seq_len
    total = min(pool.max_seq_len, total_tokens)
    held = 0 if slot is None else math.ceil(pool.seq_len(slot) / block) * block
    return max(0, math.ceil(total / block) * block - held)


class ContinuousRunner:
    """Owns the target model's runner and pool; one ``step`` = one batched prefill + one decode pass."""

    def __init__(self, runner: ModelRunner, prefix_cache: PrefixCache | None = None) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.prefix_cache = prefix_cache
        self.hidden_listener: HiddenListener | None = None  # set by a speculative runner that needs it

    # -- the runner interface the scheduler uses -------------------------------------------------
    def step(self, prefill: list[PrefillChunk], decode: list[Request]) -> StepResult:
        return self.prefill(prefill) + self.decode(decode)

    def free_slot(self, request: Request) -> None:
        if request.slot is not None:
            self.pool.free(request.slot)
            request.slot = None

    def cleanup_request(self, request: Request) -> None:
        """Forget per-request state (none here; the speculative runner keeps drafter state)."""

    def free_kv_tokens(self) -> int:
        return self.pool.free_kv_tokens()

    def can_admit(self, request: Request, running: list[Request], extra: int = 0) -> bool:
        """Whether the pool can take ``request`` while still finishing every running request."""
        def need(r: Request) -> int:
            return kv_tokens_needed(self.pool, r.slot, r.max_total_tokens + extra)

        return need(request) <= self.pool.free_kv_tokens() - sum(need(r) for r in running)

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk]) -> StepResult:
        """Feed prompt chunks; a request whose prompt is now complete gets its first token."""
        if not chunks:
            return []
        for chunk in chunks:
            self.ensure_slot(chunk.request)
        slots = [c.request.slot for c in chunks]
        runs = [c.request.prompt_token_ids[c.request.num_computed_tokens:][: c.num_tokens] for c in chunks]
        hidden = self.runner.forward(slots, runs)  # type: ignore[arg-type]
        for chunk, run in zip(chunks, runs, strict=True):
            chunk.request.num_computed_tokens += len(run)
        done = [i for i, c in enumerate(chunks) if not c.request.is_prefilling]
        if not done:
            return []
        if self.prefix_cache is not None:
            for i in done:
                request = chunks[i].request
                self.prefix_cache.insert(request.slot, request.prompt_token_ids)  # type: ignore[arg-type]
        last = self.runner.last_hidden(hidden, [len(r) for r in runs])[done]
        requests = [chunks[i].request for i in done]
        if self.hidden_listener is not None:
            self.hidden_listener(requests, last)
        return self._sample(requests, self.runner.logits(last))

    def ensure_slot(self, request: Request) -> None:
        if request.slot is None:
            request.slot = self.pool.allocate()
            if self.prefix_cache is not None:
                cached = self.prefix_cache.attach(request.slot, request.prompt_token_ids)
                request.num_computed_tokens = cached
                request.metrics.prefix_cached_tokens = cached

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, requests: list[Request]) -> StepResult:
        """One plain decode step: feed each request's newest token, sample the next."""
        if not requests:
            return []
        hidden = self.runner.forward([r.slot for r in requests], [[r.output_token_ids[-1]] for r in requests])  # type: ignore[misc]
        for r in requests:
            r.num_computed_tokens += 1
        if self.hidden_listener is not None:
            self.hidden_listener(requests, hidden[:, -1])
        return self._sample(requests, self.runner.logits(hidden[:, -1]))

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> StepResult:
        tokens = sample_next_tokens(
            logits,
            [r.params for r in requests], [r.all_token_ids for r in requests], [r.generator for r in requests],
        ).tolist()
        return [(r, StepOutput(t)) for r, t in zip(requests, tokens, strict=True)]
