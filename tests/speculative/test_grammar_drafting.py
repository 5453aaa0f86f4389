"""Grammar drafting (issue 52, item 2): the tokens a request's grammar forces are drafted and verified.

* The walk (``GrammarMatcher.draft``): a forced run is drafted where the drafter proposed nothing,
  replaces a drafter's disagreeing guess, keeps an agreeing one (and its continuation), and leaves
  the request's grammar state alone.
* Greedy: with every drafter and with none, the tokens are plain constrained decoding's, for
  batch mates of the same prompt too (n > 1), and grammar drafts were verified.
* Sampled: on a vocabulary where the grammar's forced text has several tokenizations (``a``, ``ab``,
  ``abc``), the drafted ``ab`` is a guess the masked target may reject; the first three tokens
  follow the target restricted to the grammar (chi-square, fixed seeds), and accepting the
  grammar's drafts without verification is caught by the same test.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_grammar import constrained_reference

import infer.engine.speculative_runner as speculative_runner
from checkpoints import make_eagle3_head, make_medusa_heads, shared_tokenizer
from helpers import P_CONTROL, PROMPT, V, assert_follows_reference, generate_unseeded, grouped_chisquare
from infer import LLM, SamplingParams
from infer.data.tokenizer import EOS_ID, SPECIAL_TOKENS, save_tokenizer
from infer.sampling.grammar import GrammarCompiler, StructuredOutput, unpack_bitmasks

# ----------------------------------------------------------------------------- the walk


def json_matcher(schema: dict[str, Any]) -> tuple[Any, Any]:
    tokenizer = shared_tokenizer()
    compiler = GrammarCompiler(tokenizer, [EOS_ID], tokenizer.get_vocab_size())
    return tokenizer, compiler.matcher(StructuredOutput(json=schema))


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}


def test_draft_adds_the_forced_run_and_leaves_the_state_alone() -> None:
    tokenizer, matcher = json_matcher(SCHEMA)
    before = matcher.bitmask().clone()
    walk = matcher.draft([], None, room=16, depth=16)
    text = tokenizer.decode(walk.tokens)
    assert text.startswith('{"id": ') or text.startswith('{"id":'), text
    assert walk.parents == list(range(-1, len(walk.tokens) - 1))  # a chain
    assert walk.origin == [-1] * len(walk.tokens) and all(walk.forced)
    allowed = unpack_bitmasks(walk.masks, tokenizer.get_vocab_size(), "cpu")
    for row, token in enumerate(walk.tokens):  # each drafted token is allowed at its row
        assert allowed[row, token]
    assert torch.equal(matcher.bitmask(), before)
    # Off (room None): nothing is added, exactly the pruning walk.
    assert matcher.draft([], None).tokens == []
    # Within room and depth.
    assert len(matcher.draft([], None, room=2, depth=16).tokens) == 2
    assert len(matcher.draft([], None, room=16, depth=1).tokens) == 1


def test_draft_joins_a_drafters_guesses_where_the_grammar_is_free() -> None:
    tokenizer, matcher = json_matcher(SCHEMA)
    for token in tokenizer.encode('{"id": ').ids:
        matcher.consume(token)
    digits = tokenizer.encode("12").ids
    before = matcher.bitmask().clone()
    # The drafter guesses the number; after it, a "," is free too (another digit may follow), so
    # nothing more is forced: its guess alone.
    walk = matcher.draft(digits, None, room=16, depth=16)
    assert walk.tokens[: len(digits)] == digits and walk.origin[: len(digits)] == list(range(len(digits)))
    assert not any(walk.forced[: len(digits)])
    # The drafter guesses the number and the comma: after the comma the grammar forces the next key,
    # drafted on below the drafter's chain.
    guess = tokenizer.encode("12,").ids
    walk = matcher.draft(guess, None, room=16, depth=16)
    assert walk.tokens[: len(guess)] == guess
    assert tokenizer.decode(walk.tokens).startswith('12, "ok"'), tokenizer.decode(walk.tokens)
    assert walk.origin[len(guess):] == [-1] * (len(walk.tokens) - len(guess))
    # A guess the grammar forbids ends the drafter's chain; with nothing forced there, nothing is added.
    walk = matcher.draft(tokenizer.encode("x").ids, None, room=16, depth=16)
    assert walk.tokens == []
    assert torch.equal(matcher.bitmask(), before)


def test_draft_replaces_a_guess_where_the_grammar_forces_a_token() -> None:
    tokenizer, matcher = json_matcher(SCHEMA)
    forced = matcher.draft([], None, room=16, depth=16)
    first = forced.tokens[0]
    other = next(t for t in range(tokenizer.get_vocab_size()) if t != first and t > 10)
    # A disagreeing guess goes, and its continuation with it; the forced run takes the chain.
    walk = matcher.draft([other, first], None, room=16, depth=16)
    assert walk.tokens == forced.tokens and walk.origin == [-1] * len(forced.tokens)
    # An agreeing guess stays (its place is the drafter's: origin 0), still a grammar choice (q one-hot).
    walk = matcher.draft([first], None, room=16, depth=16)
    assert walk.tokens == forced.tokens and walk.origin[0] == 0 and walk.forced[0]
    # In a tree, the child with the forced token keeps its place; the others go.
    walk = matcher.draft([other, first, other], [-1, -1, 1], room=16, depth=16)
    assert walk.tokens == forced.tokens and walk.origin[0] == 1 and walk.parents[0] == -1


# ----------------------------------------------------------------------------- greedy, every drafter

PROMPTS = ['{"id": 12, "ok": true, "tag": "red"}\n{"id": 13, "ok": false, "tag": "green"}\n',
           "def parse(self, text):\n    return", '{"id": 1, "ok": true, "tag": "blue"}\n']
COPIES = 3  # batch mates of each prompt (n > 1)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, structured_output={"json": SCHEMA})


@pytest.fixture(scope="module")
def plain_greedy(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", grammar_drafting=False)
    outputs = llm.generate(PROMPTS * COPIES, GREEDY)
    assert sum(o.metrics.proposed_tokens for o in outputs) == 0  # truly plain
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("drafter", [None, "ngram", "suffix", "draft", "medusa", "eagle"])
def test_greedy_with_grammar_drafting_equals_plain(tiny_llama: Path, tiny_draft: Path, plain_greedy: list[list[int]],
                                                   drafter: str | None,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp(f"grammar_drafting_{drafter}")
    options: dict[str, Any] = {
        None: {},
        "ngram": {"speculator": "ngram"},
        "suffix": {"speculator": "suffix"},
        "draft": {"draft_model": str(tiny_draft), "spec_length": 3},
        "medusa": {"speculator": "medusa", "medusa_tree_size": 8,
                   "medusa_heads": str(make_medusa_heads(tiny_llama, root / "medusa", tree_size=8))},
        "eagle": {"speculator": "eagle", "eagle_tree_size": 8, "spec_length": 2,
                  "eagle_head": str(make_eagle3_head(tiny_llama, root / "eagle", std=0.3))},
    }[drafter]
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", **options)
    forced = 0
    real = speculative_runner.filter_proposal

    def counted(*args: Any) -> Any:
        nonlocal forced
        pruned, grammar = real(*args)
        forced += sum(o < 0 for origin in grammar.origin for o in origin)
        return pruned, grammar

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculative_runner, "filter_proposal", counted)
        outputs = llm.generate(PROMPTS * COPIES, GREEDY)
    assert [o.token_ids for o in outputs] == plain_greedy
    assert forced > 0  # the grammar drafted
    assert sum(o.metrics.accepted_tokens for o in outputs) > 0


def test_seeded_batch_mates_are_plain_decodings_with_grammar_drafting(tiny_llama: Path) -> None:
    """Seeded sampled requests (16 copies, seeds s, s + 1, ...) draw plain decoding's tokens."""
    params = [SamplingParams(max_tokens=30, temperature=0.9, seed=40 + i, structured_output={"json": SCHEMA})
              for i in range(16)]
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu", grammar_drafting=False)
    drafted = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="ngram")
    expect = [o.token_ids for o in plain.generate([PROMPTS[0]] * 16, params)]
    outputs = drafted.generate([PROMPTS[0]] * 16, params)
    assert [o.token_ids for o in outputs] == expect
    assert sum(o.metrics.proposed_tokens for o in outputs) > 0


