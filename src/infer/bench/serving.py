"""``infer bench serving``: an async OpenAI-API load generator with a concurrency sweep.

Either measures one running server (``--server URL``) or launches ``infer serve`` itself for
speculation off / fixed / goodput (``--model T --draft-model D``) and any model-free drafters
(``--speculator ngram suffix``, each fixed and goodput) and compares them; with ``--replicas 0 1 2`` each of those runs as
one process (0) and on Ray Serve with 1 and 2 replicas, which share the machine's CPUs. Reports
throughput, time to first token and inter-token latency percentiles per concurrency level.

Launched one-process servers run side by side (each idle while another is measured) and every
concurrency level runs on each in turn, ``--level-repeats`` times in an order that rotates per
repeat: on a shared machine whose speed drifts over minutes, servers measured one after another
would compare the drift. The table adds each config's throughput over speculation off's at the
same level (median-throughput repeats). Ray Serve replicas reserve CPUs, so those run one at a time.

With ``--offline-repeats N`` each launched server is first compared with the same engine offline:
the bench process builds an engine from the same flags and, alternating with single requests
through the server (nothing else running), generates each prompt itself; the report gives both
single-stream rates (tokens over the request's whole wall time, prefill included) and their ratio;
then every concurrency level's requests also run offline on that engine after each repeat through
the server (``offline_level``), for aggregate tokens/s through the server against offline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infer.bench.llama_server import start_infer_serve, wait_healthy
from infer.bench.report import write_json_and_table
from infer.extras import pyplot

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


def _offline_engine(serve_args: list[str]) -> Any:
    """An engine built from the engine options among the same ``infer serve`` flags (its HTTP and
    scale-out flags have no offline meaning), for the offline side of the comparison."""
    from infer.engine.engine import Engine
    from infer.engine.options import MODEL_OPTIONS, SERVING_OPTIONS, add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser, MODEL_OPTIONS + SERVING_OPTIONS)
    return Engine(engine_config(parser.parse_known_args(serve_args)[0]))


async def _whole_request(url: str, model: str, prompt: str, max_tokens: int, temperature: float,
                         chat: bool) -> tuple[float, int]:
    """One request with ``stream: false``: (tokens/s over its wall time, completion tokens)."""
    import httpx

    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        response = await client.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body)
        wall = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]!r}")
    tokens = int(response.json()["usage"]["completion_tokens"])
    return tokens / wall, tokens


def _offline_prompt(engine: Any, prompt: str, chat: bool) -> str | list[int]:
    """``prompt`` as the offline engine takes it: a user message through the chat template with
    ``chat`` (as ``--chat`` sends it to the server), else the text."""
    return engine.encode_chat([{"role": "user", "content": prompt}]) if chat else prompt  # type: ignore[no-any-return]


def single_stream_vs_offline(servers: dict[str, tuple[str, str]], engine: Any, prompts: list[str], repeats: int,
                             max_tokens: int, temperature: float, seed: int, chat: bool) -> dict[str, dict[str, Any]]:
    """One request at a time through each of ``servers`` (label -> (url, model)), streamed and not, and
    the same request offline, in an order that rotates per request (one warm-up each); per server the
    medians of tokens/s per request, end to end, and their ratios to offline."""
    from infer.sampling.params import SamplingParams

    def offline(prompt: str) -> tuple[float, int]:
        start = time.perf_counter()
        request = engine.add_request(_offline_prompt(engine, prompt, chat),
                                     SamplingParams(max_tokens=max_tokens, temperature=temperature))
        engine.run_until_done()
        return len(request.output_token_ids) / (time.perf_counter() - start), len(request.output_token_ids)

    def streamed(url: str, model: str) -> Any:
        def run(prompt: str) -> tuple[float, int]:
            level = asyncio.run(run_level(url, model, [prompt], 1, 1, max_tokens, temperature, None, seed, chat))
            if level.errors:
                raise RuntimeError("a single-stream request through the server failed")
            return level.throughput_tok_s, level.output_tokens
        return run

    def whole(url: str, model: str) -> Any:
        return lambda prompt: asyncio.run(_whole_request(url, model, prompt, max_tokens, temperature, chat))

    modes: dict[tuple[str, str], Any] = {("", "offline"): offline}
    for label, (url, model) in servers.items():
        modes[(label, "streamed")] = streamed(url, model)
        modes[(label, "whole")] = whole(url, model)
    for run in modes.values():
        run(prompts[0])
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in modes}
    lengths: dict[tuple[str, str], list[int]] = {key: [] for key in modes}
    keys = list(modes)
    turn = 0
    for _rep in range(repeats):
        for prompt in prompts:
            shift = turn % len(keys)  # none always goes first, or always right after another
            turn += 1
            for key in keys[shift:] + keys[:shift]:
                rate, tokens = modes[key](prompt)
                rates[key].append(rate)
                lengths[key].append(tokens)
    off = rates[("", "offline")]
    out: dict[str, dict[str, Any]] = {}
    for label in servers:
        stream_rates, whole_rates = rates[(label, "streamed")], rates[(label, "whole")]
        server, whole_median, offline_median = (statistics.median(stream_rates), statistics.median(whole_rates),
                                                statistics.median(off))
        # Each request against its offline twin run in the same turn: less exposed to the drift.
        out[label] = {
            "server_tok_s": server, "offline_tok_s": offline_median, "ratio": server / offline_median,
            "paired_ratio": statistics.median(a / b for a, b in zip(stream_rates, off, strict=True)),
            "whole_tok_s": whole_median, "whole_ratio": whole_median / offline_median,
            "whole_paired_ratio": statistics.median(a / b for a, b in zip(whole_rates, off, strict=True)),
            "samples": len(stream_rates),
            "same_token_counts": lengths[(label, "streamed")] == lengths[("", "offline")] == lengths[(label, "whole")],
            "server_samples": stream_rates, "whole_samples": whole_rates, "offline_samples": off}
    return out


def offline_level(engine: Any, prompts: list[str], concurrency: int, num_requests: int, max_tokens: int,
                  temperature: float, chat: bool, first_prompt: int = 0) -> float:
    """``run_level``'s requests run offline on ``engine``: at most ``concurrency`` in flight, a new one
    added as one finishes (the server's closed loop, batched the same way); aggregate tokens/s."""
    from infer.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)

    start = time.perf_counter()
    running: list[Any] = []
    sent = tokens = 0
    while sent < num_requests or running:
        while sent < num_requests and len(running) < concurrency:
            running.append(engine.add_request(_offline_prompt(engine, prompts[(first_prompt + sent) % len(prompts)],
                                                              chat), params))
            sent += 1
        engine.step()
        tokens += sum(len(r.output_token_ids) for r in running if r.is_finished)
        running = [r for r in running if not r.is_finished]
    return tokens / (time.perf_counter() - start)


