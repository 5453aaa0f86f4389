"""The quantized kernels' matrix-tile path (quant_tiles.h): the emulated tile primitives against AMX's
integer semantics in numpy, the tile variants' products bit for bit against the numpy reference and
the vector variants on every machine (through the C emulation, which runs the same tile code), the
real AMX variant compiled here and, where the CPU has AMX, run and compared; and its selection: only
where the CPU has the flags and the OS grants tile state, with one reason line where the OS refuses.
Nothing here skips for a missing CPU feature: where there is no AMX the tests say what they check
instead."""

from __future__ import annotations

import errno
import platform
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from helpers import TILE_SHAPES, tile_dot_cases
from infer import kernels
from infer.bench import quant_kernels as quant_kernels_bench
from infer.kernels import build, quant
from infer.kernels.build import KernelUnavailable
from infer.kernels.quant import QUANT_TYPES, QuantKernels

# The emulated tile variants this machine runs (the portable one runs on any CPU).
EMULATED = [name for name in quant.EMULATED
            if not build.missing_cpu_flags(next(v for v in build.QUANT_VARIANTS if v.name == name))]
AMX = next(v for v in build.QUANT_VARIANTS if v.name == "avx512-amx")
HAS_AMX = not build.missing_cpu_flags(AMX)


def _vector_variant() -> QuantKernels:
    """The vectors' variant the tile variants are compared with: AVX-512 VNNI (the tile variants'
    own 1-row path) where this CPU runs it, else the portable C."""
    vnni = next(v for v in build.QUANT_VARIANTS if v.name == "avx512-vnni")
    found = quant.quant_kernels("portable" if build.missing_cpu_flags(vnni) else "avx512-vnni")
    assert found is not None
    return found


@pytest.fixture(scope="module", params=[*EMULATED, *(["avx512-amx"] if HAS_AMX else [])])
def tiles(request: pytest.FixtureRequest) -> Iterator[QuantKernels]:
    """A tile variant taking every call of 2 rows or more (AMX's default is 64: each A tile height,
    2, 4, 8 and 16 rows, runs on the real tiles too)."""
    found = quant.quant_kernels(request.param)
    assert found is not None and found.tiles == ("amx" if request.param == "avx512-amx" else "emu")
    before = found.set_tile_min_rows(2)
    yield found
    found.set_tile_min_rows(before)


def test_the_emulation_runs_here() -> None:
    """The portable emulated variant runs on every CPU (plain C): the tile path is tested everywhere."""
    assert "portable-amx-emu" in EMULATED
    if "avx512_vnni" in build.cpu_flags() and "avx512bw" in build.cpu_flags():
        assert "avx512-amx-emu" in EMULATED


def test_tile_primitives_are_amx_int8_dot_products(tiles: QuantKernels) -> None:
    """tdpbsud / tdpbssd / tdpbusd as AMX defines them: C[m, n] += sum over k of A[m, k] * B(k, n),
    A's rows of K bytes, B in VNNI layout (row kk holds column n's k = 4kk .. 4kk + 3 at bytes
    4n .. 4n + 3), each operand's bytes signed or unsigned by the instruction, the sum in int32 on
    top of C's old values; for every shape a tile holds, partial ones included."""
    for op, a, b, c, want in tile_dot_cases(TILE_SHAPES):
        got = c.copy()
        assert tiles.tile_dot(a, b, got, op) == 0
        assert got.dtype == np.int32 and np.array_equal(got, want), (a.shape, c.shape, op)
    # the extremes of a 64-byte row: -128 * 255 * 64 and 127 * 255 * 64 fit int32 exactly
    a = np.full((16, 64), 0x80, dtype=np.uint8)
    b = np.full((16, 64), 0xFF, dtype=np.uint8)
    c = np.zeros((16, 16), dtype=np.int32)
    assert tiles.tile_dot(a, b, c, "su") == 0 and (c == -128 * 255 * 64).all()
    # shapes no tile holds are refused before any tile is touched
    assert tiles.tile_dot(np.zeros((17, 64), np.uint8), np.zeros((16, 64), np.uint8), np.zeros((17, 16), np.int32)) == 1
    assert tiles.tile_dot(np.zeros((4, 6), np.uint8), np.zeros((1, 64), np.uint8), np.zeros((4, 16), np.int32)) == 1


