"""How the decoding programs are compiled so that a token is scored with the same bits whichever
program scores it: a one-token step of autoregressive decoding, or a row of a speculative
verification block, over a KV cache of any size.

Greedy speculative decoding is token-identical to autoregressive decoding only if the target's
argmax at each position does not depend on the program that computed it. Float32 weights tolerate
last-bit differences (they almost never move an argmax); int8 weights do not, because every
activation is re-quantized to int8 and a last-bit difference can move a value across a rounding
boundary, one whole quantization step. Three things make the bits program-independent:

- matmuls of int8 weights are int8 x int8 -> int32 (exact) with per-token activation scales
  (`quant.einsum`), attention runs one query token at a time (`llama.masked_attention`);
- sums over a row run in one fixed order that zeros appended to the row do not change
  (`llama.row_sum`), so a softmax over a 320-slot cache equals one over 256 slots;
- XLA:CPU's YNNPACK fusions are off: XLA hands a reduction and its elementwise neighbours
  (max, subtract, exp) to YNNPACK for some shapes and emits them itself for others, and the two
  `exp` implementations differ in the last bit, so the choice depended on the cache size.

Every engine's `jax.jit` passes COMPILER_OPTIONS. If you jit jspec's pure functions
(`generate_tokens`, `speculative_generate_tokens`) yourself, pass them too:
`jax.jit(fn, compiler_options=COMPILER_OPTIONS, ...)`. The options are debug options of the CPU
backend; other backends ignore them.
"""

from __future__ import annotations

import jax

COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def engine_jit(fn, **kwargs):
  """jax.jit(fn, **kwargs) with COMPILER_OPTIONS: how every decoding program is compiled."""
  return jax.jit(fn, compiler_options=COMPILER_OPTIONS, **kwargs)

