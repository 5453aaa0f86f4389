"""Micro-benchmark of the quantized matrix-vector kernels (``infer.kernels.quant``).

For one weight shape (default: out 2048 x in 8192, the 1B shape's down projection) it times, at
each row count and thread count, interleaved in every repeat:
  - each quantized-kernel variant this CPU runs, on the GGUF blocks (default Q4_0) as its ``pack``
    gives them (the x8 layout: 8 rows interleaved);
  - ``F.linear`` in float32 on the dequantized weight;
  - PyTorch's weight-only CPU operators at the same shape: ``_weight_int8pack_mm`` (int8 per
    output channel) and ``_weight_int4pack_mm_for_cpu`` (int4, groups of 32), float32 activations;
  - a numpy copy of a buffer as large as the weight set (the memory bandwidth).
Each mode cycles through enough copies of its weight to exceed the last-level cache, so every call
streams its weight from memory. The figure is GB/s of weight bytes read (the mode's own bytes: a
float32 weight is 7x a Q4_0 one), the arithmetic rate (GOP/s: 2 x rows x out x in per second) and
the time per product; medians over the repeats.

    PYTHONPATH=src python -m infer.bench.quant_kernels [--qtype Q4_0] [--rows 1 6] [--threads 1 2]
        [--repeats 7] [--quant-only] [--variants avx512-vnni avx2] [--tile-min-rows 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from infer.kernels import build, quant

STREAM_BYTES = 256 << 20  # each mode cycles through at least this many weight bytes (beyond any LLC)


def _copies(nbytes: int) -> int:
    return max(2, -(-STREAM_BYTES // nbytes))


def _time(call: Callable[[int], object], copies: int, calls: int) -> float:
    """Seconds per call, ``calls`` calls cycling through the ``copies`` weights."""
    call(0)
    start = time.perf_counter()
    for i in range(calls):
        call(i % copies)
    return (time.perf_counter() - start) / calls


def _quant_call(kernels: quant.QuantKernels, weights: list[quant.QuantWeight], x: torch.Tensor, threads: int,
                i: int) -> object:
    return kernels.linear(x, weights[i], threads=threads)


def _dense_call(weights: list[torch.Tensor], x: torch.Tensor, i: int) -> object:
    return F.linear(x, weights[i])


def _int8_call(weights: list[torch.Tensor], scales: torch.Tensor, x: torch.Tensor, i: int) -> object:
    return torch.ops.aten._weight_int8pack_mm(x, weights[i], scales)


def _int4_call(weights: list[torch.Tensor], scales: torch.Tensor, x: torch.Tensor, i: int) -> object:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weights[i], 32, scales)


def _copy_call(target: np.ndarray, source: np.ndarray, i: int) -> object:
    np.copyto(target, source)
    return target


def run(qtype: str, out_features: int, in_features: int, rows: list[int], threads: list[int], repeats: int,
        calls: int, quant_only: bool = False, variant_names: list[str] | None = None,
        tile_min_rows: int | None = None) -> dict[str, object]:
    generator = torch.Generator().manual_seed(0)
    qt = quant.quant_type(qtype)
    raw = quant.random_blocks(qt.name, out_features, in_features, generator)
    dense = torch.from_numpy(quant.dequantize_reference(raw, qt.name, in_features))
    q_bytes = raw.numel()
    q_copies = _copies(q_bytes)
    raws = [raw.clone() for _ in range(q_copies)]
    f_copies = _copies(dense.numel() * 4)
    denses = [dense.clone() for _ in range(f_copies)]

    int8 = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    int8_scales = torch.rand(out_features, generator=generator) * 0.01
    i8_copies = _copies(int8.numel())
    int8s = [int8.clone() for _ in range(i8_copies)]
    nibbles = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, generator=generator)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
    int4_scales = torch.rand(in_features // 32, out_features, 2, generator=generator) * 0.01
    i4_copies = _copies(int4.numel())
    int4s = [int4.clone() for _ in range(i4_copies)]

    variants = []
    refused = {}
    for variant in build.QUANT_VARIANTS:
        if variant_names is not None and variant.name not in variant_names:
            continue
        if variant_names is None and variant.name in quant.EMULATED:  # C-emulated tiles: correctness, not speed
            continue
        try:
            kernels = quant.quant_kernels(variant.name)
        except build.KernelUnavailable as err:
            refused[variant.name] = str(err)
            continue
        assert kernels is not None
        if tile_min_rows is not None and kernels.tiles is not None:
            kernels.set_tile_min_rows(tile_min_rows)
        variants.append((variant.name, kernels, [kernels.pack(r, qt.name, in_features) for r in raws]))

    buffer = np.ones(STREAM_BYTES // 4, dtype=np.float32)
    target = np.empty_like(buffer)
    results: list[dict[str, object]] = []
    for m in rows:
        x = torch.randn(m, in_features, generator=generator)
        for t in threads:
            modes: dict[str, tuple[Callable[[int], object], int, int]] = {}
            for name, kernels, weights in variants:
                modes[f"quant {qt.name} {name}"] = (functools.partial(_quant_call, kernels, weights, x, t), q_copies,
                                                    q_bytes)
            if not quant_only:
                modes["F.linear float32"] = (functools.partial(_dense_call, denses, x), f_copies, dense.numel() * 4)
                modes["aten int8pack_mm"] = (functools.partial(_int8_call, int8s, int8_scales, x), i8_copies,
                                             int8.numel() + 4 * out_features)
                modes["aten int4pack_mm_for_cpu"] = (functools.partial(_int4_call, int4s, int4_scales, x), i4_copies,
                                                     int4.numel() + int4_scales.numel() * 4)
                modes["numpy copy (bandwidth)"] = (functools.partial(_copy_call, target, buffer), 1, buffer.nbytes)
            seconds: dict[str, list[float]] = {name: [] for name in modes}
            previous = torch.get_num_threads()
            torch.set_num_threads(t)
            try:
                for _ in range(repeats):  # interleaved: every mode once per repeat
                    for name, (call, copies, _) in modes.items():
                        # The kernels run as the engine runs them (kernel_threads_only): PyTorch on
                        # one thread, so its OpenMP pool does not compete with theirs for the cores.
                        torch.set_num_threads(1 if name.startswith("quant") else t)
                        seconds[name].append(_time(call, copies, calls if "copy" not in name else 3))
            finally:
                torch.set_num_threads(previous)
            for name, (_, _, nbytes) in modes.items():
                median = statistics.median(seconds[name])
                results.append({"mode": name, "rows": m, "threads": t, "weight_bytes": nbytes,
                                "median_ms": median * 1e3, "gb_per_s": nbytes / median / 1e9,
                                "gop_per_s": 2 * m * out_features * in_features / median / 1e9, "repeats": repeats})
    return {"shape": [out_features, in_features], "qtype": qt.name, "results": results, "refused": refused,
            "note": "GB/s = the mode's weight bytes read per second (numpy copy: bytes read; it writes as many)"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qtype", default="Q4_0", choices=list(quant.QUANT_TYPES))
    parser.add_argument("--out-features", type=int, default=2048)
    parser.add_argument("--in-features", type=int, default=8192)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="products timed per repeat and mode")
    parser.add_argument("--quant-only", action="store_true", help="time the quantized kernels only")
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in build.QUANT_VARIANTS],
                        help="the quantized-kernel variants to time (default: every one this CPU runs but the "
                             "emulated tile ones)")
    parser.add_argument("--tile-min-rows", type=int, default=None,
                        help="the tile variants take calls of this many rows or more (default: the library's, "
                             "16 on AMX; 2 puts every call of 2 rows or more on the tiles, to find the crossover)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.tile_min_rows is not None and args.tile_min_rows < 2:
        parser.error("--tile-min-rows must be 2 or more")
    report = run(args.qtype, args.out_features, args.in_features, args.rows, args.threads, args.repeats, args.calls,
                 args.quant_only, args.variants, args.tile_min_rows)
    print(f"{report['qtype']} weight [{args.out_features} x {args.in_features}], medians of {args.repeats} "
          f"interleaved repeats x {args.calls} products")
    print(f"{'mode':34} {'rows':>4} {'thr':>3} {'ms':>8} {'GB/s':>7} {'GOP/s':>7}")
    for row in report["results"]:  # type: ignore[attr-defined]
        print(f"{row['mode']:34} {row['rows']:>4} {row['threads']:>3} {row['median_ms']:>8.3f} {row['gb_per_s']:>7.2f} "
              f"{row['gop_per_s']:>7.1f}")
    for reason in report["refused"].values():  # type: ignore[attr-defined]
        print(f"not run: {reason}")
    if args.json:
        from infer.bench.report import write_json

        write_json(args.json, report)


if __name__ == "__main__":
    main()
