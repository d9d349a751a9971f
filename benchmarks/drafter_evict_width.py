"""A budgeted drafter's eviction: selecting over the slots a round can add vs over the prefill's
whole working block (session 43).

  python benchmarks/drafter_evict_width.py --json benchmarks/drafter_evict_width_cpu.json

Between rounds a drafter under `draft_kv` holds at most budget + evict_every - 1 entries and a
round feeds `room` (gamma + 1) more, so an eviction drops at most evict_every - 1 + room entries.
Until session 43 it selected over every slot past the budget, max(chunk, evict_every - 1 + room):
128 with the default chunk. This times `evict_when_full` both ways on drafter-shaped caches of
random keys (3 KV heads of 64, as the default model's; 2 layers as the default drafter, 30 as the
default model drafting for a larger target), 40 evictions in one jitted loop that updates the
cache in place, the two forms alternated, best of `repeats`; and checks that both keep the same
cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profiling import save_script_record
from jspec.kv.evict import evict_when_full, record_positions
from jspec.kv.policy import KVPolicy
from jspec.models.cache import KVCache
from jspec.models.config import Config

EVICTIONS = 40


def evictions(policy: KVPolicy, room: int, max_drop: int | None):
  """EVICTIONS rounds of `room` new entries, each followed by decoding's eviction."""
  @jax.jit
  def run(cache: KVCache) -> KVCache:
    def body(_, carry):
      cache, evicted = carry
      cache, dropped = evict_when_full(policy, cache.with_lengths(cache.lengths + room), evicted,
                                       max_drop=max_drop)
      return cache, evicted + dropped
    return jax.lax.fori_loop(0, EVICTIONS, body, (cache, jnp.zeros_like(cache.lengths)))[0]
  return run


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", default="2,30")
  p.add_argument("--budget", type=int, default=512)
  p.add_argument("--chunk", type=int, default=128)
  p.add_argument("--evict-every", type=int, default=1)
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  policy = KVPolicy("keydiff", args.budget, chunk=args.chunk, evict_every=args.evict_every)
  room = args.gamma + 1
  narrow = args.evict_every - 1 + room
  rows = []
  for layers in (int(x) for x in args.layers.split(",")):
    cfg = Config(arch="llama", vocab_size=256, hidden_size=192, intermediate_size=64,
                 num_layers=layers, num_heads=3, num_kv_heads=3, head_dim=64)
    cache = KVCache.init(cfg, 1, args.budget + max(args.chunk, narrow), jnp.float32)
    rng = np.random.default_rng(0)
    cache = dataclasses.replace(cache, k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                                v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32))
    cache = record_positions(cache.with_lengths(jnp.full((1,), args.budget, jnp.int32)),
                             jnp.zeros((1,), jnp.int32))
    forms = {"chunk_wide": evictions(policy, room, None), "round_wide": evictions(policy, room,
                                                                                narrow)}
    kept = {name: run(cache) for name, run in forms.items()}  # compiles too
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(kept["chunk_wide"]),
                                                          jax.tree.leaves(kept["round_wide"])))
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(args.repeats):
      for name, run in forms.items():
        start = time.perf_counter()
        jax.block_until_ready(run(cache))
        best[name] = min(best[name], (time.perf_counter() - start) / EVICTIONS * 1e3)
    rows.append({"layers": layers, "width_chunk": max(args.chunk, narrow), "width_round": narrow,
                 "ms_per_eviction_chunk_wide": best["chunk_wide"],
                 "ms_per_eviction_round_wide": best["round_wide"],
                 "speedup": best["chunk_wide"] / best["round_wide"], "same_cache": same})
    print(rows[-1], flush=True)
  save_script_record({"budget": args.budget, "chunk": args.chunk, "evict_every": args.evict_every,
                      "gamma": args.gamma, "evictions": EVICTIONS, "repeats": args.repeats,
                      "rows": rows}, args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
