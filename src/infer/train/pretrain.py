"""Pretrain a small Llama-architecture model and its byte-level BPE tokenizer from scratch.

``pretrain(PretrainConfig(out=...))`` trains the tokenizer on the corpus (the running Python's
standard library by default), encodes the corpus once (cached as ``tokens.npz``), then trains on
random windows with AdamW, warm-up + cosine decay and gradient clipping (bfloat16 autocast on
CUDA, float32 on CPU). The result is a Hugging Face folder that ``infer.loader.load_model`` and
``transformers.AutoModelForCausalLM.from_pretrained`` both load.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from infer.data.corpus import Corpus, load_corpus
from infer.data.tokenizer import EOS_ID, save_tokenizer, train_bpe_tokenizer
from infer.fileio import publish_folder, staging_folder
from infer.models.config import ModelConfig
from infer.models.layers import DecoderOnlyLM
from infer.train.common import (
    CHECKPOINT_DIR,
    CHECKPOINT_FILE,
    PRECISIONS,
    TRAIN_LOG_FILE,
    TRAINING_ARGS_FILE,
    Checkpointer,
    LoopState,
    ModelTrainConfig,
    ThreadTuner,
    autocast,
    build_model,
    configure_threads,
    count_params,
    loop_settings,
    make_optimizer,
    model_config,
    pick_device,
    run_loop,
    say,
    uses_bf16,
    write_json,
    write_model_files,
)
from infer.train.data import TOKENS_FILE, TokenData, WindowSampler, cap_texts, eval_windows, tokenize_corpus

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class PretrainConfig(ModelTrainConfig):
    """Everything ``pretrain`` needs; the CLI flags map one to one onto these fields (and the shared ones
    of ``ModelTrainConfig``; ``corpus`` None: the stdlib)."""

    out: Path
    held_out_fraction: float = 0.05
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    intermediate_size: int = 704
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    seq_len: int = 256

    def __post_init__(self) -> None:
        self.out = Path(self.out).expanduser()
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError(f"seq_len={self.seq_len} and batch_size={self.batch_size} must be >= 1")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len={self.seq_len} exceeds max_position_embeddings={self.max_position_embeddings}")
        check_precision(self.precision, self.save_dtype)


def check_precision(precision: str, dtype: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use {', '.join(PRECISIONS)}")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"save_dtype={dtype!r}: use auto, float32 or bfloat16")


@dataclass
class TrainResult:
    """What a finished pretraining or distillation run produced."""

    path: Path
    config: ModelConfig
    num_params: int
    steps: int
    tokens: int
    train_time: float
    wall_time: float
    heldout: dict[str, float] = field(default_factory=dict)


def save_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    if cfg.save_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and uses_bf16(device, cfg.precision) else torch.float32
    return torch.bfloat16 if cfg.save_dtype == "bfloat16" else torch.float32


@torch.inference_mode()
def heldout_loss(model: DecoderOnlyLM, windows: torch.Tensor, device: torch.device, batch_size: int,
                 precision: str = "auto") -> float:
    """Mean next-token cross-entropy (nats) over the evaluation windows."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        chunk = windows[start:start + batch_size].to(device)
        with autocast(device, precision):
            logits = model.compute_logits(model(chunk[:, :-1]))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                               reduction="sum")
        total += float(loss)
        count += chunk[:, 1:].numel()
    return total / max(count, 1)


def environment(device: torch.device) -> dict[str, Any]:
    return {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count()}


def pick_eval_windows(data: TokenData, seq_len: int, count: int) -> torch.Tensor:
    """Held-out windows, or the training stream's tail windows when there is no held-out text."""
    source = data.heldout if data.num_heldout_tokens >= 2 else data.train
    return eval_windows(source, seq_len, count)


