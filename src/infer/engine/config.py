"""Engine configuration, validated on construction."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

import torch

from infer.cache import KV_BACKENDS
from infer.sampling.grammar import GrammarLimits
from infer.speculative.suffix import SCOPES as SUFFIX_SCOPES

SPECULATORS = ("draft", "ngram", "medusa", "suffix", "eagle")
# Drafters without a model: a draft costs only its verification row, so goodput may draft as far as
# a match goes (a copied passage or function) by default, up to this many tokens a round.
MODEL_FREE = ("ngram", "suffix")
MODEL_FREE_MAX_DRAFT = 32
LENGTH_POLICIES = ("fixed", "entropy", "goodput")
TREE_ATTENTION = ("sdpa", "flex")
EAGLE_MAX_TREE = 64  # most nodes an EAGLE-3 round verifies (the measured size stays at or below it)


@dataclass
class SpeculativeConfig:
    """Which drafter proposes tokens and how much each round speculates.

    Each field is the flat option of the same name (``LLM(...)`` keyword, ``--flag-with-dashes``).
    ``speculator`` names the drafter. ``spec_length_policy`` sets the budget controller
    (``infer.speculative.budget``): ``goodput`` (the default) picks 0..``spec_length_limit`` per
    request and round by measured cost and the request's own acceptance, so speculation that does
    not pay stops within a few rounds; ``fixed`` drafts ``spec_length`` tokens a round; ``entropy`` drafts
    at least ``spec_length_min`` and up to ``spec_length_limit`` and stops a chain once the draft
    model is unsure (n-gram guesses carry no distribution, so there it drafts like ``fixed``).
    Medusa's tree size is chosen by the same controller, up to the heads' tree, unless
    ``medusa_tree_size`` fixes it; the draft length then only caps the tree's depth. Suffix
    decoding's draft length is its tree's depth, chosen like a chain's; its node count is its own
    (at most ``suffix_tree_size``). EAGLE-3 grows a tree of up to ``eagle_tree_size`` nodes per round
    (None: sized each round by the controller, up to ``EAGLE_MAX_TREE``), at most the draft length deep.
    """

    speculator: str  # one of SPECULATORS
    draft_model: str | None = None
    spec_length: int = 5
    spec_length_policy: str = "goodput"
    spec_length_min: int = 1  # entropy: tokens drafted before the draft model's entropy may stop a chain
    # None: spec_length (entropy), or for goodput 2 * spec_length (a draft model, Medusa's depth) or
    # MODEL_FREE_MAX_DRAFT (n-gram, suffix).
    spec_length_max: int | None = None
    entropy_threshold: float = 0.5  # normalised draft entropy above which the entropy policy stops drafting
    ngram_min: int = 1
    ngram_max: int = 4
    medusa_heads: str | None = None  # folder of trained Medusa heads (default: medusa/ in loader.hub.drafters_dir)
    # Tree nodes verified per round. None: up to the heads' configured tree, sized each round by the
    # budget controller; a number: exactly that tree, always.
    medusa_tree_size: int | None = None
    eagle_head: str | None = None  # EAGLE-3 head folder (default: eagle/ in loader.hub.drafters_dir)
    # Tree nodes verified per EAGLE-3 round. None: up to EAGLE_MAX_TREE, sized each round by the budget
    # controller; a number: exactly that many (fewer only where the context or the request ends).
    eagle_tree_size: int | None = None
    # Suffix decoding: a tree of at most suffix_tree_size nodes per round from the longest earlier
    # occurrence (up to suffix_max_match tokens) of the request's suffix; finished requests are kept
    # up to suffix_max_tokens / suffix_max_requests (oldest evicted first) and shared among requests
    # with the same cache_salt ("salt"), or not shared at all ("request").
    suffix_tree_size: int = 32
    suffix_max_match: int = 16
    suffix_min_prob: float = 0.1
    suffix_max_tokens: int = 65536
    suffix_max_requests: int = 1024
    suffix_scope: str = "salt"
    # The draft model's weights (loader.quantized): its own checkpoint's format by default (auto), or
    # quantized at load like the target's --quantization (a Q4_0 copy of the target drafting for it).
    draft_quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.speculator not in SPECULATORS:
            raise ValueError(f"speculator={self.speculator!r} is invalid: use one of {', '.join(SPECULATORS)}")
        if self.speculator == "draft" and self.draft_model is None:
            raise ValueError("speculator='draft' needs draft_model (a path to the draft checkpoint)")
        if self.spec_length < 1:
            raise ValueError(f"spec_length={self.spec_length} is invalid: must be >= 1")
        if self.spec_length_policy not in LENGTH_POLICIES:
            raise ValueError(f"spec_length_policy={self.spec_length_policy!r} is invalid: use one of "
                             f"{', '.join(LENGTH_POLICIES)}")
        if self.spec_length_policy == "entropy" and self.speculator in ("medusa", "eagle"):
            raise ValueError("spec_length_policy='entropy' stops a drafted chain once the draft model is unsure; "
                             f"{dict(medusa='Medusa', eagle='EAGLE-3')[self.speculator]} drafts a whole tree per "
                             "round: use fixed or goodput")
        if self.spec_length_min < 0 or (self.spec_length_max is not None
                                        and self.spec_length_max < max(1, self.spec_length_min)):
            raise ValueError(f"spec_length_min={self.spec_length_min}, spec_length_max={self.spec_length_max} are "
                             "invalid: need 0 <= spec_length_min <= spec_length_max, spec_length_max >= 1")
        if not 0.0 < self.entropy_threshold <= 1.0:
            raise ValueError(f"entropy_threshold={self.entropy_threshold} is invalid: must be in (0, 1]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max} are invalid: "
                             "need 1 <= ngram_min <= ngram_max")
        if self.medusa_tree_size is not None and self.medusa_tree_size < 1:
            raise ValueError(f"medusa_tree_size={self.medusa_tree_size} is invalid: must be >= 1")
        if self.eagle_tree_size is not None and not 1 <= self.eagle_tree_size <= EAGLE_MAX_TREE:
            raise ValueError(f"eagle_tree_size={self.eagle_tree_size} is invalid: must be in 1..{EAGLE_MAX_TREE}")
        for name in ("suffix_tree_size", "suffix_max_match"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        for name in ("suffix_max_tokens", "suffix_max_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 0")
        if not 0.0 < self.suffix_min_prob <= 1.0:
            raise ValueError(f"suffix_min_prob={self.suffix_min_prob} is invalid: must be in (0, 1]")
        from infer.loader.quantized import check_quantization

        check_quantization(self.draft_quantization, "draft_quantization")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ValueError(f"suffix_scope={self.suffix_scope!r} is invalid: use one of {', '.join(SUFFIX_SCOPES)}")

    @property
    def spec_length_limit(self) -> int:
        """The most tokens one round may draft in a chain (the bound every cache must leave room for):
        ``spec_length_max``, or what the policy implies without it."""
        if self.spec_length_max is not None:
            return self.spec_length_max
        if self.spec_length_policy != "goodput":
            return self.spec_length
        return MODEL_FREE_MAX_DRAFT if self.speculator in MODEL_FREE else 2 * self.spec_length


# The flat options (CLI flags, ``LLM(...)`` keywords) that make a SpeculativeConfig: its fields, by name.
SPECULATIVE_OPTIONS = frozenset(f.name for f in fields(SpeculativeConfig))


def prefix_caching_on(prefix_caching: bool | None, kv_cache_backend: str) -> bool:
    """Whether prefix caching runs: as asked, or by default (None) wherever the pool is paged."""
    return kv_cache_backend == "paged" if prefix_caching is None else prefix_caching


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_batch_size: int = 8
    # None: the model's max_position_embeddings, lowered if one sequence's KV would not fit the KV budget
    max_seq_len: int | None = None
    kv_cache_backend: str = "paged"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: max_batch_size full-length sequences, within the KV budget
    # The default KV budget: this fraction of the memory free once the weights are loaded (GPU memory
    # on CUDA, MemAvailable on CPU). It bounds max_seq_len and num_kv_blocks when they are not given.
    kv_memory_fraction: float = 0.5
    chunked_prefill: bool = True
    max_prefill_tokens: int = 512  # per-step prompt-token budget when chunked prefill is on
    # Reuse the KV blocks of prompt prefixes seen before (a conversation's earlier turns, a shared system
    # prompt). None: on where the KV pool can share blocks (paged); True with another pool is an error.
    prefix_caching: bool | None = None
    max_queue: int = 256  # waiting requests beyond this are refused (the server answers 429)
    # What one request's grammar or JSON Schema may ask of the grammar engine (sampling.grammar.GrammarLimits,
    # which declares the defaults and what each bounds); past a limit the request is refused (a 400).
    grammar_max_bytes: int = GrammarLimits.max_bytes
    grammar_max_rules: int = GrammarLimits.max_rules
    grammar_max_depth: int = GrammarLimits.max_depth
    grammar_max_ref_chain: int = GrammarLimits.max_ref_chain
    grammar_max_regex_bytes: int = GrammarLimits.max_regex_bytes
    grammar_max_enum: int = GrammarLimits.max_enum
    grammar_compile_timeout_s: float = GrammarLimits.compile_timeout_s
    speculative: SpeculativeConfig | None = None  # None: plain decoding
    # Grammar drafting: a request with structured output drafts the tokens its grammar forces (keys,
    # quotes, braces, enum values), with any speculator or none, verified like any draft.
    grammar_drafting: bool = True
    # Tree verification kernel: SDPA with the dense boolean mask, or FlexAttention with a block mask
    # (compiled on CUDA; on CPU it runs eagerly and is only a slower reference).
    tree_attention: str = "sdpa"
    # Exact-greedy kernels (backends.exact): a token's logits are bit-identical whatever pass
    # computes them, so greedy speculation emits exactly plain decoding's tokens in any dtype.
    exact_greedy: bool = False
    # torch.compile the target's (and draft model's) forward pass (backends.compiled); off: eager.
    compile: bool = False
    # CUDA only: replay decode steps and chain verifications as CUDA graphs (backends.cuda_graphs).
    cuda_graphs: bool = False
    # What computes the forward pass (infer.backends): auto, torch or cpu-kernels. auto picks the
    # fastest this machine runs; naming one it cannot run is an error that says why.
    backend: str = "auto"
    # The target's weights (loader.quantized): auto keeps a GGUF's quantized blocks quantized and float
    # weights float; none dequantizes everything; q8_0/q4_0/q4_1/q5_0 quantize float weights at load.
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_backend not in KV_BACKENDS:
            raise ValueError(f"kv_cache_backend={self.kv_cache_backend!r} is invalid: use one of "
                             f"{', '.join(KV_BACKENDS)}")
        if self.prefix_caching and self.kv_cache_backend != "paged":
            raise ValueError("prefix_caching needs kv_cache_backend='paged'")
        self.prefix_caching = prefix_caching_on(self.prefix_caching, self.kv_cache_backend)
        for name in ("max_batch_size", "block_size", "max_prefill_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} is invalid: must be >= 2")
        if self.tree_attention not in TREE_ATTENTION:
            raise ValueError(f"tree_attention={self.tree_attention!r} is invalid: use one of "
                             f"{', '.join(TREE_ATTENTION)}")
        if self.tree_attention == "flex":
            from infer.models.layers import flex_available

            if not flex_available():
                raise ValueError(f"tree_attention='flex' needs torch.nn.attention.flex_attention (torch "
                                 f">= 2.5); this is torch {torch.__version__}")
        self.grammar_limits()  # ValueError naming a bad limit
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction} is invalid: must be in (0, 1]")
        if self.exact_greedy and self.tree_attention == "flex":
            raise ValueError("exact_greedy runs its own attention kernel; tree_attention='flex' cannot be combined "
                             "with it (use tree_attention='sdpa')")
        if self.compile and self.exact_greedy:
            raise ValueError("compile and exact_greedy cannot be combined: the exact-greedy kernels fix their "
                             "own reduction order, which a compiler's fusions would change")
        if self.cuda_graphs and (self.compile or self.exact_greedy):
            raise ValueError("cuda_graphs runs the eager model's passes as graphs; it cannot be combined with "
                             f"{'compile' if self.compile else 'exact_greedy'}")
        from infer.backends import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is invalid: use {', '.join(BACKENDS)}")
        from infer.loader.quantized import check_quantization

        check_quantization(self.quantization)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is invalid: must be >= 1")

    @property
    def speculate(self) -> bool:
        """Whether requests are drafted for (the ``speculate`` option, ``SamplingParams.speculate`` per
        request): a drafter is configured."""
        return self.speculative is not None

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(**{f.name: getattr(self, f"grammar_{f.name}") for f in fields(GrammarLimits)})

    @classmethod
    def from_options(cls, speculate: bool = False, **options: Any) -> EngineConfig:
        """An EngineConfig from flat options, the CLI flags' names (``speculator``, ``spec_length``, ...).

        A draft model alone implies ``speculator='draft'``; without a speculator the speculative
        options are ignored. ``speculate`` asks for speculation, an error without a drafter.
        """
        if "use_speculative_decoding" in options:
            # The option's old name, accepted with a warning for one release so callers can move.
            warnings.warn("use_speculative_decoding is now speculate; the old name will be removed",
                          DeprecationWarning, stacklevel=3)
            speculate = speculate or bool(options.pop("use_speculative_decoding"))
        spec = {k: options.pop(k) for k in list(options) if k in SPECULATIVE_OPTIONS}
        if spec.get("draft_model") is not None and spec.get("speculator") is None:
            spec["speculator"] = "draft"
        if speculate and spec.get("speculator") is None:
            raise ValueError("speculative decoding needs a drafter: set draft_model, or speculator='ngram'")
        unknown = set(options) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown engine options: {', '.join(sorted(unknown))}")
        speculative = SpeculativeConfig(**spec) if spec.get("speculator") is not None else None
        return cls(**options, speculative=speculative)
