#!/bin/bash
# Issue #4, feature-level drafter: EAGLE-style (one decoder layer over the target's final hidden
# states, the target's table as embedding and VocabTrim-8192 head, smooth-L1 + 0.1 KL, unroll 2)
# on the same data as the default drafter (set a + set b shards 0-87; the data: the two
# distill-data commands at the top of benchmarks/make_issue4_drafters.sh). The target's hidden
# states of every row are computed once into $R/eagle-b88/features (~21 min on the 2-core CPU).
# CLS sets the KL weight next to the regression (EAGLE's 0.1; run eagle-b88-cls1 uses 1.0: at 0.1
# the held-out greedy acceptance was 0.16 / 0.21 after 170 / 340 steps, so that run was stopped).
# Resumable: rerun the same command (the features are shared: cp -al eagle-b88/features first).
set -e
cd "$(dirname "$0")/.."
D=$HOME/.cache/jspec/distill
R=$HOME/.cache/jspec/drafter-runs
CLS=${CLS:-1}
NAME=eagle-b88; [ "$CLS" = 0.1 ] || NAME=$NAME-cls$CLS
jspec train-eagle --target default --out $R/$NAME --cls-weight $CLS --data $D/smollm2-sharegpt-a \
  --data $D/smollm2-sharegpt-b:0-88 --vocab-trim 8192 --seq-len 384 --batch-size 8 --steps 850 \
  --lr 1e-3 --warmup-steps 20 --eval-every 170 --checkpoint-every 50
