"""Tests for infer.train: pretraining, distillation, output safety, the CLI and the reference pair cache.

Everything runs on tiny models and a tiny corpus on one CPU thread, so the file takes seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.data.corpus import stdlib_root
from infer.data.tokenizer import BOS_ID, EOS_ID
from infer.loader import load_model, load_tokenizer
from infer.train import distill as distill_module
from infer.train import medusa as medusa_train_module
from infer.train import pretrain as pretrain_module
from infer.train import reference as reference_module
from infer.train.common import CHECKPOINT_DIR, MODEL_FILES, build_model, model_config
from infer.train.data import TOKENS_FILE, WindowSampler
from infer.train.distill import DistillConfig, distill, pair_metrics
from infer.train.pretrain import PretrainConfig, pretrain
from infer.train.reference import (
    MARKER_FILE,
    METRICS_FILE,
    ReferenceSettings,
    build_reference_pair,
    reference_pair_dir,
)

TINY_MODEL: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
TINY_DRAFT: dict[str, Any] = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
TINY_RUN: dict[str, Any] = dict(seq_len=48, batch_size=8, device="cpu", threads=1, eval_windows=8,
                                checkpoint_every=0.0)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three small text files (one ends up held out): ~70 KB of stdlib source."""
    d = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "heapq.py", "bisect.py"):
        text = (stdlib_root() / name).read_text(encoding="utf-8")[:30_000]
        (d / name.replace(".py", ".txt")).write_text(text, encoding="utf-8")
    return d


def tiny_pretrain(corpus: Path, out: Path, **overrides: Any) -> PretrainConfig:
    settings: dict[str, Any] = dict(corpus=[str(corpus)], vocab_size=300, lr=5e-3, warmup_steps=5, max_steps=4,
                                    **TINY_MODEL, **TINY_RUN)
    settings.update(overrides)
    return PretrainConfig(out=out, **settings)


