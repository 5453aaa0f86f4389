"""``infer bench quality``: what quantized inference costs in accuracy, infer's and llama.cpp's.

Each ``--model`` is measured against its own float32 reference: the same file with every weight
dequantized (``quantization="none"``), so a GGUF's blocks are the reference's exact values and the
difference measured is only the quantized arithmetic (infer's kernels quantize activations to int8
per 32 values; llama.cpp's do the same, to q8_0 / q8_1). Modes of a model:

* ``infer QUANTIZATION`` for each ``--quantization`` (``auto``: a GGUF's blocks on infer's kernels;
  ``q8_0``/``q4_0``/...: a float checkpoint's weights quantized at load, weights and activations);
* ``llama.cpp`` on the same GGUF (llama-cpp-python, ``LlamaCppRunner``): the same blocks should give
  about the same figures.

Text: held-out windows of the corpus the trainers hold out (the Python standard library's files
that ``infer.data.corpus.split_files`` puts aside), each document followed by EOS, windows evenly
spread over the stream, every window run from an empty cache. Over every position of every window:
mean and max KL(reference || mode) of the next-token distributions (nats), the perplexity of the
text, top-1 (greedy) agreement with the reference, and the largest |logit difference|; and infer's
quantized logits against llama.cpp's on the same file (``infer auto against llama.cpp``).

    PYTHONPATH=src python -m infer.bench.quality [--model GGUF_OR_FOLDER ...] [--quantization auto]
        [--windows 16] [--window 256] [--no-peer] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from infer.loader.hub import DEFAULT_MODEL

# Logits of every position of one window: token ids [T] -> float32 [T, vocab].
LogitSource = Callable[[torch.Tensor], torch.Tensor]
REFERENCE = "infer float32 (dequantized)"
_ROWS_PER_CHUNK = 64  # float64 softmaxes over a 49k vocabulary: ~25 MB per tensor per chunk


@dataclass
class QualityTally:
    """Running sums of a mode's logits against the reference's, window after window."""

    positions: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    nll_sum: float = 0.0
    top1_agreed: int = 0
    max_abs_logit_diff: float = 0.0

    def add(self, reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``reference`` and ``logits`` [T, vocab] at the same positions; ``targets`` [T] the next tokens."""
        if reference.shape != logits.shape or reference.dim() != 2 or targets.shape != reference.shape[:1]:
            raise ValueError(f"logits {tuple(logits.shape)} against reference {tuple(reference.shape)} "
                             f"and targets {tuple(targets.shape)}: need [T, vocab] twice and [T]")
        if not torch.isfinite(logits).all():
            raise ValueError("the mode's logits hold NaN or infinity")
        for start in range(0, reference.shape[0], _ROWS_PER_CHUNK):
            rows = slice(start, start + _ROWS_PER_CHUNK)
            ref_logp = F.log_softmax(reference[rows].double(), dim=-1)
            logp = F.log_softmax(logits[rows].double(), dim=-1)
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)
            self.kl_sum += float(kl.sum())
            self.kl_max = max(self.kl_max, float(kl.max()))
            self.nll_sum -= float(logp.gather(1, targets[rows, None]).sum())
            self.top1_agreed += int((reference[rows].argmax(-1) == logits[rows].argmax(-1)).sum())
            self.max_abs_logit_diff = max(self.max_abs_logit_diff,
                                          float((logits[rows].double() - reference[rows].double()).abs().max()))
        self.positions += reference.shape[0]

    def summary(self) -> dict[str, Any]:
        if self.positions == 0:
            raise ValueError("no positions measured")
        nll = self.nll_sum / self.positions
        return {"positions": self.positions, "kl_mean": self.kl_sum / self.positions, "kl_max": self.kl_max,
                "nll_mean": nll, "perplexity": math.exp(nll), "top1_agreement": self.top1_agreed / self.positions,
                "max_abs_logit_diff": self.max_abs_logit_diff}


