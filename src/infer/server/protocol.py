"""Request bodies of the OpenAI API (the fields ``infer`` honours) and their mapping to SamplingParams.

Bodies are validated strictly (no "5" for 5, no 1 for true, no NaN/Infinity); unknown fields are
ignored because OpenAI clients send many optional ones. Known fields that ask for something the
engine cannot do (``n=2``, ``echo``, tools...) are refused with a 400 that names the field, rather
than silently ignored. Structured output comes from ``response_format`` (chat) or the extension
fields ``structured_outputs`` / ``guided_json`` / ``guided_regex`` / ``guided_grammar`` (as vLLM's).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infer.sampling.params import MAX_LOGPROBS, SamplingParams, short_repr
from infer.server.errors import APIError, bad_request, from_sampling_error
from infer.server.tools import forced_schema, functions, loads_bounded

MAX_CHOICES = 64  # n, and prompts x n in one completions request
MAX_STOP_CHARS = 1000  # one stop string


@dataclass(frozen=True)
class RequestLimits:
    """Per-request work the server bounds beyond the body size (``infer serve`` flags of the same
    names; each past its limit is a 400 naming the field). Every step of a batch pays for one
    request's logit_bias entries and stop strings, and a response's logprobs are built and
    serialised whole."""

    max_logit_bias: int = 1024  # logit_bias entries
    max_stop: int = 64  # stop strings
    # Logprob entries a response may carry: choices x tokens (generated, plus the prompt's with
    # echo) x (1 + top logprobs), at most; 2^18 is about 10 MB of JSON.
    max_logprob_entries: int = 1 << 18

    def __post_init__(self) -> None:
        for name in ("max_logit_bias", "max_stop", "max_logprob_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    # True for the models only ever found inside a body: the body's check already covered them.
    nested: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON may carry a lone surrogate ("\ud800"): Python keeps it, UTF-8 cannot encode it. Echoed
        # (metadata, tools, ...) it made a 500 after the work was done, and a stored response that
        # answered 500 on every read; elsewhere it failed deep inside. So every string of every body,
        # ignored fields and keys too, is checked once here. An APIError rather than a ValueError, so
        # the 400 names the field: pydantic passes other exceptions through to the app's handlers.
        found = None if cls.nested else lone_surrogate(data)
        if found is not None:
            raise bad_request(found[1], param=found[0])
        return data


class StreamOptions(_Body):
    nested = True
    include_usage: bool | None = False


DEFAULT_LIMITS = RequestLimits()
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any) -> tuple[str, str] | None:
    """The top-level field and a message naming where ``value`` (parsed JSON) holds a string with a
    lone surrogate (in a key or a value), or None when every string is valid Unicode.

    Scans run at C speed (``json.dumps`` and a regex): one over the whole value in the common case,
    and to locate a surrogate, a descent that halves each list (or a dict's items) until one element
    is left, so a megabyte of small items costs a few dozen scans, not a Python step per item."""
    try:
        if not _has_surrogate(value):
            return None
    except (TypeError, ValueError, RecursionError):  # not plain JSON data, or deeper than json.dumps goes
        return _walk(value)
    item = value
    path: tuple[str | int, ...] = ()
    while True:
        if isinstance(item, str):
            return _in_text(path, item)
        if isinstance(item, dict):
            pairs = list(item.items())
            key, item = pairs[_first_with_surrogate(pairs)]
            if (found := _in_key(path, key)) is not None:
                return found
            path += (key,)
        elif isinstance(item, (list, tuple)) and item:
            index = _first_with_surrogate(item)
            item, path = item[index], path + (index,)
        else:
            return None


def _has_surrogate(value: Any) -> bool:
    text = json.dumps(value, ensure_ascii=False)
    if text.isascii():
        return False
    try:  # faster than the regex: UTF-8 encoding is what fails on a surrogate
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _first_with_surrogate(items: Any) -> int:
    """The index of the first of ``items`` (a list that holds a lone surrogate) that holds one."""
    low, high = 0, len(items)
    while high - low > 1:
        middle = (low + high) // 2
        if _has_surrogate(items[low:middle]):
            high = middle
        else:
            low = middle
    return low


def _walk(value: Any) -> tuple[str, str] | None:
    """``lone_surrogate`` for values ``json.dumps`` cannot take: every string visited in turn."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:  # iterative: a body may nest as deep as the JSON parser allows
        item, path = stack.pop()
        if isinstance(item, str):
            if (found := _in_text(path, item)) is not None:
                return found
        elif isinstance(item, dict):
            for key in item:
                if (found := _in_key(path, key)) is not None:
                    return found
            stack.extend((child, path + (key,)) for key, child in reversed(item.items()))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, path + (i,)) for i, child in reversed(list(enumerate(item))))
    return None


