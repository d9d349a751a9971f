"""Whole-cache copies in one iteration of each loop of a program that decodes under a KV budget
(the prefill's chunk loop, then the decode loop), for each layer layout and policy, on whatever
backend JAX runs here: a copy of the cache's k or v there costs a pass over the cache.

  python benchmarks/kv_copies.py --json benchmarks/kv_copies_cpu.json

A 4-layer random model (the tests' target config), budget 32, chunk 16, a 40-token prompt,
evicting every token. On a CPU `tests/test_cache_write.py` checks the stacked layout's 0.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jspec.bench.launches import copies_per_loop
from jspec.bench.profiling import save_script_record
from jspec.bench.programs import lower_decode
from jspec.kv.policy import KVPolicy
from jspec.models.config import Config
from jspec.models.llama import init_params, stack_layers

CFG = Config(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4,
             num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--methods", default="keydiff,streaming,h2o+caote")
  p.add_argument("--json", required=True)
  args = p.parse_args()
  params = init_params(CFG, jax.random.key(3), scale=0.3)
  rows = []
  for layout, weights in (("unrolled", params), ("stacked", stack_layers(params))):
    for method in args.methods.split(","):
      policy = KVPolicy(method, budget=32, sinks=2, chunk=16, evict_every=1)
      lowered, _ = lower_decode(weights, CFG, jnp.zeros((1, 40), jnp.int32), jnp.asarray([40]),
                                jax.random.key(0), max_new_tokens=8, cache_size=0, kv=policy)
      shape = (CFG.num_layers, 1, policy.slots, CFG.num_kv_heads, CFG.head_dim)
      prefill, decode = copies_per_loop(lowered.compile().as_text(), shape)
      rows.append({"layout": layout, "method": method, "prefill_chunk_copies": prefill,
                   "decode_step_copies": decode})
      print(rows[-1], flush=True)
  save_script_record({"backend": jax.default_backend(), "rows": rows}, args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
