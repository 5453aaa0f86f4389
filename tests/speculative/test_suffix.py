"""Suffix decoding: the counted suffix trie, its memory bound, greedy parity and sampling exactness
through the whole engine, and tenant isolation.

The trie is checked against brute force (substring counts, longest matching suffix, best-first
trees). Through the engine, a second pass over the same prompts drafts from the first pass's
outputs, so long paths are accepted and rounds end mid-tree on stop rules; sampled output is
compared with the target's exact distribution with the harness of ``helpers.py`` (as in ``test_exactness.py``).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import infer.speculative.verification as verification
from helpers import (
    DRAFTER_PROMPTS,
    KV_BACKENDS,
    P_CONTROL,
    PROMPT,
    TREE_CONFIGS,
    TREE_NUM_SAMPLES,
    assert_follows_reference,
    generate_unseeded,
    grouped_chisquare,
    reference,
)
from infer import LLM, EngineConfig, RequestOutput, SamplingParams
from infer.cli import build_parser, main
from infer.core.request import Request
from infer.speculative.drafter import Proposal
from infer.speculative.suffix import SuffixDrafter
from infer.speculative.suffix_trie import ROOT, SuffixStore, SuffixTrie

# =============================================================================== the trie


def substring_counts(sequences: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, depth + 1):
                if i + n <= len(seq):
                    counts[tuple(seq[i: i + n])] += 1
    return counts


def continued(sequences: list[list[int]], path: tuple[int, ...]) -> bool:
    """Whether ``path`` occurs in some sequence followed by another token."""
    n = len(path)
    return any(tuple(seq[i: i + n]) == path for seq in sequences for i in range(len(seq) - n))


def test_counts_are_substring_occurrences_while_sequences_grow_and_go() -> None:
    rng = random.Random(0)
    depth = 4
    trie = SuffixTrie(depth)
    sequences: dict[str, list[int]] = {}
    for step in range(300):
        name = f"s{rng.randrange(6)}"
        if rng.random() < 0.1 and name in sequences:
            trie.remove(name)
            del sequences[name]
        else:
            chunk = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            trie.extend(name, chunk)
            sequences.setdefault(name, []).extend(chunk)
        if step % 25 == 0 or step == 299:
            expected = substring_counts(list(sequences.values()), depth)
            for length in range(1, depth + 1):
                for path in itertools.product(range(3), repeat=length):
                    assert trie.count(path) == expected[path], (path, step)
            assert trie.num_nodes == len(expected)  # one node per distinct substring, no leftovers
            assert trie.num_tokens == sum(map(len, sequences.values()))
    for name in list(sequences):
        trie.remove(name)
    assert trie.num_nodes == 0 and trie.num_tokens == 0 and trie.num_sequences == 0


def test_continuations_count_what_followed() -> None:
    trie = SuffixTrie(3)
    trie.extend("a", [1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert trie.continuations([1, 2]) == {3: 2, 4: 1}
    assert trie.continuations([2, 3]) == {1: 1}  # the trailing 2, 3 has no follower
    assert trie.continuations([9]) == {}
    with pytest.raises(ValueError, match="deeper"):
        trie.count([1, 2, 3, 1])
    with pytest.raises(ValueError, match="out of range"):
        trie.extend("a", [-1])
    with pytest.raises(ValueError, match="depth"):
        SuffixTrie(1)


def test_match_is_the_longest_suffix_that_occurred_with_a_continuation() -> None:
    rng = random.Random(1)
    for _ in range(200):
        depth = rng.randint(2, 6)
        sequences = [[rng.randrange(3) for _ in range(rng.randint(0, 15))] for _ in range(rng.randint(1, 3))]
        trie = SuffixTrie(depth)
        for i, seq in enumerate(sequences):
            trie.extend(i, seq)
        context = [rng.randrange(3) for _ in range(rng.randint(0, 8))]
        max_length = rng.randint(1, 8)
        expected = 0
        for n in range(1, min(max_length, len(context), depth - 1) + 1):
            if continued(sequences, tuple(context[len(context) - n:])):
                expected = n
        node, length = trie.match(context, max_length)
        assert length == expected
        if length == 0:
            assert node == ROOT
        else:
            assert trie.continuations(context[len(context) - length:])


def all_paths(trie: SuffixTrie, prefix: list[int], max_depth: int) -> dict[tuple[int, ...], float]:
    """Every continuation path below ``prefix`` with its score (product of continuation frequencies)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(path: list[int], score: float) -> None:
        if len(path) - len(prefix) >= max_depth:
            return
        followers = trie.continuations(path)
        total = sum(followers.values())
        for token, count in followers.items():
            child = score * count / total
            out[tuple(path[len(prefix):] + [token])] = child
            walk(path + [token], child)

    walk(prefix, 1.0)
    return out


