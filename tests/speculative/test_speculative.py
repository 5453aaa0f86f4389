"""Speculative decoding through the whole engine: greedy parity, stop rules, rollback, policies.

Greedy speculation must be token-identical to plain decoding, whatever the drafter (a useless
draft model, a noisy copy of the target that accepts runs of different lengths, the target itself
as its own draft, n-gram lookup), the length policy and the KV backend. The paged runs use
``block_size=4`` so rollbacks cross block boundaries. Distribution exactness of sampling is
tested in ``test_exactness.py``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_tiny_checkpoint, small_vocab_tokenizer
from infer import LLM, EngineConfig, RequestOutput, SamplingParams
from infer.core.request import Request
from infer.data.tokenizer import IM_END_ID
from infer.speculative.budget import (
    BudgetController,
    EntropyStop,
    expected_speedup,
    expected_speedup_over_rounds,
)

PROMPTS = [
    "a",
    "def foo(x):",
    "import json\nimport json\nimport json\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "class A:\n    def __init__(self):\n        self.x = 1\n        self.y = 2\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)

DRAFTERS = ("tiny_draft", "noisy_draft", "self_draft", "ngram")
POLICIES: dict[str, dict[str, Any]] = {
    "fixed-1": {"spec_length": 1, "spec_length_policy": "fixed"},
    "fixed-3": {"spec_length": 3, "spec_length_policy": "fixed"},
    "fixed-5": {"spec_length": 5, "spec_length_policy": "fixed"},
    "entropy": {"spec_length": 4, "spec_length_policy": "entropy"},
    "goodput": {"spec_length": 3, "spec_length_policy": "goodput"},
}
BACKENDS: dict[str, dict[str, Any]] = {
    "paged": {"kv_cache_backend": "paged", "block_size": 4},
    "slotted": {"kv_cache_backend": "slotted"},
}


# ----------------------------------------------------------------------------- checkpoints


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """``src`` with Gaussian noise (``noise`` times each matrix's std) added to every matrix."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(src / "model.safetensors")
    noisy = {name: (w + noise * w.std() * torch.randn(w.shape, generator=gen)).contiguous() if w.dim() == 2 else w
             for name, w in weights.items()}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with 10% weight noise: agrees with it often but not always (α about 0.5)."""
    return perturbed_copy(tiny_llama, tmp_path_factory.mktemp("noisy_draft"), noise=0.1)


@pytest.fixture(scope="module")
def cheap_exact_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 6-layer target whose layers 1-5 are inert (zero output projections) and a 1-layer draft
    holding its layer 0: the draft's distributions equal the target's (α = 1) at a fraction of the cost."""
    root = tmp_path_factory.mktemp("cheap_exact")
    layers = 6
    target = make_tiny_checkpoint(root / "target", "llama", num_layers=layers, seed=21)
    weights = load_file(target / "model.safetensors")
    for name in weights:
        inert_layer = name.startswith("model.layers.") and not name.startswith("model.layers.0.")
        if inert_layer and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    draft = root / "draft"
    shutil.copytree(target, draft)
    kept = {n: w for n, w in weights.items() if not n.startswith("model.layers.") or n.startswith("model.layers.0.")}
    save_file(kept, draft / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((draft / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    return target, draft


# ----------------------------------------------------------------------------- helpers


def make_llm(model: Path, **options: Any) -> LLM:
    return LLM(str(model), dtype="float32", device="cpu", **options)


def drafter_options(name: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    if name == "ngram":
        return {"speculator": "ngram"}
    fixture = {"self_draft": "tiny_llama"}.get(name, name)
    return {"draft_model": str(request.getfixturevalue(fixture))}


_PLAIN: dict[str, list[RequestOutput]] = {}


def plain_generate(model: Path, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams],
                   **options: Any) -> list[RequestOutput]:
    """Plain (non-speculative) decoding, memoised: the reference every speculative run must match."""
    key = repr((str(model), prompts, params, sorted(options.items())))
    if key not in _PLAIN:
        _PLAIN[key] = make_llm(model, **options).generate(prompts, params)
    return _PLAIN[key]


def assert_same_outputs(spec: list[RequestOutput], plain: list[RequestOutput]) -> None:
    assert len(spec) == len(plain)
    for i, (s, p) in enumerate(zip(spec, plain, strict=True)):
        assert s.token_ids == p.token_ids, f"prompt {i}: tokens differ"
        assert s.text == p.text, f"prompt {i}: text differs"
        assert s.finish_reason == p.finish_reason, f"prompt {i}: finish_reason differs"


def total(outputs: list[RequestOutput], field: str) -> int:
    return sum(getattr(o.metrics, field) for o in outputs)


def per_position(outputs: list[RequestOutput], field: str) -> list[int]:
    width = max(len(getattr(o.metrics, field)) for o in outputs)
    sums = [0] * width
    for o in outputs:
        for i, n in enumerate(getattr(o.metrics, field)):
            sums[i] += n
    return sums


# ----------------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_parity(tiny_llama: Path, request: pytest.FixtureRequest, drafter: str, policy: str,
                       backend: str) -> None:
    llm = make_llm(tiny_llama, **drafter_options(drafter, request), **POLICIES[policy], **BACKENDS[backend])
    assert llm.engine.config.speculate
    spec = llm.generate(PROMPTS, GREEDY)
    assert_same_outputs(spec, plain_generate(tiny_llama, PROMPTS, GREEDY, **BACKENDS[backend]))

    proposed, accepted = total(spec, "proposed_tokens"), total(spec, "accepted_tokens")
    if policy == "goodput":
        return  # goodput may legitimately decide not to speculate (checked in its own tests)
    assert proposed > 0
    if drafter == "self_draft":  # the target drafting for itself: (almost) every draft survives
        assert accepted >= 0.95 * proposed
    elif drafter == "ngram":  # the prompts repeat themselves: some lookups must be right
        assert accepted > 0
    elif drafter == "noisy_draft" and policy in ("fixed-3", "fixed-5"):
        # Rounds end at different positions: some reject the first draft, some keep two or more.
        acc_pos, prop_pos = per_position(spec, "accepted_per_position"), per_position(spec, "proposed_per_position")
        assert 0 < acc_pos[0] < prop_pos[0]
        assert acc_pos[1] > 0
        assert len({o.metrics.accepted_tokens for o in spec}) > 1


@pytest.mark.parametrize("drafter", ["noisy_draft", "ngram"])
def test_greedy_parity_in_bfloat16_with_packed_cpu_weights(tiny_llama: Path, request: pytest.FixtureRequest,
                                                           drafter: str) -> None:
    # bfloat16 on CPU runs the pre-packed oneDNN linears (where available): a 1-token decode step
    # and a (K+1)-token verification pass go through different kernels and must still agree.
    def bf16(**options: Any) -> LLM:
        return LLM(str(tiny_llama), dtype="bfloat16", device="cpu", **options)

    plain = bf16().generate(PROMPTS, GREEDY)
    spec = bf16(**drafter_options(drafter, request), spec_length=4, spec_length_policy="fixed").generate(PROMPTS, GREEDY)
    assert_same_outputs(spec, plain)
    assert total(spec, "accepted_tokens") > 0


def test_greedy_parity_with_penalty_and_sampled_batch_mates(tiny_llama: Path, noisy_draft: Path) -> None:
    """Greedy rows (one with a repetition penalty) stay exact while batched with sampled rows."""
    prompts = PROMPTS[:4]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=1, repetition_penalty=1.2),
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=2),
    ]
    plain = plain_generate(tiny_llama, prompts, params, block_size=4)
    for options in ({"draft_model": str(noisy_draft)}, {"speculator": "ngram"}):
        spec = make_llm(tiny_llama, spec_length=3, spec_length_policy="fixed", block_size=4, **options).generate(prompts, params)
        assert_same_outputs([spec[0], spec[2]], [plain[0], plain[2]])
        assert all(len(o.token_ids) == 24 or o.finish_reason == "stop" for o in spec)


