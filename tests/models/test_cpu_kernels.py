"""The streaming CPU matrix-vector kernel (infer.models.cpu_kernels) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.models.cpu_kernels import MAX_ROWS, GemvLinear, gemv, gemv_available

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
