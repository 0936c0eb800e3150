#!/usr/bin/env bash
# Issue 21's checks on a Hopper GPU, in one command: the environment, the native kernel tests, the
# kernel sweep and the unified step against its roofline. Logs and JSON go to OUT_DIR (default
# ./gpu-out). Stages: env tests kernels step step_dsf (default: the first four), e.g.
# `bash scripts/gpu_checks.sh env tests`; step_dsf repeats step with XLA's dynamic-slice fusion on.
# Each stage runs under its own time limit (seconds, TESTS_S / KERNELS_S / STEP_S) so a hang in one
# leaves the others their time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-gpu-out}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stages=${*:-env tests kernels step}

for stage in $stages; do
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
      $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
      ;;
    tests)
      timeout "${TESTS_S:-300}" $PY -m pytest -q -rs --tb=short -p no:cacheprovider ${TESTS_ARGS:-tests/pallas_kernels} \
        >"$OUT_DIR/tests.log" 2>&1
      echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT_DIR/tests.log" | tail -30
      ;;
    kernels)
      timeout "${KERNELS_S:-300}" $PY scripts/bench_kernels.py ${KERNELS_ARGS:---batch 1 64 --context 1024 32768 --k 0 3 --gmm-tokens 1 32 256 --gmm-weights bf16 fp8} \
        --json "$OUT_DIR/kernels.json" >"$OUT_DIR/kernels.md" 2>"$OUT_DIR/kernels.log"
      echo "kernels rc=$?"; cat "$OUT_DIR/kernels.md"; grep -E "skipped|Error|error" "$OUT_DIR/kernels.log" | cut -c1-400 | sort -u | head -20
      ;;
    step)
      timeout "${STEP_S:-300}" $PY scripts/bench_step.py --config configs/deepseek-v3.json --weights fp8 \
        ${STEP_ARGS:---set num_hidden_layers=3 --set first_k_dense_replace=1 --context 4096 --k 0 1 3 --iters 10} \
        --json "$OUT_DIR/step.json" >"$OUT_DIR/step.md" 2>"$OUT_DIR/step.log"
      echo "step rc=$?"; cat "$OUT_DIR/step.md"; tail -5 "$OUT_DIR/step.log"
      ;;
    step_dsf)  # the same step with XLA's dynamic-slice fusion: the scanned layers' weight slices read in place
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" timeout "${STEP_S:-300}" \
        $PY scripts/bench_step.py --config configs/deepseek-v3.json --weights fp8 \
        ${STEP_ARGS:---set num_hidden_layers=3 --set first_k_dense_replace=1 --context 4096 --k 0 1 3 --iters 10} \
        --json "$OUT_DIR/step_dsf.json" >"$OUT_DIR/step_dsf.md" 2>"$OUT_DIR/step_dsf.log"
      echo "step_dsf rc=$?"; cat "$OUT_DIR/step_dsf.md"; tail -5 "$OUT_DIR/step_dsf.log"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
