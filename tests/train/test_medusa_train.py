"""Training Medusa heads on a frozen target: the loss goes down, the files and the CLI work."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from infer.engine.llm import LLM
from infer.loader import load_model
from infer.models.medusa_heads import CONFIG_FILE, HEADS_FILE, MedusaHeads
from infer.sampling.params import SamplingParams
from infer.speculative.medusa import medusa_tree
from infer.train.medusa import MedusaTrainConfig, add_medusa_parser, train_medusa


@pytest.mark.parametrize("objective", ["distill", "ce"])
def test_training_lowers_the_heads_loss(tiny_llama: Path, stdlib_corpus: Path, tmp_path: Path, objective: str) -> None:
    target_before = {k: v.clone() for k, v in load_model(tiny_llama, "float32", "cpu")[0].state_dict().items()}
    cfg = MedusaTrainConfig(tiny_llama, heads=2, out=tmp_path / "heads", corpus=[str(stdlib_corpus)], objective=objective,
                            max_steps=40, batch_size=4, seq_len=32, lr=3e-3, seed=0, device="cpu", threads=1)
    result = train_medusa(cfg, progress=False)
    assert result.steps == 40
    assert result.final_loss < result.initial_loss - 0.1, (result.initial_loss, result.final_loss)
    assert result.train_losses[-1] < result.train_losses[0]
    assert (result.out / HEADS_FILE).is_file() and (result.out / CONFIG_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]  # no temporary folders left
    config = json.loads((result.out / CONFIG_FILE).read_text())
    assert config["num_heads"] == 2 and len(config["rank_accuracy"]) == 2
    assert config["training"]["objective"] == objective and config["training"]["steps"] == 40
    # The target stayed frozen (the heads own copies of its LM head).
    after = load_model(tiny_llama, "float32", "cpu")[0].state_dict()
    assert all(torch.equal(target_before[k], after[k]) for k in after)
    heads = MedusaHeads.load(result.out)
    assert medusa_tree(heads.config).size == heads.config.tree_size


def test_training_is_reproducible_and_respects_a_time_budget(tiny_llama: Path, stdlib_corpus: Path, tmp_path: Path) -> None:
    def config(out: str, **kw: object) -> MedusaTrainConfig:
        base: dict[str, object] = dict(heads=1, corpus=[str(stdlib_corpus)], batch_size=2, seq_len=16, seed=3,
                                       device="cpu", threads=1, log_every=1, max_steps=5)
        return MedusaTrainConfig(tiny_llama, out=tmp_path / out, **{**base, **kw})  # type: ignore[arg-type]

    a = train_medusa(config("a"), progress=False)
    b = train_medusa(config("b"), progress=False)
    assert a.train_losses == b.train_losses and len(a.train_losses) == 5
    timed = train_medusa(config("c", max_steps=None, time_budget=0.5), progress=False)
    assert timed.steps >= 1 and timed.train_time < 5
    with pytest.raises(ValueError, match="max_steps or time_budget"):
        train_medusa(config("d", max_steps=None, time_budget=None), progress=False)
    with pytest.raises(ValueError, match="objective"):
        config("e", objective="typical")


def test_cli_trains_into_the_target_folder_and_generate_uses_it(tiny_llama: Path, stdlib_corpus: Path,
                                                                tmp_path: Path) -> None:
    target = tmp_path / "target"
    shutil.copytree(tiny_llama, target)
    parser = argparse.ArgumentParser(prog="infer train")
    add_medusa_parser(parser.add_subparsers(dest="what", required=True))
    args = parser.parse_args(["medusa", "--target", str(target), "--heads", "2", "--corpus", str(stdlib_corpus),
                              "--max-steps", "5", "--batch-size", "2", "--seq-len", "16", "--tree-size", "6",
                              "--device", "cpu", "--threads", "1", "--quiet"])
    assert args.func(args) == 0
    assert (target / "medusa" / HEADS_FILE).is_file()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target), dtype="float32", device="cpu").generate(["def main():"], params)[0]
    medusa = LLM(str(target), dtype="float32", device="cpu", speculator="medusa").generate(["def main():"], params)[0]
    assert medusa.token_ids == plain.token_ids
    assert medusa.metrics.num_rounds > 0
