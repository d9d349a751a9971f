#!/bin/bash
# Issue #4: n-gram lookup in front of the default drafter (and alone) against the default drafter
# and autoregressive decoding, side by side in one run per setting: MT-Bench and HumanEval,
# 5 prompts x 96 tokens, T=0 at gamma 3 and 5, T=1 at gamma 3. Skips results that exist.
# The offline bound these runs check: python benchmarks/probe_ngram_hybrid.py (see its docstring).
set -e
cd "$(dirname "$0")/.."
for ds in humaneval mt-bench; do
  for tg in 0:3 0:5 1:3; do
    t=${tg%:*}; g=${tg#*:}
    out=benchmarks/ngram_${ds}_t${t}_g${g}_cpu.json
    [ -f $out ] && continue
    jspec bench --model default --dataset $ds --num-prompts 5 --max-new-tokens 96 \
      --temperature $t --drafters default,ngram,ngram+default --gamma $g --no-transformers \
      --json $out
  done
done