@pytest.mark.parametrize("drafter", ["self_draft", "ngram"])
def test_greedy_parity_with_strong_repetition_penalty(tiny_llama: Path, request: pytest.FixtureRequest,
                                                      drafter: str) -> None:
    """Verification position i must penalise the drafts t_1..t_i before it, exactly as plain decoding
    penalises the tokens it has already emitted (tiny_llama likes to repeat itself: "a" -> 496 496 ...)."""
    params = SamplingParams(max_tokens=32, temperature=0.0, repetition_penalty=3.0)
    spec = make_llm(tiny_llama, spec_length=4, spec_length_policy="fixed", block_size=4, **drafter_options(drafter, request)).generate(PROMPTS, params)
    assert_same_outputs(spec, plain_generate(tiny_llama, PROMPTS, params, block_size=4))
    if drafter == "self_draft":  # (the penalised text hardly repeats, so n-gram lookups mostly miss)
        assert total(spec, "accepted_tokens") > 0.9 * total(spec, "proposed_tokens")


# ----------------------------------------------------------------------------- stops mid-round

K_STOP = 5
STOP_PROMPT = "def foo(x):"


@pytest.fixture(scope="module")
def stop_setup(tiny_llama: Path) -> SimpleNamespace:
    """Self-draft (α = 1, K = 5: every round emits 6 tokens) and the chunks a stop-free run emits."""
    spec = make_llm(tiny_llama, draft_model=str(tiny_llama), spec_length=K_STOP, spec_length_policy="fixed", block_size=4)
    plain = make_llm(tiny_llama, block_size=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = plain.generate([STOP_PROMPT], params)[0]
    chunks: list[list[int]] = []
    free = spec.generate([STOP_PROMPT], params, on_token=lambda _r, ids: chunks.append(list(ids)))[0]
    assert free.token_ids == base.token_ids
    assert max(len(c) for c in chunks) == K_STOP + 1  # whole rounds accepted
    # Output positions strictly inside a multi-token chunk: a stop there cuts a round short.
    inside, pos = [], 0
    for chunk in chunks:
        inside += list(range(pos, pos + len(chunk) - 1)) if len(chunk) > 1 else []
        pos += len(chunk)
    first_seen = [p for p in inside if base.token_ids[p] not in base.token_ids[:p]]
    assert len(first_seen) >= 3, "the fixture output has too few fresh tokens mid-round"
    return SimpleNamespace(spec=spec, plain=plain, base=base, chunks=chunks, positions=first_seen[:6])


def assert_stopped_mid_round(out: RequestOutput) -> None:
    """The rounds emitted more tokens than the request kept: its stop cut the last round short."""
    emitted = 1 + out.metrics.accepted_tokens + out.metrics.num_rounds  # prefill token + per round
    assert emitted > len(out.token_ids)


def test_stop_token_lands_mid_round(stop_setup: SimpleNamespace) -> None:
    s = stop_setup
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[s.base.token_ids[p]])
              for p in s.positions]
    prompts = [STOP_PROMPT] * len(params)
    plain, spec = s.plain.generate(prompts, params), s.spec.generate(prompts, params)
    assert_same_outputs(spec, plain)
    for p, out in zip(s.positions, spec, strict=True):
        assert out.finish_reason == "stop" and out.token_ids == s.base.token_ids[: p + 1]
        assert_stopped_mid_round(out)


