#!/bin/sh
# Build the ARM NEON (dot-product) quantized kernels with the aarch64 cross compiler and run their
# tests under qemu (tests/kernels/test_quant_kernels_arm.py), failing rather than skipping if the
# tools are missing. With --install it first installs the two Debian/Ubuntu packages it needs
# (gcc-aarch64-linux-gnu, qemu-user-static) through apt-get, as root or with sudo; where apt-get is
# not available it says so and skips the ARM tests (exit 0; a failed install fails).
#   scripts/arm_kernels.sh [--install]      (run from the repository root; PY=python3 by default)
set -eu
PY=${PY:-python3}
if [ "${1:-}" = "--install" ]; then
    if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64-static >/dev/null 2>&1; then
        echo "arm_kernels: aarch64-linux-gnu-gcc and qemu-aarch64-static already installed"
    elif ! command -v apt-get >/dev/null 2>&1; then
        echo "arm_kernels: SKIPPED: apt-get is not available here, so the ARM NEON kernels are not tested;" \
             "install an aarch64 cross gcc (aarch64-linux-gnu-gcc) and qemu-aarch64-static by hand to test them" >&2
        exit 0
    else
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user-static
    fi
fi
INFER_REQUIRE_ARM=1 PYTHONPATH=src "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels_arm.py
