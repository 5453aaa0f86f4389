"""``infer bench agent``: agent loops through ``infer serve``, plain against each speculator.

An agent loop is a conversation of turns: a tool is called, its result (a JSON document, a file, a
log) is fed back, and the model answers from it: restates its plan with the steps done, quotes the
lines of the result the step is about and writes them edited. The next turn calls the next tool of
the plan. Such answers copy from the conversation (the quoted result, the plan written at every
turn), which is what suffix decoding and n-gram lookup draft from.

The benchmark plays the agent's tool calls and the tools: each conversation is one of four
scenarios (``SCENARIOS``: a service's JSON config, a payment log to triage, an order to refund
through a JSON API, a standard-library function to edit), its tool results generated from a seed,
so every mode and every run sees the same conversation, and the model writes every answer (greedy,
``tool_choice: "none"``, up to ``--max-tokens`` a turn). Each call is sent as the API carries it:

* ``chat``: ``/v1/chat/completions``, the whole conversation each turn: the assistant's
  ``tool_calls`` (ids ``call_<seed>_<turn>``), a ``role: "tool"`` message with the result, the
  model's earlier answers as assistant messages.
* ``responses``: ``/v1/responses`` continuing the previous response (``previous_response_id``):
  each turn's input is the ``function_call`` item and its ``function_call_output``.
* ``responses-input``: ``/v1/responses`` with the whole conversation as the input list (message,
  ``function_call`` and ``function_call_output`` items, the earlier answers as assistant
  messages), ``store: false``.

One ``infer serve`` per mode (plain, then ``--speculator NAME`` at its default policy for each),
launched as ``infer bench serving`` launches them, each idle while another is measured; the modes
take turns per conversation in an order that rotates, and every (repeat, API, conversation) has a
seed of its own, so a drafter that learns from earlier requests (suffix decoding) never sees a
measured conversation twice. Reports per API and mode the total tokens/s over the whole loop
(completion tokens over the requests' wall time, prefill included) per repeat, their median, the
median of per-repeat ratios to plain, and whether every answer equals plain's (a mismatch is
reported and makes the command exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infer.bench.report import write_json_and_table

APIS = ("chat", "responses", "responses-input")
SPECULATORS = ("ngram", "suffix", "eagle")

INSTRUCTIONS = (
    "You are a coding agent. You work through the user's plan one step at a time; the harness makes each "
    "tool call for you and shows you its result. After every tool result, answer in three parts: first "
    "the plan again, each step marked [done] or [next]; then the lines of the result this step is about, "
    "quoted exactly; then those lines as they should be after the change.")

# The functions the agent calls, as /v1/chat/completions declares them (the Responses form is flat).
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command in the workspace and return its output",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "search_logs", "description": "Search a service's log for lines of a level",
        "parameters": {"type": "object", "properties": {"service": {"type": "string"}, "level": {
            "enum": ["DEBUG", "INFO", "WARNING", "ERROR"]}}, "required": ["service", "level"]}}},
    {"type": "function", "function": {
        "name": "http_request", "description": "Send a request to the shop's internal JSON API",
        "parameters": {"type": "object", "properties": {"method": {"enum": ["GET", "POST"]},
                                                        "url": {"type": "string"}, "body": {"type": "object"}},
                       "required": ["method", "url"]}}},
]


@dataclass(frozen=True)
class ToolStep:
    """One turn's call (made by the benchmark for the agent) and the tool's result."""

    name: str
    arguments: dict[str, Any]
    result: str


@dataclass(frozen=True)
class Conversation:
    """An agent loop to replay: the user's task (with its plan) and a tool step per turn."""

    scenario: str
    seed: int
    task: str
    steps: tuple[ToolStep, ...]

    def call_id(self, turn: int) -> str:
        return f"call_{self.seed}_{turn}"

    def arguments(self, turn: int) -> str:
        return json.dumps(self.steps[turn].arguments)


# -- the scenarios: synthetic artifacts from a seed ------------------------------------------------
_SERVICES = ("billing", "search", "thumbnails", "notifications", "inventory", "checkout", "reports", "accounts")
_FEATURES = ("compression", "request_tracing", "rate_limiting", "cache_warmup", "audit_log", "retry_budget",
             "batch_writes", "read_replicas", "circuit_breaker", "gzip_static")
