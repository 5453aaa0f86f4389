"""Train Medusa heads on a frozen target: ``infer train medusa --target DIR [--heads 4]``.

The target runs under ``torch.inference_mode`` on each batch; only the heads learn. Head k at
position t is taught the token at t + k + 2, either

* ``distill`` (default): the target's own next-token distribution at position t + k + 1 (soft
  cross-entropy), which is what verification judges the guesses against, or
* ``ce``: the corpus token itself (hard cross-entropy).

The data settings (corpus, character cap, held-out split, window length) default to the target's
own training run, so its cached token stream is reused. The loop, budgets (``--max-steps`` and/or
``--time-budget``), progress bar, seed and learning-rate schedule are those of ``infer train
pretrain``/``distill`` (``infer.train.common``). Afterwards held-out windows measure each head's
top-s accuracy against the target's argmax; those numbers are saved with the heads and shape the
candidate tree (``infer.speculative.tree.build_tree``). The heads are published atomically to
``<target>/medusa`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import KW_ONLY, asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from infer.models.medusa_heads import DEFAULT_TOP_K, DEFAULT_TREE_SIZE, MedusaHeads
from infer.speculative.medusa import default_heads_dir
from infer.train.common import TrainRunConfig

OBJECTIVES = ("distill", "ce")


@dataclass
class MedusaTrainConfig(TrainRunConfig):
    """Settings for ``train_medusa`` (with the shared ones of ``TrainRunConfig``); ``None`` data settings
    mean "as the target was trained"."""

    target: Path
    heads: int = 4
    out: Path | None = None  # default: <target>/medusa
    objective: str = "distill"
    num_layers: int = 1  # residual blocks per head
    # False: every head keeps the target's LM head as its vocabulary projection, so drafting applies one
    # shared V x H matrix instead of K copies (a fifth of SmolLM2's weights each). None: False when
    # training from a teacher cache (real targets), True otherwise.
    train_projection: bool | None = None
    # A teacher cache folder (``infer train cache``, with hidden states), or "auto". None: "auto" for a
    # model infer did not train when no corpus is given; otherwise the live target runs on corpus windows.
    teacher_cache: str | None = None
    tree_size: int = DEFAULT_TREE_SIZE
    top_k: int = DEFAULT_TOP_K
    held_out_fraction: float | None = None
    seq_len: int | None = None
    _: KW_ONLY
    # Where Medusa training's defaults differ from pretraining's: a smaller, shorter run (heads only).
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_steps: int | None = 500
    eval_windows: int = 32

    def __post_init__(self) -> None:
        from infer.train.common import uses_bf16

        uses_bf16(torch.device("cpu"), self.precision)  # rejects an unknown precision now, not mid-run
        self.target = Path(self.target).expanduser()
        if self.out is not None:
            self.out = Path(self.out).expanduser()
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} is invalid: use one of {', '.join(OBJECTIVES)}")
        for name in ("heads", "num_layers", "tree_size", "top_k", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.seq_len is not None and self.seq_len < self.heads + 2:
            raise ValueError(f"seq_len={self.seq_len} must be >= heads + 2 = {self.heads + 2}")

    def uses_cache(self) -> bool:
        from infer.train.teacher import trains_from_cache

        return trains_from_cache(self.teacher_cache, self.corpus, str(self.target))

    def trains_projection(self) -> bool:
        return not self.uses_cache() if self.train_projection is None else self.train_projection


@dataclass
class MedusaTrainResult:
    out: Path
    steps: int
    train_time: float
    initial_loss: float  # held-out loss (mean over heads) before the first step
    final_loss: float  # held-out loss after the last step
    head_losses: list[float]  # final held-out loss per head
    rank_accuracy: list[list[float]]  # [head][rank]: P(candidate == target argmax)
    train_losses: list[float] = field(default_factory=list)  # logged training losses

    @property
    def top1_accuracy(self) -> list[float]:
        return [row[0] for row in self.rank_accuracy]


def head_loss(logits: torch.Tensor, k: int, ids: torch.Tensor, teacher: torch.Tensor | None) -> torch.Tensor:
    """Loss of head k, whose logits [B, T, V] at position t guess the token at t + k + 2.

    ``teacher`` [B, T, V] holds the target's next-token distributions (distillation); None uses the
    corpus tokens ``ids`` [B, T].
    """
    usable = ids.shape[1] - (k + 2)
    pred = logits[:, :usable].float()
    if teacher is None:
        return F.cross_entropy(pred.flatten(0, 1), ids[:, k + 2:].flatten())
    target = teacher[:, k + 1: k + 1 + usable]  # p(x_{t+k+2} | x_{<=t+k+1})
    return -(target * F.log_softmax(pred, dim=-1)).sum(-1).mean()


@torch.no_grad()
def evaluate_heads(target: Any, heads: MedusaHeads, windows: torch.Tensor, objective: str, batch_size: int,
                   device: torch.device) -> tuple[list[float], list[list[float]]]:
    """Per-head held-out loss, and rank accuracy P(head k's rank-r token == target argmax at t + k + 1)."""
    num_heads, top_k = heads.config.num_heads, heads.config.top_k
    loss_sum = [0.0] * num_heads
    hits = torch.zeros(num_heads, top_k, dtype=torch.float64)
    counts = [0] * num_heads
    batches = 0
    heads.eval()
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start:start + batch_size].to(device)
        with torch.inference_mode():
            hidden = target(ids).float()
            teacher_logits = target.compute_logits(hidden).float()
        teacher = torch.softmax(teacher_logits, dim=-1) if objective == "distill" else None
        argmax = teacher_logits.argmax(dim=-1)
        for k in range(num_heads):
            logits = heads.head_logits(k, hidden)
            loss_sum[k] += float(head_loss(logits, k, ids, teacher))
            usable = ids.shape[1] - (k + 2)
            top = logits[:, :usable].topk(top_k, dim=-1).indices
            truth = argmax[:, k + 1: k + 1 + usable].unsqueeze(-1)
            hits[k] += (top == truth).flatten(0, 1).double().sum(0).cpu()
            counts[k] += truth.numel()
        batches += 1
    losses = [s / max(1, batches) for s in loss_sum]
    return losses, [[float(h) / max(1, counts[k]) for h in hits[k]] for k in range(num_heads)]


