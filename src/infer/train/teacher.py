"""The teacher cache: a target's next-token distributions, computed once, for training its drafters.

For a real target, running it is the expensive part of distilling a draft or training Medusa
heads: on 2 CPU cores SmolLM2-135M's forward pass costs several times the whole training step of
a small draft, and live distillation repeats it every step. ``build_teacher_cache`` runs the target
once over token windows and stores at every position the top-k token ids with their log-probs,
the log-probability of all other tokens together, and optionally the final hidden states (which
Medusa heads read). Training then only reads the cache (``TeacherCache``), as often as it likes.

Where the text comes from (``source``):

* ``self`` (the default for a model infer did not train): the target's own answers to varied
  instructions (``infer.train.prompts``), written with its chat template when it has one. This is
  self-distillation as in Medusa-2: no corpus to find, and the text is the kind the drafter will
  be asked to continue. Only the answer positions are counted by the held-out metrics.
* ``corpus``: text files, by default the corpus the target was trained on (infer's own toy
  models: the standard library's Python source).

Layout of a cache folder (``~/.cache/infer/teacher/<model>-<hash>`` unless ``out`` is given)::

    teacher_cache.json        settings, the target's config and fingerprint, counts, timings (written last)
    generations.jsonl         source "self": {"prompt": ids, "output": ids} per prompt, appended as made
    train-00000.safetensors   per window: tokens [N, W] int32, answer [N, W] uint8 (position t predicts
    heldout-00000.safetensors   a generated token), topk_ids [N, W, k] int32, topk_logprobs [N, W, k]
                              float32, rest_logprob [N, W] float32, hidden [N, W, H] bfloat16 (optional)

An interrupted build continues where it stopped (finished shards and generations are kept when the
settings match). The losses below compare a drafter's full distribution q with the cached
coarsening of p: the top-k tokens plus one bucket for the rest, which is exact on the top-k and a
lower bound on the full KL.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from infer.fileio import default_cache_dir
from infer.loader import ModelConfig, load_config, load_model, load_tokenizer, resolve_model_path
from infer.loader.hub import model_slug
from infer.train.common import (
    configure_threads,
    pick_device,
    progress_bar,
    say,
    target_training_args,
    write_json,
)

MANIFEST_FILE = "teacher_cache.json"
BUILDING_FILE = "building.json"
GENERATIONS_FILE = "generations.jsonl"
CACHE_FORMAT = 1
SOURCES = ("auto", "self", "corpus")
SPLITS = ("train", "heldout")
GENERATION_CONTEXT = 2048  # longest prompt + answer generated for self-distillation


@dataclass
class TeacherCacheConfig:
    """Settings for ``build_teacher_cache``; ``target`` is any model reference the loader accepts."""

    target: str
    out: Path | None = None  # default: ~/.cache/infer/teacher/<model>-<settings hash>
    source: str = "auto"  # auto: "corpus" for a model infer trained, "self" for any other
    corpus: list[str] | None = None  # source "corpus": files/folders (default: the target's own corpus)
    max_train_chars: int | None = None
    num_prompts: int = 256  # source "self": instructions answered by the target
    max_new_tokens: int = 160  # source "self": longest answer
    gen_temperature: float = 0.7  # sampled answers vary more than greedy ones; 0 = greedy
    gen_top_p: float = 0.95
    gen_batch_size: int = 16
    gen_dtype: str = "auto"  # the answers only need to be plausible: the fastest dtype will do
    seq_len: int = 256  # tokens per cached window
    top_k: int = 32
    hidden_states: bool = True  # store the target's final hidden states (Medusa heads train on them)
    held_out_fraction: float = 0.05
    max_windows: int | None = 1024  # cap on training windows (a corpus can be much larger than needed)
    heldout_windows: int = 64  # cap on held-out windows
    batch_size: int = 4  # windows per target forward
    windows_per_shard: int = 64
    dtype: str = "float32"  # the target's dtype for the cached distributions
    seed: int = 0
    device: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        self.target = str(self.target)
        if self.out is not None:
            self.out = Path(self.out).expanduser()
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} is invalid: use one of {', '.join(SOURCES)}")
        for name in ("num_prompts", "max_new_tokens", "gen_batch_size", "seq_len", "top_k", "batch_size",
                     "windows_per_shard", "heldout_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"max_windows={self.max_windows} must be >= 1")
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction={self.held_out_fraction} must be in [0, 1)")
        if self.gen_temperature < 0 or not 0.0 < self.gen_top_p <= 1.0:
            raise ValueError(f"gen_temperature={self.gen_temperature} must be >= 0 and gen_top_p={self.gen_top_p} "
                             "in (0, 1]")

    def settings(self) -> dict[str, Any]:
        """What the cached numbers depend on (not where they go or how fast they are made)."""
        skip = {"out", "batch_size", "windows_per_shard", "device", "threads", "gen_batch_size"}
        return {k: v for k, v in asdict(self).items() if k not in skip}


def target_fingerprint(target: str) -> dict[str, Any]:
    """Which model file(s) the target is, cheaply: resolved path, and sizes and mtimes of its weights."""
    path = resolve_model_path(target)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return {"path": str(path.resolve()), "weights": stats}


def settings_hash(cfg: TeacherCacheConfig) -> str:
    raw = json.dumps({"settings": cfg.settings(), "target": target_fingerprint(cfg.target), "format": CACHE_FORMAT},
                     sort_keys=True, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def default_teacher_dir(cfg: TeacherCacheConfig) -> Path:
    return default_cache_dir() / "teacher" / f"{model_slug(cfg.target)}-{settings_hash(cfg)[:12]}"


def trained_by_infer(target: str) -> bool:
    """Whether ``infer train pretrain`` made this model (then its own corpus is the natural data)."""

    path = resolve_model_path(target)
    return path.is_dir() and target_training_args(path).get("kind") == "pretrain"


def trains_from_cache(teacher_cache: str | None, corpus: list[str] | None, target: str) -> bool:
    """Whether a drafter trains from a teacher cache: when one is named, and by default for a model
    infer did not train (a real checkpoint) unless a corpus is given to run it on live."""
    return teacher_cache is not None or (corpus is None and not trained_by_infer(target))


def resolve_source(cfg: TeacherCacheConfig) -> str:
    if cfg.source != "auto":
        return cfg.source
    return "corpus" if cfg.corpus is not None or trained_by_infer(cfg.target) else "self"


# ------------------------------------------------------------------------------------------- text


@dataclass
class Streams:
    """Train and held-out token streams, each with a flag per token: was it generated by the target."""

    tokens: dict[str, np.ndarray]
    generated: dict[str, np.ndarray]
    description: str
    stats: dict[str, Any] = field(default_factory=dict)


def _concat(sequences: list[tuple[list[int], list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of (prompt, answer) ids, one after another, with the answer tokens flagged."""
    tokens = [np.asarray(p + a, dtype=np.int64) for p, a in sequences]
    flags = [np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(a), np.uint8)]) for p, a in sequences]
    if not tokens:
        return np.zeros(0, np.int64), np.zeros(0, np.uint8)
    return np.concatenate(tokens), np.concatenate(flags)