SHAPES = [  # out_features (n), in_features (k), rows (m): partial weight tiles (n % 32), partial A tiles (m % 16)
    (19, 96, 2), (45, 640, 3), (133, 256, 15), (64, 128, 16), (37, 384, 17), (45, 640, 33), (133, 256, 40),
    (8, 64, 70),  # more rows than a tile job's span of accumulators (64)
]


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_tile_products_are_the_reference_and_the_vectors_bit_for_bit(tiles: QuantKernels, qtype: str) -> None:
    """Every type on tiles (each call of 2 rows or more: the products counter moves; the K types one
    tile product per 32-value chunk, Q6_K two of 16 values), with the bits of reference_linear_x8 and of the vector
    variant, for weight rows not a multiple of 16 or 32, 2 to 70 activation rows, several blocks, a
    bias, an all-zero activation block, on 1 and 2 threads; 1-row calls stay off the tiles."""
    vectors = _vector_variant()
    on_tiles = qtype in quant.TILE_TYPES
    generator = torch.Generator().manual_seed(21)
    for n, k, m in SHAPES:
        k = k if QUANT_TYPES[qtype].block_elems == 32 else 256 * max(1, k // 256)
        raw = quant.random_blocks(qtype, n, k, generator)
        x = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 10
        x[m // 2, :32] = 0.0
        bias = torch.randn(n, generator=generator)
        want = quant.reference_linear_x8(x, raw, qtype, k, bias).numpy()
        weight = tiles.pack(raw, qtype, k)
        assert torch.equal(weight.data, vectors.pack(raw, qtype, k).data)  # the one x8 layout: no second copy
        vector = vectors.linear(x, vectors.pack(raw, qtype, k), bias, threads=1).numpy()
        for threads in (1, 2):
            before = tiles.tile_products()
            got = tiles.linear(x, weight, bias, threads=threads).numpy()
            assert tiles.tile_products() - before == int(on_tiles), (n, k, m, threads)
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (n, k, m, threads)
            assert np.array_equal(got.view(np.int32), vector.view(np.int32)), (n, k, m, threads)
        before = tiles.tile_products()
        one = tiles.linear(x[1:2].contiguous(), weight, bias, threads=1).numpy()
        assert tiles.tile_products() == before  # a decode step stays on the vectors
        assert np.array_equal(one[0].view(np.int32), want[1].view(np.int32))


def test_tile_products_at_their_integer_extremes(tiles: QuantKernels) -> None:
    """The largest integer sums the 32-value types reach: every value at its extreme against
    activations of +-127 (Q8_0's -128 * -127 included), still the reference's bits."""
    generator = torch.Generator().manual_seed(22)
    for qtype, fill in (("Q8_0", 0x80), ("Q8_0", 0x7F), ("Q4_0", 0xFF), ("Q4_0", 0x00), ("Q4_1", 0xFF), ("Q5_0", 0xFF),
                        ("Q5_0", 0x00)):
        qt = QUANT_TYPES[qtype]
        raw = quant.random_blocks(qtype, 40, 128, generator)
        blocks = raw.reshape(40, -1, qt.block_bytes)
        first = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4, "Q5_0": 2}[qtype]
        blocks[:, :, first:] = fill
        x = torch.full((5, 128), 1.0)
        x[1] = -1.0
        x[2, ::2] = -1.0
        x[3] = torch.linspace(-3, 3, 128)
        got = tiles.linear(x, tiles.pack(raw, qtype, 128))
        assert torch.equal(got, quant.reference_linear_x8(x, raw, qtype, 128)), (qtype, fill)


def test_calls_below_the_tile_min_rows_stay_on_the_vectors_with_the_same_bits(capsys: pytest.CaptureFixture[str]) -> None:
    """Calls of fewer rows than the setting take the vectors, the rest the tiles, the bits the same;
    a setting under 2 is refused (a 1-row call never takes the tiles); the emulation's default is 2
    (every A tile height tested) and AMX's 64 (from where its tiles measured mostly faster than VNNI)."""
    emu = quant.quant_kernels("portable-amx-emu")
    assert emu is not None
    raw = quant.random_blocks("Q4_1", 45, 256, torch.Generator().manual_seed(31))
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(32))
    weight = emu.pack(raw, "Q4_1", 256)
    want = quant.reference_linear_x8(x, raw, "Q4_1", 256)
    assert emu.set_tile_min_rows(6) == 2
    try:
        for m, on_tiles in ((5, False), (6, True), (9, True)):
            before = emu.tile_products()
            assert torch.equal(emu.linear(x[:m].contiguous(), weight, threads=2), want[:m])
            assert emu.tile_products() - before == int(on_tiles), m
        with pytest.raises(ValueError, match="2 or more"):
            emu.set_tile_min_rows(1)
        # the micro-benchmark's flag refuses the same values before it times anything
        with pytest.raises(SystemExit):
            quant_kernels_bench.main(["--tile-min-rows", "1", "--rows", "2"])
        assert "--tile-min-rows must be 2 or more" in capsys.readouterr().err
    finally:
        emu.set_tile_min_rows(2)
    if platform.machine().lower() in ("x86_64", "amd64"):
        # the default as a fresh process has it (this module's fixture sets 2 where AMX runs); the
        # setting is a number, readable without tiles
        probe = ("from infer.kernels import build, quant; v = next(v for v in build.QUANT_VARIANTS if v.name == 'avx512-amx'); "
                 "print(quant.QuantKernels(v, build.load(v)).set_tile_min_rows(64))")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        assert out.split() == ["64"]