class _LiveTarget:
    """Batches of corpus windows run through the target at every step (infer's own small targets)."""

    def __init__(self, cfg: MedusaTrainConfig, device: torch.device, progress: bool) -> None:
        from infer.data.corpus import load_corpus
        from infer.train.common import say
        from infer.train.data import TOKENS_FILE, WindowSampler, tokenize_corpus
        from infer.train.distill import load_frozen_target
        from infer.train.pretrain import pick_eval_windows

        self.cfg, self.device = cfg, device
        frozen = load_frozen_target(cfg, device)
        self.target, tcfg = frozen.model, frozen.config
        seq_len = min(frozen.seq_len, tcfg.max_position_embeddings - 1)
        corpus = load_corpus(frozen.corpus_paths, held_out_fraction=frozen.held_out_fraction)
        t0 = time.perf_counter()
        data = tokenize_corpus(frozen.tokenizer, corpus, frozen.eos_id, max_train_chars=frozen.max_train_chars,
                               seed=frozen.data_seed, cache=[cfg.target / TOKENS_FILE])
        say(f"corpus: {corpus.source}: {data.num_train_tokens:,} train / {data.num_heldout_tokens:,} held-out "
            f"tokens ({time.perf_counter() - t0:.1f}s)", progress)
        self.sampler = WindowSampler(data.train, seq_len, cfg.batch_size, cfg.seed + 1)
        self.windows = pick_eval_windows(data, seq_len, cfg.eval_windows)
        if self.sampler.window < cfg.heads + 2 or self.windows.shape[0] == 0:
            raise ValueError(f"the corpus is too small ({data.num_train_tokens} training tokens) for {cfg.heads} heads")
        self.lm_head = self.target.lm_head.weight.detach().float().clone()
        self.target_params = sum(p.numel() for p in self.target.parameters())
        self.tokens_per_step = cfg.batch_size * self.sampler.window
        self.resolved = {"corpus": frozen.corpus_paths, "max_train_chars": frozen.max_train_chars,
                         "held_out_fraction": frozen.held_out_fraction, "seq_len": seq_len,
                         "data_seed": frozen.data_seed, "corpus_source": corpus.source}

    def losses(self, medusa: MedusaHeads) -> list[torch.Tensor]:
        from infer.train.common import autocast

        cfg, device = self.cfg, self.device
        ids = self.sampler.sample().to(device, non_blocking=True)
        with torch.inference_mode(), autocast(device, cfg.precision):
            hidden = self.target(ids).float()
            teacher = torch.softmax(self.target.compute_logits(hidden).float(), dim=-1) \
                if cfg.objective == "distill" else None
        hidden = hidden.clone()  # normal tensors, usable by autograd
        teacher = None if teacher is None else teacher.clone()
        with autocast(device, cfg.precision):
            logits = [medusa.head_logits(k, hidden) for k in range(cfg.heads)]
        return [head_loss(logits[k].float(), k, ids, teacher) for k in range(cfg.heads)]

    def evaluate(self, medusa: MedusaHeads) -> tuple[list[float], list[list[float]]]:
        return evaluate_heads(self.target, medusa, self.windows, self.cfg.objective, max(1, self.cfg.batch_size),
                              self.device)


