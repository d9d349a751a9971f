"""Unrolled layer loop (what jspec runs) vs `lax.scan` over stacked layers: compile time and decode
speed of the same autoregressive decode program, measured side by side in one process.

The unrolled variant is `llama.forward` itself; the scan variant runs the same
`llama.decoder_layer` over every layer's arrays stacked on a leading axis (one traced layer
instead of L). The program
timed is a `fori_loop` of `--steps` one-token forwards + greedy argmax, the shape of the decode
loop's body; compile is `jit(...).lower(...).compile()` with the persistent cache off.

  python benchmarks/scan_layers.py --model qwen2.5-coder-1.5b --weights int8 \
      --json benchmarks/issue17_scan_layers_int8_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

from jspec.bench.profiling import save_script_record
from jspec.model import load
from jspec.models import attention, llama, quant
from jspec.models.cache import KVCache
from jspec.models.numerics import COMPILER_OPTIONS


def decode_program(cfg, steps: int, scan: bool):
  """`steps` greedy one-token forwards from a filled cache, layers unrolled or scanned."""
  def forward(p, token, position, cache):
    if not scan:  # what jspec runs
      logits, _, cache = llama.forward(p, cfg, token, position, cache)
      return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache.commit(1)
    x = quant.take_rows(p.embed, token)  # [1, 1, E]
    cos, sin = llama.rope_tables(cfg, position)
    slots = cache.lengths[:, None]
    attend = attention.attention_fn(cfg, cache.lengths, cache.size, None, 1,
                                    quant.attention_kernel(p))

    def body(carry, layer):
      x, k_all, v_all, i = carry
      x, k_all, v_all = llama.decoder_layer(cfg, x, layer, i, k_all, v_all, cos, sin, slots,
                                            attend)
      return (x, k_all, v_all, i + 1), None

    (x, k_all, v_all, _), _ = jax.lax.scan(body, (x, cache.k, cache.v, jnp.int32(0)), p.layers)
    logits = llama.lm_head(p, llama.rms_norm(x, p.final_norm, cfg.rms_norm_eps))
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), dataclasses.replace(
        cache, k=k_all, v=v_all).commit(1)

  def run(p, cache, n=steps):  # n may be traced: one program for any number of steps
    def one(_, carry):
      token, cache = carry
      nxt, cache = forward(p, token[:, None], cache.lengths[:, None], cache)
      return nxt, cache
    return jax.lax.fori_loop(0, n, one, (jnp.zeros((1,), jnp.int32), cache))[0]

  return run


def stacked(params):
  """Every layer's arrays stacked on a leading axis (the scan's xs)."""
  return dataclasses.replace(params, layers=jax.tree.map(lambda *a: jnp.stack(a), *params.layers))


def measure(model, scan: bool, steps: int, context: int, cache_size: int) -> dict:
  params = stacked(model.params) if scan else model.params
  cache = KVCache.init(model.cfg, 1, cache_size, jnp.float32).with_lengths(
      jnp.asarray([context], jnp.int32))
  run = decode_program(model.cfg, steps, scan)
  jitted = jax.jit(run, compiler_options=COMPILER_OPTIONS)
  start = time.perf_counter()
  compiled = jitted.lower(params, cache).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(params, cache))
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(compiled(params, cache))
    best = min(best, time.perf_counter() - start)
  return {"compile_s": compile_s, "step_s": best / steps, "tok_s": steps / best}


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--weights", default="int8")
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--context", type=int, default=200)
  p.add_argument("--cache-size", type=int, default=320)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  model = load(args.model, args.weights)
  record = {"model": args.model, "weights": args.weights, "steps": args.steps,
            "context": args.context, "cache_size": args.cache_size}
  for name, scan in (("unrolled", False), ("scan", True)):
    record[name] = measure(model, scan, args.steps, args.context, args.cache_size)
    print(name, record[name], flush=True)
  record["scan_compile_speedup"] = record["unrolled"]["compile_s"] / record["scan"]["compile_s"]
  record["scan_decode_speed_ratio"] = record["scan"]["tok_s"] / record["unrolled"]["tok_s"]
  save_script_record(record, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