def _in_text(path: tuple[str | int, ...], text: str) -> tuple[str, str] | None:
    """``lone_surrogate``'s answer for the string ``text`` at ``path``, or None when it is valid."""
    bad = _SURROGATE.search(text)
    return None if bad is None else _located(path, f"a lone surrogate U+{ord(bad.group()):04X} at character "
                                                   f"{bad.start()}")


def _in_key(path: tuple[str | int, ...], key: Any) -> tuple[str, str] | None:
    """``lone_surrogate``'s answer for the key ``key`` of the dict at ``path``, or None when it is valid."""
    bad = _SURROGATE.search(key) if isinstance(key, str) else None
    return None if bad is None else _located((*path, key), f"its key has a lone surrogate U+{ord(bad.group()):04X}")


def _located(path: tuple[str | int, ...], problem: str) -> tuple[str, str]:
    def part(step: str | int) -> str:
        if isinstance(step, int):
            return f"[{step}]"
        return f".{step}" if step.isascii() and step.isidentifier() else f"[{ascii(step)[:40]}]"

    where = "".join(part(step) for step in path).lstrip(".") or "body"
    if len(where) > 200:  # a path hundreds of levels deep: its ends say where
        where = f"{where[:100]}…{where[-100:]}"
    top = path[0] if path else "body"
    field = top if isinstance(top, str) and _SURROGATE.search(top) is None else ascii(top)[:40]
    return field, f"{where}: the text is not valid Unicode: {problem}"


