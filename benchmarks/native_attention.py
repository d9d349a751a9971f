"""jspec's native decoding attention (`jspec.native.attention`) against XLA's masked attention
(`jspec.models.attention.masked_attention`), side by side, at the real pair's shapes.

Qwen2.5-Coder-1.5B (12 query heads, 2 KV heads, head dim 128) at 1 token (a decode step) and 5
(a gamma-4 verification block); the 0.5B drafter (14 / 2 / 64) at 1 and 2 tokens. Each program
runs the attention of 24 distinct layers of a stacked cache of 256 slots, 200 of them visible
(each token of a block sees one more). Session 18's rewrite took the native kernel from 36 / 222 /
29 / 57 us a layer (scalar exp, lane sums per slot; measured with the same shapes at 964847c) to
the figures this writes.

  python benchmarks/native_attention.py --json benchmarks/issue17_native_attention_cpu.json
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jspec import native
from jspec.bench.profiling import save_script_record
from jspec.bench.round_split import best_seconds
from jspec.models.attention import masked_attention

SHAPES = {"target_step": (1, 12, 2, 128), "target_verify_g4": (5, 12, 2, 128),
          "drafter_step": (1, 14, 2, 64), "drafter_last2": (2, 14, 2, 64)}
LAYERS, SLOTS, VISIBLE = 24, 256, 200


def per_layer_seconds(attend, q, k, v, visible) -> float:
  """One program attending over every layer in turn: best of 7 runs (this VM is noisy)."""
  def run(q, k, v, visible):
    acc = jnp.float32(0)
    for layer in range(LAYERS):
      out = attend(q, k, v, visible, layer)
      acc, q = acc + out[0, 0, 0, 0], q + 1e-3 * out
    return acc

  return best_seconds(jax.jit(run), q, k, v, visible, repeats=LAYERS, tries=7)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--json", required=True)
  args = p.parse_args()
  rng = np.random.default_rng(0)
  rows = []
  for name, (T, H, K, D) in SHAPES.items():
    q = jnp.asarray(rng.standard_normal((1, T, H, D)).astype(np.float32))
    k, v = (jnp.asarray(rng.standard_normal((LAYERS, 1, SLOTS, K, D)).astype(np.float32))
            for _ in range(2))
    visible = jnp.asarray(np.arange(SLOTS)[None, None] < VISIBLE + np.arange(T)[None, :, None])
    kernels = {"native": native.attention,
               "xla": lambda q, k, v, vis, layer: masked_attention(q, k[layer], v[layer], vis)}
    s = {kernel: per_layer_seconds(f, q, k, v, visible) for kernel, f in kernels.items()}
    got = np.asarray(native.attention(q, k, v, visible, 3))
    want = np.asarray(masked_attention(q, k[3], v[3], visible))
    rows.append({"shape": name, "tokens": T, "heads": H, "kv_heads": K, "head_dim": D,
                 "native_us": s["native"] * 1e6, "xla_us": s["xla"] * 1e6,
                 "native_speedup_vs_xla": s["xla"] / s["native"],
                 "max_abs_diff": float(np.max(np.abs(got - want)))})
    print(f"{name:18s} native {s['native'] * 1e6:7.1f} us, xla {s['xla'] * 1e6:7.1f} us a layer: "
          f"{s['xla'] / s['native']:.2f}x", flush=True)
  save_script_record({"kernel_path": native.kernel_path(), "layers": LAYERS, "slots": SLOTS,
                      "visible": VISIBLE, "results": rows}, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