def test_eos_lands_mid_round(stop_setup: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    s = stop_setup
    for p in s.positions[:3]:
        eos = [s.base.token_ids[p]]
        # Declare the token EOS for both engines (requests copy the EOS ids when they are made).
        monkeypatch.setattr(s.plain.tokenizer, "eos_token_ids", eos)
        monkeypatch.setattr(s.spec.tokenizer, "eos_token_ids", eos)
        params = SamplingParams(max_tokens=40, temperature=0.0)
        plain, spec = s.plain.generate([STOP_PROMPT], params), s.spec.generate([STOP_PROMPT], params)
        assert_same_outputs(spec, plain)
        assert spec[0].finish_reason == "stop" and spec[0].token_ids == s.base.token_ids[: p + 1]
        assert_stopped_mid_round(spec[0])


def test_stop_string_lands_mid_round(stop_setup: SimpleNamespace) -> None:
    s = stop_setup
    tok = s.plain.tokenizer
    stops: list[tuple[int, str]] = []
    for p in s.positions:
        before, upto = tok.decode(s.base.token_ids[:p]), tok.decode(s.base.token_ids[: p + 1])
        if upto.startswith(before) and upto[len(before):].strip():
            # The new text of token p plus one character before it, found nowhere earlier.
            stop = upto[max(0, len(before) - 1):]
            if stop not in before:
                stops.append((p, stop))
    assert len(stops) >= 2
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]) for _, stop in stops]
    prompts = [STOP_PROMPT] * len(params)
    plain, spec = s.plain.generate(prompts, params), s.spec.generate(prompts, params)
    assert_same_outputs(spec, plain)
    for (p, stop), out in zip(stops, spec, strict=True):
        assert out.finish_reason == "stop"
        assert out.token_ids == s.base.token_ids[: p + 1]
        assert stop not in out.text and s.base.text.startswith(out.text)
        assert_stopped_mid_round(out)


