#!/usr/bin/env bash
# Issue 30's checks on a Hopper GPU, in one command: the environment, the native kernel tests, the
# kernel sweep and the unified step against its roofline (with a jax.profiler trace), for every
# target x draft at real sizes with random weights. Logs and JSON go to OUT_DIR (default ./gpu-out).
# Stages: env tests kernels mla dense step step_eagle3 step_dflash llama llama_eagle3 llama_dflash llama_ngram
# step_dsf smollm2 smollm2_ngram smollm2_suffix smollm2_tree (default: env tests kernels step), e.g. `bash scripts/gpu_checks.sh env tests`; step_dsf
# repeats step with XLA's dynamic-slice fusion on; smollm2 times SmolLM2-135M's shape (random weights) plain and with its
# shipped EAGLE-3 draft's shape at batch 1, 8 and 32 (SMOL_BATCH, SMOL_K); smollm2_ngram the same shape with n-gram
# drafts (K = 3, 5, 8: SMOL_NGRAM_K), each step verifying K + 1 tokens as where the lookup matched (and, beside
# it, the step without a match), then scripts/bench_either.py (the step's two widths by loops or lax.cond);
# smollm2_suffix the same with suffix decoding's drafts (K = 4, 8: SMOL_SUFFIX_K; its lookup and frequency tree);
# smollm2_tree the EAGLE-3 draft's shape verifying static and dynamic (EAGLE-2) token trees (SMOL_TREES). PACK=FILE.tgz re-packs OUT_DIR's reports (not the traces) into FILE after
# every stage, so a run cut short still returns what it finished. Each stage runs under its own time limit (seconds: TESTS_S / KERNELS_S / STEP_S) so a
# hang in one leaves the others their time; a timed-out pytest is interrupted (SIGINT) so that it
# still prints its summary.
set -uo pipefail
set -f  # no globbing: the stages pass JSON values such as [0,1,2]
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
      timeout -k 20 -s INT "${TESTS_S:-300}" $PY -m pytest -q -rs --tb=short -p no:cacheprovider \
        ${TESTS_ARGS:-tests/pallas_kernels} >"$OUT_DIR/tests.log" 2>&1
      echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT_DIR/tests.log" | tail -30
      grep -qE "passed|failed" "$OUT_DIR/tests.log" || tail -40 "$OUT_DIR/tests.log"
      ;;
    kernels)
      timeout "${KERNELS_S:-300}" $PY scripts/bench_kernels.py ${KERNELS_ARGS:---batch 1 64 --context 1024 32768 --k 0 3 --gmm-tokens 1 32 256 --gmm-weights bf16 fp8 --device-time} \
        --json "$OUT_DIR/kernels.json" >"$OUT_DIR/kernels.md" 2>"$OUT_DIR/kernels.log"
      echo "kernels rc=$?"; cat "$OUT_DIR/kernels.md"; grep -E "skipped|Error|error" "$OUT_DIR/kernels.log" | cut -c1-400 | sort -u | head -20
      ;;
    mla|dense)  # mla: the MLA kernel's two schedules side by side; dense: FP8 dense projections three ways
      case $stage in
        mla) bench_args=${MLA_ARGS:---ops mla_decode --impls kernel-shared kernel-single --batch 1 64 --context 1024 32768 --k 0 3} ;;
        dense) bench_args=${DENSE_ARGS:---ops dense --impls materialize blocked kernel --dense-tokens 1 4 32} ;;
      esac
      timeout "${KERNELS_S:-300}" $PY scripts/bench_kernels.py $bench_args --device-time \
        --json "$OUT_DIR/$stage.json" >"$OUT_DIR/$stage.md" 2>"$OUT_DIR/$stage.log"
      echo "$stage rc=$?"; cat "$OUT_DIR/$stage.md"; grep -E "skipped|Error|error" "$OUT_DIR/$stage.log" | cut -c1-300 | sort -u | head -12
      ;;
    step|step_eagle3|step_dflash|llama|llama_eagle3|llama_dflash|llama_ngram)
      V3="--config configs/deepseek-v3.json --weights fp8 --set num_hidden_layers=3 --set first_k_dense_replace=1"
      case $stage in
        step) run_args="$V3 --k 0 1 3" ;;  # the MTP layer
        step_eagle3) run_args="$V3 --draft-config configs/eagle3-deepseek-v3.json --k 1 3" ;;
        step_dflash)  # the 3-layer target: the draft reads its 3 layers
          run_args="$V3 --draft-config configs/dflash-deepseek-v3.json --draft-set num_target_layers=3
            --draft-set dflash_config={\"mask_token_id\":129279,\"target_layer_ids\":[0,1,2]} --k 3 7" ;;
        llama) run_args="--config configs/llama-3.1-8b.json --k 0" ;;
        llama_eagle3) run_args="--config configs/llama-3.1-8b.json --draft-config configs/eagle3-llama-3.1-8b.json --k 1 3" ;;
        llama_dflash) run_args="--config configs/llama-3.1-8b.json --draft-config configs/dflash-llama-3.1-8b.json --k 3 7" ;;
        llama_ngram) run_args="--config configs/llama-3.1-8b.json --draft ngram --k 3 7" ;;  # no weights: verifying K + 1 and the lookup
      esac
      [ -n "${STEP_K:-}" ] && run_args="$run_args --k $STEP_K"  # e.g. STEP_K="3": one K per stage
      timeout "${STEP_S:-300}" $PY scripts/bench_step.py $run_args ${STEP_ARGS:---context 4096 --iters 10} \
        --profile "$OUT_DIR/prof_$stage" --json "$OUT_DIR/$stage.json" >"$OUT_DIR/$stage.md" 2>"$OUT_DIR/$stage.log"
      echo "$stage rc=$?"; cat "$OUT_DIR/$stage.md"; grep -vE "^\s+[0-9.]+ us" "$OUT_DIR/$stage.log" | tail -5
      ;;
    step_dsf)  # the same step with XLA's dynamic-slice fusion: the scanned layers' weight slices read in place
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" timeout "${STEP_S:-300}" \
        $PY scripts/bench_step.py --config configs/deepseek-v3.json --weights fp8 \
        ${STEP_ARGS:---set num_hidden_layers=3 --set first_k_dense_replace=1 --context 4096 --k 0 1 3 --iters 10} \
        --json "$OUT_DIR/step_dsf.json" >"$OUT_DIR/step_dsf.md" 2>"$OUT_DIR/step_dsf.log"
      echo "step_dsf rc=$?"; cat "$OUT_DIR/step_dsf.md"; tail -5 "$OUT_DIR/step_dsf.log"
      ;;
    smollm2|smollm2_ngram|smollm2_suffix|smollm2_tree)  # item 5, issues 32 and 66: the real model's shapes; tokens/s = rows x tokens per step
      # (the acceptance length, measured end to end on the CPU with the real weights) / step
      case $stage in
        smollm2) draft_args="--draft-config checkpoints/smollm2-135m-instruct-eagle3/config.json --k ${SMOL_K:-0 2 3}" ;;
        smollm2_ngram) draft_args="--draft ngram --k ${SMOL_NGRAM_K:-0 3 5 8}" ;;
        smollm2_suffix) draft_args="--draft suffix --k ${SMOL_SUFFIX_K:-0 4 8}" ;;
        smollm2_tree) draft_args="--draft-config checkpoints/smollm2-135m-instruct-eagle3/config.json --k 0 3 \
          --tree ${SMOL_TREES:-4,3,24 4,3,24,dynamic 6,3,24,dynamic}" ;;
      esac
      for b in ${SMOL_BATCH:-1 8 32}; do
        prof=""; [ "$b" = 1 ] && prof="--profile $OUT_DIR/prof_$stage"
        timeout "${STEP_S:-300}" $PY scripts/bench_step.py --config configs/smollm2-135m.json $draft_args --batch "$b" \
          ${STEP_ARGS:---context 512 --iters 20} $prof --json "$OUT_DIR/$stage-b$b.json" \
          >"$OUT_DIR/$stage-b$b.md" 2>"$OUT_DIR/$stage-b$b.log"
        echo "$stage batch $b rc=$?"; cat "$OUT_DIR/$stage-b$b.md"; grep -vE "^\s+[0-9.]+ us" "$OUT_DIR/$stage-b$b.log" | tail -3
      done
      if [ "$stage" = smollm2_ngram ]; then  # step.either's loops against lax.cond (pool copies vs predicate reads)
        timeout "${STEP_S:-300}" $PY scripts/bench_either.py --config configs/smollm2-135m.json --k 8 --context 512 \
          --pool-rows 32 --rounds 6 --json "$OUT_DIR/either.json" >"$OUT_DIR/either.md" 2>"$OUT_DIR/either.log"
        echo "either rc=$?"; cat "$OUT_DIR/either.md"; tail -2 "$OUT_DIR/either.log"
      fi
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  [ -n "${PACK:-}" ] && tar czf "$PACK" --exclude='prof_*' -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
done
