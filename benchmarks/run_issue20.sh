#!/usr/bin/env bash
# Issue #20: training-free drafting on the default model (SmolLM2-135M-Instruct, float32) on this
# machine, each file one process with its autoregressive baseline first. ~30 minutes on the
# 2-core VM; run it on an idle machine.
set -euxo pipefail
cd "$(dirname "$0")/.."
# Resumable: a record that already exists is kept (delete it to rerun that part).
run() { local out="${@: -1}"; [ -e "$out" ] || jspec bench "$@"; }
COMMON="--num-prompts 6 --max-new-tokens 64 --no-transformers --no-ttft --no-overhead"
# Chains of 3: the distilled drafter, the lookup (and with the stop at its first miss), mask-token
# probing, layer skipping (10 of 30 layers; and with a 0.5 confidence stop).
for ds in mt-bench humaneval; do
  run --dataset $ds $COMMON --drafters default,ngram,ngram@1,mtp:3,skip:10,skip:10@0.5 \
    --gamma 3 --json benchmarks/issue20_chains_${ds}_t0_cpu.json
  # tau vs node budget for one-mask probing trees (ESP's best shape: the top N of mask 1).
  run --dataset $ds $COMMON --drafters mtp:1 --gamma 1 \
    --tree dynamic:2,1,1,2,dynamic:4,1,1,4,dynamic:8,1,1,8,dynamic:16,1,1,16 \
    --json benchmarks/issue20_mtp_trees_${ds}_t0_cpu.json
done
run --dataset mt-bench $COMMON --temperature 1 --drafters default,ngram,ngram@1,mtp:3,skip:10 \
  --gamma 3 --json benchmarks/issue20_chains_mt-bench_t1_cpu.json
python benchmarks/plot_trees.py --glob 'benchmarks/issue20_mtp_trees_*_t0_cpu.json' \
  --out benchmarks/issue20_mtp_trees_cpu.png --title 'mask-token probing (mtp:1) trees, default model'
# Paired tau (`jspec bench-tau`): the probing trees on the SAME contexts (the target's greedy
# responses cut every 4th token; the prefill probes after each context), where they differ little.
for ds in mt-bench humaneval; do
  out=benchmarks/issue20_mtp_trees_paired_${ds}_t0_cpu.json
  [ -e "$out" ] || jspec bench-tau --dataset $ds --num-prompts 6 --max-new-tokens 64 --rounds 1 \
    --drafter mtp:1 --tree dynamic:2,1,1,2,dynamic:4,1,1,4,dynamic:8,1,1,8,dynamic:16,1,1,16 \
    --json "$out"
done
# Session 21: float32 on CPU runs jspec's float32 kernel (`--weights float32`, the default), where a
# verification block of 4 tokens costs 1.17 one-token steps instead of 1.41 (XLA's dot). The
# width costs side by side, then the chains table again (and HumanEval at T=1, missing above).
[ -e benchmarks/issue20_f32_width_cpu.json ] || python benchmarks/f32_width.py \
  --json benchmarks/issue20_f32_width_cpu.json
for ds in mt-bench humaneval; do
  for t in 0 1; do
    run --dataset $ds $COMMON --temperature $t \
      --drafters default,ngram,ngram@1,mtp:3,skip:10,skip:10@0.5 \
      --gamma 3 --json benchmarks/issue20_native_chains_${ds}_t${t}_cpu.json
  done
done
# The float32 kernel against XLA's dot in one process: AR and the lookup's chains in each format.
for ds in humaneval mt-bench; do
  out=benchmarks/issue20_f32_kernels_side_by_side_${ds}_cpu.json
  [ -e "$out" ] || python benchmarks/kernels_side_by_side.py --model default \
    --formats float32,float32-xla --dataset $ds --num-prompts 6 --max-new-tokens 64 \
    --drafter ngram@1 --gamma 3 --json "$out"
