#!/bin/bash
cd "$(dirname "$0")/.."
R=$HOME/.cache/jspec/drafters/random-2x128  # made by: python benchmarks/make_random_draft.py
for ds in mt-bench humaneval; do for T in 0 1; do
  jspec bench --model default --dataset $ds --num-prompts 10 --max-new-tokens 128 --temperature $T \
    --drafters self,model:$R --gamma 4 --json benchmarks/spec_${ds}_t${T}_cpu.json 
done; done
