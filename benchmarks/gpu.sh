#!/usr/bin/env bash
# The 1.5B real model on a GPU: Wanda / SparseGPT 50 %, depth (foldable) and eval in
# bfloat16, each plain, with --offload (weights on the CPU, one block on the GPU at a time)
# and with --stream (layer-wise loading from disk) where `prunelab ... --help` lists it;
# llm-compressor (oneshot, sequential pipeline) on the same calibration tokens through
# benchmarks/sparsity_vs_llmcompressor.py. Prints one table: wall s, peak RSS, peak GPU
# memory, test perplexity.
#
#   benchmarks/gpu.sh [--dry-run] [--out DIR]
#
# --dry-run checks the plan on any machine (no GPU, nothing run): python and prunelab
# import, the model spec is known (embedded spec or checkpoint dir), every flag of every
# planned command exists in that command's --help, the llm-compressor script takes
# --model/--dtype/--device; it prints the plan and exits 0, or names what is wrong and
# exits 1. Settings come from the environment:
#   MODEL (qwen2.5-coder-1.5b)  SAMPLES (128)  SEQLEN (2048)  TEST_SAMPLES (40)
#   DEVICE (cuda)  DTYPE (bfloat16)  REMOVE (7 blocks for depth)  PYTHON (python3)
#   SKIP_LLMC (unset; 1 = prunelab only)
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
MODEL="${MODEL:-qwen2.5-coder-1.5b}"
SAMPLES="${SAMPLES:-128}"
SEQLEN="${SEQLEN:-2048}"
TEST_SAMPLES="${TEST_SAMPLES:-40}"
DEVICE="${DEVICE:-cuda}"
DTYPE="${DTYPE:-bfloat16}"
REMOVE="${REMOVE:-7}"
PYTHON="${PYTHON:-python3}"
DRY=0
OUT="$ROOT/.bench/gpu-$(date -u +%Y%m%d-%H%M%S)"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=250 NO_COLOR=1 TERM=dumb
PL=("$PYTHON" -m prunelab)
FAIL=0
fail() { echo "PLAN ERROR: $*" >&2; FAIL=1; }

# ------------------------------------------------------------------ flags each command has
declare -A HELP
load_help() {  # every planned subcommand's --help and the model check, in one process
  local all key
  all="$("$PYTHON" - "$MODEL" 2>&1 <<'EOF'
import sys
from pathlib import Path

from prunelab.cli import cli_main
from prunelab.models.embedded import EMBEDDED

for cmd in ("eval", "prune sparsity", "prune depth"):
    print(f"@@HELP {cmd}", flush=True)
    cli_main([*cmd.split(), "--help"])
    sys.stdout.flush()
spec = sys.argv[1]
known = spec in EMBEDDED or (Path(spec) / "config.json").is_file()
print("@@MODEL", "known" if known else "unknown", flush=True)
EOF
)" || fail "cannot import prunelab / render the CLI help with $PYTHON: ${all##*$'\n'}"
  for key in "eval" "prune sparsity" "prune depth"; do
    HELP[$key]="$(awk -v k="@@HELP $key" '$0 == k {on = 1; next} /^@@/ {on = 0} on' <<<"$all")"
    [ -n "${HELP[$key]}" ] || fail "no --help text for 'prunelab $key'"
  done
  grep -qx "@@MODEL known" <<<"$all" || fail "model spec $MODEL is neither an embedded name nor a checkpoint dir"
}
has_flag() { grep -qE -- "(^|[^a-z0-9-])$2([^a-z0-9-]|\$)" <<<"${HELP[$1]:-}"; }

