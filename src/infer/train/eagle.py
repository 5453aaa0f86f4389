"""Train an EAGLE-3 head on a frozen target: ``infer train eagle --target MODEL``.

Data: the teacher cache (``infer.train.teacher``) the Medusa and distillation trainers use; for a
model infer did not train that is the target's own answers to varied instructions, with its top-k
next-token distributions at every position and the three layer inputs the head reads
(``models.layers.AuxCapture``), both from one pass of the target loaded as the engine loads it (a
GGUF's quantized blocks stay quantized): the default cache for a head is built with them. A cache
built without them (``--teacher-cache`` naming one made for Medusa) costs one more pass over its
windows to capture the states, saved beside the cache so a resumed run, or another run on the same
cache, does not recompute them.

Training-time test (EAGLE-3): the head is unrolled ``ttt_steps`` times over each window. Step 0
reads the target's fused states; step s > 0 reads the head's own outputs of step s - 1 with the
tokens s positions further on, and row t of step s sits at position t + s, seeing step 0's keys up to
t and its own keys of steps 1..s: exactly what a depth-s node of a draft tree sees at inference. Each
step is taught the target's distribution at its position (soft cross-entropy over the draft
vocabulary, the target's top-k mass renormalised to it), weighted 0.8^s, on answer positions.

The draft vocabulary is the ``draft_vocab_size`` most frequent tokens of the training windows (fewer
when the windows hold fewer distinct tokens). The
head is saved in the published EAGLE-3 layout (``models.eagle3``) to ``<target drafters>/eagle``
(``~/.cache/infer/drafters/<model>/eagle`` for a GGUF or built-in model), where ``--speculator
eagle`` looks. The loop (budgets, progress bar, resumable checkpoints with ``--resume``) is
``infer.train.common``'s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import KW_ONLY, asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from infer.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from infer.train.common import TrainRunConfig

STEP_DECAY = 0.8  # weight of training-time-test step s: 0.8^s (later steps matter less, and are harder)


@dataclass
class EagleTrainConfig(TrainRunConfig):
    target: str
    out: Path | None = None  # default: <target drafters>/eagle
    teacher_cache: str | None = None  # a teacher cache folder, or None/"auto": the default one (built if missing)
    draft_vocab_size: int = 8192  # capped at the target's vocabulary
    ttt_steps: int = 3  # training-time-test unroll: the head learns from its own outputs this many steps deep
    max_windows: int | None = 512  # training windows read from the cache (their aux states stay in memory)
    resume: bool = False
    checkpoint_every: float = 120.0  # seconds between resumable checkpoints (<= 0: never)
    _: KW_ONLY
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 5  # a CPU run takes few steps
    weight_decay: float = 0.0
    max_steps: int | None = 400
    eval_windows: int = 32

    def __post_init__(self) -> None:
        from infer.train.common import uses_bf16

        uses_bf16(torch.device("cpu"), self.precision)
        self.target = str(self.target)
        if self.out is not None:
            self.out = Path(self.out).expanduser()
        for name in ("draft_vocab_size", "ttt_steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"max_windows={self.max_windows} must be >= 1")


@dataclass
class EagleTrainResult:
    out: Path
    steps: int
    train_time: float
    initial: dict[str, float]  # held-out loss and per-step top-1 agreement before training
    final: dict[str, float]  # ... after


@dataclass
class Features:
    """Training windows with the target's captured states: tokens [N, W], answer [N, W] bool,
    topk_ids [N, W, k], topk_logprobs [N, W, k], aux [N, W, 3 * hidden] (bfloat16)."""

    tensors: dict[str, torch.Tensor]

    @property
    def count(self) -> int:
        return int(self.tensors["tokens"].shape[0])

    def batch(self, index: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        t = self.tensors
        return {"tokens": t["tokens"][index].long(), "answer": t["answer"][index].bool(),
                "topk_ids": t["topk_ids"][index].long(), "topk_logprobs": t["topk_logprobs"][index].float(),
                "aux": t["aux"][index].float()}


def capture_features(target: Any, windows: Any, limit: int | None, layers: tuple[int, ...], batch_size: int,
                     progress: bool, desc: str) -> Features:
    """The cache's first ``limit`` windows with the target's states entering ``layers``."""
    from infer.models.layers import AuxCapture
    from infer.train.common import progress_bar

    count = windows.num_windows if limit is None else min(limit, windows.num_windows)
    parts: list[torch.Tensor] = []
    width = int(windows.tensors["tokens"].shape[1]) if count else 0
    bar = progress_bar(total=count * width, desc=desc, unit="tok", disable=not progress, dynamic_ncols=True)
    with torch.inference_mode():
        for start in range(0, count, batch_size):
            tokens = windows.tensors["tokens"][start: min(count, start + batch_size)].long()
            aux = AuxCapture(layers)
            target(tokens, aux=aux)
            parts.append(aux.result().to(torch.bfloat16))
            bar.update(tokens.numel())
    bar.close()
    tensors = {k: windows.tensors[k][:count] for k in ("tokens", "answer", "topk_ids", "topk_logprobs")}
    tensors["aux"] = torch.cat(parts)
    return Features(tensors)


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``tokens`` (ties by id), sorted; never a token the
    windows do not hold (it would get no training signal, only cost every step)."""
    counts = torch.bincount(tokens.flatten().long(), minlength=vocab_size)
    seen = int((counts > 0).sum())
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[: max(1, min(size, seen))]), dtype=torch.long)