# ----------------------------------------------------------------------------- budgets and context


@pytest.mark.parametrize("drafter", ["noisy_draft", "self_draft", "ngram"])
def test_max_tokens_not_multiple_of_round(tiny_llama: Path, request: pytest.FixtureRequest, drafter: str) -> None:
    budgets = [1, 2, 3, 5, 6, 7, 9, 10, 13]  # K = 3: rounds emit up to 4 tokens
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(budgets))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in budgets]
    spec = make_llm(tiny_llama, spec_length=3, spec_length_policy="fixed", block_size=4, **drafter_options(drafter, request)).generate(prompts, params)
    assert_same_outputs(spec, plain_generate(tiny_llama, prompts, params, block_size=4))
    for n, out in zip(budgets, spec, strict=True):
        assert len(out.token_ids) == n and out.finish_reason == "length"


@pytest.mark.parametrize("policy", ["fixed-5", "goodput"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("drafter", ["noisy_draft", "self_draft", "ngram"])
def test_overflow_guard_near_max_seq_len(tiny_llama: Path, request: pytest.FixtureRequest, drafter: str,
                                         backend: str, policy: str) -> None:
    """Drafting is clamped so verification never writes past max_seq_len."""
    max_seq_len = 24
    tokenizer = make_llm(tiny_llama).tokenizer
    ids = tokenizer.encode(PROMPTS[4])
    prompts = [ids[:10], ids[:7], ids[:3]]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    options = {"max_seq_len": max_seq_len, **BACKENDS[backend]}
    llm = make_llm(tiny_llama, **drafter_options(drafter, request), **POLICIES[policy], **options)
    spec = llm.generate(prompts, params)
    assert_same_outputs(spec, plain_generate(tiny_llama, prompts, params, **options))
    for prompt, out in zip(prompts, spec, strict=True):
        assert out.finish_reason == "length"
        assert len(prompt) + len(out.token_ids) == max_seq_len


# ----------------------------------------------------------------------------- rollback


def draft_pool(llm: LLM) -> Any:
    return getattr(llm.engine.runner.drafter, "pool", None)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("drafter", ["noisy_draft", "self_draft", "ngram"])
def test_rollback_keeps_caches_in_step(tiny_llama: Path, request: pytest.FixtureRequest, drafter: str,
                                       backend: str) -> None:
    block = 4
    llm = make_llm(tiny_llama, spec_length=3, spec_length_policy="fixed", max_seq_len=128, **drafter_options(drafter, request),
                   **BACKENDS[backend])
    engine = llm.engine
    drafter = engine.runner.drafter
    target_free, dpool = engine.pool.free_kv_tokens(), draft_pool(llm)
    draft_free = None if dpool is None else dpool.free_kv_tokens()
    paged = backend == "paged"

    specs = [("def f(x):", 17, 0.0), ("import os\nimport sys\n", 9, 1.0), ("a", 30, 0.0), (PROMPTS[5], 21, 0.7)]
    requests = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=t, seed=i, ignore_eos=True))
                for i, (p, n, t) in enumerate(specs)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 200
        for r in requests:
            if r.is_finished or r.slot is None or r.is_prefilling:
                continue
            length = engine.pool.seq_len(r.slot)
            assert length == r.num_computed_tokens == r.num_tokens - 1, f"target cache of {r.request_id}"
            if paged:
                assert len(engine.pool.block_tables[r.slot]) == math.ceil(length / block)
            draft_slot = getattr(drafter, "slots", {}).get(r.request_id)
            if draft_slot is not None:
                draft_len = dpool.seq_len(draft_slot)
                assert draft_len <= r.num_tokens, f"draft cache of {r.request_id}"
                if paged:
                    assert len(dpool.block_tables[draft_slot]) == math.ceil(draft_len / block)
    assert [len(r.output_token_ids) for r in requests] == [n for _, n, _ in specs]

    # Everything is given back, after manual stepping and after a generate call.
    for _ in range(2):
        assert engine.pool.free_kv_tokens() == target_free
        if dpool is not None:
            assert dpool.free_kv_tokens() == draft_free
            assert not drafter.slots
        llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))


