"""Medusa heads with tree attention: tree shape and mask, lossless tree acceptance, KV compaction,
greedy parity of the whole engine path, metrics and the CLI.

Untrained heads are enough for parity: acceptance is exact, so head quality only changes speed. To
also exercise long accepted paths through the middle of the tree (the interesting case for KV
compaction), an "oracle" wraps the drafter and plants the true continuation on a random path.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from scipy.stats import chisquare

import infer.engine.speculative_runner as speculative_runner
import infer.speculative.verification as verification
from checkpoints import make_medusa_heads
from helpers import DRAFTER_PROMPTS, KV_BACKENDS
from infer.backends.onednn import cpu_packing_available, projection_packer
from infer.cache import PagedKVCachePool, SlottedKVCache
from infer.cache.protocol import CachePoolProtocol, copy_positions
from infer.core.request import Request
from infer.engine.llm import LLM
from infer.loader import load_model
from infer.models.layers import flex_available
from infer.models.medusa_heads import CONFIG_FILE, HEADS_FILE, MedusaConfig, MedusaHeads
from infer.sampling.params import SamplingParams
from infer.speculative.budget import BudgetController, size_ladder
from infer.speculative.drafter import Proposal
from infer.speculative.medusa import MedusaDrafter, medusa_tree
from infer.speculative.tree import (
    CandidateTree,
    TreeMaskCache,
    build_tree,
    default_rank_accuracy,
    tree_attention_mask,
    tree_depths,
)
from infer.speculative.verification import verify_tree

P_THRESHOLD = 1e-3


def chain_tree(length: int) -> CandidateTree:
    """The top-1 chain of ``length`` nodes (what a single-path drafter would propose)."""
    return CandidateTree(tuple((0,) * d for d in range(1, length + 1)))


@pytest.fixture(scope="module")
def heads_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Heads for tiny_llama with trees of 1 node, a small tree and the default size."""
    root = tmp_path_factory.mktemp("medusa_heads")
    sizes = {"size_1": 1, "small": 5, "default": MedusaConfig(1, 1, 1).tree_size}
    return {name: make_medusa_heads(tiny_llama, root / name, tree_size=n) for name, n in sizes.items()}


@pytest.fixture(scope="module")
def plain_greedy(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_backend="slotted")
    return [o.token_ids for o in llm.generate(DRAFTER_PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))]


# =============================================================================== tree shape


def test_build_tree_takes_the_most_probable_paths_parents_first() -> None:
    gen = random.Random(3)
    heads, top_k, size = 3, 4, 14
    # Distinct, decreasing accuracies: the best `size` paths are unique.
    acc = [sorted((gen.uniform(0.05, 0.9) for _ in range(top_k)), reverse=True) for _ in range(heads)]
    tree = build_tree(acc, size)
    assert tree.size == size
    everything = [p for d in range(1, heads + 1) for p in itertools.product(range(top_k), repeat=d)]
    score = {p: math.prod(acc[k][r] for k, r in enumerate(p)) for p in everything}
    assert set(tree.paths) == set(sorted(everything, key=lambda p: -score[p])[:size])
    for i, parent in enumerate(tree.parents):
        assert parent < i
        assert (parent == -1) == (len(tree.paths[i]) == 1)
        if parent >= 0:
            assert tree.paths[parent] == tree.paths[i][:-1]
    assert tree.depths == [len(p) for p in tree.paths]
    assert tree.top_k <= top_k and tree.max_depth <= heads


def test_subtree_keeps_ancestors() -> None:
    tree = build_tree(default_rank_accuracy(4, 6), 40)
    for depth, nodes in [(1, 40), (2, 7), (4, 1), (3, 40), (0, 5)]:
        kept = tree.subtree(depth, nodes)
        assert len(kept) <= nodes
        assert all(tree.depths[i] <= depth for i in kept)
        assert all(tree.parents[i] == -1 or tree.parents[i] in kept for i in kept)
    assert tree.subtree(4, 40) == list(range(40))
    assert chain_tree(3).parents == [-1, 0, 1]
    with pytest.raises(ValueError, match="parent"):
        CandidateTree(((0, 0), (0,)))