def head_for(target: Any, layers: tuple[int, ...], draft_ids: torch.Tensor, seed: int) -> Eagle3Head:
    """A fresh head shaped like one layer of ``target``, starting from the target's own features rather
    than noise: ``fc`` passes the highest captured layer's state through, the layer's output projections
    are zero (the layer adds nothing yet), and the norm and vocabulary projection are the target's own
    (the rows of the draft vocabulary); the other projections are random. (Measured on SmolLM2, this
    starts the held-out loss lower than an all-random head; it still has everything to learn, since the
    state at t describes token t + 1 and the head must guess t + 2.)"""
    c = target.config
    config = Eagle3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                          num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                          head_dim=c.head_dim, vocab_size=c.vocab_size, draft_vocab_size=len(draft_ids),
                          target_hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                          rope_scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings,
                          aux_layers=layers)
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                param.normal_(0.0, 0.02)
        hidden = c.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * hidden:] = torch.eye(hidden)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.lm_head.weight.copy_(target.lm_head.weight.detach()[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight.detach())
    head.set_vocabulary(draft_ids)
    return head


def ttt_loss(head: Eagle3Head, embed: Any, batch: dict[str, torch.Tensor], steps: int) -> tuple[torch.Tensor, list[float], list[float]]:
    """The training-time-test loss of one batch, and per step the loss and the top-1 agreement with the
    target's argmax (answer positions)."""
    tokens, aux, answer = batch["tokens"], batch["aux"], batch["answer"]
    batch_size, width = tokens.shape
    rows = width - 1
    layer = head.midlayer
    attn = layer.self_attn
    groups = attn.heads // attn.kv_heads
    scale = attn.head_dim ** -0.5
    draft_of = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=tokens.device)
    draft_of[head.target_ids] = torch.arange(head.config.draft_vocab_size, device=tokens.device)
    t = torch.arange(rows, device=tokens.device)
    causal = t.unsqueeze(1) >= t.unsqueeze(0)  # [T, T]
    state = head.fc(aux[:, :rows])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = torch.zeros((), device=tokens.device)
    weight_sum = 0.0
    losses: list[float] = []
    agree: list[float] = []
    for s in range(steps):
        shifted = torch.zeros(batch_size, rows, dtype=torch.long, device=tokens.device)
        shifted[:, : rows - s] = tokens[:, s + 1:]
        positions = (t + s).unsqueeze(0).expand(batch_size, -1)
        cos, sin = head.rope(positions, state.dtype)
        q, k, v, residual = layer.qkv(embed(shifted).to(state.dtype), state, cos, sin)
        q = q.transpose(1, 2)  # [B, heads, T, D]
        k = k.transpose(1, 2).repeat_interleave(groups, dim=1)
        v = v.transpose(1, 2).repeat_interleave(groups, dim=1)
        keys.append(k)
        values.append(v)
        scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, s + 1)]
        weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = weights[..., :rows] @ values[0]
        for i in range(1, s + 1):
            out = out + weights[..., rows + i - 1: rows + i] * values[i]
        hidden = layer.finish(residual, out.transpose(1, 2))
        # Row t of step s predicts the token after position t + s + 1: the teacher at t + s + 1.
        target_ids = torch.zeros_like(batch["topk_ids"][:, :rows])
        target_lp = torch.full_like(batch["topk_logprobs"][:, :rows], float("-inf"))
        keep = torch.zeros(batch_size, rows, dtype=torch.bool, device=tokens.device)
        target_ids[:, : rows - s] = batch["topk_ids"][:, s + 1:]
        target_lp[:, : rows - s] = batch["topk_logprobs"][:, s + 1:]
        keep[:, : rows - s] = answer[:, s + 1:]
        draft_ids = draft_of[target_ids]  # [B, T, k]; -1 outside the draft vocabulary
        inside = draft_ids >= 0
        p = torch.where(inside, target_lp.exp(), torch.zeros_like(target_lp))
        mass = p.sum(-1, keepdim=True)
        keep = keep & (mass.squeeze(-1) > 0)
        p = p / mass.clamp_min(1e-12)
        # The vocabulary projection (most of a step's cost) only on the positions the loss counts.
        logq = torch.log_softmax(head.logits(hidden[keep]).float(), dim=-1)  # [K, draft vocab]
        ce = -(p[keep] * logq.gather(-1, draft_ids[keep].clamp_min(0))).sum(-1)
        count = max(int(keep.sum()), 1)
        step_loss = ce.sum() / count
        total = total + STEP_DECAY ** s * step_loss
        weight_sum += STEP_DECAY ** s
        losses.append(float(step_loss.detach()))
        guess = head.target_ids[logq.argmax(-1)]
        agree.append(float((guess == target_ids[keep][:, 0]).sum()) / count)
        state = hidden
    return total / weight_sum, losses, agree


