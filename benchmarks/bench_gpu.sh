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
#   1. pack examples/rollouts.parquet three ways: --balance flops, tokens, count (dp $DP) --
#      skipped when $PACKED_DIR/packed-{flops,tokens,count} exist (packed by --prepare)
#   2. bench those three with torch-varlen (fwd+bwd, $MODEL layer shape), --check (every
#      segment of a sample of rows equals its sequence run alone), --calibrate (fit a·L + b·L²
#      of the whole layer; bench warns when the fit is unreliable). Its table is already the
#      three-way comparison (best marked); tables and JSON come from the same run.
#   2b. optional (REFERENCE=1; off by default): the same three timed as attention only (--what
#      attention): what bench measured before layer mode, and why attention alone misjudges a
#      FLOPs-balanced packing
#   3. pack a fourth time with --balance calibrated, using the fitted coefficients -- skipped,
#      with a message, where polars is missing (the bare GPU image): calibration.json is still
#      written; pack with it back on the CPU machine (the command is printed)
#   4. bench all four side by side (only when step 3 packed): the comparison table, best marked
#   5. SPLIT=1 (default): the flops pack next to the same input packed --cp 2 and --sp 2 at half
#      the per-GPU budget (the same group budget), bench per GPU with --check (each GPU's view
#      against every sample alone, gradients too): the group balance and the block kernels'
#      bottom-right causal alignment on the device (issue 11)
#
# Two-step use where the GPU machine lacks polars (rolltool pack needs it; bench does not):
#   benchmarks/bench_gpu.sh --prepare     # here, on a CPU machine (or PREPARE=1): packs into
#                                         # $PACKED_DIR (default benchmarks/gpu-input, NOT
#                                         # git-ignored, so the device tool copies it along)
#   benchmarks/bench_gpu.sh               # then on the GPU machine: benches the prepared dirs
# DP and MODEL must match between the two steps ($PACKED_DIR/prepared.txt records them).
#
# Estimated runtime on an H200 (dense-8b, dp 8, defaults; not yet measured): ~3 min of commands,
# plus the machine's start. Counting every pass: each layer-mode directory-pass replays ~0.8 M
# tokens through one layer forward + backward (~1 PFLOP, ~2.5-3.5 s); step 2 makes
# 3 directories x (2 warm-up + 5 timed) = 21 directory-passes plus --check's sample rows, step 4
# 4 x 7 = 28: 49 in all (~2.5 min), plus ~20-30 s start-up (torch import, CUDA init, weights)
# for each of the 2 bench calls. REFERENCE=1 adds 21 attention-only passes (each a small
# fraction of a layer pass) and a third start-up: ~+40 s. Without polars, step 4 does not run
# (21 passes, ~1.5 min).
#
# Usage (repository root):
#   benchmarks/bench_gpu.sh                       # results under $OUT (default benchmarks/out)
#   OUT=/tmp/b DP=4 MODEL=dense-7b benchmarks/bench_gpu.sh
#   REFERENCE=1 benchmarks/bench_gpu.sh           # also step 2b
# Dry run on a CPU (tiny shape, sdpa; checks the plumbing, not the numbers; a few minutes):
#   BACKEND=sdpa DP=2 BENCH_ARGS="--heads 2 --kv-heads 1 --head-dim 16 --hidden 32 \
#     --intermediate 64 --repeats 1 --warmup 0" benchmarks/bench_gpu.sh
#
# Needs: python with torch (CUDA build for torch-varlen) and bench's dependencies (click, rich,
# numpy, pyarrow); polars too for packing (steps 1 and 3, --prepare). rolltool itself runs from
# this checkout (PYTHONPATH).
# Writes under $OUT: packed-{flops,tokens,count}/ (unless prepared), calibration.json, check.txt
# and check.json (step 2's tables and JSON), attention.{txt,json} (step 2b), packed-calibrated/,
# bench.txt and bench.json (step 4), split.txt and split.json (step 5).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benchmarks/out}
PACKED_DIR=${PACKED_DIR:-benchmarks/gpu-input}
PREPARE=${PREPARE:-0}
DP=${DP:-8}
MODEL=${MODEL:-dense-8b}
BACKEND=${BACKEND:-torch-varlen}
WHAT=${WHAT:-layer}
REFERENCE=${REFERENCE:-0}
SPLIT=${SPLIT:-1}
BENCH_ARGS=${BENCH_ARGS:---repeats 5 --warmup 2}
INPUT=examples/rollouts.parquet
for arg in "$@"; do
  case $arg in
    --prepare) PREPARE=1 ;;
    *) echo "usage: $0 [--prepare]   (settings through the environment, see the header)" >&2
       exit 2 ;;
  esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
rolltool() { "$PY" -m rolltool "$@"; }
have_polars() { "$PY" -c 'import polars' 2>/dev/null; }
BALANCES=(flops tokens count)
SETTINGS="DP=$DP MODEL=$MODEL INPUT=$INPUT"

