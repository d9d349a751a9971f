"""Why jspec's int8 path quantizes activations too: XLA's CPU matmuls, side by side.

One Qwen2.5-1.5B MLP projection (1536 x 8960) at 1, 2, 5 and 8 rows: float32; bfloat16;
weight-only int8 dequantized inside the jitted matmul; int8 weights x int8 activations (per-token
scales, int32 accumulation) as `jspec.models.quant.einsum` runs it; int4 weights (jnp.int4, half
the bytes) x int8 activations, the form a Q4 format kept in memory would take.

  python benchmarks/matmul_int8.py --json benchmarks/issue17_matmul_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profiling import machine_info
from jspec.bench.round_split import best_seconds
from jspec.models import quant
from jspec.models.numerics import COMPILER_OPTIONS

E, F, REPEATS = 1536, 8960, 50


def seconds(fn, *args) -> float:
  """Per call, best of 3 runs of a jitted loop of REPEATS calls."""
  loop = jax.jit(lambda x, *w: jax.lax.fori_loop(
      0, REPEATS, lambda i, acc: acc + fn(x + i.astype(x.dtype) * 1e-3, *w).sum()
      .astype(jnp.float32), jnp.float32(0)), compiler_options=COMPILER_OPTIONS)
  return best_seconds(loop, *args, repeats=REPEATS)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--json", required=True)
  args = p.parse_args()
  w = jnp.asarray(np.random.default_rng(0).standard_normal((E, F)).astype(np.float32)) * 0.02
  w8 = quant.quantize_int8(w, (0,))
  wb = w.astype(jnp.bfloat16)
  scale4 = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 7.0
  q4 = jnp.clip(jnp.round(w / scale4), -7, 7).astype(jnp.int4)

  def int4_matmul(x, q, s):
    xq, xs = quant.quantize_rows(x)
    return jnp.einsum("bte,ef->btf", xq, q, preferred_element_type=jnp.int32) * xs * s

  rows = []
  for T in (1, 2, 5, 8):
    x = jnp.ones((1, T, E), jnp.float32)
    times = {
        "float32": seconds(lambda x, w: jnp.einsum("bte,ef->btf", x, w), x, w),
        "bfloat16": seconds(lambda x, w: jnp.einsum("bte,ef->btf", x.astype(jnp.bfloat16), w,
                                                    preferred_element_type=jnp.float32), x, wb),
        "int8_weight_only": seconds(lambda x, q, s: jnp.einsum(
            "bte,ef->btf", x, q.astype(jnp.float32) * s), x, w8.q, w8.scale),
        "int8_weights_and_activations": seconds(
            lambda x, q, s: quant.einsum("bte,ef->btf", x, quant.Int8Weight(q, s, (0,))),
            x, w8.q, w8.scale),
        "int4_weights_int8_activations": seconds(int4_matmul, x, q4, scale4),
    }
    row = {"rows": T, **{f"{k}_ms": v * 1e3 for k, v in times.items()},
           **{f"{k}_speedup_vs_float32": times["float32"] / v for k, v in times.items()
              if k != "float32"}}
    rows.append(row)
    print(" | ".join(f"{k} {v:.3f}" for k, v in row.items()))
  Path(args.json).write_text(json.dumps({"shape": [E, F], "results": rows,
                                         "machine": machine_info(),
                                         "command": " ".join(["python"] + sys.argv)}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
