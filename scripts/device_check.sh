#!/usr/bin/env bash
# The GPU checks, as one script for a machine with a GPU, its own torch and no network (<= 10 minutes):
#
#   1. the machine: nvidia-smi, torch, CUDA, the GPUs, triton and flash-linear-attention versions
#   2. the test suite on the GPU: SUBQUAD_TEST_DEVICE=cuda pytest -x (tests/conftest.py)
#   3. `subquad train --device cuda` on one GPU, 20 steps (the default stdlib corpus, a tiny model)
#   4. with two GPUs or more: the same run on two ranks with NCCL and FSDP (torchrun; each rank on
#      cuda:LOCAL_RANK)
#   5. when flash-linear-attention imports: benchmarks/bench_fla_cuda.py --quick, the op and decode rows
#      against fla's Triton kernels
#
# Nothing is installed: the repository runs from PYTHONPATH with the python found here ($PYTHON, else
# python, else python3). Tests whose reference packages are missing skip. Everything is written under
# ${OUT:-/tmp/device_check} (logs, junit XML, the runs, the benchmark tables) and summary.txt lists each
# step. Exit status: 0 when every step that ran passed, 1 when one failed, 2 when there is no GPU.
#
#   scripts/device_check.sh              # on the GPU machine
#   scripts/device_check.sh --dry-run    # print the steps and what this machine has; run nothing
#
# DEVICE_CHECK_BUDGET (seconds, default 580) bounds the whole script: each step gets what is left after
# the later steps' shares, the test suite the most.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/device_check}
BUDGET=${DEVICE_CHECK_BUDGET:-580}
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: scripts/device_check.sh [--dry-run]" >&2; exit 64 ;;
esac

PY=${PYTHON:-$(command -v python || command -v python3 || true)}
if [[ -z "$PY" ]]; then
  echo "error: no python on PATH (set PYTHON=/path/to/python)" >&2
  exit 2
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export SUBQUAD_CACHE="$OUT/cache"          # the tokenizer and token cache: made once, shared by the runs
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0

say() { echo "== $*"; }
note() { echo "$*" | tee -a "$SUMMARY"; }

# seconds this step may take: what is left of the budget less the later steps' shares, at most $1
left() {
  local cap=$1 reserve=$2 rest=$(( BUDGET - SECONDS - $2 ))
  (( rest < cap )) && cap=$rest
  (( cap < 10 )) && cap=10
  echo "$cap"
}

# step NAME SECONDS LOG COMMAND...: run under a timeout, record PASS / FAIL / TIMEOUT in the summary
step() {
  local name=$1 secs=$2 log=$3 rc=0
  shift 3
  say "$name (at most ${secs}s): $*"
  set +e
  timeout -k 10 "$secs" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if (( rc == 0 )); then
    note "PASS     $name"
  elif (( rc == 124 || rc == 137 )); then
    note "TIMEOUT  $name (${secs}s; log $log)"; FAILED=1
  else
    note "FAIL     $name (exit $rc; log $log)"; FAILED=1
  fi
}

missing() {   # the modules of "$@" this python cannot import
  "$PY" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}

say "machine"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi | tee "$OUT/nvidia-smi.txt" || true
else
  echo "nvidia-smi: not on PATH"
fi
"$PY" - "$OUT/gpus" <<'EOF' | tee "$OUT/versions.txt"
import sys
from importlib.metadata import PackageNotFoundError, version
import torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {gpus}")
for i in range(gpus):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
for name in ("triton", "flash-linear-attention", "fla-core", "pytest", "hypothesis", "tokenizers", "transformers"):
    try:                                       # installed versions, without importing them (transformers: slow)
        print(f"{name} {version(name)}")
    except PackageNotFoundError:
        print(f"{name}: not installed")
open(sys.argv[1], "w").write(str(gpus))
EOF
GPUS=$(cat "$OUT/gpus")
HAVE_FLA=0
"$PY" -c 'import fla' > /dev/null 2>&1 && HAVE_FLA=1

RUN_FLAGS=(--preset micro --pattern "linear,softmax" --n-layers 2 --d-model 64 --n-heads 2 --context 64
           --vocab-size 512 --batch-size 8 --steps 20 --eval-every 10 --ckpt-every 20 --no-progress)
TESTS=(env SUBQUAD_TEST_DEVICE=cuda "$PY" -m pytest -x -q -p no:cacheprovider --junitxml "$OUT/pytest.xml" tests)
ONE=("$PY" -m subquad train "${RUN_FLAGS[@]}" --device cuda --out "$OUT/run-1gpu")
TWO=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m subquad train "${RUN_FLAGS[@]}"
     --device cuda --fsdp --out "$OUT/run-2gpu-fsdp")
BENCH=("$PY" benchmarks/bench_fla_cuda.py --quick --out "$OUT/bench")

if (( DRY )); then
  say "dry run: GPUs here: $GPUS, flash-linear-attention: $([[ $HAVE_FLA == 1 ]] && echo yes || echo no)"
  echo "tests:      ${TESTS[*]}"
  echo "one GPU:    ${ONE[*]}"
  echo "two GPUs:   ${TWO[*]}   (only with >= 2 GPUs)"
  echo "benchmark:  ${BENCH[*]}   (only when fla imports)"
  exit 0
fi
if (( GPUS == 0 )); then
  note "error: torch sees no CUDA GPU on this machine; nothing to check (scripts/device_check.sh --dry-run shows the steps)"
  exit 2
fi

# the later steps' shares of the budget, held back from the test suite (the first run trains the BPE)
RESERVE=90
(( GPUS >= 2 )) && RESERVE=$(( RESERVE + 90 ))
(( HAVE_FLA )) && RESERVE=$(( RESERVE + 100 ))

gone=$(missing pytest hypothesis)
if [[ -n "$gone" ]]; then
  note "FAIL     test suite: this python lacks $gone (pip install pytest hypothesis where there is a network)"; FAILED=1
else
  step "test suite, SUBQUAD_TEST_DEVICE=cuda" "$(left 420 "$RESERVE")" "$OUT/pytest.log" "${TESTS[@]}"
fi
RESERVE=$(( RESERVE - 90 ))

gone=$(missing tokenizers safetensors tqdm)
if [[ -n "$gone" ]]; then
  note "FAIL     training runs: this python lacks $gone (subquad's own dependencies)"; FAILED=1
else
  step "train on one GPU, 20 steps" "$(left 90 "$RESERVE")" "$OUT/run-1gpu.log" "${ONE[@]}"
  if (( GPUS >= 2 )); then
    RESERVE=$(( RESERVE - 90 ))
    step "train on two ranks, NCCL + FSDP, 20 steps" "$(left 90 "$RESERVE")" "$OUT/run-2gpu-fsdp.log" "${TWO[@]}"
  else
    note "SKIP     two-rank NCCL + FSDP run: $GPUS GPU here (needs 2)"
  fi
fi

if (( HAVE_FLA )); then
  step "benchmark rows against fla's Triton kernels" "$(left 100 0)" "$OUT/bench.log" "${BENCH[@]}"
else
  note "SKIP     benchmark rows: flash-linear-attention does not import here (pip install flash-linear-attention)"
fi

say "summary ($SECONDS s; everything under $OUT)"
cat "$SUMMARY"
exit "$FAILED"
