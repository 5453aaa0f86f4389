"""Prompt-lookup (n-gram) drafting: propose the tokens that followed an earlier copy of the suffix.

Rule: take the longest ``n`` in ``[min_n, max_n]`` for which the last ``n`` tokens also occur
earlier, i.e. as an occurrence that is followed by at least one token; among those occurrences use
the most recent one, and propose up to ``max_proposal`` tokens that followed it. A copy that runs
into the end of the sequence goes on with its own drafted tokens (period = the distance back to
the occurrence): text repeating with a short period drafts as far as the budget, not one period.
"""

from collections.abc import Iterable

import torch

from infer.core.request import Request
from infer.speculative.drafter import Drafter, DrafterInfo, Proposal, pad_proposals


def _check_args(min_n: int, max_n: int, max_proposal: int | None = None) -> None:
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"max_n must be >= min_n ({min_n}), got {max_n}")
    if max_proposal is not None and max_proposal < 1:
        raise ValueError(f"max_proposal must be >= 1, got {max_proposal}")


def _as_int_list(tokens: Iterable[int] | torch.Tensor) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        return [int(t) for t in tokens.tolist()]
    return [int(t) for t in tokens]


class NgramIndex:
    """Incremental n-gram index for one request, applying the rule above.

    Keeps, per n, a map from each n-gram to the end position of its most recent occurrence that
    is followed by a token. ``extend`` costs O(max_n - min_n + 1) per token and ``propose``
    O(max_n), so per-round drafting does not rescan the whole sequence.
    """

    def __init__(self, tokens: Iterable[int] | torch.Tensor = (), *, min_n: int = 1, max_n: int = 4) -> None:
        _check_args(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end index of latest occurrence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """Copy of the indexed sequence."""
        return list(self._tokens)

    def extend(self, new_tokens: Iterable[int] | torch.Tensor) -> None:
        """Append tokens to the sequence and index the n-grams that gained a follower."""
        toks = self._tokens
        for tok in _as_int_list(new_tokens):
            # The n-grams ending at the current last token become "earlier occurrences" only once a
            # token follows them, so index them now, before appending.
            end = len(toks) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last_end[tuple(toks[end - n + 1 : end + 1])] = end
            toks.append(tok)

    def match(self) -> tuple[int, int]:
        """``(n, end)``: the longest suffix length ``n`` with an earlier occurrence followed by a token,
        and where its latest occurrence ends; ``(0, -1)`` without one."""
        toks = self._tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            end = self._last_end.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                return n, end
        return 0, -1

    def propose(self, max_proposal: int = 5) -> list[int]:
        """Draft up to ``max_proposal`` tokens following the latest copy of the longest suffix."""
        _check_args(self.min_n, self.max_n, max_proposal)
        n, end = self.match()
        if not n:
            return []
        toks = self._tokens
        draft = toks[end + 1 : end + 1 + max_proposal]
        period = len(draft)  # < max_proposal only where the copy reached the sequence's end
        for i in range(period, max_proposal):
            draft.append(draft[i - period])
        return draft


class NgramDrafter(Drafter):
    """Prompt-lookup drafting: continue the longest recent n-gram seen in the prompt or output.

    Proposals are deterministic guesses, so the rejection sampler treats q as one-hot: a guess is
    accepted with probability p(t) and a rejection resamples from p with t removed, which keeps
    sampling exact. With no match a request drafts nothing and the round is a plain decode step.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, device: torch.device | str = "cpu") -> None:
        _check_args(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.device = torch.device(device)
        self.info = DrafterInfo()
        self._indexes: dict[str, NgramIndex] = {}

    def _index(self, request: Request) -> NgramIndex:
        """The request's index, with every token it has so far."""
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = NgramIndex(min_n=self.min_n, max_n=self.max_n)
        # Only the tokens since the last round (all_token_ids would copy the whole sequence).
        seen, prompt = len(index), request.prompt_token_ids
        index.extend(prompt[seen:] + request.output_token_ids[max(0, seen - len(prompt)):])
        return index

    def match_classes(self, requests: list[Request]) -> list[int]:
        """The matched suffix length per request (0: no match, no draft)."""
        return [self._index(request).match()[0] for request in requests]

    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        guesses = [self._index(request).propose(limit) if limit > 0 else []
                   for request, limit in zip(requests, budgets, strict=True)]
        return pad_proposals(guesses, self.device)

    def release(self, request: Request) -> None:
        self._indexes.pop(request.request_id, None)
