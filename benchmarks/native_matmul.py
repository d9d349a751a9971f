"""jspec's native CPU matmuls (`jspec.native`: int8 and 4-bit weights) against XLA's int8 dot,
side by side.

The Qwen2.5-Coder-1.5B projections (q/o 1536 x 1536, k/v 1536 x 256, gate/up 1536 x 8960,
down 8960 x 1536) at 1-8 activation rows (a decode step: 1; a verification block: gamma + 1),
each as `jspec.models.quant.einsum` runs it (per-token activation quantization and scaling
included), over 8 distinct weight matrices per call so the weights stream from memory rather than
sit in the cache. GB/s counts int8 weight bytes (q4 reads half as many). "q4" is the format
`--weights q4` loads (a float16 offset per group: ggml's Q4_1), "q4_symmetric" the one without
offsets (`quant.quantize_q4(..., offset=False)`).

  python benchmarks/native_matmul.py --json benchmarks/issue17_native_matmul_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec import native
from jspec.bench.profiling import machine_info
from jspec.models import quant
from jspec.models.numerics import COMPILER_OPTIONS

SHAPES = {"q_o": (1536, 1536), "k_v": (1536, 256), "gate_up": (1536, 8960), "down": (8960, 1536)}
DISTINCT = 8


def per_call_seconds(weights, x, repeats: int = 7) -> float:
  """Best of `repeats` runs of one program that applies each weight in turn."""
  def run(x, ws):
    acc = jnp.float32(0)
    for w in ws:
      acc = acc + quant.einsum("te,ef->tf", x, w)[0, 0]
      x = x + 1e-3
    return acc

  fn = jax.jit(run, compiler_options=COMPILER_OPTIONS)
  fn(x, weights).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn(x, weights).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return best / len(weights)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--json", required=True)
  p.add_argument("--rows", default="1,2,4,5,8")
  args = p.parse_args()
  rng = np.random.default_rng(0)
  rows_out = []
  for name, (K, N) in SHAPES.items():
    dense = [rng.standard_normal((K, N)).astype(np.float32) for _ in range(DISTINCT)]
    by_kernel = {k: [quant.quantize_int8(w, (0,), k) for w in dense] for k in quant.KERNELS}
    by_kernel["q4"] = [quant.quantize_q4(w, (0,)) for w in dense]  # with offsets (Q4_1)
    by_kernel["q4_symmetric"] = [quant.quantize_q4(w, (0,), offset=False) for w in dense]
    for M in map(int, args.rows.split(",")):
      x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
      s = {k: per_call_seconds(ws, x) for k, ws in by_kernel.items()}
      row = {"shape": name, "K": K, "N": N, "rows": M,
             **{f"{k}_ms": v * 1e3 for k, v in s.items()},
             **{f"{k}_weight_GBps": K * N / v / 1e9 for k, v in s.items()},
             "native_speedup_vs_xla": s["xla"] / s["native"],
             "q4_speedup_vs_native_int8": s["native"] / s["q4"],
             "q4_offsets_time_vs_symmetric": s["q4"] / s["q4_symmetric"]}
      rows_out.append(row)
      print(f"{name:8s} {K}x{N} rows {M}: native {s['native'] * 1e3:.3f} ms "
            f"({row['native_weight_GBps']:.1f} GB/s), xla {s['xla'] * 1e3:.3f} ms "
            f"({row['xla_weight_GBps']:.1f} GB/s): {row['native_speedup_vs_xla']:.2f}x; q4 "
            f"{s['q4'] * 1e3:.3f} ms: {row['q4_speedup_vs_native_int8']:.2f}x native int8, "
            f"{row['q4_offsets_time_vs_symmetric']:.2f}x the symmetric q4's time",
            flush=True)
  Path(args.json).write_text(json.dumps(
      {"kernel_path": native.kernel_path(), "distinct_weights": DISTINCT, "results": rows_out,
       "machine": machine_info(), "command": " ".join(["python"] + sys.argv)}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