def test_expand_keeps_the_most_probable_paths_parents_first() -> None:
    rng = random.Random(2)
    for _ in range(100):
        trie = SuffixTrie(8)
        for i in range(3):
            trie.extend(i, [rng.randrange(3) for _ in range(30)])
        node, length = trie.match([0], 1)
        assert length == 1
        max_nodes, max_depth, min_prob = rng.randint(1, 12), rng.randint(1, 5), rng.choice([0.01, 0.1, 0.3])
        tree = trie.expand(node, max_nodes, max_depth, min_prob)
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(tree.tokens, tree.parents, strict=True):
            assert parent < len(paths)  # parents come first
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        candidates = all_paths(trie, [0], max_depth)
        for path, score in zip(paths, tree.scores, strict=True):
            assert score == pytest.approx(candidates[path]) and score >= min_prob
        assert len(set(paths)) == len(paths) and max(map(len, paths), default=0) <= max_depth
        eligible = sorted((s for s in candidates.values() if s >= min_prob), reverse=True)
        assert len(tree) == min(max_nodes, len(eligible))
        # The kept scores are the best ones available (ties may pick either path).
        assert sorted(tree.scores, reverse=True) == pytest.approx(eligible[: len(tree)])


def test_a_draft_past_the_windows_copies_the_paths_first_occurrence() -> None:
    """A path that reaches the windows' depth goes on as a chain copied from where it first
    occurred: the same tokens a trie deep enough to hold them drafts, at the same score, within the
    node budget; the copy follows the first occurrence of a periodic text (the one with the most
    text after it); and a path whose first sequence is gone copies nothing."""
    rng = random.Random(5)
    text = [rng.randrange(1000) for _ in range(60)]
    context = text[:20]  # drafting at position 20: the text after it occurred once, earlier
    shallow, deep = SuffixTrie(8), SuffixTrie(40)
    for trie in (shallow, deep):
        trie.extend("old", text)
    node, length = shallow.match(context, 6)
    deep_node, deep_length = deep.match(context, 6)
    assert length == deep_length == 6
    for max_nodes, max_depth in ((30, 30), (12, 30), (30, 9)):
        copied = shallow.expand(node, max_nodes, max_depth, 0.1, node_depth=length)
        held = deep.expand(deep_node, max_nodes, max_depth, 0.1, node_depth=deep_length)
        assert copied.tokens == held.tokens == text[20: 20 + min(max_nodes, max_depth)]
        assert copied.parents == held.parents and copied.scores == held.scores
    # Without the match's length the shallow trie does not know its windows end: no copy.
    assert len(shallow.expand(node, 30, 30, 0.1)) == 2
    periodic = SuffixTrie(8)
    cycle = [7, 8, 9, 10, 11]
    periodic.extend("p", cycle * 6)
    node, length = periodic.match(cycle * 6, 5)
    assert periodic.expand(node, 20, 20, 0.1, node_depth=length).tokens == (cycle * 4)[:20]
    # "new" repeats old's text; old is removed: the nodes stay (new holds them) but copy nothing.
    shallow.extend("new", text)
    shallow.remove("old")
    node, length = shallow.match(context, 6)
    assert shallow.expand(node, 30, 30, 0.1, node_depth=length).tokens == text[20: 22]