def prepare_run(cfg: Any, progress: bool) -> tuple[torch.device, bool]:
    """The device (threads configured), and whether ``cfg.resume`` finds a checkpoint in
    OUT/.checkpoint; starting afresh removes a stale one (it must not be resumed later with another
    run's tokenizer or data)."""
    device = pick_device(cfg.device)
    configure_threads(device, cfg.threads)
    checkpoint = cfg.out / CHECKPOINT_DIR / CHECKPOINT_FILE
    resuming = bool(cfg.resume) and checkpoint.is_file()
    if cfg.resume and not resuming:
        say(f"no checkpoint in {checkpoint.parent}; starting from scratch", progress)
    if not resuming:
        checkpoint.unlink(missing_ok=True)
    return device, resuming


class Sampler(Protocol):
    """Draws the next training batch (as the step function reads it); its state is checkpointed."""

    def sample(self) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingRun:
    """What pretraining and distillation set up alike around the model they train: the optimiser,
    resumable checkpoints (with the batch sampler's state), the loop, and the run's log."""

    def __init__(self, cfg: Any, model: DecoderOnlyLM, sampler: Sampler, tokens_per_step: int,
                 identity: dict[str, Any], device: torch.device, resuming: bool, progress: bool) -> None:
        self.cfg, self.model, self.device, self.progress = cfg, model, device, progress
        self.settings = loop_settings(cfg, tokens_per_step, cfg.checkpoint_every)
        self.optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, device)
        self.sampler = sampler
        self.checkpointer = Checkpointer(cfg.out, identity)
        self.state = LoopState()
        if resuming:
            sampler_state, self.state = self.checkpointer.load(model, self.optimizer, device)
            self.sampler.load_state_dict(sampler_state)
            say(f"resumed from {self.checkpointer.path} at step {self.state.step} "
                f"({self.state.elapsed:.0f}s trained)", progress)

    def save_checkpoint(self, state: LoopState) -> None:
        self.checkpointer.save(self.model, self.optimizer, self.sampler.state_dict(), state)

    def train(self, step_fn: Callable[[], tuple[torch.Tensor, dict[str, float]]],
              eval_fn: Callable[[], dict[str, float]] | None, desc: str) -> LoopState:
        cfg = self.cfg
        self.state = run_loop(model=self.model, optimizer=self.optimizer, settings=self.settings, step_fn=step_fn,
                              eval_fn=eval_fn, state=self.state,
                              save_checkpoint=self.save_checkpoint if cfg.checkpoint_every > 0 else None,
                              progress=self.progress, tuner=ThreadTuner.for_device(self.device, cfg.threads),
                              desc=desc)
        return self.state

    def write_log(self, folder: Path, wall_start: float, final: dict[str, float]) -> None:
        """``train_log.json`` into the folder being published, and the checkpoint too if it is kept."""
        state = self.state
        train_loss = state.log[-1]["loss"] if state.log else None
        write_json(folder / TRAIN_LOG_FILE, _train_log(state, time.perf_counter() - wall_start, train_loss, final))
        if self.cfg.keep_checkpoint:
            self.save_checkpoint(state)
            os.replace(self.cfg.out / CHECKPOINT_DIR, folder / CHECKPOINT_DIR)


