"""Quantized models' passes through the C decoder stack (``CpuStack`` with ``QuantPart`` descriptors).

The stack calls the quantized kernels for every quantized projection (float32 activations), so its
hidden states equal the quantized layers' up to attention's rounding (the layers run
``exact_attention``, the stack its own); it takes every pass of a quantized model, so a token gets
the same bits in a decode step and in any verification pass; a descriptor that does not fit the
model is refused with ValueError before a pointer reaches C.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gguf import write_gguf

from infer.backends import cpu_kernels, exact
from infer.backends.cpu_kernels import _QUANT_TOLERANCE, CpuStack, _probe_passes, quantized_probe_model
from infer.kernels.cpu import STACK_PROJECTIONS, QuantProjection, StackTable
from infer.kernels.quant import QuantWeight
from infer.loader import load_model
from infer.models.quantized import QuantLinear
from quant_files import by_part, typed_tensors

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install gguf")

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module", autouse=True)
def kernels_here() -> None:
    """Where the quantized kernels or the float32 C kernels cannot run these tests fail, naming why."""
    from infer import kernels
    from infer.kernels import quant

    assert quant.quant_kernels() is not None, f"the quantized kernels do not run here: {quant.quant_unavailable_reason()}"
    assert kernels.library_for(torch.float32) is not None, kernels.unavailable_reason(torch.float32)


# Every part of a layer one type, and the mixes of a Q4_K_M-like file: fused q/k/v and gate/up of
# two block types each (two kernel calls whose outputs sit side by side).
TYPE_RULES: dict[str, dict[str, str]] = {
    "Q4_0": {p: "Q4_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
    "Q8_0": {p: "Q8_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
    "mixed": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q4_K",
              "ffn_up": "Q6_K", "ffn_down": "Q4_0", "output": "Q6_K", "token_embd": "Q8_0"},
}


def quantized_file(arch: str, types: str, folder: Path) -> Path:
    """A tiny 256-wide ``arch`` checkpoint (the K types' super-blocks need 256 inputs) as a GGUF of ``types``."""
    from checkpoints import make_tiny_checkpoint

    extra: dict[str, Any] = dict(head_dim=64) if arch == "qwen3" else {}
    checkpoint = make_tiny_checkpoint(folder / arch, arch, hidden_size=256, num_layers=2, num_heads=4,  # type: ignore[arg-type]
                                      num_kv_heads=2, intermediate_size=512, seed=5, **extra)
    with typed_tensors(by_part(TYPE_RULES[types])):
        return write_gguf(checkpoint, folder / f"{arch}-{types}.gguf")


def quantized_stack(model: Any) -> CpuStack:
    stack = model.backend.cpu_stack
    assert stack is not None and stack.quantized, model.backend.describe()
    return stack  # type: ignore[no-any-return]


@pytest.mark.parametrize("types", list(TYPE_RULES))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stack_equals_the_quantized_layers(arch: str, types: str, tmp_path: Path) -> None:
    """Prefills, a batched pass of uneven runs and a decode step on both cache kinds: the stack's
    hidden states equal the layer-by-layer quantized path's within float tolerance."""
    model, _ = load_model(quantized_file(arch, types, tmp_path), "float32", "cpu")
    stack = quantized_stack(model)
    assert stack.max_rows is None  # every pass of a quantized model runs here
    layer: Any = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert isinstance(qkv, QuantLinear) and isinstance(gate_up, QuantLinear)
    if types == "mixed":
        assert qkv.qtypes == ["Q4_K", "Q6_K"] and gate_up.qtypes == ["Q4_K", "Q6_K"]
    for cache in ("paged", "slotted"):
        ours, ref = _probe_passes(model, stack, cache, torch.float32), _probe_passes(model, None, cache, torch.float32)
        for index, (a, b) in enumerate(zip(ours, ref, strict=True)):
            bound = _QUANT_TOLERANCE * float(b.abs().max())
            assert float((a - b).abs().max()) <= bound, (cache, index)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_token_gets_the_same_bits_in_any_pass_of_the_stack(arch: str, threads: int, tmp_path: Path) -> None:
    """``check_invariance`` (a 72-token pass against a prefill, decode steps and a batched pass
    beside a longer sequence) on mixed-type models running on the stack."""
    model, _ = load_model(quantized_file(arch, "mixed", tmp_path), "float32", "cpu")
    quantized_stack(model)
    torch.set_num_threads(threads)
    exact._VERIFIED.clear()
    exact.check_invariance(model)


def test_a_stack_that_misplaces_a_part_fails_the_probes_comparison() -> None:
    """The load-time probe can fail: the q/k and v matrices of probe model 0 (two block types)
    given in the wrong order still fill the projection's 128 outputs, but the hidden states move
    far beyond the probe's tolerance."""
    from infer import kernels
    from infer.kernels import quant

    library, quant_kernels = kernels.library_for(torch.float32), quant.quant_kernels()
    assert library is not None and quant_kernels is not None
    assert cpu_kernels.probe_quant_stack(library, quant_kernels) is None
    model = quantized_probe_model(0, quant_kernels)
    cpu_kernels.prepare(model, library, fused=True)
    stack = CpuStack.build(model, library)
    assert stack is not None and stack.table.quant is not None
    table = stack.table
    swapped = list(table.quant)  # type: ignore[arg-type]
    first = swapped[0]
    assert first is not None and len(first.weights) == 2
    swapped[0] = QuantProjection(first.kernels, first.weights[::-1])
    wrong = CpuStack(library, StackTable(table.tensors, table.shape, table.eps, table.qk_norm, quant=swapped))
    wrong.max_rows = None
    ours, ref = _probe_passes(model, wrong, "slotted", torch.float32), _probe_passes(model, None, "slotted", torch.float32)
    assert float((ours[0] - ref[0]).abs().max()) > 5 * _QUANT_TOLERANCE * float(ref[0].abs().max())


def test_a_failed_probe_runs_the_layers_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.backends import backend

    monkeypatch.setattr(backend, "probe_quant_stack", lambda library, quant: "probe said no")
    model, _ = load_model(quantized_file("llama", "Q4_0", tmp_path), "float32", "cpu")
    assert model.backend.cpu_stack is None and not model.backend.stack
    assert "probe said no" in model.backend.describe()
    layer: Any = model.model.layers[0]
    assert layer.self_attn.attend is exact.exact_attention  # the layers stay row-invariant


def test_bad_descriptors_raise_value_error(tmp_path: Path) -> None:
    """Each malformed quantized projection is named by a ValueError before any address is taken."""
    model, _ = load_model(quantized_file("llama", "mixed", tmp_path), "float32", "cpu")
    table = quantized_stack(model).table
    quant = list(table.quant)  # type: ignore[arg-type]
    qkv, down = quant[0], quant[STACK_PROJECTIONS.index("down")]
    assert qkv is not None and down is not None

    def refused(match: str, *, tensors: list[torch.Tensor | None] | None = None, parts: Any = quant) -> None:
        with pytest.raises(ValueError, match=match):  # at construction or at the first addresses()
            StackTable(tensors if tensors is not None else list(table.tensors), table.shape, table.eps,
                       table.qk_norm, quant=parts).addresses()

    def with_qkv(projection: Any) -> list[Any]:
        return [projection, *quant[1:]]

    refused("inputs, the projection takes 256", parts=with_qkv(QuantProjection(qkv.kernels, down.weights)))
    refused("outputs together, the projection 512", parts=with_qkv(QuantProjection(qkv.kernels, qkv.weights[:1])))
    refused("has no matrices", parts=with_qkv(QuantProjection(qkv.kernels, ())))
    refused("must be a QuantProjection", parts=with_qkv((qkv.kernels, qkv.weights)))
    refused("must be a QuantProjection", parts=with_qkv(QuantProjection(object(), qkv.weights)))  # type: ignore[arg-type]
    short = dataclasses.replace(qkv.weights[0], data=qkv.weights[0].data[:, :-1])
    refused("of shape",  # a byte short
            parts=with_qkv(QuantProjection(qkv.kernels, (short, *qkv.weights[1:]))))
    refused("must be a QuantWeight", parts=with_qkv(QuantProjection(qkv.kernels, ("Q4_K",))))  # type: ignore[arg-type]
    beside = list(table.tensors)
    beside[1] = torch.zeros(512, 256)
    refused("given beside its quantized matrices", tensors=beside)
    bf16 = list(table.tensors)
    bf16[0] = bf16[0].bfloat16()  # type: ignore[union-attr]
    refused("take float32 activations", tensors=bf16)
    with pytest.raises(ValueError, match="quantized projections for 2 layers"):
        StackTable(list(table.tensors), table.shape, table.eps, table.qk_norm, quant=quant[:-1])
    assert isinstance(qkv.weights[0], QuantWeight)


def test_exact_greedy_mode_keeps_the_quantized_stack(tmp_path: Path) -> None:
    """``exact_greedy`` on a quantized model: the stack keeps every pass (no RowChunked layers) and
    the engine's invariance check passes; greedy n-gram speculation equals plain decoding."""
    from infer import LLM, SamplingParams
    from infer.backends.exact import RowChunked

    path = quantized_file("qwen3", "mixed", tmp_path)
    exact._VERIFIED.clear()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["the cat sat on the mat", "one two three four one two three"]
    plain = LLM(str(path), device="cpu", exact_greedy=True)
    model: Any = plain.engine.model
    assert quantized_stack(model).max_rows is None and not isinstance(model.model.norm, RowChunked)
    ids = [o.token_ids for o in plain.generate(prompts, params)]
    spec = LLM(str(path), device="cpu", exact_greedy=True, speculator="ngram", spec_length=4, spec_length_policy="fixed")
    assert [o.token_ids for o in spec.generate(prompts, params)] == ids


def test_decode_steps_switch_the_weight_stream_setting_without_changing_a_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's 1-row passes on the quantized kernels take turns with and without software
    prefetches (``kernels.cpu.STREAMS``, here comparing every few passes), and the greedy tokens
    equal those of a run pinned to either setting."""
    from infer import LLM, SamplingParams
    from infer.kernels import cpu
    from infer.kernels.quant import QuantKernels

    applied: list[bool] = []
    setter = QuantKernels.set_stream_prefetch

    def recording(self: QuantKernels, on: bool) -> bool:
        applied.append(on)
        return setter(self, on)

    monkeypatch.setattr(QuantKernels, "set_stream_prefetch", recording)
    path = quantized_file("llama", "Q4_0", tmp_path)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = LLM(str(path), device="cpu")
    tokens = {}
    for pinned in (None, True, False):
        chooser = cpu.PairedChooser((True, False))
        chooser.TURNS, chooser.WAIT = 2, 3
        if pinned is not None:
            chooser.settings = (pinned, pinned)
        monkeypatch.setattr(cpu, "STREAMS", chooser)
        applied.clear()
        tokens[pinned] = llm.generate(["the cat sat on the mat"], params)[0].token_ids
        assert set(applied) == ({True, False} if pinned is None else {pinned}), (pinned, applied)
        assert chooser.comparisons  # the decode steps were measured for it
    assert tokens[None] == tokens[True] == tokens[False]


def test_the_c_stack_refuses_a_part_that_does_not_fit(tmp_path: Path) -> None:
    """Behind the Python checks the C stack checks each part against its projection too (inputs,
    columns): a part tampered with after the checks makes the pass raise instead of misreading."""
    model, _ = load_model(quantized_file("llama", "mixed", tmp_path), "float32", "cpu")
    stack = quantized_stack(model)
    stack.table.addresses()
    parts = stack.table._parts
    assert parts is not None
    parts[0].in_features += 32
    with pytest.raises(RuntimeError, match="refused a quantized projection"):
        _probe_passes(model, stack, "slotted", torch.float32)


def test_every_pair_of_variants_this_cpu_runs_passes_the_probe() -> None:
    """The float stack of each ISA variant with the quantized kernels of each (AVX2 laptops, AVX-512
    without VNNI, the portable C): the stack agrees with the quantized layers on the probe models."""
    from infer.kernels import build, load_variant, quant

    pairs = [(f, q) for f in build.VARIANTS if "f32" in f.dtypes and not build.missing_cpu_flags(f)
             for q in build.QUANT_VARIANTS if not build.missing_cpu_flags(q)]
    assert pairs, "no float32 and quantized kernel variant runs here"
    for float_variant, quant_variant in pairs:
        failure = cpu_kernels.probe_quant_stack(load_variant(float_variant), quant.quant_kernels(quant_variant.name))
        assert failure is None, (float_variant.name, quant_variant.name, failure)


def _passes_with_and_without_the_head(model: Any, aux_layers: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, ...]]:
    """Each of a prefill, a ragged verification of two sequences and a decode step run twice on the
    same cache rows: asking the pass for its logits (the stack's call ends with the LM head) and not
    (the final norm and the head's own calls after it); the hidden states, aux and logits of both."""
    from infer.cache import make_pool
    from infer.core.model_runner import ModelRunner

    c = model.config
    pool = make_pool("paged", num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     max_seq_len=64, max_batch_size=2, block_size=4, num_blocks=None, dtype=torch.float32,
                     device=torch.device("cpu"))
    runner = ModelRunner(model, pool)
    runner.aux_layers = aux_layers
    slots = [pool.allocate(), pool.allocate()]
    gen = torch.Generator().manual_seed(3)
    out = []
    for batch, lengths in (([slots[0]], [9]), ([slots[1]], [5]), (slots, [4, 2]), (slots, [1, 1])):
        runs = [torch.randint(c.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        starts = [pool.seq_len(s) for s in batch]
        fused = runner.forward_ragged(batch, runs, logits=True)
        for slot, start in zip(batch, starts, strict=True):
            pool.truncate_to(slot, start)
        plain = runner.forward_ragged(batch, runs)
        assert fused.logits is not None and plain.logits is None
        out.append((fused.hidden, plain.hidden, fused.logits, runner.logits(plain.hidden),
                    *((fused.aux, plain.aux) if aux_layers else ())))
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_pass_ending_with_the_lm_head_gives_the_same_bits(arch: str, threads: int, tmp_path: Path) -> None:
    """A decode step's or a verification's logits come from the stack's own call (the final norm and
    the LM head at its end): the same bits as the norm's and the head's calls after the pass, in
    every kind of pass, with the EAGLE layer inputs captured beside them (the last layer's output
    before the norm); a head normed with another epsilon differs (the comparison can fail)."""
    model, _ = load_model(quantized_file(arch, "mixed", tmp_path), "float32", "cpu")
    stack = quantized_stack(model)
    assert stack.head is not None and stack.head.vocab == model.config.vocab_size
    torch.set_num_threads(threads)
    layers = model.config.num_hidden_layers
    for hidden, ref_hidden, logits, ref_logits, aux, ref_aux in _passes_with_and_without_the_head(model, (1, layers)):
        assert torch.equal(hidden, ref_hidden) and torch.equal(logits, ref_logits) and torch.equal(aux, ref_aux)
    stack.head.eps *= 4  # the negative control: the head's norm no longer the model's
    differs = [not torch.equal(p[2], p[3]) for p in _passes_with_and_without_the_head(model)]
    assert all(differs)


def _sequence_passes(model: Any, cache: str, one_sequence: bool, monkeypatch: pytest.MonkeyPatch,
                     aux_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """A prefill chunk, decode steps and chain verifications of one sequence (beside another that
    interleaves its paged blocks), through ``ModelRunner``: with the backend's one-sequence call
    (``forward_sequence``) or, without it, the tensors of ``build_kv_batch``; each pass's hidden
    states and logits, and with ``aux_layers`` the layer inputs each pass captured (EAGLE-3's)."""
    from infer.cache import make_pool
    from infer.core.model_runner import ModelRunner

    backend = model.backend
    with monkeypatch.context() as patch:
        if not one_sequence:
            patch.setattr(backend, "takes_sequence", lambda *args: False)
        c = model.config
        pool = make_pool(cache, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                         head_dim=c.head_dim, max_seq_len=96, max_batch_size=2, block_size=4, num_blocks=None,
                         dtype=torch.float32, device=torch.device("cpu"))
        runner = ModelRunner(model, pool)
        runner.aux_layers = aux_layers
        calls = []
        original = backend.forward_sequence
        patch.setattr(backend, "forward_sequence", lambda *a, **k: calls.append(1) or original(*a, **k))
        slots = [pool.allocate(), pool.allocate()]
        gen = torch.Generator().manual_seed(11)
        out = []
        for slot, width in ((0, 7), (1, 5), (0, 1), (0, 6), (1, 3), (0, 1), (0, 1), (0, 4), (1, 1), (0, 33)):
            run = torch.randint(c.vocab_size, (width,), generator=gen).tolist()
            done = runner.forward_ragged([slots[slot]], [run], logits=True)
            assert done.logits is not None
            out += [done.hidden, done.logits]
            if aux_layers:
                assert done.aux is not None and done.aux.shape == (width, len(aux_layers) * c.hidden_size)
                out.append(done.aux)
            if width == 6:  # a verification whose last two tokens are rejected: the next pass rewrites them
                pool.truncate_to(slots[slot], pool.seq_len(slots[slot]) - 2)
    assert len(calls) == (10 if one_sequence else 0)
    return out


@pytest.mark.parametrize("cache", ["paged", "slotted"])
@pytest.mark.parametrize("model_kind", ["quantized", "float32"])
def test_a_one_sequence_pass_through_addresses_gives_the_same_bits(model_kind: str, cache: str, tmp_path: Path,
                                                                   tiny_llama: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step, a verification or a short prefill of one sequence hands the C stack its cache
    rows, embedding rows and RoPE rows as addresses and lets it apply the causal rule itself
    (``forward_sequence``): every pass's hidden states and logits are the bits the tensors of
    ``build_kv_batch`` give, on both pools, for a quantized model and a float one. A wrong cache
    view (the paged rows rotated by one, the slotted tokens one position on) changes them: the
    comparison can fail."""
    from infer.cache import protocol

    path = quantized_file("llama", "mixed", tmp_path) if model_kind == "quantized" else tiny_llama
    model, _ = load_model(str(path), "float32", "cpu")
    assert model.backend.cpu_stack is not None
    ours = _sequence_passes(model, cache, True, monkeypatch)
    ref = _sequence_passes(model, cache, False, monkeypatch)
    for index, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(a, b), index
    # An EAGLE-3 drafter's captures (the embeddings, a middle layer's input, the last layer's output)
    # come out of the same call, the same bits as the general pass's, which change nothing else.
    layers = model.config.num_hidden_layers
    captured = _sequence_passes(model, cache, True, monkeypatch, (0, 1, layers))
    captured_ref = _sequence_passes(model, cache, False, monkeypatch, (0, 1, layers))
    for index, (a, b) in enumerate(zip(captured, captured_ref, strict=True)):
        assert torch.equal(a, b), index
    assert all(torch.equal(a, b) for a, b in zip([t for i, t in enumerate(captured) if i % 3 != 2], ours, strict=True))
    original = protocol.sequence_rows

    def shifted(pool: Any, slot: int, start: int, width: int) -> protocol.SequenceRows:
        rows = original(pool, slot, start, width)
        if rows.read_start is not None:
            rows.start, rows.context = rows.start + 1, rows.context + 1
        else:
            assert rows.rows is not None
            rows.rows = torch.cat((rows.rows[1:], rows.rows[:1]))
        return rows

    monkeypatch.setattr("infer.backends.backend.sequence_rows", shifted)  # where Backend.run_pass reads it
    broken = _sequence_passes(model, cache, True, monkeypatch)
    assert any(not torch.equal(a, b) for a, b in zip(broken, ref, strict=True))


def test_the_stack_keeps_no_dropped_pool_alive(tmp_path: Path) -> None:
    """The stack remembers the last pool's stores it checked (so a pass does not check them again)
    by weak references: a pool dropped is freed, not held by the model for its lifetime."""
    import gc
    import weakref

    from infer.cache import make_pool
    from infer.core.model_runner import ModelRunner

    model, _ = load_model(quantized_file("llama", "Q4_0", tmp_path), "float32", "cpu")
    c = model.config
    pool = make_pool("paged", num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     max_seq_len=32, max_batch_size=1, block_size=4, num_blocks=None, dtype=torch.float32,
                     device=torch.device("cpu"))
    runner = ModelRunner(model, pool)
    slot = pool.allocate()
    for run in ([1, 2, 3], [4]):  # the second pass takes the remembered stores
        runner.forward_ragged([slot], [run], logits=True)
    assert quantized_stack(model).table.checked_lists is not None
    store = weakref.ref(pool.k_layers[0])
    del runner, pool
    gc.collect()
    assert store() is None
