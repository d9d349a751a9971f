#!/bin/bash
# Issue #5: block efficiency tau versus the target's per-call node budget N for chain, SpecInfer
# (i.i.d. siblings), RSD-C (Gumbel-Top-k siblings) and RSD-S (stochastic beam search), with
# EAGLE-2 dynamic trees beside them; default model with the shipped default drafter, MT-Bench and
# HumanEval, T = 1 and 0. Equal budgets: every tree holds W sequences of depth D, W * D = N
# (chain: D = N); specinfer/rsd-c branch W ways at the root, rsd-s keeps a beam of W.
# At T = 0 specinfer and rsd-c draft the same top-k tree (greedy verification): one run of them;
# chain:32 and chain:64 are skipped there (a greedy chain's tau was flat from N = 4 to 16 on both
# sets: no round accepted more than 5 drafts) and T = 0 uses N_PROMPTS_T0 = 3 prompts (time).
# Resumable: finished files are kept. Plot: python benchmarks/plot_trees.py.
cd "$(dirname "$0")/.."
N_PROMPTS=${N_PROMPTS:-5}; N_PROMPTS_T0=${N_PROMPTS_T0:-3}; TOKENS=${TOKENS:-96}; DRAFTER=${DRAFTER:-default}

trees() {  # trees for budgets "$2 ..." at temperature $1
  local T=$1; shift; local out=""
  for n in "$@"; do
    case $n in 4) W=2 D=2;; 8) W=4 D=2;; 16) W=4 D=4;; 32) W=8 D=4;; 64) W=16 D=4;; esac
    ones=$(printf -- '-1%.0s' $(seq 2 $D))
    { [ "$T" = 1 ] || [ $n -le 16 ]; } && out+="chain:$n,"
    out+="rsd-c:$W$ones,rsd-s:$W,$D,dynamic:$n,"
    [ "$T" = 1 ] && out+="specinfer:$W$ones,"
  done
  echo "${out%,}"
}

for run in mt-bench:1:4-8-16 mt-bench:1:32-64 humaneval:1:4-8-16 humaneval:1:32-64 \
           mt-bench:0:4-8-16 humaneval:0:4-8-16 mt-bench:0:32-64 humaneval:0:32-64; do
  IFS=: read ds T budgets <<< "$run"
  out=benchmarks/trees_${ds}_t${T}_n${budgets}_cpu.json
  [ -f "$out" ] && continue
  n_prompts=$N_PROMPTS; [ "$T" = 0 ] && n_prompts=$N_PROMPTS_T0
  jspec bench --model default --dataset $ds --num-prompts $n_prompts --max-new-tokens $TOKENS \
    --temperature $T --drafters $DRAFTER --gamma 3 --no-transformers --no-ttft \
    --tree "$(trees $T ${budgets//-/ })" --json $out || exit 1
done
