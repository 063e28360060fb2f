#!/usr/bin/env bash
# One prepared run of `rolltool bench` on a borrowed GPU machine (written for one H200,
# torch 2.11, no internet). It answers: does balancing by FLOPs make data-parallel ranks finish
# together on real hardware, compared with balancing by tokens or by sample count, and does a
# cost model calibrated on this GPU do better still?
#
# Every row is timed as one whole $MODEL decoder layer (--what $WHAT, default layer: q/k/v
# projections, varlen attention, output projection, SiLU-gated MLP), forward + backward -- the
# cost pack --balance flops balances, linear term included.
#
#   1. pack examples/rollouts.parquet three ways: --balance flops, tokens, count (dp $DP)
#   2. bench those three with torch-varlen (fwd+bwd, $MODEL layer shape), --check (every
#      segment of a sample of rows equals its sequence run alone), --calibrate (fit a·L + b·L²
#      of the whole layer)
#   2b. for reference, the same three timed as attention only (--what attention): what bench
#      measured before layer mode, and why attention alone misjudges a FLOPs-balanced packing
#   3. pack a fourth time with --balance calibrated, using the fitted coefficients
#   4. bench all four side by side: the comparison table (best marked) and one JSON document
#
# Usage (repository root; estimated 4-5 min on an H200 for dense-8b at dp 8, not yet measured:
# each layer-mode pass replays ~0.8 M tokens through one layer forward + backward, ~1 PFLOP, and
# steps 2 and 4 make 3 + 2 x 4 directories x (warmup + repeats) = 77 directory-passes):
#   benchmarks/bench_gpu.sh                       # results under $OUT (default benchmarks/out)
#   OUT=/tmp/b DP=4 MODEL=dense-7b benchmarks/bench_gpu.sh
#   REFERENCE=0 benchmarks/bench_gpu.sh           # skip step 2b
# Dry run on a CPU (tiny shape, sdpa; checks the plumbing, not the numbers; ~10 min on 2 busy cores):
#   BACKEND=sdpa DP=2 BENCH_ARGS="--heads 2 --kv-heads 1 --head-dim 16 --hidden 32 \
#     --intermediate 64 --repeats 1 --warmup 0" benchmarks/bench_gpu.sh
#
# Needs: python with torch (CUDA build for torch-varlen) and rolltool's dependencies (click, rich,
# numpy, pyarrow, polars, safetensors); rolltool itself runs from this checkout (PYTHONPATH).
# Writes: packed-{flops,tokens,count,calibrated}/, calibration.json, check.json (step 2),
# attention.txt and attention.json (step 2b), bench.txt (step 4's tables) and bench.json
# (step 4's JSON) under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benchmarks/out}
DP=${DP:-8}
MODEL=${MODEL:-dense-8b}
BACKEND=${BACKEND:-torch-varlen}
WHAT=${WHAT:-layer}
REFERENCE=${REFERENCE:-1}
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
layer_bench() { bench --what "$WHAT" "$@"; }

echo "== 1. pack three ways (dp $DP)" >&2
for balance in flops tokens count; do
  model=()
  [[ $balance == flops ]] && model=(--model "$MODEL")  # the FLOPs of the shape we bench
  rolltool pack "$INPUT" --dp "$DP" --balance "$balance" "${model[@]}" \
    -o "$OUT/packed-$balance" --force >/dev/null
done

echo "== 2. bench ($WHAT) with --check and --calibrate" >&2
layer_bench "$OUT"/packed-{flops,tokens,count} --check --calibrate "$OUT/calibration.json" \
  --force --json >"$OUT/check.json"
cat "$OUT/calibration.json" >&2

if [[ $REFERENCE == 1 && $WHAT != attention ]]; then
  echo "== 2b. reference: attention only" >&2
  bench --what attention "$OUT"/packed-{flops,tokens,count} | tee "$OUT/attention.txt"
  bench --what attention "$OUT"/packed-{flops,tokens,count} --json >"$OUT/attention.json"
fi

echo "== 3. pack with the calibrated cost model" >&2
rolltool pack "$INPUT" --dp "$DP" --balance calibrated --calibration "$OUT/calibration.json" \
  -o "$OUT/packed-calibrated" --force >/dev/null

echo "== 4. compare all four ($WHAT)" >&2
layer_bench "$OUT"/packed-{flops,tokens,count,calibrated} | tee "$OUT/bench.txt"
layer_bench "$OUT"/packed-{flops,tokens,count,calibrated} --json >"$OUT/bench.json"
echo "wrote $OUT/bench.txt, $OUT/bench.json, $OUT/calibration.json" >&2
