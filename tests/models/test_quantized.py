"""Quantized weights stay quantized: GGUF tensors of the kernels' types load as ``QuantLinear`` /
``QuantEmbedding`` over the file's blocks (repacked once at load into the kernels' x8 layout),
float checkpoints quantize at load (``--quantization``), and a quantized model stays exact under
speculation: greedy ids equal plain decoding's, sampled tokens follow the quantized target's own
distribution.

The logits of a quantized model are compared with the same file dequantized to float
(``quantization="none"``): the kernels quantize activations to int8 per 32 values, so they differ
by that rounding (``LOGIT_TOLERANCE`` of the logits' spread), while a wrong row order, a dropped
bias or a mixed-up fused part moves them by the spread itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_gguf import REAL_GGUF, last_logits, needs_real, write_gguf
from torch import nn

from helpers import (
    DRAFTER_PROMPTS,
    P_CONTROL,
    PROMPT,
    V,
    assert_follows_reference,
    grouped_chisquare,
    reference_from,
)
from infer import LLM, EngineConfig, SamplingParams
from infer.backends.exact import check_invariance
from infer.loader import load_model
from infer.models.quantized import QuantEmbedding, QuantLinear
from quant_files import by_part, typed_tensors

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install gguf")

pytestmark = pytest.mark.usefixtures("torch_single_thread")

LOGIT_TOLERANCE = 0.05  # of the float model's logit spread (max - min) at that position
IDS = list(range(3, 60, 2))


@pytest.fixture(scope="module", autouse=True)
def quant_kernels_here() -> None:
    """These tests are about the model and loader on the quantized kernels: where the kernels cannot
    run they fail, naming why (the kernels' own tests cover each variant)."""
    from infer.kernels import quant

    assert quant.quant_kernels() is not None, f"the quantized kernels do not run here: {quant.quant_unavailable_reason()}"


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, tolerance: float = LOGIT_TOLERANCE) -> None:
    spread = float(ref.max() - ref.min())
    error = float((ours - ref).abs().max())
    assert error <= tolerance * spread, f"max logit error {error:.4g} > {tolerance} x spread {spread:.4g}"


