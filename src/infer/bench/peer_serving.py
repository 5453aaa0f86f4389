"""``infer bench serving --peer llama-server`` / ``--peer-server URL``: infer's server against another
OpenAI-compatible server, one chat request at a time, on the shipped prompt sets.

Every server (infer's modes, launched or ``--server`` URLs, and the peer's: ``llama-server`` started on
the same GGUF with the same threads and context, once per speculation mode, or ``--peer-server``
URLs) gets the very same chat requests, non-streamed: per request kind (chat / summary / code-edit,
``infer.data.prompt_sets``) ``--peer-prompts`` prompts, ``--peer-repeats`` times. The servers take
turns on each request in an order that rotates per request, so a machine whose speed drifts slows
them all alike; each server is idle while another is measured.

A request's rate is its completion tokens over its wall time (prompt processing included, as a user
sees it); per server and kind the report keeps the median. Greedy text must be identical across
infer's modes (speculation is lossless); the peer's text is compared with infer's and reported,
never required (another engine's kernels round differently).

Prompt caching is off on both sides (``cache_prompt: false`` for the peer; infer's launched servers run
with ``--no-prefix-caching``), so repeats of a prompt pay its prefill on both servers.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer.bench.report import write_json_and_table
from infer.data.prompt_sets import DEMO_KINDS, PROMPT_SETS
from infer.extras import pyplot

PEER_KINDS = ("llama-server",)
# llama.cpp's draftless (n-gram) speculation types, used where the binary's --spec-type offers them.
LLAMA_SPEC_MODES = ("ngram-simple", "ngram-mod")


@dataclass
class Target:
    """One server under test and what it answered."""

    label: str
    side: str  # "infer" or "peer"
    url: str
    model: str
    rates: dict[str, list[float]] = field(default_factory=dict)  # kind -> tok/s per request
    tokens: dict[str, list[int]] = field(default_factory=dict)  # kind -> completion tokens per request
    texts: dict[str, list[str]] = field(default_factory=dict)  # kind -> text per request, in request order
    repeats: dict[str, list[int]] = field(default_factory=dict)  # kind -> the repeat each request belongs to

    def record(self, kind: str, rate: float, tokens: int, text: str, repeat: int = 0) -> None:
        self.repeats.setdefault(kind, []).append(repeat)
        self.rates.setdefault(kind, []).append(rate)
        self.tokens.setdefault(kind, []).append(tokens)
        self.texts.setdefault(kind, []).append(text)


def chat_body(model: str, prompt: str, max_tokens: int, temperature: float, seed: int,
              ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                            "stream": False, "cache_prompt": False}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def one_chat(client: Any, target: Target, body: dict[str, Any]) -> tuple[float, int, str]:
    """One non-streamed chat request: (completion tokens / wall seconds, completion tokens, text)."""
    import httpx

    start = time.perf_counter()
    try:
        response = client.post(f"{target.url}/v1/chat/completions", json=body)
    except httpx.HTTPError as err:  # a server that died or dropped the connection: say which
        raise RuntimeError(f"{target.label} ({target.url}): {type(err).__name__}: {err}") from err
    wall = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{target.label}: HTTP {response.status_code}: {response.text[:300]}")
    data = response.json()
    tokens = int(data["usage"]["completion_tokens"])
    text = data["choices"][0]["message"].get("content") or ""
    return tokens / wall, tokens, text


def served_model(url: str) -> str:
    """The first model a server lists, or ``default`` where it lists none."""
    import httpx

    with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
        return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])
    return "default"


def run_requests(targets: list[Target], kinds: dict[str, list[str]], repeats: int, max_tokens: int,
                 temperature: float, seed: int, ignore_eos: bool, warmup: bool = True) -> None:
    """Every prompt of every kind through every target, ``repeats`` times, the targets in an order that
    rotates per request (one warm-up request each first)."""
    import httpx

    with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
        if warmup:
            first = next(iter(kinds.values()))[0]
            for target in targets:
                one_chat(client, target, chat_body(target.model, first, max_tokens, temperature, seed, ignore_eos))
        turn = 0
        for rep in range(repeats):
            for kind, prompts in kinds.items():
                for prompt in prompts:
                    shift = turn % len(targets)
                    turn += 1
                    for target in targets[shift:] + targets[:shift]:
                        rate, tokens, text = one_chat(client, target, chat_body(
                            target.model, prompt, max_tokens, temperature, seed, ignore_eos))
                        target.record(kind, rate, tokens, text, rep)
            print(f"[bench] peer comparison: repeat {rep + 1}/{repeats} done", file=sys.stderr, flush=True)


def compare(targets: list[Target], kinds: list[str]) -> dict[str, Any]:
    """Medians per target and kind, ratios to each side's first (plain) target, the best of each side,
    and which texts match infer's first target's."""
    infer = [t for t in targets if t.side == "infer"]
    peer = [t for t in targets if t.side == "peer"]
    base = infer[0] if infer else None
    peer_base = peer[0] if peer else None
    rows = []
    for t in targets:
        per_kind = {}
        for kind in kinds:
            rate = statistics.median(t.rates[kind])
            # A drafter that keeps what it saw across requests (infer's suffix decoding, llama.cpp's
            # ngram-mod) can copy a repeated prompt's earlier answer: the first repeat is every
            # server's first sight of each prompt.
            first = [r for r, rep in zip(t.rates[kind], t.repeats[kind], strict=True) if rep == 0]
            entry: dict[str, Any] = {"tok_s": rate, "first_repeat_tok_s": statistics.median(first),
                                     "samples": t.rates[kind], "median_tokens": statistics.median(t.tokens[kind])}
            if base is not None:
                entry["vs_infer_plain"] = rate / statistics.median(base.rates[kind])
                same = sum(a == b for a, b in zip(t.texts[kind], base.texts[kind], strict=True))
                entry["text_same_as_infer_plain"] = f"{same}/{len(t.texts[kind])}"
            if peer_base is not None:
                entry["vs_peer_plain"] = rate / statistics.median(peer_base.rates[kind])
            per_kind[kind] = entry
        rows.append({"label": t.label, "side": t.side, "url": t.url, "model": t.model, "kinds": per_kind,
                     "texts": t.texts})
    best: dict[str, Any] = {}
    for kind in kinds:
        pick: dict[str, Any] = {}
        for side, group in (("infer", infer), ("peer", peer)):
            if group:
                top = max(group, key=lambda t: statistics.median(t.rates[kind]))
                pick[side] = {"label": top.label, "tok_s": statistics.median(top.rates[kind])}
        if "infer" in pick and "peer" in pick:
            pick["infer_vs_peer"] = pick["infer"]["tok_s"] / pick["peer"]["tok_s"]
            plain = statistics.median(base.rates[kind]) / statistics.median(peer_base.rates[kind])  # type: ignore[union-attr]
            pick["infer_plain_vs_peer_plain"] = plain
        best[kind] = pick
    identical = None
    if len(infer) > 1:
        identical = all(t.texts == infer[0].texts for t in infer[1:])
    return {"rows": rows, "best": best, "greedy_text_identical_across_infer_modes": identical}


def peer_table(report: dict[str, Any]) -> str:
    s = report["settings"]
    kinds = s["peer_kinds"]
    lines = [f"{s['peer_prompts']} prompts per kind × {s['peer_repeats']} repeats, {s['max_tokens']} new tokens "
             f"({'past EOS' if s['ignore_eos'] else 'stop at EOS'}), temperature {s['temperature']}, "
             f"{s['threads']} threads, one chat request at a time, non-streamed; tok/s = completion tokens / "
             f"request wall time (median)", ""]
    peer = report.get("peer") or {}
    if peer:
        build = peer.get("build") or {}
        lines[-1:-1] = [f"llama-server `{peer['binary']}` ({peer.get('version') or 'version unknown'}"
                        + (f"; llama-cpp-python {build['llama_cpp_python']} sdist" if build.get("llama_cpp_python")
                           else "")
                        + (f", llama.cpp {build['llama_cpp_commit']}" if build.get("llama_cpp_commit") else "")
                        + f") on `{peer['gguf']}`; its --spec-type offers: {', '.join(peer['spec_types']) or 'none'}"]
    lines += ["| kind | server | side | tok/s | vs infer plain | vs peer plain | first repeat tok/s | tokens (median) | "
              "text = infer plain |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for kind in kinds:
        for row in report["comparison"]["rows"]:
            e = row["kinds"][kind]
            lines.append(f"| {kind} | {row['label']} | {row['side']} | {e['tok_s']:.1f} | "
                         f"{_ratio(e.get('vs_infer_plain'))} | {_ratio(e.get('vs_peer_plain'))} | "
                         f"{e['first_repeat_tok_s']:.1f} | {e['median_tokens']:g} | {e.get('text_same_as_infer_plain', '–')} |")
    best = report["comparison"]["best"]
    if any("infer_vs_peer" in b for b in best.values()):
        lines += ["", "| kind | infer plain vs peer plain | infer's best | peer's best | best vs best |",
                  "|---|---:|---|---|---:|"]
        for kind, b in best.items():
            if "infer_vs_peer" in b:
                lines.append(f"| {kind} | {b['infer_plain_vs_peer_plain']:.2f}× | {b['infer']['label']} "
                             f"{b['infer']['tok_s']:.1f} | {b['peer']['label']} {b['peer']['tok_s']:.1f} | "
                             f"{b['infer_vs_peer']:.2f}× |")
    identical = report["comparison"]["greedy_text_identical_across_infer_modes"]
    if identical is not None:
        lines += ["", f"greedy text identical across infer's modes: {identical}"]
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def write_peer_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    paths = write_json_and_table(report, peer_table(report), out_dir, "serving-peer")
    plt = pyplot()
    if plt is None:
        return paths
    kinds = report["settings"]["peer_kinds"]
    rows = report["comparison"]["rows"]
    path = Path(out_dir) / "serving_peer.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(kinds))]
        ax.bar(xs, [row["kinds"][kind]["tok_s"] for kind in kinds], width,
               label=f"{row['label']}" + (" (peer)" if row["side"] == "peer" else ""),
               hatch="//" if row["side"] == "peer" else None)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("tokens/s per request (median)")
    ax.set_title("infer serve vs peer server, one chat request at a time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [*paths, path]


def peer_gguf(args: argparse.Namespace) -> Path:
    """The GGUF llama-server loads: ``--peer-model``, else the file behind ``--model``."""
    from infer.loader.hub import is_gguf_file, resolve_model_path

    ref = args.peer_model or args.model
    if not ref:
        raise ValueError("--peer llama-server needs a GGUF file: give --model (a GGUF or built-in name) or "
                         "--peer-model FILE")
    path = resolve_model_path(ref)
    if not path.is_file() or not is_gguf_file(path):
        raise ValueError(f"--peer llama-server runs GGUF files; {ref!r} is {path}: give --peer-model FILE.gguf")
    return path


def llama_modes(requested: list[str] | None, available: list[str]) -> list[str]:
    """The llama-server modes to run: ``plain`` and the n-gram spec types (``requested``, or every one of
    ``LLAMA_SPEC_MODES`` this binary has). A requested mode is a spec type, optionally followed by that
    mode's own llama-server flags (``"ngram-simple --spec-ngram-simple-size-n 4"``)."""
    if requested is None:
        return ["plain", *[m for m in LLAMA_SPEC_MODES if m in available]]
    missing = [m for m in requested if m.split()[0] != "plain" and m.split()[0] not in available]
    if missing:
        raise ValueError(f"--peer-modes {', '.join(repr(m) for m in missing)}: this llama-server's --spec-type "
                         f"offers {', '.join(available) or 'nothing'}")
    return list(requested)


