"""The kernels' thread pool (thread_pool.h): loops whose chunks any thread claims give the same bits
on any number of threads (more than the cores included), from several Python threads at once, in
a forked child, and both kernel libraries share one pool."""

from __future__ import annotations

import ctypes
import multiprocessing
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from infer import kernels
from infer.kernels import build, cpu, quant
from infer.kernels.quant import QuantKernels
from infer.loader import load_model

COUNTS = (1, 2, 3, 8, 17)  # 17 threads on a 2-core machine: most of them descheduled at any moment


@pytest.fixture(scope="module")
def qk() -> QuantKernels:
    found = quant.quant_kernels()
    if found is None:
        pytest.skip(f"no quantized kernels here: {quant.quant_unavailable_reason()}")
    return found


@pytest.fixture
def kernel_threads() -> Iterator[list[int | None]]:
    """Sets the kernels' thread count for the test (``_kernel_threads`` wins over torch's)."""
    yield cpu._kernel_threads
    cpu._kernel_threads[0] = None


def _quant_case(qk: QuantKernels) -> tuple[quant.QuantWeight, torch.Tensor]:
    # 1,000 rows: 63 decode tiles, far more chunks than threads
    weight = qk.pack(quant.random_blocks("Q4_1", 1000, 512, torch.Generator().manual_seed(1)), "Q4_1", 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    return weight, x


def test_quantized_products_are_the_same_bits_on_any_thread_count(qk: QuantKernels) -> None:
    weight, x = _quant_case(qk)
    for rows in (1, 5):
        want = qk.linear(x[:rows].contiguous(), weight, threads=1)
        for threads in COUNTS[1:]:
            for _ in range(3):  # a different interleaving each time
                assert torch.equal(qk.linear(x[:rows].contiguous(), weight, threads=threads), want), (rows, threads)
    # A negative control: a changed activation changes the outputs (the comparison can fail).
    assert not torch.equal(qk.linear((x[:1] * 1.5).contiguous(), weight, threads=2), qk.linear(x[:1].contiguous(), weight, threads=2))


def test_float_products_are_the_same_bits_on_any_thread_count(kernel_threads: list[int | None]) -> None:
    library = kernels.library_for(torch.float32)
    if library is None:
        pytest.skip(f"no float32 kernels here: {kernels.unavailable_reason(torch.float32)}")
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(1001, 320, generator=generator), torch.randn(1001, generator=generator)
    x = torch.randn(3, 320, generator=generator)
    kernel_threads[0] = 1
    want = library.gemv(x, weight, bias)
    for threads in COUNTS[1:]:
        kernel_threads[0] = threads
        assert torch.equal(library.gemv(x, weight, bias), want), threads


def test_the_decoder_stack_is_the_same_bits_on_any_thread_count(tiny_qwen3: Path,
                                                                kernel_threads: list[int | None]) -> None:
    """Attention items and projections claimed by any thread: a prefill and a decode step's hidden
    states equal one thread's."""
    if kernels.library_for(torch.float32) is None:
        pytest.skip(f"no float32 kernels here: {kernels.unavailable_reason(torch.float32)}")
    from tests.models.test_cpu_kernels import _passes

    model, _ = load_model(str(tiny_qwen3), torch.float32, "cpu", backend="cpu-kernels")
    assert model.backend.cpu_stack is not None  # type: ignore[union-attr]
    kernel_threads[0] = 1
    want = _passes(model, "paged", torch.float32)
    for threads in (2, 8):
        kernel_threads[0] = threads
        got = _passes(model, "paged", torch.float32)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (threads, i)


def test_callers_on_several_python_threads_share_the_pool_safely(qk: QuantKernels) -> None:
    """One job at a time: a caller that finds the pool busy runs its loop alone, never on another's
    job; every result is still the one-thread one."""
    weight, x = _quant_case(qk)
    want = qk.linear(x, weight, threads=1)
    failures: list[str] = []

    def work() -> None:
        for _ in range(30):
            got = qk.linear(x, weight, threads=4)
            if not torch.equal(got, want):
                failures.append("differs")

    workers = [threading.Thread(target=work) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert failures == []


def _child_product(queue: multiprocessing.Queue[bool], qk: QuantKernels) -> None:
    weight, x = _quant_case(qk)
    queue.put(torch.equal(qk.linear(x, weight, threads=3), qk.linear(x, weight, threads=1)))


def test_a_forked_child_runs_its_loops(qk: QuantKernels) -> None:
    """A fork copies the pool without its helper threads: the child's jobs must still finish (on
    helpers it starts afresh), with the same bits."""
    weight, x = _quant_case(qk)
    qk.linear(x, weight, threads=3)  # the parent's helpers exist before the fork
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[bool] = context.Queue()
    child = context.Process(target=_child_product, args=(queue, qk))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0 and queue.get(timeout=5) is True


def test_both_kernel_libraries_use_one_pool(qk: QuantKernels) -> None:
    library = kernels.library_for(torch.float32)
    if library is None:
        pytest.skip(f"no float32 kernels here: {kernels.unavailable_reason(torch.float32)}")
    handles = set()
    for lib in (library.lib, qk.lib):
        handle = lib.infer_pool_handle
        handle.argtypes, handle.restype = [], ctypes.c_void_p
        handles.add(handle())
    assert len(handles) == 1 and build._pool == list(handles)
