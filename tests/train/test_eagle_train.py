"""``infer train eagle``: end to end on a tiny target, from a teacher cache of its own answers.

The run must lower the held-out loss, save a head in the published layout where ``--speculator eagle``
finds it, resume from a checkpoint, and the saved head must draft losslessly (greedy = plain)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infer import LLM, SamplingParams
from infer.cli import main
from infer.models.eagle3 import Eagle3Head
from infer.train.eagle import EagleTrainConfig, train_eagle, ttt_loss
from infer.train.teacher import TeacherCacheConfig, build_teacher_cache


@pytest.fixture(scope="module")
def answers_cache(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's own answers (source "self", as for a real model), a few short ones."""
    out = tmp_path_factory.mktemp("eagle_teacher") / "cache"
    return build_teacher_cache(TeacherCacheConfig(target=str(tiny_llama), out=out, source="self", num_prompts=12,
                                                  max_new_tokens=24, seq_len=32, top_k=8, heldout_windows=4, held_out_fraction=0.3,
                                                  gen_dtype="float32", device="cpu", threads=1), progress=False)


def test_train_eagle_learns_saves_and_drafts_losslessly(tiny_llama: Path, answers_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "eagle"
    cfg = EagleTrainConfig(target=str(tiny_llama), out=out, teacher_cache=str(answers_cache), draft_vocab_size=200,
                           ttt_steps=2, max_steps=40, batch_size=4, lr=3e-3, eval_every=0, device="cpu", threads=1)
    result = train_eagle(cfg, progress=False)
    assert result.final["loss"] < result.initial["loss"] - 0.05, (result.initial, result.final)
    config = json.loads((out / "config.json").read_text())
    assert 1 < config["draft_vocab_size"] <= 200 and config["num_hidden_layers"] == 1
    assert len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    head = Eagle3Head.load(out)
    assert int(head.t2d.sum()) == config["draft_vocab_size"] and not (out / ".checkpoint").exists()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["def f(x):", "Hello there"]
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(prompts, params)
    eagle = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="eagle", eagle_head=str(out),
                eagle_tree_size=8, spec_length=3, spec_length_policy="fixed").generate(prompts, params)
    assert [o.token_ids for o in eagle] == [o.token_ids for o in plain]


