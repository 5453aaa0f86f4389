"""Structured output: a grammar (JSON Schema, any JSON object, regex, Lark/EBNF) restricts every token.

Constrained sampling draws from the target's distribution restricted to the tokens the grammar
allows next, renormalised: the sampling transform sets forbidden logits to -inf before anything
else (``probs_from_logits(..., allowed=...)``). The grammar engine is llguidance (see "Grammar
engine" in docs/benchmarks.md for why): it compiles the grammar against the tokenizer and answers,
per state, a bitmask of allowed tokens; it can roll back tokens and validate a run of tokens.

Each request with a grammar owns a :class:`GrammarMatcher` whose state always matches the tokens
the request has emitted (``Request.append_token`` feeds it). Speculative rounds ask it, without
changing that state, which drafted nodes the grammar allows (a forbidden node and its subtree are
dropped before verification) and for the allowed-token mask at every verified position.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# JSON is laid out as json.dumps writes it ({"a": 1, "b": [2, 3]}): with free whitespace between
# tokens a weak model can emit newlines and spaces until max_tokens, never closing the object.
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint: ``json`` (a JSON Schema, as a dict or its JSON text), ``json_object``
    (any JSON object), ``regex``, or ``grammar`` (a Lark grammar, llguidance's EBNF dialect; a GBNF
    grammar, recognised by its ``::=`` rules, is converted)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in ("json", "regex", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            chosen.append("json_object")
        if len(chosen) != 1:
            raise ValueError("SamplingParams.structured_output must set exactly one of json, json_object, regex, "
                             f"grammar; got {chosen or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as err:
                    raise ValueError(f"SamplingParams.structured_output.json is not valid JSON: {err}") from None
            if not isinstance(schema, dict):
                raise ValueError("SamplingParams.structured_output.json must be a JSON Schema object, got "
                                 f"{type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SamplingParams.structured_output.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "grammar") if getattr(self, name) is not None)

    @classmethod
    def coerce(cls, value: StructuredOutput | dict[str, Any]) -> StructuredOutput:
        if isinstance(value, StructuredOutput):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"json", "json_object", "regex", "grammar"})
            if unknown:
                raise ValueError(f"SamplingParams.structured_output has unknown keys {unknown}; "
                                 "expected one of json, json_object, regex, grammar")
            return cls(**value)
        raise ValueError(f"SamplingParams.structured_output must be a StructuredOutput or a dict, "
                         f"got {type(value).__name__}")


class GrammarCompiler:
    """Compiles ``StructuredOutput`` against one tokenizer; the tokenizer's token table is built on
    first use (about a second for a 49k vocabulary) and kept."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        """``tokenizer``: the ``tokenizers.Tokenizer``; ``vocab_size``: the model's (logit rows),
        which may exceed the tokenizer's; the extra ids are never allowed."""
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = _ll_tokenizer(self.tokenizer, self.eos_token_ids, self.vocab_size)
        return self._ll_tokenizer

    def grammar_text(self, spec: StructuredOutput) -> str:
        import llguidance

        matcher = llguidance.LLMatcher
        if spec.json_object:
            return str(matcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT))
        if spec.json is not None:
            try:
                return str(matcher.grammar_from_json_schema(spec.json, JSON_LAYOUT))
            except ValueError as err:
                raise ValueError(f"SamplingParams.structured_output.json is invalid: {err}") from None
        if spec.regex is not None:
            return str(matcher.grammar_from_regex(spec.regex))
        assert spec.grammar is not None
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(spec.grammar) if "::=" in spec.grammar else spec.grammar
        except Exception as err:  # the converter raises plain Exceptions for a bad GBNF grammar
            raise ValueError(f"SamplingParams.structured_output.grammar is invalid: {err}") from None
        return str(matcher.grammar_from_lark(lark))

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher; ValueError naming the field when the grammar or schema is invalid."""
        import llguidance

        # The constructor compiles the grammar and never raises: a bad one leaves it in its error state.
        ll = llguidance.LLMatcher(self.ll_tokenizer, self.grammar_text(spec), log_level=0)
        if ll.is_error():
            raise ValueError(f"SamplingParams.structured_output.{spec.kind} is invalid: {ll.get_error().strip()}")
        return GrammarMatcher(ll, (int(self.ll_tokenizer.vocab_size) + 31) // 32, self.eos_token_ids)


class GrammarMatcher:
    """One request's grammar state: the allowed-token mask now and along drafted paths."""

    def __init__(self, matcher: Any, words: int, eos_token_ids: Sequence[int]) -> None:
        self._m = matcher
        self.words = words  # bitmask width: 32 tokens per int32
        self.eos_token_ids = frozenset(eos_token_ids)

    def consume(self, token: int) -> None:
        """The request emitted ``token``. A refusal puts the matcher in its error state, which the
        next mask reports (inside the engine step, so only this request fails)."""
        self._m.consume_token(token)

    def _fill(self, out: torch.Tensor) -> None:
        _fill(self._m, out)

    def bitmask(self) -> torch.Tensor:
        """[words] int32: bit t of the mask set = token t allowed next."""
        out = torch.empty(self.words, dtype=torch.int32)
        self._fill(out)
        return out

    def draft_bitmasks(self, tokens: Sequence[int], parents: Sequence[int] | None) -> tuple[list[bool], torch.Tensor]:
        """Which drafted nodes the grammar allows, and the mask at each verification row.

        ``tokens`` are the nodes of a chain (``parents`` None: node i's parent is i - 1) or of a tree
        (``parents[i]``, -1 for the root). A node is kept when its token is allowed after its path
        and its parent is kept. Returns ``keep`` [N] and bitmasks [N + 1, words]: row 0 after the
        emitted tokens, row i + 1 after node i's path (all ones for a dropped node, which the caller
        removes). The matcher's state is unchanged on return.

        The walk consumes each kept node's token and rolls it back when it leaves the node, except
        an EOS token: llguidance does not always record EOS in its rollback history (consumed once
        the grammar is complete, it is a no-op; ended by a lexeme, it is scanned away), so a
        rollback after it would undo an earlier token instead. EOS and everything drafted below
        it (``ignore_eos``) are walked on a copy of the matcher, which is then dropped.
        """
        count = len(tokens)
        parents = list(range(-1, count - 1)) if parents is None else list(parents)
        kids: list[list[int]] = [[] for _ in range(count + 1)]
        for i in range(count):
            kids[parents[i] + 1].append(i)
        keep = [False] * count
        masks = torch.full((count + 1, self.words), -1, dtype=torch.int32)
        # (pass row, how many of its children were visited, the matcher in that row's state, whether
        # leaving the row rolls the main matcher back one token)
        stack: list[tuple[int, int, Any, bool]] = [(0, 0, self._m, False)]
        self._fill(masks[0])
        try:
            while stack:
                row, visited, matcher, undo = stack[-1]
                if visited == len(kids[row]):
                    stack.pop()
                    if undo:
                        matcher.rollback(1)
                    continue
                stack[-1] = (row, visited + 1, matcher, undo)
                node = kids[row][visited]
                token = int(tokens[node])
                if not _allowed(masks[row], token):
                    continue
                child, undo = (matcher.deep_copy(), False) if token in self.eos_token_ids else (matcher, True)
                if not child.consume_token(token):
                    raise RuntimeError(f"grammar matcher refused allowed token {token}: {child.get_error()}")
                keep[node] = True
                _fill(child, masks[node + 1])
                stack.append((node + 1, 0, child, undo))
        except BaseException:
            for _, _, matcher, undo in reversed(stack):
                if undo:
                    matcher.rollback(1)
            raise
        return keep, masks


