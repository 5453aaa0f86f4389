"""The FastAPI app: OpenAI-compatible completions and chat completions, models, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.sampling.params import SamplingParams, short_repr
from infer.server import anthropic, responses, tokenize
from infer.server.engine_loop import EngineService, Progress, Subscription
from infer.server.engine_process import EngineClient, EngineProcess
from infer.server.errors import (
    APIError,
    ErrorResponse,
    bad_request,
    count_refusal,
    error_body,
    install_error_handlers,
    log,
    server_error,
    shutting_down,
    too_large,
)
from infer.server.metrics import ServerMetrics
from infer.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    RequestLimits,
    SamplingRequest,
    check_model,
)
from infer.server.tool_stream import ToolCallStream
from infer.server.tools import ToolCall, parse_calls, prompt_messages
from infer.server.tools import finish_reason as calls_finish_reason

# Finish reasons answered as a choice (200); any other ends the request with an error. "grammar_error":
# the request's grammar could not go on (a limit of the grammar engine's hit mid-way); the text so far.
ANSWERED = ("stop", "length", "grammar_error")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Larger bodies get a 413 before they are read. 1 MiB (nginx's default too) is far more than a
# prompt that fits a 4096-token context; raise it with --max-request-bytes for longer contexts.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DIALECT_PATHS = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize")

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: the error's `param` names the offending field",
    401: "Missing or invalid API key (`Authorization: Bearer <key>`)",
    404: "No such model",
    413: "Request body larger than the server's limit",
    429: "The request queue is full; retry later",
    500: "The request failed in the engine",
    503: "The server is shutting down (draining) or its engine is not running",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


def _generation_responses(model: type, auth: bool) -> dict[int | str, dict[str, Any]]:
    # Before OpenAPI 3.2 a text/event-stream schema describes one event (its `data`, `event`, ...).
    event = {"type": "object", "required": ["data"], "description": "One server-sent event",
             "properties": {"data": {"type": "string", "description": "A chunk (the JSON response's shape, with "
                                     "`delta`s for chat), `{\"error\": ...}` if the request fails, or `[DONE]`"},
                            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
    stream = {"schema": event}
    return {200: {"model": model, "description": "The completion (JSON), or with `stream: true` a stream of "
                                                 "server-sent events", "content": {"text/event-stream": stream}},
            **_errors(400, *((401,) if auth else ()), 404, 413, 429, 500, 503)}


def build_app(config: EngineConfig, served_model_name: str, api_key: str | None, *,
              say: Callable[[str], None] | None = None, in_process: bool = False, **app_options: Any) -> FastAPI:
    """Load the engine ``config`` describes and wrap it in the HTTP app (``create_app``'s options):
    what one ``infer serve`` process runs, and what each Ray Serve replica runs.

    The engine runs in its own process (see engine_process.py), so the front end's Python work never
    takes the kernels' cores; ``in_process=True`` runs it on a thread of this process instead."""
    engine: Engine | EngineProcess = Engine(config, say) if in_process else EngineProcess(config, say)
    if say is not None:
        spec = config.speculative
        length = f"K={spec.spec_length}" if spec is not None and spec.spec_length_policy == "fixed" else (
            f"K<={spec.spec_length_limit}" if spec is not None else "")
        drafting = "" if spec is None else f", speculation {spec.speculator} ({length}, {spec.spec_length_policy})"
        say(f"engine ready: max_seq_len {engine.max_seq_len}, batch {config.max_batch_size}, "
            f"{engine.pool.free_kv_tokens()} KV tokens{drafting}")
    try:
        return create_app(engine, served_model_name, api_key, **app_options)
    except BaseException:
        if isinstance(engine, EngineProcess):
            engine.kill()
        raise


def create_app(engine: Engine | EngineProcess, served_model_name: str, api_key: str | None, *,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, request_limits: RequestLimits | None = None,
               max_stored_responses: int = responses.DEFAULT_MAX_STORED_RESPONSES,
               max_stored_response_bytes: int = responses.DEFAULT_MAX_STORED_RESPONSE_BYTES,
               metrics_exposition: Callable[[ServerMetrics], Awaitable[str]] | None = None) -> FastAPI:
    """An app serving ``engine`` as ``served_model_name``; ``api_key`` guards /v1/* when set.

    ``engine``: an ``Engine`` (stepped on a thread of this process) or an ``EngineProcess``. The engine thread (or the
    client of the engine process) starts with the app (lifespan startup) and stops with it; requests still
    running then end with an error. ``app.state.service.begin_drain`` starts a graceful shutdown.
    ``metrics_exposition`` replaces what /metrics answers (a Ray Serve replica answers with every
    replica's metrics, not only its own). ``max_stored_responses``: how many /v1/responses answers
    are kept for ``previous_response_id``; ``max_stored_response_bytes``: how many bytes of JSON they
    may take in all.
    """
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty: pass None to serve without a key")
    metrics = _server_metrics(engine, served_model_name)
    service: EngineService | EngineClient = (EngineClient(engine, metrics) if isinstance(engine, EngineProcess)
                                             else EngineService(engine, metrics))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.stop)

    # No /docs or /redoc: their pages load Swagger UI and ReDoc from a public CDN. /openapi.json stays.
    app = FastAPI(title="infer", description="OpenAI-compatible LLM server", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.engine = engine
    app.state.service = service
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(RequireJSON, paths=("/v1/completions", "/v1/chat/completions", *DIALECT_PATHS),
                       metrics=metrics)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes, metrics=metrics)
    if api_key is not None:  # outermost: an unauthenticated body is never read
        app.add_middleware(BearerAuth, api_key=api_key, metrics=metrics)
    api = _Api(engine, service, served_model_name, request_limits or RequestLimits())
    auth = api_key is not None
    _add_openai_routes(app, api, served_model_name, auth)
    _add_probes(app, service, metrics, metrics_exposition)

    # The other dialects translate to and from the chat route (their own modules); the Anthropic
    # one's error-shape middleware goes outermost, so the API key and size refusals get it too.
    responses.install(app, api.chat, served_model_name, max_stored_responses, auth, max_stored_response_bytes)
    tokenize.install(app, engine, served_model_name, auth)
    anthropic.install(app, api.chat, served_model_name, engine, auth)

    app.openapi = functools.partial(_openapi_without_422, app)  # type: ignore[method-assign]
    return app


