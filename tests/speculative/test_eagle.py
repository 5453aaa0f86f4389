"""EAGLE-3: the published head layout, the target's aux hidden states on every path, and exactness.

Heads are random and written by ``checkpoints.make_eagle3_head`` in vLLM/SGLang's layout (by hand, not
by infer's own saver). Their guesses are poor, which only changes the speed: greedy output must be the
plain output token for token, and sampled output must follow the target's distribution (the chi-square
harness of ``test_medusa_exactness.py``, with a negative control that must be caught).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import infer.speculative.verification as verification
from checkpoints import make_eagle3_head
from helpers import (
    P_CONTROL,
    P_THRESHOLD,
    PROMPT,
    TREE_CONFIGS,
    TREE_NUM_SAMPLES,
    first_token_chisquare,
    generate_unseeded,
    grouped_chisquare,
    reference,
)
from infer import LLM, SamplingParams
from infer.cache import make_pool
from infer.cache.protocol import build_kv_batch
from infer.loader import load_model
from infer.models.eagle3 import Eagle3Head, default_aux_layers
from infer.models.layers import AuxCapture
from infer.models.quantized import QuantLinear
from infer.speculative.eagle import default_head_dir, load_eagle_head

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "import os\nimport sys\n"]


def test_head_loads_the_published_layout(tiny_llama: Path, tmp_path: Path) -> None:
    """Every tensor of a vLLM-layout head lands where the layer reads it; d2t maps draft ids to target ids."""
    from safetensors.torch import load_file

    draft_vocab = list(range(0, 512, 2))  # every other token: d2t[d] = d
    folder = make_eagle3_head(tiny_llama, tmp_path / "head", draft_vocab=draft_vocab, aux_layers=[0, 1, 2])
    head = Eagle3Head.load(folder)
    raw = load_file(str(folder / "model.safetensors"))
    state = head.state_dict()
    for name, tensor in raw.items():
        assert torch.equal(state[name], tensor), name
    assert head.embed_tokens is None  # shares the target's
    assert head.target_ids.tolist() == draft_vocab
    assert head.t2d.sum() == len(draft_vocab) and bool(head.t2d[2]) and not bool(head.t2d[3])
    assert head.config.aux_layers == (0, 1, 2) and head.config.draft_vocab_size == 256


def test_head_files_round_trip_and_resolve_aux_layers(tiny_llama: Path, tmp_path: Path) -> None:
    folder = make_eagle3_head(tiny_llama, tmp_path / "head", own_embeddings=True)
    config, _ = load_model(str(tiny_llama), "float32", "cpu")[1], None
    head = load_eagle_head(str(folder), str(tiny_llama), config, torch.float32, torch.device("cpu"))
    assert head.config.aux_layers == default_aux_layers(config.num_hidden_layers)
    assert head.embed_tokens is not None
    head.save(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["draft_vocab_size"] == 512 and saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    again = Eagle3Head.load(tmp_path / "again")
    for name, tensor in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_bad_heads_are_refused_by_name(tiny_llama: Path, small_target: Path, tmp_path: Path) -> None:
    folder = make_eagle3_head(small_target, tmp_path / "small")  # vocabulary 10, hidden 32
    config = load_model(str(tiny_llama), "float32", "cpu")[1]
    with pytest.raises(ValueError, match="vocabulary 10"):
        load_eagle_head(str(folder), str(tiny_llama), config, torch.float32, torch.device("cpu"))
    broken = make_eagle3_head(tiny_llama, tmp_path / "broken")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing midlayer.hidden_norm.weight"):
        Eagle3Head.load(broken)
    with pytest.raises(FileNotFoundError, match="infer train eagle"):
        LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="eagle", eagle_head=str(tmp_path / "none"))


@pytest.mark.parametrize("quantization", ["none", "q4_0"])
def test_aux_states_change_no_bits_and_match_the_layers(tiny_llama: Path, quantization: str) -> None:
    """Capturing layer inputs (copied out by the same C stack call) leaves the final hidden states bit for
    bit as they were, and the captured states are those the layers compute."""
    model, config = load_model(str(tiny_llama), "float32", "cpu", quantization=quantization)
    assert model.backend.cpu_stack is not None or not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    layers = (0, 1, config.num_hidden_layers)  # the embeddings, a layer's input, the last output
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)

    def run(aux: AuxCapture | None, stack: bool) -> torch.Tensor:
        backend = model.backend
        saved = backend.cpu_stack
        if not stack:
            backend.cpu_stack = None
        try:
            pool = make_pool("paged", num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                             head_dim=config.head_dim, max_seq_len=64, max_batch_size=1, block_size=8,
                             num_blocks=None, dtype=torch.float32, device=torch.device("cpu"))
            slot = pool.allocate()
            kv = build_kv_batch(pool, [slot], [0], [ids.shape[1]], None)
            with torch.inference_mode():
                return backend.forward(model, ids, positions, kv, aux)  # type: ignore[no-any-return]
        finally:
            backend.cpu_stack = saved

    plain = run(None, stack=True)
    captured = AuxCapture(layers)
    stack = model.backend.cpu_stack
    calls = []
    if stack is not None:  # one C call, capture included (no split into segments)
        library = stack.library
        original = library.decoder_stack

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(kwargs.get("capture", args[6] if len(args) > 6 else None))
            return original(*args, **kwargs)  # type: ignore[no-any-return]

        library.decoder_stack = counted  # type: ignore[method-assign]
    try:
        assert torch.equal(run(captured, stack=True), plain)
    finally:
        if stack is not None:
            del library.decoder_stack
    if stack is not None:
        # (the last layer's output is the call's own result)
        assert len(calls) == 1 and sorted(calls[0]) == [i for i in layers if 0 < i < config.num_hidden_layers]
        bad = {1: torch.empty(3)}
        x = torch.zeros(1, ids.shape[1], config.hidden_size)
        with pytest.raises(ValueError, match=r"capture buffer 1 has shape \(3,\)"):
            library.decoder_stack(x, x, x, stack.table, None, None, bad)  # type: ignore[arg-type]
        # Column blocks of one wider tensor are taken (rows evenly spaced); a buffer whose rows are
        # not contiguous, or two whose rows lie differently far apart, are refused.
        wide = torch.zeros(1, ids.shape[1], 2 * config.hidden_size)
        for bad, why in (({1: wide[..., ::2]}, "rows must each be contiguous"),
                         ({1: wide[..., : config.hidden_size], 2: torch.zeros_like(x)}, "as far apart")):
            with pytest.raises(ValueError, match=why):
                library.decoder_stack(x, x, x, stack.table, None, None, bad)  # type: ignore[arg-type]
        # the states landed side by side in one tensor, as the pass filled them: no concatenation
        assert captured.joined is not None and captured.result() is captured.joined
        twice = AuxCapture((1, 1))  # an id twice: its state in two blocks, by concatenation
        run(twice, stack=True)
        hidden = config.hidden_size
        assert twice.joined is None and torch.equal(twice.result()[..., :hidden], twice.result()[..., hidden:])
        torch.testing.assert_close(twice.result()[..., :hidden], captured.result()[..., hidden: 2 * hidden])
    reference_aux = AuxCapture(layers)
    run(reference_aux, stack=False)
    assert captured.result().shape == (1, ids.shape[1], 3 * config.hidden_size)
    torch.testing.assert_close(captured.result(), reference_aux.result(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("options", [{}, {"backend": "torch"}, {"quantization": "q4_0"},
                                     {"chunked_prefill": True, "max_prefill_tokens": 5, "prefix_caching": True,
                                      "block_size": 4}],
                         ids=["default-backend", "torch", "q4_0", "chunked-prefix-cached"])
def test_greedy_output_is_plain_output(tiny_llama: Path, tmp_path: Path, options: dict[str, Any]) -> None:
    head = make_eagle3_head(tiny_llama, tmp_path / "head", draft_vocab=list(range(300)))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu", **(options | {"prefix_caching": False})).generate(
        PROMPTS, params)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="eagle", eagle_head=str(head),
              eagle_tree_size=12, spec_length=4, spec_length_policy="fixed", max_batch_size=2, **options)
    eagle = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in eagle] == [o.token_ids for o in plain]
    assert sum(o.metrics.proposed_tokens for o in eagle) > 0  # it did draft
    # A target on the quantized kernels gets a Q8_0 head (every projection; q/k/v and gate/up fused:
    # fc, qkv, o, gate_up, down, lm_head); a float one keeps it float.
    head_modules = list(llm.engine.runner.drafter.head.modules())  # type: ignore[attr-defined]
    quantized = [m for m in head_modules if isinstance(m, QuantLinear)]
    assert len(quantized) == (6 if options.get("quantization") == "q4_0" else 0)
    assert all(m.qtypes == ["Q8_0"] for m in quantized)
    if options.get("prefix_caching"):  # again: now the prompts' blocks come from the prefix cache, never observed
        again = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in again] == [o.token_ids for o in plain]
        assert sum(o.metrics.prefix_cached_tokens for o in again) > 0


def test_head_is_found_where_training_saves_it(tiny_llama: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_head_dir(str(tiny_llama)) == tiny_llama / "eagle"
    from infer.loader.hub import drafters_dir

    assert default_head_dir("smollm2-135m-instruct") == drafters_dir("smollm2-135m-instruct") / "eagle"


# ------------------------------------------------------------------------------ distribution


@pytest.fixture(scope="module")
def engine(small_target: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    # Draft vocabulary: 8 of the 10 tokens (d2t exercised); a fixed tree of 8 nodes, at most 2 deep.
    head = make_eagle3_head(small_target, tmp_path_factory.mktemp("eagle_small") / "eagle",
                            draft_vocab=[0, 1, 2, 4, 5, 6, 7, 9], std=0.3)
    return LLM(str(small_target), speculator="eagle", eagle_head=str(head), dtype="float32", device="cpu",
               max_batch_size=256, max_seq_len=32, eagle_tree_size=8, spec_length=2, spec_length_policy="fixed")


def run_engine(llm: LLM, params: dict[str, Any], n: int = TREE_NUM_SAMPLES, seed0: int = 0) -> tuple[np.ndarray, int, int]:
    # Unseeded requests: a seeded one draws plain decoding's tokens by keyed noise, never the
    # rejection sampler this test (and its negative control) is about.
    outputs = generate_unseeded(llm, [PROMPT] * n, SamplingParams(max_tokens=4, ignore_eos=True, **params), seed0)
    assert all(len(o.token_ids) == 4 for o in outputs)
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    return samples, sum(o.metrics.proposed_tokens for o in outputs), sum(o.metrics.accepted_tokens for o in outputs)


@pytest.mark.parametrize("config", ["temperature_1", "temperature_0.7_top_k_3"])
def test_eagle_samples_follow_target_distribution(engine: LLM, small_target: Path, config: str) -> None:
    samples, proposed, accepted = run_engine(engine, TREE_CONFIGS[config])
    ref = reference(small_target, PROMPT, SamplingParams(**TREE_CONFIGS[config]))  # type: ignore[arg-type]
    assert proposed > TREE_NUM_SAMPLES // 2 and 0 < accepted < proposed  # both verdicts were exercised
    first = first_token_chisquare(samples, ref)
    assert first.impossible == 0 and first.pvalue > P_THRESHOLD, f"x1: chi2={first.statistic:.1f}"
    joint = grouped_chisquare(samples, ref)
    assert joint.impossible == 0, f"{joint.impossible} samples fell on zero-probability (x2, x3) cells"
    assert joint.dof >= 20
    assert joint.pvalue > P_THRESHOLD, f"(x2, x3 | x1): chi2={joint.statistic:.1f}, dof={joint.dof}"


def test_negative_control_broken_residual_is_detected(engine: LLM, small_target: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(probs: torch.Tensor, rejected: Any) -> torch.Tensor:
        return probs  # forgets that the rejected siblings must not be drawn again

    monkeypatch.setattr(verification, "residual_after_rejections", broken)
    samples, _, _ = run_engine(engine, TREE_CONFIGS["temperature_1"], n=2000, seed0=10_000_000)
    ref = reference(small_target, PROMPT, SamplingParams(temperature=1.0))
    assert grouped_chisquare(samples, ref).pvalue < P_CONTROL


def test_quantized_head_projections_match_float(tiny_llama: Path, tmp_path: Path) -> None:
    # The Q8_0 head computes what the float head does, within Q8_0's rounding of weights and
    # activations; widths that are not whole blocks stay float.
    from infer.kernels.quant import quant_kernels
    from infer.loader.quantized import quantize_linears

    kernels = quant_kernels()
    assert kernels is not None  # every CPU kind builds at least the portable variant
    folder = make_eagle3_head(tiny_llama, tmp_path / "head")
    float_head = Eagle3Head.load(folder, torch.float32, torch.device("cpu"))
    head = Eagle3Head.load(folder, torch.float32, torch.device("cpu"))
    odd = torch.nn.Linear(40, 8)
    head.add_module("odd", odd)
    assert quantize_linears(head, kernels) == 9
    assert head.odd is odd  # 40 is not a whole number of 32-value blocks
    x = torch.randn(5, head.config.hidden_size)
    for name in ("midlayer.mlp.gate_proj", "lm_head"):
        want = float_head.get_submodule(name)(x)
        got = head.get_submodule(name)(x)
        assert isinstance(head.get_submodule(name), QuantLinear)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        assert not torch.equal(got, want)  # it really ran on the quantized blocks


def test_fused_head_computes_what_the_published_layout_does(tiny_llama: Path, tmp_path: Path) -> None:
    folder = make_eagle3_head(tiny_llama, tmp_path / "head")
    head = Eagle3Head.load(folder, torch.float32, torch.device("cpu"))
    fused = Eagle3Head.load(folder, torch.float32, torch.device("cpu"))
    fused.fuse()
    assert fused.midlayer.self_attn.qkv_proj is not None and not hasattr(fused.midlayer.self_attn, "q_proj")
    hidden = head.config.hidden_size
    embeds, state = torch.randn(1, 3, hidden), torch.randn(1, 3, hidden)
    cos, sin = head.rope(torch.arange(3).unsqueeze(0), torch.float32)
    for want, got in zip(head.midlayer.qkv(embeds, state, cos, sin), fused.midlayer.qkv(embeds, state, cos, sin),
                         strict=True):
        torch.testing.assert_close(got, want)
    x = torch.randn(4, hidden)
    torch.testing.assert_close(fused.midlayer.mlp(x), head.midlayer.mlp(x))


def test_pruned_tree_proposes_what_full_expansion_does(tiny_llama: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A candidate at or below the budget-th best score has no descendant the proposal keeps, so
    # skipping its expansion (and stopping once none is left) changes no proposal, only the head's work.
    from infer.speculative.eagle import EagleDrafter

    head = make_eagle3_head(tiny_llama, tmp_path / "head", draft_vocab=list(range(300)), std=1.0)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run() -> tuple[list[Any], int]:
        llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="eagle", eagle_head=str(head),
                  eagle_tree_size=6, spec_length=5, spec_length_policy="fixed")
        drafter = llm.engine.runner.drafter  # type: ignore[attr-defined]
        proposals: list[Any] = []
        rows = [0]
        propose, qkv = drafter.propose, drafter._qkv

        def recording_propose(*args: Any) -> Any:
            proposal = propose(*args)
            proposals.append((proposal.tokens.tolist(), proposal.num_tokens, proposal.parents.tolist()))
            return proposal

        def counting_qkv(embeds: torch.Tensor, *args: Any) -> Any:
            rows[0] += embeds.shape[0]
            return qkv(embeds, *args)

        monkeypatch.setattr(drafter, "propose", recording_propose)
        monkeypatch.setattr(drafter, "_qkv", counting_qkv)
        llm.generate(PROMPTS, params)
        return proposals, rows[0]

    pruned, pruned_rows = run()
    monkeypatch.setattr(EagleDrafter, "_floor", staticmethod(lambda tree, budget: float("-inf")))
    full, full_rows = run()
    assert pruned == full and len(full) > 10
    assert pruned_rows < full_rows  # the pruning did skip expansions (else this test proves nothing)


def test_observed_states_are_held_once_in_position_order(tiny_llama: Path, tmp_path: Path) -> None:
    """The target states the runner hands over (a prompt, then one a step, a retried pass repeating
    positions, a restart after a gap) are kept in one growing buffer, position for position, and the
    catch-up feeds exactly those to the head, then starts over."""
    from types import SimpleNamespace

    from infer.speculative.eagle import EagleDrafter

    head = Eagle3Head.load(make_eagle3_head(tiny_llama, tmp_path / "head"), torch.float32, torch.device("cpu"))
    head.config.aux_layers = (1, 2, 3)
    width = 3 * head.config.target_hidden_size
    drafter = EagleDrafter(head, lambda ids: torch.zeros(*ids.shape, head.config.hidden_size), "cpu",
                           max_draft_tokens=4, max_depth=2, cost_hint=0.1, max_backlog=1000)
    request: Any = SimpleNamespace(request_id="r")
    states = torch.randn(200, width)
    drafter.observe_states(request, 0, states[:70])  # a prompt longer than the first buffer
    for position in range(70, 150):
        drafter.observe_states(request, position, states[position: position + 1])
    drafter.observe_states(request, 148, states[148:152])  # a retried pass: two new positions
    seq = drafter._seqs["r"]
    assert seq.pending == list(range(152)) and seq.observed_to() == 152
    assert seq.states is not None and torch.equal(seq.states[:152], states[:152])
    drafter.observe_states(request, 160, states[160:162])  # after a gap, the positions it holds
    assert seq.pending[-3:] == [151, 160, 161] and torch.equal(seq.states[152:154], states[160:162])
    request.all_token_ids = [i % 50 for i in range(163)]
    drafter._catch_up([request])
    assert seq.pending == [] and seq.length == 154 and seq.fed_to == 162  # every held state fed once
    drafter.observe_states(request, 162, states[162:163])
    assert seq.pending == [162] and torch.equal(seq.states[:1], states[162:163])  # the buffer starts over


def test_the_backlog_fed_to_the_head_is_bounded(tiny_llama: Path, tmp_path: Path) -> None:
    """A long prompt, then plain rounds: the drafter holds at most twice ``max_backlog`` states, and
    a catch-up feeds the newest ``max_backlog`` positions, each with its own state, in order."""
    from types import SimpleNamespace

    from infer.speculative.eagle import EagleDrafter

    head = Eagle3Head.load(make_eagle3_head(tiny_llama, tmp_path / "head"), torch.float32, torch.device("cpu"))
    head.config.aux_layers = (1, 2, 3)
    width = 3 * head.config.target_hidden_size
    fed: list[tuple[list[int], torch.Tensor]] = []
    drafter = EagleDrafter(head, lambda ids: torch.zeros(*ids.shape, head.config.hidden_size), "cpu",
                           max_draft_tokens=4, max_depth=2, cost_hint=0.1, max_backlog=8)
    real_qkv = drafter._qkv

    def spy(embeds: torch.Tensor, state: torch.Tensor, positions: list[int]) -> Any:
        fed.append((list(positions), state.clone()))
        return real_qkv(embeds, state, positions)

    drafter._qkv = spy  # type: ignore[method-assign]
    request: Any = SimpleNamespace(request_id="r", all_token_ids=[i % 50 for i in range(101)])
    states = torch.randn(100, width)
    drafter.observe_states(request, 0, states[:40])  # a prompt five times the backlog
    seq = drafter._seqs["r"]
    assert seq.pending == list(range(32, 40)) and seq.states is not None and torch.equal(seq.states[:8], states[32:40])
    for position in range(40, 100):  # plain rounds
        drafter.observe_states(request, position, states[position: position + 1])
        assert len(seq.pending) <= 16 and seq.pending == list(range(seq.pending[0], position + 1))
        assert torch.equal(seq.states[: len(seq.pending)], states[seq.pending[0]: position + 1])
    drafter._catch_up([request])
    positions, fed_states = fed[-1]
    assert positions == list(range(92, 100)) and seq.length == 8 and seq.pending == []
    assert torch.equal(fed_states, head.fc(states[92:100]))  # the newest eight, each with its own state
    with pytest.raises(ValueError, match="max_backlog"):
        EagleDrafter(head, lambda ids: ids, "cpu", max_draft_tokens=4, max_depth=2, cost_hint=0.1, max_backlog=0)
    with pytest.raises(ValueError, match="capture_window"):
        EagleDrafter(head, lambda ids: ids, "cpu", max_draft_tokens=4, max_depth=2, cost_hint=0.1, capture_window=0)
    # A resting head asks for captures only in the window before a probe, never past what it feeds.
    assert drafter.info.aux_window == 8
    assert EagleDrafter(head, lambda ids: ids, "cpu", max_draft_tokens=4, max_depth=2, cost_hint=0.1).info.aux_window == 16


def test_a_head_resting_between_probes_captures_only_what_it_will_read(tiny_llama: Path, tmp_path: Path) -> None:
    """A head that never pays leaves the tree sizer on plain decoding; the passes more than the
    drafter's window before its next probe capture no layer inputs, the ones before a probe do (the
    probe drafts), and the output is plain decoding's."""
    import dataclasses

    import infer.core.model_runner as model_runner

    head = make_eagle3_head(tiny_llama, tmp_path / "head", draft_vocab=list(range(300)))
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(PROMPTS[:1], params)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="eagle", eagle_head=str(head))
    runner: Any = llm.engine.runner
    runner.drafter.max_backlog = 4
    runner.drafter.info = dataclasses.replace(runner.drafter.info, aux_window=4)
    passes: list[bool] = []  # per target pass: were the layer inputs captured
    real_forward = model_runner.ModelRunner._run

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is runner.target.runner:
            passes.append(bool(self.aux_layers))
        return real_forward(self, *args, **kwargs)

    drafted_after_pause: list[int] = []  # nodes each drafting call proposed once a pass had skipped capture
    real_propose = runner.drafter.propose

    def propose(*args: Any) -> Any:
        proposal = real_propose(*args)
        if False in passes:
            drafted_after_pause.append(sum(proposal.num_tokens))
        return proposal

    runner.drafter.propose = propose
    model_runner.ModelRunner._run = spy  # type: ignore[method-assign]
    try:
        out = llm.generate(PROMPTS[:1], params)
    finally:
        model_runner.ModelRunner._run = real_forward  # type: ignore[method-assign]
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert runner.budget.best_tree_size == 0  # the random head does not pay
    assert passes.count(False) > 200 and passes.count(True) > 20
    # every probe after a pause drafted: the states it reads were captured in time
    assert drafted_after_pause and all(drafted_after_pause)
