"""Pieces shared by pretraining and distillation.

Model construction and initialisation, the optimiser and learning-rate schedule, the training
loop (time and step budgets, progress bar, periodic evaluation, resumable checkpoints) and the
resume-safe Hugging Face output folder.

Output safety: while training, ``DIR`` holds at most ``DIR/.checkpoint`` (no config.json or
weights). The finished model is written to a hidden temporary sibling and renamed to ``DIR`` only
when every file is in place, so a folder that looks like a model is always a complete one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from infer.extras import require
from infer.loader import resolve_device
from infer.loader.save import write_model_files as write_hf_model_files
from infer.models.config import ModelConfig
from infer.models.layers import DecoderOnlyLM

CHECKPOINT_DIR = ".checkpoint"
CHECKPOINT_FILE = "state.pt"
TRAINING_ARGS_FILE = "training_args.json"
TRAIN_LOG_FILE = "train_log.json"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", TRAINING_ARGS_FILE, TRAIN_LOG_FILE)


def say(message: str, enabled: bool = True) -> None:
    if enabled:
        print(f"[infer train] {message}", file=sys.stderr, flush=True)


def configure_threads(device: torch.device, threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``threads`` if given, else every core this process may run on
    (unless OMP_NUM_THREADS says otherwise). Returns the count in use."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        torch.set_num_threads(threads)
    elif device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores))
    return torch.get_num_threads()


class ThreadTuner:
    """Picks the faster of a few CPU thread counts from measured step times, re-checking periodically.

    On an idle machine all cores win. When other processes compete for the cores, OpenMP threads
    wait for each other at every parallel region and all cores can be several times slower than
    fewer; the tuner notices and switches (and switches back when the load goes away).
    """

    def __init__(self, candidates: list[int], trial_steps: int = 4, recheck_every: float = 30.0,
                 warmup_steps: int = 2) -> None:
        self.candidates = candidates
        self.trial_steps = trial_steps
        self.recheck_every = recheck_every
        self.times: dict[int, list[float]] = {}
        self.skip = warmup_steps
        self.queue: list[int] = [c for c in candidates for _ in range(trial_steps)]
        self.current = candidates[0]
        self.next_check = math.inf
        torch.set_num_threads(self.current)

    @classmethod
    def for_device(cls, device: torch.device, threads: int | None) -> ThreadTuner | None:
        """A tuner for CPU runs with automatic threads on a multi-core machine, else None."""
        if device.type != "cpu" or threads is not None or os.environ.get("OMP_NUM_THREADS"):
            return None
        n = torch.get_num_threads()
        if n < 2:
            return None
        return cls([n, max(1, n // 2)])

    def before_step(self) -> None:
        if self.skip == 0 and not self.queue and time.perf_counter() >= self.next_check:
            best = self.current
            self.queue = [c for c in self.candidates if c != best for _ in range(self.trial_steps)]
            self.queue += [best] * self.trial_steps
            self.times = {}
        want = self.queue[0] if self.skip == 0 and self.queue else self.current
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
        self.current = want

    def after_step(self, seconds: float) -> None:
        if self.skip > 0:
            self.skip -= 1
            return
        if not self.queue:
            return
        self.times.setdefault(self.queue.pop(0), []).append(seconds)
        if not self.queue:
            medians = {c: sorted(ts)[len(ts) // 2] for c, ts in self.times.items()}
            self.current = min(medians, key=lambda c: medians[c])
            torch.set_num_threads(self.current)
            self.next_check = time.perf_counter() + self.recheck_every


def pick_device(device: str) -> torch.device:
    return resolve_device(device)


PRECISIONS = ("auto", "float32", "bfloat16")


def uses_bf16(device: torch.device, precision: str = "auto") -> bool:
    """Whether compute runs under bfloat16 autocast: ``auto`` means on CUDA only."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use {', '.join(PRECISIONS)}")
    return precision == "bfloat16" or (precision == "auto" and device.type == "cuda")


