"""Exact-greedy mode: a token's logits are bit-identical in a (K+1)-row verification pass (chain or
tree, alone or batched, slotted or paged) and in the 1-token decode step, so greedy speculation in
bfloat16 emits plain decoding's tokens. The same holds by default where the CPU decoder stack runs
(``CpuStack``: one C call per pass). The layer-by-layer kernels are shown not to have that property
(the negative control), so the equality tests can fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import make_medusa_heads, make_tiny_checkpoint
from infer import LLM, SamplingParams
from infer.backends.exact import ROWS, RowChunked, check_invariance, exact_attention, make_exact
from infer.cache import make_pool
from infer.core.model_runner import ModelRunner
from infer.engine.config import EngineConfig
from infer.kernels import cpu
from infer.loader import load_model
from infer.models.layers import DecoderOnlyLM
from infer.speculative.tree import tree_attention_mask, tree_depths

# A tree of 7 nodes, parents first: two children of the root, a chain of depth 4 on the first.
PARENTS = [-1, -1, 0, 0, 2, 1, 4]


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers with the real model's widths (576 -> 1536 -> 576, 9 query / 3 KV heads of 64): at
    these shapes the default bfloat16 kernels round a 1-row step differently from a 6-row pass (the
    64-wide tiny models happen to agree bit for bit on the project's CPU, so they cannot show it)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("wide_llama"), "llama", hidden_size=576,
                                intermediate_size=1536, num_heads=9, num_kv_heads=3, num_layers=2, seed=0)


def bf16_model(path: Path, exact: bool, stack: bool = True) -> DecoderOnlyLM:
    """The model in bfloat16; ``stack=False`` runs it layer by layer even where the C decoder stack
    could (exact mode then uses its portable kernels: RowChunked and exact_attention)."""
    model, _ = load_model(path, "bfloat16", "cpu")
    if not stack:
        model.backend.cpu_stack = None
    if exact:
        make_exact(model)
    return model


def runner_for(model: DecoderOnlyLM, backend: str) -> ModelRunner:
    c = model.config
    pool = make_pool(backend, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, max_seq_len=320, max_batch_size=2, block_size=8, num_blocks=None,
                     dtype=model.model.embed_tokens.weight.dtype, device=torch.device("cpu"))
    return ModelRunner(model, pool)


def step_logits(runner: ModelRunner, slot: int, start: int, tokens: list[int]) -> torch.Tensor:
    """Logits [V] of the last of ``tokens`` fed one 1-token decode step at a time after ``start``."""
    runner.pool.truncate_to(slot, start)
    for token in tokens:
        logits = runner.logits(runner.forward([slot], [[token]]))[0, 0]
    return logits


def pass_vs_steps(model: DecoderOnlyLM, backend: str, kind: str, batched: bool, ragged: bool = False,
                  start: int = 188) -> list[bool]:
    """Per row of one verification pass (``kind`` chain: g + 5 drafts; tree: g + the PARENTS tree),
    whether its logits equal, bit for bit, those of plain 1-token steps along the row's path.
    ``ragged``: the pass packs the runs' tokens (``ModelRunner.forward_ragged``) instead of padding.
    ``start``: the cached tokens before the pass (at most 257)."""
    runner = runner_for(model, backend)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # By default the pass starts at 188: its rows straddle a key block boundary (192), and the
    # batched sequence is longer, so these rows' keys are followed by ~70 masked ones (a single
    # product over all keys would sum them in another order than a step's: it splits the keys by count).
    context, other = torch.randint(vocab, (start,), generator=gen).tolist(), torch.randint(vocab, (260,), generator=gen).tolist()
    slot = runner.pool.allocate()
    runner.forward([slot], [context])
    start = len(context)
    g, nodes = 7, torch.randint(vocab, (len(PARENTS),), generator=gen).tolist()
    if kind == "chain":
        run, positions, mask = [g] + nodes[:5], None, None
        paths = [[g] + nodes[:i] for i in range(6)]
    else:
        parents = torch.tensor([PARENTS])
        mask = tree_attention_mask(parents, [len(PARENTS)])
        run, positions = [g] + nodes, start + tree_depths(mask)

        def path(i: int) -> list[int]:  # tokens from the root down to node i
            return [g] if i < 0 else path(PARENTS[i]) + [nodes[i]]

        paths = [[g]] + [path(i) for i in range(len(PARENTS))]
    slots, runs = [slot], [run]
    if batched:  # the pass also carries another sequence with a different length (padding, gathers)
        second = runner.pool.allocate()
        runner.forward([second], [other[:257]])
        slots, runs = [second, slot], [other[257:], run]
        if mask is not None:
            mask = torch.cat([tree_attention_mask(torch.tensor([[-1, 0, 1, -1, -1, -1, -1]]), [2]), mask])
            positions = torch.cat([torch.tensor([[257, 258, 259] + [260] * 5]), positions])
    if ragged:
        packed = runner.forward_ragged(slots, runs, positions=positions, tree_mask=mask)
        assert packed.rows == sum(len(r) for r in runs) < len(runs) * max(len(r) for r in runs) or not batched
        verify = runner.logits(packed.hidden)[packed.offsets[-2]:]
    else:
        verify = runner.logits(runner.forward(slots, runs, positions=positions, tree_mask=mask))[-1]
    return [torch.equal(verify[i], step_logits(runner, slot, start, p)) for i, p in enumerate(paths)]


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "layers"])
@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_every_verification_row_equals_the_decode_step_bit_for_bit(wide_llama: Path, backend: str, kind: str,
                                                                   stack: bool) -> None:
    model = bf16_model(wide_llama, exact=True, stack=stack)
    assert all(pass_vs_steps(model, backend, kind, batched=False))
    assert all(pass_vs_steps(model, backend, kind, batched=True))


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_rows_whose_keys_straddle_an_attention_segment_equal_the_decode_step(wide_llama: Path, kind: str) -> None:
    """The C stack's attention takes a row's key list in segments of cpu.STACK_ATTN_SEGMENT keys and
    merges them: a pass (float32) starting just before a segment's end has rows of one segment and of two
    (a tree's row skips its hidden siblings, so its list indices past the boundary are not its
    positions), alone and beside a batched sequence whose keys span three segments. Each row still
    equals its decode step."""
    model, _ = load_model(wide_llama, "float32", "cpu")  # float32: no bfloat16 rounding hides a difference
    assert model.backend.cpu_stack is not None
    for start in (cpu.STACK_ATTN_SEGMENT - 4, 2 * cpu.STACK_ATTN_SEGMENT - 1):
        assert all(pass_vs_steps(model, "paged", kind, batched=True, start=start)), start
        assert all(pass_vs_steps(model, "paged", kind, batched=False, start=start)), start


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "layers"])
@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_ragged_pass_rows_equal_the_decode_step_bit_for_bit(wide_llama: Path, backend: str, kind: str,
                                                            stack: bool) -> None:
    """A ragged pass (runs packed back to back, no padding rows through the model) computes every
    row as a decode step does, on the C stack (each token as its own sequence) and the layers
    (attention in the padded layout), in exact mode and, on the stack, without it."""
    model = bf16_model(wide_llama, exact=True, stack=stack)
    assert all(pass_vs_steps(model, backend, kind, batched=True, ragged=True))
    if stack and model.backend.cpu_stack is not None:
        assert all(pass_vs_steps(bf16_model(wide_llama, exact=False), backend, kind, batched=True, ragged=True))


def test_qk_norm_architecture_is_exact_too(tiny_qwen3: Path) -> None:
    """Qwen3's per-head q/k norms are row-wise modules as well: wrapped, and still exact."""
    assert all(pass_vs_steps(bf16_model(tiny_qwen3, exact=True), "paged", "tree", batched=True))


