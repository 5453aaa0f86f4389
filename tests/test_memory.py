"""infer.memory: the buffers every pass streams (repacked weights, KV stores) in huge-page mappings,
each a tensor with a storage of its own, alive as long as any tensor in its mapping."""

from __future__ import annotations

import gc
import mmap
import sys

import numpy as np
import pytest
import torch

from infer.cache import PagedKVCachePool
from infer.kernels import quant
from infer.memory import ALIGN, Arena, huge_advice, huge_zeros


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (Linux's /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                low, high = (int(x, 16) for x in head[0].split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return head[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def advised(tensor: torch.Tensor) -> bool:
    """Whether the tensor's first and last bytes lie in mappings advised MADV_HUGEPAGE ("hg")."""
    last = tensor.data_ptr() + tensor.numel() * tensor.element_size() - 1
    return "hg" in vm_flags(tensor.data_ptr()) and "hg" in vm_flags(last)


needs_linux = pytest.mark.skipif(not (sys.platform.startswith("linux") and huge_advice()),
                                 reason="huge-page advice is Linux's (madvise MADV_HUGEPAGE)")


def test_huge_zeros_is_a_zero_tensor_of_its_own_that_outlives_every_other_reference() -> None:
    t = huge_zeros((3, 1000, 7), torch.float32)
    assert t.shape == (3, 1000, 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % ALIGN == 0 and not t.any()
    assert t.untyped_storage().nbytes() == t.numel() * 4  # its bytes only
    t += 2.5
    gc.collect()  # nothing else refers to the mapping: the tensor holds it
    assert bool((t == 2.5).all())


def test_an_arena_lays_tensors_side_by_side_each_with_a_storage_of_its_own() -> None:
    arena = Arena(chunk=1 << 20)
    a = arena.zeros((10, 3), torch.uint8)
    b = arena.zeros((5,), torch.float32)
    c = arena.zeros((100, 100), torch.int16)
    assert [t.data_ptr() % ALIGN for t in (a, b, c)] == [0, 0, 0]
    assert b.data_ptr() == a.data_ptr() + ALIGN and c.data_ptr() == b.data_ptr() + ALIGN  # in order, aligned
    for t in (a, b, c):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size() and not t.any()
    a.fill_(1), b.fill_(2.0), c.fill_(3)
    assert int(a.sum()) == 30 and float(b.sum()) == 10.0 and int(c.sum()) == 30000  # no overlap
    full = arena.zeros((200_000,), torch.uint8)  # fits no more in this mapping: a new one
    whole = arena.zeros((300_000,), torch.uint8)  # over a quarter of a mapping: one of its own
    assert full.data_ptr() != c.data_ptr() + c.numel() * 2 and not full.any() and not whole.any()
    del arena
    gc.collect()
    assert int(a.sum()) == 30 and float(b.sum()) == 10.0  # the tensors hold their mapping


@needs_linux
def test_weights_and_kv_stores_are_advised_huge_pages() -> None:
    """Where Linux takes the advice, the repacked weights and the pool's stores lie in mappings
    advised MADV_HUGEPAGE: a decode step streams all of them (the negative control: an anonymous
    mapping made without the advice)."""
    kernels = quant.quant_kernels()
    assert kernels is not None, quant.quant_unavailable_reason()
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(rng.integers(0, 256, size=(64, 8 * 34), dtype=np.uint8))
    raw.view(-1, 34)[:, 1] = 0x3c  # float16 scales of a modest size (the high byte)
    weight = kernels.pack(raw, "Q8_0", 256)
    pool = PagedKVCachePool(num_layers=2, num_kv_heads=2, head_dim=64, num_blocks=8, block_size=16,
                            max_seq_len=64, dtype=torch.float32, device="cpu")
    for tensor in (weight.data, pool.k_layers[0], pool.v_layers[1]):
        assert advised(tensor), vm_flags(tensor.data_ptr())
    plain = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a mapping never advised
    assert not advised(torch.from_numpy(np.frombuffer(plain, dtype=np.uint8)))
    x = torch.randn(3, 256)
    assert torch.equal(kernels.linear(x, weight), kernels.linear(x, weight))
