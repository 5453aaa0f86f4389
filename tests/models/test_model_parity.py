"""Numerical parity with transformers: logits (with and without a KV cache) and greedy generation.

Every tiny checkpoint is loaded twice, by ``infer.loader.load_model`` and by transformers'
``AutoModelForCausalLM``; both must produce the same logits (float32, atol 1e-4) and the same
greedy tokens. Prompts are compared on token ids (transformers re-tokenizes qwen2 folders).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from checkpoints import load_hf_model
from infer import LLM, SamplingParams
from infer.cache import PagedKVCachePool, SlottedKVCache
from infer.cache.protocol import CachePoolProtocol
from infer.core.model_runner import ModelRunner
from infer.loader import load_model
from infer.loader.tokenizer import Tokenizer
from infer.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ARCH_FIXTURES = ["tiny_llama", "tiny_llama_tied", "tiny_qwen3", "tiny_qwen2", "tiny_llama_sharded"]
BACKENDS = ["slotted", "paged"]
ATOL = 1e-4
NEW_TOKENS = 32

# Chosen so that no tiny model falls into a one-token loop or emits EOS within 32 greedy tokens.
PROMPT_TEXTS = [
    "class Foo:\n    def __init__(self, x):",
    "The quick brown fox jumps over the lazy dog, and then it returns None.",
    "x = 1",
]


_hf_model = functools.lru_cache(maxsize=8)(load_hf_model)


def _random_ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    # Skip the special ids 0..4 so every token is ordinary text.
    return torch.randint(5, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _make_pool(backend: str, config: ModelConfig, max_seq_len: int, num_seqs: int = 2) -> CachePoolProtocol:
    shape = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    if backend == "slotted":
        return SlottedKVCache(*shape, num_slots=num_seqs, max_seq_len=max_seq_len, dtype=torch.float32,
                              device="cpu")
    return PagedKVCachePool(*shape, num_blocks=num_seqs * -(-max_seq_len // 4), block_size=4,
                            max_seq_len=max_seq_len, dtype=torch.float32, device="cpu")


@pytest.fixture(params=ARCH_FIXTURES)
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_logits_match_transformers_without_cache(checkpoint: Path) -> None:
    model, config = load_model(checkpoint, "float32", "cpu")
    hf = _hf_model(checkpoint)
    ids = torch.cat([_random_ids(23, 0, config.vocab_size), _random_ids(23, 1, config.vocab_size)])
    with torch.no_grad():
        ours = model.compute_logits(model(ids))
        ref = hf(input_ids=ids).logits
    assert ours.shape == ref.shape == (2, 23, config.vocab_size)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    # The logits are far from flat, so a match is meaningful.
    assert ref.std(dim=-1).min() > 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_prefill_and_decode_match_transformers(checkpoint: Path, backend: str) -> None:
    model, config = load_model(checkpoint, "float32", "cpu")
    hf = _hf_model(checkpoint)
    ids = _random_ids(21, 7, config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0]  # [T, V]
        plain = model.compute_logits(model(ids))[0]
    torch.testing.assert_close(plain, ref, atol=ATOL, rtol=0)

    pool = _make_pool(backend, config, max_seq_len=32)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    prefill_len = 9  # not a multiple of the paged block size: decode starts mid-block
    tokens = ids[0].tolist()
    hidden = runner.forward([slot], [tokens[:prefill_len]])
    torch.testing.assert_close(runner.logits(hidden)[0], ref[:prefill_len], atol=ATOL, rtol=0)
    for pos in range(prefill_len, len(tokens)):
        hidden = runner.forward([slot], [[tokens[pos]]])
        assert hidden.shape[:2] == (1, 1)
        torch.testing.assert_close(runner.logits(hidden)[0, 0], ref[pos], atol=ATOL, rtol=0,
                                   msg=lambda m, p=pos: f"position {p}: {m}")
    assert pool.seq_len(slot) == len(tokens)
    if isinstance(pool, PagedKVCachePool):
        assert len(pool.block_tables[slot]) == -(-len(tokens) // pool.block_size) > 2


def test_long_context_matches_transformers(checkpoint: Path) -> None:
    """Positions far past llama3 scaling's original 64-token window, through the paged cache too."""
    model, config = load_model(checkpoint, "float32", "cpu")
    hf = _hf_model(checkpoint)
    ids = _random_ids(300, 3, config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0]
        plain = model.compute_logits(model(ids))[0]
    torch.testing.assert_close(plain, ref, atol=ATOL, rtol=0)
    pool = _make_pool("paged", config, max_seq_len=320, num_seqs=1)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    tokens = ids[0].tolist()
    torch.testing.assert_close(runner.logits(runner.forward([slot], [tokens[:290]]))[0], ref[:290],
                               atol=ATOL, rtol=0)
    for pos in range(290, 300):
        torch.testing.assert_close(runner.logits(runner.forward([slot], [[tokens[pos]]]))[0, 0], ref[pos],
                                   atol=ATOL, rtol=0)


