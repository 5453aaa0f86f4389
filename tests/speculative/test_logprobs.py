"""``SamplingParams.logprobs``: each generated token's log-probability under the target's processed
distribution (penalties, logit bias, grammar mask, temperature; greedy rows at temperature 1), with
the likeliest alternatives, identical with and without speculation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import load_hf_model, make_medusa_heads
from infer import LLM, SamplingParams

PROMPTS = ["def parse(self, text):\n    return", "import os\nimport sys\n\n", "for i in range(10):\n    print("]


def params(**extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3, **extra)


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu")


def test_logprobs_are_the_targets_log_softmax(plain: LLM, tiny_llama: Path) -> None:
    out = plain.generate(PROMPTS[:1], params())[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 16
    model = load_hf_model(tiny_llama)
    context = list(out.prompt_token_ids)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        with torch.no_grad():
            expect = torch.log_softmax(model(torch.tensor([context])).logits[0, -1].double(), dim=-1)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(expect[token]), abs=1e-4)
        assert [t for t, _ in lp.top] == expect.topk(3).indices.tolist()  # greedy: the argmax comes first
        assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob)
        context.append(token)


def test_logprobs_see_bias_and_grammar(plain: LLM) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = plain.generate(PROMPTS[:1], params(structured_output={"json": schema}, logit_bias={5: 3.0}))[0]
    assert out.logprobs is not None
    first = out.logprobs[0]
    assert first.logprob == pytest.approx(0.0, abs=1e-6)  # '{' is the only token the grammar allows first
    assert all(math.isinf(v) for _, v in first.top[1:])
    # Off by default; 0 gives the chosen token alone.
    assert plain.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].logprobs is None
    zero = plain.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=0))[0].logprobs
    assert zero is not None and all(lp.top == [] for lp in zero)


@pytest.mark.parametrize("drafter", ["draft", "ngram", "medusa"])
def test_logprobs_identical_with_speculation(plain: LLM, tiny_llama: Path, drafter: str,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    options: dict[str, Any] = {
        # The target drafting for itself: every draft accepted, so every verification row emits a token.
        "draft": {"draft_model": str(tiny_llama), "spec_length": 4, "spec_length_policy": "fixed"},
        "ngram": {"speculator": "ngram", "spec_length": 4, "spec_length_policy": "fixed"},
        "medusa": {"speculator": "medusa", "medusa_tree_size": 8, "medusa_heads": str(make_medusa_heads(
            tiny_llama, tmp_path_factory.mktemp("logprob_medusa") / "medusa", tree_size=8))},
    }[drafter]
    spec = LLM(str(tiny_llama), dtype="float32", device="cpu", **options)
    accepted = 0
    for extra in ({}, {"frequency_penalty": 0.5, "logit_bias": {7: 1.5}}):
        want = plain.generate(PROMPTS, params(**extra))
        got = spec.generate(PROMPTS, params(**extra))
        accepted += sum(o.metrics.accepted_tokens for o in got)
        for a, b in zip(want, got, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs is not None and b.logprobs is not None
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert accepted > 0  # tokens came from verification rows past the first


def test_logprobs_bounds() -> None:
    with pytest.raises(ValueError, match="SamplingParams.logprobs=21"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("options", [{}, {"max_prefill_tokens": 5, "prefix_caching": True}])
def test_prompt_logprobs_are_the_raw_log_softmax(tiny_llama: Path, options: dict[str, Any]) -> None:
    """Whole-prompt and chunked prefill alike, and a prompt whose blocks are cached is recomputed."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", **options)
    prompt = PROMPTS[0] + " a + b  # the sum"
    model = load_hf_model(tiny_llama)
    for _ in range(2):  # the second time its blocks are in the prefix cache (when enabled)
        out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.5,
                                                  frequency_penalty=1.0))[0]
        ids = out.prompt_token_ids
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        assert out.prompt_logprobs[0] is None
        with torch.no_grad():
            expect = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        for i in range(1, len(ids)):
            lp = out.prompt_logprobs[i]
            assert lp is not None and lp.token_id == ids[i]
            assert lp.logprob == pytest.approx(float(expect[i - 1, ids[i]]), abs=1e-4)  # raw: no penalty, no temperature
            assert [t for t, _ in lp.top] == expect[i - 1].topk(2).indices.tolist()
