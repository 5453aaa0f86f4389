"""The teacher cache: built once from a target, read back exactly, and used to train a draft and
Medusa heads without running the target. Tiny random checkpoints, one CPU thread: seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.data.corpus import stdlib_root
from infer.engine.llm import LLM
from infer.loader import load_model
from infer.sampling.params import SamplingParams
from infer.train import teacher as teacher_module
from infer.train.common import build_model
from infer.train.distill import (
    DistillConfig,
    cache_pair_metrics,
    distill,
    draft_config,
    reuse_target_weights,
)
from infer.train.medusa import MedusaTrainConfig, train_medusa
from infer.train.teacher import (
    BUILDING_FILE,
    GENERATIONS_FILE,
    MANIFEST_FILE,
    CacheSampler,
    TeacherCache,
    TeacherCacheConfig,
    build_teacher_cache,
    teacher_outputs,
    trains_from_cache,
)

TOP_K = 8
WIDTH = 32
TRAIN_WINDOWS, HELDOUT_WINDOWS, PER_SHARD = 120, 8, 50


def cache_config(target: Path, out: Path, corpus: Path, **overrides: Any) -> TeacherCacheConfig:
    settings: dict[str, Any] = dict(target=str(target), out=out, source="corpus", corpus=[str(corpus)],
                                    seq_len=WIDTH, top_k=TOP_K, max_windows=TRAIN_WINDOWS,
                                    heldout_windows=HELDOUT_WINDOWS, batch_size=4, windows_per_shard=PER_SHARD,
                                    device="cpu", threads=1)
    settings.update(overrides)
    return TeacherCacheConfig(**settings)


@pytest.fixture(scope="module")
def corpus_cache(tiny_llama_tied: Path, stdlib_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("teacher") / "cache"
    return build_teacher_cache(cache_config(tiny_llama_tied, out, stdlib_corpus), progress=False)


def test_cache_round_trip(corpus_cache: Path, tiny_llama_tied: Path) -> None:
    """What training reads is exactly what the target computes on the same windows."""
    manifest = json.loads((corpus_cache / MANIFEST_FILE).read_text())
    assert manifest["windows"] == {"train": TRAIN_WINDOWS, "heldout": HELDOUT_WINDOWS}
    assert manifest["source"] == "corpus"
    assert manifest["shards"]["train"] == [f"train-0000{i}.safetensors" for i in range(3)]
    cache = TeacherCache(corpus_cache, hidden=True)
    train = cache.train
    assert train.num_windows == TRAIN_WINDOWS and cache.seq_len == WIDTH
    assert cache.heldout.num_windows == HELDOUT_WINDOWS
    model, config = load_model(tiny_llama_tied, dtype="float32", device="cpu")
    assert cache.target_config.vocab_size == config.vocab_size

    sampler = CacheSampler(train.num_windows, 5, seed=0)
    batch = train.batch(sampler.sample())
    live = teacher_outputs(model, batch.tokens, TOP_K, hidden_states=True)
    assert torch.equal(batch.topk_ids, live["topk_ids"].long())
    torch.testing.assert_close(batch.topk_logprobs, live["topk_logprobs"], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch.rest_logprob, live["rest_logprob"], atol=1e-5, rtol=0)
    assert batch.hidden is not None
    torch.testing.assert_close(batch.hidden, live["hidden"].float(), atol=1e-2, rtol=1e-2)
    # Top-k plus the rest is a whole distribution, sorted, and the window tokens are the corpus stream.
    total = batch.topk_logprobs.exp().sum(-1) + batch.rest_logprob.exp()
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)
    assert (batch.topk_logprobs[..., :-1] >= batch.topk_logprobs[..., 1:]).all()
    assert train.tensors["answer"].bool().all()  # a corpus: every position counts (not only answers)


def test_cache_is_reused_and_an_interrupted_build_continues(corpus_cache: Path, tiny_llama_tied: Path, stdlib_corpus: Path,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = teacher_module.teacher_outputs

    def counting(model: Any, ids: torch.Tensor, top_k: int, hidden_states: bool,
                 aux_layers: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
        calls.append(ids.shape[0])
        return original(model, ids, top_k, hidden_states, aux_layers)

    monkeypatch.setattr(teacher_module, "teacher_outputs", counting)
    settings = cache_config(tiny_llama_tied, corpus_cache, stdlib_corpus)
    assert build_teacher_cache(settings, progress=False) == corpus_cache and calls == []

    # An interrupted build: the manifest not yet written, one shard missing. Only that shard is redone.
    folder = tmp_path / "cache"
    shutil.copytree(corpus_cache, folder)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    (folder / MANIFEST_FILE).unlink()
    (folder / BUILDING_FILE).write_text(json.dumps({"settings_hash": manifest["settings_hash"]}))
    (folder / "train-00001.safetensors").unlink()
    build_teacher_cache(cache_config(tiny_llama_tied, folder, stdlib_corpus), progress=False)
    assert sum(calls) == PER_SHARD and not (folder / BUILDING_FILE).exists()
    rebuilt, original_cache = TeacherCache(folder), TeacherCache(corpus_cache)
    for name, tensor in original_cache.train.tensors.items():
        torch.testing.assert_close(rebuilt.train.tensors[name], tensor, atol=1e-5, rtol=0)

    # Other settings rebuild from scratch.
    calls.clear()
    build_teacher_cache(cache_config(tiny_llama_tied, folder, stdlib_corpus, top_k=4), progress=False)
    assert sum(calls) == TRAIN_WINDOWS + HELDOUT_WINDOWS
    assert TeacherCache(folder).train.tensors["topk_ids"].shape[-1] == 4


def test_distillation_from_the_cache_lowers_the_kl(corpus_cache: Path, tiny_llama_tied: Path,
                                                   tmp_path: Path) -> None:
    cfg = DistillConfig(target=tiny_llama_tied, out=tmp_path / "draft", teacher_cache=str(corpus_cache), num_layers=1,
                        batch_size=8, lr=3e-3, warmup_steps=3, max_steps=40, exact_eval_windows=2, device="cpu",
                        threads=1, checkpoint_every=0.0)
    assert cfg.reuses_embeddings()  # training from a cache defaults to the real-target draft design
    cache = TeacherCache(corpus_cache)
    target, tcfg = load_model(tiny_llama_tied, dtype="float32", device="cpu", fuse=False)
    untrained = build_model(draft_config(cfg, tcfg, True, 1), cfg.seed)
    reuse_target_weights(untrained, target)
    before = cache_pair_metrics(untrained, cache.heldout, torch.device("cpu"), 4, "auto")

    result = distill(cfg, progress=False)
    after = result.heldout
    assert after["kl"] < 0.85 * before["kl"], (before, after)  # held-out windows: measured 0.71x
    assert after["agreement"] >= before["agreement"]
    assert 0.0 <= after["alpha"] <= 1.0 and after["kl_exact"] >= 0.0  # the live target's exact measurement
    # The embeddings (and so the tied head) stayed the target's.
    draft, dcfg = load_model(result.path, dtype="float32", device="cpu", fuse=False)
    assert dcfg.num_hidden_layers == 1 and dcfg.hidden_size == tcfg.hidden_size and dcfg.tie_word_embeddings
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    args = json.loads((result.path / "training_args.json").read_text())
    assert args["teacher_cache"] == str(corpus_cache) and args["reuse_target_embeddings"] is True
    # The draft works as the engine's drafter, losslessly.
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_llama_tied), device="cpu").generate(["def main():"], params)[0]
    spec = LLM(str(tiny_llama_tied), device="cpu", draft_model=str(result.path), spec_length=3, spec_length_policy="fixed").generate(
        ["def main():"], params)[0]
    assert spec.token_ids == plain.token_ids and spec.metrics.proposed_tokens > 0


def test_medusa_heads_train_from_the_cache(corpus_cache: Path, tiny_llama_tied: Path, tmp_path: Path) -> None:
    cfg = MedusaTrainConfig(tiny_llama_tied, heads=2, out=tmp_path / "heads", teacher_cache=str(corpus_cache),
                            batch_size=4, lr=1e-2, max_steps=30, eval_windows=4, device="cpu", threads=1, seed=0)
    result = train_medusa(cfg, progress=False)
    assert result.steps == 30 and result.final_loss < result.initial_loss - 0.1, result
    assert len(result.rank_accuracy) == 2 and all(0.0 <= a <= 1.0 for a in result.top1_accuracy)
    # From a cache the heads share the target's LM head, frozen (one matmul for all heads when drafting).
    from infer.speculative.medusa import MedusaHeads

    heads = MedusaHeads.load(result.out)
    target, _ = load_model(tiny_llama_tied, dtype="float32", device="cpu", fuse=False)
    assert all(torch.equal(h.lm_head.weight, target.lm_head.weight) for h in heads.heads)  # type: ignore[union-attr]
    assert json.loads((result.out / "medusa_config.json").read_text())["training"]["resolved"]["teacher_cache"]
    with pytest.raises(ValueError, match="no hidden states"):
        _cache_without_hidden(tiny_llama_tied, tmp_path)


def _cache_without_hidden(target: Path, tmp_path: Path) -> TeacherCache:
    corpus = tmp_path / "c"
    corpus.mkdir()
    shutil.copy(stdlib_root() / "bisect.py", corpus / "bisect.py")
    folder = build_teacher_cache(cache_config(target, tmp_path / "nohidden", corpus, hidden_states=False,
                                              max_windows=2, heldout_windows=1), progress=False)
    return TeacherCache(folder, hidden=True)


def test_self_distillation_data_is_the_targets_own_answers(tiny_llama_tied: Path, tmp_path: Path) -> None:
    settings = TeacherCacheConfig(target=str(tiny_llama_tied), out=tmp_path / "cache", num_prompts=6,
                                  max_new_tokens=12, gen_temperature=0.0, seq_len=16, top_k=4, held_out_fraction=0.2,
                                  device="cpu", threads=1)
    assert teacher_module.resolve_source(settings) == "self"  # a model infer did not train
    folder = build_teacher_cache(settings, progress=False)
    records = [json.loads(line) for line in (folder / GENERATIONS_FILE).read_text().splitlines()]
    assert len(records) == 6 and all(0 < len(r["output"]) <= 12 for r in records)
    # Greedy answers are what the engine generates for the same prompt.
    again = LLM(str(tiny_llama_tied), device="cpu").generate(
        [records[0]["prompt"]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert again.token_ids == records[0]["output"]
    # The answer flags mark exactly the positions whose next token the model generated.
    stream = [t for r in records for t in r["prompt"] + r["output"]]
    generated = [0] * len(stream)
    offset = 0
    for r in records:
        offset += len(r["prompt"])
        for i in range(len(r["output"])):
            generated[offset + i] = 1
        offset += len(r["output"])
    cache = TeacherCache(folder)
    tokens, answer = cache.train.tensors["tokens"].flatten().tolist(), cache.train.tensors["answer"].flatten().tolist()
    assert tokens == stream[:len(tokens)]
    assert answer == generated[1:len(tokens) + 1]
    assert cache.splits["heldout"].num_windows >= 1 and sum(answer) > 0


def test_answers_come_in_prompt_order_and_an_interrupted_generation_continues(tiny_llama_tied: Path,
                                                                              tmp_path: Path) -> None:
    """Every prompt goes to the engine at once (answers finish in any order) yet generations.jsonl
    lists them in prompt order, sampled answers are each prompt's own seeded ones, and a build
    interrupted after some answers generates only the rest."""
    settings = TeacherCacheConfig(target=str(tiny_llama_tied), out=tmp_path / "cache", num_prompts=8,
                                  max_new_tokens=10, seq_len=16, top_k=4, held_out_fraction=0.2, gen_batch_size=3,
                                  device="cpu", threads=1)
    folder = build_teacher_cache(settings, progress=False)
    records = [json.loads(line) for line in (folder / GENERATIONS_FILE).read_text().splitlines()]
    prompts = [r["prompt"] for r in records]
    alone = LLM(str(tiny_llama_tied), device="cpu").generate(
        [prompts[5]], SamplingParams(max_tokens=10, temperature=settings.gen_temperature, min_p=settings.gen_min_p,
                                     seed=5))[0]
    assert alone.token_ids == records[5]["output"]  # the seed follows the prompt, not the batch
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    (folder / MANIFEST_FILE).unlink()
    (folder / BUILDING_FILE).write_text(json.dumps({"settings_hash": manifest["settings_hash"]}))
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    (folder / GENERATIONS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    build_teacher_cache(settings, progress=False)
    again = [json.loads(line) for line in (folder / GENERATIONS_FILE).read_text().splitlines()]
    assert again == records
    stats = json.loads((folder / MANIFEST_FILE).read_text())["source_stats"]
    assert stats["reused"] == 3 and stats["generated_tokens"] == sum(len(r["output"]) for r in records[3:])


def test_which_targets_train_from_a_cache(tiny_llama_tied: Path, stdlib_corpus: Path, tmp_path: Path) -> None:
    target = str(tiny_llama_tied)
    assert trains_from_cache(None, None, target)  # a checkpoint infer did not train: self-distillation
    assert not trains_from_cache(None, [str(stdlib_corpus)], target)  # a corpus given: the live target runs on it
    infer_trained = tmp_path / "toy"
    shutil.copytree(tiny_llama_tied, infer_trained)
    (infer_trained / "training_args.json").write_text(json.dumps({"kind": "pretrain"}))
    assert not trains_from_cache(None, None, str(infer_trained))
    assert trains_from_cache("auto", None, str(infer_trained))
    assert MedusaTrainConfig(tiny_llama_tied).trains_projection() is False
    assert MedusaTrainConfig(infer_trained).trains_projection() is True
    with pytest.raises(ValueError, match="top_k"):
        build_teacher_cache(cache_config(tiny_llama_tied, tmp_path / "big", stdlib_corpus, top_k=10_000), progress=False)


@pytest.mark.parametrize(("field", "value"), [("gen_min_p", 1.5), ("gen_min_p", -0.1), ("aux_layers", ()),
                                              ("aux_layers", (2, -1))])
def test_bad_generation_and_state_settings_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        TeacherCacheConfig(target="unused", **{field: value})
    TeacherCacheConfig(target="unused", gen_min_p=0.0, aux_layers=(0, 3))  # the edges are fine