def llama_mode_args(mode: str) -> list[str]:
    """llama-server flags for one ``llama_modes`` entry."""
    kind, *extra = shlex.split(mode)
    return ([] if kind == "plain" else ["--spec-type", kind]) + extra


def run_peer_bench(args: argparse.Namespace, infer_servers: list[tuple[str, str]],
                   stack: contextlib.ExitStack) -> dict[str, Any]:
    """Start the peer(s), run the requests on ``infer_servers`` (label, url) and them, and report."""
    kinds = {kind: list(PROMPT_SETS[kind][: args.peer_prompts]) for kind in args.peer_kinds}
    targets = [Target(label, "infer", url, served_model(url)) for label, url in infer_servers]
    peer_info: dict[str, Any] = {}
    if args.peer_server:
        labels = args.peer_label if len(args.peer_label) == len(args.peer_server) else \
            [f"peer {i + 1}" for i in range(len(args.peer_server))]
        targets += [Target(label, "peer", url.rstrip("/"), served_model(url.rstrip("/")))
                    for label, url in zip(labels, args.peer_server, strict=True)]
    if args.peer == "llama-server":
        from infer.bench import llama_server

        gguf = peer_gguf(args)  # before a build that may take minutes
        binary = llama_server.find_or_build(args.peer_binary)
        available = llama_server.spec_types(binary)
        modes = llama_modes(args.peer_modes, available)
        peer_info = {"binary": str(binary), "version": llama_server.server_version(binary),
                     "build": llama_server.build_info(binary), "spec_types": available, "modes": modes,
                     "gguf": str(gguf), "extra_args": shlex.split(args.peer_args)}
        for mode in modes:
            extra = llama_mode_args(mode) + shlex.split(args.peer_args)
            server = llama_server.LlamaServer(binary, gguf, args.threads, args.context, extra)
            print(f"[bench] starting llama-server ({mode}): {' '.join(server.command())}", file=sys.stderr,
                  flush=True)
            stack.enter_context(server)
            targets.append(Target(f"llama-server {mode}", "peer", server.url, served_model(server.url)))
    print(f"[bench] peer comparison: {', '.join(t.label for t in targets)}; {args.peer_repeats} repeats of "
          f"{sum(len(p) for p in kinds.values())} chat requests", file=sys.stderr, flush=True)
    run_requests(targets, kinds, args.peer_repeats, args.max_tokens, args.temperature, args.seed, args.ignore_eos)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    return {"settings": settings, "peer": peer_info, "comparison": compare(targets, list(kinds))}


