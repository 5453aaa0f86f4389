"""Distil a small draft model from a trained target, for speculative decoding.

The draft learns the target's next-token distributions over corpus windows: the loss is
``T^2 * KL(p_T || q_T)`` (``p`` target, ``q`` draft, both softened by temperature ``T``), optionally
plus ``ce_weight`` times the ordinary cross-entropy on the corpus tokens. The target is frozen and
runs under ``torch.inference_mode``. The draft shares the target's tokenizer (files copied), vocab
and EOS, so the engine can pair them.

``pair_metrics`` measures what matters for speculation on held-out text: the expected acceptance
rate at temperature 1, ``alpha = E[sum_x min(p(x), q(x))]``, and greedy agreement
(``argmax q == argmax p``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from infer.fileio import publish_folder, staging_folder
from infer.loader import load_model
from infer.loader.config import ModelConfig
from infer.models.layers import DecoderOnlyLM
from infer.train.common import (
    CHECKPOINT_DIR,
    TRAINING_ARGS_FILE,
    autocast,
    build_model,
    count_params,
    is_complete_model,
    model_config,
    say,
    write_json,
    write_model_files,
)
from infer.train.corpus import load_corpus
from infer.train.data import TOKENS_FILE, tokenize_corpus
from infer.train.pretrain import (
    TOKENIZER_FILES,
    TrainingRun,
    TrainResult,
    _jsonable,
    check_precision,
    environment,
    prepare_run,
    save_dtype,
)


@dataclass
class DistillConfig:
    """Settings for ``distill``. ``None`` for corpus/max_train_chars/seq_len/held_out_fraction means
    "as the target was trained" (read from its training_args.json; stdlib and 256 otherwise)."""

    target: Path
    out: Path
    corpus: list[str] | None = None
    max_train_chars: int | None = None
    held_out_fraction: float | None = None
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    tie_word_embeddings: bool = True
    seq_len: int | None = None
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    init_std: float = 0.02
    init_from_target: bool = False  # start the draft's embeddings from the target's (top principal directions)
    temperature: float = 1.0
    ce_weight: float = 0.0  # weight of plain cross-entropy on the corpus tokens, added to the KL term
    max_steps: int | None = 1000
    time_budget: float | None = None
    eval_every: int | None = None
    eval_windows: int = 64
    log_every: int = 10
    checkpoint_every: float = 120.0
    keep_checkpoint: bool = False
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"  # auto: bfloat16 autocast on CUDA, float32 on CPU
    threads: int | None = None  # torch CPU threads; None: all cores available to the process
    save_dtype: str = "auto"
    resume: bool = False

    def __post_init__(self) -> None:
        self.target = Path(self.target).expanduser()
        self.out = Path(self.out).expanduser()
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if self.ce_weight < 0:
            raise ValueError(f"ce_weight={self.ce_weight} must be >= 0")
        check_precision(self.precision, self.save_dtype)


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
                 batch_size: int = 16, precision: str = "auto") -> dict[str, float]:
    """Held-out KL(p||q), alpha = E[sum min(p, q)], greedy agreement and both CE losses, all at T=1."""
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
    if not is_complete_model(cfg.target):
        raise FileNotFoundError(f"{cfg.target}: not a complete model folder (config.json, model.safetensors, "
                                "tokenizer.json)")
    targs = target_training_args(cfg.target)
    # Unpacked: distillation and Medusa training read the target's LM head weight.
    target, tcfg = load_model(cfg.target, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                              device=str(device), pack=False)
    target.requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(cfg.target / "tokenizer.json"))
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


def target_training_args(target: Path) -> dict[str, Any]:
    path = target / TRAINING_ARGS_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return raw if isinstance(raw, dict) else {}


def distill(cfg: DistillConfig, progress: bool = True) -> TrainResult:
    """Train a draft for ``cfg.target`` and publish it at ``cfg.out``; see the module docstring."""
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

    dcfg = model_config(vocab_size=tcfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                        intermediate_size=cfg.intermediate_size,
                        max_position_embeddings=tcfg.max_position_embeddings,
                        tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=tcfg.rope_theta,
                        eos_token_ids=list(tcfg.eos_token_ids) or [eos_id], bos_token_id=tcfg.bos_token_id)
    draft = build_model(dcfg, cfg.seed, cfg.init_std)
    if cfg.init_from_target:
        init_embeddings_from_target(draft, target, cfg.init_std)
    draft = draft.to(device)
    num_params = count_params(draft)
    target_params = count_params(target)
    say(f"draft: llama {num_params / 1e6:.2f}M params ({cfg.num_layers} layers, hidden {cfg.hidden_size}) "
        f"for a {target_params / 1e6:.2f}M target on {device}, {torch.get_num_threads()} threads", progress)

    identity = {"kind": "distill", "model": dcfg.to_hf_dict(), "data": data.key, "seq_len": seq_len,
                "batch_size": cfg.batch_size, "seed": cfg.seed, "target": str(cfg.target.resolve()),
                "temperature": cfg.temperature, "ce_weight": cfg.ce_weight}
    run = TrainingRun(cfg, draft, data, seq_len, cfg.seed + 1, identity, device, resuming, progress)
    sampler, windows = run.sampler, run.windows

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

    state = run.train(step_fn, eval_fn, "distill")
    final: dict[str, float] = {}
    if windows.shape[0]:
        final = pair_metrics(target, draft, windows, device, cfg.batch_size, cfg.precision)
        say(f"held-out (T=1, {windows[:, 1:].numel():,} tokens): KL {final['kl']:.4f}, "
            f"alpha {final['alpha']:.4f}, greedy agreement {final['agreement']:.4f}, "
            f"draft loss {final['draft_loss']:.4f} vs target {final['target_loss']:.4f}", progress)

    with staging_folder(out) as tmp:
        write_model_files(tmp, draft, dcfg, save_dtype(cfg, device))
        for name in TOKENIZER_FILES:
            shutil.copy2(cfg.target / name, tmp / name)
        if (work / TOKENS_FILE).is_file():
            os.replace(work / TOKENS_FILE, tmp / TOKENS_FILE)
        args = {"kind": "distill", **_jsonable(asdict(cfg)), "resolved": {
                    "corpus": corpus_paths, "max_train_chars": max_chars, "held_out_fraction": held_frac,
                    "seq_len": seq_len, "data_seed": data_seed},
                "model_config": dcfg.to_hf_dict(), "num_params": num_params, "target_params": target_params,
                "corpus_source": corpus.source, **environment(device)}
        write_json(tmp / TRAINING_ARGS_FILE, args)
        run.write_log(tmp, wall_start, final)
        publish_folder(tmp, out)
    say(f"saved {out} ({state.step} steps, {state.tokens:,} tokens, {state.elapsed:.0f}s training)", progress)
    return TrainResult(path=out, config=dcfg, num_params=num_params, steps=state.step, tokens=state.tokens,
                       train_time=state.elapsed, wall_time=time.perf_counter() - wall_start, heldout=final)