def _ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_tree_mask_equals_brute_force_ancestor_check() -> None:
    gen = random.Random(0)
    batch, n = 5, 12
    counts = [12, 7, 1, 0, 10]
    parents = torch.full((batch, n), -1, dtype=torch.long)
    for b in range(batch):
        for i in range(counts[b]):
            parents[b, i] = gen.randrange(-1, i)  # any earlier node, or the root
    mask = tree_attention_mask(parents, counts)
    depths = tree_depths(mask)
    assert mask.shape == (batch, n + 1, n + 1) and mask.dtype == torch.bool
    cache = TreeMaskCache()
    assert torch.equal(cache(parents, counts), mask) and torch.equal(cache(parents, counts), mask)  # miss, hit
    for b in range(batch):
        par = parents[b].tolist()
        for i in range(counts[b]):
            anc = _ancestors(par, i)
            # pass row i + 1 (node i) sees the root (row 0), its ancestors and itself, nothing else
            expected = [True] + [j in anc for j in range(n)]
            assert mask[b, i + 1].tolist() == expected, (b, i)
            assert int(depths[b, i + 1]) == len(anc)
        assert mask[b, 0].tolist() == [True] + [False] * n
        for i in range(counts[b], n):  # padding hangs off the root
            assert mask[b, i + 1].tolist() == [True] + [j == i for j in range(n)]


def test_chain_mask_is_causal() -> None:
    mask = tree_attention_mask(torch.tensor([chain_tree(5).parents]), [5])
    assert torch.equal(mask[0], torch.ones(6, 6, dtype=torch.bool).tril())


# =============================================================================== tree acceptance


def one_hot_rows(tokens: list[int], vocab: int) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return out


def test_greedy_tree_acceptance_takes_the_longest_matching_path() -> None:
    vocab = 8
    # root -> {0: tok 3, 1: tok 5}; node 0 -> {2: tok 1, 3: tok 2}; node 1 -> {4: tok 2}; node 3 -> {5: tok 6}
    parents = torch.tensor([[-1, -1, 0, 0, 1, 3]])
    tokens = torch.tensor([[3, 5, 1, 2, 2, 6]])
    # argmax at each pass row (0 = root): root -> 5, node 0 -> 2, node 1 -> 2, node 2 -> 0, node 3 -> 6, ...
    argmax = [5, 2, 2, 0, 6, 7, 4]
    probs = one_hot_rows(argmax, vocab).unsqueeze(0)
    verdict = verify_tree(tokens, [6], parents, probs, torch.tensor([True]), [None])
    # root's argmax is 5 = node 1; node 1's argmax 2 = node 4 (leaf); bonus argmax at node 4 = 7.
    assert verdict.paths == [[1, 4]]
    assert verdict.tokens == [[5, 2, 7]]
    assert verdict.last_rows == [5]
    # Switch the root's argmax to 3: path 0 -> 3 -> 5, bonus = argmax at node 5.
    argmax[0] = 3
    verdict = verify_tree(tokens, [6], parents, one_hot_rows(argmax, vocab).unsqueeze(0), torch.tensor([True]), [None])
    assert verdict.paths == [[0, 3, 5]] and verdict.tokens == [[3, 2, 6, 4]]
    # Nothing matches: the correction is the root's argmax.
    argmax[0] = 7
    verdict = verify_tree(tokens, [6], parents, one_hot_rows(argmax, vocab).unsqueeze(0), torch.tensor([True]), [None])
    assert verdict.paths == [[]] and verdict.tokens == [[7]] and verdict.last_rows == [0]


def test_empty_trees_are_plain_decode_steps() -> None:
    probs = torch.tensor([[[0.1, 0.6, 0.3]], [[0.0, 0.0, 1.0]]])
    empty = torch.zeros(2, 0, dtype=torch.long)
    verdict = verify_tree(empty, [0, 0], empty, probs, torch.tensor([True, False]), [None, None])
    assert verdict.paths == [[], []] and verdict.tokens == [[1], [2]] and verdict.last_rows == [0, 0]


def wrong_residual(probs: torch.Tensor, rejected: Any) -> torch.Tensor:
    """The classic bug: after rejecting candidates, draw the correction from p instead of the residual."""
    return probs


