"""Prefill and plain decode for a continuously changing batch of requests (no speculation)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.cache.prefix import PrefixCache
from infer.cache.protocol import CachePoolProtocol
from infer.core.model_runner import Admission, ModelRunner
from infer.core.request import Request, StepOutput
from infer.phases import PHASES
from infer.sampling.grammar import unpack_bitmasks
from infer.sampling.sampler import raw_logprobs, sample_with_logprobs
from infer.sampling.transforms import argmax_only, greedy_tokens

StepResult = list[tuple[Request, StepOutput]]


@dataclass
class PrefillChunk:
    """Feed ``num_tokens`` more prompt tokens of ``request`` this step."""

    request: Request
    num_tokens: int


@dataclass
class Sampled:
    """One token for each of some requests, and the target's final hidden state [len(outputs), hidden]
    at the position whose logits produced it (a drafter reading hidden states drafts from it)."""

    outputs: StepResult
    hidden: torch.Tensor | None
    # With ``ModelRunner.aux_layers``: per request fed this pass, the position of its first fed token
    # and the captured layer inputs of every token fed ([n, aux]), for an EAGLE-3 drafter.
    states: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)


class ContinuousRunner:
    """Owns the target model's runner and pool; one ``step`` = one batched prefill + one decode pass."""

    def __init__(self, runner: ModelRunner, prefix_cache: PrefixCache | None = None) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.prefix_cache = prefix_cache

    # -- the runner interface the scheduler uses -------------------------------------------------
    def step(self, prefill: list[PrefillChunk], decode: list[Request]) -> StepResult:
        return self.prefill(prefill).outputs + self.decode(decode).outputs

    def release(self, request: Request) -> None:
        """Free the request's KV slot. With prefix caching its whole computed blocks stay cached, the
        answer's too: a conversation's next turn sends the answer back inside its prompt. (A token's
        K/V are the same whether a decode step, a verification or a prefill computed it where the
        passes are row-exact, the C decoder stack's case; elsewhere as close as chunked prefill's.)"""
        if request.slot is not None:
            if self.prefix_cache is not None and request.finish_reason != "error":
                self.prefix_cache.insert(request.slot, request.all_token_ids[: request.num_computed_tokens],
                                         request.cache_salt)
            self.pool.free(request.slot)
            request.slot = None

    def rollback(self, request: Request, num_computed_tokens: int) -> None:
        """Undo a failed step: the request's cache goes back to its first ``num_computed_tokens``."""
        if request.slot is not None:
            self.pool.truncate_to(request.slot, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens

    def free_kv_tokens(self) -> int:
        return self.pool.free_kv_tokens()

    def kv_pools(self) -> dict[str, CachePoolProtocol]:
        return {"target": self.pool}

    def admission(self, running: list[Request]) -> Admission:
        """One step's checks of whether the pool can take a request while still finishing every
        running request (``Admission.fits``; called, extra 0)."""
        return self.runner.admission(running, lambda r: r.slot)

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk]) -> Sampled:
        """Feed prompt chunks; a request whose prompt is now complete gets its first token."""
        if not chunks:
            return Sampled([], None)
        for chunk in chunks:
            self.ensure_slot(chunk.request)
        since = PHASES.mark()
        states: list[tuple[int, Request, int, torch.Tensor]] = []
        last: dict[int, torch.Tensor] = {}  # chunk index -> its last hidden state, for prompts now complete
        for group in own_passes([c.num_tokens for c in chunks]):
            runs = [chunks[i].request.prompt_token_ids[chunks[i].request.num_computed_tokens:][: chunks[i].num_tokens]
                    for i in group]
            # Packed (ragged): padded, a short prompt would cost as many rows as the longest beside it.
            done_pass = self.runner.forward_ragged([chunks[i].request.slot for i in group], runs)  # type: ignore[misc]
            hidden, at, aux = done_pass.hidden, done_pass.offsets, done_pass.aux
            for b, i in enumerate(group):
                request = chunks[i].request
                if aux is not None:
                    states.append((i, request, request.num_computed_tokens, aux[at[b]: at[b + 1]]))
                if request.params.prompt_logprobs is not None:
                    self._prompt_logprobs(request, hidden[at[b]: at[b + 1]])
                request.num_computed_tokens += len(runs[b])
                if not request.is_prefilling:
                    last[i] = hidden[at[b + 1] - 1]
        in_order = [(request, position, captured) for _, request, position, captured in sorted(states, key=lambda s: s[0])]
        done = sorted(last)
        if not done:
            return Sampled([], None, in_order)
        if self.prefix_cache is not None:
            for i in done:
                request = chunks[i].request
                self.prefix_cache.insert(request.slot, request.prompt_token_ids,  # type: ignore[arg-type]
                                         request.cache_salt)
        sampled = self._sample([chunks[i].request for i in done], torch.stack([last[i] for i in done]), since)
        sampled.states = in_order
        return sampled

    def _prompt_logprobs(self, request: Request, hidden: torch.Tensor) -> None:
        """Logprobs of the prompt tokens this chunk's positions predict (the chunk's last position
        predicts the next chunk's first token, or the first generated one: not a prompt token)."""
        start = request.num_computed_tokens
        targets = request.prompt_token_ids[start + 1: start + hidden.shape[0] + 1]
        top = request.params.prompt_logprobs or 0
        del request.prompt_logprobs[start + 1:]  # a retried step (after a failure) recomputes its positions
        for at in range(0, len(targets), 256):  # bounded [rows, V] logits for a long chunk
            part = targets[at: at + 256]
            request.prompt_logprobs += raw_logprobs(self.runner.logits(hidden[at: at + len(part)]), part, top)

    def ensure_slot(self, request: Request) -> None:
        if request.slot is None:
            request.slot = self.pool.allocate()
            # Prompt logprobs need every prompt position computed: no cached blocks for such a request.
            if self.prefix_cache is not None and request.params.prompt_logprobs is None:
                cached = self.prefix_cache.attach(request.slot, request.prompt_token_ids, request.cache_salt)
                request.num_computed_tokens = cached
                request.metrics.prefix_cached_tokens = cached

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, requests: list[Request]) -> Sampled:
        """One plain decode step: feed each request's newest token, sample the next."""
        if not requests:
            return Sampled([], None)
        since = PHASES.mark()
        # One token a request: the pass's rows are the requests' last states (the logits computed in
        # the pass where the backend can: the C stack's call ends with the LM head).
        done = self.runner.forward_ragged([r.slot for r in requests], [[r.output_token_ids[-1]] for r in requests],  # type: ignore[misc]
                                          logits=True)
        aux = done.aux
        states = [] if aux is None else [(r, r.num_computed_tokens, aux[b: b + 1]) for b, r in enumerate(requests)]
        for r in requests:
            r.num_computed_tokens += 1
        sampled = self._sample(requests, done.hidden, since, done.logits)
        sampled.states = states
        return sampled

    def _sample(self, requests: list[Request], hidden: torch.Tensor, since: float,
                logits: torch.Tensor | None = None) -> Sampled:
        """The next token of each request from its last ``hidden`` state, or from its ``logits`` where the
        pass gave them (``since``: when the pass that gave it began, for the phase times)."""
        params = [r.params for r in requests]
        if logits is not None and argmax_only(params) and all(p.logprobs is None for p in params):
            # Greedy rows without logprobs (and so without a grammar): the argmax of the pass's logits,
            # as sample_with_logprobs would take it, without gathering what sampling would need.
            since = PHASES.add("model pass", since)
            tokens = greedy_tokens(logits)
            sampled = Sampled([(r, StepOutput(t, None)) for r, t in zip(requests, tokens.tolist(), strict=True)],
                              hidden)
            PHASES.add("sampling", since)
            return sampled
        # Sampling's operators over the vocabulary run as the backend wants host work around passes
        # (Backend.host_policy): on two threads they would leave OpenMP's workers spinning on the
        # cores the next pass's kernel threads need.
        with self.runner.host_work():
            if logits is None:
                logits = self.runner.logits(hidden)
            since = PHASES.add("model pass", since)
            tokens, logprobs = sample_with_logprobs(
                logits, params, [r.all_token_ids for r in requests],
                [r.random_source() for r in requests], grammar_masks(requests, logits.shape[-1], logits.device),
                [r.output_token_ids for r in requests],
            )
        sampled = Sampled([(r, StepOutput(t, lp)) for r, t, lp in zip(requests, tokens.tolist(), logprobs, strict=True)],
                          hidden)
        PHASES.add("sampling", since)
        return sampled


