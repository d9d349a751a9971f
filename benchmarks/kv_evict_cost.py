"""What evicting every decoded token costs: prefill seconds and decode tokens/s of one long prompt
under a KV budget, evicting every token (`evict_every=1`, the default) and every k tokens, beside
the full cache, in one process (`jspec.bench.kv.time_prefill_decode`).

  python benchmarks/kv_evict_cost.py --json benchmarks/kv_evict_cost_cpu.json

Each eviction scores the budget's keys and moves the kept newest entries into the slots it
frees (before session 38 it compacted the whole cache: a gather of the kept slots and a rewrite
of the rest), so evicting every token costs that every step; evicting every k tokens lets the
cache run k slots over the budget between evictions. `benchmarks/ab_revisions.py` runs this
script at two revisions side by side.
"""

from __future__ import annotations

import argparse

from jspec.bench.kv import policy_for, time_prefill_decode
from jspec.bench.profiling import save_script_record
from jspec.kv.policy import KVPolicy
from jspec.model import load


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="float32")
  p.add_argument("--context", type=int, default=1500, help="prompt tokens (ids 100, 101, ...)")
  p.add_argument("--budget", type=int, default=512)
  p.add_argument("--chunk", type=int, default=128)
  p.add_argument("--methods", default="keydiff,h2o+caote")
  p.add_argument("--every", default="1,16", help="evict_every values")
  p.add_argument("--json", required=True)
  args = p.parse_args()
  model = load(args.model, args.weights)
  prompt = list(range(100, 100 + args.context))
  policies = {"full": policy_for("full", 0, args.context, 40, args.chunk, 4, 0)}
  for method in args.methods.split(","):
    for every in (int(k) for k in args.every.split(",")):
      policies[f"{method} every {every}"] = KVPolicy(method, budget=args.budget,
                                                     chunk=args.chunk, evict_every=every)
  rows = []
  for name, policy in policies.items():
    prefill_s, decode = time_prefill_decode(model, prompt, policy)
    rows.append({"policy": name, "prefill_s": prefill_s, "decode_tokens_per_s": decode})
    print(rows[-1], flush=True)
  save_script_record({"model": args.model, "weights": args.weights, "context": args.context,
                      "budget": args.budget, "chunk": args.chunk, "rows": rows}, args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
