#!/bin/bash
# Issue #4: trained drafters (KL vs TVD++, with and without VocabTrim) on the default model,
# MT-Bench and HumanEval, T = 0 and 1, chain gamma 3 and 5. The drafters are made by
# benchmarks/make_issue4_drafters.sh (train-drafter with --vocab-trim 8192, then trim-vocab --size
# 49152 for the untrimmed head).
cd "$(dirname "$0")/.."
R=$HOME/.cache/jspec/drafter-runs
D=model:$R/kl-trim8k/drafter,model:$R/kl-trim8k/full,model:$R/tvdpp-trim8k/drafter,model:$R/tvdpp-trim8k/full
N=${N:-5}; TOKENS=${TOKENS:-96}
# Most informative first (the session that made them ran out of time before the last ones).
for run in mt-bench:0:3 mt-bench:1:3 humaneval:0:3 humaneval:1:3 mt-bench:0:5 mt-bench:1:5 \
           humaneval:0:5 humaneval:1:5; do
  IFS=: read ds T G <<< "$run"
  out=benchmarks/drafters_${ds}_t${T}_g${G}_cpu.json
  [ -f "$out" ] && continue  # resumable: finished runs are kept
  jspec bench --model default --dataset $ds --num-prompts $N --max-new-tokens $TOKENS \
    --temperature $T --drafters $D --gamma $G --no-transformers --json $out
done