def test_store_evicts_the_oldest_finished_sequences_and_never_a_running_one() -> None:
    store = SuffixStore(depth=4, max_tokens=25, max_sequences=3)
    store.extend("t", "running", list(range(10)))
    for i in range(4):
        store.extend("t", f"done{i}", [100 + i] * 10)
        store.finish("t", f"done{i}")
        assert store.num_tokens <= 25 or store.num_sequences == 1
    trie = store.trie("t")
    assert trie is not None
    # 10 running tokens + finished ones: only the newest finished sequence fits under 25 tokens.
    assert "running" in trie and "done3" in trie
    assert not any(f"done{i}" in trie for i in range(3))
    assert store.evicted_sequences == 3
    assert trie.count([100]) == 0 and trie.count([103, 103]) == 9
    # A running sequence is never evicted, even when it alone exceeds the bound.
    store.extend("t", "running", list(range(10, 40)))
    store.extend("t", "late", [7] * 5)
    store.finish("t", "late")
    assert "running" in trie and trie.sequence_length("running") == 40
    assert "late" not in trie and "done3" not in trie
    # The sequence bound, and an emptied key's trie is dropped.
    store = SuffixStore(depth=4, max_tokens=1000, max_sequences=2)
    for i in range(3):
        store.extend(("salt", i % 2), i, [1, 2, 3])
        store.finish(("salt", i % 2), i)
    assert store.num_sequences == 2 and set(store.tries) == {("salt", 0), ("salt", 1)}
    store.remove(("salt", 1), 1)
    assert set(store.tries) == {("salt", 0)}


def test_memory_is_bounded_by_tokens_times_depth() -> None:
    rng = random.Random(3)
    store = SuffixStore(depth=6, max_tokens=500, max_sequences=1000)
    for i in range(60):
        store.extend(None, i, [rng.randrange(50) for _ in range(40)])
        store.finish(None, i)
        assert store.num_tokens <= 500
        assert store.num_nodes <= store.num_tokens * 6
    trie = store.trie(None)
    assert trie is not None
    capacity = len(trie._count)  # node slots ever allocated: freed slots are reused, so this stays bounded
    assert capacity <= 540 * 6 + 1


# =============================================================================== the drafter


class _NoText:
    """Stands in for the detokenizer: these requests are driven by hand, token ids only."""

    def append(self, token_id: int, stop: list[str]) -> bool:
        return False

    def flush(self) -> None:
        pass


def hand_request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=100, temperature=0.0), _NoText(),  # type: ignore[arg-type]
                      [], 1000, torch.device("cpu"), cache_salt=salt)
    request.output_token_ids.append(prompt[-1] + 1000)  # the prefill's token
    return request


def drafted_paths(proposal: Proposal, b: int = 0) -> list[list[int]]:
    assert proposal.parents is not None
    paths: list[list[int]] = []
    for token, parent in zip(proposal.tokens[b, : proposal.num_tokens[b]].tolist(),
                             proposal.parents[b, : proposal.num_tokens[b]].tolist(), strict=True):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return paths


def test_a_request_drafts_from_its_own_text_when_that_promises_more() -> None:
    drafter = SuffixDrafter(max_depth=4, tree_size=8)
    # Ten earlier requests all continued [1, 2, 3] with 7, 8, 9.
    for i in range(10):
        old = hand_request(f"old{i}", [1, 2, 3, 7, 8, 9])
        drafter.propose([old], [4], None)
        old.finish("stop")
        drafter.release(old)
    # This request's prompt continued [1, 2, 3] with 4, 5, 6, and its context ends with [1, 2, 3] again.
    request = hand_request("new", [1, 2, 3, 4, 5, 6, 0, 1, 2])
    request.output_token_ids[-1] = 3
    paths = drafted_paths(drafter.propose([request], [4], None))
    assert paths[:3] == [[4], [4, 5], [4, 5, 6]]  # its own continuation, not the crowd's
    # Where its own text has nothing to offer, the shared history drafts.
    other = hand_request("other", [9, 9, 1, 2])
    other.output_token_ids[-1] = 3
    assert drafted_paths(drafter.propose([other], [4], None))[:3] == [[7], [7, 8], [7, 8, 9]]


def test_a_rolled_back_request_is_stored_once() -> None:
    """The engine releases a running request when it rolls a failed step back; it then runs on."""
    drafter = SuffixDrafter(max_depth=4)
    request = hand_request("r", [1, 2, 3, 4, 5])
    drafter.propose([request], [4], None)
    drafter.release(request)  # not finished: a rollback
    assert drafter.store.num_sequences == 0
    request.output_token_ids += [7, 8]
    drafter.propose([request], [4], None)
    trie = drafter.store.trie(("salt", None))
    assert trie is not None and trie.sequence_length("r") == request.num_tokens
    assert trie.count([1, 2]) == 1  # once, not once per sitting
    request.output_token_ids.append(9)
    request.finish("stop")
    drafter.release(request)
    assert trie.sequence_length("r") == request.num_tokens and trie.count([8, 9]) == 1


