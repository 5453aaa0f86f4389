"""Grammar and schema limits (issue 33): each limit refuses just past it and admits just under it,
the reference chains that overflowed llguidance's stack compile on the compiler threads, and the
GBNF converter and Lark/GBNF detection. Runs on the compiler directly (no model, no server)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from helpers import gbnf_chain, lark_chain, ref_chain
from infer.sampling.grammar import (
    GrammarCompiler,
    GrammarLimits,
    StructuredOutput,
    gbnf_to_lark,
    is_gbnf,
    json_depth,
)

LETTERS = "abcdexyz"


def letters_tokenizer() -> Any:
    """One token per letter, plus EOS (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["</s>", *LETTERS, "[", "]", "{", "}", '"', ":", ",", " ", "0", "1"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["</s>"])
    return tok


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return letters_tokenizer()


def compiler(tokenizer: Any, **limits: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, [0], tokenizer.get_vocab_size(), GrammarLimits(**limits))


def nested(depth: int) -> dict[str, Any]:
    """A schema whose JSON nests ``depth`` levels of objects."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def accepts(c: GrammarCompiler, spec: StructuredOutput, text: str) -> bool:
    """Whether the grammar lets ``text`` (one token per character) through and then EOS."""
    vocab = c.tokenizer.get_vocab()
    matcher = c.matcher(spec)
    for token in [vocab[ch] for ch in text] + [0]:
        if not (int(matcher.bitmask()[token >> 5]) >> (token & 31)) & 1:
            return False
        matcher.consume(token)
    return True


@pytest.mark.parametrize(("limit", "under", "over", "field"), [
    ("max_bytes", {"grammar": 'start: "' + "x" * 90 + '"'}, {"grammar": 'start: "' + "x" * 100 + '"'}, "grammar"),
    ("max_rules", {"grammar": lark_chain(99)}, {"grammar": lark_chain(100)}, "grammar"),  # + start
    ("max_rules", {"grammar": gbnf_chain(99)}, {"grammar": gbnf_chain(100)}, "grammar"),  # + root
    ("max_ref_chain", {"json": ref_chain(100)}, {"json": ref_chain(101)}, "json"),
    ("max_regex_bytes", {"regex": "x" * 100}, {"regex": "x" * 101}, "regex"),
    ("max_enum", {"json": {"enum": list(range(100))}}, {"json": {"enum": list(range(101))}}, "json"),
    ("max_depth", {"json": nested(100)}, {"json": nested(101)}, "json"),
    ("max_depth", {"json": json.dumps(nested(100))}, {"json": json.dumps(nested(101))}, "json"),
])
def test_each_limit_refuses_past_it_and_admits_under_it(tokenizer: Any, limit: str, under: dict[str, Any],
                                                        over: dict[str, Any], field: str) -> None:
    c = compiler(tokenizer, **{limit: 100})
    c.matcher(StructuredOutput(**under))
    with pytest.raises(ValueError, match=rf"structured_output\.{field} .*grammar_{limit}"):
        c.matcher(StructuredOutput(**over))


def nested_containers(count: int, kind: str) -> dict[str, Any]:
    """A schema of ``count`` objects (each the only property of the one outside) or arrays nested."""
    schema: dict[str, Any] = {"type": kind}
    for _ in range(count - 1):
        schema = ({"type": "object", "properties": {"a": schema}, "required": ["a"]} if kind == "object"
                  else {"type": "array", "items": schema})
    return schema


@pytest.mark.parametrize("kind", ["object", "array"])
@pytest.mark.parametrize("as_text", [False, True])
def test_max_depth_counts_nested_objects_and_arrays(tokenizer: Any, kind: str, as_text: bool) -> None:
    """Issue 54: --grammar-max-depth 64 admitted only 31 nested objects (the schema's "properties"
    maps counted as levels). N nested objects or arrays are admitted at N, refused at N + 1."""
    c = compiler(tokenizer)
    limit = c.limits.max_depth
    admitted, refused = nested_containers(limit, kind), nested_containers(limit + 1, kind)
    c.matcher(StructuredOutput(json=json.dumps(admitted) if as_text else admitted))
    with pytest.raises(ValueError, match=r"structured_output\.json is nested too deeply .*grammar_max_depth"):
        c.matcher(StructuredOutput(json=json.dumps(refused) if as_text else refused))


def test_a_property_named_like_a_keyword_is_a_schema_still(tokenizer: Any) -> None:
    """Under "properties", a name such as "properties" names a schema: its level counts."""
    inner: dict[str, Any] = {"type": "integer"}
    for _ in range(4):
        inner = {"type": "object", "properties": {"properties": inner}}
    compiler(tokenizer, max_depth=5).matcher(StructuredOutput(json=inner))
    with pytest.raises(ValueError, match="grammar_max_depth"):
        compiler(tokenizer, max_depth=4).matcher(StructuredOutput(json=inner))


def test_a_slow_compile_is_refused_naming_the_timeout(tokenizer: Any) -> None:
    c = compiler(tokenizer, compile_timeout_s=1e-9)
    with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
        c.matcher(StructuredOutput(grammar=lark_chain(2000)))


@pytest.mark.parametrize("spec", [{"grammar": lark_chain(3000)}, {"grammar": gbnf_chain(4000)},
                                  {"json": ref_chain(3000)}])
def test_chains_that_overflowed_the_stack_compile_on_the_compiler_threads(tokenizer: Any,
                                                                         spec: dict[str, Any]) -> None:
    # Before, each of these killed the process (a segmentation fault in llguidance on an 8 MB stack).
    c = compiler(tokenizer, max_rules=5000, max_ref_chain=5000)
    assert accepts(c, StructuredOutput(**spec), '"x"' if "json" in spec else "x")


def test_grammars_that_cannot_start_or_never_reach_a_schema_are_refused(tokenizer: Any) -> None:
    c = compiler(tokenizer)
    with pytest.raises(ValueError, match=r"regex cannot be matched: no text matches it"):
        c.matcher(StructuredOutput(regex=r"[^\s\S]"))
    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    with pytest.raises(ValueError, match="cycle that never reaches a schema"):
        c.matcher(StructuredOutput(json=cycle))
    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutput(json="[" * 50000)
    # Grammars that fail a few tokens in are walked into at admission (each was a 500 mid-request).
    with pytest.raises(ValueError, match=r"grammar cannot be matched after 1 token: .*Too many items"):
        c.matcher(StructuredOutput(grammar='start: "a" start'))
    with pytest.raises(ValueError, match=r"regex cannot be matched after \d tokens?"):
        c.matcher(StructuredOutput(regex="a{1000000}"))
    itself = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                                                   "required": ["a"]}}}
    with pytest.raises(ValueError, match=r"json cannot be matched after \d tokens?"):
        c.matcher(StructuredOutput(json=itself))
    # A recursive schema that does reach one is fine.
    tree = {"$ref": "#/$defs/t", "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}
    assert accepts(c, StructuredOutput(json=tree), "[[], []]")


def test_llguidance_errors_carry_no_parser_state(tokenizer: Any) -> None:
    with pytest.raises(ValueError) as err:
        compiler(tokenizer).matcher(StructuredOutput(grammar="start: undefined_rule"))
    assert "<state>" not in str(err.value) and "non-verbose" not in str(err.value) and len(str(err.value)) < 400


def test_lark_and_gbnf_are_told_apart_by_their_rules(tokenizer: Any) -> None:
    assert is_gbnf('root ::= "a"') and is_gbnf('# start: a comment\nroot ::= x\nx ::= "::="')
    assert not is_gbnf('start: "a" | "::="') and not is_gbnf('start: x\nx: "root ::= a"')
    c = compiler(tokenizer)
    assert accepts(c, StructuredOutput(grammar='start: "a" | "b" ":" "c"'), "b:c")


def test_gbnf_conversion_means_what_llguidance_converter_means(tokenizer: Any) -> None:
    from llguidance.gbnf_to_lark import gbnf_to_lark as reference

    grammars = ['root ::= ("a" | "b")+ tail\ntail ::= [x-z]{1,3} # a comment\n',
                '# header\nroot ::= item ("," item)*\nitem ::= "{" [a-e]? "}"\n',
                'root ::= Camel-case\nCamel-case ::= "x" sub\nsub ::= "y" | "z" sub\n']
    c = compiler(tokenizer)
    for grammar in grammars:
        ours, theirs = gbnf_to_lark(grammar), reference(grammar)
        strip = [line for line in theirs.splitlines() if line.strip() and not line.startswith("//")]
        assert [line for line in ours.splitlines() if line.strip()] == strip, (ours, theirs)
    assert accepts(c, StructuredOutput(grammar=grammars[0]), "abz")
    assert accepts(c, StructuredOutput(grammar=grammars[1]), "{a},{},{e}")


@pytest.mark.slow
def test_gbnf_conversion_is_linear_in_comment_lines() -> None:
    from llguidance.gbnf_to_lark import gbnf_to_lark as quadratic

    def grammar(lines: int) -> str:
        return "root ::= \"a\"\n" + "# a comment line of some length\n" * lines + 'x ::= "b"\n'

    def cpu_seconds(convert: Any, text: str) -> float:
        start = time.process_time()  # CPU time: other processes on a shared machine barely move it
        convert(text)
        return time.process_time() - start

    def growth(convert: Any, repeats: int) -> float:
        """Time for 8x the comment lines over the time for 1x (interleaved, fastest of each)."""
        small, large = grammar(8000), grammar(64000)
        runs = [(cpu_seconds(convert, small), cpu_seconds(convert, large)) for _ in range(repeats)]
        return min(b for _, b in runs) / min(a for a, _ in runs)

    cpu_seconds(gbnf_to_lark, grammar(1000))  # warm up
    # About 8 when linear; llguidance's own converter, which keeps the comments before a rule by
    # appending to a string attribute, grows about 20x here (the negative control).
    assert growth(gbnf_to_lark, 5) < 13
    assert growth(quadratic, 3) > 13  # fastest of 3 too: one noisy run cannot sink the control


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert json_depth('{"a": ["[[[", {"b": "]]]{"}]}') == 3
    assert json_depth("[" * 1000) == 1000 and json_depth('"[[["') == 0


def test_limits_are_engine_options_with_one_default() -> None:
    from dataclasses import fields

    from infer.engine.config import EngineConfig
    from infer.engine.options import OPTIONS, SERVING_OPTIONS

    config = EngineConfig(model="unused")
    assert config.grammar_limits() == GrammarLimits()
    for f in fields(GrammarLimits):
        assert f"grammar_{f.name}" in OPTIONS and f"grammar_{f.name}" in SERVING_OPTIONS
    with pytest.raises(ValueError, match="grammar_max_rules"):
        EngineConfig(model="unused", grammar_max_rules=0)
