"""The benchmark and demo commands run end to end on tiny checkpoints and write valid reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import make_eagle3_head, make_medusa_heads
from infer import LLM, SamplingParams
from infer.cli import main
from infer.data.prompt_sets import PROMPT_SETS
from infer.data.workloads import (
    CHAT_WORKLOADS,
    REPETITIVE_INSTRUCTION,
    code_prompts,
    edit_prompts,
    load_prompts,
    repetitive_prompts,
    workload_prompts,
)
from infer.engine.config import SpeculativeConfig
from infer.loader import load_model
from infer.speculative.budget import expected_speedup_over_rounds


def test_bench_generation_writes_report(tiny_llama: Path, tiny_draft: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def add(a, b):\n", "import os\nimport sys\n"]))
    out = tmp_path / "report"
    code = main(["bench", "generation", "--model", str(tiny_llama), "--draft-model", str(tiny_draft),
                 "--prompts", str(prompts), "--max-tokens", "8", "--repeats", "1", "--spec-length", "2", "3",
                 "--also-dtype", "bfloat16", "--also-backend", "torch", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "generation.json").read_text())
    modes = {r["mode"]: r for r in report["results"]}
    # --also-backend: a plain row on the PyTorch layers, timed beside the default backend's.
    assert modes["infer plain (backend torch)"]["tokens_per_s"] > 0
    # The extra precision's plain row reads half the bytes; its text may differ, so it is left out of
    # the greedy comparison (asserted below).
    other = modes["infer plain (bfloat16)"]
    assert other["dtype"] == "bfloat16" and modes["infer plain"]["dtype"] == "float32"
    assert other["weight_bytes_per_token"] * 2 == modes["infer plain"]["weight_bytes_per_token"]
    for expected in ("infer plain", "infer + draft K=2", "infer + draft K=3", "infer + draft (entropy)",
                     "infer + draft (goodput)", "infer + n-gram K=3", "transformers generate",
                     "transformers assisted", "transformers prompt lookup"):
        assert expected in modes, expected
        assert modes[expected]["tokens_per_s"] > 0
    assert report["greedy_outputs_identical"] is True
    assert report["cost_ratio_c"] > 0
    k2 = modes["infer + draft K=2"]
    # Theorem 3.8 over the rounds the row ran: 8 tokens with K=2 may end on a shorter round.
    assert sum(k2["rounds_by_length"]) > 0 and len(k2["rounds_by_length"]) <= 3
    assert k2["cost_ratio"] == pytest.approx(report["cost_ratio_c"])
    assert k2["predicted_speedup"] == pytest.approx(
        expected_speedup_over_rounds(k2["alpha"], k2["rounds_by_length"], cost_per_draft=report["cost_ratio_c"]))
    ngram = modes["infer + n-gram K=3"]
    if ngram["alpha"] is not None:  # the n-gram row drafted: its c is its drafter's measured time
        assert ngram["cost_ratio"] > 0 and ngram["predicted_speedup"] > 0
    assert all(modes[m]["round_ms"]["verification"] > 0 for m in ("infer + draft K=2", "infer + draft K=3"))
    assert k2["verify_vs_decode_step"] > 0 and k2["draft_step_vs_alone"] > 0
    assert report["environment"]["torch"]
    assert report["environment"]["backend"]["backend"] in ("torch", "cpu-kernels")  # what ran, and why
    # Plain rows know their share of the measured memory bandwidth; every row its CPU time per token.
    assert report["memory"]["bandwidth_gb_s"] > 0 and report["memory"]["infer_weight_bytes_per_token"] > 0
    assert modes["infer plain"]["bandwidth_fraction"] > 0 and modes["infer + draft K=2"]["bandwidth_fraction"] is None
    assert all(r["cpu_ms_per_token"] > 0 for r in modes.values())
    assert (out / "generation.md").read_text().startswith("workload")
    assert (out / "speedup_vs_k.png").stat().st_size > 1000
    assert "| infer plain |" in capsys.readouterr().out


def drafter_rows(model: Path, out: Path, *flags: str) -> dict[str, Any]:
    """``bench generation`` on ``model`` with only the drafter rows ``flags`` add (one short prompt, one
    repeat): its modes by name, after checking it ran and every mode's greedy text matched."""
    code = main(["bench", "generation", "--model", str(model), "--num-prompts", "1", "--max-tokens", "8",
                 "--repeats", "1", "--no-ngram", "--no-suffix", "--no-transformers", *flags, "--out", str(out)])
    assert code == 0
    report = json.loads((out / "generation.json").read_text())
    assert report["greedy_outputs_identical"] is True
    return {r["mode"]: r for r in report["results"]}


