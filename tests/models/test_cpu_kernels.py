"""The CPU kernels (infer.kernels): every ISA variant this CPU runs against F.linear and the layers
they stand in for, the checks in front of every pointer, and the fallbacks that keep a load working
(no compiler, an unusable cache, a refused library, a failed probe, a CPU without BF16)."""

from __future__ import annotations

import os
import random
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from infer import kernels
from infer.backends.cpu_kernels import CpuStack, KernelAttention, KernelMLP, KernelRMSNorm, probe_stack
from infer.cache import make_pool
from infer.cache.protocol import build_kv_batch
from infer.core.model_runner import ModelRunner
from infer.kernels import build, cpu
from infer.kernels.cpu import MAX_ROWS, GemvLinear, KernelLibrary
from infer.loader import load_model
from infer.models.layers import MLP, Attention, RMSNorm, apply_rope, rope_cos_sin
from infer.speculative.tree import tree_attention_mask, tree_depths

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
# Every (variant, dtype) pair the kernels have: each runs here where the CPU has the variant's flags.
CASES = [(v.name, dtype) for v in build.VARIANTS for dtype in (torch.bfloat16, torch.float32)
         if cpu.SUFFIX[dtype] in v.dtypes]


@pytest.fixture(scope="module", params=[v.name for v in build.VARIANTS])
def variant_library(request: pytest.FixtureRequest) -> KernelLibrary:
    """A variant's library, built explicitly for its flags. A CPU without the variant's flags
    cannot run it (skipped, saying which); one with them must build and load it (a failure fails)."""
    variant = next(v for v in build.VARIANTS if v.name == request.param)
    missing = build.missing_cpu_flags(variant)
    if missing:
        pytest.skip(f"this CPU cannot run the {variant.name} kernels: it lacks {', '.join(missing)}")
    return kernels.load_variant(variant)


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-{cpu.SUFFIX[dtype]}" for name, dtype in CASES])
def case(request: pytest.FixtureRequest) -> tuple[KernelLibrary, torch.dtype]:
    """One dtype of one variant's library (as ``variant_library``)."""
    name, dtype = request.param
    variant = next(v for v in build.VARIANTS if v.name == name)
    missing = build.missing_cpu_flags(variant)
    if missing:
        pytest.skip(f"this CPU cannot run the {variant.name} kernels: it lacks {', '.join(missing)}")
    return kernels.load_variant(variant), dtype


def test_every_variant_this_cpu_has_is_tested_here() -> None:
    """The x86 test machines have AVX-512: there every variant without BF16 runs (builds for fewer
    instructions than the CPU has), so none goes untested where BF16 is missing either."""
    if "avx512f" not in build.cpu_flags():
        pytest.skip("no AVX-512 on this CPU")
    runnable = [v.name for v in build.VARIANTS if not build.missing_cpu_flags(v)]
    assert "avx512" in runnable and "avx2" in runnable
    assert ("avx512-bf16" in runnable) == ("avx512_bf16" in build.cpu_flags())


@pytest.mark.parametrize("inner", [32, 64, 96, 17, 200])  # whole vectors, two chains, a masked tail
def test_matches_f_linear(case: tuple[KernelLibrary, torch.dtype], inner: int) -> None:
    variant_library, dtype = case
    tol = TOL[dtype]
    gen = torch.Generator().manual_seed(inner)
    weight, bias = torch.randn(37, inner, generator=gen).to(dtype), torch.randn(37, generator=gen).to(dtype)
    x = torch.randn(2, 5, inner, generator=gen).to(dtype)
    for b in (bias, None):
        ours = variant_library.gemv(x, weight, b)
        assert ours.shape == (2, 5, 37) and ours.dtype == dtype
        torch.testing.assert_close(ours.float(), F.linear(x, weight, b).float(), rtol=tol, atol=tol)


def test_each_row_is_the_same_whatever_the_row_count(case: tuple[KernelLibrary, torch.dtype]) -> None:
    # What keeps greedy speculation exact: a verification pass's rows equal decode steps' bit for bit.
    variant_library, dtype = case
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(300, 576, generator=gen).to(dtype), torch.randn(6, 576, generator=gen).to(dtype)
    together = variant_library.gemv(x, weight)
    alone = torch.cat([variant_library.gemv(x[i: i + 1], weight) for i in range(6)])
    assert torch.equal(together, alone)


