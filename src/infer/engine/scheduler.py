"""Continuous batching: each step retire, admit within KV capacity, and form prefill/decode work.

The scheduler sees only the runner interface (``can_admit``, ``release``); it never knows whether
speculation is on. With a prefix cache, a request whose prompt is being prefilled right now (the
same token ids and cache salt: the ``n`` copies of one prompt, or clients sending the same prompt
at once) is admitted once that prefill is done, so it attaches to the prompt's cached blocks
instead of computing them again.
"""

from __future__ import annotations

from collections import deque
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
    def can_admit(self, request: Request, running: list[Request]) -> bool: ...


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queue``; the caller should retry later (HTTP 429)."""


@dataclass
class ScheduledBatch:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, runner: Runner, *, max_batch_size: int, max_queue: int, chunked_prefill: bool,
                 max_prefill_tokens: int, prefix_cache: PrefixCache | None = None) -> None:
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.chunked_prefill = chunked_prefill
        self.max_prefill_tokens = max_prefill_tokens
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
        budget = self.max_prefill_tokens if self.chunked_prefill else None
        for request in self.running:
            if not request.is_prefilling:
                batch.decode.append(request)
                continue
            remaining = len(request.prompt_token_ids) - request.num_computed_tokens
            if budget is None:
                batch.prefill.append(PrefillChunk(request, remaining))
            elif budget > 0:
                take = min(remaining, budget)
                batch.prefill.append(PrefillChunk(request, take))
                budget -= take
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
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            if self._prompt_being_prefilled(request):
                break  # admitted next step, onto the cached blocks (first come, first served)
            if not self.runner.can_admit(request, self.running):
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
