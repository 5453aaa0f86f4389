"""``infer audit``: its statistics are right, it passes the real engine, and it fails real bugs.

The negative controls break the speculative path the way real bugs do, by wrapping the function
chain rounds go through (``verification.verify_drafts``; for greedy requests without a penalty
``greedy_verdict``; patched in the verification module, whose ``verify`` calls them):
a target distribution at the wrong temperature, a rejection that resamples from p instead of the
residual norm(max(0, p - q)), a draft q that is not the distribution the drafts were sampled from,
and a greedy verifier that reads the wrong row. Each must make the audit FAIL at its default
sample size, while the unbroken engine PASSes the same audit.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

import infer.speculative.verification as verification
from checkpoints import make_eagle3_head, make_medusa_heads
from infer.audit import AuditSettings, exit_code, run_audit
from infer.audit.checks import FAIL, LOW_POWER, NEAR_TIE, PASS, next_token_logits
from infer.audit.stats import (
    cell_chisquare,
    chi2_isf,
    chi2_sf,
    detectable_tv,
    ncx2_sf,
    noncentrality_for_power,
)
from infer.cli import main
from infer.speculative.verification import Verdict, VerificationResult

# Few distinct tokens, repeated, so n-gram lookup finds matches; the first is the default context.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 7, 5, 9, 7, 5, 9, 7], [6, 6, 8, 6, 6, 8, 6]]
SPEC_LENGTH = 3

Verify = Callable[..., VerificationResult]


def audit(target: Path, contexts: int = 1, checks: tuple[str, ...] = ("distribution",), **engine: Any) -> dict[str, Any]:
    """The audit at its default sample size and significance, on the tiny pair."""
    settings = AuditSettings(engine=dict(model=str(target), dtype="float32", device="cpu", spec_length=SPEC_LENGTH, spec_length_policy="fixed",
                                         **engine),
                             prompts=PROMPTS, contexts=contexts, checks=checks, max_tokens=24)
    return run_audit(settings)


# ------------------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("dof", [1, 4, 30, 200])
def test_chi_square_functions_match_scipy(dof: int) -> None:
    for x in (0.5 * dof, dof, 2.0 * dof + 10):
        assert chi2_sf(x, dof) == pytest.approx(scipy_stats.chi2.sf(x, dof), rel=1e-9, abs=1e-300)
        for nc in (0.5, 12.0, 150.0):
            assert ncx2_sf(x, dof, nc) == pytest.approx(scipy_stats.ncx2.sf(x, dof, nc), rel=1e-7, abs=1e-12)
    assert chi2_isf(1e-3, dof) == pytest.approx(scipy_stats.chi2.isf(1e-3, dof), rel=1e-8)
    lam = noncentrality_for_power(dof, 1e-3, 0.8)
    assert scipy_stats.ncx2.sf(scipy_stats.chi2.isf(1e-3, dof), dof, lam) == pytest.approx(0.8, abs=1e-6)


def test_detectable_tv_is_detected_with_the_stated_power() -> None:
    """Monte Carlo: a deviation of exactly the reported TV, in its least detectable direction
    (|Δ| proportional to p0), is rejected in about 80% of repeated experiments."""
    p0 = np.array([0.3, 0.2, 0.15, 0.15, 0.1, 0.1])  # halves {0.3, 0.2} vs the rest: 0.5 each
    n, alpha = 3000, 0.001
    tv = detectable_tv(n, len(p0) - 1, alpha, 0.8)
    assert tv is not None and 0.02 < tv < 0.1
    sign = np.array([1, 1, -1, -1, -1, -1])
    p1 = p0 + sign * 2 * tv * p0  # Σ|Δ| = 2 tv·Σp0 = 2 tv; Σ Δ = 0 because the halves weigh 0.5
    assert abs(p1 - p0).sum() / 2 == pytest.approx(tv)
    counts = np.random.default_rng(0).multinomial(n, p1, size=4000)
    statistics = ((counts - n * p0) ** 2 / (n * p0)).sum(axis=1)
    power = (statistics > scipy_stats.chi2.isf(alpha, len(p0) - 1)).mean()
    assert 0.77 < power < 0.83
    # A deviation half as large is mostly missed: the reported figure is not loose.
    counts = np.random.default_rng(1).multinomial(n, p0 + sign * tv * p0, size=4000)
    assert (((counts - n * p0) ** 2 / (n * p0)).sum(axis=1) > scipy_stats.chi2.isf(alpha, len(p0) - 1)).mean() < 0.4


def test_cell_chisquare_pools_small_cells() -> None:
    exact = cell_chisquare(np.array([50, 30, 20]), np.array([50.0, 30.0, 20.0]))
    assert exact.statistic == pytest.approx(0.0) and exact.dof == 2 and exact.p_value == 1.0
    # Expected (5, 3, 2): the two small cells pool into one of 5, so 1 dof remains.
    pooled = cell_chisquare(np.array([5, 3, 2]), np.array([5.0, 3.0, 2.0]))
    assert pooled.dof == 1 and pooled.samples == 10
    # A pool still below 5 joins the smallest big cell; a single cell is no test.
    assert cell_chisquare(np.array([10, 6, 2]), np.array([10.0, 6.0, 2.0])).dof == 1
    assert cell_chisquare(np.array([3, 1]), np.array([3.0, 1.0])).dof == 0


# ------------------------------------------------------------------------------------- negative controls


@pytest.fixture(scope="module")
def engine_modules_loaded(small_target: Path, small_draft: Path) -> None:
    """Build each kind of speculative engine once, so every module of the speculative path is loaded
    before a test patches the verifier."""
    from infer import LLM

    for drafter in ({"draft_model": str(small_draft)}, {"speculator": "ngram"}):
        LLM(str(small_target), dtype="float32", device="cpu", max_seq_len=32, **drafter)  # type: ignore[arg-type]


def patch_verify(monkeypatch: pytest.MonkeyPatch, make: Callable[[Any], Any], function: str = "verify_drafts") -> None:
    """Replace ``function`` of ``infer.speculative.verification`` in every infer module that holds it
    (``verification.verify``, the runner's one entry point, calls it there)."""
    real = getattr(verification, function)
    broken = make(real)
    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("infer") and getattr(module, function, None) is real:
            monkeypatch.setattr(module, function, broken)
            patched += 1
    assert getattr(verification, function) is broken and patched >= 1


def wrong_temperature(real: Verify) -> Verify:
    """The speculative path verifies against the target at temperature 1.25 instead of 1."""

    def verify(tokens: torch.Tensor, num: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
               greedy: torch.Tensor, generators: list[torch.Generator | None]) -> VerificationResult:
        hotter = target.clamp_min(0) ** (1 / 1.25)  # softmax(l)^(1/T) ∝ softmax(l / T)
        return real(tokens, num, hotter / hotter.sum(-1, keepdim=True), draft, greedy, generators)

    return verify


def residual_skipped(real: Verify) -> Verify:
    """After a rejection the correction token is drawn from p instead of norm(max(0, p - q))."""

    def verify(tokens: torch.Tensor, num: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
               greedy: torch.Tensor, generators: list[torch.Generator | None]) -> VerificationResult:
        result = real(tokens, num, target, draft, greedy, generators)
        for b in range(tokens.shape[0]):
            kept = int(result.num_accepted[b])
            if not greedy[b] and kept < int(num[b]):
                result.output_tokens[b, kept] = torch.multinomial(target[b, kept].float(), 1, generator=generators[b])[0]
        return result

    return verify


def misreported_q(real: Verify) -> Verify:
    """The drafts were sampled from q, but the verifier is handed q at twice the temperature."""

    def verify(tokens: torch.Tensor, num: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
               greedy: torch.Tensor, generators: list[torch.Generator | None]) -> VerificationResult:
        if draft is not None:
            flat = draft.clamp_min(0).sqrt()
            draft = flat / flat.sum(-1, keepdim=True)
        return real(tokens, num, target, draft, greedy, generators)

    return verify


def wrong_row(real: Verify) -> Verify:
    """Draft t_i is checked against the distribution one position later (p_{i+1})."""

    def verify(tokens: torch.Tensor, num: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
               greedy: torch.Tensor, generators: list[torch.Generator | None]) -> VerificationResult:
        return real(tokens, num, target.roll(-1, dims=1), draft, greedy, generators)

    return verify


@pytest.mark.parametrize(("bug", "drafter"), [
    (wrong_temperature, "ngram"),
    (wrong_temperature, "draft"),
    (residual_skipped, "ngram"),
    (residual_skipped, "draft"),
    (misreported_q, "draft"),
])
@pytest.mark.usefixtures("engine_modules_loaded")
def test_audit_fails_broken_verifiers(small_target: Path, small_draft: Path, monkeypatch: pytest.MonkeyPatch,
                                      bug: Callable[[Verify], Verify], drafter: str) -> None:
    patch_verify(monkeypatch, bug)
    engine = {"draft_model": str(small_draft)} if drafter == "draft" else {"speculator": "ngram"}
    report = audit(small_target, **engine)
    check = report["checks"]["distribution"]
    assert report["verdict"] == FAIL and check["verdict"] == FAIL, check["summary"]
    assert check["contexts"][0]["exercised"], "the control never reached the broken code"
    assert exit_code(report) == 1


def wrong_greedy_row(real: Callable[..., Verdict]) -> Callable[..., Verdict]:
    """The greedy path (drafts against the target's argmax tokens) checks t_i against argmax p_{i+1}."""

    def verify(tokens: list[list[int]], num: list[int], parents: list[list[int]] | None,
               target_tokens: list[list[int]]) -> Verdict:
        return real(tokens, num, parents, [row[1:] + row[:1] for row in target_tokens])

    return verify


def break_row_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both chain verifiers check t_i one position late: greedy requests without a penalty are
    verified by greedy_verdict, the rest by verify_drafts."""
    patch_verify(monkeypatch, wrong_row)
    patch_verify(monkeypatch, wrong_greedy_row, "greedy_verdict")


@pytest.mark.usefixtures("engine_modules_loaded")
def test_greedy_check_fails_a_broken_greedy_verifier(small_target: Path, small_draft: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    break_row_check(monkeypatch)
    check = audit(small_target, checks=("greedy",), draft_model=str(small_draft))["checks"]["greedy"]
    assert check["verdict"] == FAIL
    divergences = [p["first_divergence"] for p in check["prompts"] if p["first_divergence"]]
    assert divergences and all(not d["near_tie"] and d["chosen_margin"] > d["tie_tolerance"] for d in divergences)


# ------------------------------------------------------------------------------------- the real engine


def test_audit_passes_the_engine_with_ngram(small_target: Path) -> None:
    report = audit(small_target, checks=("distribution", "greedy", "acceptance"), speculator="ngram")
    assert report["verdict"] == PASS, json.dumps(report["checks"], indent=1)[:3000]
    distribution = report["checks"]["distribution"]
    assert len(distribution["contexts"]) == 1 and distribution["alpha_per_test"] == pytest.approx(0.01 / 2)
    assert distribution["contexts"][0]["exercised"] and distribution["contexts"][0]["powered"]
    acceptance = report["checks"]["acceptance"]
    assert acceptance["proposed_tokens"] > 0 and 0 < acceptance["alpha"] < 1
    assert acceptance["gamma"] == SPEC_LENGTH and acceptance["expected_tokens_per_pass"] >= 1


def test_audit_passes_the_engine_with_medusa(small_target: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tree rounds (verified by verify_tree, not verify_drafts) pass too."""
    heads = make_medusa_heads(small_target, tmp_path_factory.mktemp("audit_medusa") / "medusa", num_heads=2,
                              tree_size=10, top_k=4, jitter=0.2)
    report = audit(small_target, checks=("distribution", "greedy"), speculator="medusa", medusa_heads=str(heads),
                   medusa_tree_size=10)
    assert report["verdict"] == PASS, json.dumps(report["checks"], indent=1)[:3000]
    assert report["checks"]["distribution"]["contexts"][0]["exercised"]
    assert report["settings"]["medusa_tree_size"] == 10  # the report says how the tree was sized


def test_cli_audit_passes_the_engine_with_eagle(small_target: Path, tmp_path: Path) -> None:
    """``infer audit --speculator eagle``: dynamic EAGLE-3 trees pass the distribution and greedy checks."""
    head = make_eagle3_head(small_target, tmp_path / "eagle", draft_vocab=[0, 1, 2, 4, 5, 6, 7, 9], std=0.3)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([" ".join(f"w{t - 5}" for t in p) for p in PROMPTS]))
    out = tmp_path / "audit.json"
    args = ["audit", "--model", str(small_target), "--speculator", "eagle", "--eagle-head", str(head),
            "--eagle-tree-size", "8", "--spec-length", "2", "--dtype", "float32", "--device", "cpu",
            "--prompts", str(prompts), "--contexts", "1", "--max-tokens", "24", "--checks", "distribution", "greedy",
            "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["verdict"] == PASS, json.dumps(report["checks"], indent=1)[:3000]
    assert report["checks"]["distribution"]["contexts"][0]["exercised"]
    assert report["settings"]["speculator"] == "eagle" and report["settings"]["eagle_tree_size"] == 8


def test_cli_audit_passes_the_engine_with_a_draft_model(small_target: Path, small_draft: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([" ".join(f"w{t - 5}" for t in p) for p in PROMPTS]))
    out = tmp_path / "audit.json"
    args = ["audit", "--model", str(small_target), "--draft-model", str(small_draft), "--dtype", "float32", "--device", "cpu",
            "--spec-length", str(SPEC_LENGTH), "--prompts", str(prompts), "--contexts", "1", "--max-tokens", "24",
            "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["verdict"] == PASS
    assert {name: c["verdict"] for name, c in report["checks"].items()} == {
        "distribution": PASS, "greedy": PASS, "acceptance": "INFO"}
    contexts = report["checks"]["distribution"]["contexts"]
    assert [c["prompt"] for c in contexts] == json.loads(prompts.read_text())[:1]  # the file's prompts were used
    assert len(report["checks"]["greedy"]["prompts"]) == len(PROMPTS)
    for c in contexts:
        for test in (c["next_token"], c["next_two_tokens"]):
            assert test["dof"] >= 10 and test["p_value"] > 0.01 / 2 and test["detectable_tv"] <= 0.1
    assert report["checks"]["acceptance"]["cost_ratio_c"] is not None  # the draft model's cost was measured
    printed = capsys.readouterr().out
    assert "distribution  PASS" in printed and printed.rstrip().endswith("audit         PASS")


@pytest.mark.usefixtures("engine_modules_loaded")
def test_cli_exit_codes_for_failure_and_low_power(small_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w0 w1 w2 w3 w0 w1 w2 w3 w0 w1\n")
    base = ["audit", "--model", str(small_target), "--speculator", "ngram", "--dtype", "float32", "--device", "cpu",
            "--prompts", str(prompts), "--checks", "distribution"]
    # 200 samples cannot rule out a 10% deviation: not a pass, whatever the p-values say.
    assert main([*base, "--samples", "200", "--json", str(tmp_path / "low.json")]) == 3
    low = json.loads((tmp_path / "low.json").read_text())["checks"]["distribution"]
    assert low["verdict"] == LOW_POWER and not low["contexts"][0]["powered"]
    assert "INSUFFICIENT POWER" in capsys.readouterr().out
    patch_verify(monkeypatch, residual_skipped)
    assert main([*base, "--json", "-"]) == 1
    assert json.loads(capsys.readouterr().out)["checks"]["distribution"]["verdict"] == FAIL


def test_audit_needs_a_drafter(small_target: Path) -> None:
    with pytest.raises(ValueError, match="needs a drafter"):
        AuditSettings(engine={"model": str(small_target)})
    assert main(["audit", "--model", str(small_target)]) == 2


@pytest.mark.usefixtures("engine_modules_loaded")
def test_near_tie_flip_is_told_from_a_bug(small_target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A divergence at a top-2 margin within the tolerance is a NEAR-TIE (exit 0), beyond it a FAIL."""
    break_row_check(monkeypatch)
    report = audit(small_target, checks=("greedy",), speculator="ngram")
    divergences = [p["first_divergence"] for p in report["checks"]["greedy"]["prompts"] if p["first_divergence"]]
    assert divergences
    widest = max(abs(d["chosen_margin"]) for d in divergences)
    tolerant = run_audit(AuditSettings(engine=dict(model=str(small_target), dtype="float32", device="cpu",
                                                   speculator="ngram", spec_length=SPEC_LENGTH, spec_length_policy="fixed"),
                                       prompts=PROMPTS, checks=("greedy",), max_tokens=24, tie_tolerance=widest))
    assert tolerant["checks"]["greedy"]["verdict"] == NEAR_TIE and exit_code(tolerant) == 0


@pytest.mark.usefixtures("engine_modules_loaded")
def test_exact_greedy_mode_runs_both_engines_exact_and_calls_no_flip_a_near_tie(
        small_target: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--exact-greedy reaches the plain engine as well as the speculative one (else plain decoding would
    run other kernels than the ones verified), the report says so, and since exact kernels give a token
    the same bits in any pass, a flip even within the tie tolerance is a FAIL, never a NEAR-TIE."""
    import infer.audit.checks as checks_module

    built: list[bool] = []
    real_llm = checks_module.LLM

    def spy(*args: Any, **kwargs: Any) -> Any:
        llm = real_llm(*args, **kwargs)
        built.append(llm.config.exact_greedy)
        return llm

    monkeypatch.setattr(checks_module, "LLM", spy)
    args = ["audit", "--model", str(small_target), "--speculator", "ngram", "--spec-length", str(SPEC_LENGTH),
            "--dtype", "bfloat16", "--device", "cpu", "--exact-greedy", "--checks", "greedy", "--max-tokens", "24"]
    assert main([*args, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert built == [True, True] and report["settings"]["exact_greedy"] is True
    assert report["checks"]["greedy"]["verdict"] == PASS

    patch_verify(monkeypatch, wrong_row)  # greedy rounds go through greedy_verdict, the rest verify_drafts
    patch_verify(monkeypatch, wrong_greedy_row, "greedy_verdict")
    assert main([*args, "--tie-tolerance", "1e9", "--json", "-"]) == 1
    greedy = json.loads(capsys.readouterr().out)["checks"]["greedy"]
    divergences = [p["first_divergence"] for p in greedy["prompts"] if p["first_divergence"]]
    assert greedy["verdict"] == FAIL and divergences and not any(d["near_tie"] for d in divergences)


def test_reference_logits_match_the_engine(small_target: Path) -> None:
    """The reference (plain forward, no KV cache) agrees with the engine's greedy decoding."""
    from infer import LLM, SamplingParams

    llm = LLM(str(small_target), dtype="float32", device="cpu")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    context = list(PROMPTS[0])
    for token in out.token_ids:
        logits = next_token_logits(llm.engine.model, [context], llm.engine.device)
        assert int(logits[0].argmax()) == token
        context.append(token)