def _configs(args: argparse.Namespace, max_batch: int) -> list[tuple[str, list[str] | None]]:
    """(label, ``infer serve`` flags) per configuration to launch, or (label, None) per ``--server`` URL."""
    configs: list[tuple[str, list[str] | None]] = []
    if args.server:
        labels = args.label if len(args.label) == len(args.server) else \
            [f"{args.label[0]} {i + 1}" if len(args.server) > 1 else args.label[0] for i in range(len(args.server))]
        return [(label, None) for label in labels]
    if not args.model:
        raise ValueError("give --server URL, or --model (and --draft-model) to launch servers")
    base = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
            "--quantization", args.quantization, "--backend", args.backend, "--max-batch-size", str(max_batch),
            "--no-prefix-caching"]  # repeats send the same prompts: each pays its prefill, as with the peer
    if args.peer or args.peer_server:
        base += ["--max-seq-len", str(args.context)]
    configs.append(("speculation off", base))
    if args.draft_model:
        configs.append(("fixed", base + ["--draft-model", args.draft_model, "--spec-length", str(args.spec_length),
                                         "--spec-length-policy", "fixed"]))
        configs.append(("goodput", base + ["--draft-model", args.draft_model, "--spec-length",
                                           str(args.spec_length), "--spec-length-policy", "goodput"]))
    for name in args.speculator:
        drafter = base + ["--speculator", name, "--spec-length", str(args.spec_length)]
        configs.append((f"{name} K={args.spec_length}", drafter + ["--spec-length-policy", "fixed"]))
        configs.append((f"{name} goodput", drafter + ["--spec-length-policy", "goodput"]))
    if args.replicas:
        configs = [(f"{label}, {_replicas_label(n)}", serve_args + _replica_flags(n, args.replica_cpus))
                   for label, serve_args in configs if serve_args is not None for n in args.replicas]
    return configs


