"""Phi-3 against transformers: a family added as one file (``models/phi3.py``) plus its registration.

The tiny checkpoints are written by transformers' ``Phi3ForCausalLM``, so their q/k/v and gate/up
projections are the fused ``qkv_proj`` and ``gate_up_proj`` the loader splits; one has an 8-token
sliding window, so every prompt runs past it. Logits are compared in float32 within ATOL; greedy
tokens must be transformers' exactly. Negative controls: the configurations infer refuses say which
field, and a loader that splits the fused tensors in the wrong order fails the parity check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import assert_greedy_matches_hf, cached_hf_model, load_hf_model, random_ids, shared_tokenizer
from gemma_checkpoints import GEMMA_WINDOW, _save
from helpers import counting_stack
from infer import LLM, SamplingParams
from infer.cache import PagedKVCachePool
from infer.core.model_runner import ModelRunner
from infer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from infer.loader import load_model
from infer.loader.save import write_model_files
from infer.models import MODEL_REGISTRY, phi3
from infer.models.config import CheckpointError, ModelConfig, supported_model_types

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ATOL = 1e-4  # float32 on both sides: the same math, summed in another order
NEW_TOKENS = 20
PROMPTS = ["class Foo:\n    def __init__(self, x):",
           "The quick brown fox jumps over the lazy dog, and then it returns None.",
           "x = 1"]


def make_tiny_phi3(out_dir: Path, *, window: int | None = None, seed: int = 0) -> Path:
    """A Phi3ForCausalLM with grouped-query attention (4 query heads on 2 KV heads)."""
    import transformers

    config = transformers.Phi3Config(
        vocab_size=shared_tokenizer().get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=window,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False, dtype="float32")
    return _save(config, out_dir, seed)


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_phi3(tmp_path_factory.mktemp("tiny_phi3"))


@pytest.fixture(scope="module")
def tiny_phi3_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_phi3(tmp_path_factory.mktemp("tiny_phi3_window"), window=GEMMA_WINDOW)


@pytest.fixture(params=["tiny_phi3", "tiny_phi3_window"])
def phi3_path(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


_hf_model, _ids = cached_hf_model, random_ids


def _logits(path: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model, _ = load_model(path, "float32", "cpu")
    with torch.no_grad():
        return model.compute_logits(model(ids)), _hf_model(path)(input_ids=ids).logits


def test_the_config_reader_and_the_loader_name_no_family() -> None:
    """What a family adds lives in its file: neither the common config reading nor the loader
    branches on a model_type (a new family is its file and its registration)."""
    import inspect

    import infer.loader
    import infer.models.config

    families = supported_model_types()
    assert "phi3" in families and MODEL_REGISTRY["phi3"] is phi3.Phi3ForCausalLM
    for module in (infer.models.config, infer.loader):
        source = inspect.getsource(module)
        assert not [f for f in families if f'"{f}"' in source or f"'{f}'" in source], module.__name__


def test_config_reads_phi3(tiny_phi3: Path, tiny_phi3_window: Path) -> None:
    config = ModelConfig.from_file(tiny_phi3 / "config.json")
    assert (config.model_type, config.head_dim, config.sliding_window, config.qkv_bias) == ("phi3", 16, None, False)
    windowed = ModelConfig.from_file(tiny_phi3_window / "config.json")
    assert windowed.sliding_window == GEMMA_WINDOW and windowed.layer_window(1) == GEMMA_WINDOW
    assert windowed.to_hf_dict()["architectures"] == ["Phi3ForCausalLM"]


def test_logits_match_transformers(phi3_path: Path) -> None:
    ours, ref = _logits(phi3_path, torch.cat([_ids(23, 0), _ids(23, 1)]))
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ref.std(dim=-1).min() > 0.5  # far from flat: the match means something


def test_cached_prefill_and_decode_past_the_window_match_transformers(tiny_phi3_window: Path) -> None:
    model, config = load_model(tiny_phi3_window, "float32", "cpu")
    ids = _ids(30, 7)
    with torch.no_grad():
        ref = _hf_model(tiny_phi3_window)(input_ids=ids).logits[0]
    pool = PagedKVCachePool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_blocks=8,
                            block_size=4, max_seq_len=32, dtype=torch.float32, device="cpu")
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    tokens = ids[0].tolist()
    got = [runner.logits(runner.forward([slot], [tokens[:11]]))[0]]  # a prefill longer than the window
    got += [runner.logits(runner.forward([slot], [[t]]))[0] for t in tokens[11:]]
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_greedy_generation_through_the_engine_matches_transformers(phi3_path: Path) -> None:
    llm = LLM(str(phi3_path), dtype="float32", device="cpu", block_size=4, max_batch_size=4)
    assert_greedy_matches_hf(llm, phi3_path, PROMPTS, NEW_TOKENS, PAD_ID)


@pytest.mark.parametrize("speculator", [None, "ngram"])
def test_phi3_greedy_on_the_c_stack_matches_transformers(tiny_phi3_window: Path, speculator: str | None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3 is the Llama block once split, so the C decoder stack runs it (windowed, as Mistral),
    plain and with greedy speculation: transformers' greedy tokens either way."""
    from infer import kernels

    if kernels.library_for(torch.float32) is None:
        pytest.fail(f"no float32 kernels: {kernels.unavailable_reason(torch.float32)}")  # every CI CPU has them
    calls = counting_stack(monkeypatch)
    spec: dict[str, Any] = {"speculator": "ngram", "spec_length": 5, "spec_length_policy": "fixed"} if speculator else {}
    llm = LLM(str(tiny_phi3_window), dtype="float32", device="cpu", block_size=4, backend="cpu-kernels",
              max_prefill_tokens=16, **spec)
    stack = llm.engine.backend.cpu_stack
    assert stack is not None and stack.table.local_layers is not None
    outputs = assert_greedy_matches_hf(llm, tiny_phi3_window, PROMPTS, NEW_TOKENS, PAD_ID)
    assert calls[0] >= NEW_TOKENS // 5  # the passes ran in the stack
    if speculator:
        assert sum(o.metrics.num_rounds for o in outputs) > 0


