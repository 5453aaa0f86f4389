"""Distil a small draft model from a trained target, for speculative decoding.

The draft learns the target's next-token distributions over corpus windows: the loss is
``T^2 * KL(p_T || q_T)`` (``p`` target, ``q`` draft, both softened by temperature ``T``), optionally
plus ``ce_weight`` times the ordinary cross-entropy on the corpus tokens. The target is frozen and
runs under ``torch.inference_mode``. The draft shares the target's tokenizer (files copied), vocab
and EOS, so the engine can pair them.

For a model infer did not train (a real checkpoint) the target is not run during training at
all: its distributions come from a teacher cache (``infer.train.teacher``: by default the target's
own answers to varied prompts, computed once), and the draft reuses the target's token embeddings,
which its tied LM head shares, frozen (see ``DistillConfig.reuse_target_embeddings``).

``pair_metrics`` measures what matters for speculation on held-out text: the expected acceptance
rate at temperature 1, ``alpha = E[sum_x min(p(x), q(x))]``, and greedy agreement
(``argmax q == argmax p``).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import KW_ONLY, asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from infer.data.corpus import load_corpus
from infer.fileio import publish_folder, staging_folder
from infer.loader import load_model, load_tokenizer, resolve_model_path
from infer.models.config import ModelConfig
from infer.models.layers import DecoderOnlyLM
from infer.train.common import (
    CHECKPOINT_DIR,
    TRAINING_ARGS_FILE,
    ModelTrainConfig,
    autocast,
    build_model,
    count_params,
    model_config,
    say,
    target_training_args,
    write_json,
    write_model_files,
)
from infer.train.data import TOKENS_FILE, WindowSampler, tokenize_corpus
from infer.train.pretrain import (
    TOKENIZER_FILES,
    TrainingRun,
    TrainResult,
    _jsonable,
    check_precision,
    environment,
    pick_eval_windows,
    prepare_run,
    save_dtype,
)

if TYPE_CHECKING:
    from infer.train.teacher import TeacherCache, TeacherWindows


@dataclass
class DistillConfig(ModelTrainConfig):
    """Settings for ``distill`` (with the shared ones of ``ModelTrainConfig``). ``None`` for
    corpus/max_train_chars/seq_len/held_out_fraction means "as the target was trained" (read from its
    training_args.json; stdlib and 256 otherwise)."""

    target: Path
    # None becomes <target>/draft, or for a single-file model ~/.cache/infer/drafters/<model>/draft.
    out: Path = None  # type: ignore[assignment]
    held_out_fraction: float | None = None
    hidden_size: int = 128
    num_layers: int = 2
    intermediate_size: int = 384
    seq_len: int | None = None
    init_from_target: bool = False  # start the draft's embeddings from the target's (top principal directions)
    # Reuse the target's token embeddings (and so its tied LM head), frozen, at the target's width, and
    # start the draft's layers as copies of the target's first layers. A real target's vocabulary is
    # large (SmolLM2: 49,152 x 576 = 28M weights, a fifth of the model): learning a copy of it is most
    # of the cost of training a draft and most of its error. The draft then has the target's layer shape
    # (hidden_size / heads / intermediate_size are ignored). None: on when training from a teacher cache.
    reuse_target_embeddings: bool | None = None
    # A teacher cache folder (``infer train cache``), or "auto": build or reuse the default one for the
    # target. None: "auto" for a model infer did not train when no corpus is given; otherwise the live
    # target runs on corpus windows (infer's own small models).
    teacher_cache: str | None = None
    exact_eval_windows: int = 8  # held-out windows on which the live target measures the final alpha exactly
    temperature: float = 1.0
    ce_weight: float = 0.0  # weight of plain cross-entropy on the corpus tokens, added to the KL term
    _: KW_ONLY
    # Where distillation's defaults differ from pretraining's:
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        from infer.loader.hub import drafters_dir

        self.target = Path(self.target).expanduser()
        self.out = Path(self.out).expanduser() if self.out is not None else drafters_dir(str(self.target)) / "draft"
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if self.ce_weight < 0:
            raise ValueError(f"ce_weight={self.ce_weight} must be >= 0")
        check_precision(self.precision, self.save_dtype)

    def uses_cache(self) -> bool:
        from infer.train.teacher import trains_from_cache

        return trains_from_cache(self.teacher_cache, self.corpus, str(self.target))

    def reuses_embeddings(self) -> bool:
        return self.uses_cache() if self.reuse_target_embeddings is None else self.reuse_target_embeddings


def distill_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * KL(softmax(t/T) || softmax(d/T))``, mean over positions (float32)."""
    logp = F.log_softmax(target_logits.float() / temperature, dim=-1)
    logq = F.log_softmax(draft_logits.float() / temperature, dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return kl.mean() * temperature**2


@torch.no_grad()
def init_embeddings_from_target(draft: DecoderOnlyLM, target: DecoderOnlyLM, std: float) -> None:
    """Project the target's token embeddings (and untied head) onto their top principal directions.

    The draft starts with the target's token geometry instead of noise; each matrix is rescaled to
    ``std`` so the draft's random layers see inputs of the usual size.
    """
    width = draft.config.hidden_size

    def project(weight: torch.Tensor) -> torch.Tensor:
        w = weight.detach().float().cpu()
        if width >= w.shape[1]:
            out = torch.zeros(w.shape[0], width)
            out[:, :w.shape[1]] = w
        else:
            _, _, vh = torch.linalg.svd(w - w.mean(0, keepdim=True), full_matrices=False)
            out = w @ vh[:width].T
        return out * (std / out.std().clamp_min(1e-12))

    draft.model.embed_tokens.weight.copy_(project(target.model.embed_tokens.weight))
    if not draft.config.tie_word_embeddings:
        draft.lm_head.weight.copy_(project(target.lm_head.weight))


@torch.inference_mode()
def pair_metrics(target: DecoderOnlyLM, draft: DecoderOnlyLM, windows: torch.Tensor, device: torch.device,
                 batch_size: int = 16, precision: str = "auto", mask: torch.Tensor | None = None) -> dict[str, float]:
    """Held-out KL(p||q), alpha = E[sum min(p, q)], greedy agreement and both CE losses, all at T=1.

    ``mask`` [N, W - 1] (bool) counts only the positions where it is set (a chat model's answers, say).
    """
    target.eval()
    draft.eval()
    sums = {"kl": 0.0, "alpha": 0.0, "agreement": 0.0, "target_loss": 0.0, "draft_loss": 0.0}
    count = 0
    for start in range(0, windows.shape[0], batch_size):
        chunk = windows[start:start + batch_size].to(device)
        x, y = chunk[:, :-1], chunk[:, 1:].reshape(-1)
        with autocast(device, precision):
            zt = target.compute_logits(target(x))
            zd = draft.compute_logits(draft(x))
        zt = zt.float().reshape(-1, zt.shape[-1])
        zd = zd.float().reshape(-1, zd.shape[-1])
        if mask is not None:
            keep = mask[start:start + batch_size].to(device).reshape(-1)
            zt, zd, y = zt[keep], zd[keep], y[keep]
        logp, logq = F.log_softmax(zt, -1), F.log_softmax(zd, -1)
        p, q = logp.exp(), logq.exp()
        sums["kl"] += float((p * (logp - logq)).sum())
        sums["alpha"] += float(torch.minimum(p, q).sum())
        sums["agreement"] += float((zt.argmax(-1) == zd.argmax(-1)).sum())
        sums["target_loss"] += float(F.cross_entropy(zt, y, reduction="sum"))
        sums["draft_loss"] += float(F.cross_entropy(zd, y, reduction="sum"))
        count += y.numel()
    return {k: v / max(count, 1) for k, v in sums.items()}


@dataclass
class FrozenTarget:
    """The model a draft or Medusa heads are trained for, frozen, with the data settings of its own
    training run (each overridable by the caller's config)."""

    model: DecoderOnlyLM
    config: ModelConfig
    tokenizer: Tokenizer
    eos_id: int
    corpus_paths: list[str] | None
    max_train_chars: int | None
    held_out_fraction: float
    seq_len: int
    data_seed: int


def load_frozen_target(cfg: Any, device: torch.device) -> FrozenTarget:
    """Load ``cfg.target`` in inference mode; ``cfg`` has target, corpus, max_train_chars,
    held_out_fraction, seq_len and seed (None data settings mean "as the target was trained")."""
    path = resolve_model_path(cfg.target)  # a folder, a GGUF file or a built-in name
    targs = target_training_args(path) if path.is_dir() else {}
    # Unpacked: distillation and Medusa training read the target's LM head weight.
    target, tcfg = load_model(cfg.target, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                              device=str(device), pack=False)
    target.requires_grad_(False)
    tokenizer = load_tokenizer(cfg.target).backend
    eos_id = tcfg.eos_token_ids[0] if tcfg.eos_token_ids else tokenizer.token_to_id("<|end_of_text|>")
    if eos_id is None:
        raise ValueError(f"{cfg.target}: no eos_token_id in config.json or generation_config.json")
    return FrozenTarget(
        model=target, config=tcfg, tokenizer=tokenizer, eos_id=eos_id,
        corpus_paths=cfg.corpus if cfg.corpus is not None else targs.get("corpus"),
        max_train_chars=cfg.max_train_chars if cfg.max_train_chars is not None else targs.get("max_train_chars"),
        held_out_fraction=(cfg.held_out_fraction if cfg.held_out_fraction is not None
                           else targs.get("held_out_fraction", 0.05)),
        seq_len=cfg.seq_len if cfg.seq_len is not None else int(targs.get("seq_len", 256)),
        # The target's own seed picks the same training subset when the data settings are inherited.
        data_seed=int(targs.get("seed", cfg.seed)) if cfg.max_train_chars is None else cfg.seed,
    )


def draft_config(cfg: DistillConfig, tcfg: ModelConfig, reuse: bool, eos_id: int) -> ModelConfig:
    """The draft's Llama config: the target's vocabulary, EOS, RoPE base and context; its own depth;
    the target's layer shape when it reuses the target's embeddings, else the configured one."""
    shape = dict(hidden_size=tcfg.hidden_size, num_heads=tcfg.num_attention_heads,
                 num_kv_heads=tcfg.num_key_value_heads, intermediate_size=tcfg.intermediate_size) if reuse else \
        dict(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
             intermediate_size=cfg.intermediate_size)
    dcfg = model_config(vocab_size=tcfg.vocab_size, num_layers=cfg.num_layers,
                        max_position_embeddings=tcfg.max_position_embeddings,
                        tie_word_embeddings=tcfg.tie_word_embeddings if reuse else cfg.tie_word_embeddings,
                        rope_theta=tcfg.rope_theta,
                        eos_token_ids=list(tcfg.eos_token_ids) or [eos_id], bos_token_id=tcfg.bos_token_id, **shape)
    if reuse:
        dcfg.head_dim, dcfg.rms_norm_eps = tcfg.head_dim, tcfg.rms_norm_eps
    return dcfg


@torch.no_grad()
def reuse_target_weights(draft: DecoderOnlyLM, target: DecoderOnlyLM) -> None:
    """Copy the target's token embeddings and LM head (frozen: tied or not, the head stays the target's), its first layers
    and its final norm into a draft of the same layer shape: the target's early exit, which training
    then teaches to finish the target's thought. (Measured on SmolLM2-135M's own held-out answers, before
    training: KL 13.8 nats for layers 0-1, 16.4 for 28-29, 17.4 for 0 and 15, 58.7 for 0 and 29, 74.6 for
    random layers; docs/benchmarks-history.md.)"""
    draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    draft.model.embed_tokens.weight.requires_grad_(False)
    if not draft.config.tie_word_embeddings:  # an untied target's head is reused as it is, frozen too
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.lm_head.weight.requires_grad_(False)
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for layer, source in zip(draft.model.layers, target.model.layers, strict=False):
        layer.load_state_dict(source.state_dict())


def save_tokenizer_files(target: str | os.PathLike[str], folder: Path) -> None:
    """The target's tokenizer files into ``folder``, so the draft loads with the same vocabulary and EOS:
    copied from a model folder, or written from what the loader read (a GGUF file, say)."""
    source = resolve_model_path(target)
    if source.is_dir():
        for name in (*TOKENIZER_FILES, "chat_template.jinja", "special_tokens_map.json"):
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)
        return
    tokenizer = load_tokenizer(target)
    (folder / "tokenizer.json").write_text(tokenizer.backend.to_str(pretty=True))
    write_json(folder / "tokenizer_config.json", tokenizer.config)