def test_an_emulated_variant_is_never_the_default() -> None:
    best = quant.quant_kernels()
    assert best is not None and best.variant.name not in quant.EMULATED
    assert best.variant.name == ("avx512-amx" if best.tiles == "amx" else best.variant.name)


def test_the_amx_variant_compiles_here_and_runs_only_where_the_cpu_has_amx() -> None:
    """The AMX build needs only gcc's flags: it compiles and loads (nothing runs at load) on any x86-64
    machine, with the layout Python expects. Where the CPU has amx_int8 it runs (the OS's permission
    granted: its probe and a product on tiles, the vectors' bits); where it does not, forcing it is
    refused naming the missing flags and the default stays the vector variant. (On another ISA's
    host, forcing it is refused naming the host.)"""
    if platform.machine().lower() not in ("x86_64", "amd64"):  # gcc here targets another ISA: nothing to compile
        with pytest.raises(KernelUnavailable, match="avx512-amx: CPU lacks an x86_64 Linux host"):
            quant.quant_kernels("avx512-amx")
        return
    lib = build.load(AMX)
    built = QuantKernels(AMX, lib)
    assert built.tiles == "amx"
    if not HAS_AMX:
        assert "amx_int8" not in build.cpu_flags()
        with pytest.raises(KernelUnavailable, match="avx512-amx: CPU lacks .*amx_int8"):
            quant.quant_kernels("avx512-amx")
        best = quant.quant_kernels()
        assert best is not None and best.variant.name != "avx512-amx" and best.tiles is None
        assert "avx512-amx" not in quant.quant_selection_note()  # no AMX here: nothing to report
        if "avx512_vnni" in build.cpu_flags():
            assert best.variant.name == "avx512-vnni"
        return
    try:
        amx = quant.quant_kernels("avx512-amx")
    except KernelUnavailable as err:  # the CPU has AMX and the OS refuses: the startup line says so
        assert "does not grant this process tile state" in str(err)
        fallback = quant.quant_kernels()
        assert "avx512-amx" in quant.quant_selection_note() and fallback is not None
        assert fallback.variant.name == "avx512-vnni"
        return
    assert amx is not None and amx.tiles == "amx" and quant.quant_kernels() is amx
    raw = quant.random_blocks("Q4_0", 133, 640, torch.Generator().manual_seed(23))
    x = torch.randn(21, 640, generator=torch.Generator().manual_seed(24))
    before = amx.tile_products()
    got = amx.linear(x, amx.pack(raw, "Q4_0", 640), threads=2)
    assert amx.tile_products() == before + 1
    assert torch.equal(got, quant.reference_linear_x8(x, raw, "Q4_0", 640))


