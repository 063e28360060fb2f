#!/usr/bin/env bash
# One prepared run of `rolltool bench` on a borrowed GPU machine (written for one H200,
# torch 2.11, no internet). It answers: does balancing by FLOPs make data-parallel ranks finish
# together on real hardware, compared with balancing by tokens or by sample count, and does a
# cost model calibrated on this GPU do better still?
#
#   1. pack examples/rollouts.parquet three ways: --balance flops, tokens, count (dp $DP)
#   2. bench those three with torch-varlen (fwd+bwd, $MODEL attention shape), --check (every
#      segment of a sample of rows equals its sequence run alone), --calibrate (fit a·L + b·L²)
#   3. pack a fourth time with --balance calibrated, using the fitted coefficients
#   4. bench all four side by side: the comparison table (best marked) and one JSON document
#
# Usage (repository root; ~1 min on an H200, most of it imports and CUDA start-up):
#   benchmarks/bench_gpu.sh                       # results under $OUT (default benchmarks/out)
#   OUT=/tmp/b DP=4 MODEL=dense-7b benchmarks/bench_gpu.sh
# Dry run on a CPU (tiny shape, sdpa; checks the plumbing, not the numbers):
#   BACKEND=sdpa DP=2 BENCH_ARGS="--heads 2 --head-dim 16 --repeats 1 --warmup 0" benchmarks/bench_gpu.sh
#
# Needs: python with torch (CUDA build for torch-varlen) and rolltool's dependencies (click, rich,
# numpy, pyarrow, polars, safetensors); rolltool itself runs from this checkout (PYTHONPATH).
# Writes: packed-{flops,tokens,count,calibrated}/, calibration.json, check.json (step 2),
# bench.txt (step 4's tables) and bench.json (step 4's JSON) under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benchmarks/out}
DP=${DP:-8}
MODEL=${MODEL:-dense-8b}
BACKEND=${BACKEND:-torch-varlen}
BENCH_ARGS=${BENCH_ARGS:---repeats 5 --warmup 2}
INPUT=examples/rollouts.parquet
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
rolltool() { "$PY" -m rolltool "$@"; }

mkdir -p "$OUT"
echo "== machine" >&2
"$PY" - "$BACKEND" <<'PY' >&2
import inspect, sys
import torch
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name())
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError as e:
    print("no torch varlen_attn:", e)
if sys.argv[1] != "sdpa" and not torch.cuda.is_available():
    sys.exit(f"backend {sys.argv[1]} needs CUDA; use BACKEND=sdpa for a CPU dry run")
PY

# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
bench() { rolltool bench --backend "$BACKEND" --model "$MODEL" --backward $BENCH_ARGS "$@"; }

echo "== 1. pack three ways (dp $DP)" >&2
for balance in flops tokens count; do
  model=()
  [[ $balance == flops ]] && model=(--model "$MODEL")  # the FLOPs of the shape we bench
  rolltool pack "$INPUT" --dp "$DP" --balance "$balance" "${model[@]}" \
    -o "$OUT/packed-$balance" --force >/dev/null
done

echo "== 2. bench with --check and --calibrate" >&2
bench "$OUT"/packed-{flops,tokens,count} --check --calibrate "$OUT/calibration.json" --force \
  --json >"$OUT/check.json"
cat "$OUT/calibration.json" >&2

echo "== 3. pack with the calibrated cost model" >&2
rolltool pack "$INPUT" --dp "$DP" --balance calibrated --calibration "$OUT/calibration.json" \
  -o "$OUT/packed-calibrated" --force >/dev/null

echo "== 4. compare all four" >&2
bench "$OUT"/packed-{flops,tokens,count,calibrated} | tee "$OUT/bench.txt"
bench "$OUT"/packed-{flops,tokens,count,calibrated} --json >"$OUT/bench.json"
echo "wrote $OUT/bench.txt, $OUT/bench.json, $OUT/calibration.json" >&2
