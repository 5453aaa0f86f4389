"""Tests for the prompt-lookup n-gram drafter."""

import random

import pytest
import torch

from infer.speculative.ngram import NgramIndex


def propose_ngram(tokens: list[int] | torch.Tensor, min_n: int = 1, max_n: int = 4, max_proposal: int = 5) -> list[int]:
    """The drafter's rule applied to a whole sequence at once: an index built from it in one go."""
    return NgramIndex(tokens, min_n=min_n, max_n=max_n).propose(max_proposal)


def _brute_force(tokens: list[int], min_n: int, max_n: int, max_proposal: int) -> list[int]:
    """Literal reading of the rule, used as an oracle."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        # Occurrences that end before the last token, scanned most recent first.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                # The copy goes on past the sequence's end through the tokens it drafted itself.
                extended = list(tokens)
                for i in range(max_proposal):
                    extended.append(extended[start + n + i])
                return extended[start + n : start + n + max_proposal]
    return []


def test_longest_match_wins() -> None:
    # Suffix [7, 8, 9]: the 1-gram [9] last occurred before 50, but the 3-gram [7, 8, 9] before 1.
    tokens = [7, 8, 9, 1, 2, 3, 9, 50, 51, 7, 8, 9]
    assert propose_ngram(tokens, max_n=3, max_proposal=3) == [1, 2, 3]
    # Capping max_n at 1 makes the most recent 1-gram occurrence win instead.
    assert propose_ngram(tokens, max_n=1, max_proposal=3) == [50, 51, 7]


def test_most_recent_occurrence_wins() -> None:
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 5, 1, 2]
    assert propose_ngram(tokens, min_n=2, max_n=2, max_proposal=2) == [20, 21]


def test_no_match_returns_empty() -> None:
    assert propose_ngram([1, 2, 3, 4, 5]) == []
    assert propose_ngram([]) == []
    assert propose_ngram([3]) == []
    # A 1-gram match exists but min_n demands 2.
    assert propose_ngram([4, 1, 2, 3, 4], min_n=2) == []


def test_proposal_cut_at_max_proposal_and_continued_past_the_end() -> None:
    tokens = [5, 6, 1, 2, 3, 4, 5, 6]
    assert propose_ngram(tokens, max_n=2, max_proposal=3) == [1, 2, 3]
    # Past the end the copy repeats its period (6 tokens back): as far as the budget goes.
    assert propose_ngram(tokens, max_n=2, max_proposal=9) == [1, 2, 3, 4, 5, 6, 1, 2, 3]
    # Overlapping repeat: the most recent [1, 1] occurrence ends one before the last token.
    assert propose_ngram([1, 1, 1, 1], max_n=2, max_proposal=5) == [1] * 5


def test_accepts_tensor_input() -> None:
    tokens = [9, 3, 4, 8, 9, 3]
    assert propose_ngram(torch.tensor(tokens)) == propose_ngram(tokens) == [4, 8, 9, 3, 4]
    with pytest.raises(ValueError, match="1-D"):
        propose_ngram(torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_n": 0}, "min_n"),
        ({"min_n": 3, "max_n": 2}, "max_n"),
        ({"max_proposal": 0}, "max_proposal"),
    ],
)
def test_arguments_validated(kwargs: dict[str, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        propose_ngram([1, 2, 1], **kwargs)


def test_index_arguments_validated() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(min_n=0)
    with pytest.raises(ValueError, match="max_n"):
        NgramIndex(min_n=2, max_n=1)
    with pytest.raises(ValueError, match="max_proposal"):
        NgramIndex([1, 2, 1]).propose(0)


def test_function_and_index_match_oracle_on_random_sequences() -> None:
    rng = random.Random(1234)
    for _ in range(150):
        vocab = rng.choice([2, 3, 5, 20])
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        max_proposal = rng.randint(1, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]

        index = NgramIndex(min_n=min_n, max_n=max_n)
        # Grow the index in random chunks and compare at every step, as an engine would per round.
        pos = 0
        while True:
            prefix = tokens[:pos]
            expected = _brute_force(prefix, min_n, max_n, max_proposal)
            assert propose_ngram(prefix, min_n=min_n, max_n=max_n, max_proposal=max_proposal) == expected
            assert index.propose(max_proposal) == expected
            if pos == len(tokens):
                break
            step = rng.randint(1, 4)
            index.extend(tokens[pos : pos + step])
            pos = min(pos + step, len(tokens))
        assert index.tokens == tokens and len(index) == len(tokens)


def test_long_sequence_matches_oracle() -> None:
    # Realistic length (a few thousand tokens) with a small vocabulary, so long matches exist.
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (4000,), generator=gen).tolist()
    expected = _brute_force(tokens, 1, 4, 5)
    assert propose_ngram(tokens) == expected
    assert NgramIndex(tokens).propose() == expected