done
# The probing trees again with the float32 kernel (a 16-node tree's forward: 2.0 steps, not 2.5).
for ds in mt-bench humaneval; do
  run --dataset $ds $COMMON --drafters mtp:1 --gamma 1 \
    --tree dynamic:2,1,1,2,dynamic:4,1,1,4,dynamic:8,1,1,8,dynamic:16,1,1,16 \
    --json benchmarks/issue20_native_mtp_trees_${ds}_t0_cpu.json
done
# Session 25: lookahead decoding (its own pool tree), side by side with AR, the lookup and probing,
# greedy and T=1 on both sets; three window shapes (W-N-G) beside the default 5-4-5.
for ds in mt-bench humaneval; do
  for t in 0 1; do
    run --dataset $ds $COMMON --temperature $t \
      --drafters ngram,mtp:3,lookahead:2-3-2,lookahead:3-3-3,lookahead,lookahead:7-5-7 \
      --gamma 3 --json benchmarks/issue20_lookahead_${ds}_t${t}_cpu.json
  done
done
# Session 27: the lookup with its chain stopped where no 2-gram matches (ngram:2-4@1) and a longer
# chain (gamma 6): a round with no match runs a one-token forward (the engines' narrow step), a
# long match is verified whole. 20 prompts x 128 tokens (the lookup finds more in longer answers).
LONG="--num-prompts 20 --max-new-tokens 128 --no-transformers --no-ttft --no-overhead"
for ds in humaneval mt-bench; do
  run --dataset $ds $LONG --drafters ngram --gamma 3 --json benchmarks/issue20_ngram_g3_${ds}_t0_cpu.json
  for t in 0 1; do
    run --dataset $ds $LONG --temperature $t --drafters ngram,ngram:2-4@1 --gamma 6 \
      --json benchmarks/issue20_ngram_stop_g6_${ds}_t${t}_cpu.json
  done
done
# Session 28: retrieval drafting (`rest`: the lookup 2-4, else the ShareGPT datastore's most
# frequent continuation of the last 1-3 tokens; built once, ~1.5 min) beside the plain lookup,
# 20 prompts x 128 tokens, chains of 3 and 4.
for ds in mt-bench humaneval; do
  for t in 0 1; do
    for g in 3 4; do
      run --dataset $ds $LONG --temperature $t --drafters ngram,rest --gamma $g \
        --json benchmarks/issue20_rest_g${g}_${ds}_t${t}_cpu.json
    done
  done
done
# Sessions 30-31: does mask-token probing catch up at a larger scale? The same chains and the
# probing trees, 6 prompts x 64 tokens, greedy, per model: TAG, model flags, drafters (skip:N = a
# third of the layers). Session 30: Qwen2.5-Coder-0.5B (24 layers) in float32. Session 31: the
# 1.5B (28 layers), and the 0.5B in int8 (token trees run over int8 targets on jspec's CPU kernels
# since then; `rest` left out); run pinned to one core each, side by side: tau and identity hold,
# the timings are one-core ratios under a neighbour's load.
probing_at_scale() {
  local tag=$1 model=$2 drafters=$3
  for ds in mt-bench humaneval; do
    run --dataset $ds $model $COMMON --drafters $drafters --gamma 3 \
      --json benchmarks/issue20_${tag}_chains_${ds}_t0_cpu.json
    run --dataset $ds $model $COMMON --drafters mtp:1 --gamma 1 \
      --tree dynamic:8,1,1,8,dynamic:16,1,1,16 \
      --json benchmarks/issue20_${tag}_mtp_trees_${ds}_t0_cpu.json
  done
}
probing_at_scale qwen05 "--model qwen2.5-coder-0.5b --weights float32" ngram,rest,mtp:3,skip:8,lookahead
probing_at_scale qwen15 "--model qwen2.5-coder-1.5b --weights float32" ngram,rest,mtp:3,skip:9,lookahead
probing_at_scale qwen05_int8 "--model qwen2.5-coder-0.5b --weights int8" ngram,mtp:3,skip:8,lookahead