def target_states(cfg: EagleTrainConfig, cache: Any, layers: tuple[int, ...], model_type: str, device: torch.device,
                  progress: bool) -> tuple[Features, Features]:
    """The training and held-out windows of ``cache`` with the target's states entering ``layers``: the
    cache's own when it was built with them (one pass gave the distributions and the states), else read
    from beside the cache when an earlier run captured them, else captured and saved there."""
    from infer.loader import load_model
    from infer.train.common import say

    if cache.manifest.get("aux_layers") == list(layers):
        keys = ("tokens", "answer", "topk_ids", "topk_logprobs", "aux")

        def first(windows: Any, limit: int | None) -> Features:
            return Features({k: windows.tensors[k][:limit] for k in keys})

        return first(cache.train, cfg.max_windows), first(cache.heldout, cfg.eval_windows)

    # The captured states live beside the teacher cache they come from, so another run (a resumed one,
    # other training settings) reuses them.
    digest = hashlib.sha256(json.dumps([cfg.target, cache.manifest.get("settings_hash"), list(layers),
                                        cfg.max_windows, cfg.eval_windows]).encode()).hexdigest()[:12]
    features_file = cache.folder / f"eagle-states-{digest}.pt"
    if features_file.is_file():
        saved = torch.load(features_file, weights_only=True)
        say(f"target states found at {features_file}", progress)
        return Features(saved["train"]), Features(saved["heldout"])
    say(f"capturing {model_type} target states entering layers {list(layers)} over the teacher cache "
        f"{cache.folder}", progress)
    # The states come from the target as the engine loads it (a GGUF's blocks on the quantized kernels):
    # what the head reads when it drafts.
    served, _ = load_model(cfg.target, dtype=torch.float32, device=str(device))
    train = capture_features(served, cache.train, cfg.max_windows, layers, cfg.batch_size, progress, "states")
    heldout = capture_features(served, cache.heldout, cfg.eval_windows, layers, cfg.batch_size, progress,
                               "held-out states")
    del served
    tmp = features_file.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"train": train.tensors, "heldout": heldout.tensors}, tmp)
    os.replace(tmp, features_file)
    return train, heldout


