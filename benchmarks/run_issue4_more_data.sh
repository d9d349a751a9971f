#!/bin/bash
# Issue #4, more distillation data: the session-4 default drafter (kl-trim8k: set a + b's first 18
# shards, 300 steps) against the same recipe on set a + b's first 36 shards (1.45x the responses,
# 450 steps; kl-trim8k-b36), side by side with autoregressive decoding in one run per setting.
# Held-out acceptance of both on shards 36-39 of set b (no drafter trained on them):
#   jspec eval-drafter --target default --drafters default,model:$R/kl-trim8k-b36/drafter \
#     --data ~/.cache/jspec/distill/smollm2-sharegpt-b:36-40
# (default = kl-trim8k while it was the shipped drafter). Resumable.
set -e
cd "$(dirname "$0")/.."
D=$HOME/.cache/jspec/distill
R=$HOME/.cache/jspec/drafter-runs
jspec train-drafter --target default --out $R/kl-trim8k-b36 --layers 2 --init target --loss kl \
  --freeze-embeddings --vocab-trim 8192 --data $D/smollm2-sharegpt-a --data $D/smollm2-sharegpt-b:36 \
  --seq-len 384 --batch-size 8 --steps 450 --lr 1e-3 --warmup-steps 20 --eval-every 150 \
  --checkpoint-every 50
for T in 0 1; do
  out=benchmarks/more_data_mt-bench_t${T}_g3_cpu.json
  [ -f "$out" ] && continue
  jspec bench --model default --dataset mt-bench --num-prompts 5 --max-new-tokens 96 \
    --temperature $T --drafters model:$R/kl-trim8k/drafter,model:$R/kl-trim8k-b36/drafter \
    --gamma 3 --no-transformers --json $out
done
