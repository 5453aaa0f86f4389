"""The audit's three checks, run on the user's own target, drafter and sampling settings.

* **distribution**: for each context prompt, N seeded speculative generations of a few tokens.
  The first generated token x1 comes from the plain prefill pass; x2 and x3 come from speculative
  rounds. Samples are grouped by x1 and compared, group by group, with the target's exact
  distributions P(x2 | prompt, x1) and P(x2, x3 | prompt, x1): the target's own logits (a plain
  forward pass without KV cache) through the engine's sampling transform, enumerated over the top
  of the vocabulary with the rest merged into tail cells. Pearson chi-square statistics are summed
  over the groups; p-values are compared with alpha / (number of tests) (Bonferroni), and each
  test reports the smallest total-variation deviation it detects with the wanted power.
* **greedy**: plain vs speculative greedy token ids per prompt; at the first divergence, the top-2
  logit margin there, so a near-tie flip (rounding) can be told from a bug.
* **acceptance**: α, acceptance by draft position, tokens per target pass, the measured draft/target
  cost ratio c, and the speedup Leviathan et al.'s Theorem 3.8 predicts from them.

Only the public engine API is used (``LLM``, ``SamplingParams``, the engine's model and config), so
the audit checks whatever drafter and verifier the engine really runs.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from infer.audit.stats import ChiSquare, cell_chisquare, detectable_tv
from infer.backends import backend_of
from infer.core.request import speculation_stats
from infer.engine.llm import LLM, RequestOutput
from infer.models.layers import DecoderOnlyLM
from infer.sampling.grammar import StructuredOutput, unpack_bitmasks
from infer.sampling.params import SamplingParams
from infer.sampling.sampler import context_presence
from infer.sampling.transforms import SamplingBatch, apply_repetition_penalty, probs_from_logits
from infer.speculative.budget import expected_speedup

CHECKS = ("distribution", "greedy", "acceptance")
PASS, FAIL, LOW_POWER, NEAR_TIE, SKIPPED, INFO = "PASS", "FAIL", "INSUFFICIENT POWER", "NEAR-TIE", "SKIPPED", "INFO"

# A sample is x1 (plain prefill) then x2, x3 from speculation; a 4th token lets the first round draft
# two tokens (the runner clamps K to the tokens still wanted), so in-round and cross-round paths both run.
SAMPLE_TOKENS = 4
MAX_GROUPS = 6  # x1 values (most frequent first) whose conditionals are tested
MIN_GROUP = 50  # fewer samples than this in an x1 group leave too few cells to test
ONE_TOKEN_CELLS = 12  # most likely x2 tokens with a cell of their own; the rest share a tail cell
TWO_TOKEN_FIRST = 5  # most likely x2 tokens whose x3 is split further ...
TWO_TOKEN_SECOND = 5  # ... into this many most likely x3 tokens plus a tail
REFERENCE_CHUNK = 32  # sequences per reference forward pass

DEFAULT_PROMPTS: tuple[str, ...] = (
    # Repetitive openings: the next token is fairly predictable and n-gram lookup finds matches.
    "one, two, three, four, one, two, three, four, one, two,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)\nprint(",
    "Q: What is the capital of France?\nA: The capital of France is Paris.\nQ: What is the capital of Italy?\nA:",
    '{"name": "Alice", "age": 30, "city": "London"}\n{"name": "Bob", "age": 25, "city":',
    "Speculative decoding makes language models faster because",
)


@dataclass
class AuditSettings:
    """What to audit and how hard. ``engine`` holds the ``LLM`` keyword arguments (model, dtype,
    device, draft_model / speculator, spec_length, ...); ``sampling`` the transform to audit."""

    engine: dict[str, Any]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompts: Sequence[str | list[int]] = DEFAULT_PROMPTS
    contexts: int = 3  # the first prompts are the distribution check's contexts
    samples: int = 3000  # speculative samples per context
    max_tokens: int = 64  # tokens per prompt for the greedy and acceptance checks
    checks: Sequence[str] = CHECKS
    alpha: float = 0.01  # family-wise significance level (Bonferroni over the distribution tests)
    power: float = 0.8
    max_detectable_tv: float = 0.1  # a context whose tests cannot see this deviation is underpowered
    tie_tolerance: float | None = None  # None: from the dtype's precision and the logits' size
    batch_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown or not self.checks:
            raise ValueError(f"checks={list(self.checks)} is invalid: choose from {', '.join(CHECKS)}")
        if not self.prompts:
            raise ValueError("the audit needs at least one prompt")
        for name in ("contexts", "samples", "max_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if not 0 < self.alpha < 1 or not 0 < self.power < 1:
            raise ValueError(f"alpha={self.alpha}, power={self.power} are invalid: both must lie in (0, 1)")
        if not 0 < self.max_detectable_tv <= 1:
            raise ValueError(f"max_detectable_tv={self.max_detectable_tv} is invalid: must lie in (0, 1]")
        engine = self.engine
        # With structured output the grammar drafts what it forces (grammar drafting): a drafter of its own.
        grammar_drafts = self.sampling.structured_output is not None and engine.get("grammar_drafting", True)
        if engine.get("draft_model") is None and engine.get("speculator") is None and not grammar_drafts:
            raise ValueError("the audit needs a drafter: set draft_model, or speculator='ngram', 'medusa', 'suffix' or "
                             "'eagle', or audit grammar drafting with a grammar (--json-schema, --regex, ...)")


Say = Callable[[str], None]


def run_audit(settings: AuditSettings, say: Say = lambda _msg: None) -> dict[str, Any]:
    """Load plain and speculative engines for the settings, run the chosen checks, return the report."""
    engine = {k: v for k, v in settings.engine.items() if k not in ("max_batch_size", "prefix_caching", "block_size")}
    say("loading the target without speculation (reference and plain decoding)")
    # exact_greedy, compile, the backend and the quantization too: plain decoding must run the kernels
    # the speculative engine verifies with (a dequantized target is another model than its GGUF's blocks).
    plain_options = {k: engine[k] for k in ("model", "dtype", "device", "kv_cache_backend", "exact_greedy", "compile",
                                            "backend", "quantization") if k in engine}
    plain = LLM(**plain_options, max_seq_len=engine.get("max_seq_len") or 1024, max_batch_size=1, grammar_drafting=False)
    prompt_ids = [p if isinstance(p, list) else plain.tokenizer.encode(p) for p in settings.prompts]
    longest = max(len(p) for p in prompt_ids)
    if engine.get("max_seq_len") is None:
        engine["max_seq_len"] = longest + max(settings.max_tokens, SAMPLE_TOKENS) + 1
    # Identical prompts share their prefill through the prefix cache (small blocks share the most).
    if engine.get("kv_cache_backend", "paged") == "paged":
        engine.update(prefix_caching=True, block_size=4)
    say("loading the speculative engine")
    spec = LLM(**engine, max_batch_size=settings.batch_size)
    audit = _Audit(settings, plain, spec, prompt_ids, say)
    checks: dict[str, Any] = {}
    for name in CHECKS:
        if name in settings.checks:
            say(f"{name} check")
            checks[name] = getattr(audit, name)()
    verdicts = [c["verdict"] for c in checks.values()]
    overall = FAIL if FAIL in verdicts else LOW_POWER if LOW_POWER in verdicts else PASS
    config = spec.config
    speculative = config.speculative
    drafter: dict[str, Any] = {"speculator": None} if speculative is None else {  # None: the grammar drafts alone
        "speculator": speculative.speculator, "draft_model": speculative.draft_model,
        "spec_length": speculative.spec_length, "spec_length_policy": speculative.spec_length_policy,
        # A tree drafter's size: a measured (None) size may choose plain steps and leave the tests no power.
        "medusa_heads": speculative.medusa_heads, "medusa_tree_size": speculative.medusa_tree_size,
        "suffix_tree_size": speculative.suffix_tree_size,
        "eagle_head": speculative.eagle_head, "eagle_tree_size": speculative.eagle_tree_size}
    structured = settings.sampling.structured_output
    return {
        "verdict": overall,
        "settings": {
            "model": config.model, **drafter, "grammar_drafting": config.grammar_drafting,
            "structured_output": None if structured is None else StructuredOutput.coerce(structured).kind,
            "dtype": str(spec.engine.dtype).removeprefix("torch."), "device": str(spec.engine.device),
            "exact_greedy": config.exact_greedy, "compile": config.compile,
            "sampling": {k: getattr(settings.sampling, k)
                         for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")},
            "samples": settings.samples, "contexts": min(settings.contexts, len(prompt_ids)),
            "max_tokens": settings.max_tokens, "alpha": settings.alpha, "power": settings.power,
            "max_detectable_tv": settings.max_detectable_tv, "seed": settings.seed,
        },
        "checks": checks,
    }


def exit_code(report: dict[str, Any]) -> int:
    """0 when every check passed, 1 when one failed, 3 when none failed but one lacked power."""
    return {FAIL: 1, LOW_POWER: 3}.get(report["verdict"], 0)


# ---------------------------------------------------------------------------------- reference


@torch.inference_mode()
def next_token_logits(model: DecoderOnlyLM, contexts: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Float logits [N, V] of the token after each context: plain causal forward passes, no KV cache."""
    if not contexts:
        return torch.empty(0, model.config.vocab_size, device=device)
    rows: list[torch.Tensor | None] = [None] * len(contexts)
    by_length: dict[int, list[int]] = {}
    for i, context in enumerate(contexts):
        by_length.setdefault(len(context), []).append(i)
    for indices in by_length.values():
        for start in range(0, len(indices), REFERENCE_CHUNK):
            part = indices[start: start + REFERENCE_CHUNK]
            ids = torch.tensor([list(contexts[i]) for i in part], dtype=torch.long, device=device)
            logits = model.compute_logits(backend_of(model).forward(model, ids)[:, -1]).float()
            for row, i in enumerate(part):
                rows[i] = logits[row]
    return torch.stack([r for r in rows if r is not None])


