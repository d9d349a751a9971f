#!/bin/bash
# Issue #4: the feature-level drafter (benchmarks/run_issue4_eagle.sh) against the default
# 2-layer drafter: held-out acceptance on set b shards 88-95 (teacher-forced; the EAGLE drafter's
# draft 1 reads the target's state, draft 2 its own prediction), then MT-Bench T=0, 5 prompts x 96
# tokens, gamma 1 and 3, side by side with AR in one run each. Skips results that exist.
set -e
cd "$(dirname "$0")/.."
D=$HOME/.cache/jspec/distill
R=$HOME/.cache/jspec/drafter-runs
DR=default,model:$R/${NAME:-eagle-b88-cls1}/drafter
out=benchmarks/heldout_alpha_b88-96_eagle_cpu.json
[ -f $out ] || jspec eval-drafter --target default --drafters $DR \
  --data $D/smollm2-sharegpt-b:88-96 --json $out
for g in 3 1; do
  out=benchmarks/eagle_mt-bench_t0_g${g}_cpu.json
  [ -f $out ] && continue
  jspec bench --model default --dataset mt-bench --num-prompts 5 --max-new-tokens 96 \
    --temperature 0 --drafters $DR --gamma $g --no-transformers --json $out
done
