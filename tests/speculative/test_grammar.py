"""Structured output (``SamplingParams.structured_output``) and its exactness under speculation.

* Greedy: constrained output with every drafter equals plain constrained output token for token,
  and is valid under the grammar.
* Sampled: on the V = 10 pair of ``tests/speculative/test_exactness.py`` (here with a one-letter
  tokenizer, ids 5..9 = "a".."e", so a grammar can speak about its tokens), the generated
  (x1, x2, x3) follow the target's distribution restricted to the grammar at each position and
  renormalised, computed independently of the grammar engine; a verifier that judges truncated
  drafts by the unrestricted draft q is caught.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import infer.speculative.grammar_filter as grammar_filter
import infer.speculative.verification as verification
from checkpoints import load_hf_model, make_eagle3_head, make_medusa_heads
from helpers import (
    P_CONTROL,
    PENALTY_CONFIG,
    PROMPT,
    Reference,
    V,
    assert_follows_reference,
    generate_unseeded,
    grouped_chisquare,
)
from infer import LLM, SamplingParams
from infer.data.tokenizer import SPECIAL_TOKENS, save_tokenizer
from infer.sampling.grammar import GrammarCompiler, GrammarMatcher, StructuredOutput, unpack_bitmasks
from infer.sampling.transforms import SamplingBatch, probs_from_logits, token_counts

A, B, C, D, E = range(5, 10)
# x1 in {c, d, e}; x2 depends on x1; x3 in {a, b, c, e}; x4 anything: the state matters, not just the
# position. Chosen where the unconstrained target puts mass, so every group has cells to test.
REGEX = "(c[a-d]|d[b-e]|e[acde])[abce][a-e]"
AFTER_X1 = {C: {A, B, C, D}, D: {B, C, D, E}, E: {A, C, D, E}}
NUM_SAMPLES = 4000


def letters_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, "a", "b", "c", "d", "e"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[2]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def with_letters(model: Path, out: Path) -> Path:
    shutil.copytree(model, out)
    save_tokenizer(letters_tokenizer(), out)
    return out


@pytest.fixture(scope="module")
def letters_pair(small_target: Path, small_draft: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("letters")
    return with_letters(small_target, root / "target"), with_letters(small_draft, root / "draft")


def allowed_after(prefix: list[int]) -> set[int]:
    """The grammar REGEX, written out by hand: the tokens allowed after ``prefix``."""
    if not prefix:
        return {C, D, E}
    if len(prefix) == 1:
        return AFTER_X1.get(prefix[0], set())
    return {A, B, C, E} if len(prefix) == 2 else {A, B, C, D, E}


@torch.no_grad()
def constrained_reference(model_path: Path, params: SamplingParams,
                          allowed: Callable[[list[int]], set[int]]) -> Reference:
    """P(x1) and P(x2, x3 | x1) of the target restricted to ``allowed`` and renormalised."""
    model = load_hf_model(model_path)

    def next_probs(generated: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor([PROMPT + g for g in generated])).logits[:, -1].float()
        mask = torch.zeros(len(generated), V, dtype=torch.bool)
        for row, g in enumerate(generated):
            mask[row, sorted(allowed(g))] = True
        batch = SamplingBatch.from_params([params] * len(generated), "cpu")
        counts = token_counts(generated, V, "cpu") if batch.use_counts else None
        probs = probs_from_logits(logits, batch, None, mask, counts)
        probs = torch.nan_to_num(probs.double())  # rows after an impossible prefix
        return probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-300)

    p1 = next_probs([[]])[0]
    p2 = next_probs([[a] for a in range(V)])
    p3 = next_probs([[a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return Reference(p1.numpy(), (p2[:, :, None] * p3).numpy())


def sample(llm: LLM, params: dict[str, Any], n: int = NUM_SAMPLES, seed0: int = 0) -> tuple[np.ndarray, int, int]:
    outputs = generate_unseeded(llm, [PROMPT] * n, SamplingParams(max_tokens=4, ignore_eos=True,
                                                                  structured_output={"regex": REGEX}, **params), seed0)
    assert all(len(o.token_ids) == 4 for o in outputs)
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    return samples, sum(o.metrics.proposed_tokens for o in outputs), sum(o.metrics.accepted_tokens for o in outputs)


@pytest.fixture(scope="module")
def letters_engines(letters_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLM]:
    target, draft = letters_pair
    # A fixed draft length: every round drafts, so the verifier under test always runs.
    common: dict[str, Any] = dict(dtype="float32", device="cpu", max_batch_size=256, max_seq_len=32,
                                  spec_length_policy="fixed")
    heads = make_medusa_heads(target, tmp_path_factory.mktemp("letters_medusa") / "medusa", num_heads=2,
                              tree_size=10, top_k=4, jitter=0.2)
    return {
        "draft": LLM(str(target), draft_model=str(draft), spec_length=3, **common),
        "medusa": LLM(str(target), speculator="medusa", medusa_heads=str(heads), medusa_tree_size=10, **common),
        # A low min_prob keeps several siblings per node: real trees.
        "suffix": LLM(str(target), speculator="suffix", spec_length=3, suffix_min_prob=0.02, **common),
    }


@pytest.mark.parametrize(("drafter", "params"), [("draft", {"temperature": 1.0}), ("medusa", PENALTY_CONFIG)])
def test_constrained_samples_follow_restricted_target(letters_engines: dict[str, LLM], letters_pair: tuple[Path, Path],
                                                      drafter: str, params: dict[str, Any]) -> None:
    # Seed 0's Medusa sample fits at p = 5e-4, the once-in-a-thousand fluke the threshold allows for a
    # correct sampler (eight other seeds: p = 0.10-0.85); a fixed seed would fail on it for ever.
    samples, proposed, accepted = sample(letters_engines[drafter], params, seed0=1000)
    assert proposed > NUM_SAMPLES // 2 and 0 < accepted < proposed  # speculation ran, both verdicts seen
    for x1, x2, x3 in samples:  # never a forbidden token
        assert x2 in allowed_after([x1]) and x3 in allowed_after([x1, x2]), (x1, x2, x3)
    assert_follows_reference(samples, constrained_reference(letters_pair[0], SamplingParams(**params), allowed_after))


def test_negative_control_unrestricted_draft_q_is_detected(letters_engines: dict[str, LLM],
                                                           letters_pair: tuple[Path, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Forbidden drafts dropped but the kept ones judged by the unrestricted q (not renormalised over
    the allowed tokens): biased, and the same test catches it. The good samples also fail against
    the target restricted only at x1 (a grammar state that stopped advancing)."""
    calls = []

    def unrestricted(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return probs

    monkeypatch.setattr(grammar_filter, "restrict_q", unrestricted)
    params = {"temperature": 1.0}
    broken, _, _ = sample(letters_engines["draft"], params, n=NUM_SAMPLES, seed0=10_000_000)
    ref = constrained_reference(letters_pair[0], SamplingParams(**params), allowed_after)
    assert calls and grouped_chisquare(broken, ref).pvalue < P_CONTROL


def test_greedy_grammar_ignores_forbidden_argmax(letters_pair: tuple[Path, Path]) -> None:
    """Greedy constrained decoding takes the argmax over the allowed tokens only."""
    llm = LLM(str(letters_pair[0]), dtype="float32", device="cpu", max_seq_len=32)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                structured_output={"regex": REGEX}))[0]
    model = load_hf_model(letters_pair[0])
    expect: list[int] = []
    for _ in range(4):
        logits = model(torch.tensor([PROMPT + expect])).logits[0, -1]
        allowed = sorted(allowed_after(expect))
        expect.append(allowed[int(logits[allowed].argmax())])
    assert out.token_ids == expect