def test_fused_operators_match_the_reference_layers(case: tuple[KernelLibrary, torch.dtype]) -> None:
    variant_library, dtype = case
    tol, lib = TOL[dtype], variant_library
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 96, generator=gen).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    torch.testing.assert_close(lib.rms_norm(x, norm.weight, norm.eps).float(), norm(x).float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lib.silu_mul(x).float(), (F.silu(x[..., :48]) * x[..., 48:]).float(), rtol=tol, atol=tol)
    # RoPE has no sum to reorder: with FMA contraction off it rounds exactly where the reference does.
    qkv = torch.randn(2, 5, 7, 16, generator=gen).to(dtype)  # 4 query + 1 key heads rotated, 2 value heads not
    cos, sin = rope_cos_sin(torch.rand(8, generator=gen), torch.arange(10).view(2, 5) + 3, dtype)
    assert torch.equal(lib.rope(qkv[:, :, :5], cos, sin), apply_rope(qkv[:, :, :5], cos, sin))
    # Row-count invariance of the row-wise ones.
    rows, weight = torch.randn(6, 576, generator=gen).to(dtype), torch.randn(576, generator=gen).to(dtype)
    assert torch.equal(lib.rms_norm(rows, weight, 1e-5), torch.cat([lib.rms_norm(rows[i: i + 1], weight, 1e-5)
                                                                     for i in range(6)]))
    assert torch.equal(lib.silu_mul(rows), torch.cat([lib.silu_mul(rows[i: i + 1]) for i in range(6)]))


