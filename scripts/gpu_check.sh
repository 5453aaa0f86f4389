#!/usr/bin/env bash
# The GPU checks of issue 36 in one run, for a lent H100/H200 (torch with CUDA, triton and transformers
# installed; no network). Run from the repository root; everything it measures goes under $OUT.
#
#   scripts/gpu_check.sh --prepare   # here, with network: wheels and the template GGUF into .gpu_carry/
#   scripts/gpu_check.sh             # on the GPU machine (carry .gpu_carry); writes $OUT/summary.md
#   scripts/gpu_check.sh --dry-run   # print the steps and their time budgets, run nothing
#   scripts/gpu_check.sh --smoke     # the same steps on the CPU at the tiny shape (checks the script here)
#
# Through the device tool, whose $OUT brings back at most 8 files, run it into a folder of its own and
# pack that (how benchmarks/runs/gpu-h200-check/ was made):
#   R=$OUT; export OUT=/tmp/gco; GPU_CHECK_BUDGET=500 PYTHON=python3 bash scripts/gpu_check.sh > /tmp/run.log 2>&1
#   tar czf $R/gpu_check.tgz -C /tmp/gco .; cp /tmp/gco/summary.md $R/     (carry: .gpu_carry)
#
# Steps run in order of importance, each under its own time limit (seconds, `timeout`), cut to what is
# left of the whole run's budget (GPU_CHECK_BUDGET, default 450 s); once under 15 s are left, the rest
# are skipped and the summary says so. What the existing commands cannot measure is listed under "Not measured" in the summary.
set -u -o pipefail

MODE=gpu
case "${1:-}" in
  --prepare) MODE=prepare ;;
  --dry-run) MODE=dry ;;
  --smoke) MODE=smoke ;;
  "") ;;
  *) echo "usage: $0 [--prepare | --dry-run | --smoke]" >&2; exit 2 ;;
esac

ROOT=$(pwd)
CARRY=$ROOT/.gpu_carry
PY=${PYTHON:-python}
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
# The modules infer and its CUDA tests import, and the wheel that supplies each (pure Python or abi3).
NEEDED="gguf:gguf safetensors:safetensors tokenizers:tokenizers jinja2:jinja2 tqdm:tqdm yaml:pyyaml \
pytest:pytest pluggy:pluggy iniconfig:iniconfig pytest_timeout:pytest-timeout packaging:packaging"

if [ "$MODE" = prepare ]; then
  mkdir -p "$CARRY/wheels"
  for pair in $NEEDED; do
    pkg=${pair#*:}
    # pure-Python or abi3 wheels for CPython 3.10-3.13 on x86_64 Linux, without their dependencies
    for v in 310 311 312 313; do
      $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$v" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$CARRY/wheels" "$pkg" || echo "no wheel of $pkg for cp$v"
    done
  done
  # The template GGUF (SmolLM2's vocabulary, tokenizer and metadata on a tiny model): the shapes are
  # written from it on the GPU machine, where the 94 MB SmolLM2 file cannot be carried.
  $PY -m infer.cli bench shapes --shape tiny --types F16 --out "$CARRY/shapes"
  du -sh "$CARRY"
  exit 0
fi

OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.md
BUDGET=${GPU_CHECK_BUDGET:-450}
END=$((SECONDS + BUDGET))
if [ "$MODE" = smoke ]; then
  DEVICE=cpu; DTYPE=float32; TARGET=tiny; SMALL=tiny; SMOL=tiny; BATCHES="1 2"; TOKENS=8; REPEATS=1
  WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_smoke}
else
  # SMOL: SmolLM2-135M's shape in bfloat16 (random weights): the default model's decode speed,
  # since its own file cannot be carried.
  DEVICE=cuda; DTYPE=bfloat16; TARGET=3b; SMALL=1b; SMOL=smollm2; BATCHES="1 8 32"; TOKENS=64; REPEATS=3
  # The shapes' folders (about 9 GB): in memory where /dev/shm is large enough (a container's often is not)
  shm_kb=$(df -Pk /dev/shm 2> /dev/null | awk 'NR == 2 {print $4}')
  if [ "${shm_kb:-0}" -gt 20000000 ]; then WORK=${GPU_CHECK_WORK:-/dev/shm/gpu_check}; else WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}; fi