# pack_three DIR: examples/rollouts.parquet packed three ways into DIR/packed-*.
pack_three() {
  mkdir -p "$1"
  for balance in "${BALANCES[@]}"; do
    model=()
    [[ $balance == flops ]] && model=(--model "$MODEL")  # the FLOPs of the shape we bench
    rolltool pack "$INPUT" --dp "$DP" --balance "$balance" "${model[@]}" \
      -o "$1/packed-$balance" --force >/dev/null
  done
}

# pack_split DIR: the input packed --cp 2 and --sp 2 at half the default per-GPU budget (16,384:
# the group's 32,768, as the plain packs have) into DIR/packed-{cp2,sp2}.
pack_split() {
  for kind in cp sp; do
    rolltool pack "$INPUT" --dp "$DP" --balance flops --model "$MODEL" --$kind 2 \
      --micro-batch-tokens 16384 -o "$1/packed-${kind}2" --force >/dev/null
  done
}

if [[ $PREPARE == 1 ]]; then
  have_polars || { echo "--prepare packs, which needs polars: run it where polars is installed" >&2; exit 1; }
  echo "== prepare: pack three ways (dp $DP) into $PACKED_DIR" >&2
  pack_three "$PACKED_DIR"
  [[ $SPLIT == 1 ]] && pack_split "$PACKED_DIR"
  echo "$SETTINGS" >"$PACKED_DIR/prepared.txt"
  du -sh "$PACKED_DIR" >&2
  echo "now run benchmarks/bench_gpu.sh (same DP and MODEL) on the GPU machine;" \
    "$PACKED_DIR is not git-ignored, so it travels with the working tree" >&2
  exit 0
fi

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

prepared=1
for balance in "${BALANCES[@]}"; do
  [[ -d $PACKED_DIR/packed-$balance ]] || prepared=0
done
if [[ $prepared == 1 ]]; then
  if [[ -f $PACKED_DIR/prepared.txt && $(cat "$PACKED_DIR/prepared.txt") != "$SETTINGS" ]]; then
    echo "$PACKED_DIR was prepared with $(cat "$PACKED_DIR/prepared.txt"), not $SETTINGS:" \
      "set the same DP and MODEL, or run --prepare again" >&2
    exit 1
  fi
  echo "== 1. skipped: using the packed directories in $PACKED_DIR" >&2
  SRC=$PACKED_DIR
else
  if ! have_polars; then
    echo "== 1. cannot pack here: polars is missing (rolltool pack needs it). Run" \
      "benchmarks/bench_gpu.sh --prepare on a machine with polars first, then this again" \
      "with $PACKED_DIR copied along" >&2
    exit 1
  fi
  echo "== 1. pack three ways (dp $DP)" >&2
  pack_three "$OUT"
  [[ $SPLIT == 1 ]] && pack_split "$OUT"
  SRC=$OUT
fi
three=("$SRC"/packed-{flops,tokens,count})

echo "== 2. bench ($WHAT) with --check and --calibrate" >&2
layer_bench "${three[@]}" --check --calibrate "$OUT/calibration.json" --force \
  --json-out "$OUT/check.json" | tee "$OUT/check.txt"
cat "$OUT/calibration.json" >&2

if [[ $REFERENCE == 1 && $WHAT != attention ]]; then
  echo "== 2b. reference: attention only" >&2
  bench --what attention "${three[@]}" --json-out "$OUT/attention.json" | tee "$OUT/attention.txt"
fi

calibrated=(rolltool pack "$INPUT" --dp "$DP" --balance calibrated
            --calibration "$OUT/calibration.json" -o "$OUT/packed-calibrated" --force)
if have_polars; then
  echo "== 3. pack with the calibrated cost model" >&2
  "${calibrated[@]}" >/dev/null
  echo "== 4. compare all four ($WHAT)" >&2
  layer_bench "${three[@]}" "$OUT/packed-calibrated" --json-out "$OUT/bench.json" \
    | tee "$OUT/bench.txt"
  echo "wrote $OUT/bench.txt, $OUT/bench.json, $OUT/check.txt, $OUT/check.json," \
    "$OUT/calibration.json" >&2
else
  echo "== 3. skipped: polars is missing here, so rolltool pack cannot run." \
    "$OUT/calibration.json is written; back on a machine with polars, pack with it:" >&2
  echo "     ${calibrated[*]}" >&2
  echo "== 4. skipped (nothing calibrated to compare); step 2's table is the three-way" \
    "comparison" >&2
  echo "wrote $OUT/check.txt, $OUT/check.json, $OUT/calibration.json" >&2
fi

if [[ $SPLIT == 1 ]]; then
  if [[ -d $SRC/packed-cp2 && -d $SRC/packed-sp2 ]]; then
    echo "== 5. --cp 2 and --sp 2 per GPU ($WHAT) with --check" >&2
    layer_bench "$SRC/packed-flops" "$SRC/packed-cp2" "$SRC/packed-sp2" --check \
      --json-out "$OUT/split.json" | tee "$OUT/split.txt"
  else
    echo "== 5. skipped: $SRC has no packed-cp2/packed-sp2 (prepare again with SPLIT=1)" >&2
  fi
fi
