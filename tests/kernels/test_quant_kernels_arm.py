"""The ARM variants of the quantized kernels, cross-built and run under qemu: every block type
repacked into the x8 layout, its products bit for bit reference_linear_x8's (as on x86).

No ARM machine runs the tests, so quant_kernels.c is built with ``aarch64-linux-gnu-gcc -static``
into a small program (quant_arm_main.c) and run under ``qemu-aarch64-static`` on small shapes of
every block type, against the same numpy reference as the x86 variants: ``neon-dotprod``
(``-march=armv8.2-a+dotprod``: sdot) and ``neon-i8mm`` (``+i8mm``: calls of 2 rows or more on the
tile path, its primitives on SMMLA / USMMLA, checked against numpy's integer products first; one
row on sdot). ``scripts/arm_kernels.sh`` installs the two Debian packages (``make test`` runs it
first) and runs this file with ``INFER_REQUIRE_ARM=1``, under which missing tools fail instead of
skipping. The selection's rule (i8mm where the CPU's Features list it) is checked on any host with
a faked ARM CPU.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from helpers import TILE_SHAPES, tile_dot_cases
from infer import kernels
from infer.kernels import build, quant
from infer.kernels.build import COMMON_FLAGS, KernelUnavailable
from infer.kernels.quant import QUANT_TYPES

HERE = Path(__file__).parent
KERNELS = Path(quant.__file__).parent
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64-static"
INSTALL = "scripts/arm_kernels.sh --install (apt-get install -y gcc-aarch64-linux-gnu qemu-user-static)"
MARCH = {name: next(v for v in build.QUANT_VARIANTS if v.name == name).flags for name in ("neon-dotprod", "neon-i8mm")}


def _build(tmp_path_factory: pytest.TempPathFactory, variant: str) -> Path:
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        message = f"the ARM kernel test needs {' and '.join(missing)}: install with {INSTALL}"
        if os.environ.get("INFER_REQUIRE_ARM"):
            pytest.fail(message)
        pytest.skip(message)
    program = tmp_path_factory.mktemp("arm") / f"quant_{variant}"
    # The library's flags less the shared-object and OpenMP ones (one thread under qemu), and the
    # variant's own -march (build.QUANT_VARIANTS), so the test builds what the engine would.
    flags = [f for f in COMMON_FLAGS if f not in ("-shared", "-fPIC", "-fopenmp")]
    command = [CROSS_CC, *flags, *MARCH[variant], "-static", "-Wno-unknown-pragmas", f"-I{KERNELS}",
               str(HERE / "quant_arm_main.c"), "-o", str(program), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return program


@pytest.fixture(scope="module")
def arm_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "neon-dotprod")


@pytest.fixture(scope="module")
def i8mm_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "neon-i8mm")


def _run(program: Path, stdin: bytes, cpu: str = "max") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([QEMU, "-cpu", cpu, str(program)], input=stdin, capture_output=True, timeout=120)


def _products(program: Path, qtype: str, out_features: int, in_features: int, rows: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, tuple[str, int, int]]:
    """One product under qemu, checked for the layout line, the dequantized rows and the bits of
    every row called alone; returns the m-row call's y, the reference's, and the tiles line."""
    qt = QUANT_TYPES[qtype]
    generator = torch.Generator().manual_seed(seed)
    raw = quant.random_blocks(qtype, out_features, in_features, generator)
    x = torch.randn(rows, in_features, generator=generator) * torch.rand(rows, 1, generator=generator) * 10
    x[rows // 2, :32] = 0.0  # an all-zero activation block
    header = np.array([list(QUANT_TYPES).index(qtype), out_features, in_features, rows], dtype=np.int64)
    result = _run(program, header.tobytes() + raw.numpy().tobytes() + x.numpy().tobytes())
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    layout, tiles, body = result.stdout.split(b"\n", 2)
    variant = program.name.removeprefix("quant_")
    assert layout.decode() == quant.expected_layout(variant)  # the variant built, not the portable C
    impl, together, after = tiles.decode().split()[1:]
    values = np.frombuffer(body, dtype=np.float32)
    assert values.size == 2 * rows * out_features + out_features * in_features
    got = torch.from_numpy(values[:rows * out_features].reshape(rows, out_features).copy())
    alone = torch.from_numpy(values[rows * out_features:2 * rows * out_features].reshape(rows, out_features).copy())
    dense = values[2 * rows * out_features:].reshape(out_features, in_features)
    assert torch.equal(got, alone)  # a row's bits do not depend on the rows beside it (nor on the path)
    assert np.array_equal(dense, gguf.quants.dequantize(raw.numpy(), GGMLQuantizationType(qt.ggml_type_id)))
    # and the float64-summed reference within float32 rounding (an independent check of the integers)
    want = quant.reference_linear(x, raw, qtype, in_features)
    bound = 1e-5 * quant.reference_terms_scale(x, raw, qtype, in_features) + 1e-6
    assert ((got - want).abs() <= bound).all(), float((got - want).abs().max())
    return got, quant.reference_linear_x8(x, raw, qtype, in_features), (impl, int(together), int(after))


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_neon_dotprod_kernels_under_qemu(arm_program: Path, qtype: str) -> None:
    # a pair of groups, then one of 3 rows (padded); 6 rows
    got, want, tiles = _products(arm_program, qtype, 19, 512, 6, seed=11)
    assert tiles == ("none", 0, 0)  # no tile path in this build
    assert torch.equal(got, want)  # the same float operations as every variant, so the reference's bits


def _tile_dot(program: Path, a: np.ndarray, b: np.ndarray, c: np.ndarray, op: str) -> tuple[int, np.ndarray]:
    m, kbytes = a.shape
    n = c.shape[1]
    header = np.array([-1 - ("su", "ss", "us").index(op), n, kbytes, m], dtype=np.int64)
    result = _run(program, header.tobytes() + a.tobytes() + b.tobytes() + c.astype(np.int32).tobytes())
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    layout, _, body = result.stdout.partition(b"\n")
    assert layout.decode() == quant.expected_layout("neon-i8mm")
    values = np.frombuffer(body, dtype=np.int32)
    return int(values[0]), values[1:].reshape(m, n)


def test_neon_i8mm_tile_primitives_are_amx_int8_dot_products_under_qemu(i8mm_program: Path) -> None:
    """The tile primitives on SMMLA / USMMLA have AMX's semantics (test_quant_tiles.py's check of the
    emulation): C[m, n] += A's rows times B's columns (VNNI layout), the bytes signed or unsigned as
    tdpbsud / tdpbssd / tdpbusd read them, on top of C's old values, for full and partial shapes
    (odd rows, K not a multiple of 8, columns not a multiple of 4); the int8 extremes."""
    for op, a, b, c, want in tile_dot_cases([*TILE_SHAPES, (15, 60, 13)]):
        rc, got = _tile_dot(i8mm_program, a, b, c, op)
        assert rc == 0 and np.array_equal(got, want), (a.shape, c.shape, op)
    rc, got = _tile_dot(i8mm_program, np.full((16, 64), 0x80, np.uint8), np.full((16, 64), 0xFF, np.uint8),
                        np.zeros((16, 16), np.int32), "su")
    assert rc == 0 and (got == -128 * 255 * 64).all()


SHAPES = [  # out_features (n: not a multiple of 8 or 16), in_features, rows: 2..40, odd and even, partial A tiles
    (19, 96, 2), (45, 64, 3), (21, 128, 5), (37, 96, 16), (133, 64, 17), (29, 64, 33), (11, 64, 40),
    (13, 64, 70),  # more rows than a tile job's span of accumulators (64)
]


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_neon_i8mm_kernels_under_qemu(i8mm_program: Path, qtype: str) -> None:
    """Every type's calls of 2 rows or more on the SMMLA tile path (its product counter moves once
    per call), bit for bit reference_linear_x8's, for weights not a multiple of 8 or 16 rows and 2
    to 70 activation rows; each row called alone (sdot, the counter still) gives the same bits."""
    for index, (n, k, m) in enumerate(SHAPES):
        k = k if QUANT_TYPES[qtype].block_elems == 32 else 256 * (1 + index % 2)
        got, want, tiles = _products(i8mm_program, qtype, n, k, m, seed=31 + index)
        assert tiles == ("smmla", 1, 1), (n, k, m)  # the m-row call on tiles, the 1-row calls not
        assert torch.equal(got, want), (n, k, m)


def test_the_i8mm_build_runs_smmla(i8mm_program: Path, arm_program: Path) -> None:
    """Under a CPU model with dot products and no I8MM (qemu's Neoverse N1), the i8mm build's
    several-row call stops on an illegal instruction, where the neon-dotprod build runs: the tile
    path's integers really came from SMMLA / USMMLA, and an ARM CPU without i8mm must not get it."""
    qt = QUANT_TYPES["Q4_0"]
    raw = quant.random_blocks("Q4_0", 16, 64, torch.Generator().manual_seed(5))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    stdin = np.array([list(QUANT_TYPES).index(qt.name), 16, 64, 4], dtype=np.int64).tobytes() + \
        raw.numpy().tobytes() + x.numpy().tobytes()
    assert _run(arm_program, stdin, cpu="neoverse-n1").returncode == 0
    result = _run(i8mm_program, stdin, cpu="neoverse-n1")
    assert result.returncode != 0 and b"Illegal instruction" in result.stderr + result.stdout, result


@pytest.mark.parametrize("features", [{"asimddp"}, {"asimddp", "i8mm"}])
def test_an_arm_cpu_takes_i8mm_only_where_its_features_list_it(monkeypatch: pytest.MonkeyPatch,
                                                                features: set[str]) -> None:
    """Faked on this host: an aarch64 Linux CPU whose /proc/cpuinfo Features list asimddp, with or
    without i8mm. neon-i8mm comes first and needs i8mm: without it, it is refused as lacking it (no
    note on the startup line, as for AMX on a CPU without it); with it, it is the one tried first,
    and a refusal of it is the one note (its build is faked to fail here: this host compiles no ARM)."""
    i8mm = next(v for v in build.QUANT_VARIANTS if v.name == "neon-i8mm")
    names = [v.name for v in build.QUANT_VARIANTS]
    assert names.index("neon-i8mm") == names.index("neon-dotprod") - 1 and "neon-i8mm" in quant.TILE_VARIANTS
    assert i8mm.machine == "aarch64" and set(i8mm.cpu_needs) == {"asimddp", "i8mm"}
    real_load = build.load

    def fake_load(variant: build.Variant) -> object:
        if variant.machine == "aarch64":
            raise KernelUnavailable(f"compiling the {variant.name} kernels failed: faked")
        return real_load(variant)

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset(features))
    monkeypatch.setattr(build, "load", fake_load)
    kernels.reset()
    try:
        assert build.missing_cpu_flags(i8mm) == ([] if "i8mm" in features else ["i8mm"])
        if "i8mm" not in features:
            with pytest.raises(KernelUnavailable, match="neon-i8mm: CPU lacks i8mm"):
                quant.quant_kernels("neon-i8mm")
        best = quant.quant_kernels()
        assert best is not None and best.variant.name == "portable"  # both ARM builds faked to fail
        notes = quant.quant_selection_note().split("; ")
        assert notes[0] == ("neon-i8mm: compiling the neon-i8mm kernels failed: faked" if "i8mm" in features
                            else "neon-dotprod: compiling the neon-dotprod kernels failed: faked")
    finally:
        monkeypatch.undo()
        kernels.reset()