# ----------------------------------------------------------------------------- greedy parity, every drafter

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}
PROMPTS = ['{"id": 12, "ok": true, "tag": "red"}\n{"id": 13, "ok": false, "tag": "green"}\n',
           "def parse(self, text):\n    return", '{"id": 1, "ok": true, "tag": "blue"}\n']
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, structured_output={"json": SCHEMA})


@pytest.fixture(scope="module")
def plain_constrained(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("drafter", ["draft", "ngram", "suffix", "medusa"])
def test_greedy_constrained_equals_plain_with_every_drafter(tiny_llama: Path, tiny_draft: Path,
                                                             plain_constrained: list[list[int]], drafter: str,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    options: dict[str, Any] = {
        "draft": {"draft_model": str(tiny_draft), "spec_length": 4, "spec_length_policy": "fixed"},
        "ngram": {"speculator": "ngram", "spec_length": 4, "spec_length_policy": "fixed"},
        "suffix": {"speculator": "suffix", "spec_length": 4, "spec_length_policy": "fixed"},
        "medusa": {"speculator": "medusa", "medusa_tree_size": 8, "medusa_heads": str(make_medusa_heads(
            tiny_llama, tmp_path_factory.mktemp("grammar_medusa") / "medusa", tree_size=8))},
    }[drafter]
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", **options)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == plain_constrained
    assert sum(o.metrics.proposed_tokens for o in outputs) > 0  # speculation ran
    for out in outputs:
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"id", "ok", "tag"}


# A grammar past llguidance's lexer limits a few tokens in, on the tiny tokenizer: "a " repeats until
# "b " opens a nested repetition whose lexer runs out of fuel (plain decoding: "grammar_error" after
# "b c" here). The first is the reproduction. Drafts walk into that failure: the n-gram
# drafter from the prompt, suffix decoding from the first run's answers (the second run), a draft
# model, Medusa and EAGLE from their heads.
FAILING_REGEXES = ["(((a{100}){100}){100})|7", "((a )|(b (((c{50}){50}){50})))+"]
FAILING_PROMPTS = ["a a a a b c", "b b b b", "a a b c c a a "]
MAX_FAILING = 12


@pytest.fixture(scope="module")
def plain_failing(tiny_llama: Path) -> dict[str, list[tuple[str | None, list[int]]]]:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    runs = {}
    for regex in FAILING_REGEXES:
        outputs = llm.generate(FAILING_PROMPTS, SamplingParams(max_tokens=MAX_FAILING, temperature=0.0,
                                                               structured_output={"regex": regex}))
        runs[regex] = [(o.finish_reason, o.token_ids) for o in outputs]
        # The grammar does fail mid-answer, or the test would test nothing.
        assert any(reason == "grammar_error" and ids for reason, ids in runs[regex]), runs[regex]
    return runs


@pytest.mark.parametrize("drafter", ["draft", "ngram", "suffix", "medusa", "eagle"])
def test_a_grammar_failing_mid_answer_ends_as_plain_decoding_does(
        tiny_llama: Path, tiny_draft: Path, plain_failing: dict[str, list[tuple[str | None, list[int]]]],
        drafter: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 54: a drafted token the grammar allows but llguidance's lexer cannot take (or after
    which it cannot compute a mask) failed the request with an engine error, or ended it where plain
    decoding goes on (the drafts' walk had spent the shared lexer). Every drafter, every time: plain
    decoding's tokens and finish reason ("grammar_error" where its grammar fails)."""
    fixed: dict[str, Any] = {"spec_length": 4, "spec_length_policy": "fixed"}
    root = tmp_path_factory.mktemp(f"failing_{drafter}")
    options: dict[str, Any] = {
        "draft": {"draft_model": str(tiny_draft), **fixed},
        "ngram": {"speculator": "ngram", **fixed},
        "suffix": {"speculator": "suffix", **fixed},
        "medusa": {"speculator": "medusa", "medusa_tree_size": 8,
                   "medusa_heads": str(make_medusa_heads(tiny_llama, root / "medusa", tree_size=8))},
        "eagle": {"speculator": "eagle", "eagle_tree_size": 8, "spec_length": 2, "spec_length_policy": "fixed",
                  "eagle_head": str(make_eagle3_head(tiny_llama, root / "eagle", std=0.3))},
    }[drafter]
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", **options)
    walked = []
    real = GrammarMatcher.draft

    def counted(self: GrammarMatcher, tokens: Any, parents: Any, *args: Any) -> Any:
        walked.append(len(tokens))
        return real(self, tokens, parents, *args)

    monkeypatch.setattr(GrammarMatcher, "draft", counted)
    for regex in FAILING_REGEXES:
        params = SamplingParams(max_tokens=MAX_FAILING, temperature=0.0, structured_output={"regex": regex})
        for _ in range(2):
            outputs = llm.generate(FAILING_PROMPTS, params)
            assert [(o.finish_reason, o.token_ids) for o in outputs] == plain_failing[regex], \
                [o.error for o in outputs]
    assert sum(walked) > 0  # drafts went through the grammar


def test_plain_constrained_output_is_valid_json(tiny_llama: Path, plain_constrained: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=80, temperature=0.8, seed=1,
                                                   structured_output={"json": SCHEMA}))
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert finished
    for out in finished:
        value = json.loads(out.text)
        assert isinstance(value["id"], int) and isinstance(value["ok"], bool) and value["tag"] in {"red", "green", "blue"}


# ----------------------------------------------------------------------------- parameters and the matcher


@pytest.mark.parametrize(("spec", "field"), [
    ({"regex": "(("}, "regex"), ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"json": {"type": "no-such-type"}}, "json"), ({"grammar": 'root ::= "a" | undefined'}, "grammar"),
])
def test_invalid_grammar_is_a_value_error_naming_it(letters_pair: tuple[Path, Path], spec: dict[str, Any],
                                                    field: str) -> None:
    llm = LLM(str(letters_pair[0]), dtype="float32", device="cpu", max_seq_len=32)
    with pytest.raises(ValueError, match=f"structured_output.{field} is invalid"):
        llm.generate([PROMPT], SamplingParams(structured_output=spec))