def test_bench_generation_medusa_rows(tiny_llama: Path, tmp_path: Path) -> None:
    heads = make_medusa_heads(tiny_llama, tmp_path / "heads", tree_size=6)
    modes = drafter_rows(tiny_llama, tmp_path / "report", "--medusa-heads", str(heads), "--medusa-tree-size", "2")
    assert set(modes) == {"infer plain", "infer + Medusa", "infer + Medusa (2-node tree)"}
    assert all(modes[m]["mean_accepted_tokens"] >= 1.0 for m in ("infer + Medusa", "infer + Medusa (2-node tree)"))


def test_bench_generation_eagle_row(tiny_llama: Path, tmp_path: Path) -> None:
    head = make_eagle3_head(tiny_llama, tmp_path / "head", draft_vocab=list(range(300)))
    modes = drafter_rows(tiny_llama, tmp_path / "report", "--eagle-head", str(head), "--eagle-tree-size", "4")
    assert set(modes) == {"infer plain", "infer + EAGLE"}
    assert modes["infer + EAGLE"]["mean_accepted_tokens"] >= 1.0


def test_bench_generation_repetitive_workload(tiny_llama: Path, tmp_path: Path) -> None:
    reports = {}
    for repeats in (1, 3):
        out = tmp_path / f"report{repeats}"
        code = main(["bench", "generation", "--model", str(tiny_llama), "--workload", "repetitive", "--chat",
                     "--warmup", "2", "--num-prompts", "1", "--repeats", str(repeats), "--max-tokens", "16",
                     "--spec-length", "3", "--no-transformers", "--out", str(out)])
        assert code == 0
        reports[repeats] = json.loads((out / "generation.json").read_text())
    report = reports[3]
    modes = {r["mode"]: r for r in report["results"]}
    assert set(modes) == {"infer plain", "infer + n-gram K=3", "infer + n-gram (default policy)", "infer + suffix K=3",
                          "infer + suffix (default policy)"}
    assert modes["infer + n-gram K=3"]["policy"] == "fixed" and modes["infer + n-gram (default policy)"]["policy"] is None
    assert report["greedy_outputs_identical"] is True
    settings = report["settings"]
    assert settings["stop_at_eos"] and settings["chat"]
    assert (settings["num_prompts"], settings["num_warmup_prompts"]) == (1, 2)
    assert len(modes["infer + suffix K=3"]["samples"]) == 3
    assert "learnt from 2 other requests first" in (out / "generation.md").read_text()
    # Every timed repeat drafted from the warm-up requests alone (never from the bench's own warm-up
    # generation of the timed prompt, nor from an earlier repeat): as an engine that served only them.
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_batch_size=1, speculator="suffix", spec_length=3, spec_length_policy="fixed")
    chats = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in repetitive_prompts(3)]
    for warmup in chats[1:]:  # the timed prompt comes first, then the warm-up ones
        llm.generate([warmup], SamplingParams(max_tokens=16, temperature=0.0))
    expected = llm.generate([chats[0]], SamplingParams(max_tokens=16, temperature=0.0))[0].metrics
    for results in (reports[1]["results"], report["results"]):
        suffix = {r["mode"]: r for r in results}["infer + suffix K=3"]
        assert suffix["mean_accepted_tokens"] == pytest.approx(expected.mean_accepted_tokens)