def test_single_step_emits_several_tokens(tiny_llama: Path) -> None:
    engine = make_llm(tiny_llama, draft_model=str(tiny_llama), spec_length=4, spec_length_policy="fixed", block_size=4).engine
    request = engine.add_request("def foo(x):", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    chunks = []
    while engine.has_unfinished():
        chunks += [u.new_token_ids for u in engine.step() if u.request is request]
    assert max(len(c) for c in chunks) == 5  # K accepted drafts + the bonus token, in one step
    assert [t for c in chunks for t in c] == request.output_token_ids


# ----------------------------------------------------------------------------- length policies


def test_expected_speedup_known_values() -> None:
    for alpha in (0.0, 0.3, 1.0):
        assert expected_speedup(alpha, 0, 0.5) == 1.0  # K = 0 is plain decoding
    assert expected_speedup(0.5, 1, 0.0) == pytest.approx(1.5)  # (1 - 0.25) / 0.5
    assert expected_speedup(0.8, 3, 0.1) == pytest.approx((1 - 0.8**4) / (0.2 * 1.3))
    assert expected_speedup(1.0, 4, 0.25) == pytest.approx(2.5)  # 5 tokens for the cost of 2 passes
    assert expected_speedup(0.0, 2, 0.5) == pytest.approx(0.5)  # useless drafts only cost time


def test_expected_speedup_over_rounds() -> None:
    # Every round drafting K with c per draft: exactly Theorem 3.8.
    assert expected_speedup_over_rounds(0.8, [0, 0, 0, 7], cost_per_draft=0.1) == pytest.approx(
        expected_speedup(0.8, 3, 0.1))
    # A per-round cost d charges cK + 1 = 1 + d: the theorem with c = d / K.
    assert expected_speedup_over_rounds(0.7, [0, 0, 0, 0, 5], cost_per_round=0.2) == pytest.approx(
        expected_speedup(0.7, 4, 0.05))
    # Rounds of other lengths count at their own length: a round that found nothing emits one token
    # for 1 + d steps; one that drafted 2 emits 1 + α + α² for 1 + d.
    d, a = 0.1, 0.5
    assert expected_speedup_over_rounds(a, [3, 0, 1], cost_per_round=d) == pytest.approx(
        (3 + 1 + a + a * a) / (4 * (1 + d)))
    assert expected_speedup_over_rounds(0.9, []) == 1.0  # no rounds: nothing to predict


def fake_request(rid: str, draft_room: int = 1 << 30) -> Request:
    return SimpleNamespace(request_id=rid, draft_room=draft_room)  # type: ignore[return-value]


def test_goodput_length_choice() -> None:
    good, bad = fake_request("good"), fake_request("bad")
    policy = BudgetController(8, adaptive=True)
    policy.alpha.update(good=0.9, bad=0.05)
    assert policy.chain_lengths([good, bad], per_row=0.05)[0] > 0
    # The pass is ragged: the predictable request drafts, its batch mate does not pay rows for it.
    assert policy.chain_lengths([good, bad], per_row=0.1) == [policy.chain_lengths([good], per_row=0.1)[0], 0]
    batch = [good, bad, fake_request("good2")]
    policy.alpha["good2"] = 0.9
    lengths = policy.chain_lengths(batch, per_row=0.1)
    assert lengths[0] == lengths[2] > 0 == lengths[1]
    policy.alpha["good2"] = 0.7  # less predictable: a shorter chain of its own
    assert 0 < policy.chain_lengths(batch, per_row=0.1)[2] < policy.chain_lengths(batch, per_row=0.1)[0]
    assert policy.chain_lengths([bad], per_row=0.5) == [0]
    assert policy.chain_lengths([good], per_row=1.5) == [0]  # a draft dearer than the target never pays
    # Cheaper drafts are worth more of them; α = 1 and a tiny cost use the whole budget.
    assert policy.chain_lengths([good], per_row=0.01)[0] >= policy.chain_lengths([good], per_row=0.2)[0] > 0
    policy.alpha["good"] = 1.0
    assert policy.chain_lengths([good], per_row=0.01) == [8]
    # The acceptance estimate follows what verification reports.
    for _ in range(20):
        policy.update(bad, proposed=4, accepted=4)
    assert policy.alpha["bad"] > 0.9
    assert policy.chain_lengths([bad], per_row=0.05)[0] > 0
    policy.update(bad, proposed=0, accepted=0)  # a round without drafts teaches nothing
    assert policy.alpha["bad"] > 0.9
    policy.release(bad)
    assert "bad" not in policy.alpha


def test_goodput_new_requests_start_from_recent_acceptance() -> None:
    policy = BudgetController(8, adaptive=True)
    first, second = fake_request("first"), fake_request("second")
    assert policy.chain_lengths([second], per_row=0.45) == [1]  # the fixed prior (0.6) alone: one draft
    for _ in range(30):
        policy.update(first, proposed=4, accepted=4)
    policy.release(first)
    assert policy.recent_alpha > 0.9
    assert policy.chain_lengths([second], per_row=0.45)[0] >= 3  # starts where the drafter has been doing well
    for _ in range(60):
        policy.update(second, proposed=4, accepted=0)
    assert policy.recent_alpha < 0.1
    assert policy.chain_lengths([fake_request("third")], per_row=0.45) == [0]


def test_goodput_probes_while_at_zero() -> None:
    """A request stuck at K = 0 drafts two tokens after probe_every rounds to re-measure α and c;
    each probe that leaves it at 0 doubles the wait, up to max_probe_every."""
    bad = fake_request("bad")
    policy = BudgetController(8, adaptive=True, probe_every=4, max_probe_every=16)
    policy.alpha["bad"] = 0.05
    lengths = [policy.chain_lengths([bad], per_row=0.5)[0] for _ in range(60)]
    assert set(lengths) == {0, 2}
    assert [i + 1 for i, k in enumerate(lengths) if k] == [4, 12, 28, 44, 60]  # waits 4, 8, 16, 16, 16


def test_goodput_probe_wait_resets_when_speculation_pays() -> None:
    request = fake_request("r")
    policy = BudgetController(8, adaptive=True, probe_every=4)
    policy.alpha["r"] = 0.05
    first = [policy.chain_lengths([request], per_row=0.5)[0] for _ in range(12)]
    assert [i + 1 for i, k in enumerate(first) if k] == [4, 12]
    policy.alpha["r"] = 0.95
    assert policy.chain_lengths([request], per_row=0.5)[0] > 0  # predictable again: speculate
    policy.alpha["r"] = 0.05
    again = [policy.chain_lengths([request], per_row=0.5)[0] for _ in range(4)]
    assert again == [0, 0, 0, 2]  # the wait is probe_every again, not 16


def test_goodput_batch_probes_together() -> None:
    """A round that verifies anything pays the drafter's call (or steps) once, so the whole batch
    probes in one round (eight requests probing in eight different rounds would pay it eight times)."""
    batch = [fake_request(f"r{i}") for i in range(8)]
    policy = BudgetController(8, adaptive=True, probe_every=4)
    for i, request in enumerate(batch):
        policy.alpha[request.request_id] = 0.02 * i
    # One request runs alone for two rounds, then seven more join: they probe with it, not later.
    rounds = [policy.chain_lengths(batch[:1] if i < 2 else batch, per_row=0.9) for i in range(12)]
    assert [i + 1 for i, ks in enumerate(rounds) if any(ks)] == [4, 12]
    assert all(ks in ([0] * len(ks), [2] * len(ks)) for ks in rounds)


def test_entropy_length_stops_on_flat_drafts() -> None:
    policy = EntropyStop(spec_length_min=1, threshold=0.5)
    flat, peaked = fake_request("flat"), fake_request("peaked")
    vocab = 512
    logits = torch.zeros(2, vocab)
    logits[1, 7] = 30.0
    assert BudgetController(5).budgets([flat, peaked]) == [5, 5]  # the entropy policy's budget: its maximum
    assert policy.keep_drafting([flat, peaked], logits, step=0).tolist() == [True, True]  # below spec_length_min
    assert policy.keep_drafting([flat, peaked], logits, step=1).tolist() == [False, True]
    assert BudgetController(3).budgets([flat, peaked]) == [3, 3]


def test_goodput_stops_speculating_with_useless_drafter(tiny_llama: Path, tiny_draft: Path) -> None:
    """tiny_draft (another seed) almost never agrees with tiny_llama: goodput learns α ≈ 0 and
    drafts (almost) nothing, while still producing exactly the plain output."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = plain_generate(tiny_llama, PROMPTS, params)
    fixed = make_llm(tiny_llama, draft_model=str(tiny_draft), spec_length=5, spec_length_policy="fixed").generate(PROMPTS, params)
    goodput = make_llm(tiny_llama, draft_model=str(tiny_draft), spec_length=5,
                       spec_length_policy="goodput").generate(PROMPTS, params)
    assert_same_outputs(fixed, plain)
    assert_same_outputs(goodput, plain)
    assert total(fixed, "accepted_tokens") <= 0.05 * total(fixed, "proposed_tokens")
    assert total(goodput, "proposed_tokens") < 0.25 * total(fixed, "proposed_tokens")
    assert total(goodput, "proposed_tokens") < 0.25 * total(goodput, "generated_tokens")


def steady_timings(llm: LLM, draft_step_s: float = 2e-4, first_draft_step_s: float | None = None) -> None:
    """Replace measured times with a fixed cost model: a target pass over n tokens takes 1 ms + 10 µs·n,
    a draft step ``draft_step_s`` (the first one ``first_draft_step_s``), so the test does not
    depend on the timing noise of a shared CPU."""
    costs = llm.engine.runner.budget  # type: ignore[attr-defined]
    observe_target, observe_draft = costs.observe_target, costs.observe_draft_step
    calls = [0]

    def draft(batch_size: int, _seconds: float) -> None:
        calls[0] += 1
        slow = first_draft_step_s is not None and calls[0] == 1
        observe_draft(batch_size, first_draft_step_s if slow else draft_step_s)  # type: ignore[arg-type]

    costs.observe_target = lambda num_tokens, _seconds: observe_target(num_tokens, 1e-3 + 1e-5 * num_tokens)
    costs.observe_draft_step = draft


def test_goodput_keeps_speculating_with_cheap_exact_drafter(cheap_exact_pair: tuple[Path, Path]) -> None:
    target, draft = cheap_exact_pair
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    llm = make_llm(target, draft_model=str(draft), spec_length=3, spec_length_policy="goodput")
    steady_timings(llm)
    out = llm.generate(["def foo(x):"], params)
    assert_same_outputs(out, plain_generate(target, ["def foo(x):"], params))
    m = out[0].metrics
    assert m.accepted_tokens >= 0.95 * m.proposed_tokens  # it is an exact draft
    assert m.proposed_tokens > 0.5 * len(out[0].token_ids)
    assert m.mean_accepted_tokens is not None and m.mean_accepted_tokens > 3


def test_goodput_recovers_from_one_slow_draft_measurement(cheap_exact_pair: tuple[Path, Path]) -> None:
    target, draft = cheap_exact_pair
    llm = make_llm(target, draft_model=str(draft), spec_length=3, spec_length_policy="goodput")
    # One hiccup (3 ms for a draft step, e.g. a page fault or another process) then 0.2 ms steps.
    steady_timings(llm, first_draft_step_s=3e-3)
    out = llm.generate(["def foo(x):"], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))[0]
    assert out.metrics.proposed_tokens > 0.3 * len(out.token_ids)


# ----------------------------------------------------------------------------- metrics


def test_metrics_are_consistent(tiny_llama: Path, noisy_draft: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs = make_llm(tiny_llama, draft_model=str(noisy_draft), spec_length=4, spec_length_policy="fixed").generate(PROMPTS, params)
    for out in outputs:
        m = out.metrics
        assert m.num_rounds > 0 and m.proposed_tokens > 0
        assert m.acceptance_rate == pytest.approx(m.accepted_tokens / m.proposed_tokens)
        assert m.mean_accepted_tokens == pytest.approx((m.accepted_tokens + m.num_rounds) / m.num_rounds)
        assert sum(m.proposed_per_position) == m.proposed_tokens
        assert sum(m.accepted_per_position) == m.accepted_tokens
        assert len(m.accepted_per_position) == len(m.proposed_per_position) <= 4
        for i in range(len(m.proposed_per_position)):
            assert m.accepted_per_position[i] <= m.proposed_per_position[i]
            if i:  # draft i+1 is only proposed / accepted when draft i was
                assert m.proposed_per_position[i] <= m.proposed_per_position[i - 1]
                assert m.accepted_per_position[i] <= m.accepted_per_position[i - 1]
        assert m.proposed_per_position[0] <= m.num_rounds
        assert 1 + m.accepted_tokens + m.num_rounds <= len(out.token_ids)  # no token was discarded
        assert m.alpha == pytest.approx(m.accepted_tokens / (m.accepted_tokens + m.rejected_rounds))
        assert m.to_dict()["acceptance_rate"] == m.acceptance_rate


def test_round_metrics_do_not_depend_on_batch_mates(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, draft_model=str(tiny_llama), spec_length=3, spec_length_policy="fixed")
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # its decode step drafts 0 (budget)
    alone = llm.generate(["def f"], short)[0]
    batched = llm.generate(["def f", "import os"], [short, SamplingParams(max_tokens=20, temperature=0.0)])[0]
    assert alone.token_ids == batched.token_ids
    assert alone.metrics.num_rounds == batched.metrics.num_rounds
    assert alone.metrics.mean_accepted_tokens == batched.metrics.mean_accepted_tokens


# ----------------------------------------------------------------------------- configuration


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="drafter"):
        EngineConfig.from_options(model="m", speculate=True)
    with pytest.raises(ValueError, match="spec_length"):
        EngineConfig.from_options(model="m", speculator="ngram", spec_length=0, spec_length_policy="fixed")
    with pytest.raises(ValueError, match="speculator"):
        EngineConfig.from_options(model="m", speculator="lookahead")
    with pytest.raises(ValueError, match="spec_length_policy"):
        EngineConfig.from_options(model="m", speculator="ngram", spec_length_policy="adaptive")
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig.from_options(model="m", speculator="draft")
    implied = EngineConfig.from_options(model="m", draft_model="d")
    assert implied.speculative is not None and implied.speculative.speculator == "draft"
    assert implied.speculate
    assert EngineConfig.from_options(model="m", speculator="ngram").speculate
    assert not EngineConfig.from_options(model="m").speculate
    with pytest.warns(DeprecationWarning, match="use_speculative_decoding is now speculate"):
        assert EngineConfig.from_options(model="m", speculator="ngram", use_speculative_decoding=True).speculate
    goodput = EngineConfig.from_options(model="m", draft_model="d", spec_length=3, spec_length_policy="goodput")
    assert goodput.speculative is not None and goodput.speculative.spec_length_limit == 6


def test_llm_rejects_speculation_without_drafter(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="drafter"):
        make_llm(tiny_llama, speculate=True)


def draft_with(root: Path, **kwargs: Any) -> Path:
    return make_tiny_checkpoint(root, "llama", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                intermediate_size=64, seed=5, **kwargs)


def test_draft_with_other_vocabulary_is_rejected(tiny_llama: Path, tmp_path: Path) -> None:
    bigger = draft_with(tmp_path / "v600", tokenizer=small_vocab_tokenizer(600))
    with pytest.raises(ValueError, match="vocab"):
        make_llm(tiny_llama, draft_model=str(bigger))
    # Same size, different token -> id mapping.
    remapped = draft_with(tmp_path / "v512", tokenizer=small_vocab_tokenizer(512))
    with pytest.raises(ValueError, match="different ids"):
        make_llm(tiny_llama, draft_model=str(remapped))


def test_draft_with_other_eos_is_rejected(tiny_llama: Path, tmp_path: Path) -> None:
    other_eos = draft_with(tmp_path / "eos", eos_token_id=IM_END_ID)
    with pytest.raises(ValueError, match="EOS"):
        make_llm(tiny_llama, draft_model=str(other_eos))
