"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): the served model's tokenizer over HTTP.

``/tokenize`` takes a ``prompt`` (tokenized as /v1/completions would: with BOS, special-token text
plain unless ``parse_special_tokens``) or chat ``messages`` (rendered by the chat template as
/v1/chat/completions renders them, tools included), and answers the token ids, their count and the
context length. ``/detokenize`` turns ids back into text.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import Field, ValidationError

from infer.server.bridge import documented
from infer.server.errors import bad_request
from infer.server.protocol import ChatCompletionRequest, _Body, check_model
from infer.server.tools import prompt_messages

MAX_DETOKENIZE_IDS = 1 << 16


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool | None = True
    parse_special_tokens: bool | None = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


def install(app: FastAPI, engine: Any, model_name: str, auth: bool = False) -> None:
    """Add /tokenize and /detokenize to ``app`` (``auth``: it requires an API key, documented as a 401)."""
    tokenizer = engine.tokenizer

    @app.post("/tokenize", tags=["tokenizer"], responses=documented((400, 401, 404, 413), auth))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model, model_name)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt and messages", param="prompt")
        parse = bool(body.parse_special_tokens)
        try:
            if body.prompt is not None:
                ids = await asyncio.to_thread(tokenizer.encode, body.prompt, bool(body.add_special_tokens), parse)
            else:
                try:
                    chat = ChatCompletionRequest.model_validate({"messages": body.messages, "tools": body.tools})
                except ValidationError as err:
                    raise bad_request(str(err.errors()[0]["msg"]), param="messages") from None
                fns = chat.tool_functions()
                messages, tools = prompt_messages(chat.template_messages(), chat.tool_list() if fns else None,
                                                  tokenizer.chat_template)
                ids = await asyncio.to_thread(engine.encode_chat, messages, parse, tools)
        except ValueError as err:
            raise bad_request(str(err), param="prompt" if body.prompt is not None else "messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_seq_len}

    @app.post("/detokenize", tags=["tokenizer"], responses=documented((400, 401, 404, 413), auth))
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model, model_name)
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}