# ------------------------------------------------------------------ the plan
# Each entry: NAME|SUBCOMMAND|FLAGS (the output checkpoint, if any, is $OUT/ckpt/NAME).
PLAN=()
COMMON="--model $MODEL --dtype $DTYPE --device $DEVICE"
CALIB="--samples $SAMPLES --seqlen $SEQLEN --data wiki-vital:calib"
modes_for() {  # the memory modes a subcommand supports: plain, --offload, --stream
  local out="plain"
  has_flag "$1" --offload && out="$out offload"
  has_flag "$1" --stream && out="$out stream"
  echo "$out"
}
flag_of() { case "$1" in plain) echo "" ;; *) echo "--$1" ;; esac; }
build_plan() {
  local mode
  for mode in $(modes_for eval); do
    PLAN+=("eval-dense-$mode|eval|$COMMON --data wiki-vital:test --samples $TEST_SAMPLES --seqlen $SEQLEN $(flag_of "$mode")")
  done
  for method in wanda sparsegpt; do
    for mode in $(modes_for "prune sparsity"); do
      PLAN+=("$method-$mode|prune sparsity|$COMMON $CALIB --method $method --budget remove-weights:0.5 $(flag_of "$mode")")
    done
  done
  for mode in $(modes_for "prune depth"); do
    PLAN+=("depth$REMOVE-foldable-$mode|prune depth|$COMMON $CALIB --budget remove-blocks:$REMOVE --probe block-influence --recovery foldable $(flag_of "$mode")")
  done
}

check_plan() {
  local entry name sub flags f
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name sub flags <<<"$entry"
    for f in $flags; do
      case "$f" in --*) has_flag "$sub" "$f" || fail "$name: 'prunelab $sub' has no $f" ;; esac
    done
    case "$sub" in prune*) has_flag "$sub" --out || fail "$name: 'prunelab $sub' has no --out" ;; esac
  done
  has_flag eval --json || fail "'prunelab eval' has no --json"
  local bh
  bh="$("$PYTHON" "$HERE/sparsity_vs_llmcompressor.py" --help 2>&1)" || fail "the llm-compressor benchmark's --help failed"
  for f in --model --dtype --device --samples --seqlen --test-samples --settings --json; do
    grep -qE -- "(^|[^a-z0-9-])$f([^a-z0-9-]|\$)" <<<"$bh" || fail "sparsity_vs_llmcompressor.py has no $f"
  done
}

