"""Engine configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPECULATORS = ("draft", "ngram", "medusa")
LENGTH_POLICIES = ("fixed", "entropy", "goodput")
KV_BACKENDS = ("paged", "slotted")
TREE_ATTENTION = ("sdpa", "flex")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_batch_size: int = 8
    max_seq_len: int | None = None  # None: the model's max_position_embeddings, capped at 4096
    kv_cache_backend: str = "paged"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: enough for max_batch_size full-length sequences
    chunked_prefill: bool = True
    max_prefill_tokens: int = 512  # per-step prompt-token budget when chunked prefill is on
    prefix_caching: bool = False
    max_queue: int = 256  # waiting requests beyond this are refused (the server answers 429)
    # Speculative decoding
    use_speculative_decoding: bool = False
    speculator: str | None = None  # draft | ngram | medusa
    draft_model: str | None = None
    spec_length: int = 5
    spec_length_policy: str = "fixed"
    gamma_min: int = 1
    gamma_max: int | None = None  # None: spec_length (entropy) or 2 * spec_length (goodput)
    entropy_threshold: float = 0.5  # normalised draft entropy above which the entropy policy stops drafting
    ngram_min: int = 1
    ngram_max: int = 4
    medusa_heads: str | None = None  # folder of trained Medusa heads (default: <model>/medusa)
    # Tree nodes verified per round. None: up to the heads' configured tree, sized each round by
    # measured tokens per second (speculative/tree_sizer.py); a number: exactly that tree, always.
    medusa_tree_size: int | None = None
    # Tree verification kernel: SDPA with the dense boolean mask, or FlexAttention with a block mask
    # (compiled on CUDA; on CPU it runs eagerly and is only a slower reference).
    tree_attention: str = "sdpa"

    def __post_init__(self) -> None:
        if self.draft_model is not None and self.speculator is None:
            self.speculator = "draft"  # a draft model alone implies draft-model speculation
        if self.speculator is not None:
            self.use_speculative_decoding = True
        if self.use_speculative_decoding and self.speculator is None:
            raise ValueError("speculative decoding needs a drafter: set draft_model, or speculator='ngram'")
        if self.speculator is not None and self.speculator not in SPECULATORS:
            raise ValueError(f"speculator={self.speculator!r} is invalid: use one of {', '.join(SPECULATORS)}")
        if self.speculator == "draft" and self.draft_model is None:
            raise ValueError("speculator='draft' needs draft_model (a path to the draft checkpoint)")
        if self.spec_length < 1:
            raise ValueError(f"spec_length={self.spec_length} is invalid: must be >= 1")
        if self.spec_length_policy not in LENGTH_POLICIES:
            raise ValueError(f"spec_length_policy={self.spec_length_policy!r} is invalid: use one of "
                             f"{', '.join(LENGTH_POLICIES)}")
        if self.gamma_min < 0 or (self.gamma_max is not None and self.gamma_max < max(1, self.gamma_min)):
            raise ValueError(f"gamma_min={self.gamma_min}, gamma_max={self.gamma_max} are invalid: "
                             "need 0 <= gamma_min <= gamma_max, gamma_max >= 1")
        if not 0.0 < self.entropy_threshold <= 1.0:
            raise ValueError(f"entropy_threshold={self.entropy_threshold} is invalid: must be in (0, 1]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max} are invalid: "
                             "need 1 <= ngram_min <= ngram_max")
        if self.kv_cache_backend not in KV_BACKENDS:
            raise ValueError(f"kv_cache_backend={self.kv_cache_backend!r} is invalid: use paged or slotted")
        if self.prefix_caching and self.kv_cache_backend != "paged":
            raise ValueError("prefix_caching needs kv_cache_backend='paged'")
        for name in ("max_batch_size", "block_size", "max_prefill_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} is invalid: must be >= 2")
        if self.medusa_tree_size is not None and self.medusa_tree_size < 1:
            raise ValueError(f"medusa_tree_size={self.medusa_tree_size} is invalid: must be >= 1")
        if self.tree_attention not in TREE_ATTENTION:
            raise ValueError(f"tree_attention={self.tree_attention!r} is invalid: use sdpa or flex")
        if self.tree_attention == "flex":
            from infer.models.layers import flex_available

            if not flex_available():
                raise ValueError(f"tree_attention='flex' needs torch.nn.attention.flex_attention (torch "
                                 f">= 2.5); this is torch {torch.__version__}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is invalid: must be >= 1")

    @property
    def max_draft_length(self) -> int:
        """The most tokens one round may draft (the bound every cache must leave room for)."""
        if self.gamma_max is not None:
            return self.gamma_max
        return 2 * self.spec_length if self.spec_length_policy == "goodput" else self.spec_length
