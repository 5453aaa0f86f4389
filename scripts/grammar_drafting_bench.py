"""Grammar drafting through `infer serve` (issue 52, item 2): schema-constrained answers, plain against drafted.

Launches one `infer serve` per mode (each idle while another is measured; OMP_NUM_THREADS=--threads)
and sends the shipped structured-output requests (``infer.data.prompt_sets``: extractions into a JSON
Schema of several keys, through ``response_format``; forced tool calls, through ``tools`` and a
named ``tool_choice``), one at a time, greedy, not streamed, modes taking turns per prompt in an
order that rotates per repeat. Prints, per kind and mode, the median tokens/s over every request
and the median of per-request ratios to the plain mode, and checks that every mode's answer is
plain's. Modes: plain (--no-grammar-drafting), grammar (the default, no speculator), and each of
--speculator with and without grammar drafting.

    python scripts/grammar_drafting_bench.py --repeats 3 --speculator ngram
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from infer.bench.llama_server import free_port, wait_healthy
from infer.data.prompt_sets import SCHEMA_EXTRACTION, TOOL_CALLS


def requests_of_kind() -> dict[str, list[dict[str, Any]]]:
    extraction = [{"messages": [{"role": "user", "content": text}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "extraction", "schema": schema}}}
                  for text, schema in SCHEMA_EXTRACTION]
    tools = [{"messages": [{"role": "user", "content": text}], "tools": fns,
              "tool_choice": {"type": "function", "function": {"name": name}}} for text, fns, name in TOOL_CALLS]
    return {"extraction": extraction, "tool call": tools}


def answer(body: dict[str, Any]) -> str:
    message = body["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    return str(message.get("content")) + "|" + "|".join(c["function"]["name"] + c["function"]["arguments"]
                                                         for c in calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--speculator", nargs="*", default=["ngram"], help="speculators to add (with and without "
                        "grammar drafting)")
    args = parser.parse_args()
    modes: dict[str, list[str]] = {"plain": ["--no-grammar-drafting"], "grammar": []}
    for name in args.speculator:
        modes[f"{name}"] = ["--speculator", name, "--no-grammar-drafting"]
        modes[f"{name} + grammar"] = ["--speculator", name]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    kinds = requests_of_kind()
    rates: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    decodes: dict[tuple[str, str], list[float]] = {}  # from the first streamed token on (no prefill)
    decode_ratios: dict[tuple[str, str], list[float]] = {}
    with contextlib.ExitStack() as stack:
        urls = {}
        for label, flags in modes.items():
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "infer.cli", "serve", "--model", args.model, "--max-batch-size",
                                     "1", *flags, "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            stack.callback(proc.wait)
            stack.callback(proc.terminate)
            urls[label] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[label], proc, 600, f"infer serve ({label})")
        client = stack.enter_context(httpx.Client(timeout=600))
        order = list(modes)

        def send(label: str, body: dict[str, Any]) -> tuple[float, float | None, str]:
            """(tokens/s over the request, tokens/s from its first streamed token to its last, the answer)."""
            full = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, **body}
            start = time.perf_counter()
            first = last = None
            tokens, pieces = 0, []
            with client.stream("POST", f"{urls[label]}/v1/chat/completions", json=full) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
                    text = (delta.get("content") or "") + "".join(
                        (c.get("function", {}).get("name") or "") + (c.get("function", {}).get("arguments") or "")
                        for c in delta.get("tool_calls") or [])
                    if not text:
                        continue
                    pieces.append(text)
                    last = time.perf_counter()
                    first = first or last
            elapsed = time.perf_counter() - start
            decode = (tokens - 1) / (last - first) if first is not None and last is not None and last > first else None
            return tokens / elapsed, decode, "".join(pieces)

        for body in (b for bodies in kinds.values() for b in bodies[:1]):  # warm-up: each server's first grammars
            for label in order:
                send(label, body)
        for rep in range(args.repeats):
            turn = order[rep % len(order):] + order[: rep % len(order)]
            for kind, bodies in kinds.items():
                for body in bodies:
                    got = {label: send(label, body) for label in turn}
                    for label, (rate, decode, text) in got.items():
                        if text != got["plain"][2]:
                            print(f"DIFFERENT ({label}, {kind}): {text!r} against plain {got['plain'][2]!r}")
                        rates.setdefault((kind, label), []).append(rate)
                        ratios.setdefault((kind, label), []).append(rate / got["plain"][0])
                        plain_decode = got["plain"][1]
                        if decode is not None and plain_decode is not None:
                            decodes.setdefault((kind, label), []).append(decode)
                            decode_ratios.setdefault((kind, label), []).append(decode / plain_decode)
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    requests = {kind: len(bodies) * args.repeats for kind, bodies in kinds.items()}
    print(f"{args.model}, {args.threads} threads, greedy, max_tokens {args.max_tokens}, {args.repeats} repeats")
    print("tok/s: completion tokens over the request's wall time; decode: from its first streamed token to its "
          "last; x plain: median of per-request ratios")
    print(f"{'kind':<12} {'mode':<18} {'tok/s':>7} {'x plain':>8} {'decode':>7} {'x plain':>8}  requests")
    for kind in kinds:
        for label in modes:
            decode = (f"{statistics.median(decodes[kind, label]):7.1f} {statistics.median(decode_ratios[kind, label]):8.2f}"
                      if decodes.get((kind, label)) else f"{'-':>7} {'-':>8}")
            print(f"{kind:<12} {label:<18} {statistics.median(rates[kind, label]):7.1f} "
                  f"{statistics.median(ratios[kind, label]):8.2f} {decode}  {requests[kind]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
