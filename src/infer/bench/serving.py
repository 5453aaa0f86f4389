"""``infer bench serving``: an async OpenAI-API load generator with a concurrency sweep.

Either measures one running server (``--server URL``) or launches ``infer serve`` itself for
speculation off / fixed / goodput (``--model T --draft-model D``) and any model-free drafters
(``--speculator ngram suffix``) and compares them; with ``--replicas 0 1 2`` each of those runs as
one process (0) and on Ray Serve with 1 and 2 replicas, which share the machine's CPUs. Reports
throughput, time to first token and inter-token latency percentiles per concurrency level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONCURRENCY = [1, 2, 4, 8, 16, 32]


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    throughput_tok_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)  # gaps between streamed chunks
    tpot_ms: dict[str, float] = field(default_factory=dict)  # per request: (last - first token time) / (tokens - 1)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(ordered) * 1e3}


async def _one_request(client: Any, url: str, model: str, prompt: str, max_tokens: int, temperature: float,
                       ttfts: list[float], itls: list[float], tpots: list[float], chat: bool = False) -> int:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    endpoint = "chat/completions" if chat else "completions"
    start = time.perf_counter()
    last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            if not (choice.get("delta", {}).get("content") if chat else choice.get("text")):
                continue
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - start)
            else:
                itls.append(now - last)
            last = now
    if ttfts and last is not None and tokens > 1:
        first = start + ttfts[-1]
        tpots.append((last - first) / (tokens - 1))
    return tokens


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, num_requests: int, max_tokens: int,
                    temperature: float, poisson_rate: float | None, seed: int, chat: bool = False,
                    first_prompt: int = 0) -> LevelResult:
    """``num_requests`` requests, at most ``concurrency`` at a time; request i sends prompt
    ``first_prompt + i`` (cycling through ``prompts``)."""
    import httpx

    rng = random.Random(seed)
    ttfts: list[float] = []
    itls: list[float] = []
    tpots: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    errors = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def worker(i: int) -> int:
            nonlocal errors
            async with gate:
                try:
                    return await _one_request(client, url, model, prompts[(first_prompt + i) % len(prompts)],
                                              max_tokens, temperature, ttfts, itls, tpots, chat)
                except Exception as err:  # a failed request is counted, not fatal to the sweep
                    errors += 1
                    print(f"[bench] request failed: {err}", file=sys.stderr)
                    return 0

        start = time.perf_counter()
        tasks = []
        for i in range(num_requests):
            tasks.append(asyncio.create_task(worker(i)))
            if poisson_rate:
                await asyncio.sleep(rng.expovariate(poisson_rate))
        counts = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    total = sum(counts)
    return LevelResult(concurrency, num_requests, errors, wall, total, total / wall, percentiles(ttfts),
                       percentiles(itls), percentiles(tpots))


def _replicas_label(replicas: int) -> str:
    return "one process" if replicas == 0 else f"{replicas} Ray Serve replica{'s' if replicas > 1 else ''}"


def _replica_flags(replicas: int, cpus: float | None) -> list[str]:
    """``infer serve`` flags for ``replicas`` (0: one process, no Ray); by default the replicas split the CPUs."""
    if replicas == 0:
        return []
    cpus = cpus if cpus is not None else max(1, (os.cpu_count() or 1) // replicas)
    return ["--replicas", str(replicas), "--replica-cpus", f"{cpus:g}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"infer serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} not ready after {timeout:.0f}s")


def run_serving_bench(args: argparse.Namespace) -> dict[str, Any]:
    from infer.bench.workloads import code_prompts, load_prompts, repetitive_prompts

    warmup: list[str] = []
    if args.prompts:
        prompts = load_prompts(args.prompts)
    elif args.workload == "repetitive":
        # A new function for every request, warm-up included: a drafter that learns from earlier
        # requests never sees a measured prompt twice.
        measured = sum(max(args.requests_per_level, c) for c in args.concurrency)
        prompts = repetitive_prompts(measured + args.warmup)  # measured ones first, as in bench generation
        prompts, warmup = prompts[:measured], prompts[measured:]
    else:
        prompts = code_prompts(args.num_prompts)
    configs: list[tuple[str, list[str] | None]] = []
    if args.server:
        configs.append((args.label, None))
    else:
        if not args.model:
            raise ValueError("give --server URL, or --model (and --draft-model) to launch servers")
        base = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
                "--max-batch-size", str(max(args.concurrency))]
        configs.append(("speculation off", base))
        if args.draft_model:
            configs.append(("fixed", base + ["--draft-model", args.draft_model, "--spec-length", str(args.spec_length)]))
            configs.append(("goodput", base + ["--draft-model", args.draft_model, "--spec-length",
                                               str(args.spec_length), "--spec-length-policy", "goodput"]))
        for name in args.speculator:
            configs.append((f"{name} K={args.spec_length}",
                            base + ["--speculator", name, "--spec-length", str(args.spec_length)]))
        if args.replicas:
            configs = [(f"{label}, {_replicas_label(n)}", serve_args + _replica_flags(n, args.replica_cpus))
                       for label, serve_args in configs if serve_args is not None for n in args.replicas]
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "runs": []}
    for label, serve_args in configs:
        proc = None
        url = args.server
        if serve_args is not None:
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            print(f"[bench] starting infer serve ({label}) on {url}", file=sys.stderr, flush=True)
            proc = subprocess.Popen([sys.executable, "-m", "infer.cli", "serve", *serve_args, "--port", str(port)],
                                    stdout=subprocess.DEVNULL, env=os.environ.copy())
        try:
            if proc is not None:
                _wait_ready(url, proc)
            import httpx

            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            if warmup:
                print(f"[bench] {label}: {len(warmup)} warm-up requests", file=sys.stderr, flush=True)
                asyncio.run(run_level(url, model, warmup, max(args.concurrency), len(warmup), args.max_tokens,
                                      args.temperature, None, args.seed, args.chat))
            levels = []
            sent = 0
            for c in args.concurrency:
                n = max(args.requests_per_level, c)
                res = asyncio.run(run_level(url, model, prompts, c, n, args.max_tokens, args.temperature,
                                            args.poisson_rate, args.seed, args.chat, first_prompt=sent))
                sent += n
                print(f"[bench] {label} c={c}: {res.throughput_tok_s:.1f} tok/s, TTFT p50 "
                      f"{res.ttft_ms.get('p50', float('nan')):.0f} ms, TPOT p50 {res.tpot_ms.get('p50', float('nan')):.1f} ms, "
                      f"errors {res.errors}", file=sys.stderr, flush=True)
                levels.append(asdict(res))
            report["runs"].append({"label": label, "url": url, "levels": levels})
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=90)  # Ray Serve replicas stop gracefully first
    return report


def serving_table(report: dict[str, Any]) -> str:
    rows = ["| config | concurrency | tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        for lv in run["levels"]:
            t, i, o = lv["ttft_ms"], lv["itl_ms"], lv["tpot_ms"]
            rows.append(f"| {run['label']} | {lv['concurrency']} | {lv['throughput_tok_s']:.1f} | {t.get('p50', 0):.0f} | "
                        f"{t.get('p99', 0):.0f} | {o.get('p50', 0):.1f} | {o.get('p99', 0):.1f} | {i.get('p99', 0):.1f} | "
                        f"{lv['errors']} |")
    return "\n".join(rows) + "\n"


def write_serving_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "serving.json", out / "serving.md", out / "throughput_vs_concurrency.png"]
    paths[0].write_text(json.dumps(report, indent=2))
    paths[1].write_text(serving_table(report))
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in report["runs"]:
        xs = [lv["concurrency"] for lv in run["levels"]]
        ax.plot(xs, [lv["throughput_tok_s"] for lv in run["levels"]], "o-", label=run["label"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Serving throughput vs concurrency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return paths


def add_serving_parser(kinds: Any) -> None:
    p = kinds.add_parser("serving", help="OpenAI-API load generator with a concurrency sweep")
    p.add_argument("--server", default=None, help="URL of a running server (e.g. http://127.0.0.1:8000)")
    p.add_argument("--label", default="server", help="name of the --server run in the report")
    p.add_argument("--model", default=None, help="launch servers for this target (off / fixed / goodput)")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--speculator", nargs="*", default=[], choices=["ngram", "suffix"],
                   help="also launch a server with each of these drafters")
    p.add_argument("--spec-length", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--replicas", type=int, nargs="+", default=None, metavar="N",
                   help="also compare replica counts: 0 = one process, N = infer serve --replicas N on Ray Serve "
                        "(each replica gets cpu_count / N CPUs unless --replica-cpus says otherwise)")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs (and torch threads) per Ray Serve replica for --replicas N > 0")
    p.add_argument("--concurrency", type=int, nargs="+", default=CONCURRENCY)
    p.add_argument("--requests-per-level", type=int, default=16)
    p.add_argument("--poisson-rate", type=float, default=None, help="requests/s arrival rate (default: all at once)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", default=None)
    p.add_argument("--workload", default="code", choices=["code", "repetitive"],
                   help="code continuations (cycled), or one instruction over a new function per request")
    p.add_argument("--warmup", type=int, default=8, help="repetitive workload: requests sent before measuring")
    p.add_argument("--chat", action="store_true", help="send prompts as chat messages (/v1/chat/completions)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    report = run_serving_bench(args)
    paths = write_serving_report(report, args.out)
    print(serving_table(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