def heldout_figures(head: Eagle3Head, embed: Any, heldout: Features, steps: int, batch_size: int,
                    device: torch.device) -> dict[str, float]:
    """The held-out training-time-test loss and each step's top-1 agreement with the target, mean over
    batches (the head left in training mode)."""
    head.eval()
    sums, batches = [0.0] * (1 + steps), 0
    losses = 0.0
    with torch.no_grad():
        for start in range(0, heldout.count, batch_size):
            batch = {k: v.to(device) for k, v in heldout.batch(slice(start, start + batch_size)).items()}
            loss, _, agree = ttt_loss(head, embed, batch, steps)
            losses += float(loss)
            for s, a in enumerate(agree):
                sums[s] += a
            batches += 1
    head.train()
    n = max(batches, 1)
    return {"loss": losses / n, **{f"top1_step{s}": sums[s] / n for s in range(steps)}}


def train_eagle(cfg: EagleTrainConfig, progress: bool = True) -> EagleTrainResult:
    """Train an EAGLE-3 head for ``cfg.target`` and publish it (see the module doc)."""
    from infer.loader import load_config, load_model
    from infer.speculative.eagle import default_head_dir
    from infer.train.common import (
        Checkpointer,
        LoopState,
        configure_threads,
        loop_settings,
        pick_device,
        run_loop,
        say,
    )
    from infer.train.distill import teacher_cache_for
    from infer.train.teacher import CacheSampler, TeacherCache, read_manifest

    wall_start = time.perf_counter()
    device = pick_device(cfg.device)
    configure_threads(device, cfg.threads)
    out = cfg.out if cfg.out is not None else default_head_dir(cfg.target)
    # The default cache for a head holds the states it reads, from the pass that gives the distributions
    # (and not the final hidden states, which only Medusa heads read).
    layers = default_aux_layers(load_config(cfg.target).num_hidden_layers)
    folder = teacher_cache_for(cfg, device, progress, aux_layers=layers, hidden_states=False)
    manifest = read_manifest(folder)
    cache = TeacherCache(folder, aux=manifest.get("aux_layers") == list(layers))
    # Float weights (a GGUF's blocks dequantized): the head's initial norm and vocabulary projection, and
    # the embeddings it trains with.
    target, tconfig = load_model(cfg.target, dtype=torch.float32, device=str(device), fuse=False, pack=False,
                                 quantization="none")
    target.requires_grad_(False)
    identity = {"target": cfg.target, "teacher": cache.manifest.get("settings_hash"), "layers": list(layers),
                **{k: v for k, v in asdict(cfg).items() if k not in ("max_steps", "time_budget", "resume", "out",
                                                                    "threads", "device", "checkpoint_every")}}
    checkpoint = Checkpointer(out, identity)
    resuming = cfg.resume and checkpoint.exists()
    train, heldout = target_states(cfg, cache, layers, tconfig.model_type, device, progress)
    if resuming:
        say(f"resuming from {checkpoint.path}", progress)
    if not heldout.tensors["answer"].any():  # a tiny cache's held-out windows may hold prompts only
        say("the held-out windows hold no answer positions: evaluating on all their positions", progress)
        heldout.tensors["answer"] = torch.ones_like(heldout.tensors["answer"])
    draft_ids = draft_vocabulary(train.tensors["tokens"], tconfig.vocab_size, cfg.draft_vocab_size)
    head = head_for(target, layers, draft_ids, cfg.seed).to(device)
    embed = target.model.embed_tokens
    trainable = [p for p in head.parameters() if p.requires_grad]
    say(f"EAGLE-3 head: {sum(p.numel() for p in trainable) / 1e6:.2f}M parameters, draft vocabulary "
        f"{len(draft_ids)} of {tconfig.vocab_size}, {train.count} training windows of {train.tensors['tokens'].shape[1]} "
        f"tokens, training-time test {cfg.ttt_steps} steps", progress)
    sampler = CacheSampler(train.count, cfg.batch_size, cfg.seed + 1)

    def evaluate() -> dict[str, float]:
        return heldout_figures(head, embed, heldout, cfg.ttt_steps, cfg.batch_size, device)

    def step_fn() -> tuple[torch.Tensor, dict[str, float]]:
        batch = {k: v.to(device) for k, v in train.batch(sampler.sample()).items()}
        loss, per_step, _ = ttt_loss(head, embed, batch, cfg.ttt_steps)
        return loss, {f"step{s}": v for s, v in enumerate(per_step)}

    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = LoopState()
    if resuming:
        sampler_state, state = checkpoint.load(head, optimizer, device)
        sampler.load_state_dict(sampler_state)
    before = evaluate()
    say("held-out before: " + ", ".join(f"{k} {v:.4f}" for k, v in before.items()), progress)
    settings = loop_settings(cfg, cfg.batch_size * train.tensors["tokens"].shape[1], cfg.checkpoint_every)
    state = run_loop(model=head, optimizer=optimizer, settings=settings, step_fn=step_fn, eval_fn=evaluate,
                     state=state, save_checkpoint=lambda s: checkpoint.save(head, optimizer, sampler.state_dict(), s),
                     progress=progress, desc="eagle")
    after = evaluate()
    head.config.training = {
        "target": cfg.target, "teacher_cache": str(folder), "steps": state.step, "tokens": state.tokens,
        "train_time_s": round(state.elapsed, 1), "sessions": state.sessions, "ttt_steps": cfg.ttt_steps, "windows": train.count,
        "heldout_before": before, "heldout_after": after,
    }
    head.to(torch.float32).save(out)
    checkpoint.remove()
    say(f"saved {out} ({state.step} steps, {state.elapsed:.0f}s training, {time.perf_counter() - wall_start:.0f}s "
        "total): held-out " + ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in after), progress)
    return EagleTrainResult(out=out, steps=state.step, train_time=state.elapsed, initial=before, final=after)


