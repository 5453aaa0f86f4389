"""The Triton paged-attention kernel (``backends.triton_attention``) against PyTorch.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors:
scattered block tables, padded and packed (ragged) passes, decode rows, prefill chunks, chain and
tree masks, sliding windows measured from tree positions, GQA ratios 1 to 8, float32/bfloat16/float16.
The reference here is written independently of the kernel (a dense mask per sequence and a float32
softmax); the model tests compare whole passes with the kernel against the same passes through SDPA.
The ``cuda`` tests run the compiled kernel on a GPU (``pytest -m cuda``; skipped without one).

Triton reads ``TRITON_INTERPRET`` when it is imported, and one process cannot hold both an
interpreted and a compiled Triton: so the interpreted tests run in a child pytest on this file with
the variable set (``test_interpreted_tests_pass``); each process deselects the other's tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from helpers import run_interpreted_half
from infer.backends import choose_backend, triton_attention
from infer.cache import make_pool
from infer.core.model_runner import ModelRunner
from infer.models import MODEL_REGISTRY
from infer.models.config import FULL, SLIDING, ModelConfig
from infer.models.layers import Attention, DecoderOnlyLM

pytest.importorskip("triton", reason="triton is in the dev extra (pip install -e '.[dev]')")

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Each process runs its own half of this file and deselects the other (tests/conftest.py): the
# interpreted tests run in test_interpreted_tests_pass's child pytest, under TRITON_INTERPRET=1.
interpreted = pytest.mark.triton_interpreted
in_parent = pytest.mark.triton_parent


@in_parent
def test_interpreted_tests_pass() -> None:
    """This file's interpreted tests, in a child pytest with Triton's interpreter on."""
    run_interpreted_half(__file__)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a tree given each node's parent (node 0 the root, -1)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for node in range(1, n):
        mask[node] |= mask[parents[node]]
    return mask


@dataclass
class Case:
    """One pass: per sequence, its new tokens (``query_lens``) and its length after the pass."""

    name: str
    query_lens: list[int]
    seq_lens: list[int]
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 4
    packed: bool = True  # queries back to back; False: padded to the longest run
    tree: bool = False
    window: int | None = None


CASES = [
    Case("decode", [1, 1, 1], [9, 1, 70], heads=6, kv_heads=2),
    Case("prefill-chunks", [6, 9], [6, 30], heads=8, kv_heads=1, block_size=16),
    Case("ragged-verify", [3, 1, 5], [12, 4, 21], heads=4, kv_heads=4, block_size=1),
    Case("padded-verify", [2, 5], [7, 15], packed=False, head_dim=48),
    Case("tree", [5, 7], [11, 20], tree=True, heads=6, kv_heads=3),
    Case("window-chain", [1, 4, 8], [40, 13, 8], window=6, heads=8, kv_heads=2),
    Case("window-tree", [6, 4], [30, 9], tree=True, window=5, packed=False, block_size=8),
]


@dataclass
class Pass:
    q: torch.Tensor  # [N, heads, head_dim]
    k: torch.Tensor  # [rows, kv_heads, head_dim]
    v: torch.Tensor
    table: torch.Tensor
    meta: torch.Tensor  # [3, B] int32
    width: int
    tree: torch.Tensor | None
    positions: torch.Tensor  # [B, width] RoPE positions (depth-based in a tree)


def make_pass(case: Case, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> Pass:
    """Random K/V in a pool whose blocks are handed out in shuffled order (tables interleave)."""
    gen = torch.Generator().manual_seed(seed)
    batch, width, size = len(case.seq_lens), max(case.query_lens), case.block_size
    blocks_per_seq = [-(-n // size) for n in case.seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(batch, max(blocks_per_seq), dtype=torch.long)
    taken = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = order[taken:taken + n]
        taken += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    k, v = rand(num_blocks * size, case.kv_heads, case.head_dim), rand(num_blocks * size, case.kv_heads, case.head_dim)
    firsts = [sum(case.query_lens[:b]) for b in range(batch)] if case.packed else [b * width for b in range(batch)]
    tokens = sum(case.query_lens) if case.packed else batch * width
    meta = torch.tensor([firsts, case.query_lens, case.seq_lens], dtype=torch.int32)
    tree = None
    positions = torch.zeros(batch, width, dtype=torch.long)
    for b, (n, length) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        positions[b, :n] = torch.arange(length - n, length)
    if case.tree:
        tree = torch.zeros(batch, width, width, dtype=torch.bool)
        for b, n in enumerate(case.query_lens):
            parents = [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, n)]
            tree[b, :n, :n] = ancestor_mask(parents)
            positions[b, :n] = case.seq_lens[b] - n + tree[b, :n, :n].sum(-1) - 1  # start + depth
        tree = tree.to(device)
    return Pass(rand(tokens, case.heads, case.head_dim), k, v, table.to(device), meta.to(device), width, tree,
                positions.to(device))


def reference(case: Case, p: Pass, scale: float | None = None) -> torch.Tensor:
    """Each sequence's context gathered through its table, a dense mask, float32 softmax."""
    out = torch.zeros(p.q.shape, dtype=torch.float32)
    group = case.heads // case.kv_heads
    for b, (n, length) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        first, start = int(p.meta[0, b]), length - n
        keys = torch.arange(length)
        rows = p.table[b].cpu()[keys // case.block_size] * case.block_size + keys % case.block_size
        k = p.k.cpu()[rows].float().repeat_interleave(group, 1)
        v = p.v.cpu()[rows].float().repeat_interleave(group, 1)
        q = p.q.cpu()[first:first + n].float()
        index = torch.arange(start, length)
        visible = keys[None] <= index[:, None]
        if p.tree is not None:
            tree = p.tree.cpu()[b, :n, :n]
            visible = (keys[None] < start) | tree[:, (keys - start).clamp(min=0)]
        if case.window is not None:
            visible &= keys[None] > p.positions.cpu()[b, :n, None] - case.window
        scores = torch.einsum("qhd,khd->hqk", q, k) * (scale or case.head_dim ** -0.5)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[first:first + n] = torch.einsum("hqk,khd->qhd", weights, v)
    return out


def run_kernel(case: Case, p: Pass, scale: float | None = None) -> torch.Tensor:
    return triton_attention.paged_attention(
        p.q, p.k, p.v, p.table, case.block_size, p.meta, p.width, tree_mask=p.tree, window=case.window,
        positions=p.positions if case.window is not None else None, scale=scale,
        out=torch.zeros_like(p.q))


def check(case: Case, dtype: torch.dtype, device: str, scale: float | None = None) -> None:
    p = make_pass(case, dtype, device)
    got = run_kernel(case, p, scale).float().cpu()
    want = reference(case, p, scale)
    # Rows no query owns (a padded pass's padding) stay as allocated: zeros.
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(case: Case, dtype: torch.dtype) -> None:
    check(case, dtype, "cpu")


@interpreted
def test_scale_and_negative_control() -> None:
    """A custom scale (Gemma's query_pre_attn_scalar) is honoured, and the comparison can fail: the
    same pass with a tree mask that lets a node see a sibling differs from the reference."""
    case = CASES[4]
    check(case, torch.float32, "cpu", scale=0.3)
    p = make_pass(case, torch.float32)
    assert p.tree is not None
    wrong = p.tree.clone()
    wrong[:, 2, 1] = ~wrong[:, 2, 1]  # node 2 sees node 1 or stops seeing it
    got = triton_attention.paged_attention(p.q, p.k, p.v, p.table, case.block_size, p.meta, p.width,
                                           tree_mask=wrong, out=torch.zeros_like(p.q))
    assert not torch.allclose(got, reference(case, p), atol=1e-3)


@in_parent
def test_bad_input_is_named() -> None:
    p = make_pass(CASES[0], torch.float32)
    with pytest.raises(ValueError, match="query heads do not divide"):
        triton_attention.paged_attention(p.q[:, :5], p.k, p.v, p.table, 4, p.meta, 1)
    with pytest.raises(ValueError, match="cache is torch.float16"):
        triton_attention.paged_attention(p.q, p.k.half(), p.v.half(), p.table, 4, p.meta, 1)
    with pytest.raises(ValueError, match="int32"):
        triton_attention.paged_attention(p.q, p.k, p.v, p.table, 4, p.meta.long(), 1)


# ------------------------------------------------------------------------- through the model


def paged(model: DecoderOnlyLM, on: bool) -> None:
    """Install (or remove) the kernel as every attention layer's paged attention, as the CUDA backend does."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.paged_attention = triton_attention.attend if on else None


def runner_for(model: DecoderOnlyLM, device: str = "cpu") -> ModelRunner:
    c = model.config
    pool = make_pool("paged", num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     max_seq_len=96, max_batch_size=4, block_size=4, num_blocks=None, dtype=torch.float32,
                     device=torch.device(device),
                     layer_windows=[c.layer_window(i) for i in range(c.num_hidden_layers)])
    return ModelRunner(model, pool)


def passes(model: DecoderOnlyLM, runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill three sequences one chunk at a time (their blocks interleave), then a decode step, a
    ragged verification (packed) and a tree verification at depth positions; every pass's hidden states."""
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(model.config.vocab_size, (n,), generator=gen).tolist()

    slots = [runner.pool.allocate() for _ in range(3)]
    out = []
    for chunk in (5, 7):
        for slot in slots:
            out.append(runner.forward([slot], [tokens(chunk)]))
    out.append(runner.forward(slots, [tokens(1) for _ in slots]))
    ragged = runner.forward_ragged(slots, [tokens(4), tokens(1), tokens(3)])
    out.append(ragged.hidden)
    parents = [[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 2], [-1, 0, 0, 0, 0]]
    tree = torch.stack([ancestor_mask(p) for p in parents])
    starts = torch.tensor([runner.pool.seq_len(s) for s in slots])
    positions = starts[:, None] + tree.sum(-1) - 1
    out.append(runner.forward(slots, [tokens(5) for _ in slots], positions=positions.to(runner.device),
                              tree_mask=tree.to(runner.device)))
    return out


def random_model(model_type: str) -> DecoderOnlyLM:
    """A small random model in the inference layout (fused projections), built without a checkpoint:
    Llama with 3 query heads per KV head, or Gemma 3 with sliding-window layers (in their own
    blocks in the pool), its own attention scale and q/k norms."""
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if model_type == "gemma3":
        config = ModelConfig(model_type="gemma3", **common, sliding_window=6, layer_types=[SLIDING, FULL],
                             rope_local_theta=10_000.0, rope_theta=1_000_000.0, query_pre_attn_scalar=24,
                             qk_norm=True, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)
    else:
        config = ModelConfig(model_type="llama", **common)
    model = MODEL_REGISTRY[model_type](config)
    model.fuse_projections()
    return model.eval()


@interpreted
@pytest.mark.parametrize("model_type", ["llama", "gemma3"])
def test_model_passes_with_the_kernel_equal_sdpa(model_type: str) -> None:
    """Prefill chunks, a batched decode step, a ragged verification and a tree verification give the
    same hidden states with the kernel reading the paged pool as with SDPA over gathered keys."""
    model = random_model(model_type)
    want = passes(model, runner_for(model))
    paged(model, True)
    got = passes(model, runner_for(model))
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------- compiled for a GPU, without one

# (dtype, heads, kv_heads, head_dim, max_query_len, tree, window, positions): between them every
# compile-time branch: Llama 3.2 3B's decode step (GQA 3, head dim 128), a tree verification with a
# window at tree positions, and a float32 prefill chunk at Gemma 3's head dim 256 with GQA 8.
COMPILED = [
    (torch.bfloat16, 24, 8, 128, 1, False, False, False),
    (torch.float16, 24, 8, 128, 6, True, True, True),
    (torch.float32, 8, 1, 256, 512, False, True, False),
]
POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
SHARED_MEMORY = 101_376  # bytes a block may use on sm_86/sm_89 (the smallest of the CUDA cards since sm_80)


@in_parent
@pytest.mark.parametrize("shape", COMPILED, ids=lambda s: f"{s[0]}-gqa{s[1] // s[2]}-d{s[3]}-q{s[4]}")
def test_kernel_compiles_for_hopper(shape: tuple) -> None:
    """Triton compiles the kernel to PTX and a cubin for sm_90 here (its bundled ptxas; no GPU needed),
    as the lent H100/H200 will: a kernel the interpreter runs may still not compile (types, layouts,
    shared memory), and that is found here rather than on the GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dtype, *dims, tree, window, positions = shape
    constants = triton_attention.kernel_constants(dtype, *dims, tree=tree, window=window, positions=positions)
    kernel = triton_attention._kernel()
    pointers = {"out_ptr": POINTER[dtype], "q_ptr": POINTER[dtype], "k_ptr": POINTER[dtype], "v_ptr": POINTER[dtype],
                "table_ptr": "*i64", "meta_ptr": "*i32", "tree_ptr": "*u8", "pos_ptr": "*i64"}
    signature = {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name == "qk_scale" else "i32")
                 for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm and compiled.asm["cubin"]
    assert compiled.metadata.shared <= SHARED_MEMORY, compiled.metadata.shared


# ------------------------------------------------------------------------- on a machine without CUDA


@in_parent
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without CUDA")
def test_cuda_backend_choice_without_cuda_says_why() -> None:
    backend = choose_backend("cuda", torch.bfloat16)
    assert not backend.paged_attention
    assert "paged attention: CUDA is not available" in backend.describe()


@in_parent
def test_older_gpus_keep_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "compute capability 8.0 or newer (this GPU has 7.5)" in str(triton_attention.unavailable_reason("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert triton_attention.unavailable_reason("cuda") is None


@in_parent
def test_cuda_paths_import_without_cuda_or_triton() -> None:
    """The CUDA code paths import on a machine without CUDA, and without Triton the backend names it."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import infer.backends.triton_attention as t, infer.backends.cuda_graphs, infer.backends\n"
            "print(t.unavailable_reason('cuda'))\n"
            "print(infer.backends.choose_backend('cuda', __import__('torch').float16).describe())\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "triton is not installed" in done.stdout
    assert "paged attention: triton is not installed" in done.stdout


# ------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_on_cuda_matches_reference(dtype: torch.dtype) -> None:
    assert not triton_attention.interpreted()
    for case in CASES:
        check(case, dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["llama", "gemma3"])
def test_cuda_backend_uses_the_kernel(model_type: str) -> None:
    """On CUDA the backend installs the kernel, and the model's passes equal SDPA's."""
    backend = choose_backend("cuda", torch.float32)
    assert backend.paged_attention, backend.describe()
    model = random_model(model_type).cuda()
    backend.prepare(model)
    assert all(m.paged_attention is triton_attention.attend for m in model.modules() if isinstance(m, Attention))
    got = passes(model, runner_for(model, "cuda"))
    paged(model, False)
    want = passes(model, runner_for(model, "cuda"))
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
