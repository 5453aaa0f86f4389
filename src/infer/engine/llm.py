"""The offline Python API: ``LLM(model=...).generate(prompts, params)``, as users know it from vLLM."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from infer.core.request import Request, RequestMetrics
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.sampling.params import SamplingParams
from infer.sampling.sampler import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str | None  # stop | length | abort | error
    metrics: RequestMetrics
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # None first, then per prompt token

    @classmethod
    def from_request(cls, request: Request) -> RequestOutput:
        return cls(request.request_id, request.prompt, request.prompt_token_ids, request.text,
                   list(request.output_token_ids), request.finish_reason, request.metrics, request.error,
                   list(request.output_logprobs) if request.params.logprobs is not None else None,
                   list(request.prompt_logprobs) if request.params.prompt_logprobs is not None else None)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "metrics": self.metrics.to_dict()}


class LLM:
    """Load a model (and optionally a drafter) and generate for a batch of prompts."""

    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", draft_model: str | None = None,
                 speculator: str | None = None, progress: Callable[[str], None] | None = None,
                 **engine_options: Any) -> None:
        # The speculative options (spec_length, spec_length_policy, ...) come in engine_options with
        # their defaults declared once, in SpeculativeConfig.
        self.config = EngineConfig.from_options(
            model=str(model), dtype=dtype, device=device, draft_model=None if draft_model is None else str(draft_model),
            speculator=speculator, **engine_options)
        self.engine = Engine(self.config, progress)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_token: Callable[[Request, list[int]], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 cache_salt: str | None = None,
                 on_finish: Callable[[int, Request], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (batched); ``params`` is one for all or one per prompt.

        ``on_token`` hears each request's new tokens as they come; ``on_finish`` hears each request
        (with its prompt's index) as it finishes, in the order they finish.

        ``should_stop`` is asked after every engine step; once it says True, every unfinished
        request is aborted (finish_reason "abort", KV freed) and the outputs so far are returned.
        With prefix caching, ``cache_salt`` keeps these prompts' cached blocks apart from those of
        requests with another salt (or none).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        # Validate every prompt before admitting any, so a bad one does not leave others half-run.
        requests = [self.engine.make_request(p, sp, cache_salt=cache_salt)
                    for p, sp in zip(prompt_list, param_list, strict=True)]
        pending = list(requests)
        index = {r.request_id: i for i, r in enumerate(requests)}
        while pending or self.engine.has_unfinished():
            while pending:  # the queue is bounded: feed it as it drains
                if len(self.engine.scheduler.waiting) >= self.config.max_queue:
                    break
                self.engine.scheduler.add(pending.pop(0))
            for update in self.engine.step():
                if on_token is not None and update.new_token_ids:
                    on_token(update.request, update.new_token_ids)
                if on_finish is not None and update.finished:
                    on_finish(index[update.request.request_id], update.request)
            if should_stop is not None and should_stop():
                for request in requests:
                    if self.engine.abort(request.request_id) is None and not request.is_finished:
                        request.finish("abort")  # never admitted: nothing to free
                break
        return [RequestOutput.from_request(r) for r in requests]

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        ids = self.engine.encode_chat(messages)
        return self.generate([ids], params)[0]