def _publish_draft(cfg: DistillConfig, run: TrainingRun, draft: DecoderOnlyLM, dcfg: ModelConfig,
                   device: torch.device, args: dict[str, Any], wall_start: float,
                   final: dict[str, float]) -> None:
    work = cfg.out / CHECKPOINT_DIR
    with staging_folder(cfg.out) as tmp:
        write_model_files(tmp, draft, dcfg, save_dtype(cfg, device))
        save_tokenizer_files(cfg.target, tmp)
        if (work / TOKENS_FILE).is_file():
            os.replace(work / TOKENS_FILE, tmp / TOKENS_FILE)
        write_json(tmp / TRAINING_ARGS_FILE, {"kind": "distill", **_jsonable(asdict(cfg)), **args,
                                              "model_config": dcfg.to_hf_dict(), **environment(device)})
        run.write_log(tmp, wall_start, final)
        publish_folder(tmp, cfg.out)


def distill(cfg: DistillConfig, progress: bool = True) -> TrainResult:
    """Train a draft for ``cfg.target`` and publish it at ``cfg.out``; see the module docstring."""
    return _distill_from_cache(cfg, progress) if cfg.uses_cache() else _distill_live(cfg, progress)


def _distill_live(cfg: DistillConfig, progress: bool) -> TrainResult:
    """Run the target on every batch of corpus windows (infer's own small targets)."""
    wall_start = time.perf_counter()
    device, resuming = prepare_run(cfg, progress)
    out = cfg.out
    work = out / CHECKPOINT_DIR

    frozen = load_frozen_target(cfg, device)
    target, tcfg, tokenizer, eos_id = frozen.model, frozen.config, frozen.tokenizer, frozen.eos_id
    corpus_paths, max_chars, held_frac = frozen.corpus_paths, frozen.max_train_chars, frozen.held_out_fraction
    seq_len, data_seed = frozen.seq_len, frozen.data_seed
    if seq_len > tcfg.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len} exceeds the target's max_position_embeddings "
                         f"{tcfg.max_position_embeddings}")

    corpus = load_corpus(corpus_paths, held_out_fraction=held_frac)
    t0 = time.perf_counter()
    # Usually the target's own token cache matches (same tokenizer and texts) and is read in place.
    data = tokenize_corpus(tokenizer, corpus, eos_id, max_train_chars=max_chars, seed=data_seed,
                           cache=[cfg.target / TOKENS_FILE, work / TOKENS_FILE, out / TOKENS_FILE])
    if data.origin not in (cfg.target / TOKENS_FILE, work / TOKENS_FILE):
        data.save(work / TOKENS_FILE)
    say(f"corpus: {corpus.source}: {data.num_train_tokens:,} train / {data.num_heldout_tokens:,} held-out "
        f"tokens ({time.perf_counter() - t0:.1f}s)", progress)

    reuse = cfg.reuses_embeddings()
    dcfg = draft_config(cfg, tcfg, reuse, eos_id)
    draft = build_model(dcfg, cfg.seed, cfg.init_std)
    if reuse:
        reuse_target_weights(draft, load_model(cfg.target, dtype=torch.float32, device="cpu", fuse=False)[0])
    elif cfg.init_from_target:
        init_embeddings_from_target(draft, target, cfg.init_std)
    draft = draft.to(device)
    num_params = count_params(draft)
    target_params = count_params(target)
    say(f"draft: llama {num_params / 1e6:.2f}M params ({cfg.num_layers} layers, hidden {dcfg.hidden_size}) "
        f"for a {target_params / 1e6:.2f}M target on {device}, {torch.get_num_threads()} threads", progress)

    identity = {"kind": "distill", "model": dcfg.to_hf_dict(), "data": data.key, "seq_len": seq_len,
                "batch_size": cfg.batch_size, "seed": cfg.seed, "target": str(cfg.target.resolve()),
                "temperature": cfg.temperature, "ce_weight": cfg.ce_weight, "reuse": reuse}
    sampler = WindowSampler(data.train, seq_len, cfg.batch_size, cfg.seed + 1)
    windows = pick_eval_windows(data, seq_len, cfg.eval_windows)
    run = TrainingRun(cfg, draft, sampler, cfg.batch_size * seq_len, identity, device, resuming, progress)

    def step_fn() -> tuple[torch.Tensor, dict[str, float]]:
        batch = sampler.sample().to(device, non_blocking=True)
        x = batch[:, :-1]
        with torch.inference_mode(), autocast(device, cfg.precision):
            t_logits = target.compute_logits(target(x))
        t_logits = t_logits.clone()  # a normal tensor, usable by autograd
        with autocast(device, cfg.precision):
            d_logits = draft.compute_logits(draft(x))
        kl = distill_loss(t_logits, d_logits, cfg.temperature)
        extras = {"kl": float(kl.detach()) / cfg.temperature**2}
        loss = kl
        if cfg.ce_weight > 0:
            ce = F.cross_entropy(d_logits.float().reshape(-1, d_logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss = loss + cfg.ce_weight * ce
            extras["ce"] = float(ce.detach())
        return loss, extras

    def eval_fn() -> dict[str, float]:
        m = pair_metrics(target, draft, windows[:16], device, cfg.batch_size, cfg.precision)
        return {"kl": m["kl"], "alpha": m["alpha"], "agreement": m["agreement"]}

    state = run.train(step_fn, eval_fn if windows.shape[0] else None, "distill")
    final: dict[str, float] = {}
    if windows.shape[0]:
        final = pair_metrics(target, draft, windows, device, cfg.batch_size, cfg.precision)
        say(f"held-out (T=1, {windows[:, 1:].numel():,} tokens): KL {final['kl']:.4f}, "
            f"alpha {final['alpha']:.4f}, greedy agreement {final['agreement']:.4f}, "
            f"draft loss {final['draft_loss']:.4f} vs target {final['target_loss']:.4f}", progress)

    args = {"resolved": {"corpus": corpus_paths, "max_train_chars": max_chars, "held_out_fraction": held_frac,
                         "seq_len": seq_len, "data_seed": data_seed},
            "num_params": num_params, "target_params": target_params, "corpus_source": corpus.source}
    _publish_draft(cfg, run, draft, dcfg, device, args, wall_start, final)
    say(f"saved {out} ({state.step} steps, {state.tokens:,} tokens, {state.elapsed:.0f}s training)", progress)
    return TrainResult(path=out, config=dcfg, num_params=num_params, steps=state.step, tokens=state.tokens,
                       train_time=state.elapsed, wall_time=time.perf_counter() - wall_start, heldout=final)


def teacher_cache_for(cfg: Any, device: torch.device, progress: bool, **settings_options: Any) -> Path:
    """The teacher cache folder ``cfg.teacher_cache`` names, or for "auto"/None the default one for
    ``cfg.target`` with ``settings_options`` (``TeacherCacheConfig`` fields; built first if missing:
    the expensive, once-only part)."""
    from infer.train.teacher import TeacherCacheConfig, build_teacher_cache

    if cfg.teacher_cache not in (None, "auto"):
        return Path(cfg.teacher_cache).expanduser()
    settings = TeacherCacheConfig(target=str(cfg.target), seed=cfg.seed, device=str(device), threads=cfg.threads,
                                  **settings_options)
    return build_teacher_cache(settings, progress=progress)


def cache_pair_metrics(draft: DecoderOnlyLM, windows: TeacherWindows, device: torch.device, batch_size: int,
                       precision: str, limit: int | None = None) -> dict[str, float]:
    """Held-out metrics of a draft against the cached teacher (answer positions only): KL and alpha
    over the top-k plus the rest (alpha a lower bound), and exact greedy agreement."""
    from infer.train.teacher import coarse_metrics

    draft.eval()
    sums: dict[str, float] = {}
    with torch.inference_mode():
        for batch in windows.batches(batch_size, limit):
            batch = batch.to(device)
            with autocast(device, precision):
                logits = draft.compute_logits(draft(batch.tokens))
            for k, v in coarse_metrics(logits.float(), batch).items():
                sums[k] = sums.get(k, 0.0) + v
    count = max(sums.pop("count", 0.0), 1.0)
    return {k: v / count for k, v in sums.items()}


def _distill_from_cache(cfg: DistillConfig, progress: bool) -> TrainResult:
    """Train on a teacher cache: the target is not run during training (real targets)."""
    from infer.train.teacher import CacheSampler, TeacherCache, coarse_kl

    if cfg.temperature != 1.0:
        raise ValueError("a teacher cache holds the target's distributions at temperature 1: use temperature=1")
    wall_start = time.perf_counter()
    device, resuming = prepare_run(cfg, progress)
    cache_dir = teacher_cache_for(cfg, device, progress)
    cache = TeacherCache(cache_dir)
    tcfg, seq_len = cache.target_config, cache.seq_len
    say(f"teacher cache {cache_dir}: {cache.train.num_windows} train / {cache.heldout.num_windows} held-out "
        f"windows of {seq_len} tokens ({cache.manifest['description']})", progress)

    reuse = cfg.reuses_embeddings()
    dcfg = draft_config(cfg, tcfg, reuse, tcfg.eos_token_ids[0] if tcfg.eos_token_ids else 0)
    draft = build_model(dcfg, cfg.seed, cfg.init_std)
    target_params = 0
    if reuse or cfg.init_from_target:
        target, _ = load_model(cfg.target, dtype=torch.float32, device="cpu", fuse=False)
        target_params = count_params(target)
        if reuse:
            reuse_target_weights(draft, target)
        else:
            init_embeddings_from_target(draft, target, cfg.init_std)
        del target
    draft = draft.to(device)
    num_params = count_params(draft)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    say(f"draft: llama {num_params / 1e6:.2f}M params, {trainable / 1e6:.2f}M trained ({cfg.num_layers} layers, "
        f"hidden {dcfg.hidden_size}{', the target embeddings and tied head reused, frozen' if reuse else ''}) "
        f"on {device}, {torch.get_num_threads()} threads", progress)

    identity = {"kind": "distill-cache", "model": dcfg.to_hf_dict(), "cache": cache.manifest["settings_hash"],
                "batch_size": cfg.batch_size, "seed": cfg.seed, "ce_weight": cfg.ce_weight, "reuse": reuse}
    sampler = CacheSampler(cache.train.num_windows, cfg.batch_size, cfg.seed + 1)
    run = TrainingRun(cfg, draft, sampler, cfg.batch_size * seq_len, identity, device, resuming, progress)

    def step_fn() -> tuple[torch.Tensor, dict[str, float]]:
        batch = cache.train.batch(sampler.sample()).to(device)
        with autocast(device, cfg.precision):
            logits = draft.compute_logits(draft(batch.tokens))
        loss = coarse_kl(logits.float(), batch).mean()
        extras = {"kl": float(loss.detach())}
        if cfg.ce_weight > 0:
            ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), batch.tokens[:, 1:].flatten())
            loss = loss + cfg.ce_weight * ce
            extras["ce"] = float(ce.detach())
        return loss, extras

    def eval_fn() -> dict[str, float]:
        return cache_pair_metrics(draft, cache.heldout, device, cfg.batch_size, cfg.precision, limit=16)

    state = run.train(step_fn, eval_fn, "distill")
    final = cache_pair_metrics(draft, cache.heldout, device, cfg.batch_size, cfg.precision,
                               limit=cfg.eval_windows)
    final.update(exact_heldout_metrics(cfg, draft, cache, device))
    say("held-out answers vs the cached target: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()), progress)

    args = {"teacher_cache": str(cache_dir), "teacher": {k: cache.manifest.get(k) for k in (
                "settings_hash", "description", "source", "seq_len", "top_k", "windows")},
            "num_params": num_params, "trainable_params": trainable, "target_params": target_params,
            "reuse_target_embeddings": reuse}
    _publish_draft(cfg, run, draft, dcfg, device, args, wall_start, final)
    say(f"saved {cfg.out} ({state.step} steps, {state.tokens:,} tokens, {state.elapsed:.0f}s training)", progress)
    return TrainResult(path=cfg.out, config=dcfg, num_params=num_params, steps=state.step, tokens=state.tokens,
                       train_time=state.elapsed, wall_time=time.perf_counter() - wall_start, heldout=final)


def exact_heldout_metrics(cfg: DistillConfig, draft: DecoderOnlyLM, cache: TeacherCache,
                          device: torch.device) -> dict[str, float]:
    """alpha, KL and greedy agreement against the live target (full distributions, not the cached
    top-k) on ``cfg.exact_eval_windows`` held-out windows, answer positions only."""
    if cfg.exact_eval_windows <= 0:
        return {}
    held = cache.heldout.batch(slice(0, cfg.exact_eval_windows))
    target, _ = load_model(cfg.target, dtype=torch.float32, device=str(device))
    m = pair_metrics(target, draft, held.tokens, device, 4, cfg.precision, mask=held.answer[:, :-1])
    return {"alpha": m["alpha"], "kl_exact": m["kl"], "agreement_exact": m["agreement"]}
