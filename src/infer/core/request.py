"""A request's life: prompt, sampling state, generated tokens, stop checks and metrics."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import torch

from infer.core.detokenizer import IncrementalDetokenizer
from infer.sampling.grammar import GrammarMatcher
from infer.sampling.params import SamplingParams
from infer.sampling.sampler import KeyedDraw, RandomSource, TokenLogprobs


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class StepOutput:
    """One token emitted for a request in an engine step.

    Speculative decoding may emit several ``StepOutput`` for one request in one step (the accepted
    drafts and the correction/bonus token), always in order.
    """

    token_id: int
    logprobs: TokenLogprobs | None = None  # when the request asks for logprobs


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Speculative decoding (zero when speculation is off).
    num_rounds: int = 0  # target verification passes
    proposed_tokens: int = 0  # drafts judged: a chain's length, a tree's deepest path checked
    draft_nodes: int = 0  # drafts the target verified: a chain's length, every node of a tree
    accepted_tokens: int = 0
    rejected_rounds: int = 0  # rounds that ended on a rejected draft (the rest accepted every draft)
    accepted_per_position: list[int] = field(default_factory=list)  # how often draft i+1 was accepted
    proposed_per_position: list[int] = field(default_factory=list)  # how often draft i+1 was proposed
    prefix_cached_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.first_token_time is None or self.finish_time is None or self.generated_tokens < 2:
            return None
        elapsed = self.finish_time - self.first_token_time
        return (self.generated_tokens - 1) / elapsed if elapsed > 0 else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None

    @property
    def alpha(self) -> float | None:
        """Per-draft acceptance probability (the paper's α): accepted / drafts actually judged.

        A round stops at its first rejection, so drafts after it were never judged; unlike
        ``acceptance_rate`` this does not depend on the draft length K.
        """
        judged = self.accepted_tokens + self.rejected_rounds
        return self.accepted_tokens / judged if judged else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Tokens emitted per target verification pass (accepted drafts + the one target token)."""
        return (self.accepted_tokens + self.num_rounds) / self.num_rounds if self.num_rounds else None

    def record_round(self, proposed: int, accepted: int, nodes: int) -> None:
        self.num_rounds += 1
        self.draft_nodes += nodes
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.rejected_rounds += accepted < proposed
        for per_pos in (self.proposed_per_position, self.accepted_per_position):
            if len(per_pos) < proposed:
                per_pos.extend([0] * (proposed - len(per_pos)))
        for i in range(proposed):
            self.proposed_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("arrival_time", "first_token_time", "finish_time"):
            out.pop(name)
        out["time_to_first_token"] = self.time_to_first_token
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        out["acceptance_rate"] = self.acceptance_rate
        out["alpha"] = self.alpha
        out["mean_accepted_tokens"] = self.mean_accepted_tokens
        out["acceptance_by_position"] = [
            a / p if p else None for a, p in zip(self.accepted_per_position, self.proposed_per_position, strict=True)
        ]
        return out


class Request:
    """State of one generation request inside the engine."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, eos_token_ids: list[int], max_seq_len: int,
                 device: torch.device, prompt: str | None = None, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        # Prefix-cache isolation: requests share cached KV blocks only when their salts are equal.
        self.cache_salt = cache_salt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprobs] = []  # one per generated token when params.logprobs is set
        # With params.prompt_logprobs: None for the first prompt token, then one per prompt token.
        self.prompt_logprobs: list[TokenLogprobs | None] = [None] if params.prompt_logprobs is not None else []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.detokenizer = detokenizer
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.max_seq_len = max_seq_len
        self.num_computed_tokens = 0  # tokens whose K/V are in the target cache
        self.slot: int | None = None
        self.metrics = RequestMetrics(prompt_tokens=len(prompt_token_ids), arrival_time=time.perf_counter())
        # Each request draws from its own generator, so its samples do not depend on the batch it is in.
        # A seeded request draws each token from noise keyed by its seed and the token's position
        # instead (``random_source``), so its tokens depend on nothing else, not even speculation.
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # The structured_output grammar's state, fed every emitted token (the engine sets it).
        self.grammar: GrammarMatcher | None = None

    def random_source(self, ahead: int = 0) -> RandomSource:
        """Where the randomness of the token ``ahead`` positions past the next one comes from: a
        seeded request's ``KeyedDraw`` at that position, else the request's generator (whose stream
        the draws consume in order)."""
        if self.params.seed is None:
            return self.generator
        return KeyedDraw(self.params.seed, len(self.output_token_ids) + ahead)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def context_room(self) -> int:
        """Positions left in the context after the pending token: what one verification pass may add."""
        return max(0, self.max_seq_len - self.num_tokens)

    @property
    def draft_room(self) -> int:
        """Draft tokens one verification pass may add for this request: the context's room, within the
        request's own ``max_draft_tokens`` (0 when it turned speculation off)."""
        if not self.params.speculate:
            return 0
        cap = self.params.max_draft_tokens
        return self.context_room if cap is None else min(cap, self.context_room)

    @property
    def tokens_left(self) -> int:
        """Tokens this request may still emit after the pending one (drafts past them are discarded)."""
        return max(0, self.params.max_tokens - len(self.output_token_ids) - 1)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold in a KV cache."""
        return min(self.max_seq_len, len(self.prompt_token_ids) + self.params.max_tokens)

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> bool:
        """Record a generated token and apply the stop rules; True when the request is now finished."""
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if not self.output_token_ids:
            self.metrics.first_token_time = time.perf_counter()
        self.output_token_ids.append(token_id)
        self.metrics.generated_tokens = len(self.output_token_ids)
        # The grammar's verdict on this token, as plain decoding reaches it after every token: a
        # refusal, or no mask after it, ends the request here (and a round's later tokens with it).
        grammar_error = None if self.grammar is None else self.grammar.consume(token_id)
        stop_hit = self.detokenizer.append(token_id, self.params.stop)
        if token_id in self.stop_token_ids or token_id in self.eos_token_ids or stop_hit:
            self.finish("stop")
        elif len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= self.max_seq_len:
            self.finish("length")
        elif grammar_error is not None:
            self.finish("grammar_error", grammar_error)
        return self.is_finished

    def finish(self, reason: str, error: str | None = None) -> None:
        self.detokenizer.flush()
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.metrics.finish_time = time.perf_counter()


def speculation_stats(outputs: Sequence[Any]) -> dict[str, Any]:
    """α, acceptance rate, tokens per target pass and acceptance by draft position over ``outputs``
    (anything with a ``metrics: RequestMetrics``: requests, or the engine's outputs)."""
    accepted = sum(o.metrics.accepted_tokens for o in outputs)
    proposed = sum(o.metrics.proposed_tokens for o in outputs)
    rounds = sum(o.metrics.num_rounds for o in outputs)
    rejected = sum(o.metrics.rejected_rounds for o in outputs)
    width = max((len(o.metrics.proposed_per_position) for o in outputs), default=0)
    by_pos: list[float | None] = []
    for i in range(width):
        prop = sum(o.metrics.proposed_per_position[i] for o in outputs if i < len(o.metrics.proposed_per_position))
        acc = sum(o.metrics.accepted_per_position[i] for o in outputs if i < len(o.metrics.accepted_per_position))
        by_pos.append(acc / prop if prop else None)
    rounds_by_length = [rounds] + [0] * width
    for i in range(width):  # rounds that drafted exactly i + 1 tokens: at least i + 1, not i + 2
        at_least = sum(o.metrics.proposed_per_position[i] for o in outputs if i < len(o.metrics.proposed_per_position))
        rounds_by_length[i + 1] = at_least
        rounds_by_length[i] -= at_least
    return {
        "rounds_by_length": rounds_by_length,
        "alpha": accepted / (accepted + rejected) if accepted + rejected else None,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_tokens": (accepted + rounds) / rounds if rounds else None,
        "acceptance_by_position": by_pos,
    }