def test_the_budget_grows_with_the_match_and_the_depth_follows_the_policy() -> None:
    drafter = SuffixDrafter(max_depth=8, tree_size=24, nodes_per_matched_token=2.0)
    text = list(range(10, 40))
    old = hand_request("old", text)
    drafter.propose([old], [8], None)
    old.finish("stop")
    drafter.release(old)
    short = hand_request("short", [5, 5, 5, 24])  # matches one token ([24]) of the earlier text
    short.output_token_ids[-1] = 25  # ... then two: [24, 25]
    assert drafter.propose([short], [8], None).num_tokens == [4]  # 2 nodes per matched token
    long = hand_request("long", text[:12])
    long.output_token_ids[-1] = 22  # a 13-token match
    assert drafter.propose([long], [8], None).num_tokens == [8]  # a chain as deep as allowed
    assert drafter.propose([long], [3], None).num_tokens == [3]
    assert drafter.propose([long], [0], None).num_tokens == [0]  # the length policy chose no drafts


# =============================================================================== engine: greedy parity

PROMPTS = [*DRAFTER_PROMPTS, "a"]  # 6 prompts: batches of up to 4 leave a second wave


def greedy(max_tokens: int = 32, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> list[RequestOutput]:
    return LLM(str(tiny_llama), dtype="float32", device="cpu").generate(PROMPTS, greedy())


def spy_on_proposals(llm: LLM) -> list[Proposal]:
    drafter = llm.engine.runner.drafter  # type: ignore[attr-defined]
    real = drafter.propose
    seen: list[Proposal] = []

    def propose(requests: list[Request], budgets: list[int], hidden: torch.Tensor | None) -> Proposal:
        proposal = real(requests, budgets, hidden)
        seen.append(proposal)
        return proposal

    drafter.propose = propose
    return seen


def has_siblings(proposals: list[Proposal]) -> bool:
    for p in proposals:
        assert p.parents is not None
        for b, n in enumerate(p.num_tokens):
            parents = p.parents[b, :n].tolist()
            if len(set(parents)) < len(parents):
                return True
    return False


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
@pytest.mark.parametrize("backend", list(KV_BACKENDS))
def test_greedy_parity_with_plain_decoding(tiny_llama: Path, plain: list[RequestOutput], backend: str,
                                           policy: str) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix", spec_length=6, spec_length_policy=policy,
              max_batch_size=4, **KV_BACKENDS[backend])  # type: ignore[arg-type]
    first = llm.generate(PROMPTS, greedy())  # 6 prompts, batches of up to 4: drafts from itself and batch mates
    assert token_ids(first) == token_ids(plain)
    proposals = spy_on_proposals(llm)
    second = llm.generate(PROMPTS, greedy())  # now every prompt's own earlier output is in the store
    assert token_ids(second) == token_ids(plain)
    assert [o.finish_reason for o in second] == [o.finish_reason for o in plain]
    accepted = sum(o.metrics.accepted_tokens for o in second)
    if policy == "fixed":
        assert accepted > 0.8 * sum(len(o.token_ids) for o in second) - 2 * len(PROMPTS)
        mean = sum(o.metrics.mean_accepted_tokens or 0 for o in second) / len(second)
        assert mean > 3.0
        m = second[0].metrics
        assert m.proposed_per_position and len(m.proposed_per_position) <= 6  # depth <= spec_length
        # The metrics count every node the target verified (the tree size), at least the judged depth.
        assert sum(o.metrics.draft_nodes for o in second) == sum(sum(p.num_tokens) for p in proposals)
        assert all(o.metrics.draft_nodes >= o.metrics.proposed_tokens for o in second)
    else:
        assert accepted > 0  # goodput may pick 0 for some rounds, and still the output is the same
    assert any(p.parents is not None and max(p.num_tokens) > 0 for p in proposals)


