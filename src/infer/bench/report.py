"""Write a benchmark report: JSON with every figure, a markdown table, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infer.extras import pyplot
from infer.speculative.budget import expected_speedup


def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def generation_table(report: dict[str, Any]) -> str:
    peer = any(r.get("speedup_vs_peer") is not None for r in report["results"])
    memory = report.get("memory")
    columns = ["mode", "tok/s", "vs infer plain", "vs transformers"]
    columns += ["vs llama.cpp"] if peer else []
    columns += ["α", "accepted/pass", "Thm 3.8 predicted", "decode speedup / predicted"]
    columns += ["decode tok/s", "weights MB/token", "of bandwidth limit"] if memory else []
    trees = any(r.get("tree_nodes_per_round") is not None for r in report["results"])
    columns += ["tree nodes/round"] if trees else []
    columns += ["CPU ms/token"]
    rows = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for r in report["results"]:
        # Theorem 3.8 predicts the decoding speedup (prefill, the same in every mode, is not in it).
        measured = r.get("decode_speedup_vs_plain") or r["speedup_vs_plain"]
        ratio = (measured / r["predicted_speedup"]) if r.get("predicted_speedup") else None
        cells = [r["mode"], f"{r['tokens_per_s']:.1f}", _fmt(r["speedup_vs_plain"], 2, "×"),
                 _fmt(r["speedup_vs_transformers"], 2, "×")]
        cells += [_fmt(r.get("speedup_vs_peer"), 2, "×")] if peer else []
        cells += [_fmt(r["alpha"]), _fmt(r["mean_accepted_tokens"]), _fmt(r["predicted_speedup"], 2, "×"),
                  _fmt(ratio, 0 if ratio is None else 2)]
        if memory:
            fraction = r.get("bandwidth_fraction")
            weights = r.get("weight_bytes_per_token")
            cells += [_fmt(r.get("decode_tokens_per_s"), 1), _fmt(weights and weights / 1e6, 0),
                      "–" if fraction is None else f"{100 * fraction:.0f}%"]
        cells += [_fmt(r.get("tree_nodes_per_round"), 1)] if trees else []
        cells += [_fmt(r.get("cpu_ms_per_token"), 1)]
        rows.append("| " + " | ".join(cells) + " |")
    s = report["settings"]
    prompts = f"{s['num_prompts']} prompts × {s['repeats']} repeats"
    if s.get("num_warmup_prompts"):
        prompts += f" (suffix decoding learnt from {s['num_warmup_prompts']} other requests first)"
    new_tokens = f"up to {s['max_tokens']} new tokens (stop at EOS)" if s.get("stop_at_eos") else f"{s['max_tokens']} new tokens"
    head = (f"workload `{s['workload']}`{' (chat template)' if s.get('chat') else ''}, {prompts}, {new_tokens}, "
            f"temperature {s['temperature']}, {s['dtype']} on {report['environment'].get('gpu') or report['environment']['cpu']} "
            f"({report['environment']['threads']} threads); measured cost ratio c = {_fmt(report['cost_ratio_c'], 3)}")
    if report.get("greedy_outputs_identical") is not None:
        head += f"; greedy outputs identical across infer modes: {report['greedy_outputs_identical']}"
    if report.get("exact_greedy_outputs_identical") is not None:
        head += f"; across exact-greedy modes: {report['exact_greedy_outputs_identical']}"
    if report.get("compiled_outputs_identical") is not None:
        head += f"; across compiled modes: {report['compiled_outputs_identical']}"
    if report.get("cuda_graphs_outputs_identical") is not None:
        head += f"; across CUDA-graph modes: {report['cuda_graphs_outputs_identical']}"
    if memory:
        head += (f"; memory bandwidth {memory['bandwidth_gb_s']:.1f} GB/s (median of "
                 f"{len(memory['samples_gb_s'])}, a 512 MB reduction), weights read per token: infer "
                 f"{memory['infer_weight_bytes_per_token'] / 1e6:.0f} MB")
        if memory.get("peer_weight_bytes_per_token"):
            head += f", llama.cpp {memory['peer_weight_bytes_per_token'] / 1e6:.0f} MB"
    return (head + "\n\n" + "\n".join(rows) + "\n" + _rounds_table(report) + _prefill_table(report)
            + _long_context_table(report))


def _prefill_table(report: dict[str, Any]) -> str:
    """Prompt processing speed of the plain rows, llama.cpp's beside infer's."""
    return _plain_rows_table(
        report.get("prefill") or [], ("prompt_tokens", "prompt tokens"), ("tokens_per_s", "prefill tok/s"),
        "\nPrompt processing (prefill: a prompt of that many tokens from an empty cache, to the first "
        "token's logits; median over repeats, each on another prompt):\n\n")


def _long_context_table(report: dict[str, Any]) -> str:
    """Decode speed of the plain rows after a long context, llama.cpp's beside infer's."""
    return _plain_rows_table(
        report.get("long_context") or [], ("context_tokens", "context tokens"), ("decode_tokens_per_s", "decode tok/s"),
        "\nDecode after a long context (a prompt of that many tokens, then the greedy tokens; prefill "
        "excluded; median over repeats, each on another prompt):\n\n")


def _plain_rows_table(rows: list[dict[str, Any]], length: tuple[str, str], rate: tuple[str, str], caption: str) -> str:
    """A table of the plain rows' speed at each prompt length (``length`` and ``rate``: a row's key and its
    column's header), with a "vs llama.cpp" column when the peer ran; "" without rows."""
    if not rows:
        return ""
    peer = any(r.get("speedup_vs_peer") is not None for r in rows)
    lines = [f"| mode | {length[1]} | {rate[1]} |" + (" vs llama.cpp |" if peer else ""),
             "|---|---:|---:|" + ("---:|" if peer else "")]
    for r in rows:
        lines.append(f"| {r['mode']} | {r[length[0]]} | {r[rate[0]]:.1f} |"
                     + (f" {_fmt(r.get('speedup_vs_peer'), 2, '×')} |" if peer else ""))
    return caption + "\n".join(lines) + "\n"