def test_grammar_drafting_off_drafts_nothing_without_a_speculator(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", grammar_drafting=False)
    assert type(llm.engine.runner).__name__ == "ContinuousRunner"
    on = LLM(str(tiny_llama), dtype="float32", device="cpu")
    out = on.generate([PROMPTS[0]], GREEDY)[0]
    assert out.metrics.proposed_tokens > 0
    # A request without a grammar is decoded plainly on the grammar-only runner: no rounds recorded.
    free = on.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert free.metrics.num_rounds == 0


# ----------------------------------------------------------------------------- sampled: ambiguous forced text

# Ids 5..9: the forced text "ab" after the first letter is "a" + "b", "ab", or "abc" (with the next letter).
# The single letters get the ids the target likes after PROMPT, so every first letter is sampled.
PIECES = ["ab", "abc", "a", "b", "c"]
TOKENS = dict(enumerate(PIECES, start=5))
AB, ABC, A = 5, 6, 7
REGEX = "[abc]ab[abc]+"
PREFIXES = re.compile("([abc](a(b[abc]*)?)?)?")  # the texts REGEX's strings start with, written out
EOS = 1
NUM_SAMPLES = 4000


def pieces_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *PIECES])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[2]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def allowed_after(prefix: list[int]) -> set[int]:
    """The tokens whose text continues ``prefix``'s toward a string of REGEX (EOS once one is complete),
    from the language written out: independent of the grammar engine."""
    if any(t not in TOKENS for t in prefix):
        return set()
    text = "".join(TOKENS[t] for t in prefix)
    found = {t for t, piece in TOKENS.items() if PREFIXES.fullmatch(text + piece)}
    return found | ({EOS} if re.fullmatch(REGEX, text) else set())


