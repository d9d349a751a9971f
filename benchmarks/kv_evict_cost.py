"""What evicting every decoded token costs: prefill seconds and decode tokens/s of one long prompt
under a KV budget, evicting every token (`evict_every=1`, the default until session 45) and every
k tokens (16, the default since), beside the full cache, in one process.

  python benchmarks/kv_evict_cost.py --json benchmarks/kv_evict_cost_cpu.json

Decoding is timed as (new_tokens - 1) / (a run of new_tokens - a run of one token), each the best
of `repeats` runs taken alternately once compiled: a long prompt's prefill is seconds, so a short
decode drowns in its noise (`jspec bench-kv` times the same way since session 39). The timing is
written out here, not imported, and only `Model.generate_ids` is used, so this script measures any
revision of jspec (`--script-from new` in ab_revisions.py).

Each eviction scores the budget's keys and moves the kept newest entries into the slots it
frees (before session 38 it compacted the whole cache: a gather of the kept slots and a rewrite
of the rest), so evicting every token costs that every step; evicting every k tokens lets the
cache run k slots over the budget between evictions. `benchmarks/ab_revisions.py` runs this
script at two revisions side by side.
"""

from __future__ import annotations

import argparse

import time

import jax

from jspec.bench.kv import policy_for
from jspec.bench.profiling import save_script_record
from jspec.kv.policy import KVPolicy
from jspec.model import load


def time_prefill_decode(model, prompt: list[int], policy: KVPolicy, new_tokens: int,
                        repeats: int) -> tuple[float, float]:
  """(prefill seconds, decode tokens/s): runs of 1 and of new_tokens tokens, alternated."""
  def run(n):
    start = time.perf_counter()
    jax.block_until_ready(model.generate_ids([prompt], max_new_tokens=n, kv=policy,
                                             stop=False).tokens)
    return time.perf_counter() - start

  run(1), run(new_tokens)  # compile both
  one, many = zip(*[(run(1), run(new_tokens)) for _ in range(repeats)])
  return min(one), (new_tokens - 1) / (min(many) - min(one))


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="float32")
  p.add_argument("--context", type=int, default=1500, help="prompt tokens (ids 100, 101, ...)")
  p.add_argument("--budget", type=int, default=512)
  p.add_argument("--chunk", type=int, default=128)
  p.add_argument("--methods", default="keydiff,h2o+caote")
  p.add_argument("--every", default="1,16", help="evict_every values")
  p.add_argument("--new-tokens", type=int, default=129, help="tokens of the decode timing run")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  model = load(args.model, args.weights)
  prompt = list(range(100, 100 + args.context))
  policies = {"full": policy_for("full", 0, args.context, args.new_tokens, args.chunk, 4, 0)}
  for method in args.methods.split(","):
    for every in (int(k) for k in args.every.split(",")):
      policies[f"{method} every {every}"] = KVPolicy(method, budget=args.budget,
                                                     chunk=args.chunk, evict_every=every)
  rows = []
  for name, policy in policies.items():
    prefill_s, decode = time_prefill_decode(model, prompt, policy, args.new_tokens, args.repeats)
    rows.append({"policy": name, "window": policy.recent, "prefill_s": prefill_s,
                 "decode_tokens_per_s": decode})
    print(rows[-1], flush=True)
  save_script_record({"model": args.model, "weights": args.weights, "context": args.context,
                      "budget": args.budget, "chunk": args.chunk, "new_tokens": args.new_tokens,
                      "repeats": args.repeats, "rows": rows}, args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
