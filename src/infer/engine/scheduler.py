"""Continuous batching: each step retire, admit within KV capacity, and form prefill/decode work.

The scheduler sees only the runner interface (``admission``, ``release``); it never knows whether
speculation is on. With a prefix cache, a request whose prompt is being prefilled right now (the
same token ids and cache salt: the ``n`` copies of one prompt, or clients sending the same prompt
at once) is admitted once that prefill is done, so it attaches to the prompt's cached blocks
instead of computing them again.

With chunked prefill, the step's prompt-token budget is shared fairly among the requests prefilling
(``prefill_shares``): each gets an equal share of it, and what a request does not need goes to the
others, so a short prompt admitted behind a long one is prefilled in the next step instead of after
every chunk of the long one. A token is charged more the more keys it attends to
(``attention_span``): a chunk deep into a long prompt costs more than the same number of tokens at
its start, so a step's duration, which bounds a newcomer's time to its first token, stays about that
of a budget's worth of tokens at a short context.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from infer.cache.protocol import CachePoolProtocol
from infer.core.request import Request, RequestStatus
from infer.engine.continuous_runner import PrefillChunk, StepResult

if TYPE_CHECKING:
    from infer.cache.prefix import PrefixCache


class Runner(Protocol):
    def step(self, prefill: list[PrefillChunk], decode: list[Request]) -> StepResult: ...
    def release(self, request: Request) -> None: ...  # free everything held for a finished request
    # undo a failed step: the request's caches go back to ``num_computed_tokens``, drafter state dropped
    def rollback(self, request: Request, num_computed_tokens: int) -> None: ...
    def free_kv_tokens(self) -> int: ...
    def kv_pools(self) -> dict[str, CachePoolProtocol]: ...
    # whether a request fits besides ``running``, for one step's admissions (``running`` grows by append)
    def admission(self, running: list[Request]) -> Callable[[Request], bool]: ...


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queue``; the caller should retry later (HTTP 429)."""


@dataclass
class ScheduledBatch:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def attention_span(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                   gated: bool = True) -> float:
    """The context length at which a token's attention costs as much as its layer's projections:
    a token attending to c keys does 2 * heads * head_dim multiply-adds per key (scores and values)
    against the layer's weights' multiply-adds (q/k/v, o and the MLP's two or three matrices)."""
    weights = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    weights += (3 if gated else 2) * hidden * intermediate
    return weights / (2 * heads * head_dim)


def prefill_shares(remaining: Sequence[int], contexts: Sequence[int], budget: int,
                   span: float | None = None) -> list[int]:
    """The prompt tokens each prefilling request takes this step (``remaining[i]`` left to prefill,
    ``contexts[i]`` already in its cache): the budget water-filled in equal shares, a request whose
    whole rest costs less than its share taking just that and the others splitting what it left.
    A token at context c costs ``1 + c / span`` (``span``: ``attention_span``; None: every token 1),
    its chunk's first token's cost for all of them. Every request with tokens left gets at least one
    while the budget has tokens (none waits behind the others), and the shares never add up to more
    than ``budget`` tokens."""
    n = len(remaining)
    cost = [1.0 if span is None else 1.0 + c / span for c in contexts]
    take = [0] * n
    left = float(budget)
    order = sorted((i for i in range(n) if remaining[i] > 0), key=lambda i: remaining[i] * cost[i])
    for k, i in enumerate(order):
        share = left / (len(order) - k)
        # At least one token while the budget has tokens: the floor may overdraw the cost, never the tokens.
        take[i] = min(remaining[i], max(1, math.floor(share / cost[i] + 1e-9)), budget - sum(take))
        left -= take[i] * cost[i]
    return take


class Scheduler:
    def __init__(self, runner: Runner, *, max_batch_size: int, max_queue: int, chunked_prefill: bool,
                 max_prefill_tokens: int, prefix_cache: PrefixCache | None = None,
                 attention_span: float | None = None) -> None:
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.chunked_prefill = chunked_prefill
        self.max_prefill_tokens = max_prefill_tokens
        self.attention_span = attention_span  # see prefill_shares; None: a prompt token costs 1 anywhere
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rejected: list[Request] = []  # finished at admission; the engine reports them once

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"the request queue is full ({self.max_queue} waiting)")
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self.retire()
        self._admit()
        batch = ScheduledBatch()
        prefilling = [r for r in self.running if r.is_prefilling]
        batch.decode = [r for r in self.running if not r.is_prefilling]
        remaining = [len(r.prompt_token_ids) - r.num_computed_tokens for r in prefilling]
        if not self.chunked_prefill:
            takes = remaining
        else:
            takes = prefill_shares(remaining, [r.num_computed_tokens for r in prefilling], self.max_prefill_tokens,
                                   self.attention_span)
        # In admission order (first come, first served), each with its fair share of the budget.
        batch.prefill = [PrefillChunk(r, n) for r, n in zip(prefilling, takes, strict=True) if n > 0]
        return batch

    def retire(self) -> list[Request]:
        """Free every finished request's KV and drop it from the running set."""
        done = [r for r in self.running if r.is_finished]
        for request in done:
            self.release(request)
        self.running = [r for r in self.running if not r.is_finished]
        return done

    def release(self, request: Request) -> None:
        self.runner.release(request)

    def abort(self, request_id: str, error: str | None = None) -> Request | None:
        """Stop a request now; its KV blocks are freed immediately. It finishes with "abort"
        (client gone), or with "error" and the message ``error``."""
        for queue in (self.waiting, self.running):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    if not request.is_finished:
                        request.finish("abort" if error is None else "error", error)
                    self.release(request)
                    return request
        return None

    def _admit(self) -> None:
        if not self.waiting:  # most steps: no checks to make
            return
        fits = self.runner.admission(self.running)
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            if self._prompt_being_prefilled(request):
                break  # admitted next step, onto the cached blocks (first come, first served)
            if not fits(request):
                if not self.running:  # even an idle pool cannot hold it: fail it rather than wait forever
                    self.waiting.popleft()
                    request.finish("error", "the request needs more KV cache than the whole pool holds "
                                            "(raise num_kv_blocks or lower max_tokens)")
                    self.rejected.append(request)
                    continue
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _prompt_being_prefilled(self, request: Request) -> bool:
        """Whether a running request is prefilling the same prompt (same salt) now: with a prefix
        cache, ``request`` reuses its blocks if admitted once that prefill is done."""
        cache = self.prefix_cache
        if cache is None or request.params.prompt_logprobs is not None:  # such a request attaches nothing
            return False
        if len(request.prompt_token_ids) <= cache.block_size:  # no full block to share
            return False
        return any(r.is_prefilling and r.cache_salt == request.cache_salt
                   and r.prompt_token_ids == request.prompt_token_ids for r in self.running)