def test_an_os_that_refuses_tile_state_leaves_the_vectors_and_one_reason_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Faked: a CPU with AMX whose OS refuses ARCH_REQ_XCOMP_PERM. The AMX variant is refused with the
    OS's reason (before any tile instruction runs: the faked CPU has no tiles); where the CPU runs
    AVX-512 VNNI that variant is the default and the startup line carries the one reason line."""
    from infer.backends.plan import QuantChoice, choose_quant_kernels
    from infer.loader.quantized import QuantReport

    if platform.machine().lower() not in ("x86_64", "amd64"):  # no x86 build to fake a CPU for
        assert "an x86_64 Linux host" in " ".join(build.missing_cpu_flags(AMX))
        return
    real = build.cpu_flags()
    runs_vnni = not build.missing_cpu_flags(next(v for v in build.QUANT_VARIANTS if v.name == "avx512-vnni"))
    # the faked CPU has AMX; without VNNI here, only the refusal itself can be checked (its probe would not run)
    flags = real | {"amx_tile", "amx_int8"} | (set() if runs_vnni else set(AMX.cpu_needs))
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(QuantKernels, "request_tiles", lambda self: errno.EPERM)
    kernels.reset()
    try:
        with pytest.raises(KernelUnavailable, match=r"avx512-amx: the CPU has AMX but the OS does not grant this "
                                                    r"process tile state \(arch_prctl\(ARCH_REQ_XCOMP_PERM, "
                                                    r"XFEATURE_XTILEDATA\): Operation not permitted\)"):
            quant.quant_kernels("avx512-amx")
        if runs_vnni:
            best = quant.quant_kernels()
            assert best is not None and best.variant.name == "avx512-vnni"
            note = quant.quant_selection_note()
            assert note.startswith("avx512-amx: the CPU has AMX but the OS") and "\n" not in note and ";" not in note
            assert quant.quant_unavailable_reason() == ""
            choice = choose_quant_kernels("auto", torch.device("cpu"), "auto")
            assert choice.kernels is best and choice.note == note
            report = QuantReport(choice)
            report.types["Q4_0"] = 1
            assert f"on AVX-512 VNNI quantized kernels; {note})" in report.describe()
            assert "; avx512-amx" not in QuantReport(QuantChoice("auto", best), report.types).describe()
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_a_forced_emulated_variant_is_the_one_in_use() -> None:
    """``--backend cpu-kernels:portable-amx-emu`` names a quantized variant like any other."""
    from infer.backends.backend import BACKENDS
    from infer.backends.plan import choose_quant_kernels

    assert "cpu-kernels:portable-amx-emu" in BACKENDS and "cpu-kernels:avx512-amx" in BACKENDS
    choice = choose_quant_kernels("auto", torch.device("cpu"), "cpu-kernels:portable-amx-emu")
    assert choice.kernels is not None and choice.kernels.variant.name == "portable-amx-emu"
    assert choice.kernels.tiles == "emu"