class SpeculationOptions(BaseModel):
    """The ``speculation`` extension: this request's speculative decoding (the output never changes)."""

    # A misspelt key here would silently do nothing: unknown keys are refused, unlike the body's.
    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    max_draft_tokens: int | None = None


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
    structured_outputs: dict[str, Any] | None = Field(default=None, description=(
        "extension (as vLLM): exactly one of json (a JSON Schema), json_object (true), regex, grammar (Lark "
        "or GBNF); every token is drawn from the model's distribution restricted to it, with or without "
        "speculation"))
    guided_json: dict[str, Any] | str | None = Field(default=None, description="extension (vLLM's older "
                                                     "spelling): structured_outputs.json")
    guided_regex: str | None = Field(default=None, description="extension: structured_outputs.regex")
    guided_grammar: str | None = Field(default=None, description="extension: structured_outputs.grammar")
    speculation: SpeculationOptions | None = Field(default=None, description=(
        "extension: {\"enabled\": false} decodes this request without speculation; {\"max_draft_tokens\": N} "
        "verifies at most N draft tokens a round. Output is the same either way; only the speed changes"))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """400 for known fields set to values this server cannot honour, or past ``limits``."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise bad_request(f"n={short_repr(self.n)} must be in [1, {MAX_CHOICES}]", param="n")
        if len(self.logit_bias or {}) > limits.max_logit_bias:
            raise bad_request(f"logit_bias has {len(self.logit_bias or {})} entries; this server takes at most "
                              f"{limits.max_logit_bias} (--max-logit-bias)", param="logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > limits.max_stop:
            raise bad_request(f"stop has {len(stop)} strings; this server takes at most {limits.max_stop} "
                              "(--max-stop)", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise bad_request(f"a stop string is longer than {MAX_STOP_CHARS} characters", param="stop")

    def check_logprob_entries(self, params: SamplingParams, tokens: int, limits: RequestLimits) -> None:
        """400 when the logprobs asked for could make a response larger than ``limits`` allows:
        ``tokens`` is every choice's ``max_tokens`` plus, with echo, its prompt's tokens."""
        per_token = max(0 if params.logprobs is None else 1 + params.logprobs,
                        0 if params.prompt_logprobs is None else 1 + params.prompt_logprobs)
        if tokens * per_token > limits.max_logprob_entries:
            field = "top_logprobs" if isinstance(self, ChatCompletionRequest) else "logprobs"
            raise bad_request(f"up to {tokens} tokens in all with {per_token - 1} top logprobs each could answer "
                              f"{tokens * per_token} logprob entries; this server answers at most "
                              f"{limits.max_logprob_entries} (--max-logprob-entries): ask for fewer tokens, choices "
                              "or top logprobs", param=field)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str | None:
        """The field that set max_tokens, or None when the server's default applies."""
        return "max_tokens" if self.max_tokens is not None else None

    def requested_logprobs(self) -> int | None:
        return None

    def requested_prompt_logprobs(self) -> int | None:
        return None

    def structured_output(self) -> tuple[dict[str, Any], str] | None:
        """The structured-output constraint and the field it came from (400 when several are set)."""
        found: list[tuple[dict[str, Any], str]] = []
        if self.structured_outputs is not None:
            found.append((dict(self.structured_outputs), "structured_outputs"))
        if self.guided_json is not None:
            found.append(({"json": self.guided_json}, "guided_json"))
        if self.guided_regex is not None:
            found.append(({"regex": self.guided_regex}, "guided_regex"))
        if self.guided_grammar is not None:
            found.append(({"grammar": self.guided_grammar}, "guided_grammar"))
        if len(found) > 1:
            raise bad_request(f"set one structured-output field, not {', '.join(name for _, name in found)}",
                              param=found[1][1])
        return found[0] if found else None

    def logit_bias_ids(self) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits only: str.isdigit and int() also take "²" (an error) and "٣" (3).
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise bad_request(f"logit_bias key {short_repr(key)} is not a token id (a decimal number)",
                                  param="logit_bias")
            bias[int(key)] = value
        return bias

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        top_k = self.top_k
        if top_k == -1:
            top_k = 0  # vLLM's spelling of "disabled"
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.requested_max_tokens()
        structured = self.structured_output()
        speculation = self.speculation or SpeculationOptions()
        # The fields a body left out (None) take SamplingParams' own defaults, declared there once.
        given: dict[str, Any] = {
            "temperature": self.temperature, "top_k": top_k, "top_p": self.top_p, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "ignore_eos": self.ignore_eos}
        try:
            return SamplingParams(
                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                **{name: value for name, value in given.items() if value is not None},
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                seed=self.seed,
                logit_bias=self.logit_bias_ids(),
                logprobs=self.requested_logprobs(),
                prompt_logprobs=self.requested_prompt_logprobs(),
                structured_output=None if structured is None else structured[0],
                speculate=speculation.enabled,
                max_draft_tokens=speculation.max_draft_tokens,
            )
        except ValueError as err:
            if structured is not None and "structured_output" in str(err):
                raise bad_request(str(err), param=structured[1]) from None
            if "SamplingParams.max_draft_tokens=" in str(err):
                raise bad_request(str(err).replace("SamplingParams.max_draft_tokens", "speculation.max_draft_tokens"),
                                  param="speculation.max_draft_tokens") from None
            raise from_sampling_error(err) from None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        super().check_supported(limits)
        if self.best_of is not None and not (self.n or 1) <= self.best_of <= MAX_CHOICES:
            raise bad_request(f"best_of={short_repr(self.best_of)} must be in [n, {MAX_CHOICES}] (n={self.n or 1})",
                              param="best_of")
        if self.stream and (self.best_of or 1) > (self.n or 1):
            raise bad_request("best_of above n cannot be streamed (the best are known once all are done)",
                              param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens=0`` (lm-eval's loglikelihood): the prompt and its logprobs alone.
        The engine still generates one token (it always does), which the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token-id list, or a list of them (one choice each, in order)."""
        prompt: Any = self.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if any(not p for p in prompts):
            raise bad_request("the prompt is empty", param="prompt")
        width = max(self.n or 1, self.best_of or 1)
        if len(prompts) * width > MAX_CHOICES:
            raise bad_request(f"{len(prompts)} prompts x n={width} is more than {MAX_CHOICES} choices",
                              param="prompt")
        return prompts  # type: ignore[no-any-return]


class CalledFunction(_Body):
    nested = True
    name: str = Field(min_length=1, max_length=64)
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI's), or the object itself

    @field_validator("arguments")
    @classmethod
    def _arguments_are_json(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(value, str) and value.strip():
            try:
                loads_bounded(value)
            except ValueError as err:
                raise ValueError(f"arguments are not JSON ({str(err)[:200]})") from None
        return value


class AssistantToolCall(_Body):
    """An assistant's earlier tool call, as OpenAI's API returned it."""

    nested = True
    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionDefinition(_Body):
    nested = True
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="as OpenAI's: letters, digits, _ and -, "
                                                                      "at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema (checked as any schema when a call is forced)
    strict: bool | None = None


class ToolDefinition(_Body):
    nested = True
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Body):
    nested = True
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Body):
    nested = True
    type: Literal["function"] = "function"
    function: FunctionName


class ChatMessage(_Body):
    nested = True
    # A closed set: the template writes the role between control tokens, so free text there could forge a turn.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's call

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
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_functions(self) -> dict[str, dict[str, Any]]:
        """name -> function of ``tools`` (empty without tools, or with tool_choice none)."""
        if not self.tools or self.tool_choice == "none":
            return {}
        return functions(self.tool_list())

    def tool_list(self) -> list[dict[str, Any]]:
        """``tools`` as the chat template gets them."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def check_supported(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        super().check_supported(limits)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs={short_repr(self.top_logprobs)} must be in [0, {MAX_LOGPROBS}]",
                              param="top_logprobs")
        if self.functions or self.function_call not in (None, "none"):
            raise bad_request("the legacy functions/function_call fields are not supported; use tools",
                              param="functions" if self.functions else "function_call", code="unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise bad_request("tool_choice needs tools", param="tool_choice")

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def structured_output(self) -> tuple[dict[str, Any], str] | None:
        """``response_format`` json_object / json_schema (strict or not: either way the output
        follows the schema), else the extension fields."""
        fmt = self.response_format
        kind = None if fmt is None else fmt.get("type", "text")
        found = super().structured_output()
        fns = self.tool_functions()
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        forced = forced_schema(fns, choice, self.parallel_tool_calls is not False) if fns else None
        if forced is not None:
            if found is not None or kind not in (None, "text"):
                raise bad_request("tool_choice required or named cannot be combined with another output format",
                                  param="tool_choice")
            return {"json": forced}, "tools"
        if kind in (None, "text"):
            return found
        if found is not None:
            raise bad_request(f"set response_format or {found[1]}, not both", param=found[1])
        assert fmt is not None
        if kind == "json_object":
            return {"json_object": True}, "response_format"
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("response_format.json_schema must be an object with a 'schema' object",
                                  param="response_format")
            return {"json": spec.get("schema", {})}, "response_format"
        raise bad_request(f"response_format type {short_repr(kind)} is not supported (text, json_object, json_schema)",
                          param="response_format", code="unsupported_parameter")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str | None:
        return "max_completion_tokens" if self.max_completion_tokens is not None else super().max_tokens_field()


# -- response bodies (they document /openapi.json; app.py builds the same shapes) -----------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache (--prefix-caching)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpeculativeStats(BaseModel):
    """Extension: how speculation went for this request (only when the server speculates)."""

    acceptance_rate: float | None
    mean_accepted_tokens: float | None
    num_rounds: int
    proposed_tokens: int
    accepted_tokens: int


class CompletionLogprobs(BaseModel):
    """Per generated token (the processed distribution: penalties, logit bias, grammar mask and
    temperature, before top-k/top-p truncation; see docs/usage.md)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for the first prompt token when echo is set
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Per generated token (the processed distribution, as for completions)."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
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
        raise APIError(404, f"the model {short_repr(requested)} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")
