#!/bin/bash
# Issue #4, drafter depth by tau per unit of draft cost, and the chain length on this CPU: the
# 2-layer default drafter (kl-trim8k-b88) against the same recipe with 4 layers (kl-trim8k-b88-4l;
# `LAYERS=4 bash benchmarks/run_issue4_all_data.sh`), side by side with autoregressive decoding in
# one run per setting (T=0, gamma 1, 2, 3 on MT-Bench; gamma 3 on HumanEval), after their held-out
# acceptance on set b shards 88-95. Run alone: timings. Resumable (skips finished files).
set -e
cd "$(dirname "$0")/.."
R=$HOME/.cache/jspec/drafter-runs
DR=default,model:$R/kl-trim8k-b88-4l/drafter
out=benchmarks/heldout_alpha_b88-96_layers_cpu.json
[ -f $out ] || jspec eval-drafter --target default --drafters $DR \
  --data $HOME/.cache/jspec/distill/smollm2-sharegpt-b:88-96 --json $out
for run in mt-bench:3 mt-bench:1 mt-bench:2 humaneval:3; do
  ds=${run%%:*}; g=${run#*:}
  out=benchmarks/layers_${ds}_t0_g${g}_cpu.json
  [ -f $out ] && continue
  jspec bench --model default --dataset $ds --num-prompts 5 --max-new-tokens 96 --temperature 0 \
    --drafters $DR --gamma $g --no-transformers --json $out
done
