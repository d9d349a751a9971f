#!/bin/bash
# Issue #4, all distillation data: the default-drafter recipe (2 layers from the target's first and
# last, frozen tied table, VocabTrim 8192, forward KL) on set a + set b's shards 0-87 (~1,920
# responses), 850 steps (~3.5 epochs, as kl-trim8k-b36 had). Shards 88-95 of set b are held out:
#   jspec eval-drafter --target default --drafters default,model:$R/kl-trim8k-b88/drafter \
#     --data ~/.cache/jspec/distill/smollm2-sharegpt-b:88-96 --json benchmarks/heldout_alpha_b88-96_cpu.json
# (default = kl-trim8k-b36 while it is the shipped drafter). The data: the two distill-data
# commands at the top of benchmarks/make_issue4_drafters.sh. LAYERS=4 trains the 4-layer variant
# (layers spread over the target's depth) into kl-trim8k-b88-4l. Resumable: rerun the same command.
set -e
cd "$(dirname "$0")/.."
D=$HOME/.cache/jspec/distill
R=$HOME/.cache/jspec/drafter-runs
LAYERS=${LAYERS:-2}
NAME=kl-trim8k-b88; [ "$LAYERS" = 2 ] || NAME=$NAME-${LAYERS}l
jspec train-drafter --target default --out $R/$NAME --layers $LAYERS --init target --loss kl \
  --freeze-embeddings --vocab-trim 8192 --data $D/smollm2-sharegpt-a --data $D/smollm2-sharegpt-b:0-88 \
  --seq-len 384 --batch-size 8 --steps 850 --lr 1e-3 --warmup-steps 20 --eval-every 425 \
  --checkpoint-every 50