def _rounds_table(report: dict[str, Any]) -> str:
    """Where the speculative rows' rounds went, against Theorem 3.8's cost model (one decode step per
    verification pass, c per draft)."""
    spec = [r for r in report["results"] if r.get("round_ms")]
    if not spec:
        return ""
    rows = ["| mode | c | rounds | ms/round in drafter | ms/round verifying | ms/round plain fallback | "
            "verification / decode step | drafter per draft / draft step alone |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in spec:
        ms = r["round_ms"]
        rows.append(f"| {r['mode']} | {_fmt(r.get('cost_ratio'), 3)} | {sum(r.get('rounds_by_length') or [])} | "
                    f"{ms['proposer']:.2f} | {ms['verification']:.2f} | {ms['plain fallback']:.2f} | "
                    f"{_fmt(r.get('verify_vs_decode_step'), 2, '×')} | {_fmt(r.get('draft_step_vs_alone'), 2, '×')} |")
    return "\nWhere the speculative rounds went (timed generations; c per row as the bench's docstring defines it):\n\n" \
        + "\n".join(rows) + "\n"


def write_json(path: str | Path, data: Any, indent: int = 2) -> None:
    """``data`` as JSON at ``path``, its folder made first (a ``--json``/``--out`` a user names)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=indent))


def write_json_and_table(report: dict[str, Any], table: str, out_dir: str | Path, name: str) -> list[Path]:
    """``out_dir/name.json`` (the report) and ``out_dir/name.md`` (its table): what every benchmark writes."""
    out = Path(out_dir)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    write_json(paths[0], report)
    paths[1].write_text(table)
    return paths


def write_generation_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    paths = write_json_and_table(report, generation_table(report), out_dir, "generation")
    paths += _plot_generation(report, Path(out_dir))
    return paths


def _plot_generation(report: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    written = []
    fixed = [r for r in report["results"] if r["engine"] == "infer" and r["spec_length"] and r["policy"] == "fixed"
             and "draft" in r["mode"]]
    cost = report.get("cost_ratio_c")
    if fixed and cost is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        ks = [r["spec_length"] for r in fixed]
        ax.plot(ks, [r.get("decode_speedup_vs_plain") or r["speedup_vs_plain"] for r in fixed], "o-",
                label="measured (decode)")
        alphas = [r["alpha"] for r in fixed if r["alpha"] is not None]
        if alphas:
            alpha = sum(alphas) / len(alphas)
            grid = list(range(0, max(ks) + 3))
            ax.plot(grid, [expected_speedup(alpha, k, cost) for k in grid], "--",
                    label=f"Theorem 3.8 (α={alpha:.2f}, c={cost:.3f})")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("draft length K")
        ax.set_ylabel("decode speedup over infer plain")
        ax.set_title("Speculative decoding: measured vs predicted")
        ax.legend()
        fig.tight_layout()
        written.append(out / "speedup_vs_k.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    spec = [r for r in report["results"] if r.get("acceptance_by_position")]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in spec:
            vals = r["acceptance_by_position"]
            ax.plot(range(1, len(vals) + 1), [v if v is not None else float("nan") for v in vals], "o-", label=r["mode"])
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | proposed)")
        ax.set_ylim(0, 1.05)
        ax.set_title("Acceptance by draft position")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "acceptance_by_position.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
