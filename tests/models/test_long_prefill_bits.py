"""A long prompt's tokens get the same bits from the C stack whatever pass computes them.

A prefill chunk over several of the attention's key segments (``cpu.STACK_ATTN_SEGMENT``) has
enough work items for every thread, so each item takes its rows' segments in turn and merges them
itself; a pass of a few rows (a decode step) splits the same segments across the threads and merges
them afterwards. Both must give a token the same bits: greedy output never depends on how a prompt
was chunked or what else shared the step.
"""

from __future__ import annotations

import pytest
import torch

from infer.backends.cpu_kernels import CpuStack, prepare, quantized_probe_model
from infer.cache import make_pool
from infer.cache.protocol import build_kv_batch
from infer.kernels import cpu, library_for, unavailable_reason
from infer.kernels.quant import quant_kernels, quant_unavailable_reason

PROMPT = 5 * cpu.STACK_ATTN_SEGMENT + 37  # keys over six segments


def _stack_model(case: int) -> tuple[torch.nn.Module, CpuStack]:
    quant = quant_kernels()
    library = library_for(torch.float32)
    if quant is None or library is None:
        pytest.fail(f"the kernels do not run here: {quant_unavailable_reason()} {unavailable_reason(torch.float32)}")
    model = quantized_probe_model(case, quant)
    prepare(model, library, fused=True)
    stack = CpuStack.build(model, library)
    assert stack is not None and stack.max_rows is None  # every pass of a quantized model runs here
    return model, stack


def _hidden_by_passes(model: torch.nn.Module, stack: CpuStack, cache: str, ids: torch.Tensor,
                      widths: list[int]) -> torch.Tensor:
    """The prompt ``ids`` fed as passes of ``widths`` tokens; every token's final hidden state."""
    config = model.config
    pool = make_pool(cache, num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, max_seq_len=PROMPT + 8, max_batch_size=1, block_size=16,
                     num_blocks=None, dtype=torch.float32, device=torch.device("cpu"))
    slot = pool.allocate()
    out, at = [], 0
    with torch.inference_mode():
        for width in widths:
            part = ids[:, at: at + width]
            positions = torch.arange(at, at + width).unsqueeze(0)
            kv = build_kv_batch(pool, [slot], [at], [width])
            assert stack.takes(model.embed(part, positions)[0], kv)
            out.append(stack.forward(model, part, positions, kv)[0])
            at += width
    assert at == ids.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache", ["paged", "slotted"])
@pytest.mark.parametrize("case", [0, 1])  # head_dim 16 and 32: one and two vector chunks a key
def test_a_long_prompt_gets_the_same_bits_however_it_is_chunked(case: int, cache: str, threads: int) -> None:
    torch.set_num_threads(threads)
    model, stack = _stack_model(case)
    ids = torch.randint(model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    whole = _hidden_by_passes(model, stack, cache, ids, [PROMPT])
    chunks = [256, 200, PROMPT - 456]  # chunks of a prompt deep into its keys, as chunked prefill runs them
    tail = [PROMPT - 3, 1, 1, 1]  # a decode step's kind of pass: one row, its segments split across threads
    assert torch.equal(whole, _hidden_by_passes(model, stack, cache, ids, chunks))
    assert torch.equal(whole, _hidden_by_passes(model, stack, cache, ids, tail))