# ------------------------------------------------------------------------------------------- CLI


def add_eagle_parser(train_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``eagle`` to ``infer train``'s subcommands."""
    p: argparse.ArgumentParser = train_subparsers.add_parser(
        "eagle", help="train an EAGLE-3 head for a frozen target (used by --speculator eagle)",
        description="Train an EAGLE-3 head on the target's own answers (the teacher cache); it is saved in the "
                    "vLLM/SGLang layout to TARGET/eagle, or ~/.cache/infer/drafters/<model>/eagle for a GGUF or "
                    "built-in model.")
    p.add_argument("--target", required=True, help="target: model folder, .gguf file or built-in model name")
    p.add_argument("--out", default=None, help="head folder (default: where --speculator eagle looks)")
    p.add_argument("--teacher-cache", default=None, metavar="DIR|auto",
                   help="a teacher cache (`infer train cache`); auto (default): build or reuse the default one")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary (default 8192)")
    p.add_argument("--ttt-steps", type=int, default=None, help="training-time-test unroll depth (default 3)")
    p.add_argument("--max-windows", type=int, default=None, help="training windows used (default 512)")
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=int, default=None, help="windows per step (default 4)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    g.add_argument("--warmup-steps", type=int, default=None)
    g.add_argument("--max-steps", type=int, default=None, help="default 400 unless --time-budget is given")
    g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop after this much training time (with --max-steps: whichever comes first)")
    g.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    g.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS",
                   help="seconds between resumable checkpoints (default 120)")
    g.add_argument("--resume", action="store_true", help="continue an interrupted run from its checkpoint")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=None, help="cpu, cuda or auto (default)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available cores)")
    g.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_run_eagle)
    return p


def config_from_args(args: argparse.Namespace) -> EagleTrainConfig:
    fields = EagleTrainConfig.__dataclass_fields__
    kwargs = {k: v for k, v in vars(args).items() if k in fields and v is not None and k != "resume"}
    if "time_budget" in kwargs and "max_steps" not in kwargs:
        kwargs["max_steps"] = None
    return EagleTrainConfig(**kwargs, resume=bool(args.resume))


def _run_eagle(args: argparse.Namespace) -> int:
    result = train_eagle(config_from_args(args), progress=not args.quiet)
    print(json.dumps({"out": str(result.out), "steps": result.steps, "train_time_s": round(result.train_time, 1),
                      "heldout_before": {k: round(v, 4) for k, v in result.initial.items()},
                      "heldout_after": {k: round(v, 4) for k, v in result.final.items()}}))
    return 0 if all(math.isfinite(v) for v in result.final.values()) else 1