def next_token_probs(model: DecoderOnlyLM, contexts: Sequence[Sequence[int]], params: SamplingParams,
                     device: torch.device, allowed: torch.Tensor | None = None) -> np.ndarray:
    """The exact next-token distributions [N, V] (float64) under the engine's sampling transform
    (``allowed`` [N, V]: the grammar's tokens after each context, None without one)."""
    logits = next_token_logits(model, contexts, device)
    batch = SamplingBatch.from_params([params] * len(contexts), device)
    presence = context_presence(batch, contexts, logits.shape[-1], device)
    probs = probs_from_logits(logits, batch, presence, None if allowed is None else allowed.to(device)).double()
    return (probs / probs.sum(dim=-1, keepdim=True)).cpu().numpy()


# ---------------------------------------------------------------------------------- the checks


class _Audit:
    def __init__(self, settings: AuditSettings, plain: LLM, spec: LLM, prompt_ids: list[list[int]], say: Say) -> None:
        self.settings = settings
        self.plain, self.spec = plain, spec
        self.prompt_ids = prompt_ids
        self.say = say
        self.model = plain.engine.model
        self.device = plain.engine.device
        self._runs: dict[tuple[str, bool], list[RequestOutput]] = {}

    # -- distribution ---------------------------------------------------------------------------
    def distribution(self) -> dict[str, Any]:
        s = self.settings
        if s.sampling.greedy:
            return {"verdict": SKIPPED, "summary": "temperature 0 is greedy decoding: the greedy check covers it"}
        contexts = self.prompt_ids[: s.contexts]
        params = replace(s.sampling, max_tokens=SAMPLE_TOKENS, ignore_eos=True, stop=[], stop_token_ids=[])
        # One request per context first, so the prompt's blocks are in the prefix cache for the rest.
        self.spec.generate(contexts, replace(params, max_tokens=1, seed=None))
        prompts = [ids for ids in contexts for _ in range(s.samples)]
        progress = _Progress(self.say, "distribution samples", len(prompts))
        # Unseeded requests, so the rejection sampler is what is audited (a request with a seed
        # draws plain decoding's tokens, see docs/exactness.md); their generators' seeds come from
        # the global RNG, seeded here, so a run reproduces.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s.seed)
            outputs = self.spec.generate(prompts, replace(params, seed=None), on_token=progress.on_token)
        tests = 2 * len(contexts)
        alpha = s.alpha / tests  # Bonferroni over (next token, next two tokens) x contexts
        results = [self._context(ids, outputs[c * s.samples: (c + 1) * s.samples], params, alpha)
                   for c, ids in enumerate(contexts)]
        rejected = [r for r in results for key in ("next_token", "next_two_tokens")
                    if r[key]["p_value"] is not None and r[key]["p_value"] < alpha]
        counted = [r for r in results if r["exercised"] and r["powered"]]
        if rejected:
            verdict = FAIL
            summary = (f"the speculative samples do not follow the target's distribution "
                       f"({len(rejected)} of {tests} tests rejected at alpha {s.alpha}/{tests})")
        elif not counted:
            verdict = LOW_POWER
            summary = (f"no context both exercised speculation and could detect a total-variation deviation of "
                       f"{s.max_detectable_tv} (raise --samples, or use prompts whose next tokens are predictable)")
        else:
            worst = max(max(r["next_token"]["detectable_tv"], r["next_two_tokens"]["detectable_tv"]) for r in counted)
            verdict = PASS
            summary = (f"no deviation found in {tests} tests (Bonferroni alpha {s.alpha}/{tests}); {len(counted)} of "
                       f"{len(results)} contexts exercised speculation with power {s.power} against any "
                       f"total-variation deviation >= {worst:.3f}")
        return {"verdict": verdict, "summary": summary, "alpha_per_test": alpha, "contexts": results}

    def _context(self, ids: list[int], outputs: list[RequestOutput], params: SamplingParams, alpha: float) -> dict[str, Any]:
        s = self.settings
        tokens = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
        drafted = np.array([o.metrics.proposed_tokens > 0 for o in outputs])
        counts = Counter(tokens[:, 0].tolist())
        groups = [x1 for x1, n in counts.most_common(MAX_GROUPS) if n >= MIN_GROUP]
        used = np.isin(tokens[:, 0], groups)
        p2 = next_token_probs(self.model, [ids + [x1] for x1 in groups], params, self.device,
                              self._grammar_allowed([[x1] for x1 in groups]))
        seconds: list[list[int]] = [[int(a) for a in np.argsort(-p2[g], kind="stable")[:TWO_TOKEN_FIRST]
                                     if p2[g, a] * counts[x1] >= 2 * 5.0] for g, x1 in enumerate(groups)]
        pairs = [(g, a) for g in range(len(groups)) for a in seconds[g]]
        p3 = next_token_probs(self.model, [ids + [groups[g], a] for g, a in pairs], params, self.device,
                              self._grammar_allowed([[groups[g], a] for g, a in pairs])) if pairs else None
        one, two, impossible = ChiSquare(), ChiSquare(), 0
        for g, x1 in enumerate(groups):
            rows = tokens[tokens[:, 0] == x1]
            third = {a: p3[pairs.index((g, a))] for a in seconds[g]} if p3 is not None else {}
            one = one + _one_token_cells(rows[:, 1], p2[g])
            two = two + _two_token_cells(rows[:, 1], rows[:, 2], p2[g], third)
            impossible += int((p2[g][rows[:, 1]] == 0).sum())
            impossible += sum(int(third[a][b] == 0) for a, b in rows[:, 1:3].tolist() if a in third)
        judged = [o for o, u in zip(outputs, used, strict=True) if u]
        proposed = sum(o.metrics.proposed_tokens for o in judged)
        accepted = sum(o.metrics.accepted_tokens for o in judged)
        drafted_share = float(drafted[used].mean()) if used.any() else 0.0
        tests = {name: _test_report(test, alpha, s.power) for name, test in (("next_token", one), ("next_two_tokens", two))}
        tv = [t["detectable_tv"] for t in tests.values()]
        tokenizer = self.spec.tokenizer
        return {
            "prompt": tokenizer.decode(ids), "prompt_tokens": len(ids), "samples": len(outputs),
            "first_tokens": [{"token_id": x1, "text": tokenizer.decode([x1]), "samples": counts[x1]} for x1 in groups],
            "samples_used": int(used.sum()), "drafted_share": drafted_share,
            "acceptance_rate": accepted / proposed if proposed else None,
            **tests, "impossible_samples": impossible,
            # Drafts in most tested samples, some accepted and some rejected: both verdict paths ran.
            "exercised": drafted_share >= 0.5 and 0 < accepted < proposed,
            "powered": all(t is not None and t <= s.max_detectable_tv for t in tv),
        }

    # -- greedy -----------------------------------------------------------------------------------
    def greedy(self) -> dict[str, Any]:
        params = self._greedy_params()
        plain, spec = self._per_prompt(self.plain, params), self._per_prompt(self.spec, params)
        results, diverged, bugs = [], 0, 0
        for ids, a, b in zip(self.prompt_ids, plain, spec, strict=True):
            entry: dict[str, Any] = {"prompt": self.spec.tokenizer.decode(ids)[:80], "tokens": len(a.token_ids),
                                     "identical": a.token_ids == b.token_ids, "first_divergence": None}
            if not entry["identical"]:
                diverged += 1
                entry["first_divergence"] = divergence = self._divergence(ids, a.token_ids, b.token_ids, params)
                bugs += not divergence["near_tie"]
            results.append(entry)
        n = len(results)
        if bugs:
            verdict, summary = FAIL, (f"{diverged} of {n} prompts diverged, {bugs} at a clear margin "
                                      "(not a rounding near-tie): speculation changed the greedy output")
        elif diverged:
            verdict, summary = NEAR_TIE, (f"{diverged} of {n} prompts diverged, each at a near-tie of the top-2 logits "
                                          "(different kernels round differently); the rest are identical")
        else:
            verdict, summary = PASS, f"speculative greedy output identical to plain decoding on {n} prompts"
        return {"verdict": verdict, "summary": summary, "prompts": results}

    def _divergence(self, ids: list[int], plain: list[int], spec: list[int], params: SamplingParams) -> dict[str, Any]:
        i = next((k for k, (x, y) in enumerate(zip(plain, spec, strict=False)) if x != y), min(len(plain), len(spec)))
        context = ids + plain[:i]
        logits = next_token_logits(self.model, [context], self.device)
        if params.repetition_penalty != 1.0:
            presence = context_presence(SamplingBatch.from_params([params], self.device), [context],
                                        logits.shape[-1], self.device)
            assert presence is not None
            logits = apply_repetition_penalty(logits, presence, torch.tensor([params.repetition_penalty],
                                                                             device=self.device))
        row = logits[0]
        top2 = row.topk(2).values.tolist()
        margin = top2[0] - top2[1]
        tolerance = self.settings.tie_tolerance
        if tolerance is None:
            tolerance = default_tie_tolerance(self.spec.engine.dtype, float(row.abs().max()))
        plain_token = plain[i] if i < len(plain) else None
        spec_token = spec[i] if i < len(spec) else None
        chosen = None if plain_token is None or spec_token is None else float(row[plain_token] - row[spec_token])
        tokenizer = self.spec.tokenizer
        return {
            "index": i, "plain_token": plain_token, "speculative_token": spec_token,
            "plain_text": None if plain_token is None else tokenizer.decode([plain_token]),
            "speculative_text": None if spec_token is None else tokenizer.decode([spec_token]),
            "top2_margin": margin, "chosen_margin": chosen, "tie_tolerance": tolerance,
            # Exact-greedy kernels give a token the same bits in any pass: no flip there is rounding.
            "near_tie": chosen is not None and abs(chosen) <= tolerance and not self.spec.config.exact_greedy,
        }

    # -- acceptance -------------------------------------------------------------------------------
    def acceptance(self) -> dict[str, Any]:
        s = self.settings
        params = self._greedy_params() if s.sampling.greedy else replace(
            s.sampling, max_tokens=s.max_tokens, ignore_eos=True, stop=[], stop_token_ids=[], seed=None)
        # Unseeded (rejection sampling, what unseeded traffic gets), from a seeded global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s.seed)
            spec = self._per_prompt(self.spec, params)
            plain = self._per_prompt(self.plain, params)
        stats = speculation_stats(spec)
        rounds = sum(o.metrics.num_rounds for o in spec)
        # Rounds that drafted at least one token (the rest were plain steps the policy chose).
        drafted_rounds = sum(o.metrics.proposed_per_position[0] for o in spec if o.metrics.proposed_per_position)
        config = self.spec.config.speculative  # None: the grammar drafts alone
        chain_fixed = config is not None and config.spec_length_policy == "fixed" and \
            config.speculator not in ("medusa", "eagle")
        proposed = sum(o.metrics.proposed_tokens for o in spec)
        gamma = config.spec_length if chain_fixed and config is not None else max(1, round(proposed / drafted_rounds)) if drafted_rounds else None
        cost = _measured_cost_ratio(self.spec)
        alpha = stats["alpha"]
        # Equation (1), (1 - α^(γ+1)) / (1 - α), is Theorem 3.8 with a free drafter (c = 0).
        tokens_per_pass = None if alpha is None or gamma is None else expected_speedup(alpha, gamma, 0.0)
        predicted = None if alpha is None or gamma is None or cost is None else expected_speedup(alpha, gamma, cost)
        rates = [(o.metrics.decode_tokens_per_s, p.metrics.decode_tokens_per_s) for o, p in zip(spec, plain, strict=True)]
        ratios = [a / b for a, b in rates if a and b]
        summary = ("no tokens were drafted" if not proposed else
                   f"alpha {alpha:.3f} over {rounds} target passes, {stats['mean_accepted_tokens']:.2f} tokens per pass")
        if predicted is not None:
            summary += f"; Theorem 3.8 predicts {predicted:.2f}x at gamma={gamma}, c={cost:.3f}"
        if ratios:
            summary += f"; measured {statistics.median(ratios):.2f}x decode speed vs plain (batch 1)"
        return {
            "verdict": INFO, "summary": summary, **stats, "target_passes": rounds, "proposed_tokens": proposed,
            "gamma": gamma, "gamma_source": "spec_length" if chain_fixed else "mean drafts per drafting round",
            "cost_ratio_c": cost, "expected_tokens_per_pass": tokens_per_pass, "predicted_speedup": predicted,
            "measured_speedup": statistics.median(ratios) if ratios else None,
        }

    # -- shared ----------------------------------------------------------------------------------
    def _greedy_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.settings.max_tokens, temperature=0.0, ignore_eos=True,
                              repetition_penalty=self.settings.sampling.repetition_penalty,
                              structured_output=self.settings.sampling.structured_output)

    def _grammar_allowed(self, outputs: list[list[int]]) -> torch.Tensor | None:
        """[N, V] bool: the tokens the audited grammar allows after each of ``outputs`` (generated
        tokens, from a fresh matcher each: plain decoding's masks), or None without a grammar."""
        spec = self.settings.sampling.structured_output
        if spec is None:
            return None
        engine = self.plain.engine
        masks = []
        for tokens in outputs:
            matcher = engine.grammars.matcher(spec)  # type: ignore[arg-type]
            error = next((e for e in map(matcher.consume, tokens) if e is not None), None)
            masks.append(torch.zeros(matcher.words, dtype=torch.int32) if error else matcher.bitmask())
        return unpack_bitmasks(torch.stack(masks), engine.model_config.vocab_size, "cpu")

    def _per_prompt(self, llm: LLM, params: SamplingParams) -> list[RequestOutput]:
        """One prompt at a time (batch 1, as Theorem 3.8 assumes), cached per engine and settings."""
        key = ("spec" if llm is self.spec else "plain", params.greedy)
        if key not in self._runs:
            which = "speculative" if llm is self.spec else "plain"
            self.say(f"{which} {'greedy' if params.greedy else 'sampled'} runs on {len(self.prompt_ids)} prompts")
            self._runs[key] = [llm.generate([ids], params)[0] for ids in self.prompt_ids]
        return self._runs[key]