def test_train_eagle_resumes_from_its_checkpoint(tiny_llama: Path, answers_cache: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted run (Ctrl-C) leaves a checkpoint; ``--resume`` continues from its step."""
    import infer.train.eagle as eagle_module

    out = tmp_path / "eagle"
    args = ["train", "eagle", "--target", str(tiny_llama), "--out", str(out), "--teacher-cache", str(answers_cache),
            "--draft-vocab-size", "100", "--ttt-steps", "2", "--max-steps", "12", "--eval-every", "0",
            "--device", "cpu", "--threads", "1", "--quiet"]
    calls = {"n": 0}
    real = eagle_module.ttt_loss

    def interrupted(*a: object, **k: object) -> object:
        calls["n"] += 1
        if calls["n"] == 8:  # a few training steps in (the first evaluation runs one batch)
            raise KeyboardInterrupt
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(eagle_module, "ttt_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(args)
    assert (out / ".checkpoint").is_dir() and list(answers_cache.glob("eagle-states-*.pt"))
    monkeypatch.setattr(eagle_module, "ttt_loss", real)
    assert main([*args, "--resume"]) == 0
    head = Eagle3Head.load(out)
    assert head.config.training["steps"] == 12 and head.config.training["sessions"] == 2  # continued, not restarted


def test_ttt_steps_see_their_own_outputs(tiny_llama: Path) -> None:
    """Step s's rows depend on step s - 1's outputs (training-time test), and step 0's row t on
    tokens up to t + 1 only (causal)."""
    from infer.loader import load_model
    from infer.train.eagle import head_for

    target, config = load_model(str(tiny_llama), "float32", "cpu", fuse=False, pack=False)
    head = head_for(target, (1, 1, 2), torch.arange(100), seed=0)
    with torch.no_grad():  # the fresh head's layer adds nothing yet: give it weights that mix positions
        for param in (head.midlayer.self_attn.o_proj.weight, head.midlayer.mlp.down_proj.weight, head.fc.weight):
            param.normal_(0.0, 0.1)
    tokens = torch.randint(0, 100, (1, 12))
    aux = torch.randn(1, 12, 3 * config.hidden_size)
    batch = {"tokens": tokens, "aux": aux, "answer": torch.ones(1, 12, dtype=torch.bool),
             "topk_ids": torch.randint(0, 100, (1, 12, 4)), "topk_logprobs": torch.full((1, 12, 4), -1.5)}
    loss, losses, _ = ttt_loss(head, target.model.embed_tokens, batch, 3)
    assert len(losses) == 3 and torch.isfinite(loss)
    changed = dict(batch, aux=aux.clone())
    changed["aux"][0, 8] += 1.0  # a late state: early rows of step 0 must not move
    loss_a, losses_a, _ = ttt_loss(head, target.model.embed_tokens, dict(batch, answer=_only(0)), 1)
    loss_b, _, _ = ttt_loss(head, target.model.embed_tokens, dict(changed, answer=_only(0)), 1)
    assert torch.equal(loss_a, loss_b)
    # ... while the row whose own state changed moves.
    loss_c, _, _ = ttt_loss(head, target.model.embed_tokens, dict(batch, answer=_only(8)), 1)
    loss_d, _, _ = ttt_loss(head, target.model.embed_tokens, dict(changed, answer=_only(8)), 1)
    assert not torch.equal(loss_c, loss_d)
    # Position 9 judges step 0's row 8 (which reads the changed state) and step 1's row 7, a depth-1
    # node whose root is 7: it sits at position 8 but must not see step 0's key there (the target's
    # state at 8 does not exist yet when drafting from root 7).
    steps_a = ttt_loss(head, target.model.embed_tokens, dict(batch, answer=_only(8)), 2)[1]
    steps_b = ttt_loss(head, target.model.embed_tokens, dict(changed, answer=_only(8)), 2)[1]
    assert steps_a[0] != steps_b[0] and steps_a[1] == steps_b[1]


def _only(index: int) -> torch.Tensor:
    answer = torch.zeros(1, 12, dtype=torch.bool)
    answer[0, index + 1] = True  # row `index` of step 0 is judged at position index + 1
    return answer


def test_one_pass_gives_the_distributions_and_the_states_the_head_reads(tiny_llama: Path, tmp_path: Path) -> None:
    """A cache built with ``aux_layers`` holds, from its one pass of the served target, the same top-k
    distributions as a cache without them and the same states a separate capture pass gives; EAGLE
    training then reads them (no capture pass, no states file), and the settings hash tells the two
    caches apart."""
    from infer.loader import load_config, load_model
    from infer.models.eagle3 import default_aux_layers
    from infer.train.eagle import capture_features, target_states
    from infer.train.teacher import TeacherCache, settings_hash

    layers = default_aux_layers(load_config(str(tiny_llama)).num_hidden_layers)
    common = dict(target=str(tiny_llama), source="self", num_prompts=6, max_new_tokens=12, seq_len=16, top_k=4,
                  held_out_fraction=0.2, hidden_states=False, gen_dtype="float32", device="cpu", threads=1)
    plain_cfg = TeacherCacheConfig(out=tmp_path / "plain", **common)  # type: ignore[arg-type]
    merged_cfg = TeacherCacheConfig(out=tmp_path / "merged", aux_layers=layers, **common)  # type: ignore[arg-type]
    assert settings_hash(plain_cfg) != settings_hash(merged_cfg)
    plain = TeacherCache(build_teacher_cache(plain_cfg, progress=False))
    merged = TeacherCache(build_teacher_cache(merged_cfg, progress=False), aux=True)
    assert merged.manifest["aux_layers"] == list(layers) and "aux" not in plain.train.tensors
    for key in ("tokens", "topk_ids", "topk_logprobs", "rest_logprob"):
        assert torch.equal(plain.train.tensors[key], merged.train.tensors[key]), key
    served, _ = load_model(str(tiny_llama), dtype=torch.float32, device="cpu")
    captured = capture_features(served, merged.train, None, layers, 4, False, "states")
    assert torch.equal(captured.tensors["aux"], merged.train.tensors["aux"])
    cfg = EagleTrainConfig(target=str(tiny_llama), teacher_cache=str(merged.folder), max_windows=None, device="cpu")
    train, _ = target_states(cfg, merged, layers, "llama", torch.device("cpu"), progress=False)
    assert torch.equal(train.tensors["aux"], merged.train.tensors["aux"])
    assert not list(merged.folder.glob("eagle-states-*.pt"))
