"""Tests for infer.data (the stdlib corpus + BPE tokenizer) and the tiny test checkpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import (
    LLAMA3_ROPE_SCALING,
    make_tiny_checkpoint,
    shared_tokenizer,
    tokenizer_training_texts,
)
from infer.data.corpus import (
    Corpus,
    load_corpus,
    read_texts,
    split_files,
    stdlib_root,
    stdlib_source_files,
)
from infer.data.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    train_bpe_tokenizer,
)

ROUNDTRIP_TEXTS = [
    "def f(x):\n    if x:\n        return x * 2\n\treturn None\n",
    "  leading spaces and trailing   \n\n\n",
    "unicode: héllo wörld, 世界, emoji 🚀🐍, combining e\u0301, nbsp\u00a0here",
    "\r\nwindows\r\nnewlines\r\n",
    "",
    " ",
    "\x00\x01 control chars \x7f",
]

CHECKPOINT_FIXTURES = [
    "tiny_llama",
    "tiny_llama_tied",
    "tiny_llama_sharded",
    "tiny_qwen3",
    "tiny_qwen2",
    "tiny_draft",
]


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ROUNDTRIP_TEXTS)
def test_roundtrip(text: str) -> None:
    tok = shared_tokenizer()
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_roundtrip_stdlib_source() -> None:
    tok = shared_tokenizer()
    text = (stdlib_root() / "os.py").read_text(encoding="utf-8")
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    # The BPE actually compresses (not just bytes).
    assert len(ids) < 0.6 * len(text.encode())


def test_special_token_ids() -> None:
    tok = shared_tokenizer()
    expected = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    assert list(SPECIAL_TOKENS) == expected
    for i, s in enumerate(expected):
        assert tok.token_to_id(s) == i
        assert tok.id_to_token(i) == s
    assert tok.get_vocab_size() == 512
    # Special strings inside text map to their single ids; encode adds no BOS/EOS.
    assert tok.encode("<|im_start|>user").ids[0] == 3
    assert tok.encode("hello").ids[0] != 0
    assert 0 not in tok.encode("hello world").ids


def test_vocab_size_and_speed() -> None:
    texts = tokenizer_training_texts() + read_texts(stdlib_source_files()[:40], max_chars=200_000)
    assert sum(map(len, texts)) > 250_000
    t0, c0 = time.perf_counter(), time.process_time()
    tok = train_bpe_tokenizer(texts, 512)
    # ~0.2 s. The smaller of wall and CPU time: CPU time is not inflated by other processes on a
    # loaded machine, wall time not by the trainer's worker threads on many cores; a real slowdown
    # inflates both.
    assert min(time.perf_counter() - t0, time.process_time() - c0) < 3.0
    assert tok.get_vocab_size() == 512
    tok2 = train_bpe_tokenizer(texts, 300)
    assert tok2.get_vocab_size() == 300
    # Deterministic: same texts, same vocab.
    assert train_bpe_tokenizer(texts, 512).get_vocab() == tok.get_vocab()


def test_vocab_size_too_small() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["abc"], 100)


def test_saved_files(tmp_path: Path) -> None:
    train_bpe_tokenizer(tokenizer_training_texts(), 400, tmp_path, chat_template=None)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|begin_of_text|>"
    assert cfg["eos_token"] == "<|end_of_text|>"
    assert cfg["pad_token"] == "<|pad|>"
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "chat_template" not in cfg
    assert set(cfg["added_tokens_decoder"]) == {"0", "1", "2", "3", "4"}
    assert (tmp_path / "tokenizer.json").is_file()


def test_autotokenizer_and_chat_template(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok = shared_tokenizer()
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    text = ROUNDTRIP_TEXTS[0] + ROUNDTRIP_TEXTS[2]
    ids = hf(text)["input_ids"]
    assert ids == tok.encode(text).ids  # no BOS added by transformers either
    assert hf.decode(ids) == text

    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == DEFAULT_CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert isinstance(rendered, str) and isinstance(no_prompt, str)
    assert not no_prompt.endswith("assistant\n")
    chat_ids = tok.encode(rendered).ids
    assert chat_ids[0] == 3 and chat_ids.count(4) == 2


# ---------------------------------------------------------------- corpus


def test_stdlib_files_found_and_tests_excluded() -> None:
    files = stdlib_source_files()
    root = stdlib_root()
    rels = {f.relative_to(root).as_posix() for f in files}
    assert len(files) > 300
    assert files == sorted(files, key=lambda p: p.relative_to(root).as_posix())
    assert {"os.py", "json/decoder.py", "collections/__init__.py"} <= rels
    for rel in rels:
        parts = rel.split("/")[:-1]
        assert not any(p.startswith("test") or p in {"tests", "idle_test", "site-packages"} for p in parts), (
            rel
        )
    assert "unittest/case.py" in rels  # "unittest" is not a test directory
    assert stdlib_source_files() == files


def test_split_deterministic_and_disjoint() -> None:
    files = stdlib_source_files()
    train, held = split_files(files, 0.05)
    assert (train, held) == split_files(list(files), 0.05)
    assert set(train).isdisjoint(held)
    assert set(train) | set(held) == set(files)
    assert 0.04 * len(files) <= len(held) <= 0.06 * len(files) + 1
    # A different seed gives a different split; the split does not depend on input order.
    assert split_files(files, 0.05, seed=1)[1] != held
    assert set(split_files(list(reversed(files)), 0.05)[1]) == set(held)
    # Tiny inputs still get one held-out file, never all of them.
    assert [len(x) for x in split_files(files[:3], 0.05)] == [2, 1]
    assert split_files(files[:1], 0.5) == (files[:1], [])
    with pytest.raises(ValueError):
        split_files(files, 1.0)


def test_read_texts_max_chars() -> None:
    files = stdlib_source_files()[:10]
    texts = read_texts(files, max_chars=10_000)
    assert sum(map(len, texts)) == 10_000
    assert read_texts(files[:2]) == [f.read_text(encoding="utf-8") for f in files[:2]]


def test_load_corpus_default() -> None:
    corpus = load_corpus()
    assert isinstance(corpus, Corpus)
    assert "stdlib" in corpus.source
    assert len(corpus.train_texts) > 10 * len(corpus.heldout_texts) > 0
    assert corpus.train_chars > 1_000_000


def test_load_corpus_paths(tmp_path: Path) -> None:
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    for i in range(10):
        (d / f"f{i}.py").write_text(f"x = {i}\n")
    (d / "sub" / "notes.md").write_text("# notes\n")
    (d / "sub" / "a.txt").write_text("plain text\n")
    (d / "ignored.bin").write_bytes(b"\xff\xfe")
    (d / "bad.txt").write_bytes(b"\xff\xfe not utf8")
    corpus = load_corpus([str(d)], held_out_fraction=0.2)
    all_texts = corpus.train_texts + corpus.heldout_texts
    assert len(all_texts) == 12
    assert "# notes\n" in all_texts and "plain text\n" in all_texts
    assert len(corpus.heldout_texts) == 3
    assert str(d) in corpus.source

    single = d / "single.txt"
    single.write_text("".join(f"line {i}\n" for i in range(100)))
    c1 = load_corpus([str(single)], held_out_fraction=0.1)
    assert "".join(c1.train_texts + c1.heldout_texts) == single.read_text()
    assert c1.heldout_texts and c1.heldout_texts[0].startswith("line 9")


def test_load_corpus_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_corpus([str(missing)])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_corpus([str(empty)])
    blank = tmp_path / "blank.txt"
    blank.write_text("")
    with pytest.raises(ValueError, match="blank"):
        load_corpus([str(blank)])


# ---------------------------------------------------------------- tiny checkpoints


@pytest.mark.parametrize("fixture", CHECKPOINT_FIXTURES)
def test_checkpoint_loads_in_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    path: Path = request.getfixturevalue(fixture)
    assert (path / "config.json").is_file()
    assert (path / "generation_config.json").is_file()
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    if fixture == "tiny_llama_sharded":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2
    else:
        assert (path / "model.safetensors").is_file()
    cfg = json.loads((path / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32
    vocab = cfg["vocab_size"]
    text = "def main():\n    return 'héllo'\n"
    ids = torch.tensor([shared_tokenizer().encode(text).ids])
    # The generic fast class always reproduces tokenizer.json exactly.
    fast = PreTrainedTokenizerFast.from_pretrained(path)
    assert vocab == 512 == len(fast)
    assert fast(text)["input_ids"] == ids[0].tolist()
    if cfg["model_type"] != "qwen2":
        # transformers 5 forces Qwen2Tokenizer (own regex, NFC, extra <|endoftext|>) for
        # model_type qwen2 whatever tokenizer_config.json says; other archs honour it.
        assert AutoTokenizer.from_pretrained(path)(text)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], vocab)
    assert torch.isfinite(logits).all()


def test_checkpoint_configs(
    tiny_llama: Path, tiny_llama_tied: Path, tiny_qwen3: Path, tiny_qwen2: Path
) -> None:
    llama = json.loads((tiny_llama / "config.json").read_text())
    assert llama["rope_scaling"]["rope_type"] == "llama3" and llama["rope_theta"] == 500000.0
    assert llama["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(str(tiny_llama / "model.safetensors"))
    assert json.loads((tiny_llama_tied / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(str(tiny_llama_tied / "model.safetensors"))
    q3 = json.loads((tiny_qwen3 / "config.json").read_text())
    assert q3["model_type"] == "qwen3" and q3["head_dim"] == 16
    assert json.loads((tiny_qwen3 / "generation_config.json").read_text())["eos_token_id"] == [4, 1]
    q2 = load_file(str(tiny_qwen2 / "model.safetensors"))
    bias = q2["model.layers.0.self_attn.q_proj.bias"]
    assert bias.abs().max() > 0  # biases are random, so a loader that drops them is caught
    assert json.loads((tiny_qwen2 / "generation_config.json").read_text())["eos_token_id"] == 1


def test_checkpoint_deterministic(tmp_path: Path, tiny_qwen2: Path) -> None:
    again = make_tiny_checkpoint(tmp_path / "again", "qwen2", seed=3)
    a = load_file(str(tiny_qwen2 / "model.safetensors"))
    b = load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_legacy_and_v5_config_layouts_agree(tmp_path: Path) -> None:
    """transformers reads both config layouts identically, and rope scaling really changes the model."""
    from transformers import AutoModelForCausalLM

    legacy = make_tiny_checkpoint(tmp_path / "legacy", rope_scaling=LLAMA3_ROPE_SCALING)
    v5 = make_tiny_checkpoint(tmp_path / "v5", rope_scaling=LLAMA3_ROPE_SCALING, config_format="v5")
    plain = make_tiny_checkpoint(tmp_path / "plain")
    assert "rope_parameters" in json.loads((v5 / "config.json").read_text())
    ids = torch.tensor([shared_tokenizer().encode((stdlib_root() / "os.py").read_text()[:2000]).ids[:200]])
    with torch.no_grad():
        out = [AutoModelForCausalLM.from_pretrained(p)(ids).logits for p in (legacy, v5, plain)]
    torch.testing.assert_close(out[0], out[1])
    assert not torch.allclose(out[0], out[2], atol=1e-3)


@pytest.mark.parametrize("fixture", CHECKPOINT_FIXTURES)
def test_checkpoint_not_degenerate(fixture: str, request: pytest.FixtureRequest) -> None:
    """Next-token distributions are neither uniform nor one-hot, and greedy decoding varies."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture))
    tok = shared_tokenizer()
    src = (stdlib_root() / "os.py").read_text()
    prompts = [src[i * 3000 : i * 3000 + 300] for i in range(4)]
    with torch.no_grad():
        maxp = torch.cat(
            [model(torch.tensor([tok.encode(p).ids[:64]])).logits.softmax(-1).amax(-1)[0] for p in prompts]
        )
    assert 0.05 < maxp.median().item() < 0.9
    assert maxp.min().item() > 2.0 / 512
    distinct = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p).ids[:32]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=2)
        distinct.append(len(set(out[0, ids.shape[1] :].tolist())))
    assert max(distinct) >= 8, distinct
