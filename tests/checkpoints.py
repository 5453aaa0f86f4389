"""Tiny random Hugging Face checkpoints for tests (built with transformers, saved as safetensors).

The models are random but initialised so their next-token distributions are neither
near-uniform nor one-hot, which makes greedy/sampling comparisons against transformers
meaningful. Norm weights and biases are perturbed away from their 1/0 defaults so a loader
that silently drops them produces visibly different logits.

transformers 5 quirk: for a folder whose config.json says model_type "qwen2",
`AutoTokenizer.from_pretrained` ignores tokenizer_config.json's tokenizer_class and builds a
Qwen2Tokenizer (its own pre-tokenizer regex, NFC normaliser, an extra <|endoftext|> token),
so ids differ from tokenizer.json. Use `tokenizers.Tokenizer.from_file(dir / "tokenizer.json")`
or `transformers.PreTrainedTokenizerFast.from_pretrained(dir)` to get the exact tokenizer.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from tokenizers import Tokenizer

from infer.data.corpus import read_texts, stdlib_root, stdlib_source_files
from infer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, save_tokenizer, train_bpe_tokenizer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

Arch = Literal["llama", "qwen3", "qwen2"]
ConfigFormat = Literal["legacy", "v5"]

DEFAULT_VOCAB_SIZE = 512

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# Real-model-like rope bases; non-default so a loader that ignores rope_theta fails tests.
_DEFAULT_ROPE_THETA: dict[str, float] = {"llama": 500000.0, "qwen3": 1000000.0, "qwen2": 1000000.0}

# Fixed, modest tokenizer-training text: a handful of stdlib modules (code + English docstrings).
_TOKENIZER_MODULES: tuple[str, ...] = (
    "textwrap.py",
    "argparse.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "dataclasses.py",
    "functools.py",
    "string.py",
    "random.py",
    "heapq.py",
)
_TOKENIZER_MAX_CHARS = 200_000

# Init scales chosen empirically (see test_train_tokenizer.py::test_checkpoint_not_degenerate):
# with transformers' default std 0.02 the logits are nearly uniform over 512 tokens.
_EMBED_STD = 1.0
_LM_HEAD_STD = 0.35
_TIED_EMBED_STD = 0.03
_LINEAR_GAIN = 1.0  # times 1/sqrt(fan_in)
_NORM_JITTER = 0.1
_BIAS_STD = 0.1


def tokenizer_training_texts() -> list[str]:
    """The fixed texts the shared test tokenizer is trained on (~200 KB of stdlib source)."""
    root = stdlib_root()
    files = [root / m for m in _TOKENIZER_MODULES if (root / m).is_file()]
    if not files:  # unusual Python layout: fall back to the first stdlib files
        files = stdlib_source_files()[:20]
    return read_texts(files, max_chars=_TOKENIZER_MAX_CHARS)


@functools.lru_cache(maxsize=4)
def shared_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE tokenizer trained once per process (per vocab size) and reused."""
    return train_bpe_tokenizer(tokenizer_training_texts(), vocab_size)


def _build_config(
    arch: Arch,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    rope_scaling: dict[str, Any] | None,
    rope_theta: float,
    head_dim: int | None,
    eos_token_id: int | list[int],
) -> Any:
    import transformers

    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope_parameters = {**rope_scaling, "rope_theta": rope_theta}
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        # transformers 5 folds rope_theta + rope_scaling into a single rope_parameters dict.
        rope_parameters=rope_parameters,
        bos_token_id=BOS_ID,
        eos_token_id=eos_token_id,
        pad_token_id=PAD_ID,
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, head_dim=head_dim or hidden_size // num_heads)
    if arch == "qwen3":
        # Qwen3 decouples head_dim from hidden_size / num_heads; keep that visible here.
        return transformers.Qwen3Config(**common, head_dim=head_dim or 16)
    if arch == "qwen2":
        if head_dim is not None and head_dim != hidden_size // num_heads:
            raise ValueError("qwen2 has no head_dim setting: head_dim = hidden_size // num_heads")
        return transformers.Qwen2Config(**common)
    raise ValueError(f"unknown arch {arch!r}; expected one of llama, qwen3, qwen2")


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic, non-degenerate init from `seed`, independent of transformers' own init."""
    gen = torch.Generator().manual_seed(seed)
    tied = getattr(model.config, "tie_word_embeddings", False)
    # A tied matrix also scores every token against the current token's own embedding (the
    # residual stream still carries it); with large tied embeddings greedy decoding fell into
    # one-token loops. Small tied embeddings fix that but give flat logits, so the final
    # norm's weight (about 12 here) scales them back up to the untied logit scale.
    embed_std = _TIED_EMBED_STD if tied else _EMBED_STD
    final_norm_scale = _LM_HEAD_STD / _TIED_EMBED_STD if tied else 1.0
    # named_parameters() deduplicates tied weights, so a tied lm_head is initialised once
    # (as the embedding) and stays tied.
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=gen) * embed_std)
        elif name.startswith("lm_head"):
            p.copy_(torch.randn(p.shape, generator=gen) * _LM_HEAD_STD)
        elif name.endswith("norm.weight"):
            scale = final_norm_scale if name == "model.norm.weight" else 1.0
            p.copy_(scale * (1.0 + torch.randn(p.shape, generator=gen) * _NORM_JITTER))
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * _BIAS_STD)
        elif p.dim() == 2:
            fan_in = p.shape[1]
            p.copy_(torch.randn(p.shape, generator=gen) * (_LINEAR_GAIN / math.sqrt(fan_in)))
        else:
            raise ValueError(f"no init rule for parameter {name} {tuple(p.shape)}")


