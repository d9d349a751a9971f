#!/usr/bin/env bash
# Issues #19 and #20 on a lent GPU (the `device` tool: one call carries 64 MiB, so the default
# model's 98 MB GGUF travels in three parts under .devcarry/{a,b,c}, ignored by git, and waits in
# /root/stash between calls). `prepare` here, then three stages, one device call each, back to back:
#
#   bash benchmarks/run_gpu_lease.sh prepare   # here, once: the parts, data and gguf wheel
#   bash benchmarks/run_gpu_lease.sh kernels   # the key-similarity kernel vs its jnp reference
#   bash benchmarks/run_gpu_lease.sh tests     # the KV and kernel tests, compiled
#   bash benchmarks/run_gpu_lease.sh table     # #20's training-free drafters, greedy (+ T=1)
#   bash benchmarks/run_gpu_lease.sh anatomy   # launches, conditionals and ms per round
#   bash benchmarks/run_gpu_lease.sh cachewrite  # the KV cache write's forms, both layouts
#
# Every stage needs the gguf wheel (jspec's CLI imports it): carry .devcarry/c/whl in each call
# and start it with `python3 -m pip install -q --no-index --no-deps --target /tmp/site
# .devcarry/c/whl/*.whl; export PYTHONPATH=/tmp/site`. Session 31 (H200): `kernels` took 47 s,
# `tests` 117 s; `table` compiled for 200 s per dataset without finishing a record (its 6 methods
# x 2 prompt buckets of programs: budget one call per dataset, DATASETS=mt-bench). Since session
# 32 `table` runs --scan-layers (one traced layer a program: compiles several times faster).
# Session 33 (H100): kernels 63 s, tests cut at 130 s (38 passed); table cut at 190 s inside the
# skip:10 drafter's calibration (an unrolled program compiled per text, since fixed), before any
# record. The table now runs one process per drafter group; progress lines go to the logs.
# Session 34 (H100): kernels 80 s; tests TEST_S=75; table 372 s for both datasets at TABLE_S=140,
# the mtp:3,skip:10 groups cut while compiling and rerun on the warm machine (the compile cache
# in /root/xla) in 24 s and 66 s; the T=1 chains (DATASETS=" " T1_S=150) 23 s. Budget ~200 s a
# group cold on an H100, or run the table twice back to back on one warm machine.
#
# On a GPU machine with the model in ~/.cache/jspec already, `table` needs no parts: it runs
# the same `jspec bench` commands (exact float32 precision, as the CPU tables). Results go to
# $OUT (the device tool's folder; default benchmarks/gpu_lease/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/gpu_lease}
[ "${1:-}" = prepare ] || mkdir -p "$OUT" /root/stash
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # pytest -n 8: eight processes share the GPU
jspec() { python3 -c 'import sys; from jspec.cli import main; sys.exit(main())' "$@"; }
[ "${1:-}" = prepare ] || for part in .devcarry/*/part*; do
  [ -e "$part" ] && cp "$part" /root/stash/
done

assemble_model() {  # the model from its parts (checked as fetched), the prompt sets, gguf
  if ls /root/stash/part* >/dev/null 2>&1; then
    export JSPEC_CACHE=/root/jc
    mkdir -p $JSPEC_CACHE/smollm2-135m-instruct
    cat /root/stash/part0 /root/stash/part1 /root/stash/part2 \
      > $JSPEC_CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
    cp -r .devcarry/c/cache/* $JSPEC_CACHE/
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      .devcarry/c/whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
}

case "${1:-}" in
prepare)  # on the development machine, with the default model and prompt sets in its cache
  grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo /.devcarry/ >> .git/info/exclude
  CACHE=${JSPEC_CACHE:-$HOME/.cache/jspec}
  rm -rf .devcarry && mkdir -p .devcarry/a .devcarry/b .devcarry/c/cache
  (cd .devcarry && split -b 44040192 -d -a 1 \
    "$CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf" part)
  mv .devcarry/part0 .devcarry/a/ && mv .devcarry/part1 .devcarry/b/ && mv .devcarry/part2 .devcarry/c/
  cp -r "$CACHE/mt-bench" "$CACHE/human-eval" .devcarry/c/cache/
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d .devcarry/c/whl gguf==0.19.0
  du -sh .devcarry/*
  ;;
kernels)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
  export JSPEC_COMPILATION_CACHE=off
  # Slots per program: 512 (the default), 256 and 128 (session 33 on an H100, per call: 1.23x
  # and 1.47x the reference at batch 1, one program per head 0.90x); then float32 at the
  # default. Each record also times the kernel and the reference as calls inside one program.
  for part in 512 256 128; do
    jspec bench-kernel --kernel key-similarity --dtype bfloat16 --block-s 128 --part $part \
      --json "$OUT/keysim_bf16_b128_p$part.json"
  done
  jspec bench-kernel --kernel key-similarity --dtype float32 --precision exact --block-s 128 \
    --json "$OUT/keysim_f32_b128.json"
  ;;
tests)
  timeout -s INT "${TEST_S:-150}" python3 -m pytest -q -n 8 -p no:cacheprovider -rfE \
    --junitxml="$OUT/kv_tests.xml" tests/test_sampling_mode.py tests/test_key_similarity.py \
    tests/test_kv.py
  ;;
table)
  assemble_model
  # Stacked layers (one lax.scan) unless SCAN= (empty): session 32 added them for this table's
  # compile time; the records say "layers": "stacked".
  COMMON="--num-prompts 6 --max-new-tokens 64 --no-transformers --no-ttft --no-overhead --precision exact --gamma 3 ${SCAN---scan-layers}"
  export JSPEC_COMPILATION_CACHE=/root/xla  # survives between calls on a warm machine
  # One bench process per group of drafters, each with AR beside it and its own record file, so a
  # group cut off at its time limit leaves the others' records (session 33's H100 call lost all
  # of a dataset's to one slow drafter build). DRAFTER_GROUPS: space-separated groups of
  # comma-separated drafters.
  DRAFTER_GROUPS=${DRAFTER_GROUPS:-mtp:3,skip:10 default,ngram,lookahead}
  for ds in ${DATASETS:-mt-bench humaneval}; do
    for group in $DRAFTER_GROUPS; do
      tag=$(echo "$group" | tr ',:' '_-')  # the device tool refuses '+' in names
      timeout -s INT "${TABLE_S:-150}" bash -c "$(declare -f jspec); jspec bench --dataset $ds \
        $COMMON --drafters $group --json $OUT/issue20_${tag}_${ds}_t0_gpu.json" 2>&1 \
        | tee -a "$OUT/table.log"  # one log: a call brings back at most 8 files
    done
  done
  if [ "${T1_S:-150}" != 0 ]; then  # T1_S=0: greedy only
    timeout -s INT "${T1_S:-150}" bash -c "$(declare -f jspec); jspec bench --dataset mt-bench \
      $COMMON --temperature 1 --drafters default,ngram,mtp:3,skip:10 \
      --json $OUT/issue20_chains_mt-bench_t1_gpu.json" 2>&1 | tee -a "$OUT/table.log"
  fi
  ;;
anatomy)  # where a speculative round's time goes on this GPU (session 34: a round cost 2 tokens)
  assemble_model
  export JSPEC_COMPILATION_CACHE=/root/xla
  A="--scan-layers --precision exact --drafters ngram,mtp:3,skip:10,default"
  # plain: as the engines run (SamplingParams' static mode: no greedy/sampled conditional in the
  # loop). dynamic: mode=None, those conditionals back in every iteration (every program before
  # session 35). graphs: plain with XLA's CUDA graphs capturing loops and conditionals too. If
  # host round trips (a conditional's predicate, a loop's condition) are what a round costs, plain
  # beats dynamic and graphs beats plain. Each run compiles its own programs (new flags or modes
  # miss the compile cache): ~200 s cold on an H100, so give a call one or two runs
  # (ANATOMY_RUNS="plain dynamic", then ANATOMY_RUNS=graphs) if ANATOMY_S is cut short.
  # dsfusion: stacked layers slice each layer's weights out of the stacked arrays every step; on
  # XLA:CPU that is a copy of every weight a token (session 36: ~425 MB on the default model).
  # XLA:GPU's dynamic-slice fusion (off by default) hands cuBLAS the slice in place instead.
  GRAPHS=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
  for run in ${ANATOMY_RUNS:-plain dynamic graphs dsfusion}; do
    flags=() extra=()
    [ "$run" = dynamic ] && extra=(--dynamic-sampling)
    [ "$run" = graphs ] && flags=(XLA_FLAGS="--xla_gpu_enable_command_buffer=$GRAPHS")
    [ "$run" = dsfusion ] && flags=(XLA_FLAGS="--xla_gpu_enable_dynamic_slice_fusion=true")
    env "${flags[@]}" timeout -s INT "${ANATOMY_S:-180}" python3 benchmarks/round_anatomy.py $A \
      "${extra[@]}" --json "$OUT/round_anatomy_${run}_gpu.json" 2>&1 | grep -v -i warn \
      | grep '|' | tail -7
  done
  ;;
cachewrite)  # session 36 chose each layout's write form on XLA:CPU; is it XLA:GPU's best too?
  assemble_model
  export JSPEC_COMPILATION_CACHE=/root/xla
  # AR and an ngram chain in every form (vmap: sessions <= 34, slice: 35, now: 36), seconds and
  # whole-cache copies a loop iteration. Unrolled first: it is what a GPU runs without
  # --scan-layers, and session 36 moved it to one scatter, never timed on a GPU before. XLA:GPU
  # compiles unrolled programs slowly (session 31): CW_FORMS=slice,now CW_DRAFTERS= for 2 programs.
  for layout in ${LAYOUTS:-unrolled stacked}; do
    timeout -s INT "${CACHE_S:-150}" python3 benchmarks/cache_write.py --layout "$layout" \
      --forms "${CW_FORMS:-vmap,slice,now}" --drafters "${CW_DRAFTERS-ngram}" --runs 5 \
      --json "$OUT/cache_write_${layout}_gpu.json" 2>&1 | grep "'program'"
  done
  # Under a KV budget (session 38): whole-cache copies a prefill chunk and a decode step, both
  # layouts; XLA:CPU makes 4 in unrolled ones. A 4-layer random model: seconds.
  timeout -s INT 120 python3 benchmarks/kv_copies.py --json "$OUT/kv_copies_gpu.json" 2>&1 \
    | grep "'layout'"
  ;;
*) echo "usage: $0 prepare|kernels|tests|table|anatomy|cachewrite" >&2; exit 2 ;;
esac