def measure(windows: torch.Tensor, reference: LogitSource, modes: dict[str, LogitSource],
            pairs: tuple[tuple[str, str], ...] = (),
            say: Callable[[str], None] = lambda _: None) -> dict[str, dict[str, Any]]:
    """Every mode (and the reference itself, under ``REFERENCE``) over ``windows`` [N, W]: the first
    W - 1 tokens are run, each position predicting the next token. Each pair ``(a, b)`` of modes
    also measures b against a as its reference, under ``pair_name(a, b)``."""
    if windows.dim() != 2 or windows.shape[1] < 2 or windows.shape[0] == 0:
        raise ValueError(f"windows of shape {tuple(windows.shape)}: need [N >= 1, W >= 2] token ids")
    unknown = [name for pair in pairs for name in pair if name not in modes]
    if unknown:
        raise ValueError(f"pairs name modes {unknown} that are not measured ({', '.join(modes)})")
    tallies = {REFERENCE: QualityTally(), **{name: QualityTally() for name in modes},
               **{pair_name(a, b): QualityTally() for a, b in pairs}}
    for i, window in enumerate(windows):
        ids, targets = window[:-1], window[1:]
        ref = reference(ids)
        tallies[REFERENCE].add(ref, ref, targets)
        logits = {name: source(ids) for name, source in modes.items()}
        for name, mode_logits in logits.items():
            tallies[name].add(ref, mode_logits, targets)
        for a, b in pairs:
            tallies[pair_name(a, b)].add(logits[a], logits[b], targets)
        say(f"window {i + 1}/{windows.shape[0]}: " + ", ".join(
            f"{name} KL {t.kl_sum / t.positions:.2e}" for name, t in tallies.items() if name != REFERENCE))
    return {name: tally.summary() for name, tally in tallies.items()}


def pair_name(reference: str, mode: str) -> str:
    return f"{mode} against {reference}"


def heldout_windows(tokenizer: Any, eos_id: int, window: int, count: int, max_chars: int = 4_000_000) -> torch.Tensor:
    """``count`` windows of ``window + 1`` tokens evenly spread over the stdlib's held-out files (the
    split ``infer.data.corpus.load_corpus`` makes), each file's tokens followed by EOS."""
    from infer.data.corpus import read_texts, split_files, stdlib_source_files
    from infer.data.windows import eval_windows

    _, held = split_files(stdlib_source_files())
    pieces: list[int] = []
    for text in read_texts(held, max_chars):
        pieces += tokenizer.encode(text, add_special_tokens=False, parse_special=False) + [eos_id]
    windows = eval_windows(np.asarray(pieces, dtype=np.int64), window, count)
    if windows.shape[0] < count or windows.shape[1] != window + 1:
        raise ValueError(f"the held-out text has {len(pieces)} tokens: too few for {count} windows of {window}")
    return windows