class _CachedTarget:
    """Batches of a teacher cache: the target's final hidden states and top-k distributions, stored
    once (real targets), so a step costs only the heads."""

    def __init__(self, cfg: MedusaTrainConfig, device: torch.device, progress: bool) -> None:
        from infer.loader import load_model
        from infer.train.common import say
        from infer.train.distill import teacher_cache_for
        from infer.train.teacher import CacheSampler, TeacherCache

        if cfg.objective != "distill":
            raise ValueError("a teacher cache trains the heads on the target's distributions: use objective=distill")
        self.cfg, self.device = cfg, device
        folder = teacher_cache_for(cfg, device, progress)
        self.cache = TeacherCache(folder, hidden=True)
        if self.cache.seq_len < cfg.heads + 2:
            raise ValueError(f"the cache's windows ({self.cache.seq_len} tokens) are too short for {cfg.heads} heads")
        say(f"teacher cache {folder}: {self.cache.train.num_windows} train / {self.cache.heldout.num_windows} "
            f"held-out windows of {self.cache.seq_len} tokens ({self.cache.manifest['description']})", progress)
        target, _ = load_model(cfg.target, dtype=torch.float32, device="cpu", fuse=False)
        self.lm_head = target.lm_head.weight.detach().clone()
        self.target_params = sum(p.numel() for p in target.parameters())
        del target
        self.sampler = CacheSampler(self.cache.train.num_windows, cfg.batch_size, cfg.seed + 1)
        self.tokens_per_step = cfg.batch_size * self.cache.seq_len
        self.resolved = {"teacher_cache": str(folder), "seq_len": self.cache.seq_len,
                         "teacher": {k: self.cache.manifest.get(k) for k in (
                             "settings_hash", "description", "source", "top_k", "windows")}}

    def _head_logits(self, medusa: MedusaHeads, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head k at every position whose guess (the token at t + k + 2) the window still holds a teacher for."""
        from infer.train.common import autocast

        with autocast(self.device, self.cfg.precision):
            return medusa.head_logits(k, hidden[:, :hidden.shape[1] - (k + 1)]).float()

    def losses(self, medusa: MedusaHeads) -> list[torch.Tensor]:
        from infer.train.teacher import coarse_kl

        batch = self.cache.train.batch(self.sampler.sample()).to(self.device)
        assert batch.hidden is not None
        return [coarse_kl(self._head_logits(medusa, k, batch.hidden), batch, offset=k + 1).mean()
                for k in range(self.cfg.heads)]

    @torch.no_grad()
    def evaluate(self, medusa: MedusaHeads) -> tuple[list[float], list[list[float]]]:
        """Per-head held-out KL (top-k + rest) and rank accuracy against the target's argmax, on answers."""
        from infer.train.teacher import coarse_kl

        heads, top_k = self.cfg.heads, medusa.config.top_k
        kl_sum, counts = [0.0] * heads, [0.0] * heads
        hits = torch.zeros(heads, top_k, dtype=torch.float64)
        medusa.eval()
        for batch in self.cache.heldout.batches(max(1, self.cfg.batch_size), self.cfg.eval_windows):
            batch = batch.to(self.device)
            assert batch.hidden is not None
            for k in range(heads):
                logits = self._head_logits(medusa, k, batch.hidden)
                keep = batch.answer[:, k + 1: k + 1 + logits.shape[1]]
                kl_sum[k] += float(coarse_kl(logits, batch, offset=k + 1)[keep].sum())
                truth = batch.topk_ids[:, k + 1: k + 1 + logits.shape[1], :1]
                hit = logits.topk(top_k, dim=-1).indices == truth
                hits[k] += hit[keep].double().sum(0).cpu()
                counts[k] += float(keep.sum())
        return ([kl_sum[k] / max(counts[k], 1.0) for k in range(heads)],
                [[float(h) / max(counts[k], 1.0) for h in hits[k]] for k in range(heads)])


def train_medusa(cfg: MedusaTrainConfig, progress: bool = True) -> MedusaTrainResult:
    """Train ``cfg.heads`` Medusa heads for the frozen ``cfg.target`` and publish them; see the module doc."""
    from infer.train.common import LoopState, configure_threads, loop_settings, pick_device, run_loop, say

    wall_start = time.perf_counter()
    device = pick_device(cfg.device)
    configure_threads(device, cfg.threads)
    data = _CachedTarget(cfg, device, progress) if cfg.uses_cache() else _LiveTarget(cfg, device, progress)

    torch.manual_seed(cfg.seed)
    medusa = MedusaHeads.from_target(data.lm_head, cfg.heads, cfg.num_layers, tree_size=cfg.tree_size,
                                     top_k=cfg.top_k, target=str(cfg.target))
    medusa.to(device)
    train_projection = cfg.trains_projection()
    for head in medusa.heads:
        head.lm_head.requires_grad_(train_projection)  # type: ignore[union-attr]
    trainable = [p for p in medusa.parameters() if p.requires_grad]
    say(f"{cfg.heads} Medusa heads, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable parameters "
        f"({'own' if train_projection else 'the target LM head as their shared, frozen'} vocabulary projection"
        f"{'s' if train_projection else ''}), for a {data.target_params / 1e6:.2f}M target on {device}", progress)

    before, _ = data.evaluate(medusa)
    say(f"held-out loss before training: {sum(before) / cfg.heads:.4f}", progress)

    def step_fn() -> tuple[torch.Tensor, dict[str, float]]:
        losses = data.losses(medusa)
        return torch.stack(losses).mean(), {f"head{k}": float(loss.detach()) for k, loss in enumerate(losses)}

    def eval_fn() -> dict[str, float]:
        losses, accuracy = data.evaluate(medusa)
        return {"loss": sum(losses) / cfg.heads, **{f"top1_head{k}": row[0] for k, row in enumerate(accuracy)}}

    settings = loop_settings(cfg, data.tokens_per_step, checkpoint_every=0)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = run_loop(model=medusa, optimizer=optimizer, settings=settings, step_fn=step_fn, eval_fn=eval_fn,
                     state=LoopState(), save_checkpoint=None, progress=progress, desc="medusa")

    final, rank_accuracy = data.evaluate(medusa)
    medusa.config.rank_accuracy = rank_accuracy
    medusa.config.training = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "resolved": {**data.resolved, "train_projection": train_projection},
        "steps": state.step, "tokens": state.tokens, "train_time_s": round(state.elapsed, 1),
        "heldout_loss_before": sum(before) / cfg.heads, "heldout_loss_after": sum(final) / cfg.heads,
        "heldout_loss_per_head": final,
    }
    out = cfg.out if cfg.out is not None else default_heads_dir(str(cfg.target))
    medusa.to(torch.float32).save(out)
    top1 = ", ".join(f"{row[0]:.3f}" for row in rank_accuracy)
    say(f"saved {out} ({state.step} steps, {state.elapsed:.0f}s training, {time.perf_counter() - wall_start:.0f}s "
        f"total): held-out loss {sum(before) / cfg.heads:.4f} -> {sum(final) / cfg.heads:.4f}, top-1 accuracy "
        f"per head [{top1}]", progress)
    return MedusaTrainResult(out=out, steps=state.step, train_time=state.elapsed,
                             initial_loss=sum(before) / cfg.heads, final_loss=sum(final) / cfg.heads,
                             head_losses=final, rank_accuracy=rank_accuracy,
                             train_losses=[float(e["loss"]) for e in state.log])


