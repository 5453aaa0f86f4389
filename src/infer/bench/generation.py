"""Single-request generation benchmark (W1): infer plain / speculative vs transformers, same prompts.

Every mode generates exactly ``max_tokens`` tokens per prompt (EOS ignored) so tokens/s compare
like with like; with ``stop_at_eos`` (the repetitive workload: answers end) each stops at EOS, and
greedy modes still generate the same tokens. Throughput is end to end (prefill included), the
median over prompts × repeats after one warm-up generation per mode. Suffix decoding, which learns
from earlier requests, then forgets that generation, serves ``warmup_prompts`` (similar requests,
none of them timed), and starts every timed generation from exactly what it learnt there.

**Theorem 3.8's prediction** (Leviathan et al.) for a chain drafter's row is the theorem applied to
the rounds the row actually ran (``expected_speedup_over_rounds``): the measured α, each round's
real draft length k_r, and each round costing one target decode step (its verification pass) plus
the drafting, in target decode steps (medians of prefill-free decode rates, same run):

* a draft model: ``c`` = the draft model's decode step alone / the target's decode step, per draft,
  exactly Leviathan et al.'s c; with every round drafting K this is the theorem as printed.
* n-gram lookup (no model; one call per round whatever it finds): the measured time inside the
  drafter per round over the target's decode step, charged to every round that called it, and
  reported as ``c`` = that / K (so ``cK + 1`` is the round's cost when it drafts K tokens). Rounds
  where the lookup found fewer than K tokens (or none) are predicted at their own length: the
  theorem is not charged for drafts the lookup never made.

The theorem is about decoding: ``measured / predicted`` divides the row's *decode* speedup over infer
plain (median decode tokens/s, prefill excluded: prefill is the same work in every mode) by the
prediction. The theorem counts a (K+1)-token verification pass as one decode step and charges
nothing else, so a ratio below 1 is what infer's rounds cost beyond that. Each speculative row
also reports where its rounds went (``round_ms``: inside the drafter, verification passes, plain
fallback steps; ``verify_vs_decode_step``; for a draft model ``draft_step_vs_alone``, the drafter's
time per draft over the draft model's own decode step). Tree drafters (Medusa, suffix) get no
prediction: Theorem 3.8 is about chains.
"""

from __future__ import annotations

import copy
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from infer.bench import SPEC_LENGTH_SWEEP
from infer.bench.peer import gguf_weight_bytes_per_token, memory_bandwidth, weight_bytes_per_token
from infer.core.request import speculation_stats
from infer.engine.llm import LLM
from infer.engine.speculative_runner import SpeculativeRunner
from infer.sampling.params import SamplingParams
from infer.speculative.budget import expected_speedup_over_rounds
from infer.speculative.suffix import SuffixDrafter


