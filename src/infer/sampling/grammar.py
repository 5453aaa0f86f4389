"""Structured output: a grammar (JSON Schema, any JSON object, regex, Lark/EBNF) restricts every token.

Constrained sampling draws from the target's distribution restricted to the tokens the grammar
allows next, renormalised: the sampling transform sets forbidden logits to -inf before anything
else (``probs_from_logits(..., allowed=...)``). The grammar engine is llguidance (see "Grammar
engine" in docs/benchmarks.md for why): it compiles the grammar against the tokenizer and answers,
per state, a bitmask of allowed tokens; it can roll back tokens and validate a run of tokens.

Each request with a grammar owns a :class:`GrammarMatcher` whose state always matches the tokens
the request has emitted (``Request.append_token`` feeds it). Speculative rounds ask it, without
changing that state, which drafted nodes the grammar allows (a forbidden node and its subtree are
dropped before verification) and for the allowed-token mask at every verified position; with
grammar drafting (``GrammarMatcher.draft``) the walk also drafts the tokens the grammar forces
(keys, quotes, braces, enum values) where the drafter proposed nothing or proposed otherwise.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# JSON is laid out as json.dumps writes it ({"a": 1, "b": [2, 3]}): with free whitespace between
# tokens a weak model can emit newlines and spaces until max_tokens, never closing the object.
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint: ``json`` (a JSON Schema, as a dict or its JSON text), ``json_object``
    (any JSON object), ``regex``, or ``grammar`` (a Lark grammar, llguidance's EBNF dialect; a GBNF
    grammar, recognised by its ``::=`` rules, is converted)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in ("json", "regex", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            chosen.append("json_object")
        if len(chosen) != 1:
            raise ValueError("SamplingParams.structured_output must set exactly one of json, json_object, regex, "
                             f"grammar; got {chosen or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except RecursionError:
                    raise ValueError("SamplingParams.structured_output.json is nested too deeply") from None
                except ValueError as err:  # JSONDecodeError, or an integer too long to convert
                    raise ValueError(f"SamplingParams.structured_output.json is not valid JSON: {err}") from None
            if not isinstance(schema, dict):
                raise ValueError("SamplingParams.structured_output.json must be a JSON Schema object, got "
                                 f"{type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SamplingParams.structured_output.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "grammar") if getattr(self, name) is not None)

    @classmethod
    def coerce(cls, value: StructuredOutput | dict[str, Any]) -> StructuredOutput:
        if isinstance(value, StructuredOutput):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"json", "json_object", "regex", "grammar"})
            if unknown:
                raise ValueError(f"SamplingParams.structured_output has unknown keys {unknown}; "
                                 "expected one of json, json_object, regex, grammar")
            return cls(**value)
        raise ValueError(f"SamplingParams.structured_output must be a StructuredOutput or a dict, "
                         f"got {type(value).__name__}")


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar or schema may ask of the grammar engine; past a limit, a ValueError naming
    the option (the server's 400) before anything is compiled. Each field is the engine option
    ``grammar_<field>`` (``--grammar-max-bytes``, ...), declared here once with its default.

    llguidance compiles chains of references (Lark/GBNF rules, JSON Schema ``$ref``) recursively
    and a chain deep enough to exhaust a thread's stack kills the process; the chains these limits
    allow are compiled on threads whose stack holds them many times over (``compile_stack_bytes``).
    """

    max_bytes: int = 128 * 1024  # a grammar, or a JSON Schema as compact JSON
    max_rules: int = 4096  # rule definitions in a Lark or GBNF grammar
    # Nested schemas of a JSON Schema: N nested objects or arrays are N. llguidance reads a schema of at
    # most 128 levels of brackets, and a level takes up to _RAW_DEPTH of them (an object's schema and its
    # "properties", keywords' lists): the default is what it always reads.
    max_depth: int = 32
    max_ref_chain: int = 256  # JSON Schema $refs followed one inside another
    max_regex_bytes: int = 4096  # a regex (guided_regex, or a schema's pattern)
    max_enum: int = 2048  # values of one JSON Schema enum
    compile_timeout_s: float = 10.0  # compiling a grammar and its first mask

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_rules", "max_depth", "max_ref_chain", "max_regex_bytes", "max_enum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"grammar_{name}={getattr(self, name)!r} is invalid: must be an integer >= 1")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s={self.compile_timeout_s!r} is invalid: must be > 0")

    @property
    def compile_stack_bytes(self) -> int:
        # llguidance takes about 3 KB of stack per link of a chain; 16 KB leaves a wide margin.
        return max(64 << 20, 16 * 1024 * max(self.max_rules, self.max_ref_chain))

    def exceeded(self, field: str, name: str, what: str) -> ValueError:
        limit = getattr(self, name)
        return ValueError(f"SamplingParams.structured_output.{field} {what} (the limit is {limit}: the server "
                          f"option grammar_{name}, --grammar-{name.replace('_', '-')})")


# llguidance's own per-grammar limits at their defaults, but errors without the parser's internal
# state (which quotes the grammar and would reach the client).
_PARSER_LIMITS: dict[str, Any] = {"verbose_errors": False}
_WALKED_TOKENS = 8  # tokens a new grammar is walked at admission (see GrammarCompiler._compile)
_CACHED_GRAMMARS = 32  # grammars whose checks (and GBNF conversion) are kept: a request's are done once


