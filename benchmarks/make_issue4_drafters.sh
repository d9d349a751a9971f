#!/bin/bash
# Issue #4: the four drafters that benchmarks/run_issue4_drafters.sh compares (KL vs TVD++, with
# and without VocabTrim), exactly as they were made (each command is also recorded in the
# drafter's jspec.json). Every step resumes: rerun after a kill.
#   1. distillation data: set a = the first 512 ShareGPT prompts, set b = the next 1536
#      (the drafters below read a and b's first 18 shards);
#   2. train with a VocabTrim 8192 head over the frozen target table, KL or TVD++;
#   3. trim-vocab --size 49152 gives the same layers the full head back (the table is frozen).
set -e
cd "$(dirname "$0")/.."
D=$HOME/.cache/jspec/distill
R=$HOME/.cache/jspec/drafter-runs
jspec distill-data --target default --out $D/smollm2-sharegpt-a --num-prompts 512
jspec distill-data --target default --out $D/smollm2-sharegpt-b --num-prompts 1536 --prompt-offset 1024
for loss in kl tvd++; do
  name=$([ $loss = kl ] && echo kl || echo tvdpp)-trim8k
  jspec train-drafter --target default --out $R/$name --layers 2 --init target --loss $loss \
    --freeze-embeddings --vocab-trim 8192 --data $D/smollm2-sharegpt-a \
    --data $D/smollm2-sharegpt-b:18 --seq-len 384 --batch-size 8 --steps 300 --lr 1e-3 \
    --warmup-steps 20 --eval-every 100 --checkpoint-every 50
  jspec trim-vocab --target default --drafter $R/$name/drafter --size 49152 --out $R/$name/full
done