def _server_metrics(engine: Engine | EngineProcess, served_model_name: str) -> ServerMetrics:
    """The server's metrics, with the engine's fixed facts (draft limit, KV blocks, backend) set."""
    spec = engine.config.speculative
    metrics = ServerMetrics(max_draft=spec.spec_length_limit if spec is not None else 0, model_name=served_model_name)
    block_size = getattr(engine.pool, "block_size", None)
    if block_size is not None:
        metrics.cache_config.set(1, (("block_size", str(block_size)),
                                     ("num_gpu_blocks", str(getattr(engine.pool, "num_blocks", 0)))))
    backend = getattr(engine, "backend", None)
    if backend is not None:
        metrics.backend_info.set(1, tuple(backend.info().items()))
    return metrics


def _add_openai_routes(app: FastAPI, api: _Api, served_model_name: str, auth: bool) -> None:
    """OpenAI's completions, chat completions and models routes."""

    @app.post("/v1/completions", response_model=None, responses=_generation_responses(CompletionResponse, auth))
    async def completions(body: CompletionRequest, http: Request) -> Response:
        return await api.completions(body, http)

    @app.post("/v1/chat/completions", response_model=None,
              responses=_generation_responses(ChatCompletionResponse, auth))
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        return await api.chat(body, http)

    @app.get("/v1/models", response_model=ModelList, responses=_errors(*((401,) if auth else ())))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(404, *((401,) if auth else ())))
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != served_model_name:
            raise APIError(404, f"the model {short_repr(model_id)} does not exist", param="model",
                           code="model_not_found")
        return api.model_card()