def test_repetitive_prompts_apply_one_instruction_to_different_functions() -> None:
    prompts = repetitive_prompts(6)
    assert len(set(prompts)) == 6
    assert repetitive_prompts(9)[:6] == prompts  # more prompts only append
    for prompt in prompts:
        assert prompt.startswith(REPETITIVE_INSTRUCTION)
        code = prompt.split("```python\n", 1)[1].rsplit("```", 1)[0]
        compile(code, "<function>", "exec")  # a whole function, dedented
        assert code.startswith("def ") and "->" not in code.splitlines()[0]


def test_bench_generation_shipped_chat_workload(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert main(["bench", "generation", "--model", str(tiny_llama), "--workload", "summary", "--num-prompts", "1",
                 "--max-tokens", "4", "--repeats", "1", "--no-transformers", "--no-suffix", "--no-ngram",
                 "--out", str(out)]) == 0
    report = json.loads((out / "generation.json").read_text())
    assert report["settings"]["chat"] is True and report["settings"]["workload"] == "summary"  # a user message


def test_bench_generation_exact_greedy_rows(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    code = main(["bench", "generation", "--model", str(tiny_llama), "--num-prompts", "1", "--max-tokens", "8",
                 "--repeats", "1", "--no-transformers", "--spec-length", "3", "--dtype", "bfloat16",
                 "--exact-greedy", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "generation.json").read_text())
    modes = {r["mode"] for r in report["results"]}
    rows = ("infer plain", "infer + n-gram K=3", "infer + n-gram (default policy)", "infer + suffix K=3",
            "infer + suffix (default policy)")
    assert modes == {*rows, *(f"{row} (exact greedy)" for row in rows)}
    assert report["exact_greedy_outputs_identical"] is True
    exact_plain = next(r for r in report["results"] if r["mode"] == "infer plain (exact greedy)")
    assert exact_plain["acceptance_by_position"] is None  # plain rows carry no speculation stats
    assert "across exact-greedy modes: True" in (out / "generation.md").read_text()


@pytest.mark.parametrize("device", ["cpu"] + ([] if torch.cuda.is_available() else ["auto"]))
def test_bench_generation_cuda_graphs_needs_cuda(tiny_llama: Path, tmp_path: Path, device: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "generation", "--model", str(tiny_llama), "--num-prompts", "1", "--max-tokens", "4",
                 "--no-transformers", "--device", device, "--cuda-graphs", "--out", str(tmp_path / "r")])
    assert code == 2
    assert "--cuda-graphs replays CUDA graphs: it needs --device cuda" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before loading anything


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_bench_generation_cuda_graph_rows(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    code = main(["bench", "generation", "--model", str(tiny_llama), "--num-prompts", "1", "--max-tokens", "8",
                 "--repeats", "1", "--no-transformers", "--no-suffix", "--spec-length", "3", "--device", "cuda",
                 "--cuda-graphs", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "generation.json").read_text())
    modes = {r["mode"] for r in report["results"]}
    assert {"infer plain (CUDA graphs)", "infer + n-gram K=3 (CUDA graphs)"} <= modes
    assert report["cuda_graphs_outputs_identical"] is True


def test_workloads_and_prompt_files(tmp_path: Path) -> None:
    code = code_prompts(3)
    assert len(code) == 3 and all(p.count("\n") >= 4 for p in code)
    edit = edit_prompts(2)
    assert all("A copy of the function above" in p for p in edit)
    # The shipped user messages: several of each kind, the passage or code given in the prompt.
    for name in CHAT_WORKLOADS:
        shipped = workload_prompts(name, 6)
        assert len(set(shipped)) == 6
        with pytest.raises(ValueError, match="ships"):
            workload_prompts(name, 100)
    assert all(p.startswith("Summarize") and len(p) > 500 for p in workload_prompts("summary", 6))
    assert all("```python\n" in p for p in workload_prompts("code-edit", 6))
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n---\nsecond\nprompt")
    assert load_prompts(text) == ["first prompt", "second\nprompt"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert load_prompts(jsonl) == ["a", "b"]
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(empty)


def test_demo_runs_on_given_models(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The self-draft accepts everything, so the draft model's rows show acceptance 1.00. The EAGLE-3
    # head is found where `infer train eagle` saves it for a model folder: its eagle/.
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    make_eagle3_head(model, model / "eagle")
    code = main(["demo", "--model", str(model), "--draft-model", str(tiny_llama), "--per-kind", "1",
                 "--max-tokens", "12", "--spec-length", "4"])
    out = capsys.readouterr().out
    assert code == 0
    assert "greedy text identical in every mode: True" in out
    for kind in ("chat", "summary", "code-edit", "all"):
        for mode in ("plain", "n-gram K=4", "suffix K=4", "EAGLE-3 K=4", "draft model K=4"):
            assert f"\n{kind:<12}{mode:<22}" in out, (kind, mode)
    assert "1.00" in out and "no EAGLE-3 head" not in out
    plain_all = next(line for line in out.splitlines() if line.startswith(f"{'all':<12}{'plain':<22}"))
    assert 3 <= int(plain_all.split()[2]) <= 3 * 12  # one prompt of each kind
    assert PROMPT_SETS["chat"][0] in out  # each kind's first prompt and its answer
    assert main(["demo", "--model", str(tiny_llama), "--per-kind", "99"]) == 2  # more than the sets hold

    # Without a head the demo says how to train one; a mode whose greedy text differed makes it fail.
    from infer import demo

    monkeypatch.setattr(demo, "_identical", lambda rows: False)
    assert main(["demo", "--model", str(tiny_llama), "--max-tokens", "4", "--per-kind", "1"]) == 1
    out = capsys.readouterr().out
    assert f"`infer train eagle --target {tiny_llama}`" in out and "EAGLE-3" not in out.split("(no EAGLE-3")[0]
    assert "every drafter at its default policy" in out and f"\n{'chat':<12}{'n-gram':<22}" in out


def test_demo_never_shows_a_speedup_on_degenerate_answers(tiny_llama: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from infer import demo

    assert demo.degenerate("\n\n  \n", [13, 13, 220]) == "blank"
    assert demo.degenerate("ab" * 20, [5, 6] * 20) == "a loop of a few tokens"
    assert demo.degenerate("def f(x):\n    return x", list(range(40))) is None
    assert demo.degenerate("short", [5, 5, 5]) is None  # too short to call a loop

    # Every answer flagged: no kind gets a speedup column.
    monkeypatch.setattr(demo, "degenerate", lambda text, token_ids: "blank")
    assert main(["demo", "--model", str(tiny_llama), "--max-tokens", "4", "--per-kind", "1"]) == 0
    out = capsys.readouterr().out
    assert "×" not in out
    for kind in ("chat", "summary", "code-edit", "all"):
        assert f"\n{kind:<12}every answer is degenerate (blank or a loop): no speedup shown" in out
    assert "3 of 3 answers are degenerate" in out and out.count("(degenerate answer: blank)") == 3


def test_bench_serving_against_launched_servers(tiny_llama: Path, tiny_draft: Path, tmp_path: Path) -> None:
    code = main(["bench", "serving", "--model", str(tiny_llama), "--draft-model", str(tiny_draft),
                 "--concurrency", "1", "2", "--requests-per-level", "2", "--max-tokens", "6", "--level-repeats", "2",
                 "--offline-repeats", "1", "--num-prompts", "2", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "serving.json").read_text())
    assert [run["label"] for run in report["runs"]] == ["speculation off", "fixed", "goodput"]
    for run in report["runs"]:
        for level in run["levels"]:
            assert level["errors"] == 0
            assert level["output_tokens"] == 6 * level["requests"]
            assert level["ttft_ms"]["p50"] > 0
            assert len(level["repeat_throughputs_tok_s"]) == 2
            # Each level's requests also ran offline on the same engine, right after each repeat.
            assert len(level["repeat_offline_tok_s"]) == 2 and level["offline_tok_s"] > 0
            assert level["vs_offline"] > 0
        # The same requests through the server and offline, alternating: same lengths, both timed.
        single = run["single_stream"]
        assert single["samples"] == 2 and single["same_token_counts"]
        assert single["ratio"] == pytest.approx(single["server_tok_s"] / single["offline_tok_s"])
    table = (tmp_path / "serving.md").read_text()
    assert "| goodput | " in table and "c=2 vs off" in table and "server / offline" in table
    assert "the same requests offline tok/s" in table
    assert (tmp_path / "throughput_vs_concurrency.png").stat().st_size > 1000


def test_bench_generation_profile(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile"
    code = main(["bench", "generation", "--model", str(tiny_llama), "--num-prompts", "1", "--profile",
                 "--profile-steps", "3", "--spec-length", "5", "--out", str(out)])
    assert code == 0
    phases = json.loads((out / "profile.json").read_text())
    assert [p["units"] for p in phases] == [3, 3]
    decode, verify = phases
    assert decode["name"].startswith("decode step") and verify["name"].startswith("verification pass (6 tokens")
    for phase in phases:
        # The embedding, the final norm and the LM head at least are operator calls from Python (the
        # layers too, unless the C decoder stack runs them in one call); nested calls only add to that.
        assert phase["op_calls"] >= 3 and phase["op_calls_all_levels"] >= phase["op_calls"]
        assert phase["matmul_ms"] > 0 and phase["wall_ms"] > 0  # the LM head's at least
        assert (phase["stack_ms"] > 0) == (load_model(str(tiny_llama))[0].backend.cpu_stack is not None)
        assert phase["top_ops"] and all(op["calls"] > 0 for op in phase["top_ops"])
        trace = json.loads(Path(phase["trace"]).read_text())
        assert trace["traceEvents"]
    printed = capsys.readouterr().out
    assert "operator calls per unit" in printed and "trace:" in printed


def _tiny_gguf_template(path: Path, model_dir: Path) -> Path:
    """A GGUF with the metadata llama.cpp's converter writes (no tensors): what the export copies."""
    gguf = pytest.importorskip("gguf")
    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_export_bf16_gguf_writes_the_folder_weights(tiny_llama: Path, tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from infer.bench.peer import gguf_weight_bytes_per_token, rope_pairs_row_order

    template = _tiny_gguf_template(tmp_path / "like.gguf", tiny_llama)
    out = tmp_path / "bf16.gguf"
    assert main(["bench", "export-gguf", "--model", str(tiny_llama), "--like", str(template), "--out", str(out)]) == 0
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_BF16)
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    tensors = {t.name: t for t in reader.tensors}
    weights = {k: v for path in tiny_llama.glob("*.safetensors") for k, v in load_file(path).items()}
    config = json.loads((tiny_llama / "config.json").read_text())
    assert len(tensors) == len(weights)
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.BF16
    stored = torch.from_numpy(q.data.copy()).view(torch.bfloat16).reshape(weights["model.layers.0.self_attn.q_proj.weight"].shape)
    expected = rope_pairs_row_order(weights["model.layers.0.self_attn.q_proj.weight"], config["num_attention_heads"])
    assert torch.equal(stored, expected.to(torch.bfloat16))
    # The reordering pairs row i of each head with row i + head_dim / 2: a permutation, not a copy.
    ranks = torch.arange(float(expected.shape[0])).unsqueeze(1)
    reordered = rope_pairs_row_order(ranks, config["num_attention_heads"]).flatten().tolist()
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert sorted(reordered) == list(range(expected.shape[0])) and reordered[:2] == [0, head_dim // 2]
    norm = tensors["blk.0.attn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(torch.from_numpy(norm.data.copy()), weights["model.layers.0.input_layernorm.weight"].float())
    assert gguf_weight_bytes_per_token(out) < out.stat().st_size


def test_bench_serving_repetitive_workload_with_suffix(tiny_llama: Path, tmp_path: Path) -> None:
    code = main(["bench", "serving", "--model", str(tiny_llama), "--speculator", "suffix", "--workload", "repetitive",
                 "--chat", "--warmup", "1", "--concurrency", "2", "--requests-per-level", "2", "--max-tokens", "6",
                 "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "serving.json").read_text())
    k = SpeculativeConfig.spec_length  # the engine's one default: bench serving declares none of its own
    assert [run["label"] for run in report["runs"]] == ["speculation off", f"suffix K={k}", "suffix goodput"]
    for run in report["runs"]:
        (level,) = run["levels"]
        assert level["errors"] == 0 and level["requests"] == 2 and level["output_tokens"] > 0


def test_bench_step_prints_each_phase(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.json"
    code = main(["bench", "step", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "8",
                 "--repeats", "1", "--threads", "1", "--cpu-time", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    # (the verify pass appears where n-gram drafted: tests/integration/test_step_phases.py)
    for phase in ("scheduling", "model pass", "sampling", "detokenization", "drafting", "output", "in the C kernels"):
        assert phase in printed, phase
    assert "plain decode step:" in printed and "speculative round (ngram):" in printed
    report = json.loads(out.read_text())
    assert report["clock"] == "thread CPU time" and len(report["plain decode step"]) == 1


def test_bench_step_splits_eagle_rounds(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    head = make_eagle3_head(tiny_llama, tmp_path / "head", draft_vocab=list(range(300)))
    code = main(["bench", "step", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "8",
                 "--repeats", "1", "--threads", "1", "--speculator", "eagle", "--eagle-head", str(head)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "speculative round (eagle):" in printed and "drafting" in printed


def test_bench_threads_runs_each_mode_interleaved(tiny_llama: Path, tmp_path: Path) -> None:
    from infer.bench.threads import main as threads_main

    out = tmp_path / "missing" / "threads.json"  # --json's folder is made
    threads_main(["--model", str(tiny_llama), "--modes", "default", "1", "--busy", "1", "--repeats", "2",
                  "--max-tokens", "6", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["tok_s"]) == {"default", "1"} and all(len(v) == 2 for v in report["tok_s"].values())
    assert report["greedy_ids_equal"] is True and report["busy_processes"] == 1
    assert report["orders"] == [["default", "1"], ["1", "default"]]  # each mode first as often


def test_bench_prefill_times_prompt_lengths_and_a_newcomer_behind_a_long_prompt(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """python -m infer.bench.prefill: offline prompt tok/s per length (a fresh process per repeat),
    and a short request's time to first token behind a long one through infer serve; JSON (its
    folder made) and a table."""
    from infer.bench.prefill import main as prefill_main

    out = tmp_path / "missing" / "offline.json"
    prefill_main(["offline", "--model", str(tiny_llama), "--lengths", "32", "96", "--repeats", "2",
                  "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["kind"] == "offline" and len(report["runs"]["this"]) == 2
    assert set(report["median_tok_s"]["this"]) == {"32", "96"} and all(
        rate > 0 for rate in report["median_tok_s"]["this"].values())
    assert report["first_tokens_equal_across_trees"] is True
    out = tmp_path / "ttft.json"
    prefill_main(["ttft", "--model", str(tiny_llama), "--long", "200", "--delay", "0.05", "--repeats", "1",
                  "--max-prefill-tokens", "64", "--json", str(out)])
    report = json.loads(out.read_text())
    (run,) = report["runs"]["this"]
    assert not run["errors"] and report["max_prefill_tokens"] == 64
    assert all(run[key] is not None and run[key] > 0 for key in ("short_alone_ttft_s", "short_behind_long_ttft_s",
                                                                  "long_ttft_s"))
    assert "| short behind long: TTFT s |" in capsys.readouterr().out


def test_bench_generation_stop_at_eos_is_recorded(tiny_llama: Path, tmp_path: Path) -> None:
    """--stop-at-eos ends answers at EOS as server requests do; the report says which length was timed."""
    for flags, stops in (([], False), (["--stop-at-eos"], True)):
        out = tmp_path / f"stops-{stops}"
        code = main(["bench", "generation", "--model", str(tiny_llama), "--workload", "chat", "--num-prompts", "1",
                     "--max-tokens", "4", "--repeats", "1", "--no-ngram", "--no-suffix", "--no-transformers",
                     *flags, "--out", str(out)])
        assert code == 0
        assert json.loads((out / "generation.json").read_text())["settings"]["stop_at_eos"] is stops
