"""The CPU kernels (infer.models.cpu_kernels): the streaming matrix-vector product against F.linear,
and the fused small operators against the layers they stand in for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from infer.cache import make_pool
from infer.core.model_runner import ModelRunner
from infer.loader import load_model
from infer.models import cpu_kernels
from infer.models.cpu_kernels import MAX_ROWS, GemvLinear, gemv, gemv_available, rms_norm, rope, silu_mul
from infer.models.layers import MLP, Attention, RMSNorm, apply_rope, cpu_fused_available, rope_cos_sin
from infer.speculative.tree import tree_attention_mask, tree_depths

DTYPES = [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)]


def _needs(dtype: torch.dtype) -> None:
    if not gemv_available(dtype):
        pytest.skip(f"no {dtype} CPU kernel here (needs Linux x86-64 with AVX-512 (BF16) and a C compiler)")


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("inner", [32, 64, 96, 17, 200])  # whole vectors, two chains, a masked tail
def test_matches_f_linear(dtype: torch.dtype, tol: float, inner: int) -> None:
    _needs(dtype)
    gen = torch.Generator().manual_seed(inner)
    weight, bias = torch.randn(37, inner, generator=gen).to(dtype), torch.randn(37, generator=gen).to(dtype)
    x = torch.randn(2, 5, inner, generator=gen).to(dtype)
    for b in (bias, None):
        ours = gemv(x, weight, b)
        assert ours.shape == (2, 5, 37) and ours.dtype == dtype
        torch.testing.assert_close(ours.float(), F.linear(x, weight, b).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_each_row_is_the_same_whatever_the_row_count(dtype: torch.dtype, tol: float) -> None:
    # What keeps greedy speculation exact: a verification pass's rows equal decode steps' bit for bit.
    _needs(dtype)
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(300, 576, generator=gen).to(dtype), torch.randn(6, 576, generator=gen).to(dtype)
    together = gemv(x, weight)
    alone = torch.cat([gemv(x[i: i + 1], weight) for i in range(6)])
    assert torch.equal(together, alone)


def test_linear_shares_weights_and_falls_back_for_many_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs(torch.bfloat16)
    linear = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    fast = GemvLinear(linear)
    assert fast.weight is linear.weight and fast.bias is linear.bias
    calls: list[int] = []
    real = gemv

    def counting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(x, weight, bias)

    monkeypatch.setattr("infer.models.cpu_kernels.gemv", counting)
    with torch.inference_mode():
        for rows in (1, MAX_ROWS, MAX_ROWS + 1):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            torch.testing.assert_close(fast(x).float(), linear(x).float(), rtol=2e-2, atol=2e-2)
    assert calls == [1, MAX_ROWS]  # the prefill-sized product went to F.linear


# ----------------------------------------------------------------------------- fused small operators


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_fused_operators_match_the_reference_layers(dtype: torch.dtype, tol: float) -> None:
    _needs(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 96, generator=gen).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps).float(), norm(x).float(), rtol=tol, atol=tol)
    torch.testing.assert_close(silu_mul(x).float(), (F.silu(x[..., :48]) * x[..., 48:]).float(), rtol=tol, atol=tol)
    # RoPE has no sum to reorder: with FMA contraction off it rounds exactly where the reference does.
    qkv = torch.randn(2, 5, 7, 16, generator=gen).to(dtype)  # 4 query + 1 key heads rotated, 2 value heads not
    cos, sin = rope_cos_sin(torch.rand(8, generator=gen), torch.arange(10).view(2, 5) + 3, dtype)
    assert torch.equal(rope(qkv[:, :, :5], cos, sin), apply_rope(qkv[:, :, :5], cos, sin))


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_fused_operators_compute_each_row_the_same_whatever_the_row_count(dtype: torch.dtype, tol: float) -> None:
    _needs(dtype)
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(6, 576, generator=gen).to(dtype), torch.randn(576, generator=gen).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-5), torch.cat([rms_norm(x[i: i + 1], weight, 1e-5) for i in range(6)]))
    assert torch.equal(silu_mul(x), torch.cat([silu_mul(x[i: i + 1]) for i in range(6)]))


def test_pack_for_cpu_turns_the_fused_operators_on_unless_told_not_to(tiny_llama: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _needs(torch.bfloat16)

    def fused_flags() -> set[bool]:
        model, _ = load_model(str(tiny_llama), torch.bfloat16, "cpu")
        return {m.cpu_fused for m in model.modules() if isinstance(m, (RMSNorm, Attention, MLP))}

    assert fused_flags() == {True}
    monkeypatch.setenv("INFER_CPU_FUSED", "0")
    cpu_fused_available.cache_clear()
    try:
        assert fused_flags() == {False}
    finally:
        monkeypatch.delenv("INFER_CPU_FUSED")
        cpu_fused_available.cache_clear()


def test_small_passes_run_torch_single_threaded_and_the_kernels_on_every_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _needs(torch.bfloat16)
    seen: list[tuple[int, int]] = []  # (torch's threads, the kernel's) per product
    real = cpu_kernels._gemv

    def spying(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append((torch.get_num_threads(), cpu_kernels._threads()))
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_kernels, "_gemv", spying)
    linear = GemvLinear(torch.nn.Linear(64, 48, dtype=torch.bfloat16))
    torch.set_num_threads(2)  # the autouse fixture restores the test's thread count
    with torch.inference_mode(), cpu_kernels.kernel_threads_only():
        linear(torch.randn(3, 64, dtype=torch.bfloat16))
        with cpu_kernels.kernel_threads_only():  # nested: changes nothing
            linear(torch.randn(1, 64, dtype=torch.bfloat16))
    assert torch.get_num_threads() == 2 and cpu_kernels._kernel_threads[0] is None
    assert seen == [(1, 2), (1, 2)]


# ----------------------------------------------------------------------------- the decoder stack in C


def _runner(model: torch.nn.Module, backend: str, dtype: torch.dtype) -> ModelRunner:
    c = model.config  # type: ignore[union-attr]
    pool = make_pool(backend, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, max_seq_len=256, max_batch_size=3, block_size=8, num_blocks=None,
                     dtype=dtype, device=torch.device("cpu"))
    return ModelRunner(model, pool)  # type: ignore[arg-type]


def _passes(model: torch.nn.Module, backend: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Hidden states of a sequence of passes over three sequences: prefills of different lengths
    (the paged pool's blocks interleave), a batched decode step, a chain verification of uneven
    runs (padding), a rollback and a tree verification batched with a chain."""
    runner = _runner(model, backend, dtype)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size  # type: ignore[union-attr]

    def ids(n: int) -> list[int]:
        return torch.randint(vocab, (n,), generator=gen).tolist()

    slots = [runner.pool.allocate() for _ in range(3)]
    out = [runner.forward([s], [ids(n)]) for s, n in zip(slots, (13, 29, 7), strict=True)]
    out.append(runner.forward(slots, [ids(1) for _ in slots]))
    out.append(runner.forward(slots, [ids(6), ids(2), ids(4)]))
    runner.pool.truncate_to(slots[0], 15)
    parents = torch.tensor([[-1, 0, 0, 1, -1, -1], [-1, 0, 1, 2, 3, 4]])
    mask = tree_attention_mask(parents, [4, 6])
    positions = torch.tensor([[runner.pool.seq_len(s)] for s in slots[:2]]) + tree_depths(mask)
    out.append(runner.forward(slots[:2], [ids(4), ids(6)], positions=positions, tree_mask=mask))
    return [o.float() for o in out]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_stack_matches_the_layers_it_replaces(tiny_qwen2: Path, dtype: torch.dtype, tol: float, backend: str) -> None:
    """The C decoder stack against the same model run layer by layer, on every kind of pass (Qwen2:
    projection biases too). bfloat16 rounds attention differently (a few ulps after two layers)."""
    _needs(dtype)
    model, _ = load_model(str(tiny_qwen2), dtype, "cpu")
    assert model.cpu_stack is not None
    ours = _passes(model, backend, dtype)
    stack, model.cpu_stack = model.cpu_stack, None
    reference = _passes(model, backend, dtype)
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * 4, msg=f"pass {i}")
    # A negative control: the comparison sees a stack that skips its second layer.
    model.cpu_stack = stack
    stack.shape = {**stack.shape, "layers": 1}
    assert not torch.allclose(_passes(model, backend, dtype)[-1], reference[-1], rtol=tol, atol=tol * 4)


def test_stack_takes_small_passes_unless_told_not_to(tiny_llama: Path, tiny_qwen3: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _needs(torch.bfloat16)
    model, _ = load_model(str(tiny_llama), torch.bfloat16, "cpu")
    stack = model.cpu_stack
    assert stack is not None
    calls: list[int] = []
    real = cpu_kernels.decoder_stack

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0] * x.shape[1])
        return real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "decoder_stack", counting)
    runner = _runner(model, "paged", torch.bfloat16)
    slot = runner.pool.allocate()
    runner.forward([slot], [[1] * (MAX_ROWS + 1)])  # a prefill above the limit: layer by layer
    runner.forward([slot], [[2] * MAX_ROWS])
    stack.max_rows = None  # exact-greedy mode: every pass
    runner.forward([slot], [[3] * (MAX_ROWS + 1)])
    assert calls == [MAX_ROWS, MAX_ROWS + 1]
    assert load_model(str(tiny_qwen3), torch.bfloat16, "cpu")[0].cpu_stack is None  # per-head norms: layers
    monkeypatch.setenv("INFER_CPU_STACK", "0")
    assert load_model(str(tiny_llama), torch.bfloat16, "cpu")[0].cpu_stack is None