class GrammarCompiler:
    """Compiles ``StructuredOutput`` against one tokenizer; the tokenizer's token table is built on
    first use (about a second for a 49k vocabulary) and kept.

    Every grammar is checked against ``limits`` first, then compiled, and its first mask computed,
    on a compiler thread with a deep stack (see ``GrammarLimits``): a grammar that cannot start
    (no token allowed, a limit of llguidance's hit) is a ValueError here, not an error mid-request.
    ``check`` compiles a request's grammar for its admission, which takes it; a grammar's checks and
    conversion are kept for its next requests (and n choices).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int,
                 limits: GrammarLimits | None = None) -> None:
        """``tokenizer``: the ``tokenizers.Tokenizer``; ``vocab_size``: the model's (logit rows),
        which may exceed the tokenizer's; the extra ids are never allowed."""
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self._ll_tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._cache_lock = threading.Lock()
        self._texts: OrderedDict[tuple[str, str], tuple[tuple[str, str], str]] = OrderedDict()  # checked grammars
        self._ready: OrderedDict[tuple[str, str], Any] = OrderedDict()  # compiled by check(), not yet taken
        self._walked: OrderedDict[tuple[str, str], bool] = OrderedDict()  # grammars probed along a path

    @property
    def ll_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self.tokenizer, self.eos_token_ids, self.vocab_size)
            return self._ll_tokenizer

    def grammar_text(self, spec: StructuredOutput) -> str:
        """The grammar llguidance compiles (after the limits are checked)."""
        return self._checked(spec)[1]

    def _checked(self, spec: StructuredOutput) -> tuple[tuple[str, str], str]:
        """(cache key, llguidance grammar) of ``spec``; ValueError naming a limit or the problem."""
        import llguidance

        matcher = llguidance.LLMatcher
        limits = self.limits
        if spec.json_object:
            return ("json_object", ""), str(matcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT))
        if spec.json is not None:
            schema = check_schema(spec.json, limits)
            try:
                text = json.dumps(schema, separators=(",", ":"), sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as err:  # a dict from Python with what JSON cannot hold
                raise ValueError(f"SamplingParams.structured_output.json is not JSON: {err}") from None
            if len(text.encode()) > limits.max_bytes:
                raise limits.exceeded("json", "max_bytes", f"is {len(text.encode())} bytes as JSON")
            try:
                return ("json", text), str(matcher.grammar_from_json_schema(schema, JSON_LAYOUT))
            except ValueError as err:
                raise ValueError(f"SamplingParams.structured_output.json is invalid: {_clean(err)}") from None
        if spec.regex is not None:
            size = len(spec.regex.encode("utf-8", "surrogatepass"))
            if size > limits.max_regex_bytes:
                raise limits.exceeded("regex", "max_regex_bytes", f"is {size} bytes")
            return ("regex", spec.regex), str(matcher.grammar_from_regex(ascii_classes(spec.regex)))
        assert spec.grammar is not None
        grammar = spec.grammar
        size = len(grammar.encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            raise limits.exceeded("grammar", "max_bytes", f"is {size} bytes")
        gbnf = is_gbnf(grammar)
        rules = len((_GBNF_RULE if gbnf else _LARK_RULE).findall(grammar))
        if rules > limits.max_rules:
            raise limits.exceeded("grammar", "max_rules", f"has {rules} rules")
        try:
            lark = gbnf_to_lark(grammar) if gbnf else grammar
        except RecursionError:
            raise ValueError("SamplingParams.structured_output.grammar is invalid: nested too deeply") from None
        except Exception as err:  # the converter raises plain Exceptions for a bad GBNF grammar
            raise ValueError(f"SamplingParams.structured_output.grammar is invalid: {_clean(err)}") from None
        return ("grammar", grammar), str(matcher.grammar_from_lark(lark))

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher; ValueError naming the field (and the limit) when the grammar or schema is
        invalid, too large, or cannot start. Blocks while a compiler thread works on it."""
        return GrammarMatcher(self._compiled(spec), (int(self.ll_tokenizer.vocab_size) + 31) // 32, self.eos_token_ids,
                              functools.partial(self._compiled, spec, True), self.ll_tokenizer.tokenize_bytes)

    def check(self, spec: StructuredOutput) -> None:
        """ValueError as ``matcher`` would raise; the compiled grammar is kept for the next
        ``matcher(spec)`` (a server checks a request's grammar, then the engine admits it)."""
        compiled = self._compiled(spec)
        key = self._grammar(spec)[0]
        with self._cache_lock:
            self._ready[key] = compiled
            _trim(self._ready)

    def _compiled(self, spec: StructuredOutput, fresh: bool = False) -> Any:
        """A compiled matcher of ``spec`` whose first mask was computed (``fresh``: never one kept by
        ``check``, and no further than that: a request's walker, see ``GrammarMatcher``)."""
        tokenizer = self.ll_tokenizer  # built outside the compile timeout: it is the server's cost, once
        job = self._recompile if fresh else self._compile
        future = _compile_threads(self.limits.compile_stack_bytes).submit(job, spec, tokenizer)
        try:
            return future.result(timeout=self.limits.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()  # if it has not started; a started compile ends within llguidance's fuel limits
            raise ValueError(f"SamplingParams.structured_output.{spec.kind} took more than "
                             f"{self.limits.compile_timeout_s:g} s to compile (the server option "
                             "grammar_compile_timeout_s, --grammar-compile-timeout-s)") from None

    def _grammar(self, spec: StructuredOutput) -> tuple[tuple[str, str], str]:
        """``_checked`` once per grammar: the conversion and checks of a large grammar cost milliseconds."""
        key = _spec_key(spec)
        with self._cache_lock:
            if key in self._texts:
                self._texts.move_to_end(key)
                return self._texts[key]
        found = self._checked(spec)
        with self._cache_lock:
            self._texts[key] = found
            _trim(self._texts)
        return found

    def _compile(self, spec: StructuredOutput, tokenizer: Any) -> Any:
        """Compiler thread: a compiled matcher of ``spec`` whose first mask was computed. Each request
        gets its own: copies of one matcher share llguidance's lexer, and one copy exhausting its
        limits there can leave another's masks wrong without an error."""

        key, text = self._grammar(spec)
        with self._cache_lock:
            ready = self._ready.pop(key, None)
        if ready is not None:
            return ready
        ll = self._probe(spec, tokenizer, text, 1)
        if key not in self._walked:
            # A grammar new to this compiler is also walked a few tokens along one path, on a matcher of
            # its own (copies share llguidance's lexer), so the commonest late failures (an unproductive
            # rule, a huge repetition, a schema that requires itself) are refused here, not mid-request.
            self._probe(spec, tokenizer, text, _WALKED_TOKENS)
            with self._cache_lock:
                self._walked[key] = True
                _trim(self._walked)
        return ll

    def _recompile(self, spec: StructuredOutput, tokenizer: Any) -> Any:
        return self._probe(spec, tokenizer, self._grammar(spec)[1], 1)

    def _probe(self, spec: StructuredOutput, tokenizer: Any, text: str, steps: int) -> Any:
        """A compiled matcher of ``text`` after computing ``steps`` masks, each step taking the lowest
        allowed token other than EOS (it stops once only EOS is left); ValueError naming the field
        when it fails to compile, allows nothing at the start, or fails on the way."""
        import llguidance

        # The constructor compiles the grammar and never raises: a bad one leaves it in its error state.
        ll = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=llguidance.LLParserLimits(**_PARSER_LIMITS))
        if ll.is_error():
            raise ValueError(f"SamplingParams.structured_output.{spec.kind} is invalid: {_clean(ll.get_error())}")
        mask = torch.zeros((int(tokenizer.vocab_size) + 31) // 32, dtype=torch.int32)
        eos = set(self.eos_token_ids)
        for step in range(steps):
            ll.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
            if ll.is_error():
                error = _clean(ll.get_error())
                if error == "NoExtensionBias":  # llguidance's word for "no text matches"
                    error = "no text matches it"
                after = f" after {step} token{'s' if step > 1 else ''}" if step else ""
                raise ValueError(f"SamplingParams.structured_output.{spec.kind} cannot be matched{after}: {error}")
            allowed = unpack_bitmasks(mask, int(tokenizer.vocab_size), "cpu").nonzero().flatten().tolist()
            if not allowed and step == 0:
                raise ValueError(f"SamplingParams.structured_output.{spec.kind} allows no token at the start")
            token = next((t for t in allowed if t not in eos), None)
            if token is None or step == steps - 1:
                break
            ll.consume_token(token)
        return ll


def _spec_key(spec: StructuredOutput) -> tuple[str, str]:
    if spec.json is not None and not isinstance(spec.json, str):
        try:
            return "json", repr(spec.json)
        except RecursionError:  # a dict from Python, nested past what any schema needs
            raise ValueError("SamplingParams.structured_output.json is nested too deeply") from None
    return spec.kind, str(spec.json if spec.json is not None else spec.regex if spec.regex is not None
                          else spec.grammar if spec.grammar is not None else "")


def _trim(cache: OrderedDict[Any, Any]) -> None:
    while len(cache) > _CACHED_GRAMMARS:
        cache.popitem(last=False)


def _clean(error: Any) -> str:
    """llguidance's message without the parser state it may append, and short."""
    text = str(error).split("\n<state>", 1)[0].replace("<non-verbose/>", "").strip()
    return text if len(text) <= 300 else text[:300] + "..."


class _CompileThreads:
    """Daemon threads with a deep stack that run compile jobs in turn (a thread's stack size can
    only be set when it starts, hence not a ThreadPoolExecutor)."""

    def __init__(self, workers: int, stack_bytes: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]] = \
            queue.SimpleQueue()
        previous = threading.stack_size(stack_bytes)
        try:
            for i in range(workers):
                threading.Thread(target=self._work, name=f"grammar-compiler-{i}", daemon=True).start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # handed to the waiting caller
                future.set_exception(err)


_COMPILE_WORKERS = 2
_compile_pools: dict[int, _CompileThreads] = {}
_compile_pools_lock = threading.Lock()


def _compile_threads(stack_bytes: int) -> _CompileThreads:
    """The process's compiler threads for this stack size (started on first use, shared by every compiler)."""
    with _compile_pools_lock:
        if stack_bytes not in _compile_pools:
            _compile_pools[stack_bytes] = _CompileThreads(_COMPILE_WORKERS, stack_bytes)
        return _compile_pools[stack_bytes]


# -- limits of a JSON Schema ----------------------------------------------------------------------
_ANNOTATIONS = {"$ref", "description", "title", "$comment", "default", "examples", "$schema", "$id"}
# Keywords whose value maps names to schemas: the map is no level of nesting of its own.
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
_RAW_DEPTH = 4  # brackets of a schema allowed per level of max_depth (keywords' lists and maps between)


def check_schema(schema: dict[str, Any] | str, limits: GrammarLimits) -> dict[str, Any]:
    """The schema (parsed when given as JSON text) once it is within ``limits``: nesting, enum and
    pattern sizes, the longest ``$ref`` chain, and no cycle of ``$ref``s that never reaches a schema.
    Walks iteratively: a hostile schema cannot exhaust Python's stack either."""
    if isinstance(schema, str):
        size = len(schema.encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            raise limits.exceeded("json", "max_bytes", f"is {size} bytes")
        if json_depth(schema) > _RAW_DEPTH * limits.max_depth:
            raise limits.exceeded("json", "max_depth", "is nested too deeply")
        schema = json.loads(schema)
    if not isinstance(schema, dict):
        raise ValueError("SamplingParams.structured_output.json must be a JSON Schema object")
    targets: dict[tuple[str | int, ...], Any] = {(): schema}  # where $refs point, by path
    refs: list[tuple[tuple[str | int, ...], tuple[str | int, ...]]] = []  # (the $ref's object, its target)
    # (node, its path, the schemas nested down to it, whether it is a map of names to schemas)
    stack: list[tuple[Any, tuple[str | int, ...], int, bool]] = [(schema, (), 0, False)]
    while stack:
        node, path, depth, names = stack.pop()
        # max_depth counts nested schemas (N nested objects or arrays are N), not the schema's own
        # brackets: an object nests its properties' schemas two levels down ("properties", then the
        # name). Every bracket is bounded too, at a multiple, for llguidance's recursive compiler.
        if isinstance(node, dict) and not names:
            depth += 1
        if depth > limits.max_depth or len(path) >= _RAW_DEPTH * limits.max_depth:
            raise limits.exceeded("json", "max_depth", "is nested too deeply")
        items: Any = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, (dict, list)):
                stack.append((value, (*path, key), depth,
                              not names and key in _SCHEMA_MAPS and isinstance(node, dict) and isinstance(value, dict)))
        if not isinstance(node, dict) or names:
            continue
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > limits.max_enum:
            raise limits.exceeded("json", "max_enum", f"has an enum of {len(enum)} values")
        pattern = node.get("pattern")
        if isinstance(pattern, str) and len(pattern.encode("utf-8", "surrogatepass")) > limits.max_regex_bytes:
            raise limits.exceeded("json", "max_regex_bytes", f"has a pattern of {len(pattern.encode())} bytes")
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _pointer(schema, ref)
            if target is not None:
                targets[target[0]] = target[1]
                refs.append((path, target[0]))
    _check_refs(targets, refs, limits)
    return schema


def _pointer(schema: Any, ref: str) -> tuple[tuple[str | int, ...], Any] | None:
    """(path, value) a local ``$ref`` (``#/a/b``) points at; None for any other reference."""
    from urllib.parse import unquote

    if not ref.startswith("#") or (len(ref) > 1 and not ref.startswith("#/")):
        return None
    node: Any = schema
    path: list[str | int] = []
    for raw in ref[2:].split("/") if len(ref) > 1 else []:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
            path.append(part)
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            path.append(int(part))
        else:
            return None
    return tuple(path), node


def _check_refs(targets: dict[tuple[str | int, ...], Any],
                refs: list[tuple[tuple[str | int, ...], tuple[str | int, ...]]], limits: GrammarLimits) -> None:
    """The longest chain of ``$ref``s inside one another (each compiled inside the last), and
    cycles of bare ``$ref``s (a schema that is only a reference to itself, at some remove)."""
    def owner(path: tuple[str | int, ...]) -> tuple[str | int, ...]:
        """The innermost reference target holding ``path``: compiling it compiles what is at path."""
        for cut in range(len(path), -1, -1):
            if path[:cut] in targets:
                return path[:cut]
        return ()

    edges: dict[tuple[str | int, ...], set[tuple[str | int, ...]]] = {path: set() for path in targets}
    for path in targets:
        if path:
            edges[owner(path[:-1])].add(path)
    for where, target in refs:
        edges[owner(where)].add(target)
    # Longest path from the root, each node once per path (a cycle is a reference the compiler reuses).
    longest: dict[tuple[str | int, ...], int] = {}
    on_path: set[tuple[str | int, ...]] = {()}
    walk: list[tuple[tuple[str | int, ...], list[tuple[str | int, ...]]]] = [((), sorted(edges[()], key=str))]
    while walk:
        node, pending = walk[-1]
        if pending:
            child = pending.pop()
            if child not in on_path and child not in longest:
                on_path.add(child)
                walk.append((child, sorted(edges[child], key=str)))
            continue
        walk.pop()
        on_path.discard(node)
        longest[node] = 1 + max((longest.get(c, 0) for c in edges[node] if c not in on_path), default=0)
        if longest[node] - 1 > limits.max_ref_chain:
            raise limits.exceeded("json", "max_ref_chain", "has too long a chain of $refs")
    reaches: set[tuple[str | int, ...]] = set()  # targets known to lead to a schema
    for start, value in targets.items():
        walked = [start]
        while walked[-1] not in reaches and isinstance(value, dict) and set(value) <= _ANNOTATIONS \
                and isinstance(value.get("$ref"), str):
            found = _pointer(targets[()], value["$ref"])
            if found is None:
                break
            if found[0] in walked:
                raise ValueError("SamplingParams.structured_output.json is invalid: its $refs form a cycle that "
                                 "never reaches a schema")
            walked.append(found[0])
            value = found[1]
        reaches.update(walked)


# \d and \w as JSON Schema's (ECMA-262) regexes mean them, which llguidance gives a schema's
# `pattern` but not a bare regex (there they are Unicode's: \d takes U+1FBF8 and every other digit).
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    r"""``regex`` with ``\d``, ``\D``, ``\w`` and ``\W`` as their ASCII classes, in and outside
    character classes (a negated one inside a class becomes a nested class, which llguidance reads as
    a union); other escapes (``\\d`` is a backslash, then d) and ``\s`` are left as they are."""
    out: list[str] = []
    depth = 0  # character classes open (llguidance's syntax nests them)
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            ascii_class = _ASCII_CLASSES.get(escaped.lower())
            if ascii_class is None:
                out.append(regex[i:i + 2])
            elif escaped.islower():
                out.append(ascii_class if depth else f"[{ascii_class}]")
            else:
                out.append(f"[^{ascii_class}]")
            i += 2
            continue
        if char == "[":
            depth += 1
            out.append(char)
            i += 1
            # A "]" first in a class (after an optional "^") is a literal.
            if regex.startswith("^", i):
                out.append("^")
                i += 1
            if regex.startswith("]", i):
                out.append("]")
                i += 1
            continue
        if char == "]" and depth:
            depth -= 1
        out.append(char)
        i += 1
    return "".join(out)


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of JSON ``text`` nest (brackets in strings do not count);
    linear, without parsing."""
    depth = deepest = 0
    for token in _JSON_TOKENS.finditer(text):
        char = token.group()
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


_JSON_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"?|[\[\]{}]')


# -- GBNF -----------------------------------------------------------------------------------------
# A rule definition at the start of a line: GBNF's "name ::=", Lark's "name:" / "NAME.2:".
_GBNF_RULE = re.compile(r"(?m)^[ \t]*[A-Za-z0-9_-]+[ \t]*::=")
_LARK_RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?[0-9]+)?[ \t]*:(?!:=)")
_LARK_MARK = re.compile(r"(?m)^[ \t]*(?:%llguidance\b|%import\b|%ignore\b|start[ \t]*:(?!:=))")
_GBNF_ROOT = re.compile(r"(?m)^[ \t]*root[ \t]*::=")
# A GBNF comment runs from # to the line's end, outside literals and character classes.
_GBNF_PIECES = re.compile(r'"(?:\\.|[^"\\\n])*"|\[(?:\\.|[^\]\\\n])*\]|#[^\r\n]*|[^"\[#]+|.', re.S)


def is_gbnf(grammar: str) -> bool:
    """A GBNF grammar defines ``root ::=``; a Lark one a ``start:`` rule (or says %llguidance, ...).
    Both kinds may contain the other's symbols in literals, so the rules decide."""
    return bool(_GBNF_ROOT.search(grammar)) and not _LARK_MARK.search(grammar)


def gbnf_to_lark(text: str) -> str:
    """llguidance's GBNF parser with a linear resolution: its own converter keeps a comment by
    appending to a string held in an attribute, and finds terminal rules by repeated passes over
    every rule, both quadratic (a large grammar took seconds on the thread that compiles)."""
    from llguidance.gbnf_to_lark import GrammarParser, RuleRefNode

    kept = [piece.group() for piece in _GBNF_PIECES.finditer(text) if not piece.group().startswith("#")]
    rules = GrammarParser().parse("".join(kept))
    if "root" not in rules:
        raise ValueError("no 'root' rule found")
    order = list(rules.values())
    uses: dict[str, set[str]] = {rule.name: set() for rule in order}  # rule -> the rules it refers to
    for rule in order:
        rule.alternatives = rule.alternatives.simplify()
        nodes = list(rule.children())
        while nodes:
            node = nodes.pop()
            if isinstance(node, RuleRefNode):
                if node.name not in rules:
                    raise ValueError(f"rule {node.name!r} not found")
                node.target = rules[node.name]
                uses[rule.name].add(node.name)
            nodes.extend(node.children())
    # A rule made only of literals, classes and terminal rules is a terminal (a lexeme), except the
    # start rule; found in one pass over the reverse references (a worklist).
    used_by: dict[str, list[str]] = {rule.name: [] for rule in order}
    waiting = {name: len(refs) for name, refs in uses.items()}
    for name, refs in uses.items():
        for ref in refs:
            used_by[ref].append(name)
    ready = [name for name, count in waiting.items() if count == 0 and name != "root"]
    while ready:
        name = ready.pop()
        rules[name].rule_is_terminal = True
        for user in used_by[name]:
            waiting[user] -= 1
            if waiting[user] == 0 and user != "root":
                ready.append(user)
    names: set[str] = set()
    for rule in order:
        if rule.name == "root":
            name = "start"
        else:
            name = re.sub(r"([a-z])([A-Z])", r"\1_\2", rule.name.replace("-", "_")).lower()
            name = name.upper() if rule.rule_is_terminal else name
        if name in names or (name == "start" and rule.name != "root"):
            raise ValueError(f"rule {rule.name!r} clashes with another rule once renamed to {name!r}")
        names.add(name)
        rule.name = name
        rule.comment = ""
    return "%llguidance {}\n\n" + "\n".join(f"{rule}\n" for rule in order)


@dataclass
class GrammarDraft:
    """A drafted chain or tree after the grammar's walk (``GrammarMatcher.draft``): nodes in walk
    order, each parent before its children."""

    tokens: list[int]
    parents: list[int]  # node i's parent, -1 for the root (the emitted tokens)
    origin: list[int]  # the drafter's node whose place node i takes (its token, or the forced one there); -1: none
    forced: list[bool]  # the grammar chose node i's token: a deterministic proposal (one-hot q)
    masks: torch.Tensor  # [len(tokens) + 1, words] int32: row 0 after the emitted tokens, row i + 1 after node i


class GrammarError(RuntimeError):
    """A request's grammar failed while it generated (a limit of llguidance's hit after some
    tokens): the engine ends that request with finish_reason "grammar_error"."""


class GrammarMatcher:
    """One request's grammar state: the allowed-token mask now and along drafted paths.

    llguidance builds its lexer lazily, within a budget of work ("fuel") that each mask computation
    resets; copies of a matcher share one lexer, and a matcher whose lexer ran out of fuel is in an
    error state it never leaves. What a lexer can still do therefore depends on everything done with
    it before. Plain decoding computes the mask at each position, then consumes the sampled token: a
    token the mask allows can still be refused (its consumption ran out of fuel), or the next mask
    can fail, and the request then ends with "grammar_error".

    So that a request fails where plain decoding fails and nowhere else, whatever was drafted, the
    request's matcher does exactly what plain decoding does, on a lexer of its own: ``consume``
    takes each emitted token, then computes the mask after it (the next sampling's mask); a refusal
    or a failed mask is returned, and ``Request.append_token`` ends the request with "grammar_error"
    there, after the refused token, as plain decoding does. Speculative walks (``draft_bitmasks``)
    run on a second matcher, compiled separately (its own lexer), that follows the emitted tokens:
    where a drafted path fails on it, only the drafts are lost.
    """

    def __init__(self, matcher: Any, words: int, eos_token_ids: Sequence[int],
                 recompile: Callable[[], Any] | None = None,
                 tokenize: Callable[[bytes], Sequence[int]] | None = None) -> None:
        """``recompile``: a new compiled matcher of the same grammar, its first mask computed, with a
        lexer of its own (the walker's); without it nothing drafted is walked, so none is kept.
        ``tokenize``: bytes -> token ids, for the forced text that has no forced tokens yet (without
        it, ``draft`` drafts forced tokens only)."""
        self._m = matcher
        self._tokenize = tokenize
        self.words = words  # bitmask width: 32 tokens per int32
        self.eos_token_ids = frozenset(eos_token_ids)
        self._recompile = recompile
        self._tokens: list[int] = []  # every token consumed, replayed onto a new walker
        self._error: str | None = None  # why the grammar cannot go on after the tokens consumed
        self._mask: torch.Tensor | None = None  # the mask after the last token consumed
        self._walker: Any = None
        self._walkers = 0  # walkers built; bounded, as a walker that keeps failing costs a replay each time

    def consume(self, token: int) -> str | None:
        """The request emitted ``token``: None, or why the grammar cannot go on after it (the
        matcher refused it, or cannot compute the next mask); never raises."""
        self._tokens.append(token)
        if self._walker is not None and not self._walker.consume_token(token):
            self._walker = None  # its lexer failed: a new one is built for the next walk
        if self._error is None:
            mask = torch.empty(self.words, dtype=torch.int32)
            if self._m.consume_token(token) and _fill_unless_error(self._m, mask):
                self._mask = mask
            else:
                self._error = f"the grammar cannot go on: {_clean(self._m.get_error())}"
        return self._error

    def bitmask(self) -> torch.Tensor:
        """[words] int32: bit t of the mask set = token t allowed next. GrammarError when the grammar
        cannot go on."""
        if self._error is not None:
            raise GrammarError(self._error)
        if self._mask is None:
            mask = torch.empty(self.words, dtype=torch.int32)
            _fill(self._m, mask)
            self._mask = mask
        return self._mask.clone()

    def draft_bitmasks(self, tokens: Sequence[int], parents: Sequence[int] | None) -> tuple[list[bool], torch.Tensor]:
        """Which drafted nodes the grammar allows, and the mask at each verification row.

        ``tokens`` are the nodes of a chain (``parents`` None: node i's parent is i - 1) or of a tree
        (``parents[i]``, -1 for the root). A node is kept when its token is allowed after its path
        and its parent is kept. Returns ``keep`` [N] and bitmasks [N + 1, words]: row 0 after the
        emitted tokens (``bitmask``, GrammarError as plain decoding's mask), row i + 1 after node i's
        path (all ones for a dropped node, which the caller removes). The matcher's state is
        unchanged on return. It is ``draft`` without grammar drafting, in the drafter's numbering.
        """
        walk = self.draft(tokens, parents)
        keep = [False] * len(tokens)
        masks = torch.full((len(tokens) + 1, self.words), -1, dtype=torch.int32)
        masks[0] = walk.masks[0]
        for node, origin in enumerate(walk.origin):
            keep[origin] = True
            masks[origin + 1] = walk.masks[node + 1]
        return keep, masks

    def draft(self, tokens: Sequence[int], parents: Sequence[int] | None, room: int | None = None,
              depth: int = 0) -> GrammarDraft:
        """The drafted chain or tree as the grammar lets it be verified, and the mask at each row.

        ``tokens``/``parents`` as in ``draft_bitmasks``. A drafted node whose token the grammar forbids
        after its path is dropped with its subtree. With ``room`` (grammar drafting; None: off), the
        walk also drafts what the grammar forces, adding at most ``room`` nodes, none deeper than
        ``depth`` tokens below the emitted ones:

        * where the grammar forces a token (llguidance's fast-forward tokens, the forced text's
          canonical tokens), that token is the node there: a drafted child with that token stays (and
          its subtree), the other children go, and where no child had it a node is added;
        * where the grammar forces text but not yet its tokens (text after it may join the last
          token: `` "`` before a string's content) and no drafted child is allowed, the forced text's
          tokenization is drafted, one token a node, each a guess the target may reject.

        A node the grammar chose (``GrammarDraft.forced``) is a deterministic proposal, a one-hot q,
        whether or not the drafter had proposed the same token: verification then accepts it with the
        target's probability of it, so the output distribution is unchanged.

        The walk runs on the walker (see the class). A node whose token the walker cannot consume,
        or after which it cannot compute a mask (a limit of llguidance's hit), is dropped, the walk
        stops there (the nodes not yet visited are dropped too) and the walker is discarded; the
        rows walked before are masks of states the grammar reached without error, which do not
        depend on the lexer's history. The target may still emit the dropped token from its parent's
        row, and the request's matcher then decides, as in plain decoding.

        The walk consumes each kept node's token and rolls it back when it leaves the node, except
        an EOS token: llguidance does not always record EOS in its rollback history (consumed once
        the grammar is complete, it is a no-op; ended by a lexeme, it is scanned away), so a
        rollback after it would undo an earlier token instead. EOS and everything drafted below
        it (``ignore_eos``) are walked on a copy of the walker, which is then dropped. The grammar
        never drafts EOS.
        """
        count = len(tokens)
        parents = list(range(-1, count - 1)) if parents is None else list(parents)
        kids: list[list[int]] = [[] for _ in range(count + 1)]
        for i in range(count):
            kids[parents[i] + 1].append(i)
        adding = room is not None and room > 0 and depth > 0
        budget = room or 0
        masks = torch.full((count + budget + 1, self.words), -1, dtype=torch.int32)
        masks[0] = self.bitmask()
        out = GrammarDraft([], [], [], [], masks[:1])
        walker = self._walker_now() if count or adding else None
        # The walker's own mask at the emitted state starts its budget for the first drafted tokens.
        if walker is None or not _fill_unless_error(walker, torch.empty(self.words, dtype=torch.int32)):
            self._walker = None
            return out
        # One frame per walked row: its row (0: the emitted state), the children still to visit as
        # (token, drafter's node or -1, chosen by the grammar, forced tokens known to follow), the
        # walker in that row's state, whether leaving the row rolls the walker back one token, and
        # its depth.
        stack: list[tuple[int, list[tuple[int, int, bool, list[int] | None]], Any, bool, int]] = []

        def enter(row: int, origin: int, matcher: Any, undo: bool, level: int, known: list[int] | None) -> None:
            # A node the grammar added has no drafted children (the drafter never saw its token).
            below = kids[origin + 1] if origin >= 0 or row == 0 else []
            stack.append((row, self._children(tokens, below, masks[row], matcher, known,
                                              room is not None, adding and budget > 0 and level < depth),
                          matcher, undo, level))

        try:
            enter(0, -1, walker, False, 0, None)
            while stack:
                row, pending, matcher, undo, level = stack[-1]
                if not pending:
                    stack.pop()
                    if undo:
                        matcher.rollback(1)
                    continue
                token, origin, forced, known = pending.pop(0)
                child, undo = (matcher.deep_copy(), False) if token in self.eos_token_ids else (matcher, True)
                node = len(out.tokens)
                if not child.consume_token(token) or not _fill_unless_error(child, masks[node + 1]):
                    masks[node + 1] = -1
                    self._walker = None  # its lexer failed: the rest is not walked, nor rolled back
                    break
                out.tokens.append(token)
                out.parents.append(row - 1)
                out.origin.append(origin)
                out.forced.append(forced)
                if origin < 0:
                    budget -= 1
                enter(node + 1, origin, child, undo, level + 1, known)
        except BaseException:
            for _, _, matcher, undo, _ in reversed(stack):
                if undo:
                    matcher.rollback(1)
            raise
        out.masks = masks[: len(out.tokens) + 1]
        return out

    def _children(self, tokens: Sequence[int], kids: list[int], mask: torch.Tensor, matcher: Any,
                  known: list[int] | None, forcing: bool, adding: bool) -> list[tuple[int, int, bool, list[int] | None]]:
        """The children a walked row visits, in order: the drafter's allowed children (``kids``, its
        node numbers), or with ``forcing`` the token the grammar forces there, kept from ``kids`` or
        added when ``adding`` (see ``draft``); ``known``: forced tokens already known to come next."""
        if forcing:
            certain = known if known else [int(t) for t in matcher.compute_ff_tokens()]
            if certain and certain[0] not in self.eos_token_ids and _allowed(mask, certain[0]):
                first, rest = certain[0], certain[1:] or None
                match = next((k for k in kids if int(tokens[k]) == first), None)
                if match is not None:
                    return [(first, match, True, rest)]
                return [(first, -1, True, rest)] if adding else []
        allowed: list[tuple[int, int, bool, list[int] | None]] = [
            (int(tokens[k]), k, False, None) for k in kids if _allowed(mask, int(tokens[k]))]
        if allowed or not adding or self._tokenize is None:
            return allowed
        text = bytes(matcher.compute_ff_bytes())
        guess = self._tokenize(text) if text else []
        if guess and guess[0] not in self.eos_token_ids and _allowed(mask, guess[0]):
            return [(int(guess[0]), -1, True, None)]
        return []

    def _walker_now(self) -> Any:
        """The walker in the emitted state (built, and the tokens replayed, when there is none), or
        None when walking is off for this request (no ``recompile``, or its walkers kept failing)."""
        if self._walker is not None:
            return self._walker
        if self._recompile is None or self._walkers >= _WALKERS:
            return None
        self._walkers += 1
        try:
            walker = self._recompile()
        except ValueError:  # e.g. past the compile timeout on a loaded machine: no drafts, no failure
            self._walkers = _WALKERS
            return None
        scratch = torch.empty(self.words, dtype=torch.int32)
        for token in self._tokens:  # as plain decoding took them, so its lexer fails only where that did
            if not walker.consume_token(token) or not _fill_unless_error(walker, scratch):
                return None
        self._walker = walker
        return walker


_WALKERS = 3  # walkers one request may build; past that, its drafts are dropped (plain decoding's rounds)


def _fill(matcher: Any, out: torch.Tensor) -> None:
    """Write ``matcher``'s allowed-token bitmask into ``out`` [words] int32; GrammarError when the
    matcher is in its error state, or enters it computing the mask (the mask is then not one)."""
    if not _fill_unless_error(matcher, out):
        raise GrammarError(f"the grammar cannot go on: {_clean(matcher.get_error())}")


def _fill_unless_error(matcher: Any, out: torch.Tensor) -> bool:
    """``_fill``, False instead of GrammarError."""
    if matcher.is_error():
        return False
    matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
    return not matcher.is_error()


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return 0 <= token < 32 * bitmask.shape[-1] and bool((int(bitmask[token >> 5]) >> (token & 31)) & 1)


def unpack_bitmasks(bitmasks: torch.Tensor, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[..., words] int32 bitmasks -> [..., vocab_size] bool on ``device`` (32 * words >= vocab_size)."""
    bits = bitmasks.to(device).unsqueeze(-1) & _BITS.to(device)
    return (bits != 0).flatten(-2)[..., :vocab_size]


def _ll_tokenizer(tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int) -> Any:
    """llguidance's view of the vocabulary: from the ``tokenizer.json`` when llguidance reads its
    decoder (byte-level BPE, SentencePiece byte fallback), else each token's text decoded alone."""
    import llguidance

    n_vocab = max(vocab_size, int(tokenizer.get_vocab_size(with_added_tokens=True)))
    eos = list(eos_token_ids)
    try:
        return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos)
    except (ValueError, RuntimeError):
        pass
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_DecodedVocabulary(tokenizer, eos, n_vocab)),
                                  n_vocab=n_vocab, eos_token=eos)


class _DecodedVocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, specials, and an encode function."""

    def __init__(self, tokenizer: Any, eos: list[int], n_vocab: int) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = None
        added = {int(i) for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        tokens = []
        for i in range(n_vocab):
            text = tokenizer.id_to_token(i)
            if i in added or text is None:  # llguidance marks special tokens with a leading 0xff byte
                tokens.append(b"\xff" + (text or f"<unused_{i}>").encode())
            else:
                tokens.append(tokenizer.decode([i], skip_special_tokens=False).encode())
        self.tokens = tokens
        self.special_token_ids = sorted(added | {i for i in range(n_vocab) if tokenizer.id_to_token(i) is None})
        self._by_first: dict[int, list[int]] = {}
        special = set(self.special_token_ids)
        for i, data in enumerate(tokens):
            if data and i not in special:
                self._by_first.setdefault(data[0], []).append(i)

    def __call__(self, text: str) -> list[int]:
        """Greedy longest match over the token texts, stopping at text no token starts: llguidance
        tokenizes forced text with it, and an unknown-token id here would force a wrong token."""
        data, out, at = text.encode(), [], 0
        while at < len(data):
            best = max((i for i in self._by_first.get(data[at], []) if data.startswith(self.tokens[i], at)),
                       key=lambda i: len(self.tokens[i]), default=None)
            if best is None:
                break
            out.append(best)
            at += len(self.tokens[best])
        return out
