"""Which grammar engine: per-token mask cost and JSON Schema coverage on a real vocabulary.

``python -m infer.bench.grammar_mask [--model smollm2-135m-instruct]`` walks each engine's matcher
through tokenized valid JSON documents, timing the allowed-token mask at every step (what
constrained decoding pays per generated token, per request), and checks a set of JSON Schema
features: each schema must compile, accept a valid document and refuse an invalid one.
Engines not installed are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "emails": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "emails", "address"], "additionalProperties": False}
PERSON_DOC = {"name": "Ada Lovelace", "age": 36, "emails": ["ada@example.com", "countess@lovelace.org"],
              "address": {"city": "London", "zip": "W1"}}

# (feature, schema, a valid document, an invalid document)
FEATURES: list[tuple[str, dict[str, Any], Any, Any]] = [
    ("required + additionalProperties:false", PERSON, PERSON_DOC, {"name": "x", "age": 1}),
    ("enum", {"enum": ["red", "green"]}, "red", "blue"),
    ("const", {"const": 3}, 3, 4),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "a", [1]),
    ("$ref / $defs", {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
     [1, 2], ["x"]),
    ("recursive $ref", {"$defs": {"t": {"type": "object", "properties": {"k": {"type": "array",
                                                                               "items": {"$ref": "#/$defs/t"}}},
                                        "required": ["k"], "additionalProperties": False}}, "$ref": "#/$defs/t"},
     {"k": [{"k": []}]}, {"k": [{}]}),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, "ab", "abcd"),
    ("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]+$"}, "ab-12", "ab12"),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [1], []),
    ("integer minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 5}, 5, 6),
    ("nullable type list", {"type": ["string", "null"]}, None, 1),
    ("format: date", {"type": "string", "format": "date"}, "2024-01-31", "yesterday"),
    ("oneOf", {"oneOf": [{"type": "boolean"}, {"type": "null"}]}, True, 0),
]


class Engine:
    """One grammar engine behind the three operations the benchmark needs."""

    name: str

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def mask(self, matcher: Any) -> None:
        raise NotImplementedError

    def consume(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def accepting(self, matcher: Any) -> bool:
        raise NotImplementedError


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=tokenizer.eos_token_ids)
        self.bitmask = self.llt.allocate_token_bitmask(1, self.tok.vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled, log_level=0)

    def mask(self, matcher: Any) -> None:
        self.llt.fill_next_token_bitmask(matcher, self.bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        vocab = tokenizer.get_vocab()
        encoded = [""] * len(vocab)
        for text, i in vocab.items():
            encoded[i] = text
        info = xgrammar.TokenizerInfo(encoded, vocab_type=xgrammar.VocabType.BYTE_LEVEL,
                                      stop_token_ids=tokenizer.eos_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.stop = tokenizer.eos_token_ids[0]
        self.bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated() or matcher.accept_token(self.stop))


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self, tokenizer: Any) -> None:
        import outlines_core

        self.oc = outlines_core
        eos = tokenizer.eos_token_ids[0]
        vocab = tokenizer.get_vocab()
        decoder = _byte_decoder()
        tokens: dict[str, list[int]] = {}
        for text, i in vocab.items():
            if i == eos:
                continue
            try:
                raw = bytes(decoder[c] for c in text).decode("utf-8", errors="strict")
            except (KeyError, UnicodeDecodeError):
                continue  # outlines-core's string vocabulary cannot hold partial UTF-8 tokens
            tokens.setdefault(raw, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, tokens)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def mask(self, matcher: Any) -> None:
        matcher.get_tokens()

    def consume(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token)
            return True
        except ValueError:
            return False

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_finished())


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (byte-level BPE vocabularies are written in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def walk(engine: Engine, compiled: Any, tokens: list[int]) -> tuple[list[float], bool]:
    """Mask then consume every token; the mask times and whether the document was accepted."""
    matcher = engine.matcher(compiled)
    times = []
    for token in tokens:
        start = time.perf_counter()
        engine.mask(matcher)
        times.append(time.perf_counter() - start)
        if not engine.consume(matcher, token):
            return times, False
    return times, engine.accepting(matcher)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from infer.loader import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    print(f"tokenizer of {args.model}: {tokenizer.vocab_size} tokens")
    makers: list[Callable[[Any], Engine]] = [LLGuidance, XGrammar, OutlinesCore]
    for make in makers:
        try:
            start = time.perf_counter()
            engine = make(tokenizer)
            setup = time.perf_counter() - start
        except ImportError as err:
            print(f"{make.__name__}: not installed ({err})")
            continue
        doc = json.dumps(PERSON_DOC)  # json.dumps's layout, which every engine's default whitespace allows
        tokens = tokenizer.encode(doc, add_special_tokens=False)
        start = time.perf_counter()
        compiled = engine.compile(PERSON)
        compile_s = time.perf_counter() - start
        samples: list[float] = []
        firsts: list[float] = []
        ok = True
        for _ in range(args.repeats):
            # A fresh matcher per walk; its first mask includes any lazy grammar work, so it is apart.
            times, accepted = walk(engine, compiled, tokens)
            firsts.append(times[0])
            samples += times[1:]
            ok &= accepted
        samples.sort()
        print(f"{engine.name}: tokenizer setup {setup * 1e3:.0f} ms, schema compile {compile_s * 1e3:.1f} ms, "
              f"first mask of a matcher median {statistics.median(firsts) * 1e6:.0f} us, then per token over "
              f"{len(tokens) - 1} tokens x {args.repeats}: median {statistics.median(samples) * 1e6:.0f} us, "
              f"p99 {samples[int(0.99 * (len(samples) - 1))] * 1e6:.0f} us, max {samples[-1] * 1e6:.0f} us; "
              f"document accepted: {ok}")
        passed = []
        for feature, schema, good, bad in FEATURES:
            try:
                compiled = engine.compile(schema)
                good_ok = walk(engine, compiled, tokenizer.encode(json.dumps(good), add_special_tokens=False))[1]
                bad_ok = walk(engine, compiled, tokenizer.encode(json.dumps(bad), add_special_tokens=False))[1]
                verdict = "ok" if good_ok and not bad_ok else f"valid accepted={good_ok}, invalid accepted={bad_ok}"
            except Exception as err:  # an engine that cannot compile the feature
                verdict = f"error: {str(err).splitlines()[0][:80]}"
            passed.append(verdict == "ok")
            if verdict != "ok":
                print(f"    {feature}: {verdict}")
        print(f"    JSON Schema features: {sum(passed)}/{len(passed)} correct")


if __name__ == "__main__":
    main()
