#!/bin/bash
# The TP issue on nvidia-h200-x2, as one detached job (a device `run` kills what it leaves in its own
# session) and a watch:
#   phase 1, side by side: check_serving on the tiny DeepseekV3 target at TP=1 (GPU 0; heads restored from
#            .gpu-state, so nothing trains) and the Kimi-shaped benchmark arms at TP=1 (GPU 1);
#   phase 2, both GPUs: the same check_serving arms and benchmark arms at TP=2 (same target, heads, prompts);
#   then tests/gpu/compare_tp.py (TP=2 vs TP=1: partings scored by TP=1's gaps, acceptance, per-position
#   counts, views, invariant) and the benchmark reports.
#     bash tests/gpu/launch_tp.sh [WATCH_SECONDS]      # later calls: bash tests/gpu/launch_tp.sh watch SECONDS
# Env: TP_ARMS (check_serving arms), TP_BENCH_ARMS (spec_bench arms), TP_LEVELS (concurrency levels).
# Needs /tmp/site (install.sh) and the tiny target's heads of an earlier run in .gpu-state (carry
# .gpu-state/head-mha, .gpu-state/head-mla). Results: /tmp/tp, copied to $OUT/tp by every watch.
set -e
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
TP=/tmp/tp
watch() {
  local limit=$1 start=$SECONDS
  while [ $((SECONDS - start)) -lt "$limit" ]; do
    grep -q "\] DONE$" $TP/progress.log 2>/dev/null && break
    sleep 10
  done
  cat $TP/progress.log
  if [ -n "$OUT" ]; then
    mkdir -p "$OUT/tp"
    for f in $TP/progress.log $TP/compare.txt $TP/*.md /tmp/tp1.json /tmp/tp2/state.json /tmp/tpbench1/state.json \
             /tmp/tpbench2/state.json; do
      [ -f "$f" ] && cp "$f" "$OUT/tp/$(echo "$f" | tr / _ | sed 's/^_//')"
    done
    for f in $TP/*.log; do tail -c 20000 "$f" > "$OUT/tp/$(basename "$f")"; done
  fi
}
if [ "$1" = "watch" ]; then watch "${2:-540}"; exit 0; fi

ARMS=${TP_ARMS:-"target mha-chain mla-chain mha-tree mla-tree"}
BENCH_ARMS=${TP_BENCH_ARMS:-"plugin-chain-verify-decode plugin-mla-chain plugin-tree"}
LEVELS=${TP_LEVELS:-"1,8,32"}
mkdir -p $TP && rm -f $TP/progress.log
cat > $TP/job.sh <<EOF
say() { echo "[tp \$(date +%H:%M:%S)] \$*" >> $TP/progress.log; }
bench() {  # WORK TP
  SPEC_BENCH_WORK=\$1 SPEC_BENCH_TP=\$2 python -m eval.spec_bench all --concurrency $LEVELS --repeats 1 \
    --port \$3 --out \$1/benchmarks.md $BENCH_ARMS
}
say "phase 1: TP=1 check_serving ($ARMS) on GPU 0, TP=1 benchmark ($BENCH_ARMS) on GPU 1"
( CUDA_VISIBLE_DEVICES=0 GPU_CHECK_RESTORE=$PWD/.gpu-state GPU_CHECK_WORK=/tmp/tp1 GPU_CHECK_NO_TRAIN=1 \
    python tests/gpu/check_serving.py $ARMS > $TP/check-tp1.log 2>&1; say "check TP=1 rc \$?" ) &
( CUDA_VISIBLE_DEVICES=1 bench /tmp/tpbench1 1 31177 > $TP/bench-tp1.log 2>&1; say "bench TP=1 rc \$?" ) &
wait
cp /tmp/tp1/state.json /tmp/tp1.json
grep -h "^\[bench\]" $TP/bench-tp1.log >> $TP/progress.log || true
say "phase 2: TP=2"
# TP=2 starts from TP=1's target, heads and prompts, not its outputs: an arm that fails at TP=2 must not
# compare TP=1's outputs with themselves
rm -rf /tmp/tp1-restore && cp -r /tmp/tp1 /tmp/tp1-restore
python -c "import json; s = json.load(open('/tmp/tp1.json')); json.dump({'prompts': s['prompts']}, open('/tmp/tp1-restore/state.json', 'w'))"
GPU_CHECK_RESTORE=/tmp/tp1-restore GPU_CHECK_WORK=/tmp/tp2 GPU_CHECK_TP=2 GPU_CHECK_NO_TRAIN=1 \
  python tests/gpu/check_serving.py $ARMS > $TP/check-tp2.log 2>&1; say "check TP=2 rc \$?"
python tests/gpu/compare_tp.py /tmp/tp1.json /tmp/tp2/state.json > $TP/compare.txt 2>&1; say "compare rc \$?"
cat $TP/compare.txt >> $TP/progress.log
mkdir -p /tmp/tpbench2   # the same target and heads; the TP=1 arms are not carried over
cp -r /tmp/tpbench1/target /tmp/tpbench1/head-* /tmp/tpbench2/
python -c "import json; s = json.load(open('/tmp/tpbench1/state.json')); json.dump({'build': s['build']}, open('/tmp/tpbench2/state.json', 'w'))"
bench /tmp/tpbench2 2 31178 > $TP/bench-tp2.log 2>&1; say "bench TP=2 rc \$?"
grep -h "^\[bench\]" $TP/bench-tp2.log >> $TP/progress.log || true
cp /tmp/tpbench1/benchmarks.md $TP/bench-tp1.md 2>/dev/null; cp /tmp/tpbench2/benchmarks.md $TP/bench-tp2.md 2>/dev/null
say DONE
EOF
setsid nohup bash $TP/job.sh > $TP/job.log 2>&1 < /dev/null &
sleep 5
watch "${1:-540}"
