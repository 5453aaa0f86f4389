"""Long-prompt prefill: prompt tokens/s by prompt length, and a short request's time to its first
token behind a long prompt through ``infer serve``.

``offline``: every repeat starts a fresh process per source tree (this one, and ``--compare-src``'s
for a before/after run), which loads the model, warms up, then times ``LLM.generate`` of one prompt
with ``max_tokens=1`` at each length (prompt tokens / wall seconds; a fresh random prompt every
time, so no prefix cache helps). The trees run one at a time, in an order that rotates per repeat.

``ttft``: per repeat and tree, starts ``infer serve`` on loopback, sends a streamed chat request
whose prompt has ``--long`` tokens, ``--delay`` seconds later a short streamed greedy request, and
reads each one's time to its first streamed token (and the long one's end). ``--no-chunked-prefill``
serves with chunked prefill off. ``--busy N`` keeps N processes spinning in a loop during the timed
part (the loaded machine the issue met).

    PYTHONPATH=src python -m infer.bench.prefill offline [--lengths 512 2048 4096 6144] [--repeats 3]
        [--compare-src /tmp/wt-base/src] [--busy 0] [--json prefill.json]
    PYTHONPATH=src python -m infer.bench.prefill ttft [--long 6144] [--delay 1] [--repeats 3]
        [--no-chunked-prefill] [--compare-src ...] [--busy 1] [--json ttft.json]

Both print a table and write JSON (``--json``) with every run's figures and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from infer.bench.llama_server import free_port, wait_healthy
from infer.bench.report import write_json

MODEL = "smollm2-135m-instruct"


def _prompt_ids(length: int, seed: int, vocab: int) -> list[int]:
    """A prompt of ``length`` random ordinary token ids of a ``vocab``-token vocabulary (past the
    first ids, where special tokens sit; speed does not depend on the text; a fresh one per run
    keeps the prefix cache out of it)."""
    rng = random.Random(seed)
    return [rng.randrange(min(200, vocab // 2), min(40000, vocab)) for _ in range(length)]


def _offline_worker(model: str, lengths: list[int], seed: int, budget: int | None) -> None:
    from infer import LLM, SamplingParams

    options: dict[str, Any] = {} if budget is None else {"max_prefill_tokens": budget}
    llm = LLM(model, max_seq_len=max(lengths) + 16, **({"prefix_caching": False} | options))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    vocab = llm.engine.model_config.vocab_size
    # warm-up: first passes pay one-time costs
    llm.generate([_prompt_ids(min(256, max(lengths)), seed + 999, vocab)], params)
    out: dict[str, Any] = {"rate": {}, "cpu_rate": {}, "first_token": {}}
    for length in lengths:
        ids = _prompt_ids(length, seed * 1000 + length, vocab)
        start, cpu = time.perf_counter(), time.process_time()
        result = llm.generate([ids], params)[0]
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        out["rate"][str(length)] = length / seconds
        # per CPU second of this process (all its threads): what the work costs, less sensitive to
        # other processes taking the cores than the wall-clock rate
        out["cpu_rate"][str(length)] = length / cpu
        out["first_token"][str(length)] = result.token_ids[:1]
    print(json.dumps(out), flush=True)


def _run_script(src: str | None, argv: list[str]) -> Any:
    """This file run as a script by ``src``'s infer (the other tree may lack this module); its last
    JSON line."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    code = f"import runpy, sys; sys.argv = {[__file__, *argv]!r}; runpy.run_path({__file__!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def _commit(src: str | None) -> str | None:
    here = src or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _spinners(busy: int) -> list[subprocess.Popen[Any]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]


def _stop(processes: list[subprocess.Popen[Any]]) -> None:
    for process in processes:
        process.kill()
        process.wait()


def _trees(compare_src: str | None) -> list[tuple[str, str | None]]:
    return [("this", None)] + ([("other", compare_src)] if compare_src else [])


def offline(model: str, lengths: list[int], repeats: int, busy: int, compare_src: str | None,
            budget: int | None = None) -> dict[str, Any]:
    trees = _trees(compare_src)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for repeat in range(repeats):
        order = trees[repeat % len(trees):] + trees[: repeat % len(trees)]
        for name, src in order:
            spinners = _spinners(busy)
            try:
                result = _run_script(src, ["--offline-worker", "--model", model, "--seed", str(repeat),
                                           "--lengths", *map(str, lengths),
                                           *([] if budget is None else ["--max-prefill-tokens", str(budget)])])
            finally:
                _stop(spinners)
            runs[name].append(result)
            print(f"repeat {repeat + 1}/{repeats} {name}: " + ", ".join(
                f"{n}: {r:.0f}" for n, r in result["rate"].items()) + " prompt tok/s", flush=True)
    medians = {name: {str(n): statistics.median(r["rate"][str(n)] for r in rs) for n in lengths}
               for name, rs in runs.items()}
    cpu_medians = {name: {str(n): statistics.median(r["cpu_rate"][str(n)] for r in rs) for n in lengths}
                   for name, rs in runs.items()}
    # the prompts differ per repeat, the trees' are the same: greedy first tokens compared repeat by repeat
    same = all(len({json.dumps(runs[name][repeat]["first_token"]) for name, _ in trees}) == 1
               for repeat in range(repeats))
    return {"kind": "offline", "model": model, "lengths": lengths, "repeats": repeats, "busy_processes": busy,
            "max_prefill_tokens": budget,
            "commits": {name: _commit(src) for name, src in trees}, "cpus": len(os.sched_getaffinity(0)),
            "loadavg_after": os.getloadavg(), "runs": runs, "median_tok_s": medians,
            "median_tok_per_cpu_s": cpu_medians,
            "first_tokens_equal_across_trees": same}


# -- time to first token through infer serve -------------------------------------------------------

def _long_text(tokens: int, model: str) -> str:
    """Chat content of about ``tokens`` tokens: held-out stdlib functions to summarise."""
    from infer.data.workloads import stdlib_functions
    from infer.loader import load_tokenizer
    from infer.loader.hub import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(model))
    functions = stdlib_functions(240)
    text, count, i = "Summarise what each of these functions does.\n\n", 0, 0
    while count < tokens:
        text += functions[i % len(functions)] + "\n"
        i += 1
        count = len(tokenizer.encode(text))
    return text


def _stream(port: int, body: dict[str, Any], result: dict[str, Any]) -> None:
    """POST a streamed chat request; record when it was sent, its first content chunk and its end."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=data,
                                     headers={"Content-Type": "application/json"})
    result["sent"] = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or [{}]
                if "first" not in result and (choices[0].get("delta") or {}).get("content"):
                    result["first"] = time.perf_counter()
    except Exception as error:  # noqa: BLE001 (recorded: the run is reported, not raised)
        result["error"] = repr(error)
    result["end"] = time.perf_counter()


def _serve(src: str | None, model: str, port: int, chunked: bool, max_seq_len: int,
           budget: int | None) -> subprocess.Popen[Any]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    # served under the name the requests give (a folder's own served name is its folder's)
    argv = [sys.executable, "-m", "infer", "serve", "--model", model, "--served-model-name", model, "--port", str(port),
            "--max-seq-len", str(max_seq_len)]
    if not chunked:
        argv.append("--no-chunked-prefill")
    if budget is not None:
        argv += ["--max-prefill-tokens", str(budget)]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, 600, "infer serve")
    except BaseException:
        _stop([process])
        raise
    return process


def _one_ttft(src: str | None, model: str, long_text: str, delay: float, chunked: bool, busy: int,
              max_seq_len: int, budget: int | None) -> dict[str, Any]:
    port = free_port()
    server = _serve(src, model, port, chunked, max_seq_len, budget)
    spinners: list[subprocess.Popen[Any]] = []
    try:
        short_body = {"model": model, "messages": [{"role": "user", "content": "Name three primary colours."}],
                      "max_tokens": 16, "temperature": 0}
        warm: dict[str, Any] = {}
        _stream(port, short_body, warm)  # warm-up: the first passes pay one-time costs
        alone: dict[str, Any] = {}
        _stream(port, short_body, alone)
        spinners = _spinners(busy)
        long_body = {"model": model, "messages": [{"role": "user", "content": long_text}], "max_tokens": 16,
                     "temperature": 0}
        long: dict[str, Any] = {}
        short: dict[str, Any] = {}
        first = threading.Thread(target=_stream, args=(port, long_body, long))
        first.start()
        time.sleep(delay)
        second = threading.Thread(target=_stream, args=(port, short_body, short))
        second.start()
        second.join()
        first.join()
    finally:
        _stop(spinners + [server])

    def ttft(r: dict[str, Any]) -> float | None:
        return r["first"] - r["sent"] if "first" in r else None

    return {"short_alone_ttft_s": ttft(alone), "short_behind_long_ttft_s": ttft(short), "long_ttft_s": ttft(long),
            "long_total_s": long["end"] - long["sent"], "errors": [r["error"] for r in (long, short) if "error" in r]}


def ttft(model: str, long_tokens: int, delay: float, repeats: int, chunked: bool, busy: int,
         compare_src: str | None, budget: int | None = None) -> dict[str, Any]:
    trees = _trees(compare_src)
    text = _long_text(long_tokens, model)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for repeat in range(repeats):
        for name, src in trees[repeat % len(trees):] + trees[: repeat % len(trees)]:
            result = _one_ttft(src, model, text, delay, chunked, busy, long_tokens + 512, budget)
            runs[name].append(result)
            print(f"repeat {repeat + 1}/{repeats} {name}: short behind long {result['short_behind_long_ttft_s']}, "
                  f"alone {result['short_alone_ttft_s']}, long TTFT {result['long_ttft_s']} s", flush=True)

    def median(rs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rs if r[key] is not None]
        return statistics.median(values) if values else None

    keys = ("short_behind_long_ttft_s", "short_alone_ttft_s", "long_ttft_s", "long_total_s")
    return {"kind": "ttft", "model": model, "long_tokens": long_tokens, "delay_s": delay, "repeats": repeats,
            "chunked_prefill": chunked, "max_prefill_tokens": budget, "busy_processes": busy, "commits": {n: _commit(s) for n, s in trees},
            "cpus": len(os.sched_getaffinity(0)), "loadavg_after": os.getloadavg(), "runs": runs,
            "medians": {name: {k: median(rs, k) for k in keys} for name, rs in runs.items()}}


def _table(result: dict[str, Any]) -> str:
    if result["kind"] == "offline":
        lines = ["| tree | " + " | ".join(f"{n}: tok/s (per CPU s)" for n in result["lengths"]) + " |",
                 "|---|" + "---:|" * len(result["lengths"])]
        for name, medians in result["median_tok_s"].items():
            cpu = result["median_tok_per_cpu_s"][name]
            lines.append(f"| {name} ({result['commits'][name]}) | "
                         + " | ".join(f"{medians[str(n)]:.0f} ({cpu[str(n)]:.0f})" for n in result["lengths"]) + " |")
        return "\n".join(lines)
    lines = ["| tree | short behind long: TTFT s | short alone | long: TTFT s | long: total s |",
             "|---|---:|---:|---:|---:|"]
    for name, m in result["medians"].items():
        cells = [f"{m[k]:.2f}" if m[k] is not None else "-" for k in
                 ("short_behind_long_ttft_s", "short_alone_ttft_s", "long_ttft_s", "long_total_s")]
        lines.append(f"| {name} ({result['commits'][name]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", nargs="?", choices=["offline", "ttft"], default="offline")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 6144])
    parser.add_argument("--long", type=int, default=6144, help="ttft: the long prompt's tokens")
    parser.add_argument("--delay", type=float, default=1.0, help="ttft: seconds between the long and the short request")
    parser.add_argument("--no-chunked-prefill", action="store_true", help="ttft: serve with chunked prefill off")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="the engine's chunked-prefill budget (default: the engine's own)")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning in a loop during the timed part")
    parser.add_argument("--compare-src", default=None, help="another checkout's src folder, run interleaved")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.offline_worker:
        _offline_worker(args.model, args.lengths, args.seed, args.max_prefill_tokens)
        return
    if args.kind == "offline":
        result = offline(args.model, args.lengths, args.repeats, args.busy, args.compare_src, args.max_prefill_tokens)
    else:
        result = ttft(args.model, args.long, args.delay, args.repeats, not args.no_chunked_prefill, args.busy,
                      args.compare_src, args.max_prefill_tokens)
    print(f"{result['cpus']} CPUs, {args.busy} busy process(es), load average after {result['loadavg_after']}; "
          f"medians of {args.repeats}")
    print(_table(result))
    if args.json:
        write_json(args.json, result, indent=1)


if __name__ == "__main__":
    main()