def _to_legacy_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers-5 config.json into the 4.x layout that real Hub checkpoints use.

    (`rope_theta` + `rope_scaling` at top level instead of `rope_parameters`; `torch_dtype`
    instead of `dtype`.) transformers 5 still reads this layout.
    """
    out = dict(cfg)
    rp = dict(out.pop("rope_parameters", None) or {})
    if rp:
        out["rope_theta"] = rp.pop("rope_theta", 10000.0)
        out["rope_scaling"] = None if rp.get("rope_type", "default") == "default" and len(rp) <= 1 else rp
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    return out


def make_tiny_checkpoint(
    out_dir: str | Path,
    arch: Arch = "llama",
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    head_dim: int | None = None,
    seed: int = 0,
    eos_token_id: int | Sequence[int] = EOS_ID,
    tokenizer: Tokenizer | None = None,
    sharded: bool = False,
    config_format: ConfigFormat = "legacy",
) -> Path:
    """Build a tiny random float32 `arch` model with transformers and save it as an HF checkpoint.

    Writes config.json, generation_config.json, model.safetensors (or, with ``sharded``,
    several shards + model.safetensors.index.json), tokenizer.json and tokenizer_config.json.
    The model vocab equals the tokenizer's (``vocab_size`` picks the shared tokenizer's size
    when no tokenizer is given). ``config_format="legacy"`` rewrites config.json into the
    transformers-4 layout used by real Hub checkpoints; "v5" keeps transformers 5's layout.
    """
    import transformers
    from transformers.utils import logging as hf_logging

    if tokenizer is None:
        tokenizer = shared_tokenizer(vocab_size or DEFAULT_VOCAB_SIZE)
    tok_vocab = tokenizer.get_vocab_size()
    if vocab_size is not None and vocab_size != tok_vocab:
        raise ValueError(f"vocab_size={vocab_size} but the tokenizer has {tok_vocab} tokens")
    eos: int | list[int] = eos_token_id if isinstance(eos_token_id, int) else list(eos_token_id)

    config = _build_config(
        arch,
        vocab_size=tok_vocab,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        rope_theta=rope_theta if rope_theta is not None else _DEFAULT_ROPE_THETA[arch],
        head_dim=head_dim,
        eos_token_id=eos,
    )
    # fork_rng: seeding must not leak into the global RNG state other tests depend on.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=eos, pad_token_id=PAD_ID
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # transformers 5 always writes safetensors (no safe_serialization flag any more).
    # Shard size is picked so a default-sized model splits into several shards.
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, max_shard_size="200KB" if sharded else "50GB")
    finally:
        hf_logging.enable_progress_bar()
    if config_format == "legacy":
        cfg_path = out / "config.json"
        cfg = _to_legacy_config(json.loads(cfg_path.read_text()))
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    elif config_format != "v5":
        raise ValueError(f"config_format must be 'legacy' or 'v5', got {config_format!r}")
    save_tokenizer(tokenizer, out, model_max_length=max_position_embeddings)
    return out


# ---------------------------------------------------------------------------------------------
# Small-vocabulary checkpoints (for exact distribution tests, where P over V^2 must be enumerable)


def small_vocab_tokenizer(vocab_size: int) -> Tokenizer:
    """A WordLevel tokenizer with exactly ``vocab_size`` tokens: the 5 specials, then words w0, w1, ...

    Ids 0..4 are the shared specials (BOS, EOS, PAD, im_start, im_end), so ``save_tokenizer`` and
    the engine's EOS handling work as with the BPE tokenizer; words are split on whitespace.
    """
    from tokenizers import decoders, models, pre_tokenizers

    from infer.data.tokenizer import SPECIAL_TOKENS

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be > {len(SPECIAL_TOKENS)} (the special tokens), got {vocab_size}")
    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[2]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != vocab_size:  # guard against a tokenizers behaviour change
        raise RuntimeError(f"small tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def make_small_vocab_checkpoint(
    out_dir: str | Path,
    vocab_size: int,
    *,
    num_layers: int = 2,
    hidden_size: int = 32,
    seed: int = 0,
    logit_scale: float = 1.0,
) -> Path:
    """A tiny llama over :func:`small_vocab_tokenizer` (``vocab_size`` tokens).

    ``logit_scale`` multiplies ``lm_head.weight`` after the usual init, to make the next-token
    distributions flatter (< 1) or more peaked (> 1).
    """
    from safetensors.torch import load_file, save_file

    out = make_tiny_checkpoint(
        out_dir, "llama", hidden_size=hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        intermediate_size=2 * hidden_size, seed=seed, tokenizer=small_vocab_tokenizer(vocab_size),
    )
    if logit_scale != 1.0:
        path = out / "model.safetensors"
        tensors = load_file(path)
        tensors["lm_head.weight"] = (tensors["lm_head.weight"] * logit_scale).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def make_medusa_heads(target: Path, out: Path, *, num_heads: int = 3, tree_size: int = 32, top_k: int = 4,
                      seed: int = 0, jitter: float = 0.05) -> Path:
    """Untrained heads for ``target`` (residual blocks perturbed so the heads differ), saved to ``out``."""
    from infer.loader import load_model
    from infer.models.medusa_heads import MedusaHeads

    model, _ = load_model(target, "float32", "cpu", pack=False)  # unpacked: the heads copy its LM head
    heads = MedusaHeads.from_target(model.lm_head.weight.detach().clone(), num_heads, tree_size=tree_size,
                                    top_k=top_k)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in heads.named_parameters():
            if ".blocks." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * jitter)
    return heads.save(out)


def load_hf_model(path: Path) -> torch.nn.Module:
    """The checkpoint at ``path`` as transformers loads it (float32, eval mode): the reference the
    engine is compared against."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        hf_logging.enable_progress_bar()
    return model.eval()