@functools.lru_cache(maxsize=32)
def _hf_greedy(path: Path, prompt_ids: tuple[int, ...], pad_id: int) -> list[int]:
    """transformers' greedy continuation (cached: both backends compare against it)."""
    hf = _hf_model(path)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=pad_id)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_matches_transformers(checkpoint: Path, backend: str) -> None:
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", kv_cache_backend=backend, block_size=4,
              max_batch_size=4)
    tokenizer: Tokenizer = llm.tokenizer
    prompts = [tokenizer.encode(t) for t in PROMPT_TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must differ in length"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))

    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length"
        assert len(out.token_ids) == NEW_TOKENS
        expected = _hf_greedy(checkpoint, tuple(prompt), pad_id=2)
        eos = set(llm.engine.tokenizer.eos_token_ids)
        # transformers' min_new_tokens masks EOS; with ignore_eos we may pick it. Compare up to there.
        cut = next((i for i, t in enumerate(out.token_ids) if t in eos), NEW_TOKENS)
        assert cut > NEW_TOKENS // 2, "the model emits EOS too early for a meaningful comparison"
        assert out.token_ids[:cut] == expected[:cut]
        # Not a one-token loop: the comparison exercises real context dependence.
        assert len(set(out.token_ids)) > 4


@pytest.mark.parametrize("width", [1, 4])
def test_half_precision_gqa_attention_folds_query_heads_exactly(width: int) -> None:
    # The bfloat16 path folds each KV head's query heads into the query length; it must compute
    # what plain grouped-query attention (K/V heads repeated) computes, masks included.
    from infer.models.layers import _sdpa

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, width, 16, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 9, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    mask = torch.rand(2, 1, width, 9, generator=gen) > 0.3
    mask[..., 0] = True
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.repeat_interleave(3, 1).float(), v.repeat_interleave(3, 1).float(), attn_mask=mask)
    torch.testing.assert_close(_sdpa(q, k, v, mask, False).float(), reference, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------- the fast paths compute the reference math


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_identical_to_the_reference_formula(dtype: torch.dtype) -> None:
    # RMSNorm takes sum / dim instead of mean (cheaper on CPU); transformers' formula must come out
    # bit for bit, in half precision too (where F.rms_norm would not: it applies the weight before rounding).
    from infer.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
    for rows in (1, 7):
        x = (torch.randn(2, rows, 576, generator=gen) * 3).to(dtype)
        x32 = x.float()
        reference = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(norm(x), reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_identical_to_rotate_half(dtype: torch.dtype) -> None:
    from infer.models.layers import apply_rope, rope_cos_sin

    gen = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float()
    positions = torch.tensor([[0, 5, 17, 300], [2, 3, 4, 4000]])
    x = torch.randn(2, 4, 12, 64, generator=gen).to(dtype)
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    # The reference (transformers' Llama): cat((freqs, freqs)) tables and rotate_half.
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_cos, ref_sin = emb.cos().to(dtype).unsqueeze(2), emb.sin().to(dtype).unsqueeze(2)
    rotated = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    assert torch.equal(apply_rope(x, cos, sin), x * ref_cos + rotated * ref_sin)
    # q and k rotated together from one strided view equal each rotated on its own.
    qkv = torch.randn(2, 4, 15, 64, generator=gen).to(dtype)
    together = apply_rope(qkv[:, :, :12], cos, sin)
    assert torch.equal(together[:, :, :9], apply_rope(qkv[:, :, :9].contiguous(), cos, sin))
    assert torch.equal(together[:, :, 9:], apply_rope(qkv[:, :, 9:12].contiguous(), cos, sin))


def test_decode_step_without_mask_equals_the_masked_pass() -> None:
    # A one-token step of one sequence attends without a mask; that must be exactly the masked result.
    from infer.models.layers import _sdpa

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 6, 1, 16, generator=gen).to(dtype)
        k, v = (torch.randn(1, 2, 11, 16, generator=gen).to(dtype) for _ in range(2))
        ones = torch.ones(1, 1, 1, 11, dtype=torch.bool)
        assert torch.equal(_sdpa(q, k, v, None, False), _sdpa(q, k, v, ones, False))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_cached_decode_matches_cpu(tiny_qwen3: Path, tiny_llama: Path, dtype: str) -> None:
    # The same fast paths on CUDA (no packing there): prefill, mask-free decode steps and a
    # 6-token verification pass agree with the CPU float32 run.
    for checkpoint in (tiny_llama, tiny_qwen3):
        reference, config = load_model(checkpoint, "float32", "cpu")
        model, _ = load_model(checkpoint, dtype, "cuda")
        ids = _random_ids(30, 5, config.vocab_size)[0].tolist()
        outputs = []
        for m, device in ((reference, "cpu"), (model, "cuda")):
            pool = PagedKVCachePool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                    num_blocks=16, block_size=4, max_seq_len=64,
                                    dtype=next(m.parameters()).dtype, device=device)
            runner = ModelRunner(m, pool)
            slot = pool.allocate()
            rows = [runner.logits(runner.forward([slot], [ids[:18]]))[0]]
            rows += [runner.logits(runner.forward([slot], [[t]]))[0] for t in ids[18:24]]
            rows.append(runner.logits(runner.forward([slot], [ids[24:30]]))[0])
            outputs.append(torch.cat(rows).cpu())
        if dtype == "float32":
            torch.testing.assert_close(outputs[1], outputs[0], atol=ATOL, rtol=0)
        else:  # bfloat16 rounds every layer's output: close, and the same next token almost everywhere
            torch.testing.assert_close(outputs[1], outputs[0], atol=0.25, rtol=0.05)
            agree = (outputs[1].argmax(-1) == outputs[0].argmax(-1)).float().mean().item()
            assert agree >= 0.9, f"bfloat16 on CUDA picks the CPU float32 argmax in only {agree:.0%} of rows"