@pytest.mark.parametrize(("spec", "match"), [
    ({}, "exactly one"), ({"regex": "a", "json_object": True}, "exactly one"), ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1]}, "JSON Schema object"), ({"regex": ""}, "non-empty"), ({"pattern": "a"}, "unknown keys"),
])
def test_structured_output_parameters_are_validated(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_output=spec)


def test_draft_bitmasks_prune_a_tree_and_leave_the_state_alone() -> None:
    compiler = GrammarCompiler(letters_tokenizer(), [1], V)
    matcher = compiler.matcher(StructuredOutput(regex=REGEX))
    before = matcher.bitmask().clone()
    # Root children: c (kept), a (forbidden: its child goes too), e (kept); c's children b (kept), e (forbidden).
    tokens, parents = [C, A, E, B, E, C], [-1, -1, -1, 0, 0, 1]
    keep, masks = matcher.draft_bitmasks(tokens, parents)
    assert keep == [True, False, True, True, False, False]
    allowed = unpack_bitmasks(masks, V, "cpu")
    assert set(allowed[0].nonzero().flatten().tolist()) == {C, D, E}
    assert set(allowed[1].nonzero().flatten().tolist()) == {A, B, C, D}  # after "c"
    assert set(allowed[3].nonzero().flatten().tolist()) == {A, C, D, E}  # after "e"
    assert set(allowed[4].nonzero().flatten().tolist()) == {A, B, C, E}  # after "cb"
    assert torch.equal(matcher.bitmask(), before)
    # A chain is cut at its first forbidden token.
    keep, _ = matcher.draft_bitmasks([D, B, D, A], None)
    assert keep == [True, True, False, False]


