#!/bin/bash
# Starts the GPU run's background work detached (a process left in the caller's session may be killed with it),
# then watches it. One GPU: the scale pipeline. Two GPUs (nvidia-h200-x2): the pipeline on
# GPU 0 and, on GPU 1 (GPU1=bench|specforge|ddp,specforge|ddp,bench|none), the benchmark suite (sglang_ext.eval.spec_bench
# all, the default) or the SpecForge training comparison (each after the two-GPU DDP check with ddp,...), side by
# side; on one GPU, GPU1=specforge runs that comparison on the pipeline's GPU.
#   bash tests/gpu/launch.sh SECONDS_OF_WORK
# Needs /tmp/site (install.sh), /tmp/gpu-data and, unless a build was restored into /tmp/scale
# (scale_pipeline.py unpack-build), the SmolLM2 GGUF halves in /tmp/teacher.
set -e
BUDGET=${1:-1450}
export PYTHONPATH=/tmp/site:$PWD GPU_DATA=/tmp/gpu-data PYTHONUNBUFFERED=1
if [ ! -f /tmp/scale/target/scale_target_report.json ]; then  # the build needs the teacher; a restored one does not
  if [ ! -f /tmp/teacher/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    cat /tmp/teacher/*.part-aa "${STAGE:?STAGE: the directory tests/gpu/stage_data.py wrote}"/teacher/*.part-ab \
      > /tmp/teacher/SmolLM2-135M-Instruct.Q4_1.gguf
  fi
  export TEACHER=/tmp/teacher/SmolLM2-135M-Instruct.Q4_1.gguf
fi
mkdir -p /tmp/scale /tmp/specbench
rm -f /tmp/scale/progress.log /tmp/specbench/bench.log
GPUS=$(nvidia-smi -L | wc -l)
GPU1=${GPU1:-bench}  # the second GPU's work: bench (sglang_ext.eval.spec_bench), specforge (the trainer comparison),
                     # ddp,specforge / ddp,bench (first tests/gpu/check_ddp.py, which also uses GPU 0 for a
                     # minute), none.
                     # On one GPU, specforge runs beside the pipeline on that GPU after SPECFORGE_DELAY_S
                     # (its steps alternate with ours, so the pipeline's load weighs on both alike)
case "$GPU1" in bench|specforge|ddp,specforge|ddp,bench|none) ;;
  *) echo "GPU1=$GPU1: choose bench, specforge, ddp,specforge, ddp,bench or none"; exit 2;; esac
case "$GPU1" in ddp,*) [ "$GPUS" -lt 2 ] && { echo "GPU1=$GPU1 needs two GPUs"; exit 2; };; esac
SIDE=""  # the GPU of the SpecForge comparison
if [ "$GPU1" = specforge ] || [ "$GPU1" = ddp,specforge ]; then
  SIDE=$(( GPUS >= 2 ? 1 : 0 ))
  export PIPE_SKIP="${PIPE_SKIP:+$PIPE_SKIP,}specforge"  # the pipeline's own step would run it a second time
fi
PIPE_DEADLINE=$(( $(date +%s) + BUDGET )) CUDA_VISIBLE_DEVICES=0 \
  setsid nohup python tests/gpu/scale_pipeline.py run > /tmp/scale/pipeline.log 2>&1 < /dev/null &
if [ -n "$SIDE" ]; then
  # after the pipeline has rotated progress.log; the MLA trainer may use GPU 1 afterwards (MLA_TRAIN_GPU=1)
  sleep 5
  DDP=""
  [ "$GPU1" = ddp,specforge ] && DDP="OUT=/tmp/scale/results python tests/gpu/check_ddp.py > /tmp/scale/ddp.log 2>&1; "
  PIPE_DEADLINE=$(( $(date +%s) + BUDGET )) setsid nohup bash -c \
    "sleep ${SPECFORGE_DELAY_S:-0}; $DDP CUDA_VISIBLE_DEVICES=$SIDE python tests/gpu/scale_pipeline.py specforge" \
    > /tmp/scale/specforge.log 2>&1 < /dev/null &
elif [ "$GPUS" -ge 2 ] && { [ "$GPU1" = bench ] || [ "$GPU1" = ddp,bench ]; }; then
  # BENCH_STATE: an earlier run's state.json (e.g. docs/bench/state-*.json) whose arms are kept, not re-run
  [ -n "$BENCH_STATE" ] && [ ! -f /tmp/specbench/state.json ] && cp "$BENCH_STATE" /tmp/specbench/state.json
  DDP=""
  [ "$GPU1" = ddp,bench ] && { sleep 5; DDP="OUT=/tmp/scale/results python tests/gpu/check_ddp.py > /tmp/scale/ddp.log 2>&1; "; }
  # the benchmark starts no arm later than 250 s before the pipeline's deadline (after the DDP check, if any)
  END=$(( $(date +%s) + BUDGET - 250 ))
  SPEC_BENCH_WORK=/tmp/specbench setsid nohup bash -c \
    "$DDP export CUDA_VISIBLE_DEVICES=1; python -P -m sglang_ext.eval.spec_bench all --out /tmp/specbench/benchmarks.md --port 31177 --deadline-s \$(( $END - \$(date +%s) )) ${BENCH_ARGS:-}; echo \"[bench] EXIT \$?\"" \
    > /tmp/specbench/bench.log 2>&1 < /dev/null &
fi
sleep 3
python tests/gpu/scale_pipeline.py watch $(( ${WATCH_S:-540} ))
