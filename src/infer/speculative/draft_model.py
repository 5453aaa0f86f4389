"""Draft-model drafter: a small model with its own KV pool drafts tokens autoregressively."""

from __future__ import annotations

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.core.model_runner import Admission, ModelRunner
from infer.core.request import Request
from infer.core.timing import device_clock
from infer.loader.tokenizer import Tokenizer
from infer.sampling.sampler import context_presence, output_counts, sample_rows
from infer.sampling.transforms import SamplingBatch, argmax_only, probs_from_logits
from infer.speculative.budget import EntropyStop
from infer.speculative.drafter import Drafter, DrafterInfo, Proposal


class DraftModelDrafter(Drafter):
    """Drafts with ``runner.model`` on ``runner.pool``; the draft cache is filled lazily.

    The draft cache of a request holds a prefix of its tokens. Each round first feeds whatever is
    missing (the whole prompt the first time: lazy prefill; afterwards the one or two tokens the
    last round accepted but the draft model never saw), then drafts one token per step, until the
    request's budget is reached or ``stop_rule`` ends its chain.
    """

    def __init__(self, runner: ModelRunner, cost_hint: float, stop_rule: EntropyStop | None = None) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.stop_rule = stop_rule
        self.info = DrafterInfo(cost_per_token=True, cost_hint=cost_hint)
        self.slots: dict[str, int] = {}
        self._fed_before_round: dict[str, int] = {}

    @property
    def kv_pool(self) -> CachePoolProtocol:
        return self.pool

    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        device = self.pool.device
        batch, width = len(requests), max(budgets)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        counts = [0] * batch
        # Greedy rows without a penalty draft the argmax, whose q is one-hot: a Proposal without
        # probs says exactly that, so such a batch forms no distributions at all.
        probs = sampling = presence = generated = None
        if not argmax_only([r.params for r in requests]):
            probs = torch.zeros(batch, width, self.runner.vocab_size, dtype=torch.float32, device=device)
            sampling = SamplingBatch.from_params([r.params for r in requests], device)
            presence = context_presence(sampling, [r.all_token_ids for r in requests], self.runner.vocab_size,
                                        device)
            generated = output_counts(sampling, [r.output_token_ids for r in requests], self.runner.vocab_size,
                                      device)

        active = [b for b in range(batch) if budgets[b] > 0]
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
        rows = torch.tensor(active, device=device)
        slots = [self.slots[requests[b].request_id] for b in active]
        while active:
            if step == 1:  # the first step may hold a whole prompt: time the single-token steps only
                steps_started = device_clock(device)
            hidden = self.runner.forward(slots, runs)
            last = hidden[:, -1] if isinstance(runs, torch.Tensor) else \
                self.runner.last_hidden(hidden, [len(r) for r in runs])
            logits = self.runner.logits(last)
            if probs is None or sampling is None:
                drafted = logits.argmax(dim=-1)
            else:
                q = probs_from_logits(logits, sampling.select(rows), None if presence is None else presence[rows],
                                      counts=None if generated is None else generated[rows])
                drafted = sample_rows(q, [requests[b].params.greedy for b in active],
                                      [requests[b].random_source(step) for b in active])
                probs[rows, step] = q
            tokens[rows, step] = drafted
            if presence is not None:
                presence[rows, drafted] = True
            if generated is not None:
                generated[rows, drafted] += 1
            for b in active:
                counts[b] += 1
            step += 1
            keep = [i for i, b in enumerate(active) if counts[b] < budgets[b]]
            if keep and self.stop_rule is not None:
                flags = self.stop_rule.keep_drafting([requests[active[i]] for i in keep], logits[keep], step).tolist()
                keep = [i for i, go in zip(keep, flags, strict=True) if go]
            # The next step's input stays on the device: no sync per draft token.
            runs = drafted.unsqueeze(1) if len(keep) == len(active) else drafted[keep].unsqueeze(1)
            if len(keep) < len(active):  # rows, slots: rebuilt only when a chain ends
                active = [active[i] for i in keep]
                rows = torch.tensor(active, device=device)
                slots = [self.slots[requests[b].request_id] for b in active]
        step_seconds = (device_clock(device) - steps_started) / (step - 1) if step > 1 else None
        return Proposal(tokens, counts, probs, step_seconds=step_seconds)

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
        if self.stop_rule is not None:
            self.stop_rule.release(request)

    def admission(self, running: list[Request]) -> Admission:
        return self.runner.admission(running, lambda r: self.slots.get(r.request_id))

    def _slot(self, request: Request) -> int:
        slot = self.slots.get(request.request_id)
        if slot is None:
            slot = self.slots[request.request_id] = self.pool.allocate()
        return slot


def check_compatible(draft_name: str, target_name: str, draft_vocab_size: int, target_vocab_size: int,
                     draft_tokenizer: Tokenizer, target_tokenizer: Tokenizer) -> None:
    """Draft and target must share the vocabulary (q and p index the same tokens) and EOS ids."""
    problems = []
    if draft_vocab_size != target_vocab_size:
        problems.append(f"model vocab sizes differ (draft {draft_vocab_size}, target {target_vocab_size})")
    if draft_tokenizer.vocab_size != target_tokenizer.vocab_size:
        problems.append(f"tokenizer sizes differ (draft {draft_tokenizer.vocab_size}, "
                        f"target {target_tokenizer.vocab_size})")
    elif draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        problems.append("tokenizers map tokens to different ids")
    if set(draft_tokenizer.eos_token_ids) != set(target_tokenizer.eos_token_ids):
        problems.append(f"EOS ids differ (draft {draft_tokenizer.eos_token_ids}, "
                        f"target {target_tokenizer.eos_token_ids})")
    if problems:
        raise ValueError(f"draft model {draft_name} cannot draft for {target_name}: " + "; ".join(problems))