# Root distribution and each candidate's own next-token distribution for the hand-made tree below.
V = 6
P_ROOT = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05])
P_AFTER = torch.tensor([
    [0.10, 0.10, 0.40, 0.10, 0.20, 0.10],  # after token 1 (node 0)
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],  # after token 2 (node 1)
    [0.05, 0.05, 0.05, 0.05, 0.05, 0.75],  # after token 3 (node 2)
])
UNIFORM = torch.full((V,), 1.0 / V)


def sample_hand_made_tree(n: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Root children tokens 1, 2, 3 (in that trial order); node 0 (token 1) has children 2, 4; node 1
    (token 2) has child 0. Returns each row's emitted tokens and accepted paths."""
    parents = torch.tensor([[-1, -1, -1, 0, 0, 1]]).expand(n, -1)
    tokens = torch.tensor([[1, 2, 3, 2, 4, 0]]).expand(n, -1)
    rows = torch.stack([P_ROOT, P_AFTER[0], P_AFTER[1], P_AFTER[2], UNIFORM, UNIFORM, UNIFORM])
    probs = rows.unsqueeze(0).expand(n, -1, -1)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        verdict = verify_tree(tokens, [6] * n, parents, probs, torch.zeros(n, dtype=torch.bool), [None] * n)
    return verdict.tokens, verdict.paths


def chisq_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def test_multi_candidate_rejection_sampling_is_exact() -> None:
    n = 30_000
    emitted, paths = sample_hand_made_tree(n, seed=0)
    first = torch.tensor([t[0] for t in emitted])
    assert chisq_pvalue(first, P_ROOT) > P_THRESHOLD
    # Given an accepted first candidate, the next token follows the target after it.
    for token, p in [(1, P_AFTER[0]), (2, P_AFTER[1]), (3, P_AFTER[2])]:
        second = torch.tensor([t[1] for t in emitted if t[0] == token and len(t) > 1])
        assert second.numel() == int((first == token).sum())  # every candidate token was an accepted node
        assert chisq_pvalue(second, p) > P_THRESHOLD, token
    # Every verdict walks the tree: accepted paths are parent chains, emitted = path tokens + 1.
    assert all(len(t) == len(p) + 1 for t, p in zip(emitted, paths, strict=True))
    depths = [len(p) for p in paths]
    assert 0 < depths.count(0) < n and depths.count(2) > 0  # rejections and two-deep acceptances both occur


def test_negative_control_wrong_residual_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verification, "residual_after_rejections", wrong_residual)
    n = 30_000
    emitted, _ = sample_hand_made_tree(n, seed=0)
    first = torch.tensor([t[0] for t in emitted])
    assert chisq_pvalue(first, P_ROOT) < P_THRESHOLD


def test_per_request_generators_reproduce() -> None:
    parents, tokens = torch.tensor([[-1, -1, 0]]), torch.tensor([[1, 2, 4]])
    probs = torch.stack([P_ROOT, P_AFTER[0], P_AFTER[1], UNIFORM]).unsqueeze(0)
    runs = [verify_tree(tokens, [3], parents, probs, torch.tensor([False]),
                        [torch.Generator().manual_seed(s)]).tokens for s in (5, 5, 6, 7, 8, 9)]
    assert runs[0] == runs[1]
    assert len({tuple(r[0]) for r in runs}) > 1


# =============================================================================== KV pool