def projections(model: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return out


class FloatActivations:
    """The kernels' interface with float activations: ``linear`` multiplies by the blocks'
    reference dequantization. A model on it computes what the file dequantized computes, up to
    float32 summation order: the check that the loader put every block where it belongs, apart
    from the activation rounding the real kernels add."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def pack(self, raw: torch.Tensor, qtype: str, in_features: int) -> Any:
        return self.kernels.pack(raw, qtype, in_features)

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        # every row dequantized as gguf-py does
        dense = self.kernels.dequantize_rows(weight, torch.arange(weight.out_features))
        return F.linear(x, dense, bias)

    def dequantize_rows(self, weight: Any, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.dequantize_rows(weight, ids)  # type: ignore[no-any-return]


def assert_loaded_right(model: nn.Module, dequantized: nn.Module, ids: list[int]) -> None:
    """``model``'s logits with float activations equal the dequantized model's (float32 rounding)."""
    kernels = {}
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            kernels[module] = module.kernels
            module.kernels = FloatActivations(module.kernels)
    try:
        torch.testing.assert_close(last_logits(model, ids), last_logits(dequantized, ids), rtol=1e-4, atol=1e-3)
    finally:
        for module, original in kernels.items():
            module.kernels = original


def file_mapping_range(path: Path) -> tuple[int, int]:
    from infer.loader.gguf import open_gguf

    data = open_gguf(path).data
    start = data.ctypes.data
    return start, start + data.nbytes


# ------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_gguf_weights_stay_in_their_blocks(qtype: str, tiny_llama: Path, tmp_path: Path) -> None:
    """Every projection, the head and the embeddings are quantized modules, each matrix its x8 copy
    (none a view of the file's mapping); the logits match the same file dequantized, and (Q8_0) the
    float checkpoint it was made from."""
    path = write_gguf(tiny_llama, tmp_path / f"{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
    model, _ = load_model(path, "float32", "cpu")
    assert all(isinstance(m, QuantLinear) and m.qtypes == [qtype] for m in projections(model))
    assert isinstance(model.lm_head, QuantLinear) and isinstance(model.model.embed_tokens, QuantEmbedding)
    start, end = file_mapping_range(path)
    layer = model.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                   model.lm_head):
        weight = module.weights[0]
        assert weight.data.shape[0] == -(-weight.out_features // 8)  # 8 rows per group
        assert not start <= weight.data.data_ptr() < end
    assert f"quantized ({qtype} x" in model.weights_summary
    dequantized, _ = load_model(path, "float32", "cpu", quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in dequantized.modules())
    assert_loaded_right(model, dequantized, IDS)
    assert_logits_close(last_logits(model, IDS), last_logits(dequantized, IDS))
    if qtype == "Q8_0":  # llama q/k rows back in Hugging Face's order: the float model agrees
        folder, _ = load_model(tiny_llama, "float32", "cpu")
        assert_logits_close(last_logits(model, IDS), last_logits(folder, IDS))


def test_k_quants_and_mixed_types_in_a_fused_projection(tmp_path: Path) -> None:
    """A Q4_K_M-like file: q/k Q4_K beside v Q6_K fuse into two matrices (one call each), gate/up
    into one; o Q5_K, down Q6_K, a Q6_K head and Q8_0 embeddings. Logits match the file dequantized."""
    from checkpoints import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "wide", "llama", hidden_size=256, num_layers=2, num_heads=4,
                                  num_kv_heads=2, intermediate_size=512, seed=3)
    rule = by_part({"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
                    "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q8_0"})
    with typed_tensors(rule):
        path = write_gguf(folder, tmp_path / "mixed.gguf")
    model, _ = load_model(path, "float32", "cpu")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.qtypes == ["Q4_K", "Q6_K"] and mlp.gate_up_proj.qtypes == ["Q4_K"]
    assert attn.o_proj.qtypes == ["Q5_K"] and mlp.down_proj.qtypes == ["Q6_K"] and model.lm_head.qtypes == ["Q6_K"]
    dequantized, _ = load_model(path, "float32", "cpu", quantization="none")
    assert_loaded_right(model, dequantized, IDS)
    assert_logits_close(last_logits(model, IDS), last_logits(dequantized, IDS))


def test_gemma3_file_of_mixed_types(tmp_path: Path) -> None:
    """Gemma 3 (tied head over Q8_0 embeddings, sandwich norms, GELU, sliding windows) with Q4_K,
    Q5_0, Q6_K and Q8_0 tensors, as Gemma's Q4_K_M files mix them; greedy ids equal the dequantized
    model's and the logits are close."""
    from test_gemma3_gguf import VOCAB_SIZE, write_gemma3_gguf

    from gemma_checkpoints import make_tiny_gemma3

    folder = make_tiny_gemma3(tmp_path / "gemma", num_layers=6, hidden_size=256, head_dim=256,
                              query_pre_attn_scalar=256, sliding_window_pattern=6, vocab_size=VOCAB_SIZE)
    rule = by_part({"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
                    "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"})
    with typed_tensors(rule):
        path = write_gemma3_gguf(folder, tmp_path / "gemma3-mixed.gguf")
    model, _ = load_model(path, "float32", "cpu")
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.weights[0] is model.model.embed_tokens.weight  # tied: one copy of the blocks
    assert {q for m in projections(model) for q in m.qtypes} == {"Q4_K", "Q5_0", "Q6_K"}
    dequantized, _ = load_model(path, "float32", "cpu", quantization="none")
    ids = list(range(10, 40))
    assert_loaded_right(model, dequantized, ids)
    # This tiny random Gemma's activations (embeddings times 16, six layers) take int8 rounding
    # harder than the llama's: all-Q8_0 blocks of its own weights measured 0.05 of the spread.
    assert_logits_close(last_logits(model, ids), last_logits(dequantized, ids), tolerance=0.15)
    # Sliding-window layers under speculation: greedy n-gram ids equal plain decoding's.
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [ids, [5, 6, 7, 8] * 6]
    plain = [o.token_ids for o in LLM(str(path), device="cpu").generate(prompts, params)]
    spec = LLM(str(path), device="cpu", speculator="ngram", spec_length=4, spec_length_policy="fixed").generate(prompts, params)
    assert [o.token_ids for o in spec] == plain


def test_unsupported_type_is_dequantized_with_its_fused_siblings(tiny_llama: Path, tmp_path: Path) -> None:
    """A Q5_1 ffn_up (no quantized kernel) is dequantized, and its fused partner ffn_gate with it;
    the startup summary says which and why; everything else stays quantized."""
    with typed_tensors(lambda name: "Q5_1" if name == "blk.0.ffn_up.weight" else "Q8_0"):
        path = write_gguf(tiny_llama, tmp_path / "odd.gguf")
    model, _ = load_model(path, "float32", "cpu")
    assert not isinstance(model.model.layers[0].mlp.gate_up_proj, QuantLinear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(model.model.layers[1].mlp.gate_up_proj, QuantLinear)
    summary = model.weights_summary
    assert "dequantized to float" in summary and "Q5_1 has no quantized kernel" in summary
    assert "fused with mlp.up_proj.weight (Q5_1), e.g. model.layers.0.mlp.gate_proj.weight" in summary
    dequantized, _ = load_model(path, "float32", "cpu", quantization="none")
    assert_loaded_right(model, dequantized, IDS)
    assert_logits_close(last_logits(model, IDS), last_logits(dequantized, IDS))


def test_quantization_of_a_float_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    """--quantization q8_0 on a safetensors folder and on an F16 GGUF: quantized modules, logits close
    to the float model's; auto keeps a float checkpoint float."""
    ref, _ = load_model(tiny_llama, "float32", "cpu")
    assert not any(isinstance(m, QuantLinear) for m in ref.modules())
    f16 = write_gguf(tiny_llama, tmp_path / "f16.gguf", gguf.GGMLQuantizationType.F16)
    for source in (tiny_llama, f16):
        model, _ = load_model(source, "float32", "cpu", quantization="q8_0")
        assert all(isinstance(m, QuantLinear) and m.qtypes == ["Q8_0"] for m in projections(model))
        assert isinstance(model.model.embed_tokens, QuantEmbedding)
        assert_logits_close(last_logits(model, IDS), last_logits(ref, IDS))
    q4, _ = load_model(tiny_llama, "float32", "cpu", quantization="q4_0")
    assert q4.model.layers[0].mlp.down_proj.qtypes == ["Q4_0"]
    # The embedding table and the LM head stay at 8 bits (llama.cpp keeps its output tensor at Q6_K).
    assert q4.model.embed_tokens.weight.qtype == "Q8_0" and q4.lm_head.qtypes == ["Q8_0"]
    assert_logits_close(last_logits(q4, IDS), last_logits(ref, IDS), tolerance=0.25)  # 4 bits: coarser


def test_bad_values_and_where_the_kernels_do_not_run(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization='q3_k' is invalid: use auto, none, q8_0"):
        EngineConfig.from_options(model=str(tiny_llama), quantization="q3_k")
    with pytest.raises(ValueError, match=r"draft_quantization='int8' is invalid"):
        EngineConfig.from_options(model=str(tiny_llama), draft_model=str(tiny_llama), draft_quantization="int8")
    with pytest.raises(ValueError, match="quantization='q5_1' is invalid"):
        load_model(tiny_llama, "float32", "cpu", quantization="q5_1")
    path = write_gguf(tiny_llama, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    # --backend torch: no quantized kernels; the file is dequantized and the summary says why.
    model, _ = load_model(path, "float32", "cpu", backend="torch")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert "quantized weights dequantized: --backend torch" in model.weights_summary
    with pytest.raises(ValueError, match="needs the quantized kernels, which cannot run here: --backend torch"):
        load_model(tiny_llama, "float32", "cpu", backend="torch", quantization="q8_0")


def test_cli_takes_the_options() -> None:
    import argparse

    from infer.engine.options import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args(["--quantization", "q4_0", "--draft-model", "d",
                                              "--draft-quantization", "q8_0"]))
    assert config.quantization == "q4_0"
    assert config.speculative is not None and config.speculative.draft_quantization == "q8_0"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp8"])


# ------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("threads", [1, 2])
def test_a_token_gets_the_same_bits_in_any_pass(threads: int, tiny_llama: Path, tmp_path: Path) -> None:
    """The exact-greedy mode's own check, on a quantized model as loaded (no exact-greedy option):
    a token's hidden state in one 72-token pass equals it in a prefill, decode steps and a batched
    pass beside a longer sequence."""
    from infer.backends import exact

    path = write_gguf(tiny_llama, tmp_path / "q4.gguf", gguf.GGMLQuantizationType.Q4_0)
    torch.set_num_threads(threads)
    model, _ = load_model(path, "float32", "cpu")
    exact._VERIFIED.clear()
    check_invariance(model)


@pytest.fixture(scope="module")
def quantized_pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Q4_1 target and a draft that agrees with it often: the same weights in Q8_0."""
    folder = tmp_path_factory.mktemp("quantized_pair")
    target = write_gguf(tiny_llama, folder / "target-q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)
    draft = write_gguf(tiny_llama, folder / "draft-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    return target, draft


@pytest.mark.parametrize("kv", ["paged", "slotted"])
def test_greedy_speculation_equals_plain_decoding(quantized_pair: tuple[Path, Path], kv: str) -> None:
    """n-gram and a quantized draft model in front of a quantized target: plain decoding's ids, token
    for token, for prompts batched together."""
    target, draft = quantized_pair
    common: dict[str, Any] = dict(device="cpu", kv_cache_backend=kv, block_size=4, max_batch_size=8)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target), **common).generate(DRAFTER_PROMPTS, params)]
    for drafter in (dict(speculator="ngram", spec_length=4, spec_length_policy="fixed"), dict(draft_model=str(draft), spec_length=3, spec_length_policy="fixed")):
        llm = LLM(str(target), **common, **drafter)
        outputs = llm.generate(DRAFTER_PROMPTS, params)
        assert [o.token_ids for o in outputs] == plain, drafter
        assert sum(o.metrics.accepted_tokens for o in outputs) > 0  # speculation took part
    assert isinstance(llm.engine.model.lm_head, QuantLinear)


def test_self_speculation_with_a_q4_0_copy(tiny_llama: Path) -> None:
    """A float target drafting with its own Q4_0 copy (the same checkpoint, --draft-quantization
    q4_0): plain decoding's ids, and the copy's drafts are often accepted."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32", device="cpu").generate(DRAFTER_PROMPTS, params)]
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", draft_model=str(tiny_llama), draft_quantization="q4_0",
              spec_length=4, spec_length_policy="fixed")
    outputs = llm.generate(DRAFTER_PROMPTS, params)
    assert [o.token_ids for o in outputs] == plain
    # Far above chance (an unrelated model of this 512-token vocabulary is accepted ~never); this
    # tiny random model's flat distributions make a 4-bit copy disagree more than a real one's would.
    proposed = sum(o.metrics.proposed_tokens for o in outputs)
    assert sum(o.metrics.accepted_tokens for o in outputs) > 0.25 * proposed


# ------------------------------------------------------------------------------- sampled exactness

NUM_SAMPLES = 6000


@torch.no_grad()
def test_sampled_speculation_follows_the_quantized_target(small_target: Path, small_draft: Path) -> None:
    """Temperature 1 with a Q8_0 target (quantized at load) and a Q4_0 draft: (x1, x2, x3) follow the
    quantized target's own distribution, enumerated with its cache-free forward passes; a reference
    at another temperature is rejected (the test can fail)."""
    target, _ = load_model(small_target, "float32", "cpu", quantization="q8_0")
    assert isinstance(target.model.layers[0].self_attn.qkv_proj, QuantLinear)

    def logits(contexts: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor(contexts)
        return target.compute_logits(target(ids)[:, -1]).float()  # type: ignore[no-any-return]

    llm = LLM(str(small_target), dtype="float32", device="cpu", quantization="q8_0", draft_model=str(small_draft),
              draft_quantization="q4_0", spec_length=3, spec_length_policy="fixed", max_batch_size=256, max_seq_len=32)
    sampling = [SamplingParams(max_tokens=4, ignore_eos=True, seed=i, temperature=1.0) for i in range(NUM_SAMPLES)]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, sampling)
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    assert samples.max() < V
    assert sum(o.metrics.proposed_tokens for o in outputs) > NUM_SAMPLES  # the draft model proposed
    assert_follows_reference(samples, reference_from(logits, PROMPT, SamplingParams(temperature=1.0)))
    hotter = reference_from(logits, PROMPT, SamplingParams(temperature=1.3))
    assert grouped_chisquare(samples, hotter).pvalue < P_CONTROL


# ------------------------------------------------------------------------------- the real file


@needs_real
def test_smollm2_q4_1_runs_quantized_and_speculation_is_exact() -> None:
    """The built-in SmolLM2-135M-Instruct Q4_1 file: every projection Q4_1 on the kernels, Q8_0
    embeddings with the tied head on the same blocks, weights resident once (their bytes are the
    file's tensor bytes), the decoder stack running every pass, and greedy n-gram speculation gives
    plain decoding's ids."""
    path = REAL_GGUF
    assert path is not None
    from infer.loader.gguf import open_gguf

    llm = LLM("smollm2-135m-instruct", device="cpu")
    model = llm.engine.model
    assert all(isinstance(m, QuantLinear) and m.qtypes == ["Q4_1"] for m in projections(model))
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and model.model.embed_tokens.weight.qtype == "Q8_0"
    assert model.lm_head.weights[0] is model.model.embed_tokens.weight
    from infer.models.quantized import weight_bytes

    quantized_bytes, float_bytes = weight_bytes(model)
    tensors = open_gguf(path).tensors.values()
    assert quantized_bytes == sum(int(t.n_bytes) for t in tensors if t.tensor_type.name in ("Q4_1", "Q8_0"))
    assert float_bytes < 2**20  # norms (and RoPE tables) only
    assert "MiB quantized (Q4_1 x210, Q8_0 x1" in llm.engine.summary
    # Every pass on the C decoder stack with the quantized kernels (where the float32 C kernels run).
    from infer import kernels

    if kernels.library_for(torch.float32) is not None:
        stack = model.backend.cpu_stack
        assert stack is not None and stack.quantized and stack.max_rows is None, model.backend.describe()
    params = SamplingParams(max_tokens=40, temperature=0)
    prompts = ["Write a Python function that reverses a string.", "List three colours of the rainbow."]
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    spec = LLM("smollm2-135m-instruct", device="cpu", speculator="ngram", spec_length=4, spec_length_policy="fixed")
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain
