"""The engine: loads models, owns the scheduler and runner, and steps requests to completion."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from infer.cache import PagedKVCachePool, make_pool
from infer.cache.protocol import CachePoolProtocol
from infer.core.detokenizer import IncrementalDetokenizer
from infer.core.model_runner import ModelRunner
from infer.core.request import Request
from infer.engine.config import EngineConfig
from infer.engine.continuous_runner import ContinuousRunner
from infer.engine.scheduler import Runner, Scheduler
from infer.loader import Tokenizer, load_model, load_tokenizer, resolve_device, resolve_dtype
from infer.loader.config import ModelConfig
from infer.sampling.params import SamplingParams


@dataclass
class RequestUpdate:
    """What one engine step did for one request: its new tokens, and whether it is done."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Engine:
    """Continuous-batching engine. Thread-safe entry points: ``add_request``, ``abort``, ``step``."""

    def __init__(self, config: EngineConfig, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        say = progress or (lambda _msg: None)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        say(f"loading target model {config.model} ({self.dtype}, {self.device})")
        self.model, self.model_config = load_model(config.model, self.dtype, str(self.device))
        self.tokenizer: Tokenizer = load_tokenizer(config.model, self.model_config)
        limit = self.model_config.max_position_embeddings
        self.max_seq_len = min(config.max_seq_len or min(limit, 4096), limit)
        self.pool = self._make_pool(self.model_config)
        prefix_cache = None
        if config.prefix_caching:
            from infer.cache.prefix import PrefixCache

            assert isinstance(self.pool, PagedKVCachePool)
            prefix_cache = PrefixCache(self.pool)
        self.prefix_cache = prefix_cache
        target = ContinuousRunner(ModelRunner(self.model, self.pool, config.tree_attention), prefix_cache)
        self.runner: Runner = target
        if config.speculative is not None:
            from infer.engine.drafters import TargetModel, make_speculative_runner

            described = TargetModel(path=config.model, model=self.model, config=self.model_config,
                                    tokenizer=self.tokenizer, device=self.device, dtype=self.dtype,
                                    make_pool=self._make_pool)
            self.runner = make_speculative_runner(config.speculative, target, described, say)
        self.scheduler = Scheduler(self.runner, max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                                   chunked_prefill=config.chunked_prefill,
                                   max_prefill_tokens=config.max_prefill_tokens)
        self._ids = itertools.count()
        self.lock = threading.RLock()

    # -- requests --------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Tokenize and validate a prompt; raises ValueError naming the problem."""
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context holds {self.max_seq_len} "
                             "(max_seq_len), leaving no room to generate")
        rid = request_id or f"req-{next(self._ids)}"
        return Request(rid, ids, params, IncrementalDetokenizer(self.tokenizer, ids), self.tokenizer.eos_token_ids,
                       self.max_seq_len, self.device, prompt=text)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        request = self.make_request(prompt, params, request_id)
        with self.lock:
            self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        with self.lock:
            return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        """Schedule, run one batched pass (or speculative round), and apply stop rules in order."""
        with self.lock:
            batch = self.scheduler.schedule()
            updates: dict[str, RequestUpdate] = {}
            for request in self.scheduler.rejected:
                updates[request.request_id] = RequestUpdate(request, [], True)
            self.scheduler.rejected.clear()
            if batch.empty:
                return list(updates.values())
            for request, out in self.runner.step(batch.prefill, batch.decode):
                update = updates.setdefault(request.request_id, RequestUpdate(request, [], False))
                if update.finished:
                    continue  # a stop rule fired earlier in this round: the rest is discarded
                request.append_token(out.token_id)
                update.new_token_ids.append(out.token_id)
                update.finished = request.is_finished
            self.scheduler.retire()
            return list(updates.values())

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()

    def kv_pools(self) -> dict[str, CachePoolProtocol]:
        """The engine's KV pools by name: ``target`` and, with a draft model, ``draft``."""
        return self.runner.kv_pools()

    def _make_pool(self, model_config: ModelConfig) -> CachePoolProtocol:
        """A KV pool for a model (the target, or a draft model) with this engine's settings."""
        config = self.config
        return make_pool(config.kv_cache_backend, num_layers=model_config.num_hidden_layers,
                         num_kv_heads=model_config.num_key_value_heads, head_dim=model_config.head_dim,
                         max_seq_len=self.max_seq_len, max_batch_size=config.max_batch_size,
                         block_size=config.block_size, num_blocks=config.num_kv_blocks, dtype=self.dtype,
                         device=self.device)
