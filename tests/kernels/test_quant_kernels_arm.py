"""The ARM NEON (dot-product) variant of the quantized kernels, cross-built and run under qemu: every
block type repacked into the x8 layout, its products bit for bit reference_linear_x8's (as on x86).

No ARM machine runs the tests, so quant_kernels.c is built with ``aarch64-linux-gnu-gcc
-march=armv8.2-a+dotprod -static`` into a small program (quant_arm_main.c) and run under
``qemu-aarch64-static -cpu max`` on small shapes of every block type, against the same numpy
reference as the x86 variants. ``scripts/arm_kernels.sh`` installs the two Debian packages and
runs this file with ``INFER_REQUIRE_ARM=1``, under which missing tools fail instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from infer.kernels import quant
from infer.kernels.build import COMMON_FLAGS
from infer.kernels.quant import QUANT_TYPES

HERE = Path(__file__).parent
KERNELS = Path(quant.__file__).parent
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64-static"
INSTALL = "scripts/arm_kernels.sh --install (apt-get install -y gcc-aarch64-linux-gnu qemu-user-static)"


@pytest.fixture(scope="module")
def arm_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        message = f"the ARM kernel test needs {' and '.join(missing)}: install with {INSTALL}"
        if os.environ.get("INFER_REQUIRE_ARM"):
            pytest.fail(message)
        pytest.skip(message)
    program = tmp_path_factory.mktemp("arm") / "quant_arm"
    # The library's flags less the shared-object and OpenMP ones (one thread under qemu).
    flags = [f for f in COMMON_FLAGS if f not in ("-shared", "-fPIC", "-fopenmp")]
    command = [CROSS_CC, *flags, "-march=armv8.2-a+dotprod", "-static", "-Wno-unknown-pragmas", f"-I{KERNELS}",
               str(HERE / "quant_arm_main.c"), "-o", str(program), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return program


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_neon_dotprod_kernels_under_qemu(arm_program: Path, qtype: str) -> None:
    qt = QUANT_TYPES[qtype]
    out_features, in_features, rows = 19, 512, 6  # a pair of groups, then one of 3 rows (padded)
    generator = torch.Generator().manual_seed(11)
    raw = quant.random_blocks(qtype, out_features, in_features, generator)
    x = torch.randn(rows, in_features, generator=generator)
    header = np.array([list(QUANT_TYPES).index(qtype), out_features, in_features, rows], dtype=np.int64)
    stdin = header.tobytes() + raw.numpy().tobytes() + x.numpy().tobytes()
    result = subprocess.run([QEMU, "-cpu", "max", str(arm_program)], input=stdin, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    line, _, body = result.stdout.partition(b"\n")
    assert line.decode() == quant.expected_layout("neon-dotprod")  # the NEON path, not the portable one
    values = np.frombuffer(body, dtype=np.float32)
    assert values.size == 2 * rows * out_features + out_features * in_features
    together = torch.from_numpy(values[:rows * out_features].reshape(rows, out_features).copy())
    alone = torch.from_numpy(values[rows * out_features:2 * rows * out_features].reshape(rows, out_features).copy())
    dense = values[2 * rows * out_features:].reshape(out_features, in_features)
    # the same float operations as every variant, so the reference's bits
    assert torch.equal(together, quant.reference_linear_x8(x, raw, qtype, in_features))
    assert torch.equal(together, alone)  # a row's bits do not depend on the rows beside it
    # and the float64-summed reference within float32 rounding (an independent check of the integers)
    want = quant.reference_linear(x, raw, qtype, in_features)
    bound = 1e-5 * quant.reference_terms_scale(x, raw, qtype, in_features) + 1e-6
    assert ((together - want).abs() <= bound).all(), float((together - want).abs().max())
    assert np.array_equal(dense, gguf.quants.dequantize(raw.numpy(), GGMLQuantizationType(qt.ggml_type_id)))