def run_serving_bench(args: argparse.Namespace) -> dict[str, Any]:
    from infer.data.workloads import code_prompts, load_prompts, repetitive_prompts

    warmup: list[str] = []
    sizes = [max(args.requests_per_level, c) for c in args.concurrency]  # requests per level and repeat
    if args.prompts:
        prompts = load_prompts(args.prompts)
    elif args.workload == "repetitive":
        # A new function for every request, warm-up included: a drafter that learns from earlier
        # requests never sees a measured prompt twice.
        measured = sum(sizes) * args.level_repeats
        prompts = repetitive_prompts(measured + args.warmup)  # measured ones first, as in bench generation
        prompts, warmup = prompts[:measured], prompts[measured:]
    else:
        prompts = code_prompts(args.num_prompts)
    configs = _configs(args, max(args.concurrency))
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "runs": []}
    # Servers of one process run side by side, each idle while another is measured, so the levels
    # can be interleaved; Ray Serve replicas would compete for the CPUs they reserve: one at a time.
    groups = [[config] for config in configs] if args.replicas else [configs]
    for group in groups:
        with contextlib.ExitStack() as stack:
            urls = args.server or [None] * len(group)
            servers = [_Server(label, serve_args, url, stack) for (label, serve_args), url in zip(group, urls,
                                                                                                   strict=True)]
            if args.server and args.offline_repeats:
                _given_servers_vs_offline(servers, args, prompts)
            for server in servers:
                server.prepare(args, prompts, warmup)
            for level_index, c in enumerate(args.concurrency):
                n = sizes[level_index]
                for rep in range(args.level_repeats):
                    # Every config gets the same prompts for a level and repeat (none seen before
                    # by a server: the offsets move on), in an order that rotates per repeat.
                    first = sum(sizes) * rep + sum(sizes[:level_index])
                    shift = rep % len(servers)
                    for server in servers[shift:] + servers[:shift]:
                        res = asyncio.run(run_level(server.url, server.model, prompts, c, n, args.max_tokens,
                                                    args.temperature, args.poisson_rate, args.seed, args.chat,
                                                    first_prompt=first))
                        print(f"[bench] {server.label} c={c}: {res.throughput_tok_s:.1f} tok/s, TTFT p50 "
                              f"{res.ttft_ms.get('p50', float('nan')):.0f} ms, TPOT p50 "
                              f"{res.tpot_ms.get('p50', float('nan')):.1f} ms, errors {res.errors}",
                              file=sys.stderr, flush=True)
                        server.results.setdefault(c, []).append(res)
                        if server.engine is not None:
                            off = offline_level(server.engine, prompts, c, n, args.max_tokens, args.temperature,
                                                args.chat, first_prompt=first)
                            print(f"[bench] {server.label} c={c} offline: {off:.1f} tok/s "
                                  f"({res.throughput_tok_s / off:.2f}x through the server)", file=sys.stderr,
                                  flush=True)
                            server.offline.setdefault(c, []).append(off)
            for server in servers:
                report["runs"].append(server.report())
    return report


def run_peer_comparison(args: argparse.Namespace) -> dict[str, Any]:
    """``--peer`` / ``--peer-server``: infer's servers (launched, one request at a time, with ``--threads``
    kernel threads, or the ``--server`` URLs) against the peer's, on the same chat requests."""
    from infer.bench.peer_serving import run_peer_bench

    if args.replicas:
        raise ValueError("--peer and --peer-server compare one-process servers: drop --replicas")
    if args.offline_repeats:
        raise ValueError("--peer and --peer-server replace the sweep and its offline comparison: drop "
                         "--offline-repeats")
    args.threads = args.threads or os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with contextlib.ExitStack() as stack:
        configs = _configs(args, 1)
        urls = args.server or [None] * len(configs)
        servers = [_Server(label, serve_args, url, stack, env) for (label, serve_args), url in zip(configs, urls,
                                                                                                   strict=True)]
        return run_peer_bench(args, [(s.label, s.url) for s in servers], stack)


def _given_servers_vs_offline(servers: list[_Server], args: argparse.Namespace, prompts: list[str]) -> None:
    """``--server`` URLs with ``--offline-repeats``: every server and the engine ``--model`` (and the
    engine flags) describes, run offline here, take turns on the same single requests."""
    if not args.model:
        raise ValueError("--offline-repeats with --server needs --model (and the servers' engine flags) for the "
                         "offline side")
    flags = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--quantization",
             args.quantization, "--backend", args.backend]
    print(f"[bench] {', '.join(s.label for s in servers)}: single requests through each server vs offline, "
          f"{args.offline_repeats} repeats of {min(len(prompts), args.num_prompts)} prompts", file=sys.stderr,
          flush=True)
    singles = single_stream_vs_offline({s.label: (s.url, s.model) for s in servers}, _offline_engine(flags),
                                       prompts[: args.num_prompts], args.offline_repeats, args.max_tokens,
                                       args.temperature, args.seed, args.chat)
    for server in servers:
        server.single = singles[server.label]
        _say_single(server.label, server.single)