def autocast(device: torch.device, precision: str = "auto") -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast on CUDA (or wherever ``precision="bfloat16"``); plain float32 otherwise.

    Weights and optimiser state stay float32 either way.
    """
    if uses_bf16(device, precision):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def is_complete_model(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


# ---------------------------------------------------------------- model


def model_config(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, max_position_embeddings: int, tie_word_embeddings: bool,
                 rope_theta: float = 10000.0, eos_token_ids: list[int] | None = None,
                 bos_token_id: int | None = BOS_ID) -> ModelConfig:
    """A Llama ``ModelConfig``, validated (head counts divide evenly)."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"heads={num_heads} is not divisible by kv_heads={num_kv_heads}")
    head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for RoPE")
    for name, value in (("vocab_size", vocab_size), ("num_layers", num_layers),
                        ("intermediate_size", intermediate_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be positive")
    return ModelConfig(
        model_type="llama", vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=rope_theta, tie_word_embeddings=tie_word_embeddings,
        eos_token_ids=list(eos_token_ids if eos_token_ids is not None else [EOS_ID]), bos_token_id=bos_token_id,
    )


def build_model(config: ModelConfig, seed: int, init_std: float = 0.02) -> DecoderOnlyLM:
    """A freshly initialised Llama: N(0, std) weights, residual projections scaled by 1/sqrt(2 * layers).

    Uses its own generator, so the global RNG is untouched.
    """
    from infer.models import MODEL_REGISTRY

    model = MODEL_REGISTRY[config.model_type](config)
    gen = torch.Generator().manual_seed(seed)
    residual_std = init_std / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head appears once, as the embedding
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else init_std
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def count_params(model: torch.nn.Module) -> int:
    """Parameters, a tied embedding counted once."""
    return sum(p.numel() for p in model.parameters())


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                   device: torch.device) -> torch.optim.AdamW:
    """AdamW; matrices decay, norms and biases do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_factor(step: int, progress: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    p = min(max(progress, 0.0), 1.0)
    return warm * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


# ---------------------------------------------------------------- output folder


def write_model_files(folder: Path, model: DecoderOnlyLM, config: ModelConfig, dtype: torch.dtype) -> None:
    """The Hugging Face model files of a trained model (PAD is the training tokenizer's)."""
    write_hf_model_files(folder, model, config, dtype, pad_token_id=PAD_ID)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# ---------------------------------------------------------------- run settings


@dataclass(kw_only=True)
class TrainRunConfig:
    """Settings every ``infer train`` run shares (pretrain, distill, medusa). The defaults are pretraining's;
    distill and medusa restate the few fields whose defaults differ, after a ``KW_ONLY`` marker.

    Keyword-only, so a subclass's own fields keep their order (and positions) in its constructor."""

    corpus: list[str] | None = None  # files/folders (*.py, *.txt, *.md); None: the run's default text
    max_train_chars: int | None = None  # use a random subset of training files of this many characters
    batch_size: int = 16  # windows per step
    lr: float = 2e-3  # peak learning rate (AdamW, warm-up + cosine decay)
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int | None = 1000
    time_budget: float | None = None  # seconds of training; with max_steps, whichever ends first
    eval_every: int | None = None  # steps between held-out evaluations; None: four times per step budget
    eval_windows: int = 64
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"  # auto: bfloat16 autocast on CUDA, float32 on CPU; or float32 / bfloat16
    threads: int | None = None  # torch CPU threads; None: all cores available to the process


@dataclass(kw_only=True)
class ModelTrainConfig(TrainRunConfig):
    """A run that trains a whole model (pretrain, distill): its shape's shared defaults, initialisation,
    resumable checkpoints and the dtype it is saved in."""

    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = True
    init_std: float = 0.02
    checkpoint_every: float = 120.0  # seconds between resumable checkpoints (<= 0: never)
    keep_checkpoint: bool = False  # keep DIR/.checkpoint after finishing (to continue training later)
    save_dtype: str = "auto"  # auto: bfloat16 when trained on CUDA, else float32
    resume: bool = False


# ---------------------------------------------------------------- training loop


@dataclass
class LoopSettings:
    """What the generic loop needs; both pretraining and distillation configs map onto it."""

    max_steps: int | None
    time_budget: float | None
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    eval_every: int | None  # steps between held-out evaluations (None: only at the end)
    log_every: int
    checkpoint_every: float  # seconds between checkpoints (<= 0: never)
    tokens_per_step: int

    def __post_init__(self) -> None:
        if self.max_steps is None and self.time_budget is None:
            raise ValueError("give max_steps or time_budget (or both)")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps} must be >= 1")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError(f"time_budget={self.time_budget} must be > 0")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")

    def progress(self, step: int, elapsed: float) -> float:
        """Fraction of the run done: the further along of the step and the time budget."""
        parts = [0.0]
        if self.max_steps is not None:
            parts.append(step / self.max_steps)
        if self.time_budget is not None:
            parts.append(elapsed / self.time_budget)
        return max(parts)

    def warmup(self) -> int:
        # Never spend more than a fifth of a short step-limited run warming up.
        if self.max_steps is not None:
            return min(self.warmup_steps, max(1, self.max_steps // 5))
        return self.warmup_steps


def loop_settings(cfg: TrainRunConfig, tokens_per_step: int, checkpoint_every: float) -> LoopSettings:
    """The loop's settings for a run's config; ``cfg.eval_every`` None: four held-out evaluations over
    a step budget (under a time budget alone, only the one at the end)."""
    eval_every = cfg.eval_every
    if eval_every is None:
        eval_every = max(1, cfg.max_steps // 4) if cfg.max_steps is not None else 0
    return LoopSettings(max_steps=cfg.max_steps, time_budget=cfg.time_budget, lr=cfg.lr,
                        min_lr_ratio=cfg.min_lr_ratio, warmup_steps=cfg.warmup_steps,
                        weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, eval_every=eval_every or None,
                        log_every=max(1, cfg.log_every), checkpoint_every=checkpoint_every,
                        tokens_per_step=tokens_per_step)


@dataclass
class LoopState:
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0  # training wall time over all sessions (resumes add up)
    sessions: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "elapsed": self.elapsed, "sessions": self.sessions,
                "log": self.log, "evals": self.evals}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LoopState:
        return cls(step=int(raw["step"]), tokens=int(raw["tokens"]), elapsed=float(raw["elapsed"]),
                   sessions=int(raw.get("sessions", 0)), log=list(raw["log"]), evals=list(raw["evals"]))


class Checkpointer:
    """Saves and restores model + optimiser + sampler + loop state under ``out/.checkpoint``."""

    def __init__(self, out: Path, identity: dict[str, Any]) -> None:
        self.dir = out / CHECKPOINT_DIR
        self.path = self.dir / CHECKPOINT_FILE
        # Settings that must match for a checkpoint to be resumed (model shape, data, tokenizer...).
        self.identity = json.loads(json.dumps(identity, default=str))

    def exists(self) -> bool:
        return self.path.is_file()

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler_state: dict[str, Any],
             state: LoopState) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        payload = {"identity": json.dumps(self.identity, sort_keys=True), "model": model.state_dict(),
                   "optimizer": optimizer.state_dict(), "sampler": sampler_state,
                   "loop": json.dumps(state.to_dict())}
        tmp = self.dir / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
        torch.save(payload, tmp)
        os.replace(tmp, self.path)

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             device: torch.device) -> tuple[dict[str, Any], LoopState]:
        payload = torch.load(self.path, map_location=device, weights_only=True)
        saved = json.loads(payload["identity"])
        if saved != self.identity:
            diff = sorted(k for k in set(saved) | set(self.identity) if saved.get(k) != self.identity.get(k))
            raise ValueError(f"{self.path}: checkpoint was made with different settings ({', '.join(diff)}); "
                             "use the same settings to resume, or drop --resume to start over")
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        return payload["sampler"], LoopState.from_dict(json.loads(payload["loop"]))

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