@pytest.fixture(scope="module")
def trained_target(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A tiny target trained 40 steps, and its train log."""
    out = tmp_path_factory.mktemp("target") / "model"
    pretrain(tiny_pretrain(corpus_dir, out, max_steps=40, eval_every=20), progress=False)
    return out, json.loads((out / "train_log.json").read_text())


def _hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        return hf(ids).logits


def _infer_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model, _ = load_model(folder, dtype="float32", device="cpu")
    with torch.no_grad():
        return model.compute_logits(model(ids))


def _no_temp_siblings(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name)]


# ---------------------------------------------------------------- pretraining


@pytest.mark.parametrize("tied", [True, False])
def test_pretrain_folder_loads_in_infer_and_transformers(corpus_dir: Path, tmp_path: Path, tied: bool) -> None:
    out = tmp_path / "model"
    result = pretrain(tiny_pretrain(corpus_dir, out, max_steps=3, tie_word_embeddings=tied), progress=False)
    assert result.path == out and result.steps == 3
    for name in (*MODEL_FILES, TOKENS_FILE):
        assert (out / name).is_file(), name
    assert not (out / CHECKPOINT_DIR).exists()
    assert _no_temp_siblings(tmp_path)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is tied and config["vocab_size"] == 300
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"]) == (EOS_ID, BOS_ID)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied  # noqa: SIM118

    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 3 and log["tokens"] == 3 * 8 * 48 and log["train_time_s"] > 0
    assert math.isfinite(log["heldout"]["loss"]) and log["log"][0]["step"] == 1
    args = json.loads((out / "training_args.json").read_text())
    assert args["kind"] == "pretrain" and args["seq_len"] == 48 and args["num_params"] == result.num_params

    tok = load_tokenizer(out)
    assert tok.eos_token_ids == [EOS_ID] and tok.chat_template
    ids = torch.tensor([tok.encode("def shorten(text, width):\n    return text[:width]\n")])
    ours, theirs = _infer_logits(out, ids), _hf_logits(out, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_loss_decreases(trained_target: tuple[Path, dict[str, Any]]) -> None:
    _, log = trained_target
    first, last = log["log"][0]["loss"], log["log"][-1]["loss"]
    assert first > math.log(300) - 0.3  # starts near uniform over the vocab
    assert last < first - 1.0
    evals = [e["loss"] for e in log["evals"]]  # held-out, at steps 20 and 40
    assert len(evals) == 2 and max(evals) < math.log(300) - 1.0
    assert log["heldout"]["loss"] < math.log(300) - 1.0


def test_resume_after_interrupt_matches_uninterrupted_run(corpus_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    reference = pretrain(tiny_pretrain(corpus_dir, tmp_path / "ref", max_steps=8), progress=False)

    out = tmp_path / "model"
    calls = {"n": 0}
    original = WindowSampler.sample

    def interrupting(self: WindowSampler) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(WindowSampler, "sample", interrupting)
    with pytest.raises(KeyboardInterrupt):
        pretrain(tiny_pretrain(corpus_dir, out, max_steps=8, checkpoint_every=3600.0), progress=False)
    # Interrupted: no model files, only the checkpoint (and nothing half-written next to it).
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert (out / CHECKPOINT_DIR / "state.pt").is_file()
    assert _no_temp_siblings(tmp_path)
    monkeypatch.setattr(WindowSampler, "sample", original)

    resumed = pretrain(tiny_pretrain(corpus_dir, out, max_steps=8, resume=True), progress=False)
    assert resumed.steps == 8
    log = json.loads((out / "train_log.json").read_text())
    assert log["sessions"] == 2 and log["steps"] == 8
    assert not (out / CHECKPOINT_DIR).exists()
    ids = torch.tensor([[5, 17, 42, 99, 7, 250, 3]])
    torch.testing.assert_close(_infer_logits(out, ids), _infer_logits(reference.path, ids), atol=1e-6, rtol=0)


def test_resume_refuses_other_settings(corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "model"
    pretrain(tiny_pretrain(corpus_dir, out, max_steps=2, keep_checkpoint=True), progress=False)
    assert (out / CHECKPOINT_DIR / "state.pt").is_file() and (out / "config.json").is_file()
    with pytest.raises(ValueError, match="different settings"):
        pretrain(tiny_pretrain(corpus_dir, out, max_steps=4, hidden_size=32, resume=True), progress=False)
    # Continuing with the same settings trains further.
    more = pretrain(tiny_pretrain(corpus_dir, out, max_steps=4, resume=True), progress=False)
    assert more.steps == 4


def test_failed_save_leaves_no_model(corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "model"

    def broken(folder: Path, *args: Any) -> None:
        (folder / "config.json").write_text("{}")  # half-written...
        raise OSError("disk full")

    monkeypatch.setattr(pretrain_module, "write_model_files", broken)
    with pytest.raises(OSError, match="disk full"):
        pretrain(tiny_pretrain(corpus_dir, out, max_steps=2), progress=False)
    assert not (out / "config.json").exists()
    assert _no_temp_siblings(tmp_path)


def test_existing_model_replaced_atomically(corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "model"
    pretrain(tiny_pretrain(corpus_dir, out, max_steps=2), progress=False)
    before = (out / "model.safetensors").read_bytes()

    def broken(folder: Path, *args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(pretrain_module, "write_model_files", broken)
    with pytest.raises(OSError):
        pretrain(tiny_pretrain(corpus_dir, out, max_steps=3, seed=1), progress=False)
    assert (out / "model.safetensors").read_bytes() == before  # the old complete model is untouched
    monkeypatch.undo()
    pretrain(tiny_pretrain(corpus_dir, out, max_steps=3, seed=1), progress=False)
    assert (out / "model.safetensors").read_bytes() != before
    assert json.loads((out / "train_log.json").read_text())["steps"] == 3
    assert _no_temp_siblings(tmp_path)


# ---------------------------------------------------------------- distillation


def test_distill_lowers_kl(trained_target: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    target_dir, _ = trained_target
    cfg = DistillConfig(target=target_dir, out=tmp_path / "draft", lr=1e-2, warmup_steps=5, max_steps=40,
                        **TINY_DRAFT, **{k: v for k, v in TINY_RUN.items() if k != "seq_len"})
    target, tcfg = load_model(target_dir, dtype="float32", device="cpu")
    untrained = build_model(model_config(vocab_size=tcfg.vocab_size, max_position_embeddings=1024,
                                         tie_word_embeddings=True, **TINY_DRAFT), cfg.seed)
    windows = torch.tensor(
        [[(i * 7 + j * 13) % 300 for j in range(49)] for i in range(2)])  # any ids will do for "before"
    before = pair_metrics(target, untrained, windows, torch.device("cpu"))

    result = distill(cfg, progress=False)
    after = result.heldout
    assert after["kl"] < 0.5 * before["kl"]
    assert after["alpha"] > before["alpha"] and after["agreement"] > 0.3
    assert 0.0 <= after["alpha"] <= 1.0 and after["kl"] >= 0.0

    draft_dir = result.path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (draft_dir / name).read_bytes() == (target_dir / name).read_bytes()
    dcfg = json.loads((draft_dir / "config.json").read_text())
    assert dcfg["vocab_size"] == tcfg.vocab_size and dcfg["eos_token_id"] == EOS_ID
    assert dcfg["num_hidden_layers"] == 1 and dcfg["hidden_size"] == 32
    args = json.loads((draft_dir / "training_args.json").read_text())
    assert args["resolved"]["seq_len"] == 48  # inherited from the target's run
    ids = torch.tensor([[9, 8, 7, 100, 200, 1]])
    torch.testing.assert_close(_infer_logits(draft_dir, ids), _hf_logits(draft_dir, ids), atol=1e-5, rtol=1e-5)


def test_pair_metrics_identical_models(trained_target: tuple[Path, dict[str, Any]]) -> None:
    target, _ = load_model(trained_target[0], dtype="float32", device="cpu")
    windows = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    m = pair_metrics(target, target, windows, torch.device("cpu"))
    assert m["kl"] == pytest.approx(0.0, abs=1e-5)
    assert m["alpha"] == pytest.approx(1.0, abs=1e-5) and m["agreement"] == 1.0


# ---------------------------------------------------------------- CLI


def test_cli_pretrain_and_distill(corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from infer.cli import main

    common = ["--max-steps", "2", "--seq-len", "32", "--batch-size", "2", "--device", "cpu", "--threads", "1",
              "--quiet"]
    target = tmp_path / "t"
    rc = main(["train", "pretrain", "--corpus", str(corpus_dir), "--out", str(target), "--vocab-size", "300",
               "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
               "--intermediate-size", "64", "--no-tie-embeddings", *common])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["tokens"] == 2 * 2 * 32
    assert json.loads((target / "config.json").read_text())["tie_word_embeddings"] is False

    draft = tmp_path / "d"
    rc = main(["train", "distill", "--target", str(target), "--out", str(draft), "--hidden-size", "16",
               "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate-size", "32",
               "--temperature", "2.0", "--ce-weight", "0.5", *common])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and 0.0 <= summary["alpha"] <= 1.0
    args = json.loads((draft / "training_args.json").read_text())
    assert args["temperature"] == 2.0 and args["ce_weight"] == 0.5

    # Errors: a missing target is reported (exit 2), a missing required flag is a usage error.
    assert main(["train", "distill", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "x"),
                 *common]) == 2
    with pytest.raises(SystemExit):
        main(["train", "pretrain", "--max-steps", "2"])


# ---------------------------------------------------------------- reference pair


def tiny_reference(corpus: Path, steps: int = 2) -> ReferenceSettings:
    return ReferenceSettings(
        pretrain=dict(corpus=[str(corpus)], vocab_size=300, max_steps=steps, **TINY_MODEL, **TINY_RUN),
        distill=dict(max_steps=steps, **TINY_DRAFT, **{k: v for k, v in TINY_RUN.items() if k != "seq_len"}),
        eval_windows=4,
    )


def test_reference_pair_builds_then_reuses(corpus_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "pair"
    settings = tiny_reference(corpus_dir)
    target, draft = build_reference_pair(out=folder, settings=settings, progress=False)
    assert (target, draft) == (folder / "target", folder / "draft")
    metrics = json.loads((folder / METRICS_FILE).read_text())
    for key in ("alpha", "greedy_agreement", "kl", "target_params", "draft_params", "build_wall_time_s"):
        assert key in metrics
    assert 0.0 <= metrics["alpha"] <= 1.0 and metrics["target_params"] > metrics["draft_params"]
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["settings_hash"] == settings.settings_hash() and metrics["resumed"] is False
    assert _no_temp_siblings(tmp_path) and not (tmp_path / ".pair.partial").exists()

    calls: list[str] = []

    def counting_pretrain(cfg: PretrainConfig, progress: bool = True) -> Any:
        calls.append("pretrain")
        return pretrain(cfg, progress)

    def counting_distill(cfg: DistillConfig, progress: bool = True) -> Any:
        calls.append("distill")
        return distill(cfg, progress)

    monkeypatch.setattr(reference_module, "pretrain", counting_pretrain)
    monkeypatch.setattr(reference_module, "distill", counting_distill)
    mtime = (folder / MARKER_FILE).stat().st_mtime_ns
    assert build_reference_pair(out=folder, settings=settings, progress=False) == (target, draft)
    assert calls == [] and (folder / MARKER_FILE).stat().st_mtime_ns == mtime

    # Other settings (a different hash) or force: rebuilt in place.
    build_reference_pair(out=folder, settings=tiny_reference(corpus_dir, steps=3), progress=False)
    assert calls == ["pretrain", "distill"]
    assert json.loads((folder / "target" / "train_log.json").read_text())["steps"] == 3
    build_reference_pair(out=folder, settings=tiny_reference(corpus_dir, steps=3), force=True, progress=False)
    assert calls == ["pretrain", "distill"] * 2

    # An incomplete folder (marker missing) is not reused.
    (folder / MARKER_FILE).unlink()
    build_reference_pair(out=folder, settings=tiny_reference(corpus_dir, steps=3), progress=False)
    assert len(calls) == 6


def test_reference_pair_medusa_recipe_change_retrains_only_the_heads(corpus_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "pair"
    base = tiny_reference(corpus_dir)
    with_heads = dataclasses.replace(base, medusa=dict(heads=2, max_steps=2, eval_windows=2, batch_size=2))
    build_reference_pair(out=folder, settings=with_heads, progress=False)
    heads_config = folder / "target" / "medusa" / "medusa_config.json"
    assert json.loads(heads_config.read_text())["training"]["steps"] == 2
    assert with_heads.settings_hash() == base.settings_hash() != ""  # heads are not part of the pair's hash

    def no_model_training(cfg: Any, progress: bool = True) -> Any:
        raise AssertionError("target and draft follow the same recipe and must be reused")

    monkeypatch.setattr(reference_module, "pretrain", no_model_training)
    monkeypatch.setattr(reference_module, "distill", no_model_training)
    target_weights = (folder / "target" / "model.safetensors").stat().st_mtime_ns
    more_steps = dataclasses.replace(with_heads, medusa={**with_heads.medusa, "max_steps": 3})
    build_reference_pair(out=folder, settings=more_steps, progress=False)
    assert json.loads(heads_config.read_text())["training"]["steps"] == 3
    assert json.loads((folder / MARKER_FILE).read_text())["medusa_hash"] == more_steps.medusa_hash()
    assert (folder / "target" / "model.safetensors").stat().st_mtime_ns == target_weights

    # Now current: nothing is trained again.
    monkeypatch.setattr(medusa_train_module, "train_medusa", no_model_training)
    build_reference_pair(out=folder, settings=more_steps, progress=False)


def test_reference_pair_interrupted_build_resumes(corpus_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "pair"
    settings = tiny_reference(corpus_dir)

    def failing_distill(cfg: DistillConfig, progress: bool = True) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(reference_module, "distill", failing_distill)
    with pytest.raises(KeyboardInterrupt):
        build_reference_pair(out=folder, settings=settings, progress=False)
    assert not folder.exists()  # nothing that looks like a pair
    assert (tmp_path / ".pair.partial" / "target" / "config.json").is_file()

    def no_pretrain(cfg: PretrainConfig, progress: bool = True) -> Any:
        raise AssertionError("the finished target should be reused")

    monkeypatch.setattr(reference_module, "pretrain", no_pretrain)
    monkeypatch.setattr(reference_module, "distill", distill_module.distill)
    build_reference_pair(out=folder, settings=settings, progress=False)
    assert (folder / MARKER_FILE).is_file() and not (tmp_path / ".pair.partial").exists()
    # The reused target's time comes from its own log, so the build time still covers every stage.
    metrics = json.loads((folder / METRICS_FILE).read_text())
    logged = json.loads((folder / "target" / "train_log.json").read_text())["wall_time_s"]
    assert metrics["resumed"] is True and metrics["target_build_s"] == pytest.approx(logged, abs=0.1)
    # Each figure is rounded to 0.1 s, so three roundings may take up to 0.15 s off the inequality.
    assert metrics["build_wall_time_s"] >= metrics["target_build_s"] + metrics["draft_build_s"] - 0.15


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{path.relative_to(folder)}:{name}": t for path in sorted(folder.rglob("*.safetensors"))
            for name, t in load_file(str(path)).items()}


def test_reference_pair_is_identical_across_builds(corpus_dir: Path, tmp_path: Path) -> None:
    """Step budgets make the pair a function of the recipe and seed: two builds give equal tensors."""
    settings = dataclasses.replace(tiny_reference(corpus_dir, steps=3),
                                   medusa=dict(heads=2, max_steps=2, eval_windows=2, batch_size=2))
    first = build_reference_pair(out=tmp_path / "a", settings=settings, progress=False)[0].parent
    second = build_reference_pair(out=tmp_path / "b", settings=settings, progress=False)[0].parent
    a, b = _tensors(first), _tensors(second)
    assert len(a) > 10 and any(k.startswith("target/medusa/") for k in a) and any(k.startswith("draft/") for k in a)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    for sub in ("target", "draft"):
        assert json.loads((first / sub / "train_log.json").read_text())["steps"] == 3
    # A different seed gives a different pair (the comparison above can fail).
    reseeded = dataclasses.replace(settings, pretrain={**settings.pretrain, "seed": 1})
    other = _tensors(build_reference_pair(out=tmp_path / "c", settings=reseeded, progress=False)[0].parent)
    name = "target/model.safetensors:model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(other[name], a[name])


def test_reference_recipe_must_be_in_steps(corpus_dir: Path) -> None:
    base = tiny_reference(corpus_dir)
    with pytest.raises(ValueError, match="pretrain: give max_steps"):
        dataclasses.replace(base, pretrain={**base.pretrain, "max_steps": None, "time_budget": 60.0})
    with pytest.raises(ValueError, match="medusa: give max_steps"):
        dataclasses.replace(base, medusa=dict(heads=2, max_steps=5, time_budget=1.0))


def test_reference_pair_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert reference_pair_dir("small") == tmp_path / "infer" / "reference-pair-small"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert reference_pair_dir("large") == tmp_path / "home" / ".cache" / "infer" / "reference-pair-large"
    with pytest.raises(ValueError, match="unknown reference pair size"):
        build_reference_pair(size="medium", progress=False)


def test_reference_sizes_are_sane() -> None:
    """The real recipes: model shapes valid, parameter counts in the intended ranges."""
    for size, settings in reference_module.REFERENCE_SIZES.items():
        pre, dis = settings.pretrain, settings.distill
        PretrainConfig(out=Path("unused"), **pre)  # validates
        t = build_model(model_config(vocab_size=pre["vocab_size"], hidden_size=pre["hidden_size"],
                                     num_layers=pre["num_layers"], num_heads=pre["num_heads"],
                                     num_kv_heads=pre["num_kv_heads"], intermediate_size=pre["intermediate_size"],
                                     max_position_embeddings=1024, tie_word_embeddings=True), 0)
        d = build_model(model_config(vocab_size=pre["vocab_size"], hidden_size=dis["hidden_size"],
                                     num_layers=dis["num_layers"], num_heads=dis["num_heads"],
                                     num_kv_heads=dis["num_kv_heads"], intermediate_size=dis["intermediate_size"],
                                     max_position_embeddings=1024, tie_word_embeddings=True), 0)
        nt, nd = sum(p.numel() for p in t.parameters()), sum(p.numel() for p in d.parameters())
        assert set(settings.total_steps()) == {"pretrain", "distill", "medusa"}
        if size == "small":
            assert 8e6 <= nt <= 12.5e6 and 0.4e6 <= nd <= 1.0e6, (nt, nd)
            assert sum(settings.metadata["expected_s"].values()) <= 600  # the small pair builds in minutes
        else:
            assert nt >= 40e6 and nt >= 10 * nd, (nt, nd)
