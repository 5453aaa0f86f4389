"""The engine: loads models, owns the scheduler and runner, and steps requests to completion."""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infer.backends import backend_of
from infer.cache import PagedKVCachePool, local_blocks_per_sequence, make_pool
from infer.cache.protocol import CachePoolProtocol
from infer.core.detokenizer import IncrementalDetokenizer
from infer.core.model_runner import ModelRunner
from infer.core.request import Request
from infer.engine.config import EAGLE_MAX_TREE, EngineConfig
from infer.engine.continuous_runner import ContinuousRunner, PrefillChunk, StepResult
from infer.engine.scheduler import Runner, ScheduledBatch, Scheduler, attention_span
from infer.loader import (
    Tokenizer,
    forget_parsed_checkpoints,
    load_model,
    load_tokenizer,
    plan_load,
)
from infer.models.config import ModelConfig
from infer.phases import PHASES
from infer.sampling.grammar import GrammarCompiler, GrammarError
from infer.sampling.params import SamplingParams, short_repr

log = logging.getLogger("infer.engine")


@dataclass
class RequestUpdate:
    """What one engine step did for one request: its new tokens, and whether it is done."""

    request: Request
    new_token_ids: list[int]
    finished: bool


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free now: on CUDA the device's, on CPU the OS's MemAvailable (None where unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_token_bytes(model_config: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one token's K and V in the model's global layers, and in its sliding-window layers."""
    layers = model_config.num_hidden_layers
    local = sum(model_config.layer_window(i) is not None for i in range(layers))
    per_layer = 2 * model_config.num_key_value_heads * model_config.head_dim * dtype.itemsize
    return (layers - local) * per_layer, local * per_layer


def window_pass_bounds(config: EngineConfig, max_seq_len: int) -> tuple[int, int]:
    """How far past a committed length a pass may start (a draft model's chain), and the most tokens
    one pass appends (a prefill chunk, or a verification: a chain, or a tree of at most
    ``_MAX_TREE_PASS`` nodes): what sliding-window layers hold beyond their window."""
    spec = config.speculative
    longest = config.max_prefill_tokens if config.chunked_prefill else max_seq_len
    if config.grammar_drafting:  # a verification of what a grammar forces
        from infer.engine.speculative_runner import GRAMMAR_MAX_DRAFT

        longest = max(longest, 1 + GRAMMAR_MAX_DRAFT)
    if spec is None:
        return 0, longest
    tree = {"medusa": spec.medusa_tree_size or _MAX_TREE_PASS, "suffix": spec.suffix_tree_size,
            "eagle": spec.eagle_tree_size or EAGLE_MAX_TREE}
    return spec.spec_length_limit + 1, max(longest, 1 + spec.spec_length_limit, 1 + tree.get(spec.speculator, 0))


def pool_bytes(pool: CachePoolProtocol) -> int:
    """Bytes of a KV pool's storage (every layer's keys and values)."""
    return sum(t.numel() * t.element_size() for t in [*pool.k_layers, *pool.v_layers])


def kv_budget_tokens(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                     dtype: torch.dtype, local_tokens: int | None = None) -> tuple[int | None, str]:
    """How many tokens' K/V fit in ``kv_memory_fraction`` of the free memory, and that as a sentence.

    Sliding-window layers hold at most ``local_tokens`` positions in all (their paged blocks are
    freed as the window moves on), so past that a token costs the global layers' K/V only; None:
    they hold every token, as the slotted cache does.
    """
    free = free_memory_bytes(device)
    if free is None:
        return None, "free memory unknown"
    budget = int(config.kv_memory_fraction * free)
    global_bytes, local_bytes = kv_token_bytes(model_config, dtype)
    if local_tokens is None or local_tokens * (global_bytes + local_bytes) >= budget:
        tokens = budget // (global_bytes + local_bytes)
    elif global_bytes == 0:  # every layer slides (Mistral): the windows fit, tokens are not what bounds the pool
        return _UNBOUNDED, (f"KV budget {config.kv_memory_fraction:.0%} of {free / 2**30:.1f} GiB free "
                            f"holds the sliding windows ({local_tokens:,} tokens)")
    else:
        tokens = local_tokens + (budget - local_tokens * (global_bytes + local_bytes)) // global_bytes
    windowed = "" if local_tokens is None or not local_bytes else \
        f" (sliding-window layers: at most {local_tokens:,})"
    return tokens, (f"KV budget {config.kv_memory_fraction:.0%} of {free / 2**30:.1f} GiB free "
                    f"= {tokens:,} tokens{windowed}")


_UNBOUNDED = 2**62  # a budget no pool reaches: only the sliding windows take memory


def _local_tokens(config: EngineConfig, model_config: ModelConfig, max_seq_len: int, sequences: int) -> int | None:
    """How many positions the sliding-window layers of a paged pool hold at most for ``sequences``
    sequences (None: no such layers, or the slotted cache, which keeps every position)."""
    windows = [w for i in range(model_config.num_hidden_layers) if (w := model_config.layer_window(i)) is not None]
    if not windows or config.kv_cache_backend != "paged":
        return None
    slack, longest = window_pass_bounds(config, max_seq_len)
    per_sequence = local_blocks_per_sequence(max(windows), slack, longest, config.block_size)
    return sequences * per_sequence * config.block_size


def choose_max_seq_len(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                       dtype: torch.dtype) -> tuple[int, str]:
    """The context length: as configured (at most the model's), else the model's own, lowered only
    when one sequence (every slot, for the slotted cache) would not fit the KV budget."""
    limit = model_config.max_position_embeddings
    if config.max_seq_len is not None:
        if config.max_seq_len > limit:
            return limit, f"max_seq_len {config.max_seq_len} capped at the model's max_position_embeddings"
        return config.max_seq_len, "max_seq_len as configured"
    budget, budget_text = kv_budget_tokens(config, model_config, device, dtype,
                                           local_tokens=_local_tokens(config, model_config, limit, 1))
    if budget is not None and config.kv_cache_backend == "slotted":
        budget //= config.max_batch_size
    if budget is None or budget >= limit:
        return limit, f"the model's max_position_embeddings; {budget_text}"
    fitted = max(2 * config.block_size, budget // config.block_size * config.block_size)
    return min(fitted, limit), f"{budget_text}, below the model's {limit}"


class ContextLengthError(ValueError):
    """A prompt plus the tokens asked for do not fit the context (``fit_context=True``)."""


def freeze_loaded_objects() -> None:
    """Move every object alive now out of the cyclic collector's sight (``gc.freeze``).

    What loading made (modules, tensors, tokenizer, imported libraries: ~185k objects for SmolLM2)
    lives as long as the engine; frozen, the collector's full passes during generation stop walking
    it (a measurable share of a small model's decode step: docs/cpu.md, "Measurements behind the
    kernels' constants"). Frozen objects are
    never collected, so what an earlier engine froze is unfrozen and collected first: a process
    that makes engine after engine (tests, notebooks) keeps no garbage beyond the newest one's, and
    at exit everything is unfrozen, so the interpreter's last collection finalizes it (extension
    modules such as nanobind's report objects they see left alive as leaks).
    """
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class PromptEncoding:
    """Chat prompts to token ids for a context of ``max_seq_len`` tokens: the engine's, and the
    server front end's when the engine runs in its own process."""

    tokenizer: Any
    max_seq_len: int

    def encode_chat(self, messages: list[dict[str, Any]], parse_special: bool = True,
                    tools: list[Any] | None = None) -> list[int]:
        """Token ids of a chat prompt (the tokenizer's template, given ``tools`` as its ``tools``
        variable); ValueError naming the problem. ``parse_special=False``: special-token text in
        messages is plain text (see Tokenizer.encode_chat)."""
        self._check_fits("".join(str(m.get("content") or "") for m in messages))
        return self.tokenizer.encode_chat(messages, parse_special=parse_special, tools=tools)

    def _check_fits(self, text: str) -> None:
        """Refuse text that surely has too many tokens for the context, without tokenizing it all."""
        if self.tokenizer.min_token_count(text) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(text)} characters: more than the {self.max_seq_len}-token context "
                             "(max_seq_len) can hold")


class Engine(PromptEncoding):
    """Continuous-batching engine. Thread-safe entry points: ``add_request``, ``abort``, ``step``."""

    def __init__(self, config: EngineConfig, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        say = progress or (lambda _msg: None)
        # How the target runs, decided once before its weights are read (dtype, kept blocks and their
        # kernels, the backend with its modes), each choice with its reason; the loader follows it.
        self.plan = plan_load(config.model, config.dtype, config.device, backend=config.backend,
                              compile=config.compile, quantization=config.quantization, exact=config.exact_greedy,
                              cuda_graphs=config.cuda_graphs, tree_attention=config.tree_attention)
        self.device, self.dtype = self.plan.device, self.plan.dtype
        say(f"loading target model {config.model} ({self.dtype}, {self.device})")
        self.model, self.model_config = load_model(config.model, plan=self.plan, progress=say)
        self.backend = backend_of(self.model)
        self.tokenizer: Tokenizer = load_tokenizer(config.model, self.model_config)
        self.max_seq_len, context_reason = choose_max_seq_len(config, self.model_config, self.device, self.dtype)
        self.pool = self._make_pool(self.model_config)
        # What was chosen and why, for the run summary (infer generate/chat print it).
        self.summary = (f"dtype {str(self.dtype).removeprefix('torch.')} ({self.plan.dtype_reason}); context "
                        f"{self.max_seq_len} tokens ({context_reason}); KV pool {self.pool.free_kv_tokens():,} tokens "
                        f"({pool_bytes(self.pool) / 2**20:.1f} MiB); {self.model.weights_summary}; "
                        f"{self.backend.describe()}")
        say(self.summary)
        prefix_cache = None
        if config.prefix_caching:
            from infer.cache.prefix import PrefixCache

            assert isinstance(self.pool, PagedKVCachePool)
            prefix_cache = PrefixCache(self.pool)
        self.prefix_cache = prefix_cache
        target = ContinuousRunner(ModelRunner(self.model, self.pool), prefix_cache)
        # Graphs up to a chain verification's width, where the backend replays passes as graphs.
        width = 1 + (config.speculative.spec_length_limit if config.speculative is not None else 0)
        target.runner.graphs = self.backend.step_graphs(self.model, self.pool, config.max_batch_size, width, say)
        self.runner: Runner = target
        if config.speculative is not None or config.grammar_drafting:
            from infer.engine.drafters import TargetModel, make_speculative_runner

            described = TargetModel(path=config.model, model=self.model, config=self.model_config,
                                    tokenizer=self.tokenizer, device=self.device, dtype=self.dtype,
                                    make_pool=self._make_pool, compile=config.compile, backend=config.backend,
                                    cuda_graphs=config.cuda_graphs, max_batch_size=config.max_batch_size)
            self.runner = make_speculative_runner(config.speculative, target, described, say, config.grammar_drafting)
        if config.compile:
            width = 1 + (config.speculative.spec_length_limit if config.speculative is not None else 1)
            say("torch.compile: compiling the kinds of pass requests run (once per process; cached on disk)")
            target.runner.warm_up(width)
        mc = self.model_config
        self.scheduler = Scheduler(self.runner, max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                                   chunked_prefill=config.chunked_prefill,
                                   max_prefill_tokens=config.max_prefill_tokens, prefix_cache=prefix_cache,
                                   attention_span=attention_span(
                                       mc.hidden_size, mc.intermediate_size, mc.num_attention_heads,
                                       mc.num_key_value_heads, mc.head_dim))
        self._ids = itertools.count()
        self.lock = threading.RLock()
        self.grammars = GrammarCompiler(self.tokenizer.backend, self.tokenizer.eos_token_ids,
                                        self.model_config.vocab_size, config.grammar_limits())
        forget_parsed_checkpoints()  # every model and tokenizer is loaded: their parsed metadata can go
        freeze_loaded_objects()

    # -- requests --------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                     cache_salt: str | None = None, *, parse_special: bool = True,
                     fit_context: bool = False) -> Request:
        """Tokenize and validate a prompt; raises ValueError naming the problem.

        ``cache_salt`` keeps the request's prompt blocks apart in the prefix cache: only requests
        with the same salt (or none) share cached KV blocks. ``parse_special=False`` tokenizes
        special-token text in a string prompt as plain text (a server's untrusted input).
        ``fit_context=True`` refuses a prompt plus ``max_tokens`` over the context
        (``ContextLengthError``) instead of stopping generation at the context's end.
        """
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt={short_repr(cache_salt)} is invalid: must be a non-empty string or None")
        if isinstance(prompt, str):
            text: str | None = prompt
            self._check_fits(prompt)
            ids = self.tokenizer.encode(prompt, parse_special=parse_special)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})")
        outside = [t for t in params.logit_bias if t >= self.model_config.vocab_size]
        if outside:
            raise ValueError(f"SamplingParams.logit_bias names token ids {outside[:5]} outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context holds {self.max_seq_len} "
                             "(max_seq_len), leaving no room to generate")
        if fit_context and len(ids) + params.max_tokens > self.max_seq_len:
            raise ContextLengthError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) is more "
                                     f"than the context of {self.max_seq_len} tokens (max_seq_len); ask for at most "
                                     f"{self.max_seq_len - len(ids)} tokens")
        rid = request_id or f"req-{next(self._ids)}"
        request = Request(rid, ids, params, IncrementalDetokenizer(self.tokenizer, ids), self.tokenizer.eos_token_ids,
                          self.max_seq_len, self.device, prompt=text, cache_salt=cache_salt)
        if params.structured_output is not None:
            request.grammar = self.grammars.matcher(params.structured_output)  # type: ignore[arg-type]
        return request

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None, *, parse_special: bool = True,
                    fit_context: bool = False) -> Request:
        request = self.make_request(prompt, params, request_id, cache_salt, parse_special=parse_special,
                                    fit_context=fit_context)
        with self.lock:
            self.scheduler.add(request)
        return request

    def abort(self, request_id: str, error: str | None = None) -> Request | None:
        """Stop a request and free its KV blocks: finish_reason "abort", or "error" with ``error``."""
        with self.lock:
            return self.scheduler.abort(request_id, error)

    def fail_all(self, reason: str) -> list[Request]:
        """End every waiting and running request with finish_reason "error" and ``reason``, freeing
        their KV blocks in every pool (a server's shutdown); returns them."""
        with self.lock:
            unfinished = [*self.scheduler.running, *self.scheduler.waiting]
            for request in unfinished:
                self.scheduler.abort(request.request_id, reason)
            return unfinished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        """Schedule, run one batched pass (or speculative round), and apply stop rules in order.

        A request whose part of the step fails (its sampling, drafting or verification raises)
        finishes with finish_reason "error" ("grammar_error" when its grammar cannot go on); the
        others' tokens are unaffected (see ``_run``).
        """
        with self.lock:
            since = PHASES.mark()
            batch = self.scheduler.schedule()
            updates: dict[str, RequestUpdate] = {}
            for request in self.scheduler.rejected:
                updates[request.request_id] = RequestUpdate(request, [], True)
            self.scheduler.rejected.clear()
            if batch.empty:
                return list(updates.values())
            PHASES.add("scheduling", since)
            outputs, failed = self._run(batch)  # the runner times its model pass, sampling or round
            since = PHASES.mark()
            for request in failed:
                updates[request.request_id] = RequestUpdate(request, [], True)
            for request, out in outputs:
                update = updates.setdefault(request.request_id, RequestUpdate(request, [], False))
                if update.finished:
                    continue  # a stop rule fired earlier in this round: the rest is discarded
                request.append_token(out.token_id, out.logprobs)
                update.new_token_ids.append(out.token_id)
                update.finished = request.is_finished
            since = PHASES.add("detokenization", since)  # and the stop rules
            self.scheduler.retire()
            PHASES.add("scheduling", since)
            return list(updates.values())

    def _run(self, batch: ScheduledBatch) -> tuple[StepResult, list[Request]]:
        """Run ``batch``, isolating failures: returns the outputs and the requests that failed.

        If the batched step raises, every request is rolled back to where it was (target cache,
        drafter state, random generator) and each is stepped alone; those that fail again finish
        with an error, the others go on as if the batch had succeeded. One request's bad values
        therefore never fail another, whichever drafter runs. Costs nothing unless a step fails
        (beyond saving sampled requests' generator states). A drafter whose state was dropped by
        the rollback may draft differently (Medusa's first round after it is a plain step); that
        changes no greedy or seeded request's tokens (a seeded request's draws are keyed by
        position, see ``KeyedDraw``), and an unseeded one's keep exactly the target's distribution.
        """
        units: list[tuple[list[PrefillChunk], list[Request]]] = \
            [([chunk], []) for chunk in batch.prefill] + [([], [request]) for request in batch.decode]
        requests = [chunk.request for chunk in batch.prefill] + list(batch.decode)
        saved = {request.request_id: self._checkpoint(request) for request in requests}
        try:
            return self.runner.step(batch.prefill, batch.decode), []
        except Exception as err:
            error = err
        for request in requests:
            self._restore(request, saved[request.request_id])
        if len(units) == 1:
            _fail(requests[0], error)
            return [], requests
        log.debug("a batched step failed; stepping its %d requests alone", len(units), exc_info=error)
        outputs: StepResult = []
        failed: list[Request] = []
        for (prefill, decode), request in zip(units, requests, strict=True):
            try:
                outputs += self.runner.step(prefill, decode)
            except Exception as err:
                self._restore(request, saved[request.request_id])
                _fail(request, err)
                failed.append(request)
        return outputs, failed

    @staticmethod
    def _checkpoint(request: Request) -> tuple[int | None, int, torch.Tensor | None]:
        rng = None if request.params.greedy else request.generator.get_state()
        return request.slot, request.num_computed_tokens, rng

    def _restore(self, request: Request, checkpoint: tuple[int | None, int, torch.Tensor | None]) -> None:
        slot, computed, rng = checkpoint
        if slot is None:  # the failed step allocated it: start over, prefix-cache lookup included
            self.runner.release(request)
            request.num_computed_tokens = computed
        else:
            self.runner.rollback(request, computed)
        if rng is not None:
            request.generator.set_state(rng)

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    def kv_pools(self) -> dict[str, CachePoolProtocol]:
        """The engine's KV pools by name: ``target`` and, with a draft model, ``draft``."""
        return self.runner.kv_pools()

    def _make_pool(self, model_config: ModelConfig) -> CachePoolProtocol:
        """A KV pool for a model (the target, or a draft model) with this engine's settings: unless
        ``num_kv_blocks`` says otherwise, ``max_batch_size`` full-length sequences as far as the KV
        budget allows, and always at least one."""
        config = self.config
        num_blocks = config.num_kv_blocks
        if num_blocks is None and config.kv_cache_backend == "paged":
            # Sliding-window layers (ModelConfig.layer_window) free their blocks as the window moves on: the
            # budget counts the blocks they can hold, and every other token at the global layers' cost.
            local = _local_tokens(config, model_config, self.max_seq_len, config.max_batch_size)
            budget, _ = kv_budget_tokens(config, model_config, self.device, self.dtype, local_tokens=local)
            if budget is not None:
                per_sequence = -(-self.max_seq_len // config.block_size)
                num_blocks = max(per_sequence, min(config.max_batch_size * per_sequence, budget // config.block_size))
        slack, longest = window_pass_bounds(config, self.max_seq_len)
        windows = [model_config.layer_window(i) for i in range(model_config.num_hidden_layers)]
        return make_pool(config.kv_cache_backend, num_layers=model_config.num_hidden_layers,
                         num_kv_heads=model_config.num_key_value_heads, head_dim=model_config.head_dim,
                         max_seq_len=self.max_seq_len, max_batch_size=config.max_batch_size,
                         block_size=config.block_size, num_blocks=num_blocks, dtype=self.dtype,
                         device=self.device, layer_windows=windows, window_slack=slack, max_pass_tokens=longest)


# Medusa's tree comes with its heads (loaded after the pools): a bound on it for sizing sliding-window
# KV blocks (a larger tree's pass would find them short and fail with CacheFullError).
_MAX_TREE_PASS = 256


def _fail(request: Request, err: Exception) -> None:
    """End ``request`` for ``err`` and log it with its id: with the traceback (at the default level)
    when the engine failed, only at info level when the request's own grammar could not go on."""
    reason, error = _failure(err)
    if reason == "grammar_error":
        log.info("request %s: %s", request.request_id, error)
    else:
        log.error("request %s failed in the engine", request.request_id, exc_info=err)
    request.finish(reason, error)


def _failure(err: Exception) -> tuple[str, str]:
    """A failed request's finish_reason and error: "grammar_error" when its grammar could not go on
    (the request's own grammar, not a fault of the engine's), else "error"."""
    if isinstance(err, GrammarError):
        return "grammar_error", str(err)
    return "error", _describe(err)


def _describe(err: Exception) -> str:
    return f"the request failed in the engine: {type(err).__name__}: {err}"