def test_every_entry_point_refuses_what_would_corrupt_memory(case: tuple[KernelLibrary, torch.dtype], tiny_qwen2: Path,
                                                              ) -> None:
    """A wrong dtype, device, shape, layout or index raises ValueError before any pointer is taken
    (plain checks, not asserts: they hold under ``python -O`` too)."""
    variant_library, dtype = case
    lib = variant_library
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    w, x = torch.randn(8, 16).to(dtype), torch.randn(3, 16).to(dtype)
    bad_gemv = {"dtype": (x.to(other), w, None), "device": (x.to("meta"), w, None), "inner size": (x[:, :8], w, None),
                "bias size": (x, w, torch.zeros(7, dtype=dtype)), "bias dtype": (x, w, torch.zeros(8, dtype=other)),
                "weight layout": (x, torch.randn(16, 8).to(dtype).t(), None)}
    for what, args in bad_gemv.items():
        with pytest.raises(ValueError):
            lib.gemv(*args)
            pytest.fail(f"gemv took a wrong {what}")
    with pytest.raises(ValueError, match="expected"):
        lib.rms_norm(x, torch.ones(16, dtype=other), 1e-6)
    with pytest.raises(ValueError, match="shape"):
        lib.rms_norm(x, torch.ones(15, dtype=dtype), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        lib.rms_norm(torch.randn(16, 3).to(dtype).t(), torch.ones(3, dtype=dtype), 1e-6)
    with pytest.raises(ValueError, match="even"):
        lib.silu_mul(torch.randn(2, 7).to(dtype))
    with pytest.raises(ValueError, match="CPU"):
        lib.silu_mul(torch.randn(2, 8, device="meta").to(dtype))
    heads = torch.randn(1, 2, 3, 16).to(dtype)
    cos, sin = rope_cos_sin(torch.rand(8), torch.arange(2).view(1, 2), dtype)
    with pytest.raises(ValueError, match="shape"):
        lib.rope(heads, cos[:, :1], sin[:, :1])
    with pytest.raises(ValueError, match="expected"):
        lib.rope(heads, cos.to(other), sin.to(other))
    with pytest.raises(ValueError, match="contiguously"):
        lib.rope(heads.transpose(2, 3).contiguous().transpose(2, 3), cos, sin)
    # The decoder stack: out-of-range cache rows, a cache of another dtype, a wrong hidden size.
    model, _ = load_model(str(tiny_qwen2), dtype, "cpu", backend="cpu-kernels")
    model.backend.cpu_stack = CpuStack.build(model, lib)  # this variant's stack
    assert model.backend.cpu_stack is not None
    stack = model.backend.cpu_stack
    c = model.config
    pool = make_pool("paged", num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     max_seq_len=32, max_batch_size=2, block_size=4, num_blocks=None, dtype=dtype,
                     device=torch.device("cpu"))
    slots = [pool.allocate(), pool.allocate()]
    hidden = torch.randn(2, 1, c.hidden_size).to(dtype)
    cos, sin = rope_cos_sin(model.inv_freq, torch.zeros(2, 1, dtype=torch.long), dtype)  # type: ignore[arg-type]
    kv = build_kv_batch(pool, slots, [0, 0], [1, 1])
    with torch.inference_mode():
        stack(hidden, cos, sin, kv)  # the valid call runs
        for what, change in {"write_index": dict(write_index=kv.write_index + 10_000),
                             "read_index": dict(read_index=kv.read_index - 1 if kv.read_index is not None else None),
                             "cache dtype": dict(k_layers=[t.to(other) for t in kv.k_layers])}.items():
            broken = build_kv_batch(pool, slots, [1, 1], [1, 1])
            for name, value in change.items():
                setattr(broken, name, value)
            with pytest.raises(ValueError):
                stack(hidden, cos, sin, broken)
                pytest.fail(f"the stack took a bad {what}")
            pool.truncate_to(slots[0], 1)
            pool.truncate_to(slots[1], 1)
        with pytest.raises(ValueError, match="hidden|shape"):
            stack(hidden[..., :-1].contiguous(), cos, sin, build_kv_batch(pool, slots, [1, 1], [1, 1]))


def test_linear_shares_weights_and_falls_back_for_many_rows(variant_library: KernelLibrary,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    linear = torch.nn.Linear(64, 48, dtype=torch.float32)
    fast = GemvLinear(linear, variant_library)
    assert fast.weight is linear.weight and fast.bias is linear.bias
    calls: list[int] = []
    real = KernelLibrary.gemv

    def counting(self: KernelLibrary, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(self, x, weight, bias)

    monkeypatch.setattr(KernelLibrary, "gemv", counting)
    with torch.inference_mode():
        for rows in (1, MAX_ROWS, MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, MAX_ROWS]  # the prefill-sized product went to F.linear


def test_small_passes_run_torch_single_threaded_and_the_kernels_on_every_thread(
        variant_library: KernelLibrary, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []  # (torch's threads, the kernel's) per product
    real = KernelLibrary.gemv

    def spying(self: KernelLibrary, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        seen.append((torch.get_num_threads(), cpu._threads()))
        return real(self, x, weight, bias)

    monkeypatch.setattr(KernelLibrary, "gemv", spying)
    linear = GemvLinear(torch.nn.Linear(64, 48), variant_library)
    torch.set_num_threads(2)  # the autouse fixture restores the test's thread count
    with torch.inference_mode(), cpu.kernel_threads_only():
        linear(torch.randn(3, 64))
        with cpu.kernel_threads_only():  # nested: changes nothing
            linear(torch.randn(1, 64))
    assert torch.get_num_threads() == 2 and cpu._kernel_threads[0] is None
    assert seen == [(1, 2), (1, 2)]


def test_host_work_runs_torch_on_one_thread_around_passes_that_still_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    """A speculative round's host work (drafting, rejection) runs torch's operators on one thread, so
    libgomp's workers never spin on the kernels' cores; its passes still choose and measure their
    count, kernel calls between them use torch's count from before, and torch gets the settled count
    back at the end."""
    chooser = cpu.ThreadChooser()
    monkeypatch.setattr(cpu, "THREADS", chooser)
    clock = [0.0]
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    torch.set_num_threads(2)  # the autouse fixture restores the test's thread count
    for _ in range(4):  # (each count's first pass is a warm-up, not measured)
        with cpu.host_work_single_threaded():
            assert (torch.get_num_threads(), cpu._threads()) == (1, 2)  # a draft head's projection: 2
            with cpu.kernel_threads_only("verify"):
                used = cpu._threads()
                clock[0] += 1.0 if used == 2 else 3.0
            assert torch.get_num_threads() == 1  # rejection sampling after the pass: still one
            with cpu.host_work_single_threaded():  # nested: changes nothing
                assert (torch.get_num_threads(), cpu._threads()) == (1, 2)
        assert torch.get_num_threads() == 2 and cpu._host[0] is None
    assert ("verify", 2) in chooser.seconds and ("verify", 1) in chooser.seconds  # both counts measured
    # Where one thread won, the host work ends with torch on one (as after a bare pass).
    chooser.seconds[("verify", 2)], chooser.seconds[("verify", 1)] = 5.0, 1.0
    with cpu.host_work_single_threaded(), cpu.kernel_threads_only("verify"):
        clock[0] += 1.0
    assert torch.get_num_threads() == 1
    with cpu.host_work_single_threaded():  # and the count asked for is still two
        assert cpu._threads() == 2


def test_a_try_of_one_thread_leaves_torch_at_the_settled_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between passes torch keeps a kind's settled thread count (a prefill runs on it), never the
    count a pass only tried; where one thread won, it keeps one."""
    chooser = cpu.ThreadChooser()
    monkeypatch.setattr(cpu, "THREADS", chooser)
    clock = [0.0]
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    torch.set_num_threads(2)  # the autouse fixture restores the test's thread count

    def run_pass(two: float, one: float) -> tuple[int, int]:
        """A pass timed `two` seconds on two threads, `one` on one: (its kernel count, torch's after)."""
        with cpu.kernel_threads_only("decode"):
            used = cpu._threads()
            clock[0] += two if used == 2 else one
        return used, torch.get_num_threads()

    seen = [run_pass(1.0, 3.0) for _ in range(4)]  # warm, measured on 2; warm, measured on 1
    assert [used for used, _ in seen] == [2, 2, 1, 1]
    assert [after for _, after in seen] == [2, 2, 2, 2]  # the one-thread tries left torch on two
    # A machine where one thread wins: once measured so, torch stays on one between passes.
    seen = [run_pass(5.0, 1.0) for _ in range(6)]
    assert seen[-1] == (1, 1) and chooser.settled("decode", 2) == 1
    # The settled count follows the measurements, whichever count the last pass used.
    chooser.seconds[("decode", 1)] = 10.0
    assert chooser.settled("decode", 2) == 2


# ----------------------------------------------------------------------------- the decoder stack in C


def _runner(model: torch.nn.Module, backend: str, dtype: torch.dtype) -> ModelRunner:
    c = model.config  # type: ignore[union-attr]
    pool = make_pool(backend, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, max_seq_len=256, max_batch_size=3, block_size=8, num_blocks=None,
                     dtype=dtype, device=torch.device("cpu"))
    return ModelRunner(model, pool)  # type: ignore[arg-type]


def _passes(model: torch.nn.Module, backend: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Hidden states of a sequence of passes over three sequences: prefills of different lengths
    (the paged pool's blocks interleave; the last one's keys span two of the attention's
    segments, cpu.STACK_ATTN_SEGMENT, the others fit in one), a batched decode step, a chain
    verification of uneven runs (padding), a rollback and a tree verification batched with a chain."""
    runner = _runner(model, backend, dtype)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size  # type: ignore[union-attr]

    def ids(n: int) -> list[int]:
        return torch.randint(vocab, (n,), generator=gen).tolist()

    slots = [runner.pool.allocate() for _ in range(3)]
    long = cpu.STACK_ATTN_SEGMENT + 9
    out = [runner.forward([s], [ids(n)]) for s, n in zip(slots, (13, 29, long), strict=True)]
    out.append(runner.forward(slots, [ids(1) for _ in slots]))
    out.append(runner.forward(slots, [ids(6), ids(2), ids(4)]))
    runner.pool.truncate_to(slots[0], 15)
    parents = torch.tensor([[-1, 0, 0, 1, -1, -1], [-1, 0, 1, 2, 3, 4]])
    mask = tree_attention_mask(parents, [4, 6])
    positions = torch.tensor([[runner.pool.seq_len(s)] for s in slots[:2]]) + tree_depths(mask)
    out.append(runner.forward(slots[:2], [ids(7), ids(7)], positions=positions, tree_mask=mask))  # root + 6 nodes
    return [o.float() for o in out]


def _check_stack_against_layers(model: torch.nn.Module, backend: str, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    stack = model.backend.cpu_stack  # type: ignore[union-attr]
    assert stack is not None
    ours = _passes(model, backend, dtype)
    model.backend.cpu_stack = None  # type: ignore[union-attr]
    reference = _passes(model, backend, dtype)
    model.backend.cpu_stack = stack  # type: ignore[union-attr]
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * 4, msg=f"pass {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_stack_matches_the_layers_it_replaces(tiny_qwen2: Path, tiny_qwen3: Path, dtype: torch.dtype,
                                              backend: str) -> None:
    """The C decoder stack against the same model run layer by layer, on every kind of pass (Qwen2:
    projection biases; Qwen3: per-head q/k norms). bfloat16 rounds attention differently (a few
    ulps after two layers)."""
    if kernels.library_for(dtype) is None:
        pytest.skip(f"no {dtype} kernels on this CPU: {kernels.unavailable_reason(dtype)}")
    for folder in (tiny_qwen2, tiny_qwen3):
        model, _ = load_model(str(folder), dtype, "cpu", backend="cpu-kernels")
        _check_stack_against_layers(model, backend, dtype)
    # A negative control: the comparison sees a stack that skips its second layer.
    stack = model.backend.cpu_stack
    assert stack is not None
    stack.table.shape = {**stack.table.shape, "layers": 1}
    stack.table.tensors = stack.table.tensors[: len(cpu.STACK_TENSORS)]
    stack.table._pointers = []
    with pytest.raises(ValueError, match="layers"):  # the cache has two: refused, not misread
        _passes(model, backend, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_stack_stages_key_rows_a_multiple_of_4kb_apart(tmp_path: Path, dtype: torch.dtype) -> None:
    """16 KV heads of 128 elements make each cache row 4 KB (bfloat16) or 8 KB (float32) long, where
    the stack's attention copies a block's key and value rows together before reading them (rows
    that far apart share L1 sets): the stack still matches the layers on every kind of pass, and a
    token's bits do not depend on the pass (check_invariance, in exact-greedy mode: the stack then
    takes every pass)."""
    if kernels.library_for(dtype) is None:
        pytest.skip(f"no {dtype} kernels on this CPU: {kernels.unavailable_reason(dtype)}")
    from checkpoints import make_tiny_checkpoint
    from infer.backends import exact

    folder = make_tiny_checkpoint(tmp_path / "wide-heads", "llama", hidden_size=256, num_layers=2, num_heads=32,
                                  num_kv_heads=16, head_dim=128, intermediate_size=128, seed=3)
    model, _ = load_model(str(folder), dtype, "cpu", backend="cpu-kernels")
    assert model.config.num_key_value_heads * model.config.head_dim * dtype.itemsize % 4096 == 0
    for backend in ("slotted", "paged"):
        _check_stack_against_layers(model, backend, dtype)
    exact.make_exact(model)
    exact._VERIFIED.clear()
    exact.check_invariance(model)


def test_the_avx2_kernels_carry_a_float32_model_on_a_cpu_without_avx512(tiny_qwen3: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AVX-512 gets the AVX2 build: products, fused operators and the decoder stack
    (Qwen3's q/k norms included) against the layers."""
    if build.missing_cpu_flags(build.VARIANTS[-1]):
        pytest.skip("this CPU lacks AVX2")
    flags = frozenset(f for f in build.cpu_flags() if not f.startswith("avx512"))
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    kernels.reset()
    try:
        assert kernels.selection().variant == build.VARIANTS[-1]
        model, _ = load_model(str(tiny_qwen3), torch.float32, "cpu")
        assert model.backend is not None and "AVX2 float32 kernels" in model.backend.describe()
        assert model.backend.stack and "CPU lacks avx512f" in model.backend.describe()
        _check_stack_against_layers(model, "paged", torch.float32)
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_float32_kernels_and_the_stack_run_on_a_cpu_without_bf16(tiny_llama: Path, no_bf16_cpu: None) -> None:
    """The variant built without BF16 carries float32 models whole (stack included); bfloat16
    falls back to the PyTorch layers, and the backend says why."""
    chosen = kernels.selection()
    # the best float32 variant without BF16: AVX-512 where the CPU has avx512f, else AVX2
    variant, label = ("avx512", "AVX-512") if "avx512f" in build.cpu_flags() else ("avx2", "AVX2")
    assert chosen.variant is not None and chosen.variant.name == variant
    assert any(re.search(r"CPU lacks (.*, )?avx512_bf16", line) for line in chosen.refused)
    model, _ = load_model(str(tiny_llama), torch.float32, "cpu")
    assert model.backend is not None and model.backend.name == "cpu-kernels" and model.backend.stack
    assert f"{label} float32 kernels" in model.backend.describe()
    assert "avx512_bf16" in model.backend.describe()
    _check_stack_against_layers(model, "paged", torch.float32)
    bf16, _ = load_model(str(tiny_llama), torch.bfloat16, "cpu")
    assert bf16.backend is not None and bf16.backend.name == "torch" and bf16.backend.cpu_stack is None
    assert "avx512_bf16" in bf16.backend.describe()
    with pytest.raises(ValueError, match="avx512_bf16"):
        load_model(str(tiny_llama), torch.bfloat16, "cpu", backend="cpu-kernels")


def test_stack_takes_small_passes_and_the_backend_option_turns_it_off(tiny_llama: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels.library_for(torch.float32) is None:
        pytest.skip(f"no float32 kernels on this CPU: {kernels.unavailable_reason(torch.float32)}")
    model, _ = load_model(str(tiny_llama), torch.float32, "cpu")
    stack = model.backend.cpu_stack
    assert stack is not None
    assert {type(m) for m in model.modules() if isinstance(m, (RMSNorm, Attention, MLP))} == {KernelRMSNorm, KernelAttention,
                                                                                           KernelMLP}
    calls: list[int] = []
    real, real_sequence = KernelLibrary.decoder_stack, KernelLibrary.sequence_stack

    def counting(self: KernelLibrary, x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0] * x.shape[1])
        return real(self, x, *args)  # type: ignore[arg-type]

    def counting_sequence(self: KernelLibrary, x: torch.Tensor, *args: object) -> None:  # one sequence: [width, hidden]
        calls.append(x.shape[0])
        real_sequence(self, x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(KernelLibrary, "decoder_stack", counting)
    monkeypatch.setattr(KernelLibrary, "sequence_stack", counting_sequence)
    runner = _runner(model, "paged", torch.float32)
    slot = runner.pool.allocate()
    runner.forward([slot], [[1] * (MAX_ROWS + 1)])  # a prefill above the limit: layer by layer
    runner.forward([slot], [[2] * MAX_ROWS])
    stack.max_rows = None  # exact-greedy mode: every pass
    runner.forward([slot], [[3] * (MAX_ROWS + 1)])
    assert calls == [MAX_ROWS, MAX_ROWS + 1]
    torch_model, _ = load_model(str(tiny_llama), torch.float32, "cpu", backend="torch")
    assert torch_model.backend.cpu_stack is None and not any(isinstance(m, GemvLinear) for m in torch_model.modules())
    assert {type(m) for m in torch_model.modules() if isinstance(m, (RMSNorm, Attention, MLP))} == {RMSNorm, Attention, MLP}


def test_stack_rebuilds_its_pointer_table_after_the_weights_move(tiny_llama: Path) -> None:
    """``model.to`` gives each Parameter new storage in place: the stack must not keep calling with
    the old addresses (freed memory)."""
    if kernels.library_for(torch.float32) is None:
        pytest.skip(f"no float32 kernels on this CPU: {kernels.unavailable_reason(torch.float32)}")
    model, _ = load_model(str(tiny_llama), torch.float32, "cpu")
    stack = model.backend.cpu_stack
    assert stack is not None
    before = stack.table.addresses().tolist()
    model.to(torch.bfloat16).to(torch.float32)  # a round trip: same dtype, new storage
    assert stack.table.addresses().tolist() != before
    _check_stack_against_layers(model, "slotted", torch.float32)


# ----------------------------------------------------------------------------- never break a load


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache of the test's own (the choice is forgotten before and after)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kernels.reset()
    yield tmp_path / "cache" / "infer" / "kernels"  # type: ignore[misc]
    monkeypatch.undo()
    kernels.reset()


def _falls_back(tiny_llama: Path, reason: str) -> None:
    """No kernels, the reason given, and a model still loads and runs on the PyTorch layers."""
    chosen = kernels.selection()
    assert chosen.library is None
    assert any(reason in line for line in chosen.refused), chosen.refused
    model, _ = load_model(str(tiny_llama), torch.float32, "cpu")
    assert model.backend is not None and model.backend.name == "torch" and reason in model.backend.describe()
    with torch.inference_mode():
        assert model(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)
    with pytest.raises(ValueError, match=reason):
        load_model(str(tiny_llama), torch.float32, "cpu", backend="cpu-kernels")


def test_no_compiler_falls_back_with_its_reason(tiny_llama: Path, private_cache: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(private_cache.parent / "no-such-cc"))
    _falls_back(tiny_llama, "no C compiler")


def test_unusable_cache_directory_falls_back_with_its_reason(tiny_llama: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))  # under a file: nothing can be created
    kernels.reset()
    try:
        _falls_back(tiny_llama, "cache directory unusable")
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_a_failed_build_is_remembered_not_retried(tiny_llama: Path, private_cache: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    log = private_cache.parent / "compiles"
    fake = private_cache.parent / "fake-cc"
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "fake-cc 1.0"; exit 0; fi\n'
                    f'echo x >> {log}\necho "fake-cc: error: no" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    _falls_back(tiny_llama, "compiling the avx")  # this CPU's best variant: avx512 or avx2
    compiles = len(log.read_text().splitlines())
    assert compiles >= 1 and list(private_cache.glob("*.failed"))
    kernels.reset()
    _falls_back(tiny_llama, "an earlier start")  # the marker's reason, no compile
    assert len(log.read_text().splitlines()) == compiles


@pytest.fixture(scope="module")
def built_library() -> tuple[build.Variant, str]:
    """This CPU's best variant and its library in the real cache (built once)."""
    if "avx512f" not in build.cpu_flags():
        pytest.skip("no AVX-512 on this CPU: no library to plant")
    variant = next(v for v in build.VARIANTS if not build.missing_cpu_flags(v))
    return variant, build.load(variant)._name


@pytest.fixture(scope="module")
def built_fallbacks(built_library: tuple[build.Variant, str]) -> list[tuple[build.Variant, str]]:
    """The lesser variants this CPU runs and their libraries in the real cache (built once): planted
    beside the refused one, the fallback loads instead of compiling afresh in every test."""
    return [(v, build.load(v)._name) for v in build.VARIANTS
            if v != built_library[0] and not build.missing_cpu_flags(v)]


def _refuses_planted(tiny_llama: Path, planted: build.Variant, reason: str) -> None:
    """The planted library is refused with ``reason`` (a lesser variant, built afresh, or the PyTorch
    layers take over) and a model still loads and runs."""
    chosen = kernels.selection()
    assert any(line.startswith(planted.name) and reason in line for line in chosen.refused), chosen.refused
    assert chosen.variant != planted
    model, _ = load_model(str(tiny_llama), torch.float32, "cpu")
    with torch.inference_mode():
        assert model(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)


def _plant(built_library: tuple[build.Variant, str], fallbacks: list[tuple[build.Variant, str]]) -> Path:
    """The built library, copied to where the private cache expects it (the lesser variants too)."""
    for variant, built in fallbacks:
        shutil.copy(built, build.library_path(variant))
    variant, built = built_library
    target = build.library_path(variant)
    shutil.copy(built, target)
    return target


@pytest.mark.slow  # builds its own library: the full suite's
def test_a_library_others_can_write_is_refused(tiny_llama: Path, built_library: tuple[build.Variant, str],
                                               built_fallbacks: list[tuple[build.Variant, str]],
                                               private_cache: Path) -> None:
    target = _plant(built_library, built_fallbacks)
    target.chmod(0o777)
    kernels.reset()
    _refuses_planted(tiny_llama, built_library[0], "writable by group or others")
    target.chmod(0o700)
    kernels.reset()
    assert kernels.selection().library is not None  # the same file, private: taken


@pytest.mark.slow  # builds its own library: the full suite's
def test_a_library_that_does_not_load_is_refused(tiny_llama: Path, built_library: tuple[build.Variant, str],
                                                 built_fallbacks: list[tuple[build.Variant, str]],
                                                 private_cache: Path) -> None:
    """A file dlopen rejects (a shared home on a host without a library it needs, say): refused
    with dlopen's reason, no crash."""
    target = _plant(built_library, built_fallbacks)
    target.write_bytes(b"not an ELF file")
    kernels.reset()
    _refuses_planted(tiny_llama, built_library[0], "failed")


@pytest.mark.slow  # builds its own library: the full suite's
def test_a_library_owned_by_another_user_is_refused(tiny_llama: Path, built_library: tuple[build.Variant, str],
                                                    built_fallbacks: list[tuple[build.Variant, str]],
                                                    private_cache: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file another owner needs root")
    target = _plant(built_library, built_fallbacks)
    os.chown(target, 65534, 65534)  # nobody's: planted by another user
    kernels.reset()
    _refuses_planted(tiny_llama, built_library[0], "not this user")


def test_cache_directory_is_created_private(private_cache: Path) -> None:
    build.cache_dir()
    assert stat.S_IMODE(private_cache.stat().st_mode) == 0o700


def test_an_interface_mismatch_refuses_the_library(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's mirror of the C struct and limits is compared with the library's own at load."""
    if "avx512f" not in build.cpu_flags():
        pytest.skip("no AVX-512 on this CPU")
    monkeypatch.setattr(cpu, "MAX_STACK_GROUP", 8)
    kernels.reset()
    try:
        _falls_back(tiny_llama, "C interface differs")
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_probe_mismatches_fall_back_with_their_reasons(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A product that disagrees with F.linear keeps the PyTorch layers; a stack that disagrees with
    the layers keeps the kernels layer by layer."""
    if kernels.library_for(torch.float32) is None:
        pytest.skip(f"no float32 kernels on this CPU: {kernels.unavailable_reason(torch.float32)}")
    real_stack = KernelLibrary.decoder_stack
    monkeypatch.setattr(KernelLibrary, "decoder_stack",
                        lambda self, x, *args: real_stack(self, x, *args) + 0.5)  # type: ignore[no-untyped-def]
    probe_stack.cache_clear()
    kernels.reset()
    try:
        model, _ = load_model(str(tiny_llama), torch.float32, "cpu")
        assert model.backend is not None and model.backend.name == "cpu-kernels"
        assert model.backend.cpu_stack is None and "decoder stack failed its probe" in model.backend.describe()
        real_gemv = KernelLibrary.gemv
        monkeypatch.setattr(KernelLibrary, "gemv", lambda self, x, w, b=None: real_gemv(self, x, w, b) + 1)
        kernels.reset()
        _falls_back_probe = kernels.unavailable_reason(torch.float32)
        assert "probe failed" in _falls_back_probe
        model, _ = load_model(str(tiny_llama), torch.float32, "cpu")
        assert model.backend is not None and model.backend.name == "torch"
        assert "probe failed" in model.backend.describe()
    finally:
        monkeypatch.undo()
        probe_stack.cache_clear()
        kernels.reset()


def decode_passes(chooser: cpu.ThreadChooser, cost: dict[int, float], passes: int) -> list[int]:
    """``passes`` decode passes on two threads asked for, each taking ``cost[threads]``: the picks."""
    picks = []
    for _ in range(passes):
        threads = chooser.pick("decode", 2)
        chooser.record("decode", threads, cost[threads])
        picks.append(threads)
    return picks


def test_thread_choice_follows_the_faster_count_and_keeps_checking() -> None:
    """A kind of pass runs on the count that measured faster; the other is tried again after a
    wait that doubles while the choice stands, and the choice flips when the machine changes."""
    chooser = cpu.ThreadChooser()
    cost = {2: 1.0, 1: 3.0}  # a machine of its own: two threads win

    picks = decode_passes(chooser, cost, 200)
    assert picks[:4] == [2, 2, 1, 1] and picks.count(1) <= 5  # measured both, then tries at 32, 96, ...
    assert chooser.pick("prefill", 1) == 1  # one thread asked for: nothing to choose
    cost.update({2: 5.0, 1: 1.0})  # another process takes a core: two threads lose
    picks = decode_passes(chooser, cost, 400)
    assert picks[-100:].count(1) >= 97
    switch = picks.index(1)  # at once: two threads' time rose past DRIFT
    assert switch <= 4
    tries = [i for i, t in enumerate(picks) if t == 2 and i > switch]
    assert len(tries) >= 3 and tries[2] - tries[1] > tries[1] - tries[0] > 32  # the tries back off


def test_thread_choice_returns_at_the_first_try_after_a_passing_disturbance() -> None:
    """Another process slows two threads for a hundred passes (tries of two during it are slow too):
    the choice moves to one, and once the machine is quiet again the first try of two threads brings
    it back, a try's time replacing the count's old figure. Blended into that figure (the tries made
    during the disturbance), two threads lost their tries for the next 2,000 passes."""
    chooser = cpu.ThreadChooser()
    cost = {2: 1.0, 1: 3.0}

    decode_passes(chooser, cost, 100)
    cost[2] = 10.0  # a disturbance on the second core
    assert decode_passes(chooser, cost, 100)[-1] == 1
    cost[2] = 1.0  # quiet again
    picks = decode_passes(chooser, cost, 2000)
    first_try = picks.index(2)
    assert first_try <= 4 * chooser.EXPLORE  # the tries' wait grew during the disturbance
    assert picks[first_try:].count(1) <= 10  # back at once, trying one thread now and then


def test_a_slow_first_pass_does_not_decide_the_thread_count() -> None:
    """The first pass of a kind on a count pays one-time costs (page faults, thread start): it is
    not measured, so a first two-thread pass 6x slower than the rest does not make one thread win;
    the negative control: measured, the same first pass would."""
    for measure_first, want in ((False, 2), (True, 1)):
        chooser = cpu.ThreadChooser()
        if measure_first:  # as if the first passes were measured
            chooser.warmed |= {("logits", 2), ("logits", 1)}
        firsts = {2: True, 1: True}
        picks = []
        for _ in range(30):  # before the first retry of the other count (32 passes on)
            threads = chooser.pick("logits", 2)
            cost = 6.0 if firsts[threads] and threads == 2 else (1.0 if threads == 2 else 2.0)
            firsts[threads] = False
            chooser.record("logits", threads, cost)
            picks.append(threads)
        assert picks[4:] == [want] * 26, (measure_first, picks)


def test_a_choice_that_slows_down_is_tried_against_the_other_at_once() -> None:
    """Quiet for 600 passes (the wait between tries has grown to hundreds), then another process
    takes a core: two threads slow down, though not past one thread's figure of the quiet machine,
    and one thread is now faster. It wins within a few passes. The negative control: without the
    drift check (DRIFT infinite) the next try is over a hundred passes away."""
    for drift, within in ((cpu.ThreadChooser.DRIFT, 8), (float("inf"), None)):
        chooser = cpu.ThreadChooser()
        chooser.DRIFT = drift
        cost = {2: 1.0, 1: 1.7}
        decode_passes(chooser, cost, 600)
        assert chooser.interval["decode"] >= 256
        cost.update({2: 1.6, 1: 1.2})
        picks = decode_passes(chooser, cost, 200)
        first_one = picks.index(1) if 1 in picks else len(picks)
        if within is not None:
            assert first_one <= within and picks[within:].count(1) >= 190 - within, picks
        else:
            assert first_one > 100, first_one


def stream_passes(chooser: cpu.PairedChooser, cost: dict[bool, float], passes: int, rng: random.Random) -> list[bool]:
    """``passes`` passes of one kind, each taking ``cost[setting]`` times noise (a tenth either way,
    and one pass in twenty three times as long: another process's time slice): the picks."""
    picks = []
    for _ in range(passes):
        setting = chooser.pick("decode")
        noise = rng.uniform(0.9, 1.1) * (3.0 if rng.random() < 0.05 else 1.0)
        chooser.record("decode", setting, cost[bool(setting)] * noise)
        picks.append(bool(setting))
    return picks


@pytest.mark.parametrize("faster", [True, False])
def test_the_stream_setting_follows_the_faster_by_paired_medians(faster: bool) -> None:
    """Two settings 7% apart under noise larger than that: the two take turns, the lower median wins
    and runs alone for a wait that grows while it stands; when the machine changes, the other wins
    at the next comparison. Both parametrizations are each other's negative control: the choice
    follows the costs, not a default."""
    chooser = cpu.PairedChooser((True, False))
    rng = random.Random(7)
    cost = {faster: 0.93, not faster: 1.0}
    picks = stream_passes(chooser, cost, 4000, rng)
    assert picks[:4] == [True, False, True, False]  # turns from the first pass
    assert chooser.winner["decode"] is faster
    assert picks.count(faster) >= 0.95 * len(picks)
    assert chooser.wait["decode"] > chooser.WAIT  # confirmed, so compared less often
    cost = {faster: 1.0, not faster: 0.9}  # the machine changes
    picks = stream_passes(chooser, cost, chooser.MAX_WAIT + 4 * chooser.TURNS, rng)
    assert chooser.winner["decode"] is (not faster) and chooser.wait["decode"] == chooser.WAIT
    switch = len(picks) - picks[::-1].index(faster)  # after the last pass with the old winner
    assert switch <= chooser.MAX_WAIT + 2 * chooser.TURNS + 2


def test_a_pass_measures_the_stream_setting_it_ran_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernel_threads_only(kind, streams)`` sets the chosen stream setting before the pass and
    records the pass's time for it; a try of the other thread count keeps the last setting and is
    not measured for it (its time is the thread count's)."""
    threads, streams = cpu.ThreadChooser(), cpu.PairedChooser((True, False))
    monkeypatch.setattr(cpu, "THREADS", threads)
    monkeypatch.setattr(cpu, "STREAMS", streams)
    clock = [0.0]
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    torch.set_num_threads(2)  # the autouse fixture restores the test's thread count
    applied: list[bool] = []
    log: list[tuple[int, bool]] = []
    for _ in range(400):
        with cpu.kernel_threads_only("decode", applied.append):
            used, setting = cpu._threads(), applied[-1] if applied else None
            assert setting is not None
            clock[0] += (1.0 if used == 2 else 3.0) * (0.9 if setting is False else 1.0)
            log.append((used, setting))
    tries = [i for i, (used, _) in enumerate(log) if used == 1]
    assert tries and len(applied) == len(log) - len(tries)  # no setting applied on a thread try
    assert streams.winner[("decode", 2)] is False and ("decode", 1) not in streams.times
    settled = [s for used, s in log[50:] if used == 2]  # after the first comparison
    assert settled.count(False) >= 0.9 * len(settled)


def test_the_checks_hold_under_python_optimize() -> None:
    """``python -O`` drops asserts: the kernel package has none, so its checks are all plain ``if``s."""
    import ast

    folder = Path(kernels.__file__).parent
    asserts = [f"{path.name}:{node.lineno}" for path in sorted(folder.glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert)]
    assert not asserts, asserts