@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_cpu_stack_is_exact_without_the_mode(wide_llama: Path, backend: str, kind: str) -> None:
    """The C decoder stack computes each token's attention alone over its visible keys, and its
    row-wise kernels do not depend on the row count, so passes it takes are exact by default."""
    model = bf16_model(wide_llama, exact=False)
    if model.backend.cpu_stack is None:
        pytest.skip("the CPU decoder stack does not run here (needs the AVX-512 BF16 kernels)")
    assert all(pass_vs_steps(model, backend, kind, batched=False))
    assert all(pass_vs_steps(model, backend, kind, batched=True))


def test_layer_by_layer_kernels_are_not_exact_in_bfloat16(wide_llama: Path) -> None:
    """Negative control: with the layers run one by one in PyTorch (the path of GPUs, of passes
    above the stack's row limit, and of CPUs without the kernels) the same comparisons find
    differing rows, so the tests above would catch exactness not taking effect. (Which rows differ
    is chance: a rounding apart changes a bfloat16 result only now and then.)"""
    model = bf16_model(wide_llama, exact=False)
    model.backend.cpu_stack = None
    rows = [same for kind in ("chain", "tree") for batched in (False, True)
            for same in pass_vs_steps(model, "paged", kind, batched)]
    assert not all(rows)


class ShapeSpy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return x * 2 + 1


def test_row_chunked_calls_its_module_with_exactly_rows_rows() -> None:
    spy = ShapeSpy()
    chunked = RowChunked(spy)
    for shape in [(1, 1, 5), (1, 6, 5), (2, 7, 5), (3, 5)]:
        x = torch.randn(*shape)
        assert torch.equal(chunked(x), x * 2 + 1)
    assert set(spy.shapes) == {(ROWS, 5)} and len(spy.shapes) == 1 + 1 + 2 + 1
    assert chunked(torch.randn(0, 5)).shape == (0, 5)  # an empty pass stays empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(204, 151), (300, 150), (520, 300)])
