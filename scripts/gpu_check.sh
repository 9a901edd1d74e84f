#!/usr/bin/env bash
# The CUDA measurements of docs/benchmarks/2026-11-26-h200.md, in one run that fits a short lease:
# which ops are batch-invariant on this GPU, the dtype the engine picks here, where a decode step's
# time goes, and the bench eager and compiled (CUDA graphs). Each step has its own time box, so one
# that fails or runs long leaves the others; logs and JSON go to OUT (default runs/gpu).
#
#     bash scripts/gpu_check.sh [OUT] [SECONDS]      # SECONDS: the whole run's budget (default 540)
#
# Set BENCH_ARGS to change the prompt set (default: the first MT-Bench question of each category,
# 96 new tokens) and DEVICE to pick another device (default cuda). On an H200 these steps took
# about 7 minutes together, run one by one (docs/benchmarks/2026-11-26-h200.md); eight files land in OUT, the most
# a device lease returns.
set -u
OUT=${1:-runs/gpu}
BUDGET=${2:-540}
DEVICE=${DEVICE:-cuda}
BENCH_ARGS=${BENCH_ARGS:---per-category 1 --max-new-tokens 96}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts import medusa from this checkout

step() {  # step NAME CAP_SECONDS COMMAND...: run with the smaller of CAP and what the budget has left
    local name=$1 cap=$2; shift 2
    local left=$((BUDGET - ($(date +%s) - START) - 5))
    if [ "$left" -lt 20 ]; then echo "== $name: skipped, budget spent" | tee -a "$OUT/summary.txt"; return; fi
    [ "$cap" -gt "$left" ] && cap=$left
    local t0=$(date +%s)
    timeout --signal=INT --kill-after=10 "$cap" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $(( $(date +%s) - t0 )) s (box $cap s)" | tee -a "$OUT/summary.txt"
}

{
    echo "== environment"
    nvidia-smi -L 2>&1 || true
    $PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.version.cuda, '| gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"

step probe 60 $PY scripts/probe_exactness.py --device "$DEVICE" --dtypes bfloat16,float16,float32
# First load: converts the embedded model once, then the dtype pick measures and caches its costs.
step load 150 $PY -c "
import time, medusa
t = time.perf_counter(); eng = medusa.load(device='$DEVICE')
print(f'load {time.perf_counter() - t:.1f} s: device {eng.device}, dtype {eng.model.dtype}')
for what in ('dtype_choice',):
    print(what, getattr(eng.model, what, None))
for what in ('kernel_choice', 'draft_dtype_choice', 'compile_reason'):
    print(what, getattr(eng, what, None))
"
step bench 150 $PY -m infer.bench --device "$DEVICE" $BENCH_ARGS --modes hf,baseline,lookup,medusa,hybrid
step bench-eagle 120 $PY -m infer.bench --device "$DEVICE" $BENCH_ARGS --modes hf,eagle,hybrid@eagle
# Compiled passes (CUDA graphs on CUDA), in two runs so that a long compile of one leaves the other.
step compiled 200 $PY -m infer.bench --device "$DEVICE" $BENCH_ARGS --modes hf,hf-compile,baseline,baseline+compile
step compiled-eagle 120 $PY -m infer.bench --device "$DEVICE" $BENCH_ARGS --modes hf,hybrid@eagle+compile
step profile 45 $PY scripts/profile_step.py --device "$DEVICE" --reps 20

for f in probe load bench bench-eagle compiled compiled-eagle profile; do
    [ -f "$OUT/$f.log" ] || continue
    echo; echo "#### $f (last lines)"; tr '\r' '\n' < "$OUT/$f.log" | grep -v -E '^\s*$|it/s\]|s/it\]' | tail -n 40
done
echo; cat "$OUT/summary.txt"