# A prompt chunk of at least this many tokens runs as a pass of its own; shorter ones share one packed
# pass. A packed pass goes to the C stack token by token (each its own sequence: the same bits), so
# a long chunk packed beside a short prompt loses what its rows share in attention (its context's
# key and value rows read once for several rows), which costs more than the pass it saves. A chunk
# this long already reuses every weight over its own rows, so its own pass costs only a pass's overhead.
OWN_PASS_TOKENS = 64


def own_passes(lengths: list[int]) -> list[list[int]]:
    """The chunks (by index, of these token counts) each prefill pass runs: every long chunk alone,
    the short ones together (see OWN_PASS_TOKENS)."""
    groups = [[i] for i, n in enumerate(lengths) if n >= OWN_PASS_TOKENS]
    short = [i for i, n in enumerate(lengths) if n < OWN_PASS_TOKENS]
    return groups + ([short] if short else [])


def grammar_masks(requests: list[Request], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """[B, V] bool: the tokens each request's grammar allows next (every token for a request without
    one); None when no request has a grammar."""
    if all(r.grammar is None for r in requests):
        return None
    words = max([(vocab_size + 31) // 32] + [r.grammar.words for r in requests if r.grammar is not None])
    bitmasks = torch.full((len(requests), words), -1, dtype=torch.int32)
    for b, request in enumerate(requests):
        if request.grammar is not None:
            bitmasks[b] = 0  # ids past the tokenizer's vocabulary are never allowed
            bitmasks[b, : request.grammar.words] = request.grammar.bitmask()
    return unpack_bitmasks(bitmasks, vocab_size, device)