@pytest.mark.parametrize("backend", ["paged", "slotted"])
def test_copy_positions_copies_every_layer(backend: str) -> None:
    pool: CachePoolProtocol
    if backend == "paged":
        pool = PagedKVCachePool(3, 2, 4, num_blocks=8, block_size=4, max_seq_len=24, dtype=torch.float32, device="cpu")
    else:
        pool = SlottedKVCache(3, 2, 4, num_slots=2, max_seq_len=24, dtype=torch.float32, device="cpu")
    other, slot = pool.allocate(), pool.allocate()
    for s in (other, slot):
        pool.reserve(s, 14)
    for layer in range(3):
        for store, sign in ((pool.k_layers[layer], 1), (pool.v_layers[layer], -1)):
            for s in (other, slot):
                rows = pool.storage_rows(s, 14)
                store[rows] = sign * (torch.arange(14.0) + 100 * layer + 1000 * s).view(-1, 1, 1).expand(-1, 2, 4)
    before_other = [pool.k_layers[i][pool.storage_rows(other, 14)].clone() for i in range(3)]
    copy_positions(pool, [(slot, [9, 12, 13], [6, 7, 8])])  # a path scattered through a tree, compacted
    for layer in range(3):
        rows = pool.storage_rows(slot, 14)
        k = pool.k_layers[layer][rows][:, 0, 0] - 100 * layer - 1000 * slot
        v = -pool.v_layers[layer][rows][:, 0, 0] - 100 * layer - 1000 * slot
        expected = torch.tensor([0, 1, 2, 3, 4, 5, 9, 12, 13, 9, 10, 11, 12, 13], dtype=torch.float32)
        assert torch.equal(k, expected) and torch.equal(v, expected)
        assert torch.equal(pool.k_layers[layer][pool.storage_rows(other, 14)], before_other[layer])
    with pytest.raises(ValueError):
        copy_positions(pool, [(slot, [14], [6])])  # past the sequence


# =============================================================================== engine: greedy parity


def greedy(max_tokens: int = 24, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("sizing", ["adaptive", "fixed"])
@pytest.mark.parametrize("backend", list(KV_BACKENDS))
@pytest.mark.parametrize("tree", ["size_1", "small", "default"])
def test_greedy_parity_with_plain_decoding(tiny_llama: Path, heads_dirs: dict[str, Path],
                                           plain_greedy: list[list[int]], tree: str, backend: str,
                                           sizing: str) -> None:
    fixed_size = MedusaConfig.from_file(heads_dirs[tree] / CONFIG_FILE).tree_size if sizing == "fixed" else None
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="medusa", medusa_heads=str(heads_dirs[tree]),
              max_batch_size=4, medusa_tree_size=fixed_size, **KV_BACKENDS[backend])  # type: ignore[arg-type]
    outputs = llm.generate(DRAFTER_PROMPTS, greedy())  # 5 prompts, batches of up to 4
    assert [o.token_ids for o in outputs] == plain_greedy
    sizer = llm.engine.runner.budget  # type: ignore[attr-defined]
    if sizing == "fixed":
        assert not sizer.adaptive
    else:  # several sizes were verified, plain steps (size 0) among them, all without changing the output
        assert sum(n > 0 for n in sizer.counts) > 1 and sizer.counts[0] > 0
    m = outputs[0].metrics
    assert m.num_rounds > 0 and m.mean_accepted_tokens is not None and m.mean_accepted_tokens >= 1.0
    assert m.proposed_per_position and len(m.proposed_per_position) <= 3  # depth <= number of heads
    assert all(a <= p for a, p in zip(m.accepted_per_position, m.proposed_per_position, strict=True))


@pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")
def test_greedy_parity_with_flex_tree_attention(tiny_llama: Path, heads_dirs: dict[str, Path],
                                                plain_greedy: list[list[int]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.backends.backend as backend_module  # Backend.run_pass builds the block masks

    made: list[tuple[int, ...]] = []
    real = backend_module.block_mask_from

    def spy(mask: torch.Tensor) -> Any:
        made.append(tuple(mask.shape))
        return real(mask)

    monkeypatch.setattr(backend_module, "block_mask_from", spy)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="medusa", medusa_heads=str(heads_dirs["small"]),
              medusa_tree_size=5, tree_attention="flex", max_batch_size=4)
    outputs = llm.generate(DRAFTER_PROMPTS[:4], greedy(max_tokens=12))
    assert [o.token_ids for o in outputs] == [tokens[:12] for tokens in plain_greedy[:4]]
    assert made and all(shape[2] > 1 for shape in made)  # only tree passes (several rows) used flex
    with pytest.raises(ValueError, match="tree_attention"):
        LLM(str(tiny_llama), dtype="float32", device="cpu", tree_attention="triton")


def plant_oracle(llm: LLM, references: dict[tuple[int, ...], list[int]], seed: int = 0,
                 corrupt: float = 0.3) -> MedusaDrafter:
    """Make the engine's Medusa drafter plant each request's true continuation on a random path
    of its tree (and sometimes break it), so rounds accept long paths through the tree's middle."""
    drafter = llm.engine.runner.drafter  # type: ignore[attr-defined]
    assert isinstance(drafter, MedusaDrafter)
    real_propose = drafter.propose
    rng = random.Random(seed)

    @torch.inference_mode()
    def propose(requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        proposal = real_propose(requests, budgets, hidden_states)
        assert proposal.parents is not None
        for b, request in enumerate(requests):
            n = proposal.num_tokens[b]
            if n == 0:
                continue
            future = references[tuple(request.prompt_token_ids)][len(request.output_token_ids):]
            parents = proposal.parents[b, :n].tolist()
            path = sorted(_ancestors(parents, rng.randrange(n)))
            for depth, node in enumerate(path):
                if depth < len(future):
                    proposal.tokens[b, node] = future[depth]
            if rng.random() < corrupt:
                node = rng.choice(path)
                proposal.tokens[b, node] = (int(proposal.tokens[b, node]) + 1) % 512
        return proposal

    drafter.propose = propose  # type: ignore[method-assign]
    return drafter


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many K/V rows each compaction moved (``copy_positions`` is spied on)."""
    rows: list[int] = []
    real_copy = speculative_runner.copy_positions

    def spy(pool: CachePoolProtocol, moves: list[tuple[int, list[int], list[int]]]) -> None:
        rows.extend(len(src) for _, src, _ in moves)
        real_copy(pool, moves)

    monkeypatch.setattr(speculative_runner, "copy_positions", spy)
    return rows


@pytest.mark.parametrize("backend", list(KV_BACKENDS))
def test_greedy_parity_with_deep_acceptance_through_the_tree(
        tiny_llama: Path, heads_dirs: dict[str, Path], plain_greedy: list[list[int]], backend: str,
        moved: list[int]) -> None:
    # The whole tree every round (not sized by measurement): deep paths from the first round on.
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="medusa", medusa_heads=str(heads_dirs["default"]),
              medusa_tree_size=MedusaConfig(1, 1, 1).tree_size, max_batch_size=3,
              **KV_BACKENDS[backend])  # type: ignore[arg-type]
    prompt_ids = [llm.tokenizer.encode(p) for p in DRAFTER_PROMPTS]
    plant_oracle(llm, {tuple(ids): out for ids, out in zip(prompt_ids, plain_greedy, strict=True)})
    outputs = llm.generate(prompt_ids, greedy())
    assert [o.token_ids for o in outputs] == plain_greedy
    assert sum(moved) > 10  # accepted paths really were scattered and got compacted
    mean = sum(o.metrics.mean_accepted_tokens or 0 for o in outputs) / len(outputs)
    assert mean > 2.0
    # Max tokens landing mid-round: the output is cut at the limit, still identical.
    short = llm.generate(prompt_ids, greedy(max_tokens=7))
    assert [o.token_ids for o in short] == [p[:7] for p in plain_greedy]


def test_greedy_parity_with_repetition_penalty_and_mixed_batch(tiny_llama: Path, heads_dirs: dict[str, Path]) -> None:
    """The penalty context of a tree node is its own path; a sampled neighbour does not disturb greedy rows."""
    params = [greedy(repetition_penalty=1.3), SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True),
              greedy(), greedy(repetition_penalty=1.3)]
    prompts = DRAFTER_PROMPTS[:4]
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(prompts, params)
    medusa = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="medusa", medusa_heads=str(heads_dirs["default"]))
    prompt_ids = [medusa.tokenizer.encode(p) for p in prompts]
    plant_oracle(medusa, {tuple(ids): o.token_ids for ids, o in zip(prompt_ids, plain, strict=True)}, seed=1)
    out = medusa.generate(prompt_ids, params)
    for i in (0, 2, 3):
        assert out[i].token_ids == plain[i].token_ids, i
    assert len(out[1].token_ids) == 24


@pytest.mark.parametrize("backend", list(KV_BACKENDS))
def test_tree_shrinks_to_fit_the_context(tiny_llama: Path, heads_dirs: dict[str, Path], backend: str) -> None:
    """Near max_seq_len the tree (32 nodes) must shrink: verification writes every node."""
    params = greedy(max_tokens=100)
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu", max_seq_len=30, **KV_BACKENDS[backend]).generate(DRAFTER_PROMPTS[:2], params)  # type: ignore[arg-type]
    medusa = LLM(str(tiny_llama), dtype="float32", device="cpu", max_seq_len=30, speculator="medusa",
                 medusa_heads=str(heads_dirs["default"]), **KV_BACKENDS[backend]).generate(DRAFTER_PROMPTS[:2], params)  # type: ignore[arg-type]
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" and len(o.prompt_token_ids) + len(o.token_ids) == 30 for o in medusa)


# =============================================================================== KV compaction


@pytest.mark.parametrize("backend", list(KV_BACKENDS))
def test_compacted_cache_gives_the_logits_of_a_fresh_forward(
        tiny_llama: Path, heads_dirs: dict[str, Path], plain_greedy: list[list[int]], backend: str,
        moved: list[int]) -> None:
    """After Medusa rounds that kept scattered paths, decoding from the cache gives the logits of a
    cache-free forward over the final sequence."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="medusa", medusa_heads=str(heads_dirs["default"]),
              medusa_tree_size=MedusaConfig(1, 1, 1).tree_size, **KV_BACKENDS[backend])  # type: ignore[arg-type]
    prompt_ids = [llm.tokenizer.encode(p) for p in DRAFTER_PROMPTS[:3]]
    plant_oracle(llm, {tuple(ids): out for ids, out in zip(prompt_ids, plain_greedy[:3], strict=True)}, corrupt=0.2)
    engine = llm.engine
    requests = [engine.add_request(ids, greedy(max_tokens=40)) for ids in prompt_ids]
    for _ in range(4):  # prefill + three Medusa rounds
        engine.step()
    assert sum(moved) > 0
    runner = engine.runner.target.runner  # type: ignore[attr-defined]
    model = engine.model
    for request in requests:
        assert not request.is_finished
        assert request.num_computed_tokens == request.num_tokens - 1 == engine.pool.seq_len(request.slot)  # type: ignore[arg-type]
        cached = runner.logits(runner.forward([request.slot], [[request.output_token_ids[-1]]]))[0, -1]
        with torch.inference_mode():
            fresh = model.compute_logits(model(torch.tensor([request.all_token_ids])))[0, -1].float()
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)