def _fill(matcher: Any, out: torch.Tensor) -> None:
    """Write ``matcher``'s allowed-token bitmask into ``out`` [words] int32."""
    if matcher.is_error():
        raise RuntimeError(f"grammar matcher failed: {matcher.get_error()}")
    matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return 0 <= token < 32 * bitmask.shape[-1] and bool((int(bitmask[token >> 5]) >> (token & 31)) & 1)


def unpack_bitmasks(bitmasks: torch.Tensor, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[..., words] int32 bitmasks -> [..., vocab_size] bool on ``device`` (32 * words >= vocab_size)."""
    bits = bitmasks.to(device).unsqueeze(-1) & _BITS.to(device)
    return (bits != 0).flatten(-2)[..., :vocab_size]


def _ll_tokenizer(tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int) -> Any:
    """llguidance's view of the vocabulary: from the ``tokenizer.json`` when llguidance reads its
    decoder (byte-level BPE, SentencePiece byte fallback), else each token's text decoded alone."""
    import llguidance

    n_vocab = max(vocab_size, int(tokenizer.get_vocab_size(with_added_tokens=True)))
    eos = list(eos_token_ids)
    try:
        return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos)
    except (ValueError, RuntimeError):
        pass
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_DecodedVocabulary(tokenizer, eos, n_vocab)),
                                  n_vocab=n_vocab, eos_token=eos)


class _DecodedVocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, specials, and an encode function."""

    def __init__(self, tokenizer: Any, eos: list[int], n_vocab: int) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = None
        added = {int(i) for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        tokens = []
        for i in range(n_vocab):
            text = tokenizer.id_to_token(i)
            if i in added or text is None:  # llguidance marks special tokens with a leading 0xff byte
                tokens.append(b"\xff" + (text or f"<unused_{i}>").encode())
            else:
                tokens.append(tokenizer.decode([i], skip_special_tokens=False).encode())
        self.tokens = tokens
        self.special_token_ids = sorted(added | {i for i in range(n_vocab) if tokenizer.id_to_token(i) is None})
        self._by_first: dict[int, list[int]] = {}
        special = set(self.special_token_ids)
        for i, data in enumerate(tokens):
            if data and i not in special:
                self._by_first.setdefault(data[0], []).append(i)

    def __call__(self, text: str) -> list[int]:
        """Greedy longest match over the token texts, stopping at text no token starts: llguidance
        tokenizes forced text with it, and an unknown-token id here would force a wrong token."""
        data, out, at = text.encode(), [], 0
        while at < len(data):
            best = max((i for i in self._by_first.get(data[at], []) if data.startswith(self.tokens[i], at)),
                       key=lambda i: len(self.tokens[i]), default=None)
            if best is None:
                break
            out.append(best)
            at += len(self.tokens[best])
        return out