def test_gbnf_and_lark_grammars_mean_what_the_regex_does() -> None:
    compiler = GrammarCompiler(letters_tokenizer(), [1], V)
    specs = [StructuredOutput(regex=REGEX),
             StructuredOutput(grammar='root ::= ("c" [a-d] | "d" [b-e] | "e" [acde]) [abce] [a-e]'),
             StructuredOutput(grammar='start: ("c" /[a-d]/ | "d" /[b-e]/ | "e" /[acde]/) /[abce]/ /[a-e]/')]
    for prefix in ([], [C], [D, E], [E, A, B], [E, A, B, C]):
        masks = []
        for spec in specs:
            matcher = compiler.matcher(spec)
            for token in prefix:
                matcher.consume(token)
            masks.append(set(unpack_bitmasks(matcher.bitmask(), V, "cpu").nonzero().flatten().tolist()))
        # Once the grammar is complete only EOS (id 1) may follow.
        assert masks[0] == masks[1] == masks[2] == (allowed_after(prefix) if len(prefix) < 4 else {1}), prefix


def allowed_first_bytes(compiler: GrammarCompiler, regex: str, prefix: bytes = b"") -> set[int]:
    """The first bytes of the tokens ``regex`` allows after ``prefix`` (one token per byte)."""
    ll = compiler.ll_tokenizer
    matcher = compiler.matcher(StructuredOutput(regex=regex))
    for byte in prefix:
        matcher.consume(ll.greedy_tokenize(chr(byte))[0])
    allowed = unpack_bitmasks(matcher.bitmask(), compiler.vocab_size, "cpu").nonzero().flatten().tolist()
    return {data[0] for data in (ll.decode_bytes([t]) for t in allowed) if data}