def _split_sequences(sequences: list[tuple[list[int], list[int]]], fraction: float, width: int,
                     description: str) -> Streams:
    """The last sequences are held out: ``fraction`` of the tokens, and at least one window's worth
    when that leaves some sequences to train on."""
    sizes = [len(p) + len(a) for p, a in sequences]
    want = max(fraction * sum(sizes), width + 1) if fraction > 0 else 0
    held, total = 0, 0
    while held < len(sequences) - 1 and total < want:
        held += 1
        total += sizes[-held]
    train_tokens, train_flags = _concat(sequences[:len(sequences) - held])
    held_tokens, held_flags = _concat(sequences[len(sequences) - held:])
    return Streams({"train": train_tokens, "heldout": held_tokens},
                   {"train": train_flags, "heldout": held_flags}, description)


def self_generated(cfg: TeacherCacheConfig, folder: Path, progress: bool) -> Streams:
    """The target's answers to ``cfg.num_prompts`` varied instructions (resumed from generations.jsonl)."""
    from infer.engine.llm import LLM
    from infer.sampling.params import SamplingParams
    from infer.train.prompts import varied_prompts

    prompts = varied_prompts(cfg.num_prompts, cfg.seed)
    path = folder / GENERATIONS_FILE
    done: list[tuple[list[int], list[int]]] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                done.append((list(record["prompt"]), list(record["output"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a torn last line: regenerate from there
    tokenizer = load_tokenizer(cfg.target)
    chat = bool(tokenizer.chat_template)
    encoded = [tokenizer.encode_chat([{"role": "user", "content": p}]) if chat else tokenizer.encode(p + "\n")
               for p in prompts]
    # A prompt the model's context cannot hold with room for an answer is left out (a small model's).
    context = min(GENERATION_CONTEXT, load_config(cfg.target).max_position_embeddings)
    encoded = [ids for ids in encoded if len(ids) + cfg.max_new_tokens <= context]
    done = done[:len(encoded)]
    stats: dict[str, Any] = {"prompts": len(prompts), "too_long": len(prompts) - len(encoded), "reused": len(done),
                             "chat_template": chat}
    if len(done) < len(encoded):
        llm = LLM(cfg.target, dtype=cfg.gen_dtype, device=cfg.device, max_batch_size=cfg.gen_batch_size,
                  max_seq_len=context)
        say(f"self-distillation data: {len(encoded) - len(done)} answers of up to {cfg.max_new_tokens} tokens "
            f"from {cfg.target} ({llm.engine.dtype}, batch {cfg.gen_batch_size}, "
            f"{'its chat template' if chat else 'plain prompts: no chat template'})", progress)
        budget = (len(encoded) - len(done)) * cfg.max_new_tokens
        bar = progress_bar(total=budget, desc="generate", unit="tok", disable=not progress, dynamic_ncols=True)
        start, made = time.perf_counter(), 0
        with open(path, "a") as handle:
            chunk = 2 * cfg.gen_batch_size
            while len(done) < len(encoded):
                ids = list(range(len(done), min(len(encoded), len(done) + chunk)))
                params = [SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.gen_temperature,
                                         top_p=cfg.gen_top_p, seed=cfg.seed * 1_000_003 + i) for i in ids]
                outputs = llm.generate([encoded[i] for i in ids], params,
                                       on_token=lambda _r, new: bar.update(len(new)))
                for i, out in zip(ids, outputs, strict=True):
                    done.append((encoded[i], list(out.token_ids)))
                    handle.write(json.dumps({"prompt": encoded[i], "output": list(out.token_ids)}) + "\n")
                    bar.total -= cfg.max_new_tokens - len(out.token_ids)  # an early EOS shortens the run
                    made += len(out.token_ids)
                handle.flush()
                bar.refresh()
        bar.close()
        seconds = time.perf_counter() - start
        stats.update({"generated_tokens": made, "generation_s": round(seconds, 1),
                      "generation_tokens_per_s": round(made / max(seconds, 1e-9), 1)})
        del llm
    streams = _split_sequences(done, cfg.held_out_fraction, cfg.seq_len,
                               f"self-distillation: {cfg.target}'s answers to {len(done)} varied prompts")
    streams.stats = stats
    return streams


def corpus_text(cfg: TeacherCacheConfig) -> Streams:
    """Token streams of a text corpus (the target's own by default), every token a training token."""
    from tokenizers import Tokenizer as HFTokenizer

    from infer.data.corpus import load_corpus
    from infer.train.data import tokenize_corpus

    folder = resolve_model_path(cfg.target)
    targs = target_training_args(folder) if folder.is_dir() else {}
    corpus = load_corpus(cfg.corpus if cfg.corpus is not None else targs.get("corpus"),
                         held_out_fraction=targs.get("held_out_fraction", cfg.held_out_fraction))
    tokenizer = load_tokenizer(cfg.target)
    backend: HFTokenizer = tokenizer.backend
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
    max_chars = cfg.max_train_chars if cfg.max_train_chars is not None else targs.get("max_train_chars")
    data = tokenize_corpus(backend, corpus, eos, max_train_chars=max_chars, seed=int(targs.get("seed", cfg.seed)))
    tokens = {"train": data.train.astype(np.int64), "heldout": data.heldout.astype(np.int64)}
    return Streams(tokens, {k: np.ones_like(v, dtype=np.uint8) for k, v in tokens.items()}, corpus.source)


# ------------------------------------------------------------------------------------------ build


def _windows(tokens: np.ndarray, generated: np.ndarray, width: int,
             limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive windows [N, W] and their answer flags: position t predicts a generated token."""
    count = len(tokens) // width
    if limit is not None:
        count = min(count, limit)
    ids = torch.from_numpy(tokens[:count * width].astype(np.int64)).view(count, width)
    following = np.append(generated[1:], 0)[:count * width]
    return ids, torch.from_numpy(following.astype(np.uint8)).view(count, width)


@torch.inference_mode()
def teacher_outputs(model: Any, ids: torch.Tensor, top_k: int, hidden_states: bool) -> dict[str, torch.Tensor]:
    """The target on windows ``ids`` [B, W]: top-k ids / log-probs, the rest's log-prob, final hidden states."""
    hidden = model(ids)
    logprobs = F.log_softmax(model.compute_logits(hidden).float(), dim=-1)
    top = logprobs.topk(top_k, dim=-1)
    rest = logprobs.scatter(-1, top.indices, float("-inf")).logsumexp(-1)
    out = {"topk_ids": top.indices.to(torch.int32), "topk_logprobs": top.values.contiguous(), "rest_logprob": rest}
    if hidden_states:
        out["hidden"] = hidden.to(torch.bfloat16)
    return out


def _shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def build_teacher_cache(cfg: TeacherCacheConfig, progress: bool = True, force: bool = False) -> Path:
    """Build (or find complete, or continue) the cache for ``cfg`` and return its folder."""
    from safetensors.torch import save_file

    digest = settings_hash(cfg)
    folder = cfg.out if cfg.out is not None else default_teacher_dir(cfg)
    manifest = read_manifest(folder)
    if not force and manifest.get("settings_hash") == digest:
        say(f"teacher cache for {cfg.target} found at {folder}", progress)
        return folder
    building = folder / BUILDING_FILE
    previous = read_manifest(folder, BUILDING_FILE)
    if force or manifest or (previous and previous.get("settings_hash") != digest):
        for stale in (*folder.glob("*.safetensors"), folder / GENERATIONS_FILE, folder / MANIFEST_FILE):
            stale.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(building, {"settings_hash": digest, "settings": cfg.settings()})
    wall_start = time.perf_counter()
    device = pick_device(cfg.device)
    configure_threads(device, cfg.threads)
    source = resolve_source(cfg)
    streams = self_generated(cfg, folder, progress) if source == "self" else corpus_text(cfg)

    model, mcfg = load_model(cfg.target, dtype=cfg.dtype, device=str(device))
    if cfg.top_k >= mcfg.vocab_size:  # the rest bucket must hold some tokens
        raise ValueError(f"top_k={cfg.top_k} must be below the target's vocabulary size ({mcfg.vocab_size})")
    width = min(cfg.seq_len, mcfg.max_position_embeddings)
    windows = {}
    for split in SPLITS:
        limit = cfg.max_windows if split == "train" else cfg.heldout_windows
        windows[split] = _windows(streams.tokens[split], streams.generated[split], width, limit)
    if windows["train"][0].shape[0] == 0:
        raise ValueError(f"the text ({streams.description}) gives no full window of {width} tokens")
    total = sum(int(w[0].shape[0]) for w in windows.values())
    say(f"teacher cache: {total} windows of {width} tokens from {streams.description}; top-{cfg.top_k} of "
        f"{mcfg.vocab_size} tokens{' + hidden states' if cfg.hidden_states else ''}, {cfg.dtype} on {device}, "
        f"into {folder}", progress)
    bar = progress_bar(total=total * width, desc="teacher", unit="tok", disable=not progress, dynamic_ncols=True)
    forward_start, computed = time.perf_counter(), 0
    shards: dict[str, list[str]] = {}
    for split, (ids, answer) in windows.items():
        shards[split] = []
        for index, first in enumerate(range(0, ids.shape[0], cfg.windows_per_shard)):
            name = _shard_name(split, index)
            shards[split].append(name)
            chunk = slice(first, first + cfg.windows_per_shard)
            if (folder / name).is_file():  # made by an interrupted build with these settings
                bar.update(ids[chunk].numel())
                continue
            parts: list[dict[str, torch.Tensor]] = []
            for start in range(first, min(first + cfg.windows_per_shard, ids.shape[0]), cfg.batch_size):
                batch = ids[start:min(start + cfg.batch_size, first + cfg.windows_per_shard)]
                parts.append({k: v.cpu() for k, v in teacher_outputs(model, batch.to(device), cfg.top_k,
                                                                     cfg.hidden_states).items()})
                bar.update(batch.numel())
                computed += batch.numel()
            tensors = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
            tensors["tokens"] = ids[chunk].to(torch.int32).contiguous()
            tensors["answer"] = answer[chunk].contiguous()
            tmp = folder / f".{name}.{os.getpid()}.tmp"
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, folder / name)
    bar.close()
    forward_s = time.perf_counter() - forward_start
    summary = {
        "format": CACHE_FORMAT, "settings_hash": digest, "settings": cfg.settings(), "source": source,
        "description": streams.description, "target": target_fingerprint(cfg.target),
        "target_config": mcfg.to_hf_dict(), "eos_token_ids": list(mcfg.eos_token_ids), "seq_len": width,
        "top_k": cfg.top_k, "hidden_states": cfg.hidden_states, "shards": shards,
        "windows": {split: int(w[0].shape[0]) for split, w in windows.items()},
        "answer_tokens": {split: int(w[1].sum()) for split, w in windows.items()},
        "source_stats": streams.stats, "forward_s": round(forward_s, 1),
        "forward_tokens_per_s": round(computed / max(forward_s, 1e-9), 1) if computed else None,
        "wall_time_s": round(time.perf_counter() - wall_start, 1), "device": str(device),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    }
    write_json(folder / MANIFEST_FILE, summary)
    building.unlink(missing_ok=True)
    counts = {split: int(w[0].shape[0]) for split, w in windows.items()}
    say(f"teacher cache ready: {counts['train']} train / {counts['heldout']} held-out windows in "
        f"{time.perf_counter() - wall_start:.0f}s", progress)
    return folder


def read_manifest(folder: Path, name: str = MANIFEST_FILE) -> dict[str, Any]:
    try:
        raw = json.loads((folder / name).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


# ------------------------------------------------------------------------------------------- read


@dataclass
class TeacherBatch:
    tokens: torch.Tensor  # [B, W] int64
    answer: torch.Tensor  # [B, W] bool: position t predicts a generated token
    topk_ids: torch.Tensor  # [B, W, k] int64
    topk_logprobs: torch.Tensor  # [B, W, k] float32
    rest_logprob: torch.Tensor  # [B, W] float32
    hidden: torch.Tensor | None  # [B, W, H] float32

    def to(self, device: torch.device) -> TeacherBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return TeacherBatch(move(self.tokens), move(self.answer), move(self.topk_ids), move(self.topk_logprobs),
                            move(self.rest_logprob), None if self.hidden is None else move(self.hidden))


@dataclass
class TeacherWindows:
    """One split of the cache in memory."""

    tensors: dict[str, torch.Tensor]

    @property
    def num_windows(self) -> int:
        return int(self.tensors["tokens"].shape[0]) if self.tensors else 0

    def batch(self, index: torch.Tensor | slice) -> TeacherBatch:
        t = self.tensors
        hidden = t.get("hidden")
        return TeacherBatch(tokens=t["tokens"][index].long(), answer=t["answer"][index].bool(),
                            topk_ids=t["topk_ids"][index].long(), topk_logprobs=t["topk_logprobs"][index].float(),
                            rest_logprob=t["rest_logprob"][index].float(),
                            hidden=None if hidden is None else hidden[index].float())

    def batches(self, size: int, limit: int | None = None) -> Iterator[TeacherBatch]:
        count = self.num_windows if limit is None else min(limit, self.num_windows)
        for start in range(0, count, size):
            yield self.batch(slice(start, min(start + size, count)))


class TeacherCache:
    """A complete cache folder, read into memory (``hidden`` only when asked for)."""

    def __init__(self, folder: Path, hidden: bool = False) -> None:
        from safetensors.torch import load_file

        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        if not self.manifest:
            raise FileNotFoundError(f"{self.folder}: no complete teacher cache ({MANIFEST_FILE} missing); build "
                                    "it with `infer train cache --target MODEL --out DIR`")
        if hidden and not self.manifest.get("hidden_states"):
            raise ValueError(f"{self.folder}: this teacher cache has no hidden states (Medusa heads need them); "
                             "rebuild it with hidden states")
        self.splits: dict[str, TeacherWindows] = {}
        for split in SPLITS:
            parts = [load_file(str(self.folder / name)) for name in self.manifest["shards"].get(split, [])]
            keys = [k for k in (parts[0] if parts else {}) if hidden or k != "hidden"]
            self.splits[split] = TeacherWindows({k: torch.cat([p[k] for p in parts]) for k in keys})
        self.target_config = ModelConfig.from_dict(self.manifest["target_config"], str(self.folder / MANIFEST_FILE))

    @property
    def train(self) -> TeacherWindows:
        return self.splits["train"]

    @property
    def heldout(self) -> TeacherWindows:
        """Held-out windows, or the training ones when the cache has none."""
        return self.splits["heldout"] if self.splits["heldout"].num_windows else self.splits["train"]

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])


class CacheSampler:
    """Random batches of window indices (seeded; its state goes into training checkpoints)."""

    def __init__(self, num_windows: int, batch_size: int, seed: int) -> None:
        if num_windows < 1:
            raise ValueError("the teacher cache holds no training windows")
        self.num_windows, self.batch_size = num_windows, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self) -> torch.Tensor:
        return torch.randint(0, self.num_windows, (self.batch_size,), generator=self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


# ----------------------------------------------------------------------------------------- losses


def student_logprobs(logits: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's log-probs at the teacher's top-k ids, and of all other tokens together.

    Only the log-normaliser touches the whole vocabulary, so no second [.., V] tensor is kept for
    backward (a real vocabulary makes those the largest tensors of a step). The rest's mass is
    ``1 - sum(top)``, floored at 1e-6, below which it no longer changes the loss.
    """
    logits = logits.float()
    logq_top = logits.gather(-1, topk_ids) - logits.logsumexp(-1, keepdim=True)
    return logq_top, torch.log1p(-logq_top.exp().sum(-1).clamp(max=1.0 - 1e-6))


def coarse_kl(logits: torch.Tensor, batch: TeacherBatch, offset: int = 0) -> torch.Tensor:
    """Per-position KL(p || q) over the top-k tokens plus the rest bucket; ``logits`` [B, T, V] are
    compared with the teacher at positions ``offset .. offset + T - 1``."""
    span = slice(offset, offset + logits.shape[1])
    ids, logp, rest_p = batch.topk_ids[:, span], batch.topk_logprobs[:, span], batch.rest_logprob[:, span]
    logq, rest_q = student_logprobs(logits, ids)
    return (logp.exp() * (logp - logq)).sum(-1) + rest_p.exp() * (rest_p - rest_q)


def coarse_metrics(logits: torch.Tensor, batch: TeacherBatch, offset: int = 0,
                   answers_only: bool = True) -> dict[str, float]:
    """Sums for held-out metrics: KL, alpha's lower bound sum over the top-k of min(p, q), greedy
    agreement (the top-1 is cached exactly) and the count; positions outside answers are skipped."""
    span = slice(offset, offset + logits.shape[1])
    ids, logp = batch.topk_ids[:, span], batch.topk_logprobs[:, span]
    keep = batch.answer[:, span] if answers_only else torch.ones_like(batch.answer[:, span])
    logq, _ = student_logprobs(logits, ids)
    alpha = torch.minimum(logp.exp(), logq.exp()).sum(-1)
    agree = (logits.argmax(-1) == ids[..., 0]).float()
    kl = coarse_kl(logits, batch, offset)
    return {"kl": float(kl[keep].sum()), "alpha_topk": float(alpha[keep].sum()),
            "agreement": float(agree[keep].sum()), "count": float(keep.sum())}
