"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from infer.sampling.grammar import StructuredOutput

# A temperature below this is greedy decoding: dividing logits by a smaller number overflows the
# float32 sampling transform (1e-45 is a float32 denormal, logits / 1e-45 = inf -> NaN
# probabilities), and the distribution is one-hot to float32 precision long before that.
GREEDY_TEMPERATURE = 1e-5
FLOAT32_MAX = 3.4028234663852886e38
# The repetition penalty divides or multiplies logits: outside these bounds a penalised logit
# divided by a temperature just above GREEDY_TEMPERATURE can leave float32's range.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
MAX_ADDITIVE_PENALTY = 2.0  # presence/frequency penalty bounds, as OpenAI's
MAX_LOGIT_BIAS = 100.0  # as OpenAI's: -100 bans a token, +100 all but forces it
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


@dataclass
class SamplingParams:
    """How one request turns target logits into tokens.

    ``temperature == 0`` (or any temperature below ``GREEDY_TEMPERATURE``) means greedy decoding. Every transform (penalty, temperature, top-k,
    top-p, min-p) maps logits to a probability distribution; speculative decoding applies the very
    same transform to draft and target so rejection sampling compares like with like. A
    ``structured_output`` grammar first removes the tokens it forbids (see ``sampling/grammar.py``).
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's: subtract presence_penalty from the logit of every token generated so far, and
    # frequency_penalty times the number of times it was generated (the prompt does not count).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # Restrict every token to a grammar (JSON Schema, any JSON object, regex, Lark): a
    # StructuredOutput, or a dict of its fields.
    structured_output: StructuredOutput | dict[str, Any] | None = None
    # Per generated token its log-probability and the ``logprobs`` likeliest alternatives (0: the
    # chosen token's alone; None: off), from the processed distribution (see
    # ``transforms.processed_logprobs``).
    logprobs: int | None = None
    # Per prompt token after the first, its log-probability given the tokens before it and the
    # ``prompt_logprobs`` likeliest alternatives, from the raw distribution (no processors: nothing
    # was sampled there). Such a request computes its whole prompt (no prefix-cache reuse).
    prompt_logprobs: int | None = None
    # Speculative decoding for this request (an engine without a drafter ignores both): off, or on
    # with at most ``max_draft_tokens`` draft tokens verified per round (None: the engine's policy
    # alone decides). Either way the output is what plain decoding gives; only the speed changes.
    speculate: bool = True
    max_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.structured_output is not None:
            self.structured_output = StructuredOutput.coerce(self.structured_output)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
                 "must be an integer >= 1")
        _require(_is_number(self.temperature) and 0.0 <= self.temperature <= FLOAT32_MAX, "temperature",
                 self.temperature, f"must be a finite number >= 0 (below {GREEDY_TEMPERATURE:g} means greedy)")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
                 "must be an integer >= 0 (0 disables it)")
        _require(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _require(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _require(_is_number(self.repetition_penalty)
                 and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                 "repetition_penalty", self.repetition_penalty,
                 f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and abs(value) <= MAX_ADDITIVE_PENALTY, name, value,
                     f"must be in [-{MAX_ADDITIVE_PENALTY:g}, {MAX_ADDITIVE_PENALTY:g}] (0 disables it)")
        self.logit_bias = dict(self.logit_bias or {})
        _require(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and _is_number(b)
                     and abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias.items()),
                 "logit_bias", self.logit_bias,
                 f"must map token ids (integers >= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                       and 0 <= value <= MAX_LOGPROBS),
                     name, value, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                 "must be a list of non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 self.stop_token_ids, "must be a list of non-negative token ids")
        _require(isinstance(self.speculate, bool), "speculate", self.speculate, "must be true or false")
        _require(self.max_draft_tokens is None or (isinstance(self.max_draft_tokens, int)
                                                   and not isinstance(self.max_draft_tokens, bool)
                                                   and self.max_draft_tokens >= 1),
                 "max_draft_tokens", self.max_draft_tokens,
                 "must be None or an integer >= 1 (speculate=False turns speculation off)")
        _require(self.seed is None or (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
                 "seed", self.seed, "must be None or a 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def counts_output(self) -> bool:
        """The transform reads how often each token was generated (presence/frequency penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_number(value: object) -> bool:
    """A real, finite number (bool excluded; NaN and infinities fail)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def short_repr(value: object, limit: int = 100) -> str:
    """``repr(value)`` cut to ``limit`` characters (and "…"): error messages name a bad value
    without echoing a megabyte of it back. Long containers are cut before ``repr`` runs."""
    if isinstance(value, int) and value.bit_length() > 4 * limit:  # repr of a huge int is slow, then refused
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, (list, tuple)) and len(value) > limit:
        value = value[:limit]
    elif isinstance(value, str) and len(value) > limit:
        value = value[: limit + 1]
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={short_repr(value)} is invalid: {rule}")