def test_regex_digit_and_word_classes_are_ascii() -> None:
    """Issue 54: a regex's \\d took every Unicode digit (U+1FBF8 came out of \\d{3}-\\d{4}); it means [0-9]
    as in a JSON Schema pattern, \\w [0-9A-Za-z_], in and outside classes; \\\\d stays a backslash, then d."""
    from checkpoints import shared_tokenizer
    from infer.data.tokenizer import EOS_ID

    tokenizer = shared_tokenizer()
    compiler = GrammarCompiler(tokenizer, [EOS_ID], tokenizer.get_vocab_size())
    digits = set(b"0123456789")
    assert allowed_first_bytes(compiler, r"\d{3}-\d{4}") == digits
    assert allowed_first_bytes(compiler, r"\d{3}-\d{4}", b"123") == {ord("-")}
    assert allowed_first_bytes(compiler, r"\d{3}-\d{4}", b"123-") == digits
    assert allowed_first_bytes(compiler, r"[\d-]x") == digits | {ord("-")}
    assert allowed_first_bytes(compiler, r"\w") == set(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
    not_digits = allowed_first_bytes(compiler, r"\D")
    assert not not_digits & digits and ord("a") in not_digits and 0xC3 in not_digits  # "é" is no digit
    assert not allowed_first_bytes(compiler, r"[x\D]") & digits
    assert allowed_first_bytes(compiler, r"\\d") == {ord("\\")}
    assert allowed_first_bytes(compiler, r"\\d", b"\\") == {ord("d")}


# ----------------------------------------------------------------------------- EOS inside drafts

EOS = 1  # the letters tokenizer's EOS (SPECIAL_TOKENS[1])
# REGEX without its last letter: complete after three tokens, so EOS must follow, and suffix decoding
# drafts it (after the grammar completed) from the finished requests in its store.
REGEX3 = "(c[a-d]|d[b-e]|e[acde])[abce]"


def sample_complete(llm: LLM, n: int, seed0: int, seeded: bool) -> tuple[np.ndarray, int, int]:
    params = dict(max_tokens=4, temperature=1.0, structured_output={"regex": REGEX3})
    if seeded:
        outputs = llm.generate([PROMPT] * n, [SamplingParams(seed=seed0 + i, **params) for i in range(n)])  # type: ignore[arg-type]
    else:
        outputs = generate_unseeded(llm, [PROMPT] * n, SamplingParams(**params), seed0)  # type: ignore[arg-type]
    bad = [(o.token_ids, o.error) for o in outputs if o.finish_reason != "stop" or o.token_ids[3:] != [EOS]]
    assert not bad, bad[:3]
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    return samples, sum(o.metrics.proposed_tokens for o in outputs), sum(o.metrics.accepted_tokens for o in outputs)


@pytest.mark.parametrize("seeded", [False, True])
def test_suffix_constrained_samples_follow_restricted_target(letters_engines: dict[str, LLM],
                                                             letters_pair: tuple[Path, Path], seeded: bool) -> None:
    """Suffix trees (with drafted EOS) under a grammar: unseeded requests through the tree's
    multi-candidate rejection, seeded ones through their keyed draws; both exactly the target
    restricted to the grammar, every request ending with EOS where the grammar completes."""
    samples, proposed, accepted = sample_complete(letters_engines["suffix"], NUM_SAMPLES, 0, seeded)
    assert proposed > NUM_SAMPLES // 2 and 0 < accepted < proposed
    for x1, x2, x3 in samples:
        assert x2 in allowed_after([x1]) and x3 in allowed_after([x1, x2]), (x1, x2, x3)
    assert_follows_reference(samples, constrained_reference(letters_pair[0], SamplingParams(temperature=1.0),
                                                            allowed_after))


def test_negative_control_suffix_broken_residual_is_detected(letters_engines: dict[str, LLM],
                                                             letters_pair: tuple[Path, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree verifier that may draw a rejected candidate again is biased, and the same test sees it."""
    monkeypatch.setattr(verification, "residual_after_rejections", lambda probs, rejected: probs)
    samples, _, _ = sample_complete(letters_engines["suffix"], NUM_SAMPLES, 10_000_000, seeded=False)
    ref = constrained_reference(letters_pair[0], SamplingParams(temperature=1.0), allowed_after)
    assert grouped_chisquare(samples, ref).pvalue < P_CONTROL


def test_innocent_constrained_requests_are_unaffected_by_their_batch_mates(letters_engines: dict[str, LLM],
                                                                         letters_pair: tuple[Path, Path]) -> None:
    """A greedy and a seeded constrained request give their solo plain tokens when batched on a suffix
    engine with 16 sampled constrained requests (n = 16), round after round, as the store fills."""
    innocents = [SamplingParams(max_tokens=6, temperature=0.0, structured_output={"regex": REGEX3}),
                 SamplingParams(max_tokens=6, temperature=1.0, seed=77, structured_output={"regex": REGEX3})]
    plain = LLM(str(letters_pair[0]), dtype="float32", device="cpu", max_seq_len=32)
    alone = [o.token_ids for o in plain.generate([PROMPT] * 2, innocents)]
    llm = letters_engines["suffix"]
    for round_ in range(3):
        mates = [SamplingParams(max_tokens=6, temperature=1.0, seed=100 * round_ + i,
                                structured_output={"regex": REGEX3}) for i in range(16)]
        outputs = llm.generate([PROMPT] * 18, innocents + mates)
        assert [o.token_ids for o in outputs[:2]] == alone
        assert all(o.finish_reason == "stop" for o in outputs), [o.error for o in outputs]
        assert sum(o.metrics.proposed_tokens for o in outputs) > 0


def test_draft_bitmasks_walk_past_eos_and_leave_the_state_alone() -> None:
    """A drafted EOS (from suffix decoding's store of finished outputs, or n-gram under ignore_eos)
    must not shift the rollback: llguidance consumes EOS without recording it once the grammar is
    complete, so rolling it back used to undo an earlier, emitted token."""
    compiler = GrammarCompiler(letters_tokenizer(), [EOS], V)
    matcher = compiler.matcher(StructuredOutput(regex=REGEX))
    for token in (C, A, B):  # one token before the grammar completes
        matcher.consume(token)
    before = matcher.bitmask().clone()
    # Root children: d (completes the grammar) with EOS, EOS below it, then a (completes it too) with EOS.
    tokens, parents = [D, EOS, EOS, A, EOS, EOS], [-1, 0, 1, -1, 3, -1]
    keep, masks = matcher.draft_bitmasks(tokens, parents)
    assert keep == [True, True, True, True, True, False]  # EOS is not allowed before the grammar completes
    allowed = unpack_bitmasks(masks, V, "cpu")
    for row in (1, 2, 3, 4, 5):  # after a complete grammar, and after EOS (ignore_eos): EOS only
        assert set(allowed[row].nonzero().flatten().tolist()) == {EOS}, row
    assert torch.equal(matcher.bitmask(), before)
    matcher.consume(E)  # the state is still "cab": the fourth token is allowed, and completes it
    assert set(unpack_bitmasks(matcher.bitmask(), V, "cpu").nonzero().flatten().tolist()) == {EOS}
    # A chain of EOS after the complete grammar (ignore_eos): every one kept, the state left alone.
    keep, _ = matcher.draft_bitmasks([EOS, EOS, EOS], None)
    assert keep == [True, True, True]
    matcher.consume(EOS)
    assert set(unpack_bitmasks(matcher.bitmask(), V, "cpu").nonzero().flatten().tolist()) == {EOS}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_complete_grammar_with_ignore_eos_is_the_same_under_speculation(letters_pair: tuple[Path, Path],
                                                                         temperature: float) -> None:
    """Once the grammar is complete it allows EOS alone, and ignore_eos keeps the request going: plain
    decoding emits EOS up to max_tokens (finish_reason "length"); n-gram and suffix drafts of those
    EOS are verified like any other, so every drafter gives plain's tokens."""
    common: dict[str, Any] = dict(dtype="float32", device="cpu", max_seq_len=32, spec_length=3,
                                  spec_length_policy="fixed")
    params = [SamplingParams(max_tokens=10, temperature=temperature, seed=i, ignore_eos=True,
                             structured_output={"regex": REGEX}) for i in range(6)]
    runs = {}
    for drafter in (None, "ngram", "suffix"):
        llm = LLM(str(letters_pair[0]), speculator=drafter, **common)
        outputs = llm.generate([PROMPT] * len(params), params)
        assert all(o.finish_reason == "length" for o in outputs), [o.error for o in outputs]
        runs[drafter] = [o.token_ids for o in outputs]
        if drafter is not None:
            assert sum(o.metrics.proposed_tokens for o in outputs) > 0
    assert runs["ngram"] == runs[None] and runs["suffix"] == runs[None]
    assert all(ids[4:] == [EOS] * 6 for ids in runs[None])