@dataclass
class BenchSettings:
    model: str
    draft_model: str | None
    prompts: list[str]
    workload: str = "code"
    max_tokens: int = 128
    temperature: float = 0.0
    spec_lengths: list[int] = field(default_factory=lambda: list(SPEC_LENGTH_SWEEP))
    policies: list[str] = field(default_factory=lambda: ["entropy", "goodput"])
    ngram: bool = True
    medusa_heads: str | None = None  # a Medusa heads folder: adds an "infer + Medusa" row
    medusa_tree_sizes: list[int] = field(default_factory=list)  # plus one row per fixed tree size
    eagle_head: str | None = None  # an EAGLE-3 head folder: adds an "infer + EAGLE" row
    suffix: bool = False  # an "infer + suffix" row (suffix decoding)
    hf: bool = True
    repeats: int = 3
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    peer: str | None = None  # "llama.cpp": add llama-cpp-python rows on each of peer_gguf
    peer_gguf: list[str] = field(default_factory=list)  # the first is what "vs llama.cpp" divides by
    extra_dtypes: list[str] = field(default_factory=list)  # an "infer plain (dtype)" row for each
    extra_backends: list[str] = field(default_factory=list)  # an "infer plain (backend NAME)" row for each
    chat: bool = False  # each prompt is a user message rendered with the model's chat template
    stop_at_eos: bool = False
    # Requests suffix decoding learns from before the timed ones (which each start from exactly what
    # it learnt here: a timed request never drafts from another, nor from an earlier repeat of itself).
    warmup_prompts: list[str] = field(default_factory=list)
    # Also time every infer mode with exact-greedy kernels ("... (exact greedy)" rows), interleaved.
    exact_greedy: bool = False
    # Also time every infer mode torch.compiled ("... (compiled)" rows), interleaved.
    compiled: bool = False
    backend: str = "auto"  # what computes infer's forward passes (infer.backends); recorded in the environment
    # Also time every infer mode with its steps replayed as CUDA graphs ("... (CUDA graphs)"; CUDA only).
    cuda_graphs: bool = False
    # Prompt lengths whose processing (prefill) is timed on every plain row, llama.cpp's too, interleaved.
    prefill_tokens: list[int] = field(default_factory=list)
    # Context lengths after which every plain row's decode speed is timed (llama.cpp's too), interleaved:
    # a prompt of that many tokens, then max_tokens greedy tokens, the prefill excluded.
    context_tokens: list[int] = field(default_factory=list)
    # Engine options every infer row loads with (max_seq_len, kv_cache_backend, ...: what the bench CLI
    # takes from the option registry beyond the fields above).
    engine_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModeResult:
    mode: str
    engine: str  # infer | transformers | llama.cpp
    tokens_per_s: float
    samples: list[float]
    spec_length: int | None = None
    policy: str | None = None
    alpha: float | None = None
    acceptance_rate: float | None = None
    mean_accepted_tokens: float | None = None
    acceptance_by_position: list[float | None] | None = None
    speedup_vs_plain: float | None = None
    speedup_vs_transformers: float | None = None
    predicted_speedup: float | None = None
    speedup_vs_peer: float | None = None  # tokens/s over llama.cpp's plain row, same prompts, same run
    decode_tokens_per_s: float | None = None  # median over prompts, prefill excluded
    # CPU time the process spent per generated token (all its threads; with one thread, unlike wall
    # time, it does not count the time other programs on a shared machine held the core)
    cpu_ms_per_token: float | None = None
    decode_speedup_vs_plain: float | None = None  # decode tokens/s over infer plain's: what Theorem 3.8 predicts
    bandwidth_fraction: float | None = None  # plain rows: decode weight bytes/s over measured memory bandwidth
    tree_nodes_per_round: float | None = None  # drafters that propose trees and count their nodes
    dtype: str | None = None  # infer rows: the precision they ran in
    weight_bytes_per_token: int | None = None  # plain rows: what one decode step reads
    cost_ratio: float | None = None  # this row's c in target decode steps per draft (see the module docstring)
    rounds_by_length: list[int] | None = None  # timed rounds that drafted k tokens, k = 0, 1, ...
    round_ms: dict[str, float] | None = None  # per round: drafter, verification, plain fallback (ms)
    verify_vs_decode_step: float | None = None  # a verification round over the target's plain decode step
    draft_step_vs_alone: float | None = None  # drafter time per draft over the draft model's own step
    texts: list[str] = field(default_factory=list)


def _params(settings: BenchSettings, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature,
                          ignore_eos=not settings.stop_at_eos, seed=seed)


# A model-free drafter's row with the engine's default length policy (the K rows draft a fixed K).
DEFAULT_POLICY = "(default policy)"
OTHER_BACKEND = "(backend "  # an --also-backend row: "infer plain (backend torch)"
EXACT = "(exact greedy)"  # the suffix of a mode run with exact-greedy kernels
COMPILED = "(compiled)"  # the suffix of a mode run with its forward torch.compiled
GRAPHS = "(CUDA graphs)"  # the suffix of a mode whose decode and verify steps replay CUDA graphs

# One timed generation of a prompt (text, or token ids when it went through the chat template):
# (tokens per second, the infer RequestOutput or None for transformers).
RunFn = Callable[[str | list[int], int], tuple[float, Any]]