fi
SHAPES=$WORK/shapes
TEMPLATE=$CARRY/shapes/tiny.F16.gguf

echo "# GPU check ($MODE, $(date -u +%FT%TZ))" > "$SUMMARY"
echo >> "$SUMMARY"

# step NAME BUDGET COMMAND...: run COMMAND under `timeout BUDGET`, output in $OUT/NAME.log, status in the summary.
step() {
  local name=$1 budget=$2
  shift 2
  if [ "$MODE" = dry ]; then
    echo "[$name] (${budget}s) $*"
    return 0
  fi
  local left=$((END - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "- $name: skipped (${left}s left of the ${BUDGET}s budget)" | tee -a "$SUMMARY"
    return 0
  fi
  [ "$left" -lt "$budget" ] && budget=$left  # the whole run's budget caps every step's
  echo "== $name (budget ${budget}s): $*"
  local start=$SECONDS rc=0
  # bash -c runs the exported functions below as well as programs
  timeout --signal=TERM --kill-after=10 "$budget" bash -c '"$@"' _ "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  tail -n 15 "$OUT/$name.log"
  local took=$((SECONDS - start))
  if [ "$rc" = 0 ]; then
    echo "- $name: ok (${took}s)" >> "$SUMMARY"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "- $name: TIMED OUT after ${budget}s (log: $name.log)" >> "$SUMMARY"
  else
    echo "- $name: FAILED, exit $rc (${took}s; log: $name.log)" >> "$SUMMARY"
  fi
}

environment() {
  echo "python: $($PY -V 2>&1)"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  $PY -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
  $PY -c "import transformers; print('transformers', transformers.__version__)" || echo "transformers: not importable"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv
  return 0
}

install() {
  local missing=""
  for pair in $NEEDED; do
    $PY -c "import ${pair%%:*}" 2> /dev/null || missing="$missing ${pair#*:}"
  done
  if [ -n "$missing" ]; then
    echo "installing from $CARRY/wheels:$missing"
    # shellcheck disable=SC2086
    $PY -m pip install -q --no-index --no-deps --find-links "$CARRY/wheels" $missing || return 1
  fi
  # The console script is a convenience: every step runs python -m with src/ first on PYTHONPATH.
  # (--smoke leaves this machine's own install alone.)
  if [ "$MODE" != smoke ]; then
    $PY -m pip install -q --no-deps --no-build-isolation -e . || echo "editable install failed (PYTHONPATH covers it)"
  fi
  $PY -c "import infer, sys; print('infer from', infer.__file__)"
}

write_shapes() {
  local shape
  for shape in "$@"; do
    $PY -c "
import sys
from infer.bench.shapes import write_shape
write_shape(sys.argv[1], sys.argv[2], types=(), like=sys.argv[3])
" "$shape" "$SHAPES" "$TEMPLATE" || return 1
  done
}

cuda_tests() {
  # Only the files with CUDA tests: collecting the whole suite would import test dependencies
  # (servers, clients, ray) that the GPU image does not have.
  local files
  files=$(grep -l "pytest.mark.cuda" -r tests --include="*.py" | sort)
  echo "files: $files"
  # shellcheck disable=SC2086
  # A file whose imports are missing here (scipy: test_rejection) is reported and the others still run.
  $PY -m pytest -m cuda -q -p no:cacheprovider -o addopts="" --continue-on-collection-errors $files
}

export MODE PY NEEDED CARRY SHAPES TEMPLATE
export -f environment install write_shapes cuda_tests

GRAPHS=(--cuda-graphs)
[ "$MODE" = smoke ] && GRAPHS=()

step environment 30 environment
step install 60 install
if [ "$MODE" != smoke ]; then
  step cuda-tests 100 cuda_tests
fi
step bandwidth 20 $PY scripts/gpu_check.py bandwidth --device "$DEVICE" --gib 1 --out "$OUT/bandwidth.json"
# each shape once (--smoke's are all tiny)
step shapes 100 write_shapes $(printf '%s\n' "$TARGET" "$SMALL" "$SMOL" | awk '!seen[$0]++')
# decode_step BUDGET SHAPE: decode tok/s at $BATCHES, eager and with graphs, against the bandwidth limits.
decode_step() {
  step "decode-$2" "$1" $PY scripts/gpu_check.py decode --model "$SHAPES/$2" --device "$DEVICE" \
    --dtype "$DTYPE" --batch $BATCHES --max-tokens "$TOKENS" --repeats "$REPEATS" ${GRAPHS[@]+"${GRAPHS[@]}"} \
    --bandwidth "$OUT/bandwidth.json" --out "$OUT/decode-$2.json"
}
HF_COMPILE=()
[ "$MODE" = smoke ] && HF_COMPILE=(--no-compile)  # compiling on two shared cores would take minutes
decode_step 70 "$TARGET"
if [ "$MODE" != smoke ]; then
  decode_step 60 "$SMOL"
fi
step "greedy-$SMALL" 70 $PY scripts/gpu_check.py greedy --model "$SHAPES/$SMALL" --device "$DEVICE" \
  --dtype "$DTYPE" --max-tokens 24 --out "$OUT/greedy-$SMALL.json"
step "widths-$TARGET" 40 $PY scripts/gpu_check.py widths --model "$SHAPES/$TARGET" --device "$DEVICE" \
  --dtype "$DTYPE" --repeats "$REPEATS" --context 512 --out "$OUT/widths-$TARGET.json"
# Every drafter infer has for a model without trained heads: n-gram (prompt lookup), suffix decoding and
# a draft model (the small shape drafting for the large, same vocabulary), plain and speculative rows.
step "drafters-$TARGET" 110 $PY -m infer.cli bench generation --model "$SHAPES/$TARGET" --draft-model "$SHAPES/$SMALL" \
  --device "$DEVICE" --dtype "$DTYPE" --workload edit --num-prompts 2 --max-tokens "$TOKENS" --spec-length 4 \
  --policies goodput --repeats 1 --no-transformers ${GRAPHS[@]+"${GRAPHS[@]}"} --out "$OUT/drafters-$TARGET"
step "hf-static-$TARGET" 120 $PY scripts/gpu_check.py hf-static --model "$SHAPES/$TARGET" --device "$DEVICE" \
  --dtype "$DTYPE" --max-tokens "$TOKENS" --repeats "$REPEATS" ${HF_COMPILE[@]+"${HF_COMPILE[@]}"} --out "$OUT/hf-static-$TARGET.json"
if [ "$MODE" != smoke ]; then
  # Last: what the budget may cut. transformers compiles once per batch size, so batch 1 only.
  step "hf-static-$SMOL" 100 $PY scripts/gpu_check.py hf-static --model "$SHAPES/$SMOL" --device "$DEVICE" \
    --dtype "$DTYPE" --max-tokens "$TOKENS" --repeats "$REPEATS" --batch 1 --out "$OUT/hf-static-$SMOL.json"
  decode_step 70 "$SMALL"
fi

[ "$MODE" = dry ] && exit 0
cat >> "$SUMMARY" << 'EOF'

## Not measured by this script

- SmolLM2 itself: its 94 MB GGUF is over what can be carried to the GPU machine (64 MiB). Its shape
  (`smollm2`, bfloat16, random weights) stands in for decode speed; the shapes carry its vocabulary
  and tokenizer (random weights, so drafters' acceptance there says nothing about real text).
- transformers at batch 8/32: it compiles once per batch size, over the time this run has.
- Medusa and EAGLE drafters: no trained heads exist for the shapes.
- Speculation at batch 8/32, and decode with the verification width under CUDA graphs per width:
  `decode` runs plain decoding; `drafters` runs one request at a time.
- The `widths` curve is the eager pass (no graphs).
EOF
echo "summary: $SUMMARY"
cat "$SUMMARY"
