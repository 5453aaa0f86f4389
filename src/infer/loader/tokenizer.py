"""The tokenizer: a ``tokenizers`` object (from ``tokenizer.json``, or built from a GGUF's vocabulary)
plus the tokenizer config (special tokens, chat template)."""

from __future__ import annotations

import functools
import json
import re
import secrets
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from infer.models.config import CheckpointError

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 5 saves the template


class Tokenizer:
    """Encode, decode, render the chat template, and know the end-of-sequence ids.

    ``config`` holds the ``tokenizer_config.json`` fields (special tokens, ``chat_template``).
    """

    def __init__(self, backend: HFTokenizer, config: dict[str, Any], eos_token_ids: list[int] | None = None,
                 source: str = "tokenizer_config.json") -> None:
        self._tok = backend
        self.config = config
        self.source = source
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template: str | None = _pick_template(config.get("chat_template"))
        ids = list(eos_token_ids or [])
        if self.eos_token is not None:
            eos_id = self._tok.token_to_id(self.eos_token)
            if eos_id is not None and eos_id not in ids:
                ids.append(eos_id)
        self.eos_token_ids = ids
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: list[int] | None = None) -> Tokenizer:
        """``tokenizer.json`` + ``tokenizer_config.json``; the chat template from ``chat_template.jinja``
        when present (transformers 5 keeps it there), else from ``tokenizer_config.json``."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer.json not found")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a plain Exception for a malformed file
            raise CheckpointError(f"{path}: cannot parse tokenizer ({err})") from None
        cfg_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as err:
                raise CheckpointError(f"{cfg_path}: not valid JSON ({err})") from None
            if not isinstance(config, dict):
                raise CheckpointError(f"{cfg_path}: expected a JSON object")
        template_path = folder / CHAT_TEMPLATE_FILE
        if template_path.is_file():
            config["chat_template"] = template_path.read_text()
        return cls(backend, config, eos_token_ids, source=f"{folder} ({CHAT_TEMPLATE_FILE} or tokenizer_config.json)")

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers`` object (``backend.to_str()`` is a ``tokenizer.json``)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ValueError for text the tokenizer cannot take (a lone surrogate).

        ``parse_special=False`` reads special-token text (``<|im_end|>``) as plain characters, so
        untrusted text cannot inject control tokens; ``add_special_tokens`` (BOS) is a separate matter.
        ``encode_batch`` releases the GIL while ``encode`` holds it (seconds for a long text, which
        would stall a server's event loop even from a worker thread); the ids are the same.
        """
        backend = self._tok if parse_special else self._plain_backend
        try:
            encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        except TypeError:  # tokenizers refuses str objects that are not valid Unicode
            raise ValueError(_invalid_text(text)) from None
        return list(encoding.ids)

    @functools.cached_property
    def _plain_backend(self) -> HFTokenizer:
        """A copy of the backend that tokenizes special-token text like any other text (the
        setting is per object, so the shared backend keeps parsing them for templates)."""
        plain = HFTokenizer.from_str(self._tok.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def _special_text(self) -> re.Pattern[str] | None:
        """Matches the text of any special token (None if there are none)."""
        texts = sorted({t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content},
                       key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def has_special_text(self, text: str) -> bool:
        """Whether ``text`` contains the text of a special token (``<|im_end|>``)."""
        return self._special_text is not None and self._special_text.search(text) is not None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: no token covers more text than that
        (a byte-level entry has one character per byte, at least as many as its decoded text)."""
        return max((len(token) for token in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def min_token_count(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` known without tokenizing.

        A normaliser may shrink text before tokenizing (Unicode composition merges at most three
        code points into one), hence the margin of 4.
        """
        return len(text) // (4 * self.max_token_chars)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[Any] | None = None) -> str:
        if not self.chat_template:
            raise ValueError(f"this tokenizer has no chat_template (looked in {self.source}); use a plain prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools,
            )
        except TemplateError as err:
            raise ValueError(f"chat template failed: {err}") from None

    def encode_chat(self, messages: list[dict[str, Any]], parse_special: bool = True,
                    tools: list[Any] | None = None) -> list[int]:
        """Token ids of the rendered chat template. With ``parse_special=False`` only the template
        writes control tokens: special-token text in a message's ``content`` or ``name`` is plain text,
        so a user cannot close their turn and open a fake system turn."""
        # The template already writes any BOS, so no special tokens are added again (as transformers does).
        if parse_special or not any(self.has_special_text(v) for m in messages for k, v in m.items()
                                    if k in _MESSAGE_TEXT and isinstance(v, str)):
            return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)
        # Mark each text with a random fence, render, then tokenize the fenced parts as plain text
        # and the template's own text with its control tokens. (Only taken when a message holds
        # special-token text: tokenizing in pieces may split differently at the fences.)
        nonce = secrets.token_hex(8)
        start, end = f"\ue000{nonce}\ue001", f"\ue001{nonce}\ue000"
        fenced = [{k: f"{start}{v}{end}" if k in _MESSAGE_TEXT and isinstance(v, str) else v for k, v in m.items()}
                  for m in messages]
        rendered = self.apply_chat_template(fenced, tools=tools)
        ids: list[int] = []
        pos = 0
        for match in re.finditer(f"{re.escape(start)}(.*?){re.escape(end)}", rendered, re.DOTALL):
            ids += self._template_ids(rendered[pos:match.start()], nonce)
            inner = match.group(1)
            if nonce in inner:
                raise ValueError(_FENCE_BROKEN)
            ids += self.encode(inner, add_special_tokens=False, parse_special=False)
            pos = match.end()
        return ids + self._template_ids(rendered[pos:], nonce)

    def _template_ids(self, text: str, nonce: str) -> list[int]:
        if nonce in text:  # the template cut or reordered a message's text: refuse rather than guess
            raise ValueError(_FENCE_BROKEN)
        return self.encode(text, add_special_tokens=False) if text else []


_MESSAGE_TEXT = ("content", "name")  # the message fields a request supplies as free text
_FENCE_BROKEN = ("a message holds special-token text (such as '<|im_end|>') and this chat template rewrites "
                 "message text, so it cannot be kept as plain text; remove it from the message")


def _invalid_text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        return f"the text is not valid Unicode: a lone surrogate U+{ord(bad):04X} at character {err.start}"
    return "the text cannot be tokenized"


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