def default_tie_tolerance(dtype: torch.dtype, logit_scale: float) -> float:
    """The logit difference below which a flip is put down to rounding: a few ulps of the dtype at the
    logits' size, accumulated over the layers (a heuristic; ``--tie-tolerance`` overrides it)."""
    return 8 * torch.finfo(dtype).eps * max(1.0, logit_scale)


def _measured_cost_ratio(llm: LLM) -> float | None:
    """c = one draft step / one target step at batch size 1, from the budget controller's fitted
    costs (None for drafters without per-token steps, or before both costs were measured)."""
    from infer.engine.speculative_runner import SpeculativeRunner

    runner = llm.engine.runner
    if not isinstance(runner, SpeculativeRunner):
        return None
    budget = runner.budget
    if not (budget.cost_per_token and budget.target.ready and budget.draft.ready):
        return None
    intercept, slope = budget.target.coefficients()
    plain = intercept + slope
    return budget.draft.predict(1) / plain if plain > 0 else None


def _one_token_cells(x2: np.ndarray, p: np.ndarray) -> ChiSquare:
    n = len(x2)
    top = [int(t) for t in np.argsort(-p, kind="stable")[:ONE_TOKEN_CELLS] if p[t] * n >= 5.0]
    observed = [int((x2 == t).sum()) for t in top]
    expected = [float(p[t] * n) for t in top]
    observed.append(n - sum(observed))
    expected.append(max(n - sum(expected), 0.0))
    return cell_chisquare(np.array(observed), np.array(expected))