# ------------------------------------------------------------------------------------------- CLI

_RENAMES = {"layers": "num_layers"}
_NOT_CONFIG = {"func", "quiet", "freeze_projection", "train_projection"}


def add_medusa_parser(train_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``medusa`` to ``infer train``'s subcommands (flags as for pretrain/distill)."""
    p: argparse.ArgumentParser = train_subparsers.add_parser(
        "medusa", help="train Medusa heads for a frozen target (used by --speculator medusa)",
        description="Train Medusa heads on a frozen target; they are saved to TARGET/medusa by default.")
    p.add_argument("--target", required=True, help="target: model folder, .gguf file or built-in model name")
    p.add_argument("--heads", type=int, default=None, help="number of heads = tokens guessed ahead (default 4)")
    p.add_argument("--out", default=None, help="heads folder (default: TARGET/medusa; for a single-file model "
                                                  "~/.cache/infer/drafters/<model>/medusa)")
    p.add_argument("--objective", default=None, choices=OBJECTIVES,
                   help="distill: the target's own predictions (default); ce: the corpus's future tokens")
    p.add_argument("--layers", type=int, default=None, help="residual blocks per head (default 1)")
    p.add_argument("--freeze-projection", action="store_true",
                   help="keep each head's vocabulary projection equal to the target's LM head")
    p.add_argument("--tree-size", type=int, default=None, help=f"candidate tree nodes per round (default {DEFAULT_TREE_SIZE})")
    p.add_argument("--top-k", type=int, default=None, help=f"most candidates per head in the tree (default {DEFAULT_TOP_K})")
    p.add_argument("--train-projection", action="store_true",
                   help="give each head its own trainable copy of the LM head (default for infer's own models)")
    p.add_argument("--corpus", nargs="+", action="extend", default=None, metavar="PATH",
                   help="run the target live on these texts (default for infer's own models: their corpus)")
    p.add_argument("--teacher-cache", default=None, metavar="DIR|auto",
                   help="train from a teacher cache with hidden states (`infer train cache`); auto: build or reuse "
                        "the default one (the default for a model infer did not train)")
    p.add_argument("--max-train-chars", type=int, default=None)
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per training window (default: the target's)")
    g.add_argument("--batch-size", type=int, default=None, help="windows per step (default 8)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW, warm-up + cosine; default 1e-3)")
    g.add_argument("--warmup-steps", type=int, default=None)
    g.add_argument("--max-steps", type=int, default=None, help="default 500 unless --time-budget is given")
    g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop after this much training time (with --max-steps: whichever comes first)")
    g.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=None, help="cpu, cuda or auto (default)")
    g.add_argument("--precision", default=None, choices=["auto", "float32", "bfloat16"],
                   help="auto (default): bfloat16 autocast on CUDA, float32 on CPU")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available cores)")
    g.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_run_medusa)
    return p


def config_from_args(args: argparse.Namespace) -> MedusaTrainConfig:
    fields = MedusaTrainConfig.__dataclass_fields__
    kwargs = {_RENAMES.get(k, k): v for k, v in vars(args).items() if k not in _NOT_CONFIG and v is not None}
    kwargs = {k: v for k, v in kwargs.items() if k in fields}
    if "time_budget" in kwargs and "max_steps" not in kwargs:
        kwargs["max_steps"] = None  # time-limited only
    if args.freeze_projection and args.train_projection:
        raise ValueError("--freeze-projection and --train-projection contradict each other")
    if args.freeze_projection or args.train_projection:
        kwargs["train_projection"] = bool(args.train_projection)
    return MedusaTrainConfig(**kwargs)


def _run_medusa(args: argparse.Namespace) -> int:
    result = train_medusa(config_from_args(args), progress=not args.quiet)
    print(json.dumps({"out": str(result.out), "steps": result.steps, "train_time_s": round(result.train_time, 1),
                      "heldout_loss_before": round(result.initial_loss, 4),
                      "heldout_loss_after": round(result.final_loss, 4),
                      "top1_accuracy": [round(a, 4) for a in result.top1_accuracy]}))
    return 0