# ------------------------------------------------------------------ running and measuring
gpu_sampler() {  # peak used GPU memory (MiB) into $1 while it runs
  local peak=0 v
  while :; do
    v=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    [ -n "$v" ] && [ "$v" -gt "$peak" ] && peak=$v && echo "$peak" >"$1"
    sleep 0.2
  done
}
measure() {  # NAME LOGFILE CMD...: "wall_s maxrss_KiB" -> $OUT/NAME.time, GPU -> .status
  local name="$1" log="$2"; shift 2
  local gpu0 gpu_file="$OUT/$name.gpu" pid
  gpu0=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
  echo 0 >"$gpu_file"
  gpu_sampler "$gpu_file" & pid=$!
  "$PYTHON" - "$OUT/$name.time" "$log" "$@" <<'EOF'
import resource, subprocess, sys, time
t0 = time.perf_counter()
with open(sys.argv[2], "w") as log:
    rc = subprocess.run(sys.argv[3:], stdout=log, stderr=subprocess.STDOUT).returncode
wall = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
open(sys.argv[1], "w").write(f"{wall:.1f} {rss}\n")
sys.exit(rc)
EOF
  local rc=$?
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  echo "$rc ${gpu0:-0} $(cat "$gpu_file")" >"$OUT/$name.status"
  return $rc
}
ppl_of() {  # perplexity from an eval --json file
  "$PYTHON" -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{d.get('perplexity', d.get('metrics', {}).get('perplexity', float('nan'))):.3f}\")" "$1" 2>/dev/null || echo "-"
}
run_plan() {
  mkdir -p "$OUT/ckpt" "$OUT/logs"
  local entry name sub flags ck
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name sub flags <<<"$entry"
    echo "== $name: prunelab $sub $flags"
    if [ "$sub" = eval ]; then
      # shellcheck disable=SC2086
      measure "$name" "$OUT/logs/$name.log" "${PL[@]}" eval $flags --json "$OUT/$name.eval.json"
    else
      ck="$OUT/ckpt/$name"
      # shellcheck disable=SC2086
      measure "$name" "$OUT/logs/$name.log" "${PL[@]}" $sub $flags --out "$ck" && \
        "${PL[@]}" eval --model "$ck" --dtype "$DTYPE" --device "$DEVICE" \
          --data wiki-vital:test --samples "$TEST_SAMPLES" --seqlen "$SEQLEN" \
          --json "$OUT/$name.eval.json" >"$OUT/logs/$name.eval.log" 2>&1
      rm -rf "$ck"
    fi
  done
  if [ -z "${SKIP_LLMC:-}" ]; then
    echo "== llm-compressor vs prunelab (sparsity_vs_llmcompressor.py)"
    "$PYTHON" "$HERE/sparsity_vs_llmcompressor.py" --model "$MODEL" --dtype "$DTYPE" \
      --device "$DEVICE" --samples "$SAMPLES" --seqlen "$SEQLEN" \
      --test-samples "$TEST_SAMPLES" --settings wanda-0.5,sparsegpt-0.5 \
      --json "$OUT/llmc.json" >"$OUT/logs/llmc.log" 2>&1 || echo "  llm-compressor run failed: $OUT/logs/llmc.log"
  fi
}
print_table() {
  echo
  echo "$MODEL, $DTYPE on $DEVICE ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)), $(date -u +%F)"
  echo "calibration $SAMPLES x $SEQLEN wiki-vital:calib, test $TEST_SAMPLES x $SEQLEN wiki-vital:test"
  printf '%-28s %6s %10s %12s %12s %10s\n' run exit "wall s" "peak RSS MiB" "peak GPU MiB" "test ppl"
  local entry name rc g0 g1 t m
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name _ _ <<<"$entry"
    read -r rc g0 g1 <"$OUT/$name.status" 2>/dev/null || { rc="-"; g0=0; g1=0; }
    read -r t m <"$OUT/$name.time" 2>/dev/null || { t="-"; m=0; }
    printf '%-28s %6s %10s %12s %12s %10s\n' "$name" "$rc" "$t" "$((m / 1024))" \
      "$((g1 > g0 ? g1 - g0 : 0))" "$(ppl_of "$OUT/$name.eval.json")"
  done
  if [ -f "$OUT/llmc.json" ]; then
    "$PYTHON" - "$OUT/llmc.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for s, r in d["results"].items():
    for side in ("prunelab", "llmc"):
        x = r.get(side, {})
        if "seconds" in x:
            gpu = x.get("cuda_peak_bytes")
            print(f"{('llmc ' if side == 'llmc' else 'bench ') + s:<28} {'0':>6} "
                  f"{x['seconds']:>10.1f} {x['extra_peak'] / 2**20:>12.0f} "
                  f"{(gpu or 0) / 2**20:>12.0f} {x.get('ppl', float('nan')):>10.3f}")
EOF
  fi
  echo "(peak RSS: whole process (getrusage); llmc/bench rows: over the loaded model;"
  echo " peak GPU: nvidia-smi used minus before, or torch max allocated for the llmc/bench rows)"
}

load_help
build_plan
check_plan
if [ "$DRY" = 1 ]; then
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name sub flags <<<"$entry"
    echo "plan: $name: prunelab $sub $flags"
  done
  [ -z "${SKIP_LLMC:-}" ] && echo "plan: llmc: sparsity_vs_llmcompressor.py --model $MODEL --dtype $DTYPE --device $DEVICE --settings wanda-0.5,sparsegpt-0.5"
  if [ "$FAIL" = 0 ]; then echo "dry run OK: ${#PLAN[@]} prunelab runs"; exit 0; fi
  echo "dry run FAILED" >&2; exit 1
fi
[ "$FAIL" = 0 ] || { echo "the plan does not check out; see above" >&2; exit 1; }
command -v nvidia-smi >/dev/null || { echo "gpu.sh: no nvidia-smi (no GPU?); use --dry-run" >&2; exit 1; }
run_plan
print_table | tee "$OUT/table.txt"