def add_peer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peer comparison (replaces the concurrency sweep)")
    g.add_argument("--peer", choices=PEER_KINDS, default=None,
                   help="start llama.cpp's llama-server on the same GGUF (built from the llama-cpp-python sdist "
                        "into ~/.cache/infer/llama.cpp on first use, 10+ minutes) once per --peer-modes entry, and "
                        "send it and infer's servers the same chat requests, in turns")
    g.add_argument("--peer-server", nargs="+", default=None, metavar="URL",
                   help="already running OpenAI-compatible servers to compare with (POST /v1/chat/completions)")
    g.add_argument("--peer-label", nargs="+", default=["peer"], help="names of the --peer-server runs")
    g.add_argument("--peer-binary", default=None, metavar="PATH",
                   help="llama-server to run (default: the cached build, built when missing)")
    g.add_argument("--peer-model", default=None, metavar="FILE",
                   help="GGUF file llama-server loads (default: the file behind --model)")
    g.add_argument("--peer-modes", nargs="+", default=None, metavar="MODE",
                   help="llama-server modes: plain or a --spec-type value, each optionally followed by its own "
                        "llama-server flags in one quoted string (default: plain and whichever of "
                        f"{', '.join(LLAMA_SPEC_MODES)} the binary offers)")
    g.add_argument("--peer-args", default="", metavar="ARGS",
                   help="extra llama-server flags for every mode, one quoted string")
    g.add_argument("--peer-kinds", nargs="+", default=list(DEMO_KINDS), choices=list(PROMPT_SETS),
                   help="request kinds (the shipped prompt sets; default: the demo's three)")
    g.add_argument("--peer-prompts", type=int, default=4, metavar="N", help="prompts per kind (default: 4)")
    g.add_argument("--peer-repeats", type=int, default=3, metavar="R", help="times each request is sent (default: 3)")
    g.add_argument("--threads", type=int, default=None,
                   help="kernel threads of every launched server, infer's (OMP_NUM_THREADS) and llama-server's "
                        "(-t); default: this machine's CPU count")
    g.add_argument("--context", type=int, default=4096,
                   help="context length of every launched server (infer serve --max-seq-len, llama-server -c)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="every request generates --max-tokens tokens (the ignore_eos extension both servers take)")