def _add_probes(app: FastAPI, service: EngineService | EngineClient, metrics: ServerMetrics,
                metrics_exposition: Callable[[ServerMetrics], Awaitable[str]] | None) -> None:
    """The probes: readiness (/health), liveness (/livez) and Prometheus metrics (/metrics)."""

    @app.get("/health", response_model=None,
             responses={200: {"model": Health, "description": "Ready: serving requests"},
                        503: {"model": Health, "description": "Not ready: `loading` the model, `draining` for "
                                                              "shutdown, or the engine is not running"}})
    async def health() -> Response:
        if service.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not service.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/livez", response_model=None,
             responses={200: {"model": Health, "description": "The process answers: `ok`, `loading` or `draining`"},
                        503: {"model": Health, "description": "The engine thread is not running"}})
    async def livez() -> Response:
        if service.draining:
            return JSONResponse({"status": "draining"})
        if not service.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics_text() -> PlainTextResponse:
        text = metrics.render() if metrics_exposition is None else await metrics_exposition(metrics)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema minus the 422 it documents for every body: this server answers invalid
    bodies with 400 (see errors.py), and a schema-driven client or fuzzer must see the real codes."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


class _Api:
    def __init__(self, engine: Engine | EngineProcess, service: EngineService | EngineClient,
                 served_model_name: str, limits: RequestLimits) -> None:
        self.engine = engine
        self.service = service
        self.model_name = served_model_name
        self.limits = limits
        self.created = int(time.time())

    def model_card(self) -> dict[str, Any]:
        # "root" is the served name, never the checkpoint's path on this machine.
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "infer",
                "root": self.model_name, "max_model_len": self.engine.max_seq_len}

    # -- endpoints --------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        check_model(body.model, self.model_name)
        body.check_supported(self.limits)
        prompts = body.prompts()
        params = body.sampling_params(DEFAULT_COMPLETION_MAX_TOKENS)
        if params.logprobs is not None or params.prompt_logprobs is not None:
            width = max(body.n or 1, body.best_of or 1)
            echoed = await self._echoed_tokens(body, prompts) if body.echo else [0] * len(prompts)
            body.check_logprob_entries(params, width * sum(params.max_tokens + e for e in echoed), self.limits)
        await self._check_grammar(body, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        # An explicit max_tokens must fit the context with the prompt (a 400 naming both otherwise);
        # the default (16) stops at the context's end.
        submit: dict[str, Any] = {"cache_salt": body.cache_salt, "parse_special": bool(body.parse_special_tokens),
                                  "max_tokens_param": body.max_tokens_field(), "final_only": not body.stream}
        n = body.n or 1
        width = max(n, body.best_of or 1)  # best_of: generate width per prompt, answer the n likeliest
        scored = params if width == n or params.logprobs is not None else dataclasses.replace(params, logprobs=0)
        jobs, streams = [], []
        for index in range(len(prompts) * width):
            prompt = prompts[index // width]
            echo = None
            if body.echo:
                echo = prompt if isinstance(prompt, str) else \
                    self.engine.tokenizer.decode(prompt, skip_special_tokens=False)
            jobs.append((prompt, _choice_params(scored, index % width)))
            streams.append(_Stream("text_completion", rid, self.model_name, body, chat=False,
                                   holdback=_holdback(params.stop), tokenizer=self.engine.tokenizer, echo=echo,
                                   prompt_only=body.prompt_only, index=index,
                                   show_logprobs=params.logprobs is not None))
        if len(jobs) > 1:
            return await self._respond_many(jobs, body, http, streams, "prompt", width, keep=n, submit=submit)
        sub = await self.service.submit(prompts[0], params, rid, prompt_param="prompt", **submit)
        return await self._respond(sub, body, http, streams[0])

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        check_model(body.model, self.model_name)
        body.check_supported(self.limits)
        fns = body.tool_functions()
        template = self.engine.tokenizer.chat_template
        messages, tools = prompt_messages(body.template_messages(), body.tool_list() if fns else None, template)
        self.service.check_admitting()  # before spending a worker thread on the template and tokenizer
        try:
            ids = await asyncio.to_thread(self.engine.encode_chat, messages, bool(body.parse_special_tokens), tools)
        except ValueError as err:
            raise bad_request(str(err), param="messages") from None
        params = body.sampling_params(max(1, self.engine.max_seq_len - len(ids)))
        if params.logprobs is not None:
            body.check_logprob_entries(params, (body.n or 1) * params.max_tokens, self.limits)
        await self._check_grammar(body, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        submit: dict[str, Any] = {"cache_salt": body.cache_salt, "max_tokens_param": body.max_tokens_field(),
                                  "final_only": not body.stream}
        n = body.n or 1
        if n > 1:
            streams = [_Stream("chat.completion.chunk", rid, self.model_name, body, chat=True,
                               holdback=_holdback(params.stop), tokenizer=self.engine.tokenizer, index=i,
                               tools=_ToolMode(fns, template) if fns else None)
                       for i in range(n)]
            jobs: list[tuple[str | list[int], SamplingParams]] = [(ids, _choice_params(params, i)) for i in range(n)]
            return await self._respond_many(jobs, body, http, streams, "messages", n, submit=submit)
        sub = await self.service.submit(ids, params, rid, prompt_param="messages", **submit)
        stream = _Stream("chat.completion.chunk", rid, self.model_name, body, chat=True,
                         holdback=_holdback(params.stop), tokenizer=self.engine.tokenizer,
                         tools=_ToolMode(fns, template) if fns else None)
        return await self._respond(sub, body, http, stream)

    async def _echoed_tokens(self, body: CompletionRequest, prompts: list[str | list[int]]) -> list[int]:
        """How many tokens each prompt echoes (string prompts tokenized on a worker thread; text that
        is not valid Unicode counts its characters: the engine refuses it later, naming the prompt)."""
        def count(prompt: str | list[int]) -> int:
            if not isinstance(prompt, str):
                return len(prompt)
            try:
                return len(self.engine.tokenizer.encode(prompt, parse_special=bool(body.parse_special_tokens)))
            except ValueError:
                return len(prompt)

        return await asyncio.to_thread(lambda: [count(p) for p in prompts])

    async def _check_grammar(self, body: SamplingRequest, params: SamplingParams) -> None:
        """A 400 naming the request's field for an invalid grammar or schema (compiled in a worker
        thread: the first one also builds the tokenizer's table for the grammar engine)."""
        structured = body.structured_output()
        if params.structured_output is None or structured is None:
            return
        try:
            await asyncio.to_thread(self.engine.grammars.check, params.structured_output)  # type: ignore[arg-type]
        except ValueError as err:
            raise bad_request(str(err), param=structured[1]) from None

    async def _respond_many(self, jobs: list[tuple[str | list[int], SamplingParams]], body: SamplingRequest,
                            http: Request, streams: list[_Stream], prompt_param: str, n: int,
                            keep: int | None = None, submit: dict[str, Any] | None = None) -> Response:
        """Several choices (a list of prompts, n > 1): one engine request each, answered together.
        ``n`` requests per prompt; with ``keep`` < n (best_of), the ``keep`` with the highest
        cumulative logprob of each prompt are answered (usage counts every generated token)."""
        subs: list[Subscription] = []
        try:
            for i, (prompt, params) in enumerate(jobs):
                subs.append(await self.service.submit(prompt, params, f"{streams[i].id}-{i}", prompt_param=prompt_param,
                                                      **(submit or {})))
        except BaseException:
            for sub in subs:
                sub.close()
            raise

        def close_all() -> None:
            for sub in subs:
                sub.close()

        if body.stream:
            return EventStreamResponse(_merged_events(streams, subs, body.include_usage, n), on_close=close_all)
        try:
            finals = await _wait_all(subs, http)
        finally:
            close_all()
        if finals is None:
            return Response(status_code=499)
        for final in finals:
            if final.finish_reason not in ANSWERED:
                message = final.error or f"the request ended with finish_reason={final.finish_reason!r}"
                raise shutting_down(message, refused=False) if final.shutdown else server_error(message)
        usage = _summed_usage([s._usage(f) for s, f in zip(streams, finals, strict=True)], n)
        chosen = list(range(len(jobs)))
        if keep is not None and keep < n:
            chosen = []
            for start in range(0, len(jobs), n):
                group = sorted(range(start, start + n), key=lambda i: -_cumulative_logprob(finals[i]))
                chosen += sorted(group[:keep])
        for new, i in enumerate(chosen):
            streams[i].index = new
        # whole() once per choice: it consumes the stream's logprobs and text offsets (a second call
        # would answer that choice without its generated tokens' logprobs).
        wholes = [streams[i].whole(finals[i]) for i in chosen]
        out = wholes[0]
        out["choices"] = [w["choices"][0] for w in wholes]
        out["usage"] = usage
        out.pop("speculative", None)
        return JSONResponse(out)

    async def _respond(self, sub: Subscription, body: SamplingRequest, http: Request, stream: _Stream) -> Response:
        if body.stream:
            return EventStreamResponse(stream.events(sub), on_close=sub.close)
        try:
            final = await _wait_final(sub, http)
        finally:
            sub.close()
        if final is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        if final.finish_reason not in ANSWERED:
            message = final.error or f"the request ended with finish_reason={final.finish_reason!r}"
            raise shutting_down(message, refused=False) if final.shutdown else server_error(message)
        return JSONResponse(stream.whole(final))


async def _wait_final(sub: Subscription, http: Request) -> Progress | None:
    """The finished progress of ``sub``, or None if the client disconnects first."""

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    final = asyncio.ensure_future(sub.final())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({final, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (final, watcher):
            task.cancel()
    return final.result() if final.done() and not final.cancelled() else None


@dataclass
class _ToolMode:
    functions: dict[str, dict[str, Any]]
    template: str | None


def _choice_params(params: SamplingParams, copy: int) -> SamplingParams:
    """Choice ``copy`` of n: a seeded request's copies draw from seed, seed + 1, ... (else identical)."""
    if copy == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + copy) % 2**63)


def _cumulative_logprob(final: Progress) -> float:
    """Sum of the generated tokens' logprobs (best_of's ranking)."""
    return sum(lp.logprob for lp in (final.logprobs or [])[: final.completion_tokens])


def _summed_usage(usages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Every prompt's tokens once (the n choices of a prompt share it), every choice's completion."""
    prompt = sum(u["prompt_tokens"] for u in usages[::n])
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages[::n])
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _wait_all(subs: list[Subscription], http: Request) -> list[Progress] | None:
    """The finished progress of every subscription, or None if the client disconnects first."""

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    finals: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(sub.final() for sub in subs)))
    watcher: asyncio.Future[Any] = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({finals, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (finals, watcher):
            task.cancel()
    return list(finals.result()) if finals.done() and not finals.cancelled() else None


async def _merged_events(streams: list[_Stream], subs: list[Subscription], include_usage: bool,
                         n: int) -> AsyncIterator[str]:
    """The SSE chunks of several choices as they come, then one usage chunk (if asked) and [DONE]."""
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    async def pump(stream: _Stream, sub: Subscription) -> None:
        try:
            async for item in stream.events(sub, last=False):
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(stream, sub)) for stream, sub in zip(streams, subs, strict=True)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item
        if include_usage and all(stream.final is not None for stream in streams):
            usage = _summed_usage([s._usage(s.final) for s in streams if s.final is not None], n)
            yield _sse({"id": streams[0].id, "object": streams[0].object, "created": streams[0].created,
                        "model": streams[0].model, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for sub in subs:
            sub.close()


def _holdback(stop: list[str]) -> int:
    """Characters a stream keeps back so it never sends the start of a stop string that later matches."""
    return max((len(s) for s in stop), default=1) - 1


class _Stream:
    """Builds the response bodies of one request, streamed (SSE chunks) or whole."""

    def __init__(self, object_name: str, request_id: str, model: str, body: SamplingRequest, *, chat: bool,
                 holdback: int, tokenizer: Any, echo: str | None = None, prompt_only: bool = False,
                 index: int = 0, tools: _ToolMode | None = None, show_logprobs: bool = True) -> None:
        self.object = object_name
        self.id = request_id
        self.model = model
        self.chat = chat
        self.include_usage = body.include_usage
        self.holdback = holdback
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.logprobs_sent = 0  # tokens whose logprobs a chunk carried
        self.text_offset = 0  # completions' text_offset of the next token
        self.echo = echo  # completions' echo: the prompt text, sent before the completion
        self.prompt_only = prompt_only  # echo with max_tokens=0: the generated token is left out
        self.index = index  # the choice's index (several prompts, or n > 1)
        self.final: Progress | None = None  # the finished progress, once streamed
        self.tools = tools  # chat with tools: the answer may be tool calls (streamed as they are generated)
        self.show_logprobs = show_logprobs  # False: computed for best_of's ranking only

    def _tool_calls(self, final: Progress) -> tuple[str | None, list[ToolCall]] | None:
        """The answer's content and tool calls, when tools are on and it made calls. An answer cut at
        max_tokens keeps the calls it ended inside (tools.parse_calls): whole ones (a forced call's
        JSON can end on the last token allowed, with no room left for EOS) and one cut short, as the
        stream announced them."""
        if self.tools is None or final.finish_reason not in ANSWERED:
            return None
        content, calls = parse_calls(final.text, self.tools.template, self.tools.functions)
        return (content, calls) if calls else None

    def _usage(self, progress: Progress) -> dict[str, Any]:
        usage = progress.usage()
        if self.prompt_only:
            usage["completion_tokens"], usage["total_tokens"] = 0, usage["prompt_tokens"]
        return usage

    def _prompt_logprobs(self, progress: Progress) -> dict[str, Any] | None:
        """Completions' ``logprobs`` of the echoed prompt (None when not asked for)."""
        if progress.prompt_logprobs is None:
            return None
        tokens: list[str] = []
        offsets: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for i, token in enumerate(progress.prompt_token_ids or []):
            piece = self.tokenizer.decode([token], skip_special_tokens=False)
            lp = progress.prompt_logprobs[i] if i < len(progress.prompt_logprobs) else None
            tokens.append(piece)
            offsets.append(self.text_offset)
            self.text_offset += len(piece)
            values.append(None if lp is None else _finite(lp.logprob))
            tops.append(None if lp is None else {self.tokenizer.decode([t], skip_special_tokens=False): _finite(v)
                                                 for t, v in lp.top})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, progress: Progress) -> dict[str, Any] | None:
        """The OpenAI ``logprobs`` object of the tokens not yet sent (None when not asked for)."""
        if progress.logprobs is None or not self.show_logprobs:
            return None
        new = progress.logprobs[self.logprobs_sent: progress.completion_tokens]
        self.logprobs_sent += len(new)
        text = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        if self.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                piece = text([token])
                return {"token": piece, "logprob": _finite(logprob), "bytes": list(piece.encode())}

            return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in new], "refusal": None}
        tokens, offsets = [], []
        for lp in new:
            piece = text([lp.token_id])
            tokens.append(piece)
            offsets.append(self.text_offset)
            self.text_offset += len(piece)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in new],
                "top_logprobs": [{text([t]): _finite(v) for t, v in lp.top} for lp in new],
                "text_offset": offsets}

    # -- whole (stream=false) ---------------------------------------------------------------------
    def whole(self, final: Progress) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": final.text}
            choice["logprobs"] = self._logprobs(final)
            calls = self._tool_calls(final)
            if calls:
                choice["message"] = {"role": "assistant", "content": calls[0],
                                     "tool_calls": [c.to_openai() for c in calls[1]]}
        else:
            echoed = self._prompt_logprobs(final) if self.echo is not None else None
            generated = None if self.prompt_only else self._logprobs(final)
            choice["text"] = (self.echo or "") + ("" if self.prompt_only else final.text)
            choice["logprobs"] = _joined(echoed, generated)
        calls = self._tool_calls(final) if self.chat else None
        choice["finish_reason"] = calls_finish_reason(calls[1], final.finish_reason) if calls else final.finish_reason
        choice["stop_reason"] = final.stop_string  # extension (as vLLM): the stop string that ended it
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": [choice],
                               "usage": self._usage(final)}
        if final.spec is not None:
            out["speculative"] = final.spec.to_dict()
        return out

    # -- streamed ---------------------------------------------------------------------------------
    async def events(self, sub: Subscription, last: bool = True) -> AsyncIterator[str]:
        """This choice's chunks; ``last``: then its usage chunk (if asked) and [DONE]."""
        try:
            if self.chat:
                yield self._chunk({"role": "assistant", "content": ""}, None)
            sent = 0
            # With tools, calls go out as they are generated: names once known, arguments piece by piece.
            calls_stream = ToolCallStream(self.tools.functions) if self.tools is not None else None
            while calls_stream is not None:
                progress = await sub.next()
                if progress.finished and progress.finish_reason not in ANSWERED:
                    message = progress.error or f"the request ended with finish_reason={progress.finish_reason!r}"
                    code = "server_shutting_down" if progress.shutdown else "internal_error"
                    yield _sse(error_body(message, "server_error", None, code))
                    if last:
                        yield "data: [DONE]\n\n"
                    return
                parsed = self._tool_calls(progress) if progress.finished else None
                if progress.finished:
                    self.final = progress
                    content, deltas = calls_stream.finish(progress.text, parsed or (None, []))
                else:
                    content, deltas = calls_stream.step(progress.text[: max(0, len(progress.text) - self.holdback)])
                logprobs = self._logprobs(progress) if progress.finished and parsed is None else None
                if content or logprobs is not None:
                    yield self._chunk({"content": content}, None, logprobs)
                if deltas:
                    yield self._chunk({"tool_calls": deltas}, None)
                if not progress.finished:
                    continue
                reason = calls_finish_reason(parsed[1], progress.finish_reason) if parsed else progress.finish_reason
                yield self._chunk({}, reason, None, progress.stop_string)
                if self.include_usage and last:
                    yield self._usage_chunk(progress)
                if last:
                    yield "data: [DONE]\n\n"
                return
            while True:
                progress = await sub.next()
                if self.echo is not None and (progress.completion_tokens or progress.finished):
                    # The prompt's logprobs are complete once it has been computed.
                    yield self._chunk(self.echo, None, self._prompt_logprobs(progress))
                    self.echo = None
                if progress.finished and progress.finish_reason not in ANSWERED:
                    message = progress.error or f"the request ended with finish_reason={progress.finish_reason!r}"
                    code = "server_shutting_down" if progress.shutdown else "internal_error"
                    yield _sse(error_body(message, "server_error", None, code))
                    break
                text = "" if self.prompt_only else progress.text
                visible = text if progress.finished else text[: max(0, len(text) - self.holdback)]
                if len(visible) > sent:
                    delta, sent = visible[sent:], len(visible)
                    yield self._chunk({"content": delta} if self.chat else delta, None, self._logprobs(progress))
                if progress.finished:
                    self.final = progress
                    rest = None if self.prompt_only else self._logprobs(progress)
                    yield self._chunk({} if self.chat else "", progress.finish_reason, rest, progress.stop_string)
                    if self.include_usage and last:
                        yield self._usage_chunk(progress)
                    break
            if last:
                yield "data: [DONE]\n\n"
        except Exception as err:  # a failure while building chunks: the client still gets an end
            log.error("stream failed", exc_info=err)
            yield _sse(error_body(f"internal error: {type(err).__name__}", "server_error", None, "internal_error"))
            if last:
                yield "data: [DONE]\n\n"
        finally:
            sub.close()

    def _chunk(self, delta: dict[str, Any] | str, finish_reason: str | None,
               logprobs: dict[str, Any] | None = None, stop_reason: str | None = None) -> str:
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                                 "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return _sse(chunk)

    def _usage_chunk(self, final: Progress) -> str:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                                 "choices": [], "usage": self._usage(final)}
        if final.spec is not None:
            chunk["speculative"] = final.spec.to_dict()
        return _sse(chunk)


