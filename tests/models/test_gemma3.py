"""Gemma 3 and Mistral-style sliding-window models against transformers, and every drafter on Gemma 3.

The tiny checkpoints (``gemma_checkpoints``) have 8-token windows, so every prompt and generation
here runs well past them: a model that attended beyond the window (or not far enough) fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import assert_greedy_matches_hf, cached_hf_model, make_medusa_heads, random_ids
from gemma_checkpoints import GEMMA_WINDOW, make_tiny_gemma3, make_tiny_mistral
from helpers import counting_stack
from infer import LLM, SamplingParams
from infer.cache import PagedKVCachePool, SlottedKVCache
from infer.core.model_runner import ModelRunner
from infer.loader import load_model
from infer.models.config import CheckpointError, ModelConfig

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ATOL = 1e-4
NEW_TOKENS = 32
PROMPTS = ["class Foo:\n    def __init__(self, x):",
           "The quick brown fox jumps over the lazy dog, and then it returns None.",
           "x = 1"]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Local/global layers alternating, logit soft-capping on."""
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"), softcap=30.0)


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mistral(tmp_path_factory.mktemp("tiny_mistral"))


@pytest.fixture(params=["tiny_gemma3", "tiny_mistral"])
def windowed(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


_hf_model, _ids = cached_hf_model, random_ids


def test_config_reads_gemma3_fields(tiny_gemma3: Path) -> None:
    raw = json.loads((tiny_gemma3 / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    assert (config.model_type, config.sliding_window, config.query_pre_attn_scalar) == ("gemma3", 8, 24.0)
    assert (config.rope_theta, config.rope_local_theta, config.final_logit_softcapping) == (1e6, 1e4, 30.0)
    assert [config.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert config.tie_word_embeddings and config.qk_norm
    # transformers 4's layout: a pattern instead of layer_types, top-level RoPE bases.
    legacy = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    legacy.update(sliding_window_pattern=3, rope_theta=5e5, rope_local_base_freq=2e4, num_hidden_layers=6)
    old = ModelConfig.from_dict(legacy)
    assert [old.layer_window(i) for i in range(6)] == [8, 8, None, 8, 8, None]
    assert (old.rope_theta, old.rope_local_theta) == (5e5, 2e4)
    # A multimodal checkpoint: the language model's fields nest under text_config.
    nested = ModelConfig.from_dict({"model_type": "gemma3", "text_config": raw, "eos_token_id": [1, 106]})
    assert nested.model_type == "gemma3" and nested.eos_token_ids == [1] and nested.num_hidden_layers == 4
    with pytest.raises(CheckpointError, match="attn_logit_softcapping"):
        ModelConfig.from_dict({**raw, "attn_logit_softcapping": 50.0})


def test_multimodal_checkpoint_loads_its_language_model(tiny_gemma3: Path, tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration folder: text_config nests the config, the language model's
    tensors sit under model.language_model.*, and the vision tower is skipped."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((tiny_gemma3 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                                                      "text_config": {**raw, "model_type": "gemma3_text"},
                                                      "vision_config": {"model_type": "siglip_vision_model"}}))
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(tiny_gemma3 / "model.safetensors").items()}
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(2, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    text, _ = load_model(tiny_gemma3, "float32", "cpu")
    multimodal, config = load_model(tmp_path, "float32", "cpu")
    assert config.model_type == "gemma3" and config.sliding_window == 8
    ids = _ids(12, 4)
    with torch.no_grad():
        assert torch.equal(multimodal.compute_logits(multimodal(ids)), text.compute_logits(text(ids)))


def test_logits_match_transformers_without_cache(windowed: Path) -> None:
    model, config = load_model(windowed, "float32", "cpu")
    ids = torch.cat([_ids(23, 0), _ids(23, 1)])
    with torch.no_grad():
        ours = model.compute_logits(model(ids))
        ref = _hf_model(windowed)(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ref.std(dim=-1).min() > 0.5  # far from flat: the match means something


@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_cached_prefill_and_decode_past_the_window_match_transformers(windowed: Path, backend: str) -> None:
    model, config = load_model(windowed, "float32", "cpu")
    ids = _ids(30, 7)
    with torch.no_grad():
        ref = _hf_model(windowed)(input_ids=ids).logits[0]
    shape = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    pool = (SlottedKVCache(*shape, num_slots=1, max_seq_len=32, dtype=torch.float32, device="cpu")
            if backend == "slotted" else
            PagedKVCachePool(*shape, num_blocks=8, block_size=4, max_seq_len=32, dtype=torch.float32, device="cpu"))
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    tokens = ids[0].tolist()
    # a prefill longer than the window, a chunk that straddles it, then decode steps
    got = [runner.logits(runner.forward([slot], [tokens[:11]]))[0], runner.logits(runner.forward([slot], [tokens[11:17]]))[0]]
    got += [runner.logits(runner.forward([slot], [[t]]))[0] for t in tokens[17:]]
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers(windowed: Path) -> None:
    llm = LLM(str(windowed), dtype="float32", device="cpu", block_size=4, max_batch_size=4)
    assert_greedy_matches_hf(llm, windowed, PROMPTS, NEW_TOKENS, pad_token_id=2)


# ----------------------------------------------------------------------------- drafters on Gemma 3

def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_plain(tiny_gemma3: Path) -> list[list[int]]:
    llm = LLM(str(tiny_gemma3), dtype="float32", device="cpu", block_size=4)
    return [o.token_ids for o in llm.generate(PROMPTS, _greedy())]


@pytest.fixture(scope="module")
def gemma_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny random Gemma 3 over the same vocabulary: two layers, its own weights."""
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_draft"), seed=5, num_layers=2, hidden_size=32)


def _drafter(name: str, tiny_gemma3: Path, gemma_draft: Path, tmp_path: Path) -> dict[str, Any]:
    if name == "draft":
        return {"draft_model": str(gemma_draft), "spec_length": 4, "spec_length_policy": "fixed"}
    if name == "draft-self":  # the target drafting for itself: every draft accepted, rounds cross the window
        return {"draft_model": str(tiny_gemma3), "spec_length": 5, "spec_length_policy": "fixed"}
    if name == "medusa":
        return {"speculator": "medusa", "medusa_heads": str(make_medusa_heads(tiny_gemma3, tmp_path / "heads"))}
    return {"speculator": name, "spec_length": 5, "spec_length_policy": "fixed"}


@pytest.mark.parametrize("backend", ["paged", "slotted"])
@pytest.mark.parametrize("drafter", ["ngram", "suffix", "draft", "draft-self", "medusa"])
def test_greedy_speculation_on_gemma3_equals_plain(tiny_gemma3: Path, gemma_draft: Path, gemma_plain: list[list[int]],
                                                    drafter: str, backend: str, tmp_path: Path) -> None:
    # Short prefill chunks: the sliding-window layers' blocks are sized for window + slack + one pass,
    # so speculation runs with them freed and reused throughout.
    llm = LLM(str(tiny_gemma3), dtype="float32", device="cpu", block_size=4, kv_cache_backend=backend,
              max_prefill_tokens=16, **_drafter(drafter, tiny_gemma3, gemma_draft, tmp_path))
    outputs = llm.generate(PROMPTS, _greedy())
    assert [o.token_ids for o in outputs] == gemma_plain
    assert sum(o.metrics.num_rounds for o in outputs) > 0
    for pool in llm.engine.kv_pools().values():  # target and draft: every block back, none leaked
        if isinstance(pool, PagedKVCachePool):
            assert pool.num_local_blocks < pool.num_blocks
            assert len(pool._free_local) == pool.num_local_blocks and pool.num_free_blocks() == pool.num_blocks
    if drafter == "draft-self":
        assert min(o.metrics.mean_accepted_tokens or 0 for o in outputs) > 4  # long accepted runs past the window


# ----------------------------------------------------------------- sliding-window blocks in the paged pool

def _windowed_pool(config: ModelConfig, slack: int, num_blocks: int = 16) -> PagedKVCachePool:
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    return PagedKVCachePool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_blocks=num_blocks,
                            block_size=4, max_seq_len=64, dtype=torch.float32, device="cpu", layer_windows=windows,
                            window_slack=slack)


def test_local_blocks_are_freed_while_decoding_and_logits_still_match(windowed: Path) -> None:
    model, config = load_model(windowed, "float32", "cpu")
    ids = _ids(48, 11)
    with torch.no_grad():
        ref = _hf_model(windowed)(input_ids=ids).logits[0]
    pool = _windowed_pool(config, slack=0)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    tokens = ids[0].tolist()
    got = [runner.logits(runner.forward([slot], [tokens[:6]]))[0]]
    most = 0
    for token in tokens[6:]:
        got.append(runner.logits(runner.forward([slot], [[token]]))[0])
        most = max(most, pool.live_local_blocks(slot))
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)
    assert len(pool.block_tables[slot]) == 12  # the global layers keep every position (Mistral's: none use them)
    # window 8 in blocks of 4: at most the window's blocks, the one being written and one straddling the edge
    assert most <= 4 and pool.local_tables[slot].count(-1) == 12 - pool.live_local_blocks(slot) >= 8
    pool.free(slot)
    assert len(pool._free_local) == pool.num_local_blocks and pool.num_free_blocks() == pool.num_blocks  # no leak


@pytest.mark.parametrize("slack", [0, 4])
def test_rollback_across_the_window_edge(tiny_gemma3: Path, slack: int) -> None:
    """A draft model's chain: passes start past the committed length, then the cache rolls back to it.
    With ``window_slack`` covering the chain nothing it needs was freed; without, the rollback reads
    freed rows (the negative control: the test can tell)."""
    model, config = load_model(tiny_gemma3, "float32", "cpu")
    ids = _ids(40, 3)
    with torch.no_grad():
        ref = _hf_model(tiny_gemma3)(input_ids=ids).logits[0]
    pool = _windowed_pool(config, slack=slack)
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    tokens = ids[0].tolist()
    runner.forward([slot], [tokens[:20]])
    drafted = torch.randint(5, 512, (5,), generator=torch.Generator().manual_seed(9)).tolist()
    for token in drafted:  # a 5-token chain from position 20: passes start at 20..24
        runner.forward([slot], [[token]])
    pool.truncate_to(slot, 20)  # every draft rejected
    got = runner.logits(runner.forward([slot], [tokens[20:]]))[0]
    if slack:
        torch.testing.assert_close(got, ref[20:], atol=ATOL, rtol=0)
    else:
        assert not torch.allclose(got, ref[20:], atol=ATOL, rtol=0)


def test_engine_frees_window_blocks_and_turns_prefix_caching_off(tiny_gemma3: Path, gemma_plain: list[list[int]]) -> None:
    llm = LLM(str(tiny_gemma3), dtype="float32", device="cpu", block_size=4, max_batch_size=4, max_seq_len=512,
              max_prefill_tokens=32)
    pool = llm.engine.pool
    assert isinstance(pool, PagedKVCachePool)
    # The local layers' storage holds max_batch_size sequences of window + one pass, not of 512 tokens.
    assert pool.num_local_blocks < pool.num_blocks
    outputs = llm.generate(PROMPTS + PROMPTS, _greedy())  # each prompt twice: a prefix cache would hit
    assert [o.token_ids for o in outputs] == gemma_plain + gemma_plain
    assert all(not o.metrics.prefix_cached_tokens for o in outputs)
    assert len(pool._free_local) == pool.num_local_blocks and pool.num_free_blocks() == pool.num_blocks


def _storage_bytes(pool: PagedKVCachePool) -> int:
    """The pool's K/V bytes, its scratch rows (one per layer tensor, owned by no sequence) left out."""
    return sum((t.shape[0] - 1) * t[0].numel() * t.element_size() for t in pool.k_layers + pool.v_layers)


def test_kv_budget_counts_what_sliding_window_layers_hold(tiny_gemma3: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under one byte budget, the same model with half its layers windowed gets a larger pool: the
    local layers take only window + one pass per sequence, every other token costs the global
    layers' K/V alone. Both pools stay within the budget, and the windowed one runs more requests at
    once (the full-layer one cannot hold four of them) and gives back every block."""
    from infer.engine import engine as engine_module

    full = make_tiny_gemma3(tmp_path / "no_windows", layer_types=["full_attention"] * 4)
    # 4 layers x 2 KV heads x 32 dims x (K and V) x 4 bytes = 2048 bytes per token when no layer slides
    budget = 200 * 2048
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda _device: 2 * budget)
    # Grammar drafting off: its verification (1 + GRAMMAR_MAX_DRAFT nodes) would be the longest pass,
    # checked below.
    settings: dict[str, Any] = dict(dtype="float32", device="cpu", block_size=4, max_batch_size=4, max_seq_len=128,
                                    max_prefill_tokens=16, kv_memory_fraction=0.5, grammar_drafting=False)
    with_grammar = LLM(str(tiny_gemma3), **{**settings, "grammar_drafting": True}).engine.pool
    # window 8 + a 33-node grammar verification + a block at the edge = 12 blocks of 4, 4 sequences
    assert isinstance(with_grammar, PagedKVCachePool) and with_grammar.num_local_blocks == 48
    del with_grammar
    llms = {name: LLM(str(path), **settings) for name, path in (("windowed", tiny_gemma3), ("full", full))}
    pools = {name: llm.engine.pool for name, llm in llms.items()}
    assert all(isinstance(pool, PagedKVCachePool) for pool in pools.values())
    windowed, plain = pools["windowed"], pools["full"]
    assert isinstance(windowed, PagedKVCachePool) and isinstance(plain, PagedKVCachePool)
    assert plain.free_kv_tokens() == 200 and not plain.local_layers
    # window 8 + one 16-token pass + a block at the edge = 7 blocks of 4 per sequence, 4 sequences:
    # 112 tokens at 2048 bytes, the remaining 180,224 bytes at the global layers' 1024
    assert windowed.num_local_blocks == 28 and windowed.free_kv_tokens() == 112 + 176
    for pool in (windowed, plain):
        assert _storage_bytes(pool) <= budget
    # 4 requests of about 60 tokens: within the windowed pool's 72 each, past the full-layer pool's 50
    prompts = [f"{PROMPTS[0]} # {i}" for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    most_running: dict[str, int] = {}
    for name, llm in llms.items():
        for prompt in prompts:
            llm.engine.add_request(prompt, params)
        most = 0
        while llm.engine.has_unfinished():
            llm.engine.step()
            most = max(most, pools[name].num_active)
        most_running[name] = most
    assert most_running["windowed"] == 4 > most_running["full"]
    assert len(windowed._free_local) == windowed.num_local_blocks  # nothing leaked
    for pool in (windowed, plain):
        assert pool.num_active == 0 and pool.num_free_blocks() == pool.num_blocks


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_audit_passes_on_gemma3(tiny_gemma3: Path, gemma_draft: Path, drafter: str) -> None:
    from infer.audit import AuditSettings, run_audit

    engine = {"speculator": "ngram"} if drafter == "ngram" else {"draft_model": str(gemma_draft)}
    settings = AuditSettings(engine=dict(model=str(tiny_gemma3), dtype="float32", device="cpu", spec_length=4, spec_length_policy="fixed", **engine),
                             prompts=PROMPTS, contexts=1, checks=("greedy", "acceptance"), max_tokens=40)
    report = run_audit(settings)
    assert report["verdict"] == "PASS", json.dumps(report["checks"], indent=1)[:3000]
    assert report["checks"]["acceptance"]["proposed_tokens"] > 0


def test_exact_greedy_bfloat16_speculation_on_gemma3(tiny_gemma3: Path) -> None:
    """Exact-greedy mode (row-count-invariant kernels) covers Gemma's extra norms and scaled attention:
    bfloat16 speculation gives plain decoding's tokens (the engine refuses a machine where it cannot)."""
    def run(**drafter: Any) -> list[list[int]]:
        llm = LLM(str(tiny_gemma3), dtype="bfloat16", device="cpu", exact_greedy=True, block_size=4, **drafter)
        return [o.token_ids for o in llm.generate(PROMPTS, _greedy())]

    assert run(speculator="ngram", spec_length=5, spec_length_policy="fixed") == run()


def test_batched_passes_of_unequal_lengths_past_the_window(tiny_gemma3: Path) -> None:
    """One pass over sequences whose new runs differ by more than the window: no query row of the
    window's mask is empty (a padding query would otherwise see no key: NaN on some attention
    kernels), and every real row equals its own single-sequence pass."""
    from infer.cache.protocol import build_kv_batch

    model, config = load_model(tiny_gemma3, "float32", "cpu")
    long, short = _ids(20, 1)[0].tolist(), _ids(3, 2)[0].tolist()
    pool = _windowed_pool(config, slack=0)
    probe = [pool.allocate(), pool.allocate()]
    kv = build_kv_batch(pool, probe, [0, 0], [20, 3])
    assert kv.windowed(GEMMA_WINDOW, torch.arange(20).expand(2, 20)).mask.any(-1).all()  # type: ignore[union-attr]
    runner = ModelRunner(model, pool)
    slots = [pool.allocate(), pool.allocate()]
    hidden = runner.forward(slots, [long, short])
    with torch.no_grad():
        ref = _hf_model(tiny_gemma3)(input_ids=torch.tensor([short])).logits[0]
    torch.testing.assert_close(runner.logits(hidden)[1, :3], ref, atol=ATOL, rtol=0)


def test_ragged_pass_equals_the_padded_pass_past_the_window(windowed: Path) -> None:
    """A ragged pass (runs packed back to back: ``ModelRunner.forward_ragged``, what speculative
    verification runs) over sequences whose runs differ by more than the window, in a pool whose
    sliding-window layers keep their own blocks: every row equals the padded pass's, and the cache
    after it is the same."""
    model, config = load_model(windowed, "float32", "cpu")
    _assert_ragged_equals_padded(model, config)


def _assert_ragged_equals_padded(model: Any, config: Any) -> None:
    """Two sequences prefilled, then runs of 14 and 2 tokens (past the window) as one padded pass and
    as one ragged pass, each in a fresh windowed pool: the runs' rows, and a decode step after
    them, are the same."""
    prompts = [_ids(30, 3)[0].tolist(), _ids(9, 4)[0].tolist()]
    runs = [_ids(14, 5)[0].tolist(), _ids(2, 6)[0].tolist()]
    results = []
    with torch.inference_mode():
        for ragged in (False, True):
            pool = _windowed_pool(config, slack=16, num_blocks=40)
            runner = ModelRunner(model, pool)
            slots = [pool.allocate(), pool.allocate()]
            for slot, prompt in zip(slots, prompts, strict=True):
                runner.forward([slot], [prompt])
            if ragged:
                packed = runner.forward_ragged(slots, runs)
                assert packed.rows == 16 and packed.offsets == [0, 14, 16]
                logits = packed.padded(runner.logits(packed.hidden))
            else:
                logits = runner.logits(runner.forward(slots, runs))
            results.append((logits, runner.logits(runner.forward(slots, [[7], [8]]))))
    (padded, after_padded), (ragged_rows, after_ragged) = results
    for b, run in enumerate(runs):
        torch.testing.assert_close(ragged_rows[b, : len(run)], padded[b, : len(run)], atol=1e-5, rtol=0)
    torch.testing.assert_close(after_ragged, after_padded, atol=1e-5, rtol=0)


# ------------------------------------------------- the C decoder stack on Gemma 3 and Mistral (windowed)

def _stack_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from infer import kernels

    if kernels.library_for(dtype) is None:
        pytest.fail(f"no {dtype} kernels: {kernels.unavailable_reason(dtype)}")  # every CI CPU has float32's
    model, config = load_model(path, dtype, "cpu", backend="cpu-kernels")
    stack = model.backend.cpu_stack
    assert stack is not None and stack.table.local_layers is not None, model.backend.describe()
    gemma = config.model_type == "gemma3"  # its block's form in the C stack; Mistral's is Llama's
    assert (stack.table.norm_offset, stack.table.post_norms, stack.table.activation) == \
        ((True, True, "gelu_tanh") if gemma else (False, False, "silu"))
    return model, config


def _decode_past_the_window(model: Any, config: ModelConfig, backend: str) -> list[torch.Tensor]:
    """Logits of a prefill, 20 greedy decode steps (past the 8-token window) and a 4-token pass."""
    if backend == "paged":
        pool: Any = _windowed_pool(config, slack=8, num_blocks=40)
    else:
        pool = SlottedKVCache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_slots=2,
                              max_seq_len=64, dtype=torch.float32, device="cpu")
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    out = [runner.logits(runner.forward([slot], [_ids(6, 11)[0].tolist()]))[0]]
    for _ in range(20):
        out.append(runner.logits(runner.forward([slot], [[int(out[-1][-1].argmax())]]))[0])
    out.append(runner.logits(runner.forward([slot], [_ids(4, 12)[0].tolist()]))[0])
    return out


@pytest.mark.parametrize("backend", ["paged", "slotted"])
def test_the_c_stack_computes_windowed_models_like_their_layers_past_the_window(windowed: Path, backend: str,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 (local and global layers, two RoPE bases) and Mistral (every layer windowed, one RoPE)."""
    model, config = _stack_model(windowed)
    calls = counting_stack(monkeypatch)
    with torch.inference_mode():
        ours = _decode_past_the_window(model, config, backend)
    assert calls[0] == len(ours)  # every pass, the prefill too (under the stack's 64-row limit)
    stack, model.backend.cpu_stack = model.backend.cpu_stack, None
    with torch.inference_mode():
        reference = _decode_past_the_window(model, config, backend)
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=f"pass {i}")
    # A negative control: the comparison sees a stack whose local layers see every key.
    model.backend.cpu_stack = stack
    monkeypatch.setattr(type(model), "layer_kv", lambda self, kv, index, positions: kv.layer(index))
    with torch.inference_mode():
        unwindowed = _decode_past_the_window(model, config, backend)
    assert max(float((a - b).abs().max()) for a, b in zip(unwindowed, reference, strict=True)) > 100 * ATOL


def test_the_c_stack_takes_a_ragged_windowed_pass(windowed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged pass past the window (each token as its own sequence in the stack, the local layers'
    rows and window mask alike): the same rows as the padded pass, both in the stack."""
    model, config = _stack_model(windowed)
    calls = counting_stack(monkeypatch)
    _assert_ragged_equals_padded(model, config)
    assert calls[0] == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_check_invariance_passes_on_gemma3_with_the_c_stack(tiny_gemma3: Path, dtype: torch.dtype,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact-greedy mode lifts the stack's row limit: every pass of the invariance check runs in it,
    and each token gets the same bits in a long pass, single steps and a batched pass."""
    from infer.backends import exact
    from infer.kernels import library_for

    if library_for(dtype) is None:
        pytest.skip(f"no {dtype} kernels on this CPU")
    model, _ = _stack_model(tiny_gemma3, dtype)
    exact.make_exact(model)
    assert model.backend.cpu_stack.max_rows is None
    calls = counting_stack(monkeypatch)
    monkeypatch.setattr(exact, "_VERIFIED", set())
    exact.check_invariance(model)
    assert calls[0] >= 6


@pytest.mark.parametrize("backend", ["paged", "slotted"])
def test_greedy_ngram_equals_plain_on_gemma3_with_the_c_stack(tiny_gemma3: Path, gemma_plain: list[list[int]],
                                                              backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting_stack(monkeypatch)
    llm = LLM(str(tiny_gemma3), dtype="float32", device="cpu", block_size=4, kv_cache_backend=backend,
              backend="cpu-kernels", max_prefill_tokens=16, speculator="ngram", spec_length=5, spec_length_policy="fixed")
    assert llm.engine.backend.cpu_stack is not None
    outputs = llm.generate(PROMPTS, _greedy())
    assert [o.token_ids for o in outputs] == gemma_plain
    assert sum(o.metrics.num_rounds for o in outputs) > 0 and calls[0] > len(PROMPTS) * 10


@pytest.mark.parametrize("speculator", [None, "ngram"])
def test_mistral_greedy_on_the_c_stack_matches_transformers(tiny_mistral: Path, speculator: str | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Mistral (a Llama with a sliding window in every layer) runs on the C stack, plain and with
    greedy speculation, past its window: the tokens are transformers' greedy ones."""
    calls = counting_stack(monkeypatch)
    spec: dict[str, Any] = {"speculator": "ngram", "spec_length": 5, "spec_length_policy": "fixed"} if speculator else {}
    llm = LLM(str(tiny_mistral), dtype="float32", device="cpu", block_size=4, backend="cpu-kernels",
              max_prefill_tokens=16, **spec)
    stack = llm.engine.backend.cpu_stack
    assert stack is not None and stack.table.local_layers is not None and not stack.table.norm_offset
    # Decoding goes well past the window.
    outputs = assert_greedy_matches_hf(llm, tiny_mistral, PROMPTS, NEW_TOKENS, pad_token_id=2, past=2 * GEMMA_WINDOW)
    assert calls[0] > len(PROMPTS) * 10  # the passes ran in the stack
    if speculator:
        assert sum(o.metrics.num_rounds for o in outputs) > 0


def test_a_gemma3_stack_that_fails_its_probe_falls_back_with_the_reason(tiny_gemma3: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.backends.cpu_kernels import probe_block_stack
    from infer.kernels.cpu import KernelLibrary

    real = KernelLibrary.decoder_stack

    def off(self: KernelLibrary, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: Any,
            *args: Any) -> torch.Tensor:  # a Gemma block that errs; the Llama block untouched
        out = real(self, x, cos, sin, table, *args)
        return out + 0.5 if table.norm_offset else out

    monkeypatch.setattr(KernelLibrary, "decoder_stack", off)
    probe_block_stack.cache_clear()
    try:
        model, _ = load_model(tiny_gemma3, torch.float32, "cpu", backend="cpu-kernels")
        assert model.backend.cpu_stack is None
        assert "Gemma3ForCausalLM block failed its probe" in model.backend.describe()
    finally:
        monkeypatch.undo()
        probe_block_stack.cache_clear()
    model, _ = load_model(tiny_gemma3, torch.float32, "cpu", backend="cpu-kernels")
    assert model.backend.cpu_stack is not None
