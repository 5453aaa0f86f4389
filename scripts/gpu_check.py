"""The measurements of scripts/gpu_check.sh that no ``infer bench`` command makes: batched decode
against the memory-bandwidth limit, the verification-width cost curve, transformers with a static
cache under torch.compile, and greedy tokens on the device against the CPU float32 path.

Each subcommand prints a short table and writes one JSON file (``--out``). Timings synchronize the
device before reading the clock; every figure is a median over ``--repeats`` runs after a warm-up.

    python scripts/gpu_check.py bandwidth --out bw.json
    python scripts/gpu_check.py decode --model DIR --batch 1 8 32 --out decode.json
    python scripts/gpu_check.py widths --model DIR --out widths.json
    python scripts/gpu_check.py hf-static --model DIR --batch 1 --out hf.json
    python scripts/gpu_check.py greedy --model DIR --out greedy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], Any], device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def save(out: str | None, record: dict[str, Any]) -> None:
    print(json.dumps(record, indent=1))
    if out:
        Path(out).write_text(json.dumps(record, indent=1) + "\n")


def environment(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def bandwidth(args: argparse.Namespace) -> None:
    """Device-to-device copy bandwidth: bytes read plus bytes written per second (the ceiling decode
    can reach, measured on this card rather than taken from a data sheet)."""
    n = args.gib * 2**30 // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=args.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = median_seconds(lambda: dst.copy_(src), args.device, args.repeats)
    save(args.out, {**environment(args.device), "copy_gib": args.gib, "bytes_per_s": 2 * src.numel() * 2 / seconds})


# Data-sheet HBM bandwidth (bytes/s) by the name CUDA reports, most specific first: the peak the
# measured copy bandwidth is compared with (a copy reaches some 85-90% of it).
PEAK_BANDWIDTH = (("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12), ("H200", 4.8e12),
                  ("A100-SXM4-80GB", 2.039e12), ("A100-PCIE-80GB", 1.935e12), ("A100", 1.555e12))


def datasheet_peak(device: str) -> tuple[str, float] | None:
    """The card's name and data-sheet memory bandwidth, when this table knows the card."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next(((name, peak) for key, peak in PEAK_BANDWIDTH if key in name), None)


def weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode(args: argparse.Namespace) -> None:
    """Decode tok/s of ``batch`` greedy sequences through the LLM API, eager and with CUDA graphs:
    (batch x (N - 1) tokens) / (time for N tokens - time for 1), so prefill is left out, against
    ``batch x bandwidth / (weight bytes + KV bytes read per step)``, with the measured copy bandwidth
    and with the card's data-sheet peak (``--peak-tb-s``, else ``PEAK_BANDWIDTH`` by the card's name)."""
    from infer import LLM, SamplingParams

    bw = json.loads(Path(args.bandwidth).read_text())["bytes_per_s"] if args.bandwidth else None
    known = datasheet_peak(args.device)
    peak = args.peak_tb_s * 1e12 if args.peak_tb_s else known[1] if known else None
    rows, wbytes = [], 0
    for graphs in ([False, True] if args.cuda_graphs else [False]):
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=max(args.batch),
                  max_seq_len=args.prompt_tokens + args.max_tokens + 8, cuda_graphs=graphs)
        wbytes, config = weight_bytes(llm.engine.model), llm.engine.model_config
        for batch in args.batch:
            prompts = [[(7 * b + 3 * i) % 1000 + 10 for i in range(args.prompt_tokens)] for b in range(batch)]

            def run(tokens: int, prompts: list[list[int]] = prompts, llm: LLM = llm) -> None:
                llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))

            run(args.max_tokens)  # warm-up (and graph capture)
            full = median_seconds(lambda: run(args.max_tokens), args.device, args.repeats)
            first = median_seconds(lambda: run(1), args.device, args.repeats)
            # None when the run of N tokens did not take longer than the run of one (noise swamped it)
            tok_s = batch * (args.max_tokens - 1) / (full - first) if full > first else None
            row: dict[str, Any] = {"cuda_graphs": graphs, "batch": batch, "decode_tok_s": tok_s,
                                   "end_to_end_tok_s": batch * args.max_tokens / full}
            # every step reads the weights once and each sequence's K/V (its mean length here)
            per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                         * getattr(torch, args.dtype).itemsize)
            step_bytes = wbytes + batch * per_token * (args.prompt_tokens + args.max_tokens // 2)
            row["bytes_per_step"] = step_bytes
            if tok_s is not None:
                row["achieved_bytes_per_s"] = step_bytes * tok_s / batch
            if bw is not None and tok_s is not None:
                limit = batch * bw / step_bytes
                row |= {"limit_tok_s": limit, "fraction_of_limit": tok_s / limit}
            if peak is not None and tok_s is not None:
                row |= {"peak_limit_tok_s": batch * peak / step_bytes, "fraction_of_peak": tok_s * step_bytes / batch / peak}
            rows.append(row)
            print(f"cuda_graphs={graphs} batch={batch}: "
                  + (f"{tok_s:.1f} decode tok/s" if tok_s is not None else "decode not resolved from the noise")
                  + (f" ({row['fraction_of_limit']:.0%} of the measured-bandwidth limit)" if "fraction_of_limit" in row else "")
                  + (f" ({row['fraction_of_peak']:.0%} of the data-sheet peak)" if "fraction_of_peak" in row else ""))
        del llm
    save(args.out, {**environment(args.device), "model": args.model, "dtype": args.dtype, "weight_bytes": wbytes,
                    "peak_bytes_per_s": peak, "peak_source": "--peak-tb-s" if args.peak_tb_s else known and known[0],
                    "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rows": rows})


def widths(args: argparse.Namespace) -> None:
    """Milliseconds of one forward pass (and its logits) of W new tokens over a ``context``-token
    sequence, for each W: what a verification of W - 1 drafted tokens costs next to a decode step."""
    from infer.cache import make_pool
    from infer.core.model_runner import ModelRunner
    from infer.loader import load_model

    model, config = load_model(args.model, args.dtype, args.device)
    pool = make_pool("paged", num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, max_seq_len=args.context + max(args.widths) + 1, max_batch_size=1,
                     block_size=16, num_blocks=None, dtype=next(model.parameters()).dtype,
                     device=torch.device(args.device))
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    runner.forward([slot], [[(5 * i) % 1000 + 10 for i in range(args.context)]])
    rows = []
    for width in args.widths:
        def step(width: int = width) -> None:
            runner.logits(runner.forward([slot], [[11] * width]))
            pool.truncate_to(slot, args.context)

        step()
        ms = 1000 * median_seconds(step, args.device, args.repeats)
        rows.append({"width": width, "ms": ms})
    base = rows[0]["ms"]
    for row in rows:
        row["vs_width_1"] = row["ms"] / base
        print(f"width {row['width']:3d}: {row['ms']:.3f} ms ({row['vs_width_1']:.2f}x a decode step)")
    save(args.out, {**environment(args.device), "model": args.model, "dtype": args.dtype, "context": args.context,
                    "backend": model.backend.describe() if model.backend is not None else None, "rows": rows})


def hf_static(args: argparse.Namespace) -> None:
    """transformers' generate with a static KV cache and its forward under torch.compile (as generate
    does by itself on CUDA with a static cache), greedy, at each ``--batch``: end-to-end tok/s of
    ``batch x max_tokens`` tokens after two warm-up generations (which compile, once per batch size)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    # With a static cache on CUDA, generate compiles the forward itself (transformers' own
    # CompileConfig, reduce-overhead): the path its documentation gives for fast decoding.
    model.generation_config.disable_compile = not args.compile
    rows = []
    for batch in args.batch:
        ids = torch.tensor([[(7 * b + 5 * i) % 1000 + 10 for i in range(args.prompt_tokens)] for b in range(batch)],
                           device=args.device)

        def run(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                               min_new_tokens=args.max_tokens, do_sample=False, cache_implementation="static")

        start = time.perf_counter()
        run()
        run()
        warm = time.perf_counter() - start
        seconds = median_seconds(run, args.device, args.repeats)
        tok_s = batch * args.max_tokens / seconds
        rows.append({"batch": batch, "end_to_end_tok_s": tok_s, "warmup_s": warm})
        print(f"transformers static cache{' + torch.compile' if args.compile else ''}, batch {batch}: "
              f"{tok_s:.1f} tok/s end to end (warm-up {warm:.0f} s)")
    save(args.out, {**environment(args.device), "model": args.model, "dtype": args.dtype, "compiled": args.compile,
                    "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rows": rows})


def greedy(args: argparse.Namespace) -> None:
    """Greedy tokens on the device (float32, then --dtype) against the CPU's float32 path: how many
    agree before the first difference, and the CPU's top-2 logit margin there (a near tie is where
    two correct float32 reductions may differ)."""
    from infer import LLM, SamplingParams

    prompt = [(5 * i) % 1000 + 10 for i in range(args.prompt_tokens)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)

    def tokens(device: str, dtype: str) -> tuple[list[int], list[Any]]:
        llm = LLM(args.model, dtype=dtype, device=device, max_batch_size=1,
                  max_seq_len=args.prompt_tokens + args.max_tokens + 8)
        out = llm.generate([prompt], params)[0]
        return out.token_ids, out.logprobs or []

    cpu, cpu_logprobs = tokens("cpu", "float32")
    rows = []
    for dtype in dict.fromkeys(["float32", args.dtype]):
        dev, _ = tokens(args.device, dtype)
        agree = next((i for i, (a, b) in enumerate(zip(cpu, dev, strict=True)) if a != b), len(cpu))
        row: dict[str, Any] = {"dtype": dtype, "tokens": len(cpu), "agree_before_first_difference": agree,
                               "identical": dev == cpu}
        if agree < len(cpu) and agree < len(cpu_logprobs):
            row["cpu_logprobs_at_difference"] = str(cpu_logprobs[agree])
        rows.append(row)
        print(f"{args.device} {dtype} vs cpu float32: {agree}/{len(cpu)} greedy tokens agree"
              + (" (identical)" if row["identical"] else ""))
    save(args.out, {**environment(args.device), "model": args.model, "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = parser.add_subparsers(dest="kind", required=True)
    for name, fn in (("bandwidth", bandwidth), ("decode", decode), ("widths", widths), ("hf-static", hf_static),
                     ("greedy", greedy)):
        sub = kinds.add_parser(name)
        sub.set_defaults(func=fn)
        sub.add_argument("--device", default="cuda")
        sub.add_argument("--repeats", type=int, default=3)
        sub.add_argument("--out", default=None)
        if name == "bandwidth":
            sub.add_argument("--gib", type=int, default=2)
            continue
        sub.add_argument("--model", required=True)
        sub.add_argument("--dtype", default="bfloat16")
        sub.add_argument("--prompt-tokens", type=int, default=32)
        sub.add_argument("--max-tokens", type=int, default=64)
        if name == "decode":
            sub.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
            sub.add_argument("--bandwidth", default=None, help="bandwidth's JSON (for the limit)")
            sub.add_argument("--cuda-graphs", action="store_true", help="also with CUDA graphs")
            sub.add_argument("--peak-tb-s", type=float, default=None,
                             help="the card's data-sheet memory bandwidth in TB/s (default: by its name, if known)")
        if name == "widths":
            sub.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 64])
            sub.add_argument("--context", type=int, default=512)
        if name == "hf-static":
            sub.add_argument("--batch", type=int, nargs="+", default=[1])
            sub.add_argument("--no-compile", dest="compile", action="store_false",
                             help="static cache only (checks the step where compiling would take minutes)")
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