# A module's transformers references, loaded once per checkpoint (parity tests compare several passes).
cached_hf_model = functools.lru_cache(maxsize=4)(load_hf_model)


@functools.lru_cache(maxsize=32)
def hf_greedy(path: Path, prompt: tuple[int, ...], new_tokens: int, pad_token_id: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` by the checkpoint at ``path``: exactly
    ``new_tokens`` tokens (``min_new_tokens`` masks EOS, so a caller compares up to the engine's EOS)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = cached_hf_model(path).generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                             pad_token_id=pad_token_id)
    return out[0, len(prompt):].tolist()  # type: ignore[no-any-return]


def assert_greedy_matches_hf(llm: Any, path: Path, prompts: list[str], new_tokens: int, pad_token_id: int,
                             past: int = 0) -> list[Any]:
    """``llm``'s greedy outputs for ``prompts`` equal transformers' (``hf_greedy``) up to the engine's
    first EOS, which comes after at least half of them, and are not degenerate; each prompt with its
    continuation longer than ``past`` tokens (a sliding window's span, say). Returns the outputs."""
    from infer import SamplingParams

    encoded = [llm.tokenizer.encode(t) for t in prompts]
    outputs = llm.generate(encoded, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    eos = set(llm.engine.tokenizer.eos_token_ids)
    for prompt, out in zip(encoded, outputs, strict=True):
        assert len(prompt) + new_tokens > past
        cut = next((i for i, t in enumerate(out.token_ids) if t in eos), new_tokens)
        assert cut > new_tokens // 2
        assert out.token_ids[:cut] == hf_greedy(path, tuple(prompt), new_tokens, pad_token_id)[:cut]
        assert len(set(out.token_ids)) > 4
    return outputs


def random_ids(n: int, seed: int) -> torch.Tensor:
    """[1, n] token ids in 5..511 (past the tiny tokenizer's special tokens), reproducible by ``seed``."""
    return torch.randint(5, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def make_eagle3_head(target: Path, out: Path, *, draft_vocab: list[int] | None = None, seed: int = 0,
                     hidden_size: int | None = None, own_embeddings: bool = False,
                     aux_layers: list[int] | None = None, std: float = 0.2) -> Path:
    """A random EAGLE-3 head for ``target`` written the way published heads are (vLLM/SGLang's layout,
    written here by hand, not by infer's saver): a one-layer Llama ``config.json`` with ``draft_vocab_size``
    and ``model.safetensors`` with ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` and ``t2d``.
    ``draft_vocab``: the target ids the draft vocabulary keeps (default all)."""
    import json

    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    vocab, target_hidden = cfg["vocab_size"], cfg["hidden_size"]
    hidden = hidden_size or target_hidden
    heads, kv_heads = 4, 2
    head_dim = hidden // heads
    inter = 2 * hidden
    ids = torch.tensor(draft_vocab if draft_vocab is not None else list(range(vocab)), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).contiguous()

    tensors = {
        "fc.weight": rand(hidden, 3 * target_hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "midlayer.input_layernorm.weight": 1 + rand(hidden),
        "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(len(ids), hidden) * 5,
        "d2t": (ids - torch.arange(len(ids))).contiguous(),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if own_embeddings:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
              "draft_vocab_size": len(ids), "target_hidden_size": target_hidden, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