def test_a_q8_0_phi3_on_the_c_stack_speculates_exactly(tiny_phi3_window: Path) -> None:
    """The split projections quantize like any Llama's (``--quantization q8_0``): the stack runs them
    quantized, and greedy n-gram speculation gives plain decoding's tokens."""
    def run(**spec: Any) -> list[list[int]]:
        llm = LLM(str(tiny_phi3_window), dtype="float32", device="cpu", block_size=4, backend="cpu-kernels",
                  quantization="q8_0", **spec)
        stack = llm.engine.backend.cpu_stack
        assert stack is not None and stack.table.quant is not None
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(PROMPTS, params)]

    plain = run()
    assert run(speculator="ngram", spec_length=5, spec_length_policy="fixed") == plain
    assert all(len(set(ids)) > 4 for ids in plain)


def test_a_saved_phi3_loads_in_transformers_with_its_fused_names(tiny_phi3: Path, tmp_path: Path) -> None:
    model, config = load_model(tiny_phi3, "float32", "cpu", fuse=False)
    state = model.hf_state_dict()
    assert "model.layers.0.self_attn.qkv_proj.weight" in state and "model.layers.0.mlp.gate_up_proj.weight" in state
    assert not any(".q_proj." in name or ".gate_proj." in name for name in state)
    write_model_files(tmp_path, model, config, torch.float32)
    ids = _ids(12, 3)
    with torch.no_grad():
        torch.testing.assert_close(load_hf_model(tmp_path)(input_ids=ids).logits,
                                   _hf_model(tiny_phi3)(input_ids=ids).logits, atol=0, rtol=0)


# ------------------------------------------------------------------------------- negative controls

def _raw(path: Path, **changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    raw.update(changes)
    return raw


@pytest.mark.parametrize(("changes", "named"), [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "rope_scaling type 'longrope'"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "rope_scaling type 'su'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8}}, "rope_scaling type 'longrope'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
], ids=["partial-rotary", "partial-rotary-top-level", "longrope", "su", "longrope-rope-parameters", "gelu", "window-0"])
def test_refused_configs_name_the_field(tiny_phi3: Path, changes: dict[str, Any], named: str) -> None:
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_dict(_raw(tiny_phi3, **changes))


def test_a_fused_tensor_of_the_wrong_size_names_it(tiny_phi3: Path, tmp_path: Path) -> None:
    """A config whose KV heads disagree with the checkpoint: the fused qkv_proj cannot be split."""
    folder = tmp_path / "wrong_heads"
    folder.mkdir()
    for f in tiny_phi3.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps(_raw(tiny_phi3, num_key_value_heads=4)))
    with pytest.raises(CheckpointError, match=r"qkv_proj.weight' has shape \(128, 64\).*\(192, 64\).*q_proj, k_proj, v_proj"):
        load_model(folder, "float32", "cpu")


@pytest.mark.parametrize("mutation", [{"qkv_proj": ("q_proj", "v_proj", "k_proj")},
                                      {"gate_up_proj": ("up_proj", "gate_proj")}], ids=["k-v-swapped", "gate-up-swapped"])
def test_a_wrong_split_fails_parity(tiny_phi3: Path, monkeypatch: pytest.MonkeyPatch,
                                    mutation: dict[str, tuple[str, ...]]) -> None:
    """The parity check can fail: the same checkpoint split in the wrong order loads (the parts have
    the same shapes) but its logits are far from transformers'."""
    for fused, parts in mutation.items():
        monkeypatch.setitem(phi3.PACKED_MODULES, fused, parts)
    ours, ref = _logits(tiny_phi3, _ids(23, 0))
    assert float((ours - ref).abs().max()) > 100 * ATOL