class _Server:
    """One configuration under test: a launched ``infer serve`` (or the ``--server`` URL) and its results."""

    def __init__(self, label: str, serve_args: list[str] | None, url: str | None, stack: contextlib.ExitStack,
                 env: dict[str, str] | None = None) -> None:
        self.label = label
        self.serve_args = serve_args
        self.single: dict[str, Any] | None = None
        self.results: dict[int, list[LevelResult]] = {}
        # With --offline-repeats: the same engine offline in the bench process, and its aggregate
        # tokens/s per level, each measured right after the server's run of the same requests.
        self.engine: Any = None
        self.offline: dict[int, list[float]] = {}
        if serve_args is not None:
            proc, url = start_infer_serve(serve_args, stack, env)
            print(f"[bench] started infer serve ({label}) on {url}", file=sys.stderr, flush=True)
            wait_healthy(url, proc, 600.0, "infer serve")
        assert url is not None
        self.url = url
        import httpx

        self.model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

    def prepare(self, args: argparse.Namespace, prompts: list[str], warmup: list[str]) -> None:
        """The single-stream comparison with offline (when asked), then the warm-up requests."""
        if args.offline_repeats and self.serve_args is not None:
            print(f"[bench] {self.label}: single stream through the server vs offline, {args.offline_repeats} "
                  f"repeats of {min(len(prompts), args.num_prompts)} prompts", file=sys.stderr, flush=True)
            self.engine = _offline_engine(self.serve_args)
            self.single = single_stream_vs_offline({self.label: (self.url, self.model)}, self.engine,
                                                   prompts[: args.num_prompts], args.offline_repeats,
                                                   args.max_tokens, args.temperature, args.seed,
                                                   args.chat)[self.label]
            _say_single(self.label, self.single)
        if warmup:
            print(f"[bench] {self.label}: {len(warmup)} warm-up requests", file=sys.stderr, flush=True)
            asyncio.run(run_level(self.url, self.model, warmup, max(args.concurrency), len(warmup), args.max_tokens,
                                  args.temperature, None, args.seed, args.chat))

    def report(self) -> dict[str, Any]:
        """Per level the repeat with the median throughput (all repeats' throughputs kept)."""
        levels = []
        for c, runs in self.results.items():
            ordered = sorted(runs, key=lambda r: r.throughput_tok_s)
            level = asdict(ordered[(len(ordered) - 1) // 2])
            level["repeat_throughputs_tok_s"] = [r.throughput_tok_s for r in runs]
            if c in self.offline:
                offline = self.offline[c]
                level |= {"offline_tok_s": statistics.median(offline), "repeat_offline_tok_s": offline,
                          "vs_offline": statistics.median(a.throughput_tok_s / b for a, b in zip(runs, offline,
                                                                                                 strict=True))}
            levels.append(level)
        return {"label": self.label, "url": self.url, "levels": levels, "single_stream": self.single}


def _say_single(label: str, single: dict[str, Any]) -> None:
    print(f"[bench] {label}: one stream {single['server_tok_s']:.1f} tok/s through the server "
          f"({single['whole_tok_s']:.1f} not streamed), {single['offline_tok_s']:.1f} offline "
          f"({single['ratio']:.2f}x, {single['whole_ratio']:.2f}x)", file=sys.stderr, flush=True)



def serving_table(report: dict[str, Any]) -> str:
    rows = ["| config | concurrency | tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        for lv in run["levels"]:
            t, i, o = lv["ttft_ms"], lv["itl_ms"], lv["tpot_ms"]
            rows.append(f"| {run['label']} | {lv['concurrency']} | {lv['throughput_tok_s']:.1f} | {t.get('p50', 0):.0f} | "
                        f"{t.get('p99', 0):.0f} | {o.get('p50', 0):.1f} | {o.get('p99', 0):.1f} | {i.get('p99', 0):.1f} | "
                        f"{lv['errors']} |")
    base = next((run for run in report["runs"] if run["label"] == "speculation off"), None)
    if base is not None and len(report["runs"]) > 1:
        plain = {lv["concurrency"]: lv["throughput_tok_s"] for lv in base["levels"]}
        levels = sorted(plain)
        rows += ["", "| config | " + " | ".join(f"c={c} vs off" for c in levels) + " |",
                 "|---|" + "---:|" * len(levels)]
        for run in report["runs"]:
            mine = {lv["concurrency"]: lv["throughput_tok_s"] for lv in run["levels"]}
            rows.append(f"| {run['label']} | " + " | ".join(
                f"{mine[c] / plain[c]:.2f}×" if c in mine and plain[c] else "–" for c in levels) + " |")
    offline = [(run["label"], lv) for run in report["runs"] for lv in run["levels"] if "offline_tok_s" in lv]
    if offline:
        rows += ["", "| config | concurrency | through the server tok/s | the same requests offline tok/s | "
                 "server / offline (median of paired repeats) |", "|---|---:|---:|---:|---:|"]
        rows += [f"| {label} | {lv['concurrency']} | {lv['throughput_tok_s']:.1f} | {lv['offline_tok_s']:.1f} | "
                 f"{lv['vs_offline']:.2f}× |" for label, lv in offline]
    singles = [(run["label"], run["single_stream"]) for run in report["runs"] if run.get("single_stream")]
    if singles:
        rows += ["", "| config | one stream through the server tok/s | not streamed tok/s | same requests offline "
                 "tok/s | server / offline (streamed, not) | median of paired ratios (streamed, not) | requests each |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        rows += [f"| {label} | {s['server_tok_s']:.1f} | {s['whole_tok_s']:.1f} | {s['offline_tok_s']:.1f} | "
                 f"{s['ratio']:.2f}×, {s['whole_ratio']:.2f}× | {s['paired_ratio']:.2f}×, {s['whole_paired_ratio']:.2f}× "
                 f"| {s['samples']} |" for label, s in singles]
    return "\n".join(rows) + "\n"


def write_serving_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    paths = write_json_and_table(report, serving_table(report), out_dir, "serving")
    plt = pyplot()
    if plt is None:
        return paths
    paths.append(Path(out_dir) / "throughput_vs_concurrency.png")
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
    from infer.engine.options import add_engine_args

    p = kinds.add_parser("serving", help="OpenAI-API load generator with a concurrency sweep")
    p.add_argument("--server", nargs="+", default=None, metavar="URL",
                   help="URLs of running servers (e.g. http://127.0.0.1:8000), measured in turns")
    p.add_argument("--label", nargs="+", default=["server"], help="names of the --server runs in the report")
    p.add_argument("--model", default=None, help="launch servers for this target (off / fixed / goodput); with "
                   "--server and --offline-repeats, the engine run offline")
    p.add_argument("--speculator", nargs="*", default=[], choices=["ngram", "suffix"],
                   help="also launch a server with each of these drafters")
    # What the launched servers get, declared as infer serve declares them (the draft length's default is
    # the engine's); a benchmark keeps naming its precision and device (the same on every machine).
    add_engine_args(p, ("draft_model", "spec_length", "dtype", "device", "quantization", "backend"))
    p.set_defaults(dtype="float32", device="cpu")
    p.add_argument("--replicas", type=int, nargs="+", default=None, metavar="N",
                   help="also compare replica counts: 0 = one process, N = infer serve --replicas N on Ray Serve "
                        "(each replica gets cpu_count / N CPUs unless --replica-cpus says otherwise)")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs (and torch threads) per Ray Serve replica for --replicas N > 0")
    p.add_argument("--concurrency", type=int, nargs="+", default=CONCURRENCY)
    p.add_argument("--requests-per-level", type=int, default=16)
    p.add_argument("--level-repeats", type=int, default=1, metavar="R",
                   help="run every concurrency level R times, the launched servers' runs interleaved in an order "
                        "that rotates per repeat; the report keeps the median-throughput repeat")
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
    p.add_argument("--offline-repeats", type=int, default=0, metavar="N",
                   help="before the sweep, time N repeats of --num-prompts single requests (streamed and not) "
                        "through each server against the same engine run offline in this process, in turns")
    p.add_argument("--out", default="bench-out")
    from infer.bench.peer_serving import add_peer_args

    add_peer_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.peer or args.peer_server:
        from infer.bench.peer_serving import peer_table, write_peer_report

        report = run_peer_comparison(args)
        paths = write_peer_report(report, args.out)
        print(peer_table(report))
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    report = run_serving_bench(args)
    paths = write_serving_report(report, args.out)
    print(serving_table(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
