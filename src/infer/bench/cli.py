"""``infer bench generation`` and ``infer bench serving``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from infer.backends import BACKENDS
from infer.bench import SPEC_LENGTH_SWEEP
from infer.bench.peer import EXPORT_TYPES, LLAMA_CPP_FILE_TYPES, QUANTIZERS
from infer.bench.quality import add_arguments as add_quality_arguments
from infer.bench.shapes import DEFAULT_TYPES, SHAPES
from infer.data.workloads import CHAT_WORKLOADS, WORKLOADS
from infer.engine.options import MODEL_OPTIONS, OPTIONS, add_engine_args

# The registry's model options load every infer row of infer bench generation alike (an option added
# there reaches the bench too), except those the bench varies across rows: it takes lists of draft
# lengths and tree sizes (a row each), and its --exact-greedy, --compiled and --cuda-graphs add twin
# rows rather than switching every row.
VARIED_BY_ROWS = ("speculate", "speculator", "spec_length", "spec_length_policy", "medusa_tree_size",
                  "exact_greedy", "compile", "cuda_graphs")
ROW_OPTIONS = tuple(name for name in MODEL_OPTIONS if name not in VARIED_BY_ROWS)
# Those BenchSettings has fields of its own for; the rest reach every row's LLM when set.
_SETTINGS_FIELDS = ("model", "dtype", "device", "draft_model", "medusa_heads", "eagle_head", "backend")


def add_subparser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (generation vs transformers; serving load)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    _add_generation_parser(kinds)
    _add_export_gguf_parser(kinds)
    _add_compile_parser(kinds)
    _add_step_parser(kinds)
    _add_shapes_parser(kinds)
    quality = kinds.add_parser("quality", help="quantized inference against the same file in float32: KL, perplexity, "
                                               "greedy agreement on held-out text, infer's kernels and llama.cpp's")
    add_quality_arguments(quality)
    quality.set_defaults(func=_run_quality)

    from infer.bench.agent import add_agent_parser

    add_agent_parser(kinds)
    try:
        from infer.bench.serving import add_serving_parser
    except ModuleNotFoundError:
        return
    add_serving_parser(kinds)


def _add_generation_parser(kinds: Any) -> None:
    gen = kinds.add_parser("generation", help="single-request decode: infer plain/speculative vs transformers")
    add_engine_args(gen, ROW_OPTIONS)
    # A benchmark names its precision and device: the same command measures the same thing on every
    # machine (the engine's auto would pick bfloat16 on some CPUs, float32 on others, or a GPU).
    gen.set_defaults(dtype="float32", device="cpu")
    gen.add_argument("--prompts", default=None, help="prompt file (JSON list, JSONL with 'prompt', or text split by ---)")
    gen.add_argument("--workload", default="code", choices=WORKLOADS,
                     help="built-in prompts: code continuation, input-grounded edit, code at temperature 1, one "
                     "instruction over many functions (answers end at EOS), or the shipped user messages (sent "
                     "through the chat template): open-ended chat, summary of a given passage, code-edit of given "
                     "code, short factual qa, math word problems worked step by step, translation of a passage, "
                     "rag (an answer quoting a given document), extract-json (named keys from a message)")
    gen.add_argument("--warmup", type=int, default=8,
                     help="repetitive workload: similar requests suffix decoding learns from before the timed ones")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message in the chat template")
    gen.add_argument("--num-prompts", type=int, default=4)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--stop-at-eos", action="store_true",
                     help="end each answer at EOS, as a server request does (default: --max-tokens past EOS, "
                          "every mode timed over the same length; the repetitive workload always stops)")
    gen.add_argument("--temperature", type=float, default=None, help="default 0 (1 for --workload sample)")
    gen.add_argument("--spec-length", type=int, nargs="+", default=list(SPEC_LENGTH_SWEEP),
                     help="the draft lengths swept: a fixed-K draft-model row each; n-gram, suffix and the policies "
                          "draft up to the largest (default: the engine's default K and two shorter)")
    gen.add_argument("--policies", nargs="*", default=["entropy", "goodput"], choices=["entropy", "goodput"])
    gen.add_argument("--no-ngram", action="store_true")
    gen.add_argument("--no-suffix", action="store_true", help="skip the suffix decoding row")
    gen.add_argument("--medusa-tree-size", type=int, nargs="*", default=[], metavar="N",
                     help="also rows with a fixed N-node tree (the default row sizes its tree by measurement)")
    gen.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    gen.add_argument("--repeats", type=int, default=3)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--exact-greedy", action="store_true",
                     help="also time every infer mode with exact-greedy kernels, interleaved with the default ones")
    gen.add_argument("--compiled", action="store_true",
                     help="also time every infer mode torch.compiled, interleaved with the eager ones (the first "
                     "run of each kind of pass compiles; the warm-up pays for it)")
    gen.add_argument("--cuda-graphs", action="store_true",
                     help="also time every infer mode with its decode and verification steps replayed as CUDA "
                          "graphs, interleaved with the eager ones (CUDA only; each bucket captures on first use)")
    gen.add_argument("--out", default="bench-out", help="folder for generation.json, generation.md and plots")
    gen.add_argument("--profile", action="store_true",
                     help="instead of the comparison, profile infer's decode steps and a (K+1)-token verification "
                          "pass (K = the largest --spec-length) on the first prompt: top operators by self CPU "
                          "time, operator calls per token, Chrome traces in --out")
    gen.add_argument("--profile-steps", type=int, default=32, help="decode steps and verification passes profiled")
    gen.add_argument("--peer", choices=["llama.cpp"], default=None,
                     help="add rows for another engine on the same prompts, interleaved with infer's "
                          "(llama.cpp: llama-cpp-python, pip install 'infer[peer]')")
    gen.add_argument("--peer-gguf", nargs="+", default=[], metavar="GGUF",
                     help="GGUF files of the same model the peer runs, a plain row each (the first is what "
                          "'vs llama.cpp' divides by, and gets the prompt lookup row)")
    gen.add_argument("--also-backend", nargs="*", default=[], choices=BACKENDS,
                     help="an extra 'infer plain (backend NAME)' row for each, interleaved with --backend's rows "
                          "(e.g. torch: the C kernels against the PyTorch layers on the same run)")
    gen.add_argument("--prefill-tokens", type=int, nargs="*", default=[], metavar="N",
                     help="also time prompt processing of an N-token prompt (prefill tok/s) on every plain row, "
                          "llama.cpp's beside infer's, interleaved (e.g. 512)")
    gen.add_argument("--context-tokens", type=int, nargs="*", default=[], metavar="N",
                     help="also time decoding after an N-token prompt (decode tok/s, prefill excluded) on every "
                          "plain row, llama.cpp's beside infer's, interleaved: attention over a long cache "
                          "(e.g. 1024)")
    gen.add_argument("--also-dtype", nargs="*", default=[], choices=["float32", "bfloat16", "float16"],
                     help="an extra 'infer plain (DTYPE)' row for each, next to --dtype's rows")
    gen.set_defaults(func=_run_generation)


def _add_export_gguf_parser(kinds: Any) -> None:
    export = kinds.add_parser("export-gguf", help="write a Hugging Face folder's weights as a GGUF (llama; BF16 unless "
                                                  "--type), metadata and tokenizer copied from a GGUF of the same model")
    export.add_argument("--model", required=True, help="Hugging Face model folder (safetensors)")
    export.add_argument("--like", required=True, help="a GGUF of the same model (e.g. the quantized file it came from)")
    export.add_argument("--out", required=True, help="the .gguf file to write")
    add_quantization_args(export, "BF16")
    export.set_defaults(func=_run_export_gguf)


def _add_compile_parser(kinds: Any) -> None:
    comp = kinds.add_parser("compile", help="measure torch.compile against infer's eager decode and verification "
                                            "passes: compile time, then interleaved ms per step (CPU)")
    add_engine_args(comp, ("model", "dtype", "backend"))
    comp.set_defaults(dtype="bfloat16")
    comp.add_argument("--verify-width", type=int, default=6)
    comp.add_argument("--steps", type=int, default=8, help="steps per timed block")
    comp.add_argument("--repeats", type=int, default=5)
    comp.add_argument("--out", default="bench-out", help="folder for compile.json")
    comp.set_defaults(func=_run_compile_eval)


def _add_step_parser(kinds: Any) -> None:
    step = kinds.add_parser("step", help="a decode step's and a speculative round's time by phase (model pass, "
                                         "sampling, scheduling, detokenization, drafting, verification, ...)")
    add_engine_args(step, ("model", "dtype", "backend", "eagle_head"))
    step.add_argument("--speculator", default="ngram", choices=["none", "draft", "ngram", "medusa", "suffix", "eagle"],
                      help="also split this drafter's rounds (none: the plain step only)")
    step.add_argument("--max-tokens", type=int, default=128)
    step.add_argument("--repeats", type=int, default=3)
    step.add_argument("--threads", type=int, default=None, help="torch's (and the kernels') thread count")
    step.add_argument("--cpu-time", action="store_true",
                      help="this thread's CPU time instead of wall time (a machine other processes keep busy)")
    step.add_argument("--json", default=None, help="write the per-request figures here")
    step.set_defaults(func=_run_step)


def _add_shapes_parser(kinds: Any) -> None:
    shapes = kinds.add_parser("shapes", help="random-weight models of Llama-3.2-1B's and 3B's shapes (SmolLM2's "
                                             "vocabulary) as a Hugging Face folder and GGUF files, for the peer tables")
    shapes.add_argument("--shape", nargs="+", default=["1b"], choices=sorted(SHAPES),
                        help="; ".join(f"{name}: {shape.description}" for name, shape in SHAPES.items()))
    add_quantization_args(shapes, *DEFAULT_TYPES)
    shapes.add_argument("--like", default=None,
                        help="the GGUF whose tokenizer and metadata the models get (default: the built-in SmolLM2)")
    shapes.add_argument("--seed", type=int, default=0)
    shapes.add_argument("--out", default=None, help="folder to write to (default: ~/.cache/infer/shapes): OUT/NAME "
                                                    "is the Hugging Face folder, OUT/NAME.TYPE.gguf each GGUF")
    shapes.set_defaults(func=_run_shapes)


def add_quantization_args(parser: argparse.ArgumentParser, *default: str) -> None:
    """--type (one GGUF file) or --types (several), and --quantizer."""
    flag, nargs = ("--type", None) if len(default) == 1 else ("--types", "+")
    parser.add_argument(flag, nargs=nargs, default=default[0] if nargs is None else list(default), metavar="TYPE",
                        help=f"GGUF type: {', '.join(EXPORT_TYPES)}; with llama.cpp's quantizer also "
                             f"{', '.join(t for t in LLAMA_CPP_FILE_TYPES if t not in EXPORT_TYPES)} "
                             f"(default: {' '.join(default)})")
    parser.add_argument("--quantizer", default="auto", choices=QUANTIZERS,
                        help="who quantizes: llama.cpp's quantizer (llama-cpp-python; auto: where installed), or "
                             "gguf-py (every matrix in the type, as llama-quantize --pure)")


def _run_generation(args: argparse.Namespace) -> int:
    from infer.bench.generation import BenchSettings, run_generation_bench
    from infer.bench.report import generation_table, write_generation_report
    from infer.data.workloads import load_prompts, repetitive_prompts, workload_prompts
    from infer.loader import resolve_device

    # The engine refuses it too, but only when the twin loads, after every other mode has loaded.
    if args.cuda_graphs and resolve_device(args.device).type != "cuda":
        raise ValueError(f"--cuda-graphs replays CUDA graphs: it needs --device cuda (this run is on {args.device})")
    repetitive = args.workload == "repetitive" and not args.prompts
    warmup: list[str] = []
    if args.prompts:
        prompts = load_prompts(args.prompts)
    elif repetitive:
        # Timed prompts first: they stay the same whatever the number of warm-up requests.
        prompts = repetitive_prompts(args.num_prompts + args.warmup)
        prompts, warmup = prompts[: args.num_prompts], prompts[args.num_prompts:]
    else:
        prompts = workload_prompts(args.workload, args.num_prompts)
    if args.profile:
        return _run_profile(args, prompts[0])
    from infer.speculative.medusa import default_heads_dir

    medusa = args.medusa_heads
    if medusa is None and (default_heads_dir(args.model) / "medusa_config.json").is_file():
        medusa = str(default_heads_dir(args.model))
    from infer.speculative.eagle import default_head_dir

    eagle = args.eagle_head
    if eagle is None and (default_head_dir(args.model) / "config.json").is_file():
        eagle = str(default_head_dir(args.model))
    temperature = args.temperature if args.temperature is not None else (1.0 if args.workload == "sample" else 0.0)
    settings = BenchSettings(
        model=args.model, draft_model=args.draft_model, prompts=prompts, workload=args.workload,
        max_tokens=args.max_tokens, temperature=temperature, spec_lengths=args.spec_length,
        policies=args.policies if args.draft_model else [], ngram=not args.no_ngram, medusa_heads=medusa, eagle_head=eagle,
        medusa_tree_sizes=args.medusa_tree_size, suffix=not args.no_suffix, hf=not args.no_transformers,
        repeats=args.repeats, dtype=args.dtype, device=args.device, seed=args.seed, exact_greedy=args.exact_greedy,
        compiled=args.compiled, cuda_graphs=args.cuda_graphs, backend=args.backend,
        peer=args.peer, peer_gguf=args.peer_gguf, extra_dtypes=args.also_dtype, extra_backends=args.also_backend, chat=args.chat or args.workload in CHAT_WORKLOADS,
        stop_at_eos=repetitive or args.stop_at_eos,
        warmup_prompts=warmup, prefill_tokens=args.prefill_tokens,
        context_tokens=args.context_tokens,
        engine_options={name: getattr(args, name) for name in ROW_OPTIONS
                        if name not in _SETTINGS_FIELDS and getattr(args, name) != OPTIONS[name].default()},
    )
    report = run_generation_bench(settings, say=lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    paths = write_generation_report(report, args.out)
    print(generation_table(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_profile(args: argparse.Namespace, prompt: str) -> int:
    from infer.bench.profile import profile_engine
    from infer.engine.llm import LLM

    if args.profile_steps < 1:
        raise SystemExit(f"--profile-steps {args.profile_steps} is invalid: must be >= 1")
    say = lambda msg: print(f"[profile] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"loading {args.model} ({args.dtype}, {args.device}, backend {args.backend})")
    options = {name: getattr(args, name) for name in ROW_OPTIONS if name not in ("model", "draft_model", "medusa_heads")}
    llm = LLM(args.model, max_batch_size=1, **({"prefix_caching": False} | options))
    phases = profile_engine(llm.engine, prompt, max(args.spec_length) + 1, args.profile_steps, args.out, say)
    for phase in phases:
        print("\n".join(phase.lines()) + "\n")
    print(f"wrote {Path(args.out) / 'profile.json'}")
    return 0


def _run_export_gguf(args: argparse.Namespace) -> int:
    from infer.bench.peer import write_gguf

    say = lambda msg: print(f"[export] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    print(f"wrote {write_gguf(args.model, args.like, args.out, args.type, args.quantizer, say)}")
    return 0


def _run_quality(args: argparse.Namespace) -> int:
    from infer.bench.quality import run_from_args

    return run_from_args(args)


def _run_shapes(args: argparse.Namespace) -> int:
    from infer.bench.shapes import default_shapes_dir, write_shape

    say = lambda msg: print(f"[shapes] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    out = args.out or default_shapes_dir()
    written = [path for name in args.shape for path in write_shape(
        name, out, tuple(args.types), like=args.like, seed=args.seed, quantizer=args.quantizer, say=say)]
    print("\n".join(str(p) for p in written))
    return 0


def _run_step(args: argparse.Namespace) -> int:
    from infer.bench.report import write_json
    from infer.bench.step import run_step_bench

    report = run_step_bench(args.model, args.dtype, args.backend, None if args.speculator == "none" else args.speculator,
                            args.max_tokens, args.repeats, args.cpu_time, args.threads, eagle_head=args.eagle_head)
    if args.json:
        write_json(args.json, report)
    return 0


def _run_compile_eval(args: argparse.Namespace) -> int:
    import json

    from infer.bench.compile_eval import compile_table, run_compile_eval
    from infer.data.workloads import code_prompts

    say = lambda msg: print(f"[compile] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    report = run_compile_eval(args.model, args.dtype, code_prompts(1)[0], args.verify_width, args.steps,
                              args.repeats, say, backend=args.backend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(report, indent=2))
    print(compile_table(report))
    print(f"wrote {out / 'compile.json'}")
    return 0
