#!/bin/bash
# Issue #22: feature-level drafters compared at equal training data and equal steps.
#   EAGLE-1 style (`--network eagle`: final hidden state, smooth-L1 + KL, unroll 2) vs EAGLE-3
#   (`--network eagle3`: layers 2, L/2, L-3 fused, token prediction, training-time test) and ConFu
#   (`--network confu`: EAGLE-3 + contemplate tokens, soft prompt, MoE; 32 anchors a row) on the
#   default target, each trained on the first N shards of one distillation set (16 prompts a
#   shard) for the same number of steps, then scored on the same held-out shards no run trained
#   on (`jspec eval-drafter`, teacher-forced acceptance per draft and the tau it implies).
# The training-time test runs 4 passes (drafts 1-4: the chains benchmarked use gamma <= 4; the
# paper's 7 cost 7/4 the time on this 2-core CPU).
# Every step resumes: rerun after a kill. Results: benchmarks/issue22_heldout_cpu.json.
set -e
cd "$(dirname "$0")/.."
D=$HOME/.cache/jspec/distill
R=$HOME/.cache/jspec/drafter-runs/issue22
SIZES=${SIZES:-"12 36"}
NETS=${NETS:-"eagle eagle3 confu"}
STEPS=${STEPS:-200}
jspec distill-data --target default --out $D/i22 --num-prompts 640 --max-new-tokens 192 \
  --gen-batch-size 16
for n in $SIZES; do
  for net in $NETS; do
    extra=""; [ $net != eagle ] && extra="--ttt-steps 4"
    jspec train-eagle --network $net --target default --out $R/$net-$n --data $D/i22:$n \
      --vocab-trim 8192 --seq-len 256 --batch-size 8 --steps $STEPS --lr 1e-3 --warmup-steps 20 \
      --eval-every 50 --checkpoint-every 25 $extra
  done
done
drafters=""
for n in $SIZES; do for net in $NETS; do
  [ -f $R/$net-$n/drafter/jspec.json ] && drafters="$drafters,model:$R/$net-$n/drafter"
done; done
jspec eval-drafter --target default --drafters "${drafters#,}" --data $D/i22:38-40 \
  --seq-len 256 --gamma 4 --json ${HELDOUT:-benchmarks/issue22_heldout_cpu.json}
# `jspec bench`: the trained drafters' chains (gamma 3) side by side with AR on MT-Bench and
# HumanEval, greedy and T=1 (BENCH_DRAFTERS overrides which; session 26 benched confu-12 only,
# the EAGLE runs no longer being on the machine; session 29 ran SIZES=36 with
# BENCH_TAG=n36_ HELDOUT=benchmarks/issue22_heldout_n36_cpu.json: all three side by side).
for ds in mt-bench humaneval; do for t in 0 1; do
  out=benchmarks/issue22_bench_${BENCH_TAG:-}${ds}_t${t}_cpu.json
  [ -e $out ] || jspec bench --dataset $ds --num-prompts 6 --max-new-tokens 64 --no-transformers \
    --no-ttft --no-overhead --temperature $t --drafters "${BENCH_DRAFTERS:-${drafters#,}}" \
    --gamma 3 --json $out
done; done
