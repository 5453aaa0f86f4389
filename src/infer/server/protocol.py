"""Request bodies of the OpenAI API (the fields ``infer`` honours) and their mapping to SamplingParams.

Bodies are validated strictly (no "5" for 5, no 1 for true, no NaN/Infinity); unknown fields are
ignored because OpenAI clients send many optional ones. Known fields that ask for something the
engine cannot do (``n=2``, ``logprobs``, penalties other than repetition_penalty, tools...) are
refused with a 400 that names the field, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infer.sampling.params import SamplingParams, short_repr
from infer.server.errors import APIError, bad_request, from_sampling_error


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = False


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, description="extension; 0 or -1 disables it")
    min_p: float | None = Field(default=None, description="extension")
    repetition_penalty: float | None = Field(default=None, description="extension")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="extension")
    ignore_eos: bool | None = Field(default=None, description="extension: keep generating past EOS")
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, description=(
        "extension (as vLLM): with prefix caching, only requests with the same salt share cached prompt "
        "blocks, so tenants with different salts never reuse each other's KV cache"))
    parse_special_tokens: bool | None = Field(default=False, description=(
        "extension: tokenize special-token text in the prompt or message contents (such as '<|im_end|>') as "
        "control tokens. By default it is plain text, so text from users cannot end a turn or forge one; "
        "only the chat template writes control tokens"))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """400 for known fields set to values this server cannot honour."""
        if self.n not in (None, 1):
            raise bad_request(f"n={short_repr(self.n)} is not supported: this server returns one choice per "
                              "request (n=1)",
                              param="n", code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise bad_request(f"{name}={short_repr(value)} is not supported (only 0); use repetition_penalty "
                                  "instead",
                                  param=name, code="unsupported_parameter")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported_parameter")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str | None:
        """The field that set max_tokens, or None when the server's default applies."""
        return "max_tokens" if self.max_tokens is not None else None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        top_k = self.top_k
        if top_k == -1:
            top_k = 0  # vLLM's spelling of "disabled"
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.requested_max_tokens()
        try:
            return SamplingParams(
                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=0 if top_k is None else top_k,
                top_p=1.0 if self.top_p is None else self.top_p,
                min_p=0.0 if self.min_p is None else self.min_p,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=bool(self.ignore_eos),
                seed=self.seed,
            )
        except ValueError as err:
            raise from_sampling_error(err) from None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo=true is not supported", param="echo", code="unsupported_parameter")
        if self.logprobs is not None:
            raise bad_request("logprobs is not supported", param="logprobs", code="unsupported_parameter")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of={short_repr(self.best_of)} is not supported (only 1)", param="best_of",
                              code="unsupported_parameter")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string, or token ids. Batches of prompts are refused."""
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"got {len(prompt)} prompts; this server takes one prompt per request",
                                  param="prompt", code="unsupported_parameter")
            prompt = prompt[0]
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        return prompt  # type: ignore[no-any-return]


class ChatMessage(_Body):
    # A closed set: the template writes the role between control tokens, so free text there could forge a turn.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"content part of type {short_repr(part.get('type'))} is not supported "
                                      "(only text)",
                                      param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            name = "logprobs" if self.logprobs else "top_logprobs"
            raise bad_request(f"{name} is not supported", param=name, code="unsupported_parameter")
        if self.tools or self.functions:
            name = "tools" if self.tools else "functions"
            raise bad_request("tool calling is not supported", param=name, code="unsupported_parameter")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            name = "tool_choice" if self.tool_choice not in (None, "none") else "function_call"
            raise bad_request("tool calling is not supported", param=name, code="unsupported_parameter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request(f"response_format type {short_repr(self.response_format.get('type'))} is not supported "
                              "(only text)", param="response_format", code="unsupported_parameter")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str | None:
        return "max_completion_tokens" if self.max_completion_tokens is not None else super().max_tokens_field()


# -- response bodies (they document /openapi.json; app.py builds the same shapes) -----------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeStats(BaseModel):
    """Extension: how speculation went for this request (only when the server speculates)."""

    acceptance_rate: float | None
    mean_accepted_tokens: float | None
    num_rounds: int
    proposed_tokens: int
    accepted_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """``stream: false``; with ``stream: true`` the answer is ``text/event-stream`` chunks of this
    shape (``text`` the new piece), ``data: {"error": ...}`` if the request fails, then ``data: [DONE]``."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    speculative: SpeculativeStats | None = None


class AssistantMessage(BaseModel):
    role: str
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """``stream: false``; with ``stream: true`` the answer is ``text/event-stream`` chunks
    (``chat.completion.chunk`` with a ``delta``), ``data: {"error": ...}`` if the request fails,
    then ``data: [DONE]``."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None
    speculative: SpeculativeStats | None = None


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Health(BaseModel):
    status: str


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(400, f"the model {short_repr(requested)} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")
