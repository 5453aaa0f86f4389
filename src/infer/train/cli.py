"""``infer train``: pretrain, cache, distill, medusa, eagle, reference-pair.

    infer train pretrain --out DIR [--corpus PATH ...] [--vocab-size N] [--hidden-size N] [--layers N] ...
    infer train cache --target MODEL [--out DIR] [--prompts N] [--top-k K] ...   (a real target's distributions)
    infer train distill --target MODEL [--out DIR] [--layers N] ... [--teacher-cache DIR|auto]
    infer train medusa --target MODEL [--heads N] ... [--teacher-cache DIR|auto]
    infer train eagle --target MODEL [--ttt-steps N] ... [--teacher-cache DIR|auto] [--resume]
    infer train reference-pair [--size small|large] [--out DIR] [--force]

Flags left out take the defaults of ``PretrainConfig`` / ``TeacherCacheConfig`` / ``DistillConfig``.
With ``--time-budget`` and no ``--max-steps`` the run is limited by time only.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from infer.extras import require

# Flag -> config field (flags whose names differ from the field).
_RENAMES = {"layers": "num_layers", "heads": "num_heads", "kv_heads": "num_kv_heads",
            "tie_embeddings": "tie_word_embeddings"}
_NOT_CONFIG = {"func", "command", "train_command", "quiet", "force"}


def add_subparser(sub: Any) -> None:
    parser = sub.add_parser("train", help="train models: pretrain, cache, distill, medusa, eagle, reference-pair",
                            description=__doc__.splitlines()[0] if __doc__ else None)
    tsub = parser.add_subparsers(dest="train_command", required=True,
                                 metavar="{pretrain,cache,distill,medusa,eagle,reference-pair}")

    p = tsub.add_parser("pretrain", help="train a BPE tokenizer and a small Llama from scratch on a corpus")
    p.add_argument("--corpus", nargs="+", action="extend", default=None, metavar="PATH",
                   help="text files or folders (*.py, *.txt, *.md); default: the Python standard library")
    p.add_argument("--out", required=True, help="output model folder (Hugging Face format)")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default 4096)")
    _model_flags(p, "model")
    p.add_argument("--max-position-embeddings", type=int, default=None, help="context the config declares")
    p.add_argument("--max-train-chars", type=int, default=None,
                   help="train on a random subset of the corpus files of this many characters")
    _run_flags(p)
    p.set_defaults(func=_run_pretrain)

    c = tsub.add_parser("cache", help="run a target once over text and cache its top-k distributions "
                                      "(and hidden states) for training drafters")
    c.add_argument("--target", required=True, help="model folder, .gguf file or built-in model name")
    c.add_argument("--out", default=None, help="cache folder (default: ~/.cache/infer/teacher/<model>-<hash>)")
    c.add_argument("--source", default=None, choices=["auto", "self", "corpus"],
                   help="self: the target's answers to varied prompts; corpus: text files; auto (default): "
                        "corpus for a model infer trained, else self")
    c.add_argument("--corpus", nargs="+", action="extend", default=None, metavar="PATH")
    c.add_argument("--max-train-chars", type=int, default=None)
    c.add_argument("--prompts", dest="num_prompts", type=int, default=None, help="self: prompts answered (256)")
    c.add_argument("--max-new-tokens", type=int, default=None, help="self: longest answer (160)")
    c.add_argument("--gen-temperature", type=float, default=None, help="self: sampling temperature (0.7)")
    c.add_argument("--gen-min-p", type=float, default=None,
                   help="self: drop tokens below this share of the likeliest one's probability (0.05)")
    c.add_argument("--gen-batch-size", type=int, default=None, help="self: answers generated together (32)")
    c.add_argument("--gen-dtype", default=None, help="self: dtype for generating (auto)")
    c.add_argument("--seq-len", type=int, default=None, help="tokens per cached window (256)")
    c.add_argument("--top-k", type=int, default=None, help="tokens kept per position (32)")
    c.add_argument("--hidden-states", action=argparse.BooleanOptionalAction, default=None,
                   help="store the final hidden states, which Medusa heads train on (default: yes)")
    c.add_argument("--aux-layers", type=int, nargs="+", default=None, metavar="ID",
                   help="also store the states entering these layers, from the same pass (what an EAGLE-3 head "
                        "reads; `infer train eagle` builds its default cache with them)")
    c.add_argument("--max-windows", type=int, default=None, help="at most this many training windows (1024)")
    c.add_argument("--held-out-fraction", type=float, default=None,
                   help="share of the text held out for evaluation (0.05)")
    c.add_argument("--batch-size", type=int, default=None, help="windows per target forward (4)")
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="the target's dtype for the cached distributions (float32)")
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--device", default=None, help="cpu, cuda or auto (default)")
    c.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available cores)")
    c.add_argument("--force", action="store_true", help="rebuild even if a complete cache exists")
    c.add_argument("--quiet", action="store_true", help="no progress output")
    c.set_defaults(func=_run_cache)

    d = tsub.add_parser("distill", help="distil a small draft model from a target (KL on its distributions)")
    d.add_argument("--target", required=True, help="target: model folder, .gguf file or built-in model name")
    d.add_argument("--out", default=None, help="output draft model folder (default: TARGET/draft; for a "
                                               "single-file model ~/.cache/infer/drafters/<model>/draft, "
                                               "where `infer demo` finds it)")
    d.add_argument("--corpus", nargs="+", action="extend", default=None, metavar="PATH",
                   help="run the target live on these texts (default for infer's own models: their corpus)")
    d.add_argument("--teacher-cache", default=None, metavar="DIR|auto",
                   help="train from a teacher cache (`infer train cache`); auto: build or reuse the default one "
                        "(the default for a model infer did not train)")
    d.add_argument("--reuse-target-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share the target's embeddings and tied head (frozen) and start from its layers "
                        "(default: yes when training from a teacher cache)")
    d.add_argument("--exact-eval-windows", type=int, default=None,
                   help="held-out windows on which the live target measures the final alpha (8)")
    _model_flags(d, "draft")
    d.add_argument("--max-train-chars", type=int, default=None)
    d.add_argument("--temperature", type=float, default=None, help="distillation temperature T (default 1)")
    d.add_argument("--ce-weight", type=float, default=None,
                   help="add this times cross-entropy on the corpus tokens to the KL loss (default 0)")
    _run_flags(d)
    d.set_defaults(func=_run_distill)

    from infer.train.eagle import add_eagle_parser
    from infer.train.medusa import add_medusa_parser

    add_medusa_parser(tsub)
    add_eagle_parser(tsub)
    r = tsub.add_parser("reference-pair", help="build (or reuse) the cached reference target + draft pair")
    r.add_argument("--size", default="small", choices=["small", "large"])
    r.add_argument("--out", default=None, help="pair folder (default: ~/.cache/infer/reference-pair-SIZE)")
    r.add_argument("--force", action="store_true", help="rebuild even if a complete cached pair exists")
    r.add_argument("--device", default=None, help="cpu, cuda or auto (default)")
    r.add_argument("--quiet", action="store_true", help="no progress output")
    r.set_defaults(func=_run_reference_pair)
    for command in tsub.choices.values():  # say at once, not after minutes of tokenizer training
        command.set_defaults(func=_with_train_extra(command.get_default("func")))


def _with_train_extra(run: Any) -> Any:
    def checked(args: argparse.Namespace) -> int:
        require("tqdm", "train", "training")
        return int(run(args))

    return checked


def _model_flags(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_argument_group(f"{what} size")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--intermediate-size", type=int, default=None)
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share the input embedding and the output head (default: tied)")


def _run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per training window")
    g.add_argument("--batch-size", type=int, default=None, help="windows per step")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW, warm-up + cosine)")
    g.add_argument("--warmup-steps", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--max-steps", type=int, default=None, help="default 1000 unless --time-budget is given")
    g.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop after this much training time (with --max-steps: whichever comes first)")
    g.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    g.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS",
                   help="seconds between resumable checkpoints in OUT/.checkpoint (0: never)")
    g.add_argument("--keep-checkpoint", action="store_true", default=None,
                   help="keep OUT/.checkpoint after finishing, to continue training later")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=None, help="cpu, cuda or auto (default)")
    g.add_argument("--precision", default=None, choices=["auto", "float32", "bfloat16"],
                   help="auto (default): bfloat16 autocast on CUDA, float32 on CPU")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available cores)")
    g.add_argument("--resume", action="store_true", default=None,
                   help="continue from OUT/.checkpoint if present")
    g.add_argument("--quiet", action="store_true", help="no progress output")


def _config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {_RENAMES.get(k, k): v for k, v in vars(args).items() if k not in _NOT_CONFIG and v is not None}
    if "time_budget" in kwargs and "max_steps" not in kwargs:
        kwargs["max_steps"] = None  # time-limited only
    return kwargs


def _run_pretrain(args: argparse.Namespace) -> int:
    from infer.train.pretrain import PretrainConfig, pretrain

    result = pretrain(PretrainConfig(**_config_kwargs(args)), progress=not args.quiet)
    print(json.dumps({"out": str(result.path), "params": result.num_params, "steps": result.steps,
                      "tokens": result.tokens, "train_time_s": round(result.train_time, 1),
                      "heldout_loss": result.heldout.get("loss")}))
    return 0


def _run_cache(args: argparse.Namespace) -> int:
    from infer.train.teacher import MANIFEST_FILE, TeacherCacheConfig, build_teacher_cache, read_manifest

    folder = build_teacher_cache(TeacherCacheConfig(**_config_kwargs(args)), progress=not args.quiet,
                                 force=args.force)
    manifest = read_manifest(folder, MANIFEST_FILE)
    print(json.dumps({"out": str(folder), "source": manifest.get("source"), "windows": manifest.get("windows"),
                      "seq_len": manifest.get("seq_len"), "top_k": manifest.get("top_k"),
                      "answer_tokens": manifest.get("answer_tokens"), "source_stats": manifest.get("source_stats"),
                      "forward_tokens_per_s": manifest.get("forward_tokens_per_s"),
                      "wall_time_s": manifest.get("wall_time_s")}))
    return 0


def _run_distill(args: argparse.Namespace) -> int:
    from infer.train.distill import DistillConfig, distill

    result = distill(DistillConfig(**_config_kwargs(args)), progress=not args.quiet)
    h = result.heldout
    print(json.dumps({"out": str(result.path), "params": result.num_params, "steps": result.steps,
                      "tokens": result.tokens, "train_time_s": round(result.train_time, 1),
                      "heldout_kl": h.get("kl"), "alpha": h.get("alpha"),
                      "greedy_agreement": h.get("agreement_exact", h.get("agreement"))}))
    return 0


def _run_reference_pair(args: argparse.Namespace) -> int:
    from infer.train.reference import METRICS_FILE, build_reference_pair

    target, draft = build_reference_pair(size=args.size, out=args.out, force=args.force, progress=not args.quiet,
                                         device=args.device)
    metrics = json.loads((target.parent / METRICS_FILE).read_text())
    print(f"target  {target}  ({metrics['target_params'] / 1e6:.2f}M params)")
    print(f"draft   {draft}  ({metrics['draft_params'] / 1e6:.2f}M params)")
    print(f"alpha (expected acceptance at T=1)  {metrics['alpha']:.4f}")
    print(f"greedy agreement                    {metrics['greedy_agreement']:.4f}")
    print(f"held-out KL(target || draft)        {metrics['kl']:.4f}")
    print(f"held-out loss target / draft        {metrics['target_heldout_loss']:.4f} / "
          f"{metrics['draft_heldout_loss']:.4f}")
    print(f"forward time ratio target / draft   {metrics['forward_time_ratio']:.1f}x")
    print(f"build time                          {metrics['build_wall_time_s']:.0f}s")
    return 0