def test_stop_rules_that_land_mid_tree(tiny_llama: Path, plain: list[RequestOutput]) -> None:
    """A round that accepts a long path whose middle holds a stop token or a stop string, or that
    reaches max_tokens, ends exactly where plain decoding ends."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix", spec_length=8, spec_length_policy="fixed", max_batch_size=3, block_size=4)
    llm.generate(PROMPTS, greedy())  # warm the store with the full outputs
    reference = plain[0].token_ids
    stop_id = reference[5]  # the first round (after the prefill token) covers tokens 1..9
    stop_text = llm.tokenizer.decode(reference[6:8])
    variants = [greedy(stop_token_ids=[stop_id]), greedy(stop=[stop_text]), greedy(max_tokens=11)]
    for params in variants:
        base = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(PROMPTS, params)
        spec = llm.generate(PROMPTS, params)
        assert token_ids(spec) == token_ids(base), params
        assert [o.text for o in spec] == [o.text for o in base]
        assert [o.finish_reason for o in spec] == [o.finish_reason for o in base]
        m, kept = spec[0].metrics, len(spec[0].token_ids)
        assert kept < len(reference)
        emitted = 1 + m.accepted_tokens + m.num_rounds  # the prefill's token, then per round accepted + 1
        if params.max_tokens == 11:  # the depth is clamped to the budget: the last round ends on it
            assert emitted == kept
        else:  # the stop fell inside a round: it emitted more tokens than were kept
            assert emitted > kept


def test_greedy_parity_with_penalty_and_sampled_batch_mates(tiny_llama: Path) -> None:
    prompts = PROMPTS[:4]
    params = [greedy(24, repetition_penalty=1.3), SamplingParams(max_tokens=24, temperature=0.8, seed=1),
              greedy(24), greedy(24, repetition_penalty=1.3)]
    base = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(prompts, params)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix", spec_length=4, spec_length_policy="fixed")
    for _ in range(2):
        out = llm.generate(prompts, params)
        for i in (0, 2, 3):
            assert out[i].token_ids == base[i].token_ids, i
    assert sum(o.metrics.accepted_tokens for o in out) > 0


def test_tree_shrinks_to_fit_the_context(tiny_llama: Path) -> None:
    params = greedy(100)
    base = LLM(str(tiny_llama), dtype="float32", device="cpu", max_seq_len=30).generate(PROMPTS[:2], params)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_seq_len=30, speculator="suffix", spec_length=8, spec_length_policy="fixed",
              suffix_tree_size=16, kv_cache_backend="slotted")
    for _ in range(2):
        out = llm.generate(PROMPTS[:2], params)
        assert token_ids(out) == token_ids(base)
        assert all(len(o.prompt_token_ids) + len(o.token_ids) == 30 for o in out)


# =============================================================================== isolation


def run_salted(llm: LLM, prompt: str, salt: str | None, params: SamplingParams) -> Request:
    request = llm.engine.add_request(prompt, params, cache_salt=salt)
    llm.engine.run_until_done()
    return request


def test_tenants_draft_only_from_their_own_requests(tiny_llama: Path) -> None:
    params = greedy(32, ignore_eos=True)
    prompt = PROMPTS[0]
    alone = run_salted(LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix", spec_length=6, spec_length_policy="fixed"), prompt, "b", params)

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix", spec_length=6, spec_length_policy="fixed")
    first = run_salted(llm, prompt, "a", params)
    other_tenant = run_salted(llm, prompt, "b", params)
    same_tenant = run_salted(llm, prompt, "a", params)
    assert first.output_token_ids == other_tenant.output_token_ids == same_tenant.output_token_ids
    # Tenant b saw nothing of tenant a: it drafted exactly what it drafts on a fresh engine.
    for field in ("proposed_tokens", "accepted_tokens", "num_rounds"):
        assert getattr(other_tenant.metrics, field) == getattr(alone.metrics, field), field
    # Tenant a's second request drafts from the first one's output and accepts nearly everything.
    assert same_tenant.metrics.num_rounds < other_tenant.metrics.num_rounds
    assert same_tenant.metrics.accepted_tokens >= 0.9 * (32 - 1 - same_tenant.metrics.num_rounds)
    store = llm.engine.runner.drafter.store  # type: ignore[attr-defined]
    assert set(store.tries) == {("salt", "a"), ("salt", "b")}


def test_request_scope_shares_nothing(tiny_llama: Path) -> None:
    params = greedy(32, ignore_eos=True)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix", spec_length=6, spec_length_policy="fixed", suffix_scope="request")
    runs = [run_salted(llm, PROMPTS[0], None, params) for _ in range(2)]
    assert runs[0].output_token_ids == runs[1].output_token_ids
    assert runs[0].metrics.proposed_tokens == runs[1].metrics.proposed_tokens
    assert runs[0].metrics.accepted_tokens == runs[1].metrics.accepted_tokens
    assert llm.engine.runner.drafter.store.num_sequences == 0  # type: ignore[attr-defined]


def test_aborted_waiting_request_is_not_stored(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix")
    request = llm.engine.add_request(PROMPTS[0], greedy())
    llm.engine.abort(request.request_id)
    assert llm.engine.runner.drafter.store.num_sequences == 0  # type: ignore[attr-defined]


# =============================================================================== configuration


@pytest.mark.parametrize(("field", "value"), [("suffix_tree_size", 0), ("suffix_max_match", 0),
                                              ("suffix_min_prob", 0.0), ("suffix_max_tokens", -1),
                                              ("suffix_max_requests", -1), ("suffix_scope", "tenant")])
def test_bad_settings_are_named(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_options(model="m", speculator="suffix", **{field: value})


def test_drafter_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="scope"):
        SuffixDrafter(4, scope="everyone")
    with pytest.raises(ValueError, match="tree_size"):
        SuffixDrafter(4, tree_size=0)


def test_cli_flags_reach_the_engine(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from infer.engine.options import engine_config

    args = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--speculator", "suffix",
                                      "--suffix-tree-size", "12", "--suffix-max-tokens", "999",
                                      "--suffix-max-requests", "7", "--suffix-scope", "request"])
    spec = engine_config(args).speculative
    assert spec is not None
    assert (spec.speculator, spec.suffix_tree_size, spec.suffix_max_tokens, spec.suffix_max_requests,
            spec.suffix_scope) == ("suffix", 12, 999, 7, "request")
    assert main(["generate", "--model", str(tiny_llama), "--device", "cpu", "--speculator", "suffix",
                 "--prompt", "import os\nimport os\nimport", "--max-tokens", "12", "--temperature", "0",
                 "--json"]) == 0
    assert len(__import__("json").loads(capsys.readouterr().out)["token_ids"]) == 12


# =============================================================================== sampling exactness



def run_engine(small_target: Path, params: dict[str, Any], n: int = TREE_NUM_SAMPLES,
               seed0: int = 0) -> tuple[np.ndarray, int, int, bool]:
    # A low min_prob keeps several siblings per node, so the multi-candidate rejection is exercised.
    llm = LLM(str(small_target), speculator="suffix", spec_length=3, spec_length_policy="fixed", suffix_min_prob=0.02, dtype="float32",
              device="cpu", max_batch_size=256, max_seq_len=32)
    proposals = spy_on_proposals(llm)
    outputs = generate_unseeded(llm, [PROMPT] * n, SamplingParams(max_tokens=4, ignore_eos=True, **params), seed0)
    assert all(len(o.token_ids) == 4 for o in outputs)
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    return (samples, sum(o.metrics.proposed_tokens for o in outputs), sum(o.metrics.accepted_tokens for o in outputs),
            has_siblings(proposals))


@pytest.mark.parametrize("config", list(TREE_CONFIGS))
def test_suffix_samples_follow_target_distribution(small_target: Path, config: str) -> None:
    samples, proposed, accepted, siblings = run_engine(small_target, TREE_CONFIGS[config])
    ref = reference(small_target, PROMPT, SamplingParams(**TREE_CONFIGS[config]))  # type: ignore[arg-type]
    assert proposed > TREE_NUM_SAMPLES // 2 and 0 < accepted < proposed  # both verdicts were exercised
    assert siblings  # real trees, not only chains

    assert_follows_reference(samples, ref)


def test_negative_control_broken_residual_is_detected(small_target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(probs: torch.Tensor, rejected: Any) -> torch.Tensor:
        return probs  # forgets that the rejected candidates must not be drawn again

    monkeypatch.setattr(verification, "residual_after_rejections", broken)
    samples, _, _, _ = run_engine(small_target, TREE_CONFIGS["temperature_1"], n=2000, seed0=10_000_000)
    ref = reference(small_target, PROMPT, SamplingParams(temperature=1.0))
    assert grouped_chisquare(samples, ref).pvalue < P_CONTROL