# =============================================================================== loading and CLI


def test_heads_round_trip_and_start_as_the_lm_head(tiny_llama: Path, tmp_path: Path) -> None:
    model, _ = load_model(tiny_llama, "float32", "cpu", pack=False)
    heads = MedusaHeads.from_target(model.lm_head.weight.detach().clone(), 2, tree_size=7)
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():  # zero-initialised residual blocks: every head is the target's LM head
        expected = model.compute_logits(hidden)
        assert torch.allclose(heads(hidden), expected.unsqueeze(1).expand(-1, 2, -1))
    out = heads.save(tmp_path / "h")
    assert (out / HEADS_FILE).is_file() and (out / CONFIG_FILE).is_file()
    heads.save(tmp_path / "h")  # overwriting is atomic and leaves no temporary folders
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]
    loaded = MedusaHeads.load(out)
    assert loaded.config.tree_size == 7 and medusa_tree(loaded.config).size == 7
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))


def test_missing_heads_give_a_clear_error(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from infer.cli import main

    code = main(["generate", "--model", str(tiny_llama), "--speculator", "medusa", "--prompt", "x",
                 "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"infer train medusa --target {tiny_llama}" in err and "medusa" in err


def test_cli_finds_heads_in_the_default_folder(tiny_llama: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from infer.cli import main

    target = tmp_path / "target"
    shutil.copytree(tiny_llama, target)
    make_medusa_heads(target, target / "medusa", tree_size=8)
    args = ["generate", "--model", str(target), "--prompt", "def f(x):", "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos", "--dtype", "float32", "--device", "cpu", "--json"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculator", "medusa"]) == 0
    medusa = capsys.readouterr().out
    import json

    plain_out, medusa_out = json.loads(plain), json.loads(medusa)
    assert medusa_out["token_ids"] == plain_out["token_ids"]
    assert medusa_out["metrics"]["num_rounds"] > 0
    assert medusa_out["metrics"]["mean_accepted_tokens"] >= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_fused_heads_compute_what_the_heads_compute(shared: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(num_heads=3, hidden_size=16, vocab_size=40, num_layers=2))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
        if shared:  # trained with --freeze-projection: every head keeps the target's LM head
            for head in heads.heads[1:]:
                head.lm_head.weight.copy_(heads.heads[0].lm_head.weight)  # type: ignore[union-attr]
    heads.to(dtype)
    fused = heads.fused(projection_packer(next(heads.parameters())))
    assert fused.shared_projection == shared
    assert (fused.packed is not None) == (dtype == torch.bfloat16 and cpu_packing_available())
    hidden = torch.randn(5, 16, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        torch.testing.assert_close(fused(hidden).float(), heads(hidden).float(), rtol=tol, atol=tol)


# =============================================================================== tree sizing


def tree_sizer(max_nodes: int) -> BudgetController:
    """The budget controller as the engine makes it for Medusa heads whose tree has ``max_nodes``."""
    return BudgetController(max_nodes, adaptive=True, tree=True, cost_per_token=False)


def play(sizer: BudgetController, rounds: int, tokens_for: Callable[[int], float],
         seconds_for: Callable[[int], float]) -> list[int]:
    """One request; a round of size n emits tokens_for(n) and its target pass takes seconds_for(n)."""
    chosen = []
    request: Any = SimpleNamespace(request_id="r")
    for _ in range(rounds):
        n = sizer.budgets([request])[0]
        chosen.append(n)
        sizer.observe_target(1 + n, seconds_for(n))
        sizer.record_tree_round(n, round(tokens_for(n)))
    return chosen


def expected_tokens(n: int, decay: float = 0.6) -> float:
    """1 + the accepted nodes of an n-node tree whose k-th node is accepted with chance 0.7 * decay^k."""
    return 1 + sum(0.7 * decay**k for k in range(n))


def test_size_ladder_starts_with_plain_and_ends_with_the_whole_tree() -> None:
    assert size_ladder(1) == [0, 1]
    assert size_ladder(32) == [0, 1, 2, 3, 4, 6, 9, 13, 19, 28, 32]
    with pytest.raises(ValueError, match="max_draft_tokens"):
        tree_sizer(0)


@pytest.mark.parametrize(("decay", "cost_per_node", "best"), [(0.9, 0.0, 32), (0.6, 0.02, 6), (0.6, 1.0, 0)])
def test_tree_sizer_settles_on_the_fastest_size(decay: float, cost_per_node: float, best: int) -> None:
    # GPU-like (nodes free): the whole tree; CPU-like (each node costs 2% of a step): a few nodes;
    # useless heads (a node costs a whole step): plain decoding.
    sizer = tree_sizer(32)
    tokens = {n: round(1000 * expected_tokens(n, decay)) for n in sizer.sizes}
    rates = {n: tokens[n] / (1 + cost_per_node * n) for n in sizer.sizes}
    assert max(rates, key=lambda n: rates[n]) == best  # the test's premise
    chosen = play(sizer, 200, lambda n: tokens[n], lambda n: 1 + cost_per_node * n)
    assert sizer.best_tree_size == best
    assert sum(n == best for n in chosen[-100:]) >= 90  # exploits, probing now and then
    # The ladder is climbed from plain decoding, each size twice, until two sizes in a row rate
    # below the best: a tree that cannot pay is never tried at its largest.
    climbed = sizer.sizes[: sizer.sizes.index(best) + 3]
    assert chosen[: 2 * len(climbed)] == [n for n in climbed for _ in range(2)]


def test_plain_rounds_ahead_counts_down_to_the_next_probe() -> None:
    # Plain decoding is best (each node costs a whole step): between probes the sizer knows how many
    # rounds stay plain, and no round it promised plain drafts.
    sizer = tree_sizer(16)
    request: Any = SimpleNamespace(request_id="r")
    chosen, ahead = [], []
    for _ in range(700):
        n = sizer.budgets([request])[0]
        chosen.append(n)
        ahead.append(sizer.plain_rounds_ahead())
        sizer.observe_target(1 + n, 1.0 + n)
        sizer.record_tree_round(n, round(1000 * expected_tokens(n, 0.6)))
    assert chosen[:6] == [0, 0, 1, 1, 2, 2] and ahead[:6] == [0] * 6  # climbing: any round may draft
    for i, k in enumerate(ahead):
        assert not any(chosen[i + 1: i + 1 + k]), i  # promised plain rounds stay plain
    probes = [i for i, n in enumerate(chosen) if i >= 6 and n]
    assert len(probes) >= 5 and all(ahead[i - 1] == 0 for i in probes)  # each probe was announced
    assert max(ahead) == 126  # probes 128 rounds apart: the first plain round after one knows the other 126


@pytest.mark.parametrize(("gain", "played"), [(1.03, False), (1.10, True)])
def test_tree_sizer_needs_a_margin_over_plain_decoding(gain: float, played: bool) -> None:
    # A one-node tree emitting `gain` tokens a round for the price of a plain step (every other
    # size worse): 3% over plain decoding is within the estimates' noise and not played (the
    # default must never lose); 10% is.
    sizer = tree_sizer(8)
    chosen = play(sizer, 300, lambda n: 1000 * (gain if n == 1 else 1.0), lambda n: 1.0)
    assert sizer.best_tree_size == (1 if played else 0)
    assert (sum(n == 1 for n in chosen[-100:]) >= 90) == played


def test_tree_sizer_follows_a_change_in_costs() -> None:
    sizer = tree_sizer(16)
    play(sizer, 100, lambda n: 1000 * expected_tokens(n, 0.9), lambda n: 1.0)
    assert sizer.best_tree_size == 16
    play(sizer, 400, lambda n: 1000 * expected_tokens(n, 0.9), lambda n: 1 + n)  # nodes became dear
    assert sizer.best_tree_size == 0


def test_tree_probes_back_off_where_speculation_does_not_pay() -> None:
    # Nodes cost a whole step each: plain decoding is best. The climb stops after the 1- and 2-node
    # trees lose; then a probe of the smallest tree comes after 16 rounds, then 32, 64 and 128 (each
    # left plain decoding best), and every 128 rounds from then on: a request that cannot gain pays
    # for ever fewer probes.
    sizer = tree_sizer(16)
    warmup = 2 * 3
    chosen = play(sizer, warmup + 1000, lambda n: 1000 * expected_tokens(n, 0.6), lambda n: 1 + n)
    assert chosen[:warmup] == [0, 0, 1, 1, 2, 2]
    assert sizer.best_tree_size == 0
    probes = [i for i, n in enumerate(chosen) if i >= warmup and n]
    assert all(chosen[i] == 1 for i in probes)  # from plain decoding, the smallest tree
    gaps = [b - a for a, b in zip([warmup - 1, *probes], probes, strict=False)]
    assert gaps[:4] == [16, 32, 64, 128] and set(gaps[4:]) == {128}


@pytest.mark.parametrize("backend", list(KV_BACKENDS))
def test_greedy_parity_over_a_quantized_target(tiny_llama: Path, heads_dirs: dict[str, Path], backend: str) -> None:
    """Medusa in front of a target quantized at load (Q4_1 blocks on the quantized kernels): the tree
    verification passes give every accepted token plain quantized decoding's bits, with long paths
    accepted through the tree (an oracle plants the true continuation)."""
    from infer.models.quantized import QuantLinear

    options: dict[str, Any] = dict(dtype="float32", device="cpu", quantization="q4_1", max_batch_size=3,
                                   **KV_BACKENDS[backend])
    plain = [o.token_ids for o in LLM(str(tiny_llama), **options).generate(DRAFTER_PROMPTS, greedy())]
    llm = LLM(str(tiny_llama), speculator="medusa", medusa_heads=str(heads_dirs["default"]),
              medusa_tree_size=MedusaConfig(1, 1, 1).tree_size, **options)
    assert isinstance(llm.engine.model.model.layers[0].mlp.gate_up_proj, QuantLinear)  # type: ignore[union-attr]
    prompt_ids = [llm.tokenizer.encode(p) for p in DRAFTER_PROMPTS]
    plant_oracle(llm, {tuple(ids): out for ids, out in zip(prompt_ids, plain, strict=True)})
    outputs = llm.generate(prompt_ids, greedy())
    assert [o.token_ids for o in outputs] == plain
    assert sum(o.metrics.mean_accepted_tokens or 0 for o in outputs) / len(outputs) > 2.0