def _two_token_cells(x2: np.ndarray, x3: np.ndarray, p2: np.ndarray, p3: dict[int, np.ndarray]) -> ChiSquare:
    """Cells (a, b) for likely a and b, (a, other) per likely a, and (other, any)."""
    n = len(x2)
    observed: list[int] = []
    expected: list[float] = []
    for a, third in p3.items():
        mass = n * float(p2[a])
        follow = x3[x2 == a]
        top = [int(b) for b in np.argsort(-third, kind="stable")[:TWO_TOKEN_SECOND] if third[b] * mass >= 5.0]
        observed += [int((follow == b).sum()) for b in top] + [len(follow) - sum(int((follow == b).sum()) for b in top)]
        expected += [float(third[b] * mass) for b in top] + [max(mass * (1.0 - float(third[top].sum())), 0.0)]
    observed.append(n - sum(observed))
    expected.append(max(n - sum(expected), 0.0))
    return cell_chisquare(np.array(observed), np.array(expected))


def _test_report(test: ChiSquare, alpha: float, power: float) -> dict[str, Any]:
    return {
        "statistic": test.statistic, "dof": test.dof, "samples": test.samples,
        "p_value": test.p_value if test.dof else None,
        "detectable_tv": detectable_tv(test.samples, test.dof, alpha, power),
        "observed_tv": test.observed_tv,
    }


class _Progress:
    """Counts finished requests and says so every tenth of the way."""

    def __init__(self, say: Say, what: str, total: int) -> None:
        self.say, self.what, self.total = say, what, total
        self.done = 0
        self.next_report = 0.1

    def on_token(self, request: Any, _new: list[int]) -> None:
        if request.is_finished:
            self.done += 1
            if self.done >= self.next_report * self.total:
                self.say(f"{self.what}: {self.done}/{self.total}")
                self.next_report = math.floor(10 * self.done / self.total + 1) / 10
