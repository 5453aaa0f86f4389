"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request turns target logits into tokens.

    ``temperature == 0`` means greedy decoding. Every transform (penalty, temperature, top-k,
    top-p, min-p) maps logits to a probability distribution; speculative decoding applies the very
    same transform to draft and target so rejection sampling compares like with like.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
                 "must be an integer >= 1")
        _require(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0 (0 means greedy)")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
                 "must be an integer >= 0 (0 disables it)")
        _require(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _require(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _require(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                 "must be a list of non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 self.stop_token_ids, "must be a list of non-negative token ids")
        _require(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "must be an integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")
