#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench (the peer of `infer bench serving --peer llama-server`)
# from the vendor/llama.cpp folder of the llama-cpp-python sdist, into ~/.cache/infer/llama.cpp
# ($XDG_CACHE_HOME/infer/llama.cpp), with this CPU's features named instead of GGML_NATIVE (see
# src/infer/bench/llama_server.py for why). A finished build is reused; --force builds again.
# Prints the path of llama-server. Takes 10+ minutes on 2 cores.
#
#   scripts/build_llama_server.sh [--jobs N] [--force] [--root DIR] [--amx on|off]
#
# --amx off (the default) builds into vendor/llama.cpp/build with AMX off. --amx on builds into
# vendor/llama.cpp/build-amx with the same features plus the AMX ones cpuinfo reports (amx_tile,
# amx_int8, amx_bf16), i.e. llama.cpp's AMX backend (its "AMX" buffer type), for a CPU whose tiles
# work; it fails before building where cpuinfo reports no AMX. Both builds can sit side by side:
#   infer bench serving ... --peer llama-server --peer-binary "$(scripts/build_llama_server.sh --amx on)"
# With GCC 12 and the llama-cpp-python 0.3.36 sdist (llama.cpp 0c1e570) the --amx on build compiles
# but dies of SIGILL (exit 132) at its first AMX matmul: GCC drops the tile config's rows/colsb
# stores before ldtilecfg. Details, a one-line patch, and AMX against no AMX: benchmarks/runs/llama-amx/.
set -euo pipefail
exec nice -n 10 python -m infer.bench.llama_server "$@"