StepFn = Callable[[], tuple[torch.Tensor, dict[str, float]]]
EvalFn = Callable[[], dict[str, float]]


def run_loop(*, model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: LoopSettings,
             step_fn: StepFn, eval_fn: EvalFn | None, state: LoopState,
             save_checkpoint: Callable[[LoopState], None] | None, progress: bool, desc: str,
             tuner: ThreadTuner | None = None) -> LoopState:
    """Optimise until the step or time budget is used up; returns the updated state.

    ``step_fn`` computes the loss of a fresh batch (the loop does backward, clipping and the update).
    On KeyboardInterrupt a checkpoint is written (when checkpointing is on) before re-raising.
    ``tuner`` (CPU) adapts the thread count to the measured step time.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    session_start = time.perf_counter()
    base_elapsed = state.elapsed
    last_ckpt = session_start
    state.sessions += 1
    bar = progress_bar(total=1000, desc=desc, disable=not progress, dynamic_ncols=True, leave=True,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining} {postfix}")
    shown = 0
    window_loss, window_n, window_start, window_tokens = 0.0, 0, time.perf_counter(), 0
    extra_sums: dict[str, float] = {}
    tok_per_s = 0.0
    updating = False
    model.train()
    try:
        while True:
            elapsed = base_elapsed + time.perf_counter() - session_start
            done = settings.progress(state.step, elapsed)
            if done >= 1.0:
                break
            factor = lr_factor(state.step, done, settings.warmup(), settings.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * factor
            if tuner is not None:
                tuner.before_step()
            step_start = time.perf_counter()
            loss, extras = step_fn()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip) if settings.grad_clip > 0 \
                else torch.tensor(0.0)
            updating = True  # weights and state disagree until the step is counted
            optimizer.step()
            state.step += 1
            state.tokens += settings.tokens_per_step
            updating = False
            window_tokens += settings.tokens_per_step
            loss_value = float(loss.detach())
            if tuner is not None:
                tuner.after_step(time.perf_counter() - step_start)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {state.step}; lower the learning rate")
            window_loss += loss_value
            window_n += 1
            for k, v in extras.items():
                extra_sums[k] = extra_sums.get(k, 0.0) + v
            now = time.perf_counter()
            elapsed = base_elapsed + now - session_start
            if state.step % settings.log_every == 0 or state.step == 1:
                tok_per_s = window_tokens / max(now - window_start, 1e-9)
                entry = {"step": state.step, "tokens": state.tokens, "elapsed": round(elapsed, 2),
                         "loss": round(window_loss / window_n, 5), "lr": settings.lr * factor,
                         "grad_norm": round(float(grad_norm), 4), "tokens_per_s": round(tok_per_s, 1),
                         "threads": torch.get_num_threads()}
                entry.update({k: round(v / window_n, 5) for k, v in extra_sums.items()})
                state.log.append(entry)
                bar.set_postfix_str(f"step {state.step} loss {entry['loss']:.3f} {tok_per_s:,.0f} tok/s",
                                    refresh=False)
                window_loss, window_n, window_start, window_tokens = 0.0, 0, now, 0
                extra_sums = {}
            if eval_fn is not None and settings.eval_every and state.step % settings.eval_every == 0:
                result = eval_fn()
                state.evals.append({"step": state.step, "tokens": state.tokens, "elapsed": round(elapsed, 2),
                                    **{k: round(v, 5) for k, v in result.items()}})
                model.train()
                if progress:
                    bar.write(f"[infer train] {desc} step {state.step}: "
                              + ", ".join(f"held-out {k} {v:.4f}" for k, v in result.items()), file=sys.stderr)
            target = min(1000, int(settings.progress(state.step, elapsed) * 1000))
            if target > shown:
                bar.update(target - shown)
                shown = target
            if save_checkpoint is not None and settings.checkpoint_every > 0 \
                    and now - last_ckpt >= settings.checkpoint_every:
                state.elapsed = elapsed
                save_checkpoint(state)
                last_ckpt = time.perf_counter()
        bar.update(1000 - shown)
    except KeyboardInterrupt:
        state.elapsed = base_elapsed + time.perf_counter() - session_start
        if save_checkpoint is not None and not updating:
            save_checkpoint(state)
            if progress:
                bar.write(f"[infer train] interrupted at step {state.step}; checkpoint saved, resume with --resume",
                          file=sys.stderr)
        raise
    finally:
        bar.close()
    state.elapsed = base_elapsed + time.perf_counter() - session_start
    model.eval()
    return state


def target_training_args(target: Path) -> dict[str, Any]:
    """The settings a target infer trained was trained with (its training_args.json), or {}."""
    path = target / TRAINING_ARGS_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return raw if isinstance(raw, dict) else {}


def progress_bar(**options: Any) -> Any:
    """A tqdm progress bar (imported on first use: building the ``infer train`` flags needs no extra)."""
    return require("tqdm", "train", "training").tqdm(**options)