def test_exact_attention_ignores_query_count_context_padding_and_interleaved_keys(
        dtype: torch.dtype, lengths: tuple[int, int]) -> None:
    """float32 inputs give float32 outputs, so this sees any difference in the sums' order. The
    lengths are a batch's two sequences: the shorter one's keys are followed by masked ones, which
    a single product over all keys sums in another order (its kernel splits the keys by count)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 11, 64, generator=gen).to(dtype)  # the real model's heads: 9 over 3 KV heads of 64
    keys, values = (torch.randn(2, 3, lengths[0], 64, generator=gen).to(dtype) for _ in range(2))
    ends = torch.tensor(lengths).unsqueeze(1)
    position = ends - 11 + torch.arange(11)  # [B, T] query positions
    mask = (torch.arange(lengths[0]) <= position.unsqueeze(-1)).unsqueeze(1)  # causal, [B, 1, T, L]
    whole = exact_attention(q, keys, values, mask)
    for t in range(11):
        for b in range(2):
            seen = int(position[b, t]) + 1
            alone = exact_attention(q[b: b + 1, :, t: t + 1], keys[b: b + 1, :, :seen], values[b: b + 1, :, :seen], None)
            assert torch.equal(whole[b: b + 1, :, t: t + 1], alone), (b, t)
    # A tree row sees its ancestors with other nodes between them (here across a key block
    # boundary): it must come out as the step that sees just those keys, packed.
    seen = list(range(120)) + [120, 125, 129, 140]
    spread = torch.zeros(1, 1, 1, lengths[0], dtype=torch.bool)
    spread[..., seen] = True
    packed = exact_attention(q[:1, :, :1], keys[:1, :, seen], values[:1, :, seen], None)
    assert torch.equal(exact_attention(q[:1, :, :1], keys[:1], values[:1], spread), packed)
    assert whole.shape == q.shape and whole.dtype == dtype


def test_make_exact_is_idempotent_and_passes_its_load_check(tiny_llama: Path) -> None:
    model = bf16_model(tiny_llama, exact=True)
    head = model.lm_head
    make_exact(model)
    assert model.lm_head is head
    check_invariance(model)
    assert ROWS >= 6  # a default K=5 chain verifies in one block


def test_load_check_refuses_kernels_that_depend_on_the_pass(wide_llama: Path) -> None:
    """The check at load fails a model whose kernels are not row-invariant: the default bfloat16 ones
    at the real model's widths (the negative control above shows their rows differ)."""
    with pytest.raises(RuntimeError, match="depends on the shape of the pass"):
        check_invariance(bf16_model(wide_llama, exact=False))
    check_invariance(bf16_model(wide_llama, exact=True))
    check_invariance(bf16_model(wide_llama, exact=True, stack=False))


def test_flex_tree_attention_is_refused_with_exact_greedy(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="exact_greedy"):
        EngineConfig(model=str(tiny_llama), exact_greedy=True, tree_attention="flex")


def greedy_run(llm: LLM, prompts: list[str] | list[list[int]], max_tokens: int) -> tuple[list[list[int]], int, int]:
    """Generated ids per prompt, and the drafts proposed and accepted over all of them."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return ([o.token_ids for o in outs], sum(o.metrics.proposed_tokens for o in outs),
            sum(o.metrics.accepted_tokens for o in outs))


def test_greedy_speculation_is_token_identical_in_bfloat16(tiny_llama: Path, tmp_path: Path) -> None:
    """Engine level, three requests batched: plain, n-gram and Medusa (tree) decoding emit the same ids.
    The untrained Medusa heads are rarely right, but every tree round's first row still decides a token."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(512, (n,), generator=gen).tolist() * 2 for n in (5, 9, 14)]  # repeats: n-gram hits
    common = dict(dtype="bfloat16", device="cpu", exact_greedy=True, max_batch_size=3)
    plain, _, _ = greedy_run(LLM(str(tiny_llama), **common), prompts, 40)  # type: ignore[arg-type]
    heads = make_medusa_heads(tiny_llama, tmp_path / "heads", tree_size=12)
    # A fixed tree size: every round verifies a tree (a measured size could settle on plain steps).
    medusa = {"speculator": "medusa", "medusa_heads": str(heads), "medusa_tree_size": 6}
    for options in ({"speculator": "ngram"}, medusa):
        ids, proposed, accepted = greedy_run(LLM(str(tiny_llama), **common, **options), prompts, 40)  # type: ignore[arg-type]
        assert ids == plain, options
        assert proposed > 0 and (accepted > 0 or options["speculator"] == "medusa"), (options, proposed, accepted)
