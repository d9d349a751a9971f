"""Where an int8 decode step's time goes, and what bounds XLA:CPU's int8 matmuls.

1. One autoregressive step of a model (1-token forward + LM head), against the same step without
   the head, the step's projections alone (with the per-token activation quantization jspec runs)
   and the bare int8 x int8 dots of those projections: what is left beyond the matmuls is
   attention, norms, RoPE and the rest of the step's kernels.
2. int8 x int8 -> int32 dots streaming many DISTINCT weights (so they come from memory, not cache)
   at 1-8 rows, against what a single thread reads of memory with numpy (a sum): a dot rate far
   below the memory rate means the kernel, not memory, bounds decode.

All timed in one process, best of 3 fori_loops of `--repeats` steps.

  python benchmarks/int8_step_profile.py --model qwen2.5-coder-1.5b \
      --json benchmarks/issue17_int8_step_profile_cpu.json
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profiling import save_script_record
from jspec.bench.profiling import best_seconds
from jspec.model import load
from jspec.models import llama, quant
from jspec.models.cache import KVCache
from jspec.models.numerics import engine_jit

PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def step_seconds(params, cfg, repeats: int, context: int = 128, size: int = 512) -> dict:
  """Seconds per decode step: whole, without the head, projections only, bare int8 dots."""
  cache = KVCache.init(cfg, 1, size, jnp.float32).with_lengths(jnp.asarray([context], jnp.int32))

  def forward_step(with_head: bool):
    @engine_jit
    def run(params, cache):
      def one(i, carry):
        cache, acc = carry
        token = jnp.full((1, 1), i, jnp.int32)
        position = jnp.full((1, 1), context, jnp.int32)
        at = None if with_head else jnp.zeros((1, 0), jnp.int32)
        logits, hidden, cache = llama.forward(params, cfg, token, position, cache,
                                              logits_indices=at)
        return cache, acc + hidden[0, -1, 0] + (logits[0, 0, 0] if with_head else 0.0)
      return jax.lax.fori_loop(0, repeats, one, (cache, jnp.float32(0)))
    return run

  def projections(bare: bool):
    @engine_jit
    def run(params):
      def one(i, acc):
        for lp in params.layers:
          for name in PROJECTIONS:
            w = getattr(lp, name)
            w = w.reshape(-1, cfg.hidden_size) if name == "wo" else w  # [in, out...]
            x = (jnp.arange(w.shape[0], dtype=jnp.float32)[None, None] % 7 + i) * 1e-3
            if bare:  # the dot alone: two int8 rows (jspec's one-token shape), int32 out
              xq = jnp.concatenate([x, x], axis=1).astype(jnp.int8)
              y = jnp.einsum("bte,e...->bt...", xq, w.q, preferred_element_type=jnp.int32)
            else:
              y = quant.einsum("bte,e...->bt...", x, w)
            acc = acc + y.reshape(-1)[0].astype(jnp.float32)
        return acc
      return jax.lax.fori_loop(0, repeats, one, jnp.float32(0))
    return run

  return {"ar_step_s": best_seconds(forward_step(True), params, cache, repeats=repeats),
          "layers_s": best_seconds(forward_step(False), params, cache, repeats=repeats),
          "projections_s": best_seconds(projections(False), params, repeats=repeats),
          "bare_int8_dots_s": best_seconds(projections(True), params, repeats=repeats)}


def dot_rates(rows_list=(1, 2, 4, 8), layers: int = 28, shape=(1536, 8960), repeats: int = 4
              ) -> dict:
  """GB/s of weights streamed by int8 dots over `layers` distinct [E, F] weights, per row count,
  and a single numpy thread's read rate over the same bytes."""
  rng = np.random.default_rng(0)
  weights = [jnp.asarray(rng.integers(-127, 128, shape, dtype=np.int8)) for _ in range(layers)]
  gb = layers * shape[0] * shape[1] / 1e9
  out = {"weights_gb": gb}
  for rows in rows_list:
    @engine_jit
    def run(ws):
      def one(i, acc):
        x = (jnp.arange(rows * shape[0]).reshape(rows, shape[0]) % 7 + i).astype(jnp.int8)
        for w in ws:
          acc = acc + jnp.einsum("te,ef->tf", x, w, preferred_element_type=jnp.int32)[0, 0]
        return acc
      return jax.lax.fori_loop(0, repeats, one, jnp.int32(0))
    out[f"int8_dot_rows{rows}_gb_per_s"] = gb / best_seconds(run, weights, repeats=repeats)
  flat = np.concatenate([np.asarray(w).reshape(-1) for w in weights]).view(np.int64)
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    flat.sum()
    best = min(best, time.perf_counter() - start)
  out["numpy_one_thread_read_gb_per_s"] = gb / best
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", action="append", default=None,
                  help="models to profile (repeatable; default qwen2.5-coder-1.5b and -0.5b)")
  ap.add_argument("--repeats", type=int, default=8)
  ap.add_argument("--json", required=True)
  args = ap.parse_args()
  record = {"weights": "int8", "models": {}}
  for name in args.model or ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]:
    model = load(name, "int8")
    split = step_seconds(model.params, model.cfg, args.repeats)
    split["param_bytes"] = llama.param_bytes(model.params)
    split["beyond_projections_s"] = split["layers_s"] - split["projections_s"]
    split["head_s"] = split["ar_step_s"] - split["layers_s"]
    record["models"][name] = split
    del model
  record["int8_dots"] = dot_rates()
  save_script_record(record, args.json)


if __name__ == "__main__":
  main()