@pytest.fixture(scope="module")
def pieces_target(small_target: Path, small_draft: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pieces")
    out = []
    for model, name in ((small_target, "target"), (small_draft, "draft")):
        shutil.copytree(model, root / name)
        save_tokenizer(pieces_tokenizer(), root / name)
        out.append(root / name)
    return out[0], out[1]


def test_the_masks_are_the_languages() -> None:
    """The reference's allowed sets are llguidance's masks on every reachable prefix (so the grammar
    engine restricts the target as the reference does), and the forced "ab" has three tokenizations."""
    compiler = GrammarCompiler(pieces_tokenizer(), [EOS], V)
    spec = StructuredOutput(regex=REGEX)
    frontier: list[list[int]] = [[]]
    seen = 0
    while frontier:
        prefix = frontier.pop()
        matcher = compiler.matcher(spec)
        for token in prefix:
            assert matcher.consume(token) is None
        mask = set(unpack_bitmasks(matcher.bitmask(), V, "cpu").nonzero().flatten().tolist())
        assert mask == allowed_after(prefix), (prefix, mask)
        seen += 1
        if len(prefix) < 3:
            frontier.extend(prefix + [t] for t in mask if t != EOS)
    assert seen > 40
    matcher = compiler.matcher(spec)
    matcher.consume(A)
    walk = matcher.draft([], None, room=4, depth=4)
    assert walk.tokens[:1] == [AB]  # "ab" drafted, though "a" and "abc" are allowed there too
    assert allowed_after([A]) == {A, AB, ABC}


def sample(llm: LLM, n: int, seed0: int) -> tuple[np.ndarray, int, int]:
    outputs = generate_unseeded(llm, [PROMPT] * n, SamplingParams(max_tokens=4, temperature=1.0,
                                                                  structured_output={"regex": REGEX}), seed0)
    bad = [(o.token_ids, o.error) for o in outputs if len(o.token_ids) < 3]
    assert not bad, bad[:3]
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    return samples, sum(o.metrics.proposed_tokens for o in outputs), sum(o.metrics.accepted_tokens for o in outputs)


@pytest.fixture(scope="module")
def pieces_engines(pieces_target: tuple[Path, Path]) -> dict[str, LLM]:
    target, draft = pieces_target
    common: dict[str, Any] = dict(dtype="float32", device="cpu", max_batch_size=256, max_seq_len=32)
    return {"none": LLM(str(target), **common),
            "draft": LLM(str(target), draft_model=str(draft), spec_length=2, spec_length_policy="fixed", **common)}


@pytest.mark.parametrize("drafter", ["none", "draft"])
def test_sampled_with_grammar_drafting_follows_the_restricted_target(pieces_engines: dict[str, LLM],
                                                                      pieces_target: tuple[Path, Path],
                                                                      drafter: str) -> None:
    samples, proposed, accepted = sample(pieces_engines[drafter], NUM_SAMPLES, seed0=0)
    assert proposed > NUM_SAMPLES // 2 and 0 < accepted < proposed  # drafts verified, some rejected
    ab_drafted_x2 = (samples[:, 1] == AB).mean()
    assert 0.05 < ab_drafted_x2 < 0.95  # the drafted "ab" is not what the target always takes
    for x1, x2, x3 in samples:
        assert x2 in allowed_after([x1]) and x3 in allowed_after([x1, x2]), (x1, x2, x3)
    ref = constrained_reference(pieces_target[0], SamplingParams(temperature=1.0), allowed_after)
    assert_follows_reference(samples, ref)


def test_negative_control_forced_drafts_accepted_unverified_is_detected(pieces_engines: dict[str, LLM],
                                                                         pieces_target: tuple[Path, Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking the grammar's drafts as certain (the target's p at a drafted row replaced by the drafted
    token, so verification always accepts it) is biased where the forced text has several
    tokenizations, and the same test catches it."""
    real = speculative_runner.target_distributions

    def certain(logits: Any, sampling: Any, contexts: Any, outputs: Any, nodes: torch.Tensor, ancestors: Any = None,
                allowed: Any = None) -> Any:
        probs, processed = real(logits, sampling, contexts, outputs, nodes, ancestors, allowed)
        probs = probs.clone()
        drafted = nodes > 0  # (id 0, a special token, is the padding past a request's drafts)
        onehot = torch.nn.functional.one_hot(nodes, probs.shape[-1]).to(probs.dtype)
        probs[:, : nodes.shape[1]][drafted] = onehot[drafted]
        return probs, processed

    monkeypatch.setattr(speculative_runner, "target_distributions", certain)
    samples, _, _ = sample(pieces_engines["none"], NUM_SAMPLES, seed0=10_000_000)
    ref = constrained_reference(pieces_target[0], SamplingParams(temperature=1.0), allowed_after)
    assert grouped_chisquare(samples, ref).pvalue < P_CONTROL


# ----------------------------------------------------------------------------- infer audit


@pytest.mark.parametrize("broken", [False, True])
def test_audit_checks_grammar_drafting(pieces_target: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                       broken: bool) -> None:
    """`infer audit` with a grammar and no speculator audits grammar drafting: it passes, and fails
    once the grammar's drafts are accepted unverified."""
    from infer.audit.checks import FAIL, PASS, AuditSettings, run_audit

    if broken:
        real = speculative_runner.target_distributions

        def certain(logits: Any, sampling: Any, contexts: Any, outputs: Any, nodes: torch.Tensor, ancestors: Any = None,
                    allowed: Any = None) -> Any:
            probs, processed = real(logits, sampling, contexts, outputs, nodes, ancestors, allowed)
            probs = probs.clone()
            drafted = nodes > 0
            probs[:, : nodes.shape[1]][drafted] = torch.nn.functional.one_hot(nodes, probs.shape[-1]).to(probs.dtype)[drafted]
            return probs, processed

        monkeypatch.setattr(speculative_runner, "target_distributions", certain)
    settings = AuditSettings(engine={"model": str(pieces_target[0]), "dtype": "float32", "device": "cpu",
                                     "max_seq_len": 32},
                             sampling=SamplingParams(temperature=1.0, structured_output={"regex": REGEX}),
                             prompts=[PROMPT], contexts=1, samples=3000, max_tokens=6, batch_size=256)
    report = run_audit(settings)
    checks = report["checks"]
    assert report["settings"]["speculator"] is None and report["settings"]["structured_output"] == "regex"
    assert checks["distribution"]["verdict"] == (FAIL if broken else PASS), checks["distribution"]["summary"]
    assert report["verdict"] == (FAIL if broken else PASS)
    if not broken:
        assert checks["greedy"]["verdict"] == PASS  # (broken, greedy fails too: its drafts are taken as well)