def _joined(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions ``logprobs`` objects as one (the echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token the grammar or truncation forbids gets OpenAI's floor, -9999."""
    return max(logprob, -9999.0)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class EventStreamResponse(StreamingResponse):
    """SSE response that notices a client disconnect while it waits for tokens and always runs
    ``on_close`` (which aborts an unfinished request), however the stream ends."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                with contextlib.suppress(OSError):  # the client went away mid-send
                    await self.stream_response(send)
                group.cancel_scope.cancel()
        finally:
            self._on_close()
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def _refuse(error: APIError, metrics: ServerMetrics | None, scope: Scope, receive: Receive, send: Send) -> None:
    """A middleware's refusal: counted in /metrics, then answered."""
    count_refusal(metrics, error)
    await error.response()(scope, receive, send)


class BearerAuth:
    """ASGI middleware: /v1/*, /tokenize and /detokenize need ``Authorization: Bearer <api_key>``
    or, as Anthropic's clients send it, ``x-api-key: <api_key>`` (health and metrics stay open).

    The scheme is case-insensitive (RFC 9110); the key is compared in constant time.
    """

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in DIALECT_PATHS):
            sent = [value for name, value in scope.get("headers") or [] if name == b"authorization"]
            keys = [value for name, value in scope.get("headers") or [] if name == b"x-api-key"]
            if keys and not sent and len(keys) == 1:  # Anthropic's header: the same key, without a scheme
                sent = [b"Bearer " + keys[0]]
            if len(sent) > 1:  # a proxy that checks the first and this server the last must not disagree
                error = bad_request(f"{len(sent)} Authorization headers; send exactly one", code="invalid_api_key")
                await _refuse(error, self.metrics, scope, receive, send)
                return
            given = sent[0] if sent else b""
            scheme, _, credentials = given.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials.strip(), self.expected):
                reason = "missing API key" if not given else "invalid API key"
                error = APIError(401, f"{reason}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
                await _refuse(error, self.metrics, scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequireJSON:
    """ASGI middleware: a POST to ``paths`` must say its body is JSON (``Content-Type:
    application/json``); otherwise a 400 that says so, not a schema error about the body's shape."""

    def __init__(self, app: ASGIApp, paths: tuple[str, ...], metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.paths = paths
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            given = dict(scope.get("headers") or []).get(b"content-type", b"")
            media = given.partition(b";")[0].strip().lower()
            if media != b"application/json" and not (media.startswith(b"application/") and media.endswith(b"+json")):
                shown = short_repr(given.decode("latin-1")) if given else "none"
                error = bad_request(f"the request body must be JSON: send 'Content-Type: application/json' "
                                    f"(got {shown})", code="invalid_content_type")
                await _refuse(error, self.metrics, scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """ASGI middleware: a body over ``max_bytes`` gets a 413 at once, unread when its
    Content-Length says so, otherwise as soon as the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _refuse(too_large(self.max_bytes), self.metrics, scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:  # read the (small) body here, so a chunked upload is cut off at the limit too
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _refuse(too_large(self.max_bytes), self.metrics, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # then the client's disconnect, for the handlers that watch it

        await self.app(scope, replay, send)