class _History:
    """What suffix decoding has learnt from earlier requests, saved once and restored at will."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.engine.runner
        assert isinstance(runner, SpeculativeRunner) and isinstance(runner.drafter, SuffixDrafter)
        self.drafter = runner.drafter
        self.saved = copy.deepcopy(self.drafter.store)  # nothing learnt yet

    def save(self) -> None:
        self.saved = copy.deepcopy(self.drafter.store)

    def restore(self) -> None:
        self.drafter.store = copy.deepcopy(self.saved)


@dataclass
class _Mode:
    result: ModeResult
    run: RunFn
    outputs: list[Any] = field(default_factory=list)
    reported: bool = True
    llm: LLM | None = None
    history: _History | None = None  # for a drafter that learns from earlier requests
    cpu_ms_per_token: list[float] = field(default_factory=list)
    # Plain rows: process a prompt of token ids and return the seconds it took (prefill tok/s rows).
    prefill: Callable[[list[int]], float] | None = None


def _infer_runner(settings: BenchSettings, model: str, dtype: str, **options: Any) -> tuple[RunFn, LLM]:
    # One request at a time: a batch of one needs only one sequence's KV cache.
    options.setdefault("backend", settings.backend)
    # Repeats send the same prompts: a prefix-cache hit would time no prefill, so caching is off.
    llm = LLM(model, dtype=dtype, device=settings.device, max_batch_size=1,
              **({"prefix_caching": False} | settings.engine_options | options))

    def run(prompt: str | list[int], seed: int) -> tuple[float, Any]:
        start = time.perf_counter()
        out = llm.generate([prompt], _params(settings, seed))[0]
        return len(out.token_ids) / (time.perf_counter() - start), out

    return run, llm


def _infer_prefill(llm: LLM) -> Callable[[list[int]], float]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill(prompt_ids: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([prompt_ids], params)
        return time.perf_counter() - start

    return prefill


def prefill_prompt(tokenizer: Any, prompts: list[str], tokens: int, offset: int) -> list[int]:
    """``tokens`` ids of the prompts' text, one after another (repeated as needed), from ``offset``:
    each repeat gets another offset, so no engine can reuse an earlier prompt's cache."""
    text_ids = [i for p in prompts for i in tokenizer.encode(p)]
    if not text_ids:
        raise ValueError("the prompts encode to no tokens: nothing to build a prefill prompt from")
    needed = offset + tokens
    ids = text_ids * (needed // len(text_ids) + 1)
    return ids[offset:needed]


def _prepare(settings: BenchSettings, prompts: list[str]) -> list[str | list[int]]:
    """The prompts as every mode receives them: text, or chat-template token ids with ``chat``."""
    if not settings.chat:
        return list(prompts)
    from infer.loader import load_tokenizer

    tokenizer = load_tokenizer(settings.model)
    return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]


@dataclass
class PeerOutput:
    """What a peer engine's run produced (the fields the report reads from infer's outputs)."""

    text: str
    token_ids: list[int]
    decode_tokens_per_s: float | None


def _model_gguf(model: str) -> Path:
    """The GGUF file ``--model`` names, which the peer runs when no --peer-gguf is given."""
    from infer.loader import resolve_model_path

    path = resolve_model_path(model)
    if not path.is_file():
        raise ValueError(f"--peer llama.cpp runs llama.cpp on --model's own file, but {model} is a Hugging Face "
                         "folder: give --peer-gguf, a GGUF of the same model (infer bench export-gguf writes one)")
    return path


def _peer_modes(settings: BenchSettings, llm: LLM, threads: int, say: Callable[[str], None]) -> list[_Mode]:
    """llama.cpp plain (and prompt lookup, next to infer's n-gram row) on the same prompt token ids,
    on ``threads`` threads."""
    from infer.bench.peer import LlamaCppRunner

    if settings.peer != "llama.cpp":
        raise ValueError(f"unknown peer {settings.peer!r}: the one supported is llama.cpp")
    import gguf

    from infer.loader.gguf import open_gguf

    tokenizer = llm.tokenizer
    prompt_ids = {p: tokenizer.encode(p) for p in settings.prompts}
    if settings.chat:
        prompt_ids = {p: ids for p, ids in zip(settings.prompts, _prepare(settings, settings.prompts), strict=True)
                      if isinstance(ids, list)}
    context = max(max(len(ids) for ids in prompt_ids.values()) + settings.max_tokens,
                  max(settings.prefill_tokens, default=0),
                  max(settings.context_tokens, default=0) + settings.max_tokens) + 8
    # One plain row per file, named by its precision; prompt lookup on the first file only.
    variants: list[tuple[str, str, int | None]] = []
    for i, path in enumerate(settings.peer_gguf):
        file_type = open_gguf(Path(path)).get("general.file_type")
        name = f"llama.cpp {gguf.LlamaFileType(file_type).name.removeprefix('MOSTLY_')}"
        variants.append((name, path, None))
        if i == 0 and settings.ngram:
            variants.append((f"{name} + prompt lookup K={max(settings.spec_lengths)}", path, max(settings.spec_lengths)))
    modes = []
    for name, path, lookup in variants:
        say(f"[{name}] loading {path}")
        runner = LlamaCppRunner(path, settings.max_tokens, context, lookup, threads)

        def run(prompt: str | list[int], seed: int, runner: LlamaCppRunner = runner) -> tuple[float, Any]:
            rate, decode, ids = runner.run(prompt if isinstance(prompt, list) else prompt_ids[prompt])
            return rate, PeerOutput(tokenizer.decode(ids), ids, decode)

        result = ModeResult(name, "llama.cpp", 0.0, [], spec_length=lookup,
                            weight_bytes_per_token=None if lookup else gguf_weight_bytes_per_token(path))
        modes.append(_Mode(result, run, prefill=None if lookup else runner.prefill))
    return modes


