#!/bin/sh
# Build the ARM quantized kernels (neon-dotprod: sdot; neon-i8mm: sdot and I8MM's smmla) with the
# aarch64 cross compiler and run their tests under qemu (tests/kernels/test_quant_kernels_arm.py;
# `qemu-aarch64-static -cpu max` has I8MM), failing rather than skipping if the tools are missing.
# With --install it first installs the two Debian/Ubuntu packages it needs
# (gcc-aarch64-linux-gnu, qemu-user-static) through apt-get, as root or with sudo; where apt-get is
# not available it says so and skips the ARM tests (exit 0; a failed install fails).
# With --install-only it installs them and stops (`make test` runs that first, so the suite's ARM
# tests run under qemu; an install that fails there warns and the ARM tests skip saying why).
#   scripts/arm_kernels.sh [--install | --install-only]   (from the repository root; PY=python3 by default)
set -eu
PY=${PY:-python3}
if [ "${1:-}" = "--install" ] || [ "${1:-}" = "--install-only" ]; then
    if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64-static >/dev/null 2>&1; then
        echo "arm_kernels: aarch64-linux-gnu-gcc and qemu-aarch64-static already installed"
    elif ! command -v apt-get >/dev/null 2>&1; then
        echo "arm_kernels: SKIPPED: apt-get is not available here, so the ARM kernels are not tested;" \
             "install an aarch64 cross gcc (aarch64-linux-gnu-gcc) and qemu-aarch64-static by hand to test them" >&2
        exit 0
    else
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        if [ "${1:-}" = "--install-only" ]; then
            { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user-static; } ||
                echo "arm_kernels: WARNING: installing gcc-aarch64-linux-gnu and qemu-user-static failed;" \
                     "the ARM kernel tests will skip" >&2
        else
            $SUDO apt-get update -qq
            $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user-static
        fi
    fi
    [ "${1:-}" = "--install-only" ] && exit 0
fi
INFER_REQUIRE_ARM=1 PYTHONPATH=src "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels_arm.py