_HOSTS = ("db-eu-1", "db-eu-2", "db-us-1", "pg-main", "pg-replica")
_PEOPLE = ("Ada Moreau", "Ben Okafor", "Chen Li", "Dana Kowalski", "Eli Haddad", "Fatima Zahra", "Gus Lindqvist",
           "Hana Sato", "Ivan Petrov", "Julia Rossi")
_PRODUCTS = (("ceramic mug", 12.5), ("desk lamp", 39.0), ("wool blanket", 64.0), ("steel bottle", 18.0),
             ("notebook set", 9.5), ("phone stand", 15.0), ("tea kettle", 42.0), ("cutting board", 27.0))
_ERRORS = ("card declined by issuer", "timeout contacting bank gateway after 30s", "currency EUR not enabled for "
           "merchant", "duplicate idempotency key", "amount must be positive")


def _clock(rng: random.Random, start_hour: int, count: int) -> list[str]:
    """``count`` sorted timestamps within an hour of one day."""
    day = rng.randint(10, 28)
    seconds = sorted(rng.sample(range(3600), count))
    return [f"2027-03-{day}T{start_hour:02d}:{s // 60:02d}:{s % 60:02d}Z" for s in seconds]


def _config_conversation(rng: random.Random, seed: int, size: int) -> Conversation:
    service = rng.choice(_SERVICES)
    features = {name: rng.random() < 0.5 for name in rng.sample(_FEATURES, min(len(_FEATURES), 2 + size // 2))}
    off = [name for name, on in features.items() if not on] or [next(iter(features))]
    turn_on = rng.choice(off)
    workers = rng.randint(2, 8)
    config: dict[str, Any] = {
        "service": service, "version": f"{rng.randint(1, 4)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
        "port": rng.choice((8080, 8081, 9000, 9090)), "workers": workers, "log_level": "info",
        "features": features,
        "database": {"host": rng.choice(_HOSTS), "port": 5432, "pool_size": rng.randint(4, 32),
                     "timeout_s": rng.choice((5, 10, 30))},
        "limits": {f"max_{name}": rng.randint(10, 5000) for name in
                   ("connections", "requests_per_minute", "body_kb", "queue_depth", "open_files", "threads")[
                       :max(1, size // 2)]}}
    edited = json.loads(json.dumps(config))
    edited["workers"] = workers * 2
    edited["features"][turn_on] = True
    path = f"config/{service}.json"
    times = _clock(rng, 9, max(2, size))
    deploy = [f"{t} INFO deploy {service} v{config['version']}: step {i + 1}/{len(times)} "
              f"{rng.choice(('pulled image', 'migrated schema', 'restarted workers', 'health check passed'))}"
              for i, t in enumerate(times)]
    deploy[-1] = f"{times[-1]} WARNING deploy {service}: {workers} workers busy at 100% for 300s, queue depth " \
                 f"{rng.randint(200, 900)}"
    checks = [f"check {key}: ok" for key in edited if key != "features"]
    checks += [f"check features.{name}: ok ({'on' if on else 'off'})" for name, on in edited["features"].items()]
    checks.append(f"warning: workers={edited['workers']} exceeds database.pool_size="
                  f"{edited['database']['pool_size']} / 2" if edited["workers"] > edited["database"]["pool_size"] // 2
                  else "all checks passed")
    task = (f"The {service} service is slow under load. Double its worker count from {workers} to {workers * 2} and "
            f"turn on the {turn_on} feature in {path}, keeping every other setting as it is.\n"
            f"Plan:\n1. Read {path}.\n2. Read the last deployment's log.\n3. Validate the edited config.\n"
            f"4. Read {path} back and confirm both changes.")
    steps = (ToolStep("read_file", {"path": path}, json.dumps(config, indent=2)),
             ToolStep("read_file", {"path": f"logs/deploy-{service}.log"}, "\n".join(deploy)),
             ToolStep("run_command", {"command": f"svcctl validate {path}"}, "\n".join(checks)),
             ToolStep("read_file", {"path": path}, json.dumps(edited, indent=2)))
    return Conversation("config", seed, task, steps)


def _log_conversation(rng: random.Random, seed: int, size: int) -> Conversation:
    from infer.data.workloads import stdlib_functions

    error = rng.choice(_ERRORS)
    function = stdlib_functions(seed % 64 + 1)[seed % 64]
    name = function.split("(", 1)[0].removeprefix("def ")
    module = f"payments/{name.strip('_')}.py"
    times = _clock(rng, 7, max(3, 2 * size))
    lines = []
    for i, t in enumerate(times):
        if i % 3 == 2:
            lines.append(f"{t} INFO payments: charge ch_{rng.randint(10 ** 5, 10 ** 6)} succeeded "
                         f"({rng.randint(5, 300)}.{rng.randint(0, 99):02d} EUR)")
        else:
            lines.append(f"{t} ERROR payments: charge ch_{rng.randint(10 ** 5, 10 ** 6)} failed: {error} "
                         f"(in {name}, {module}:{rng.randint(10, 90)})")
    errors = [line for line in lines if " ERROR " in line]
    test = f"tests/test_{name.strip('_')}.py"
    failing = (f"============================= test session starts ==============================\n"
               f"collected {size + 2} items\n\n{test} " + "." * size + "F.\n\n"
               f"=================================== FAILURES ===================================\n"
               f"_____________________________ test_{name.strip('_')}_refund _____________________________\n"
               f"    def test_{name.strip('_')}_refund():\n>       assert {name}(...) is not None\n"
               f"E       AssertionError: {error}\n\n{test}:{rng.randint(10, 60)}: AssertionError\n"
               f"=========================== short test summary info ============================\n"
               f"FAILED {test}::test_{name.strip('_')}_refund - AssertionError: {error}\n"
               f"========================= 1 failed, {size + 1} passed in 0.{rng.randint(10, 99)}s =========================")
    task = (f"Payments have been failing since 7 am with errors like '{error}'. Find where they come from, "
            f"fix the code, and check that the errors stop.\nPlan:\n1. Search the payments log for errors.\n"
            f"2. Read the file the errors point to.\n3. Run its tests.\n4. Search the log again.")
    later = [line for line in lines if " INFO " in line][: max(1, size // 2)]
    steps = (ToolStep("search_logs", {"service": "payments", "level": "ERROR"}, "\n".join(errors)),
             ToolStep("read_file", {"path": module}, function),
             ToolStep("run_command", {"command": f"python -m pytest -q {test}"}, failing),
             ToolStep("search_logs", {"service": "payments", "level": "INFO"}, "\n".join(later)))
    return Conversation("log", seed, task, steps)


def _orders_conversation(rng: random.Random, seed: int, size: int) -> Conversation:
    customer = rng.choice(_PEOPLE)
    cid = rng.randint(1000, 9999)
    orders: list[dict[str, Any]] = []
    for _ in range(max(1, size // 2)):
        items: list[dict[str, Any]] = [{"product": p, "unit_price": price, "quantity": rng.randint(1, 3)}
                                       for p, price in rng.sample(_PRODUCTS, rng.randint(1, 3))]
        orders.append({"id": f"ord_{rng.randint(10 ** 5, 10 ** 6)}", "status": rng.choice(("delivered", "shipped")),
                       "placed": f"2027-02-{rng.randint(1, 28):02d}", "items": items,
                       "total": round(sum(i["unit_price"] * i["quantity"] for i in items), 2)})
    order = orders[0]
    order["status"] = "delivered"
    damaged = order["items"][0]
    refund_amount = round(damaged["unit_price"] * damaged["quantity"], 2)
    rid = f"re_{rng.randint(10 ** 5, 10 ** 6)}"
    email = customer.lower().replace(" ", ".") + "@example.com"
    tracking = f"TRK{rng.randint(10 ** 7, 10 ** 8)}"
    detail = {**order, "customer": {"id": cid, "name": customer, "email": email},
              "shipping": {"carrier": rng.choice(("DHL", "UPS", "PostNL")), "tracking": tracking,
                           "delivered": f"2027-03-{rng.randint(1, 9):02d}"}}
    refund: dict[str, Any] = {"id": rid, "order": order["id"], "amount": refund_amount, "currency": "EUR", "status": "pending",
              "items": [{"product": damaged["product"], "quantity": damaged["quantity"]}], "reason": "damaged"}
    done = {**refund, "status": "succeeded", "settled": "2027-03-12", "method": "original card"}
    task = (f"{customer} (customer {cid}) writes that the {damaged['product']} in their last delivered order arrived "
            f"broken. Refund the broken item and tell them what happens next.\nPlan:\n1. List the customer's orders.\n"
            f"2. Read the delivered order.\n3. Refund the broken item.\n4. Check the refund's status.")
    body = {"items": refund["items"], "reason": "damaged"}
    steps = (ToolStep("http_request", {"method": "GET", "url": f"/api/customers/{cid}/orders"},
                      json.dumps({"customer": cid, "orders": orders}, indent=2)),
             ToolStep("http_request", {"method": "GET", "url": f"/api/orders/{order['id']}"},
                      json.dumps(detail, indent=2)),
             ToolStep("http_request", {"method": "POST", "url": f"/api/orders/{order['id']}/refunds", "body": body},
                      json.dumps(refund, indent=2)),
             ToolStep("http_request", {"method": "GET", "url": f"/api/refunds/{rid}"}, json.dumps(done, indent=2)))
    return Conversation("orders", seed, task, steps)


def _code_conversation(rng: random.Random, seed: int, size: int) -> Conversation:
    from infer.data.workloads import stdlib_functions

    function = stdlib_functions(seed % 64 + 33)[seed % 64 + 32]
    name = function.split("(", 1)[0].removeprefix("def ")
    path = f"src/tools/{name.strip('_')}.py"
    test = f"tests/test_{name.strip('_')}.py"
    passing = f"{test} " + "." * (size + 1) + f"\n{size + 1} passed in 0.{rng.randint(10, 99)}s"
    documented = function.replace(":\n", f':\n    """{name.strip("_").replace("_", " ").capitalize()}."""\n', 1)
    diff = [f"--- a/{path}", f"+++ b/{path}", f"@@ -1,{function.count(chr(10))} +1,{documented.count(chr(10))} @@"]
    old, new = function.splitlines(), documented.splitlines()
    diff += [f" {old[0]}", f"+{new[1]}"] + [f" {line}" for line in old[1:]]
    task = (f"Add a one-line docstring to `{name}` in {path}, change nothing else, and make sure its tests still "
            f"pass.\nPlan:\n1. Read {path}.\n2. Run its tests.\n3. Show the change as a diff.\n"
            f"4. Run the tests again.")
    steps = (ToolStep("read_file", {"path": path}, function),
             ToolStep("run_command", {"command": f"python -m pytest -q {test}"}, passing),
             ToolStep("run_command", {"command": f"git diff {path}"}, "\n".join(diff)),
             ToolStep("run_command", {"command": f"python -m pytest -q {test}"}, passing))
    return Conversation("code", seed, task, steps)


SCENARIOS: dict[str, Callable[[random.Random, int, int], Conversation]] = {
    "config": _config_conversation, "log": _log_conversation, "orders": _orders_conversation,
    "code": _code_conversation}


def make_conversation(seed: int, size: int = 8, scenarios: tuple[str, ...] = tuple(SCENARIOS)) -> Conversation:
    """The conversation of ``seed``: scenario ``seed % len(scenarios)``, its artifacts from the seed
    (``size``: about how many lines, keys or records each holds)."""
    scenario = scenarios[seed % len(scenarios)]
    return SCENARIOS[scenario](random.Random(f"{scenario}-{seed}"), seed, size)


# -- the conversation as each API carries it --------------------------------------------------------
def chat_body(conv: Conversation, answers: list[str], turn: int) -> dict[str, Any]:
    """Turn ``turn``'s /v1/chat/completions body (``answers``: the model's answers to the turns before)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": conv.task}]
    for k in range(turn + 1):
        call = {"id": conv.call_id(k), "type": "function",
                "function": {"name": conv.steps[k].name, "arguments": conv.arguments(k)}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": conv.call_id(k), "content": conv.steps[k].result}]
        if k < turn:
            messages.append({"role": "assistant", "content": answers[k]})
    return {"messages": messages, "tools": TOOLS, "tool_choice": "none"}


def _call_items(conv: Conversation, turn: int) -> list[dict[str, Any]]:
    return [{"type": "function_call", "call_id": conv.call_id(turn), "name": conv.steps[turn].name,
             "arguments": conv.arguments(turn)},
            {"type": "function_call_output", "call_id": conv.call_id(turn), "output": conv.steps[turn].result}]


def _response_tools() -> list[dict[str, Any]]:
    return [{"type": "function", **tool["function"]} for tool in TOOLS]


def responses_body(conv: Conversation, answers: list[str], turn: int, previous_id: str | None = None) -> dict[str, Any]:
    """Turn ``turn``'s /v1/responses body. With ``previous_id`` (the stored response of the turn
    before) it continues that response with this turn's call and its output; without, the input is
    the whole conversation (``answers``: the model's answers to the turns before), stored only on
    the first turn, for the next turn to continue."""
    body: dict[str, Any] = {"instructions": INSTRUCTIONS, "tools": _response_tools(), "tool_choice": "none"}
    if previous_id is not None:
        return {**body, "previous_response_id": previous_id, "input": _call_items(conv, turn)}
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": conv.task}]
    for k in range(turn + 1):
        items += _call_items(conv, k)
        if k < turn:
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": answers[k]}]})
    return {**body, "input": items, "store": turn == 0}


@dataclass
class Turn:
    text: str
    tokens: int
    seconds: float
    finish: str | None
    accepted: int = 0  # drafted tokens accepted, and target verification passes (0 without speculation)
    rounds: int = 0
    prompt_tokens: int = 0  # the turn's prompt, and how much of it the prefix cache held
    cached_tokens: int = 0


def _post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"POST {url}: HTTP {err.code}: {err.read()[:400]!r}") from None


def run_conversation(url: str, model: str, conv: Conversation, api: str, turns: int, max_tokens: int) -> list[Turn]:
    """The loop through one server: ``turns`` answers, each fed back into the next turn."""
    out: list[Turn] = []
    previous: str | None = None
    for turn in range(turns):
        answers = [t.text for t in out]
        if api == "chat":
            body = {**chat_body(conv, answers, turn), "max_tokens": max_tokens}
            endpoint = "chat/completions"
        else:
            body = {**responses_body(conv, answers, turn, previous if api == "responses" else None),
                    "max_output_tokens": max_tokens}
            if api == "responses-input":
                body["store"] = False
            endpoint = "responses"
        body |= {"model": model, "temperature": 0.0, "stream": False}
        start = time.perf_counter()
        answer = _post(f"{url}/v1/{endpoint}", body)
        seconds = time.perf_counter() - start
        spec = answer.get("speculative") or {}
        if api == "chat":
            choice = answer["choices"][0]
            text, tokens, finish = choice["message"].get("content") or "", answer["usage"]["completion_tokens"], \
                choice["finish_reason"]
            prompt, cached = answer["usage"]["prompt_tokens"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        else:
            if answer.get("error"):
                raise RuntimeError(f"response {answer['id']} failed: {answer['error']}")
            text = "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                           for part in item["content"])
            tokens, finish = answer["usage"]["output_tokens"], answer["status"]
            prompt, cached = answer["usage"]["input_tokens"], answer["usage"]["input_tokens_details"]["cached_tokens"]
            previous = answer["id"]
        out.append(Turn(text, tokens, seconds, finish, spec.get("accepted_tokens", 0), spec.get("num_rounds", 0),
                        prompt, cached))
    return out


# -- the benchmark ---------------------------------------------------------------------------------
def _seed(args: argparse.Namespace, rep: int, api_index: int, conv: int) -> int:
    """Every (repeat, API, conversation) its own seed: no server meets a measured conversation twice."""
    return args.seed + (rep * len(args.api) + api_index) * args.conversations + conv


def _modes(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    base = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--quantization",
            args.quantization, "--backend", args.backend, "--max-batch-size", "1"]
    modes = [("plain", base)]
    for name in args.speculator:
        flags = ["--speculator", name] + ([] if args.spec_length is None else ["--spec-length", str(args.spec_length)])
        modes.append((name, base + flags))
    return modes


class _Server:
    """A launched ``infer serve``; ``ready`` waits for it (the servers load side by side)."""

    def __init__(self, label: str, serve_args: list[str], stack: contextlib.ExitStack, env: dict[str, str]) -> None:
        from infer.bench.llama_server import start_infer_serve

        self.label = label
        self.serve_args = serve_args
        self.proc, self.url = start_infer_serve(serve_args, stack, env)
        self.model = ""
        _say(f"started infer serve ({label}) on {self.url}")

    def ready(self) -> _Server:
        from infer.bench.llama_server import wait_healthy

        wait_healthy(self.url, self.proc, 600.0, f"infer serve ({self.label})")
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as response:
            self.model = json.loads(response.read())["data"][0]["id"]
        return self


def _say(message: str) -> None:
    print(f"[bench agent] {message}", file=sys.stderr, flush=True)


def run_agent_bench(args: argparse.Namespace) -> dict[str, Any]:
    from infer.bench.generation import environment

    scenarios = tuple(args.scenarios)
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    modes = _modes(args)
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = [server.ready() for server in [_Server(label, flags, stack, env) for label, flags in modes]]
        # A warm-up conversation per server and API (seeds apart from the measured ones): first passes,
        # the template, the prefix cache's first entries.
        for api_index, api in enumerate(args.api):
            warm = make_conversation(10 ** 6 + api_index, args.size, scenarios)
            for server in servers:
                run_conversation(server.url, server.model, warm, api, 1, min(16, args.max_tokens))
        turn = 0
        for rep in range(args.repeats):
            for api_index, api in enumerate(args.api):
                for index in range(args.conversations):
                    conv = make_conversation(_seed(args, rep, api_index, index), args.size, scenarios)
                    shift = turn % len(servers)
                    turn += 1
                    for server in servers[shift:] + servers[:shift]:
                        done = run_conversation(server.url, server.model, conv, api, args.turns, args.max_tokens)
                        tokens, seconds = sum(t.tokens for t in done), sum(t.seconds for t in done)
                        _say(f"repeat {rep + 1} {api} {conv.scenario} (seed {conv.seed}) {server.label}: "
                             f"{tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tok/s")
                        runs.append({"repeat": rep, "api": api, "conversation": index, "seed": conv.seed,
                                     "scenario": conv.scenario, "mode": server.label,
                                     "turns": [vars(t) for t in done]})
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    report = {"settings": settings, "modes": {label: flags for label, flags in modes},
              "environment": environment(args.device) | {"threads": args.threads}, "runs": runs}
    report["summary"] = summarize(runs, [label for label, _ in modes], list(args.api))
    return report


def summarize(runs: list[dict[str, Any]], modes: list[str], apis: list[str]) -> dict[str, Any]:
    """Per API and mode: tokens/s of every repeat (its conversations' tokens over their time), the
    median, the median of per-repeat ratios to plain, tokens per target pass, and the answers that
    differ from plain's."""
    out: dict[str, Any] = {}
    for api in apis:
        mine = [r for r in runs if r["api"] == api]
        plain = {(r["repeat"], r["conversation"]): r for r in mine if r["mode"] == modes[0]}
        repeats = sorted({r["repeat"] for r in mine})
        rows: dict[str, Any] = {}
        base_rates: list[float] = []
        for mode in modes:
            rates, mismatches, turns, tokens, accepted, rounds, prompt, cached = [], [], 0, 0, 0, 0, 0, 0
            for rep in repeats:
                in_rep = [r for r in mine if r["mode"] == mode and r["repeat"] == rep]
                rep_tokens = sum(t["tokens"] for r in in_rep for t in r["turns"])
                rep_seconds = sum(t["seconds"] for r in in_rep for t in r["turns"])
                rates.append(rep_tokens / rep_seconds if rep_seconds else 0.0)
                for r in in_rep:
                    reference = plain[(r["repeat"], r["conversation"])]
                    for k, (t, p) in enumerate(zip(r["turns"], reference["turns"], strict=True)):
                        turns += 1
                        tokens += t["tokens"]
                        accepted += t["accepted"]
                        rounds += t["rounds"]
                        prompt += t.get("prompt_tokens", 0)
                        cached += t.get("cached_tokens", 0)
                        if t["text"] != p["text"]:
                            at = next((i for i, (a, b) in enumerate(zip(t["text"], p["text"], strict=False))
                                       if a != b),
                                      min(len(t["text"]), len(p["text"])))
                            mismatches.append({"repeat": rep, "seed": r["seed"], "turn": k, "first_difference": at,
                                               "text": t["text"], "plain": p["text"]})
            if mode == modes[0]:
                base_rates = rates
            rows[mode] = {
                "tok_s": statistics.median(rates), "repeat_tok_s": rates,
                "vs_plain": statistics.median(a / b for a, b in zip(rates, base_rates, strict=True) if b),
                "tokens": tokens, "turns": turns, "tokens_per_pass": (accepted + rounds) / rounds if rounds else None,
                "prompt_tokens": prompt, "cached_share": cached / prompt if prompt else None,
                "identical_to_plain": not mismatches, "mismatches": mismatches}
        out[api] = rows
    return out


def agent_table(report: dict[str, Any]) -> str:
    s, env = report["settings"], report["environment"]
    identical = all(row["identical_to_plain"] for rows in report["summary"].values() for row in rows.values())
    head = (f"`{s['model']}`, agent loops through `infer serve`: {s['conversations']} conversations × {s['repeats']} "
            f"repeats per API ({', '.join(s['scenarios'])}), {s['turns']} turns each, up to {s['max_tokens']} new "
            f"tokens a turn, greedy, {s['dtype']} on {env.get('cpu')} ({s['threads'] or 'default'} threads); tok/s = "
            f"completion tokens over the requests' wall time (prefill included), per repeat, median; × plain = median "
            f"of per-repeat ratios. Greedy text identical to plain in every mode: "
            f"{'yes' if identical else 'NO (see mismatches in the JSON)'}")
    rows = ["| API | mode | tok/s | × plain | tokens per target pass | turns | tokens | prompt tokens cached | text = plain |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for api, modes in report["summary"].items():
        for mode, row in modes.items():
            per_pass = "–" if row["tokens_per_pass"] is None else f"{row['tokens_per_pass']:.2f}"
            same = "yes" if row["identical_to_plain"] else f"NO: {len(row['mismatches'])} turns differ"
            share = row.get("cached_share")
            cached = "–" if share is None else f"{share:.0%} of {row['prompt_tokens']}"
            rows.append(f"| {api} | {mode} | {row['tok_s']:.1f} | {row['vs_plain']:.2f}× | {per_pass} | {row['turns']} "
                        f"| {row['tokens']} | {cached} | {same} |")
    return head + "\n\n" + "\n".join(rows) + "\n"


def add_agent_parser(kinds: Any) -> None:
    from infer.engine.options import add_engine_args

    p = kinds.add_parser("agent", help="agent loops (tool calls, their results fed back, answers quoting them) "
                                       "through infer serve: plain against each speculator, chat and Responses API")
    add_engine_args(p, ("model", "dtype", "device", "quantization", "backend"))
    p.set_defaults(dtype="float32", device="cpu")
    p.add_argument("--speculator", nargs="*", default=["ngram", "suffix"], choices=SPECULATORS,
                   help="a server with each of these drafters at its default policy, against plain")
    p.add_argument("--spec-length", type=int, default=None, help="pass --spec-length K to every speculator's server")
    p.add_argument("--api", nargs="+", default=["chat", "responses"], choices=APIS,
                   help="chat: /v1/chat/completions with tool messages; responses: /v1/responses with "
                        "previous_response_id; responses-input: /v1/responses with the whole input list")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS),
                   help="the conversations' kinds, taken in turn")
    p.add_argument("--conversations", type=int, default=4, help="conversations per API and repeat")
    p.add_argument("--turns", type=int, default=4, choices=range(1, 5), metavar="{1..4}",
                   help="tool calls (and answers) per conversation")
    p.add_argument("--size", type=int, default=8, help="about how many lines, keys or records a tool result holds")
    p.add_argument("--repeats", type=int, default=3, help="new conversations each repeat, modes interleaved")
    p.add_argument("--max-tokens", type=int, default=128, help="longest answer per turn")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every launched server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="folder for agent.json and agent.md")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.conversations < 1 or args.repeats < 1 or args.size < 1:
        raise ValueError("--conversations, --repeats and --size must be >= 1")
    # A SIGTERM unwinds as an exit does, so the launched servers are stopped, not left running.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        report = run_agent_bench(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    paths = write_json_and_table(report, agent_table(report), args.out, "agent")
    print(agent_table(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    identical = all(row["identical_to_plain"] for rows in report["summary"].values() for row in rows.values())
    if not identical:
        print("error: a speculative mode's greedy text differs from plain's (the mismatches are in agent.json)",
              file=sys.stderr)
    return 0 if identical else 1
