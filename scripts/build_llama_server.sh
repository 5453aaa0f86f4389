#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench (the peer of `infer bench serving --peer llama-server`)
# from the vendor/llama.cpp folder of the llama-cpp-python sdist, into ~/.cache/infer/llama.cpp
# ($XDG_CACHE_HOME/infer/llama.cpp), with this CPU's features named instead of GGML_NATIVE (see
# src/infer/bench/llama_server.py for why). A finished build is reused; --force builds again.
# Prints the path of llama-server. Takes 10+ minutes on 2 cores.
#
#   scripts/build_llama_server.sh [--jobs N] [--force] [--root DIR]
set -euo pipefail
exec nice -n 10 python -m infer.bench.llama_server "$@"