def run_generation_bench(settings: BenchSettings, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Load every mode, then time them interleaved: each (repeat, prompt) runs all modes back to back,
    in an order that rotates per repeat, so a machine that speeds up or slows down over minutes
    (shared or throttled CPUs) shifts every mode alike instead of whichever ran at that time."""
    torch.manual_seed(settings.seed)
    # The machine's thread count, taken before infer's engines load: on a shared machine they may
    # lower torch's count between passes (kernels.cpu.ThreadChooser), which must not set the peer's.
    threads = torch.get_num_threads()
    if settings.peer and not settings.peer_gguf:
        settings = replace(settings, peer_gguf=[str(_model_gguf(settings.model))])
    modes, draft_alone = _load_modes(settings, threads, say)
    plain, plain_llm = modes[0].result, modes[0].llm
    assert plain_llm is not None

    prompts = _prepare(settings, settings.prompts)
    history = _prepare(settings, settings.warmup_prompts)
    _warm_up(settings, modes, prompts, history, say)
    bandwidths = _time_modes(settings, modes, prompts, say)
    prefill = _time_prefill(settings, plain_llm, modes, say) if settings.prefill_tokens else []
    long_context = _time_long_context(settings, plain_llm, modes, say) if settings.context_tokens else []

    _summarise(modes, len(settings.prompts), plain)
    cost = _cost_and_predictions(modes, plain, draft_alone, say)
    results = [m.result for m in modes if m.reported]
    _speedups(results, plain)
    greedy_identical, twin_identical = _outputs_identical(settings, results, plain)
    memory = _weights_and_bandwidth(settings, modes, results, plain, bandwidths)
    return {
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("prompts", "warmup_prompts")}
        | {"num_prompts": len(prompts), "num_warmup_prompts": len(history)},
        "environment": environment(settings.device) | {"backend": plain_llm.engine.backend.info(), "threads": threads},
        "cost_ratio_c": cost,
        "greedy_outputs_identical": greedy_identical,
        "memory": memory,
        "exact_greedy_outputs_identical": twin_identical[EXACT],
        "compiled_outputs_identical": twin_identical[COMPILED],
        "cuda_graphs_outputs_identical": twin_identical[GRAPHS],
        "results": [{k: v for k, v in asdict(r).items() if k != "texts"} for r in results],
        "prefill": prefill,
        "long_context": long_context,
        "sample_output": plain.texts[0] if plain.texts else "",
    }


def _infer_modes(settings: BenchSettings, name: str, say: Callable[[str], None], reported: bool = True,
                 dtype: str | None = None, **options: Any) -> list[_Mode]:
    """The infer row ``name``, loaded with ``options``, then its twins (exact-greedy kernels, compiled,
    CUDA graphs) where the settings ask for them."""
    model = options.pop("model", settings.model)
    variants: list[tuple[str, dict[str, Any]]] = [(name, {})]
    if reported:  # the draft alone (only for c) needs no twins
        if settings.exact_greedy:
            variants.append((f"{name} {EXACT}", {"exact_greedy": True}))
        if settings.compiled:
            variants.append((f"{name} {COMPILED}", {"compile": True}))
        if settings.cuda_graphs:
            variants.append((f"{name} {GRAPHS}", {"cuda_graphs": True}))
    modes = []
    for label, extra in variants:
        say(f"[{label}] loading")
        run, llm = _infer_runner(settings, model, settings.dtype if dtype is None else dtype, **options, **extra)
        # The precision the row ran in (what --dtype auto resolved to on this machine).
        ran = str(llm.engine.dtype).removeprefix("torch.")
        result = ModeResult(label, "infer", 0.0, [], spec_length=options.get("spec_length"),
                            policy=options.get("spec_length_policy"), dtype=ran)
        history = _History(llm) if options.get("speculator") == "suffix" else None
        plain_row = reported and not options.get("speculator") and not options.get("draft_model")
        modes.append(_Mode(result, run, reported=reported, llm=llm, history=history,
                           prefill=_infer_prefill(llm) if plain_row else None))
    return modes


def _load_modes(settings: BenchSettings, threads: int,
                say: Callable[[str], None]) -> tuple[list[_Mode], ModeResult | None]:
    """Every mode in the order the report lists them, infer plain first (each infer row followed by its
    twins), and the draft model decoding alone when there is one (not a row: it gives the cost ratio c)."""
    modes: list[_Mode] = []

    def infer_row(name: str, **options: Any) -> ModeResult:
        added = _infer_modes(settings, name, say, **options)
        modes.extend(added)
        return added[0].result

    infer_row("infer plain")
    for dtype in settings.extra_dtypes:
        infer_row(f"infer plain ({dtype})", dtype=dtype)
    for backend in settings.extra_backends:
        infer_row(f"infer plain {OTHER_BACKEND}{backend})", backend=backend)
    draft_alone = None
    if settings.draft_model is not None:
        draft_alone = infer_row("draft model alone", reported=False, model=settings.draft_model)
        for k in settings.spec_lengths:
            infer_row(f"infer + draft K={k}", draft_model=settings.draft_model, spec_length=k,
                      spec_length_policy="fixed")
        for policy in settings.policies:
            infer_row(f"infer + draft ({policy})", draft_model=settings.draft_model,
                      spec_length=max(settings.spec_lengths), spec_length_policy=policy)
    if settings.ngram:
        infer_row(f"infer + n-gram K={max(settings.spec_lengths)}", speculator="ngram",
                  spec_length=max(settings.spec_lengths), spec_length_policy="fixed")
        infer_row(f"infer + n-gram {DEFAULT_POLICY}", speculator="ngram")
    if settings.medusa_heads:
        infer_row("infer + Medusa", speculator="medusa", medusa_heads=settings.medusa_heads,
                  spec_length=max(settings.spec_lengths))
        for size in settings.medusa_tree_sizes:
            infer_row(f"infer + Medusa ({size}-node tree)", speculator="medusa", medusa_heads=settings.medusa_heads,
                      spec_length=max(settings.spec_lengths), medusa_tree_size=size)
    if settings.eagle_head:
        infer_row("infer + EAGLE", speculator="eagle", eagle_head=settings.eagle_head,
                  spec_length=max(settings.spec_lengths))
    if settings.suffix:
        infer_row(f"infer + suffix K={max(settings.spec_lengths)}", speculator="suffix",
                  spec_length=max(settings.spec_lengths), spec_length_policy="fixed")
        infer_row(f"infer + suffix {DEFAULT_POLICY}", speculator="suffix")
    if settings.hf:
        from infer.bench.hf_baseline import transformers_runners

        say("[transformers] loading")
        for name, run, spec_length in transformers_runners(settings):
            modes.append(_Mode(ModeResult(name, "transformers", 0.0, [], spec_length=spec_length), run))
    if settings.peer:
        assert modes[0].llm is not None
        modes += _peer_modes(settings, modes[0].llm, threads, say)
    return modes, draft_alone


def _rotated(modes: list[_Mode], rep: int) -> list[_Mode]:
    """``modes`` starting at another one each repeat (a machine's drift then shifts every mode alike)."""
    start = rep % len(modes)
    return modes[start:] + modes[:start]


def _warm_up(settings: BenchSettings, modes: list[_Mode], prompts: list[str | list[int]],
             history: list[str | list[int]], say: Callable[[str], None]) -> None:
    """One untimed generation per mode; suffix decoding then learns from the ``history`` requests; the
    round timings restart."""
    say(f"warming up {len(modes)} modes" + (f", then {len(history)} warm-up requests for suffix decoding"
                                             if history and any(m.history for m in modes) else ""))
    for mode in modes:
        mode.run(prompts[0], settings.seed)
        if mode.history is not None:
            # Forget the warm-up generation (a timed prompt), learn from the warm-up requests instead,
            # and keep exactly that: every timed request starts from it, so none can replay an answer
            # to a prompt timed earlier (the same prompts come back every repeat).
            mode.history.restore()
            for i, prompt in enumerate(history):
                mode.run(prompt, settings.seed - 1 - i)
            mode.history.save()
    for mode in modes:  # round timings cover the timed generations only
        if mode.llm is not None and isinstance(mode.llm.engine.runner, SpeculativeRunner):
            mode.llm.engine.runner.reset_round_times()


def _time_modes(settings: BenchSettings, modes: list[_Mode], prompts: list[str | list[int]],
                say: Callable[[str], None]) -> list[float]:
    """The timed generations: each repeat runs every prompt on every mode back to back, in an order
    that rotates per repeat. Returns the memory bandwidth measured once per repeat (CPU only)."""
    bandwidths: list[float] = []
    for rep in range(settings.repeats):
        if settings.device == "cpu":
            bandwidths.append(memory_bandwidth())  # in the same rounds as the rows it bounds
        order = _rotated(modes, rep)
        for i, prompt in enumerate(prompts):
            for mode in order:
                if mode.history is not None:
                    mode.history.restore()
                cpu = time.process_time()
                rate, out = mode.run(prompt, settings.seed + 1000 * rep + i)
                tokens = len(out.token_ids) if out is not None else settings.max_tokens  # fewer at EOS
                mode.cpu_ms_per_token.append((time.process_time() - cpu) * 1e3 / max(tokens, 1))
                mode.result.samples.append(rate)
                if out is not None:
                    mode.outputs.append(out)
        say(f"repeat {rep + 1}/{settings.repeats}: " + ", ".join(
            f"{m.result.mode} {statistics.median(m.result.samples):.1f}" for m in modes if m.reported))
    return bandwidths


def _summarise(modes: list[_Mode], num_prompts: int, plain: ModeResult) -> None:
    """Each row's medians, texts and (speculative infer rows) speculation statistics."""
    for mode in modes:
        r = mode.result
        r.tokens_per_s = statistics.median(r.samples)
        r.cpu_ms_per_token = statistics.median(mode.cpu_ms_per_token)
        r.texts = [o.text for o in mode.outputs[:num_prompts]]
        measured = [d for d in map(_decode_rate, mode.outputs) if d]
        r.decode_tokens_per_s = statistics.median(measured) if measured else None
        if r.engine == "infer" and not r.mode.startswith(plain.mode):
            for key, value in speculation_stats(mode.outputs).items():
                setattr(r, key, value)
            runner = mode.llm.engine.runner if mode.llm is not None else None
            if isinstance(runner, SpeculativeRunner) and isinstance(runner.drafter, SuffixDrafter):
                r.tree_nodes_per_round = runner.drafter.mean_tree_size


def _cost_and_predictions(modes: list[_Mode], plain: ModeResult, draft_alone: ModeResult | None,
                          say: Callable[[str], None]) -> float | None:
    """The draft model's cost ratio c (None without one), and Theorem 3.8's prediction on every
    speculative row."""
    def step_seconds(outputs: list[Any]) -> float:
        return statistics.median(1.0 / o.metrics.decode_tokens_per_s for o in outputs if o.metrics.decode_tokens_per_s)

    target_step = step_seconds(next(m.outputs for m in modes if m.result is plain))
    cost = draft_step = None
    if draft_alone is not None:
        draft_step = step_seconds(next(m.outputs for m in modes if m.result is draft_alone))
        cost = draft_step / target_step
        say(f"cost ratio c = draft step / target step = {draft_step * 1e3:.2f} ms / {target_step * 1e3:.2f} ms "
            f"= {cost:.3f}")
    for mode in modes:
        if mode.llm is not None and isinstance(mode.llm.engine.runner, SpeculativeRunner):
            _predict(mode.result, mode.llm.engine.runner, target_step, draft_step)
    return cost


def _speedups(results: list[ModeResult], plain: ModeResult) -> None:
    """Each row over infer plain, over its transformers counterpart and over llama.cpp's plain row."""
    hf_plain = next((r for r in results if r.mode == "transformers generate"), None)
    for r in results:
        r.speedup_vs_plain = r.tokens_per_s / plain.tokens_per_s
        if r.decode_tokens_per_s and plain.decode_tokens_per_s:
            r.decode_speedup_vs_plain = r.decode_tokens_per_s / plain.decode_tokens_per_s
        match = _matching_hf_mode(r, results) if r.engine == "infer" else None
        if match is not None:
            r.speedup_vs_transformers = r.tokens_per_s / match.tokens_per_s
        elif r.engine == "transformers" and hf_plain is not None:
            r.speedup_vs_transformers = r.tokens_per_s / hf_plain.tokens_per_s
    peer_plain = next((r for r in results if r.engine == "llama.cpp" and r.spec_length is None), None)
    if peer_plain is not None:
        for r in results:
            r.speedup_vs_peer = r.tokens_per_s / peer_plain.tokens_per_s


def _outputs_identical(settings: BenchSettings, results: list[ModeResult],
                       plain: ModeResult) -> tuple[bool | None, dict[str, bool | None]]:
    """Greedy only: whether every infer row wrote infer plain's texts, and each kind of twin row its own
    plain twin's (None: not compared)."""
    greedy_identical = None
    twin_identical: dict[str, bool | None] = {EXACT: None, COMPILED: None, GRAPHS: None}
    if settings.temperature == 0.0:
        # Each kind of twin row runs other kernels, so it is compared with its own plain row.
        # Rows on another backend sum in another order, so a near-tie may go the other way: like another
        # dtype's rows, they are not part of the speculation-vs-plain comparison.
        greedy_identical = all(r.texts == plain.texts for r in results if r.engine == "infer" and r.dtype == plain.dtype
                               and not any(suffix in r.mode for suffix in twin_identical)
                               and OTHER_BACKEND not in r.mode)
        for suffix in twin_identical:
            twin_plain = next((r for r in results if r.mode == f"{plain.mode} {suffix}"), None)
            if twin_plain is not None:
                twin_identical[suffix] = all(r.texts == twin_plain.texts for r in results if suffix in r.mode)
    return greedy_identical, twin_identical


def _weights_and_bandwidth(settings: BenchSettings, modes: list[_Mode], results: list[ModeResult],
                           plain: ModeResult, bandwidths: list[float]) -> dict[str, Any] | None:
    """The weight bytes each plain infer row reads per decode step; with bandwidth samples (CPU), the
    report's memory figures and each row's fraction of the bandwidth limit."""
    for mode in modes:
        if mode.result.engine == "infer" and mode.result.spec_length is None and mode.llm is not None:
            mode.result.weight_bytes_per_token = weight_bytes_per_token(mode.llm.engine.model)
    if not bandwidths:
        return None
    memory: dict[str, Any] = {"bandwidth_gb_s": statistics.median(bandwidths) / 1e9,
                              "samples_gb_s": [b / 1e9 for b in bandwidths],
                              "infer_weight_bytes_per_token": plain.weight_bytes_per_token}
    if settings.peer_gguf:
        memory["peer_weight_bytes_per_token"] = gguf_weight_bytes_per_token(settings.peer_gguf[0])
    for r in results:
        if r.weight_bytes_per_token and r.decode_tokens_per_s:
            r.bandwidth_fraction = r.decode_tokens_per_s * r.weight_bytes_per_token / statistics.median(bandwidths)
    return memory


def _per_length_samples(settings: BenchSettings, plain_llm: LLM, timed: list[_Mode], tokens: int, offset_step: int,
                        measure: Callable[[_Mode, list[int]], float]) -> dict[str, list[float]]:
    """``measure`` of every mode on a prompt of ``tokens`` tokens, by mode: one warm-up, then the
    repeats interleaved in a rotating order, each repeat on another prompt of that length."""
    samples: dict[str, list[float]] = {m.result.mode: [] for m in timed}
    for rep in range(-1, settings.repeats):  # -1: the warm-up
        ids = prefill_prompt(plain_llm.tokenizer, settings.prompts, tokens, offset=offset_step * (rep + 1))
        for mode in _rotated(timed, rep):
            value = measure(mode, ids)
            if rep >= 0:
                samples[mode.result.mode].append(value)
    return samples


def _time_prefill(settings: BenchSettings, plain_llm: LLM, modes: list[_Mode],
                  say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Prompt processing tok/s of every plain row (llama.cpp's too) for each prompt length, timed
    like the decode rows (one warm-up, then repeats interleaved in a rotating order), each repeat on
    another prompt of the same length."""
    timed = [m for m in modes if m.prefill is not None]
    rows: list[dict[str, Any]] = []

    def seconds(mode: _Mode, ids: list[int]) -> float:
        assert mode.prefill is not None
        return mode.prefill(ids)

    for tokens in settings.prefill_tokens:
        if tokens < 1:
            raise ValueError(f"--prefill-tokens {tokens} is invalid: must be >= 1")
        say(f"prefill of {tokens} tokens: {len(timed)} rows")
        samples = {mode: [tokens / s for s in times] for mode, times in
                   _per_length_samples(settings, plain_llm, timed, tokens, 17, seconds).items()}
        for mode in timed:
            rows.append({"mode": mode.result.mode, "engine": mode.result.engine, "prompt_tokens": tokens,
                         "tokens_per_s": statistics.median(samples[mode.result.mode]),
                         "samples": samples[mode.result.mode]})
        peer = next((r for r in rows if r["engine"] == "llama.cpp" and r["prompt_tokens"] == tokens), None)
        for row in rows:
            if row["prompt_tokens"] == tokens:
                row["speedup_vs_peer"] = row["tokens_per_s"] / peer["tokens_per_s"] if peer else None
        say(f"prefill of {tokens} tokens: " + ", ".join(
            f"{r['mode']} {r['tokens_per_s']:.0f} tok/s" for r in rows if r["prompt_tokens"] == tokens))
    return rows


def _decode_rate(output: Any) -> float | None:
    """Decode tokens/s of one run's output (prefill excluded): infer's metrics or a peer's field."""
    metrics = getattr(output, "metrics", None)
    return metrics.decode_tokens_per_s if metrics is not None else getattr(output, "decode_tokens_per_s", None)


def _time_long_context(settings: BenchSettings, plain_llm: LLM, modes: list[_Mode],
                       say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Decode tok/s of every plain row (llama.cpp's too) after a prompt of each context length:
    what attention over a long cache costs, which the workload's short prompts do not show. Timed
    like the prefill rows (one warm-up, then repeats interleaved in a rotating order, each on another
    prompt); the prefill is excluded."""
    timed = [m for m in modes if m.prefill is not None]
    rows: list[dict[str, Any]] = []
    for tokens in settings.context_tokens:
        if tokens < 1:
            raise ValueError(f"--context-tokens {tokens} is invalid: must be >= 1")
        say(f"decode after {tokens} tokens of context: {len(timed)} rows")

        def decode_rate(mode: _Mode, ids: list[int], tokens: int = tokens) -> float:
            _, out = mode.run(ids, settings.seed)
            rate = _decode_rate(out)
            if rate is None:
                raise ValueError(f"{mode.result.mode} decoded fewer than 2 tokens after {tokens} tokens of "
                                 "context: no decode rate (raise --max-tokens)")
            return rate

        samples = _per_length_samples(settings, plain_llm, timed, tokens, 29, decode_rate)
        peer = next((m for m in timed if m.result.engine == "llama.cpp"), None)
        for mode in timed:
            rate = statistics.median(samples[mode.result.mode])
            rows.append({"mode": mode.result.mode, "engine": mode.result.engine, "context_tokens": tokens,
                         "decode_tokens_per_s": rate, "samples": samples[mode.result.mode],
                         "speedup_vs_peer": rate / statistics.median(samples[peer.result.mode]) if peer else None})
        say(f"decode after {tokens} tokens: " + ", ".join(
            f"{r['mode']} {r['decode_tokens_per_s']:.1f} tok/s" for r in rows if r["context_tokens"] == tokens))
    return rows


def _predict(r: ModeResult, runner: SpeculativeRunner, target_step: float, draft_step: float | None) -> None:
    """Theorem 3.8's prediction for a chain row and where its rounds went (see the module docstring)."""
    times = runner.round_times
    if not times.rounds:
        return
    r.round_ms = {"proposer": 1e3 * times.propose_seconds / times.rounds,
                  "verification": 1e3 * times.verify_seconds / times.rounds,
                  "plain fallback": 1e3 * times.plain_seconds / times.rounds}
    if times.verify_rounds:
        r.verify_vs_decode_step = times.verify_seconds / times.verify_rounds / target_step
    info = runner.drafter.info
    drafts = sum(k * n for k, n in enumerate(r.rounds_by_length or []))
    if info.cost_per_token and draft_step is not None and drafts:
        r.draft_step_vs_alone = times.propose_seconds / drafts / draft_step
    if info.tree or r.tree_nodes_per_round is not None or r.alpha is None or not r.rounds_by_length:
        return  # a tree drafter's round is no chain (suffix decoding budgets depths but drafts trees)
    if info.cost_per_token:
        if draft_step is None:
            return
        r.cost_ratio = draft_step / target_step
        r.predicted_speedup = expected_speedup_over_rounds(r.alpha, r.rounds_by_length, cost_per_draft=r.cost_ratio)
    elif times.drafter_calls:
        # One call per round: its measured time, in target steps, averaged over every round (a round
        # whose budget was 0 made no call).
        per_call = times.propose_seconds / times.drafter_calls / target_step
        per_round = per_call * times.drafter_calls / times.rounds
        r.cost_ratio = per_call / max(1, r.spec_length or 1)
        r.predicted_speedup = expected_speedup_over_rounds(r.alpha, r.rounds_by_length, cost_per_round=per_round)


def _matching_hf_mode(result: ModeResult, results: list[ModeResult]) -> ModeResult | None:
    wanted = "transformers generate"
    if "draft" in result.mode:
        wanted = "transformers assisted"
    elif "n-gram" in result.mode or "suffix" in result.mode:
        wanted = "transformers prompt lookup"
    return next((r for r in results if r.mode == wanted), None)


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        env["gpu"] = torch.cuda.get_device_name(0)
    try:  # the peer's build: which instructions its kernels were compiled for (an AVX2-only build, ...)
        import llama_cpp

        env["llama_cpp"] = {"version": llama_cpp.__version__, "path": str(Path(llama_cpp.__file__).parent),
                            "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    except (ImportError, AttributeError, OSError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            env["cpu"] = names[0]
    except OSError:
        pass
    return env
