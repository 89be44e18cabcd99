#!/bin/bash
# The automatic drafting shape (sglang_ext/serving/draft_shape.py) on one GPU, as one detached job (a process left
# in the caller's session may be killed with it) and a watch:
#   1. check_serving on the tiny DeepseekV3 target: greedy equality in deterministic mode for each server started
#      as the tree whose cost policy also chooses chains and no drafting (AUTO_CHECK_ARMS; the heads are trained
#      in the run unless GPU_CHECK_WORK already holds them);
#   2. spec_bench compare on the Kimi-K2.5-shaped target (AUTO_LAYERS layers): the automatic shape beside the
#      fixed chain and tree and no speculation at one synthetic acceptance (AUTO_COMPARE: the chain must win
#      there, every shape accepting the same), then a head that never accepts beside no speculation
#      (AUTO_ZERO_COMPARE), at AUTO_LEVELS; the tables against the chain and against no speculation.
# Each server's policy summaries ("measured step time ... now ..."), CUDA-graph memory and KV pool lines are kept.
#     bash tests/gpu/launch_auto_shape.sh [WATCH_SECONDS]    # later calls: bash tests/gpu/launch_auto_shape.sh watch SECONDS
# Env: AUTO_CHECK_ARMS, AUTO_COMPARE, AUTO_ZERO_COMPARE (empty: that part skipped), AUTO_LEVELS, AUTO_REPEATS,
# AUTO_LAYERS, AUTO_BENCH_OPTS (more compare options). Needs /tmp/site (install.sh).
# Results: /tmp/autoshape, packed into $OUT/autoshape.tgz by every watch (one file: $OUT returns few files).
set -e
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/autoshape
watch() {
  local limit=$1 start=$SECONDS
  while [ $((SECONDS - start)) -lt "$limit" ]; do
    grep -q "\] DONE$" $R/progress.log 2>/dev/null && break
    sleep 10
  done
  cat $R/progress.log 2>/dev/null || true
  if [ -n "$OUT" ]; then
    local pack=/tmp/autoshape-pack
    rm -rf $pack && mkdir -p $pack
    cp $R/progress.log $R/*.md $pack/ 2>/dev/null || true
    for f in $R/*.log; do tail -c 20000 "$f" > "$pack/$(basename "$f")"; done
    for f in /tmp/autoshape-bench/state.json /tmp/autoshape-zero/state.json /tmp/autoshape-check/out/serving.json; do
      [ -f "$f" ] && cp "$f" "$pack/$(echo "$f" | tr / _ | sed 's/^_//')"
    done
    for f in /tmp/gpu-logs/*.log; do  # what each server's policy ran, its graphs' memory, its pools, any error
      [ -f "$f" ] && grep -h "measured step time\|adaptive shapes\|Capture cuda graph end\|KV Cache is allocated\|Error\|Traceback" \
        "$f" | tail -80 > "$pack/server-$(basename "$f")"
    done
    tar czf "$OUT/autoshape.tgz" -C $pack .
  fi
}
if [ "$1" = "watch" ]; then watch "${2:-540}"; exit 0; fi

CHECK_ARMS=${AUTO_CHECK_ARMS-"target-deterministic mha-auto-shape-deterministic mla-auto-shape-deterministic"}
COMPARE=${AUTO_COMPARE-"auto-shape plugin-mha-chain plugin-mha-tree nospec"}
ZERO_COMPARE=${AUTO_ZERO_COMPARE-"zero-accept-auto-shape nospec"}
LEVELS=${AUTO_LEVELS:-"64,1,32,8,128"}
REPEATS=${AUTO_REPEATS:-2}
LAYERS=${AUTO_LAYERS:-16}
mkdir -p $R && rm -f $R/progress.log
cat > $R/job.sh <<JOB
say() { echo "[auto-shape \$(date +%H:%M:%S)] \$*" >> $R/progress.log; }
if [ -n "$CHECK_ARMS" ]; then
  say "check_serving: $CHECK_ARMS"
  GPU_CHECK_WORK=\${GPU_CHECK_WORK:-/tmp/autoshape-check} OUT=/tmp/autoshape-check/out GPU_CHECK_PARALLEL=2 \
    python tests/gpu/check_serving.py $CHECK_ARMS > $R/check.log 2>&1; say "check_serving rc \$?"
  sed -n '/^arm  /,\$p' $R/check.log >> $R/progress.log || true
fi
if [ -n "$COMPARE" ] || [ -n "$ZERO_COMPARE" ]; then
  SPEC_BENCH_WORK=/tmp/autoshape-bench python -P -m sglang_ext.eval.spec_bench build --layers $LAYERS > $R/build.log 2>&1
  say "build ($LAYERS layers) rc \$?"
fi
if [ -n "$COMPARE" ]; then
  say "compare: $COMPARE at $LEVELS"
  SPEC_BENCH_WORK=/tmp/autoshape-bench python -P -m sglang_ext.eval.spec_bench compare $COMPARE \
    --concurrency $LEVELS --repeats $REPEATS ${AUTO_BENCH_OPTS:-} > $R/compare.log 2>&1; say "compare rc \$?"
  SPEC_BENCH_WORK=/tmp/autoshape-bench python -P -m sglang_ext.eval.spec_bench table $COMPARE \
    --reference plugin-mha-chain > $R/table-vs-chain.md 2>&1 || true
  cat $R/table-vs-chain.md >> $R/progress.log
fi
if [ -n "$ZERO_COMPARE" ]; then
  # its own state: the same arm names (nospec) measured again beside this server set
  mkdir -p /tmp/autoshape-zero && cp -r /tmp/autoshape-bench/target /tmp/autoshape-bench/head-* /tmp/autoshape-zero/
  python -c "import json; s = json.load(open('/tmp/autoshape-bench/state.json')); json.dump({'build': s['build']}, open('/tmp/autoshape-zero/state.json', 'w'))"
  say "compare: $ZERO_COMPARE at $LEVELS"
  SPEC_BENCH_WORK=/tmp/autoshape-zero python -P -m sglang_ext.eval.spec_bench compare $ZERO_COMPARE \
    --concurrency $LEVELS --repeats $REPEATS ${AUTO_BENCH_OPTS:-} > $R/compare-zero.log 2>&1; say "compare rc \$?"
  SPEC_BENCH_WORK=/tmp/autoshape-zero python -P -m sglang_ext.eval.spec_bench table $ZERO_COMPARE \
    --reference nospec > $R/table-zero.md 2>&1 || true
  cat $R/table-zero.md >> $R/progress.log
fi
say "DONE"
JOB
setsid nohup bash $R/job.sh > $R/job.log 2>&1 < /dev/null &
sleep 3
watch "${WATCH_S:-540}"