def pretrain(cfg: PretrainConfig, progress: bool = True) -> TrainResult:
    """Train tokenizer + model as configured and publish the folder ``cfg.out``; see the module docstring."""
    wall_start = time.perf_counter()
    device, resuming = prepare_run(cfg, progress)
    out = cfg.out
    work = out / CHECKPOINT_DIR

    corpus = load_corpus(cfg.corpus, held_out_fraction=cfg.held_out_fraction)
    say(f"corpus: {corpus.source}: {corpus.train_chars:,} train / {corpus.heldout_chars:,} held-out chars",
        progress)
    tokenizer = _tokenizer(cfg, corpus, work, resuming, progress)
    t0 = time.perf_counter()
    data = tokenize_corpus(tokenizer, corpus, EOS_ID, max_train_chars=cfg.max_train_chars, seed=cfg.seed,
                           cache=[work / TOKENS_FILE, out / TOKENS_FILE], save_to=work / TOKENS_FILE)
    say(f"tokens: {data.num_train_tokens:,} train / {data.num_heldout_tokens:,} held-out "
        f"({time.perf_counter() - t0:.1f}s)", progress)

    mcfg = model_config(vocab_size=tokenizer.get_vocab_size(), hidden_size=cfg.hidden_size,
                        num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                        intermediate_size=cfg.intermediate_size,
                        max_position_embeddings=cfg.max_position_embeddings,
                        tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=cfg.rope_theta)
    model = build_model(mcfg, cfg.seed, cfg.init_std).to(device)
    num_params = count_params(model)
    say(f"model: llama {num_params / 1e6:.2f}M params ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {mcfg.vocab_size}) on {device}, {torch.get_num_threads()} threads", progress)
    identity = {"kind": "pretrain", "model": mcfg.to_hf_dict(), "data": data.key, "seq_len": cfg.seq_len,
                "batch_size": cfg.batch_size, "seed": cfg.seed}
    sampler = WindowSampler(data.train, cfg.seq_len, cfg.batch_size, cfg.seed)
    windows = pick_eval_windows(data, cfg.seq_len, cfg.eval_windows)
    run = TrainingRun(cfg, model, sampler, cfg.batch_size * cfg.seq_len, identity, device, resuming, progress)

    def step_fn() -> tuple[torch.Tensor, dict[str, float]]:
        batch = sampler.sample().to(device, non_blocking=True)
        with autocast(device, cfg.precision):
            logits = model.compute_logits(model(batch[:, :-1]))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        return loss, {}

    def eval_fn() -> dict[str, float]:
        return {"loss": heldout_loss(model, windows[:16], device, cfg.batch_size, cfg.precision)}

    state = run.train(step_fn, eval_fn if windows.shape[0] else None, "pretrain")
    final: dict[str, float] = {}
    if windows.shape[0]:
        final["loss"] = heldout_loss(model, windows, device, cfg.batch_size, cfg.precision)
        say(f"held-out loss {final['loss']:.4f} nats/token over {windows[:, 1:].numel():,} tokens", progress)

    with staging_folder(out) as tmp:
        dtype = save_dtype(cfg, device)
        write_model_files(tmp, model, mcfg, dtype)
        for name in TOKENIZER_FILES:
            shutil.copy2(work / name, tmp / name)
        os.replace(work / TOKENS_FILE, tmp / TOKENS_FILE)
        args = {"kind": "pretrain", **_jsonable(asdict(cfg)), "model_config": mcfg.to_hf_dict(),
                "num_params": num_params, "corpus_source": corpus.source,
                "train_tokens_available": data.num_train_tokens, "heldout_tokens": data.num_heldout_tokens,
                **environment(device)}
        write_json(tmp / TRAINING_ARGS_FILE, args)
        run.write_log(tmp, wall_start, final)
        publish_folder(tmp, out)
    say(f"saved {out} ({state.step} steps, {state.tokens:,} tokens, {state.elapsed:.0f}s training, "
        f"{time.perf_counter() - wall_start:.0f}s total)", progress)
    return TrainResult(path=out, config=mcfg, num_params=num_params, steps=state.step, tokens=state.tokens,
                       train_time=state.elapsed, wall_time=time.perf_counter() - wall_start, heldout=final)


def _tokenizer(cfg: PretrainConfig, corpus: Corpus, work: Path, resuming: bool, progress: bool) -> Tokenizer:
    if resuming and (work / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(work / "tokenizer.json"))
    t0 = time.perf_counter()
    texts = cap_texts(corpus.train_texts, cfg.max_train_chars, cfg.seed)
    tokenizer = train_bpe_tokenizer(texts, cfg.vocab_size)
    work.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, work, model_max_length=cfg.max_position_embeddings)
    say(f"tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} tokens ({time.perf_counter() - t0:.1f}s)",
        progress)
    return tokenizer


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()}


def _train_log(state: LoopState, wall: float, train_loss: float | None,
               final: dict[str, float]) -> dict[str, Any]:
    return {"steps": state.step, "tokens": state.tokens, "train_time_s": round(state.elapsed, 2),
            "wall_time_s": round(wall, 2), "tokens_per_s": round(state.tokens / max(state.elapsed, 1e-9), 1),
            "sessions": state.sessions, "final_train_loss": train_loss,
            "heldout": {k: round(v, 5) for k, v in final.items()}, "evals": state.evals, "log": state.log}