def infer_logits(model: torch.nn.Module) -> LogitSource:
    def run(ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model.compute_logits(model(ids[None]))[0].float()  # type: ignore[operator,no-any-return]
    return run


def _file_type(path: Path) -> str | None:
    """A GGUF's ``general.file_type`` name (``Q4_1``...), None for a folder."""
    if not path.is_file():
        return None
    import gguf

    from infer.loader.gguf import open_gguf

    value = open_gguf(path).get("general.file_type")
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_") if value is not None else "unknown"
    except ValueError:
        return str(value)


def run_quality(models: list[str], quantizations: list[str], windows: int, window: int, peer: bool,
                threads: int | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    from infer.bench.generation import environment
    from infer.bench.peer import LlamaCppRunner
    from infer.loader import load_config, load_model, load_tokenizer
    from infer.loader.hub import resolve_model_path
    from infer.loader.quantized import check_quantization

    for quantization in quantizations:
        check_quantization(quantization)
    if window < 1 or windows < 1:
        raise ValueError(f"--windows {windows} --window {window}: both must be >= 1")
    if threads:
        torch.set_num_threads(threads)
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    for ref in models:
        path = resolve_model_path(ref)
        file_type = _file_type(path)
        config = load_config(path)
        if window > config.max_position_embeddings:
            raise ValueError(f"--window {window} is longer than {path.name}'s {config.max_position_embeddings} positions")
        tokenizer = load_tokenizer(path, config)
        held = heldout_windows(tokenizer, config.eos_token_ids[0], window, windows)
        say(f"{path.name}: {held.shape[0]} held-out windows of {window} tokens")
        reference, _ = load_model(path, torch.float32, "cpu", quantization="none")
        modes: dict[str, LogitSource] = {}
        for quantization in quantizations:
            model, _ = load_model(path, torch.float32, "cpu", quantization=quantization)
            say(f"{path.name}: infer {quantization}: {model.weights_summary}")
            modes[f"infer {quantization}"] = infer_logits(model)
        if peer and file_type is not None:
            runner = LlamaCppRunner(path, max_tokens=0, context=window, threads=torch.get_num_threads(),
                                    all_logits=True)
            modes["llama.cpp"] = lambda ids, runner=runner: runner.logits(ids.tolist())  # type: ignore[misc]
        elif peer:
            say(f"{path.name}: a Hugging Face folder: no llama.cpp row (give the GGUF)")
        # The same blocks on both engines' kernels: how far apart are they from each other?
        pairs = (("llama.cpp", "infer auto"),) if {"llama.cpp", "infer auto"} <= modes.keys() else ()
        figures_by_mode = measure(held, infer_logits(reference), modes, pairs,
                                  say=lambda m, name=path.name: say(f"{name}: {m}"))  # type: ignore[misc]
        for mode, figures in figures_by_mode.items():
            results.append({"model": str(path), "file_type": file_type, "mode": mode, **figures})
    return {"settings": {"models": models, "quantizations": quantizations, "windows": windows, "window": window,
                         "peer": peer, "text": "Python stdlib held-out files (infer.data.corpus split), EOS between"},
            "environment": environment("cpu"), "seconds": time.perf_counter() - start, "results": results}


def quality_table(report: dict[str, Any]) -> str:
    s = report["settings"]
    env = report["environment"]
    head = (f"{s['windows']} held-out windows of {s['window']} tokens (stdlib text), every position; reference: the "
            f"same weights in float32 (a GGUF's blocks dequantized; a row 'X against Y': Y's logits the reference); "
            f"{env['cpu']} ({env['threads']} threads)")
    rows = ["| model | mode | KL mean (nats) | KL max | perplexity | top-1 agreement | max abs logit diff |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        name = Path(r["model"]).name + (f" ({r['file_type']})" if r["file_type"] else "")
        rows.append(f"| {name} | {r['mode']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['perplexity']:.3f} | "
                    f"{100 * r['top1_agreement']:.2f}% | {r['max_abs_logit_diff']:.3f} |")
    return head + "\n\n" + "\n".join(rows) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", nargs="+", default=[DEFAULT_MODEL],
                        help="GGUF files (or float folders) of the model, each measured against its own "
                             f"dequantized float32 weights (default: {DEFAULT_MODEL})")
    parser.add_argument("--quantization", nargs="+", default=["auto"],
                        help="infer modes: auto (a GGUF's blocks on infer's kernels), or q8_0 / q4_0 / q4_1 / q5_0 "
                             "(a float checkpoint quantized at load)")
    parser.add_argument("--windows", type=int, default=16, help="held-out windows")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--threads", type=int, default=None, help="threads for infer and llama.cpp (default: torch's)")
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp (llama-cpp-python)")
    parser.add_argument("--out", default="bench-out", help="folder for quality.json")


def run_from_args(args: argparse.Namespace) -> int:
    report = run_quality(args.model, args.quantization, args.windows, args.window, not args.no_peer, args.threads,
                         say=lambda msg: print(f"[quality] {msg}", file=sys.stderr, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=2) + "\n")
    print(quality_table(report))
    print(f"wrote {out / 'quality.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.bench.quality", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
