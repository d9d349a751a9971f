#!/bin/bash
# Issue #5, the goal "RSD >= the other verifiers at every budget at T = 1", measured paired:
# `jspec bench-tau` scores every tree on the same contexts (the target's own T = 1 responses to 5
# prompts, a context every 4 tokens: ~120 contexts) with 8 independent rounds each, and reports
# each equal-budget pair's difference with its standard error. Same tree shapes as
# run_issue5_trees.sh (W sequences of depth D, W * D = N); chain only up to N = 16 (its tau is
# flat beyond: no round of this drafter accepted more than 5 drafts). Resumable.
cd "$(dirname "$0")/.."
TREES=chain:4,specinfer:2-1,rsd-c:2-1,rsd-s:2,2,chain:8,specinfer:4-1,rsd-c:4-1,rsd-s:4,2
TREES+=,chain:16,specinfer:4-1-1-1,rsd-c:4-1-1-1,rsd-s:4,4
TREES+=,specinfer:8-1-1-1,rsd-c:8-1-1-1,rsd-s:8,4,specinfer:16-1-1-1,rsd-c:16-1-1-1,rsd-s:16,4
for ds in mt-bench humaneval; do
  out=benchmarks/paired_tau_${ds}_t1_cpu.json
  [ -f "$out" ] && continue
  jspec bench-tau --model default --dataset $ds --num-prompts 5 --max-new-tokens 96 \
    --temperature 1 --drafter default --stride 4 --rounds 8 --tree "$TREES" --json $out || exit 1
done
