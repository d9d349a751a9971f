#!/bin/bash
# Issue #4: chain (gamma 3) tau of drafters on the SAME evaluation contexts (`jspec bench-tau`: the
# target's own responses to 10 prompts of each set, a context every 4 tokens, ~240 contexts;
# 4 independent draft rounds per context at T=1, 1 at T=0). Contexts do not depend on the drafter,
# so drafters compare paired, without timing noise. DRAFTERS: name=spec pairs. Resumable.
cd "$(dirname "$0")/.."
R=$HOME/.cache/jspec/drafter-runs
DRAFTERS=${DRAFTERS:-"b36=model:$R/kl-trim8k-b36/drafter b88=model:$R/kl-trim8k-b88/drafter b88-4l=model:$R/kl-trim8k-b88-4l/drafter"}
for T in 1 0; do
  rounds=4; [ $T = 0 ] && rounds=1
  for ds in mt-bench humaneval; do
    for pair in $DRAFTERS; do
      name=${pair%%=*}; spec=${pair#*=}
      out=benchmarks/chain_tau_${name}_${ds}_t${T}_cpu.json
      [ -f "$out" ] && continue
      [ -d "${spec#model:}" ] || { echo "skip $name: ${spec#model:} not trained yet"; continue; }
      jspec bench-tau --model default --dataset $ds --num-prompts 10 --max-new-tokens 96 \
        --temperature $T --drafter $spec --stride 4 --rounds $rounds --tree chain:3 --json $out || exit 1
    done
  done
done
