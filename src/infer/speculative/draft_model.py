"""Draft-model proposer: a small model with its own KV pool drafts tokens autoregressively."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from infer.engine.continuous_runner import kv_tokens_needed
from infer.engine.model_runner import ModelRunner
from infer.engine.request import Request
from infer.models.layers import count_weights
from infer.sampling.sampler import sample_from_probs
from infer.sampling.transforms import SamplingBatch, probs_from_logits, token_presence
from infer.speculative.proposer import Proposal, Proposer

if TYPE_CHECKING:
    from infer.engine.engine import Engine
    from infer.loader.tokenizer import Tokenizer

# Called after each draft step with the raw draft logits of the still-drafting rows and the step index;
# returns which of those rows keep drafting (the entropy length policy stops uncertain ones early).
ContinueFn = Callable[[list[Request], torch.Tensor, int], torch.Tensor]


class DraftModelProposer(Proposer):
    """Drafts with ``runner.model`` on ``runner.pool``; the draft cache is filled lazily.

    The draft cache of a request holds a prefix of its tokens. Each round first feeds whatever is
    missing (the whole prompt the first time: lazy prefill; afterwards the one or two tokens the
    last round accepted but the draft model never saw), then drafts one token per step.
    """

    name = "draft"

    def __init__(self, runner: ModelRunner, target_params: int, extra_tokens: int) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.extra_tokens = extra_tokens
        self.slots: dict[str, int] = {}
        self._fed_before_round: dict[str, int] = {}
        draft_params = count_weights(runner.model)
        self._cost_hint = draft_params / max(1, target_params)
        self.continue_fn: ContinueFn | None = None
        # Seconds per single-token draft step in the last round, timed apart from the first step
        # (whose catch-up run may hold a whole prompt); None when the round had one step only.
        self.last_step_seconds: float | None = None

    @property
    def relative_cost_hint(self) -> float:
        return self._cost_hint

    def propose(self, requests: list[Request], max_tokens: list[int]) -> Proposal:
        device = self.pool.device
        batch, width = len(requests), max(max_tokens)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        probs = torch.zeros(batch, width, self.runner.vocab_size, dtype=torch.float32, device=device)
        counts = [0] * batch
        sampling = SamplingBatch.from_params([r.params for r in requests], device)
        presence = token_presence([r.all_token_ids for r in requests], self.runner.vocab_size, device) \
            if sampling.use_penalty else None

        active = [b for b in range(batch) if max_tokens[b] > 0]
        catchup: list[list[int]] = []
        for b in active:
            request = requests[b]
            slot = self._slot(request)
            fed = self.pool.seq_len(slot)
            self._fed_before_round[request.request_id] = request.num_tokens
            catchup.append(request.all_token_ids[fed:])
        runs: list[list[int]] | torch.Tensor = catchup
        step = 0
        steps_started = 0.0
        while active:
            if step == 1:
                steps_started = _clock(device)
            slots = [self.slots[requests[b].request_id] for b in active]
            hidden = self.runner.forward(slots, runs)
            last = hidden[:, -1] if isinstance(runs, torch.Tensor) else \
                self.runner.last_hidden(hidden, [len(r) for r in runs])
            logits = self.runner.logits(last)
            rows = torch.tensor(active, device=device)
            sub = sampling.select(rows)
            q = probs_from_logits(logits, sub, None if presence is None else presence[rows])
            drafted = q.argmax(dim=-1)
            sampled = [i for i, b in enumerate(active) if not requests[b].params.greedy]
            if sampled:
                drafted[sampled] = sample_from_probs(q[sampled], [requests[active[i]].generator for i in sampled])
            tokens[rows, step] = drafted
            probs[rows, step] = q
            if presence is not None:
                presence[rows, drafted] = True
            for b in active:
                counts[b] += 1
            step += 1
            keep = [i for i, b in enumerate(active) if counts[b] < max_tokens[b]]
            if keep and self.continue_fn is not None:
                flags = self.continue_fn([requests[active[i]] for i in keep], logits[keep], step).tolist()
                keep = [i for i, go in zip(keep, flags, strict=True) if go]
            runs = drafted[keep].unsqueeze(1)  # stays on the device: no sync per draft token
            active = [active[i] for i in keep]
        self.last_step_seconds = (_clock(device) - steps_started) / (step - 1) if step > 1 else None
        return Proposal(tokens, counts, probs)

    def accepted(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        # The draft cache saw the round's start tokens plus drafts t_1..t_{k-1}; keep the accepted ones.
        slot = self.slots.get(request.request_id)
        if slot is None or num_proposed == 0:
            return
        before = self._fed_before_round.pop(request.request_id)
        self.pool.truncate_to(slot, before + min(num_accepted, num_proposed - 1))

    def release(self, request: Request) -> None:
        slot = self.slots.pop(request.request_id, None)
        if slot is not None:
            self.pool.free(slot)
        self._fed_before_round.pop(request.request_id, None)

    def can_admit(self, request: Request, running: list[Request], extra: int) -> bool:
        committed = sum(self._need(r, extra) for r in running)
        return self._need(request, extra) <= self.pool.free_kv_tokens() - committed

    def free_kv_tokens(self) -> int | None:
        return self.pool.free_kv_tokens()

    def _need(self, request: Request, extra: int) -> int:
        return kv_tokens_needed(self.pool, self.slots.get(request.request_id), request.max_total_tokens + extra)

    def _slot(self, request: Request) -> int:
        slot = self.slots.get(request.request_id)
        if slot is None:
            slot = self.slots[request.request_id] = self.pool.allocate()
        return slot



def _clock(device: torch.device) -> float:
    """Wall time after the device's queued work is done (one sync, only for timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def load_draft_proposer(engine: Engine, max_draft: int) -> DraftModelProposer:
    """Load ``engine.config.draft_model`` and check it can draft for the target."""
    from infer.engine.engine import build_pool
    from infer.loader import load_model, load_tokenizer

    config = engine.config
    assert config.draft_model is not None
    model, model_config = load_model(config.draft_model, engine.dtype, str(engine.device))
    tokenizer = load_tokenizer(config.draft_model, model_config)
    check_compatible(engine, model_config.vocab_size, tokenizer)
    # Same backend and sequence length as the target; its own (smaller) per-token footprint.
    pool = build_pool(config, model_config, engine.max_seq_len, engine.device, engine.dtype)
    target_params = count_weights(engine.model)
    return DraftModelProposer(ModelRunner(model, pool), target_params, max_draft + 1)


def check_compatible(engine: Engine, draft_vocab_size: int, draft_tokenizer: Tokenizer) -> None:
    """Draft and target must share the vocabulary (q and p index the same tokens) and EOS ids."""
    target_tok = engine.tokenizer
    problems = []
    if draft_vocab_size != engine.model_config.vocab_size:
        problems.append(f"model vocab sizes differ (draft {draft_vocab_size}, target {engine.model_config.vocab_size})")
    if draft_tokenizer.vocab_size != target_tok.vocab_size:
        problems.append(f"tokenizer sizes differ (draft {draft_tokenizer.vocab_size}, target {target_tok.vocab_size})")
    elif draft_tokenizer.get_vocab() != target_tok.get_vocab():
        problems.append("tokenizers map tokens to different ids")
    if set(draft_tokenizer.eos_token_ids) != set(target_tok.eos_token_ids):
        problems.append(f"EOS ids differ (draft {draft_tokenizer.eos_token_ids}, target {target_tok.eos_token_ids})")
    if problems:
        raise ValueError(f"draft model {engine.config.draft_model} cannot draft for {engine.config.model}: "
                         + "; ".join(problems))
