"""The stacked cache write before and after session 35, side by side in one process: each program
compiled once with `write_slots` as it was (a vmap over the [L, B, S, K, D] cache's batch axis)
and once as it is (the rows written into the layer's own slice, put back in place), then run
alternately. Before, XLA:CPU copied the whole stacked cache into a batch-major layout and back at
every layer of the scan.

  python benchmarks/stacked_cache_write.py --drafters ngram,default,skip:10 \
      --json benchmarks/stacked_cache_write_cpu.json

Per program: seconds for `--max-new-tokens` tokens (best of `--runs`), the ratio, full-cache copies
a loop iteration (copies whose shape is the stacked cache's, nested loops times their trip
counts), and whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.launches import _called, computations, opcode, tally
from jspec.bench.profiling import save_script_record
from jspec.bench.programs import lower_decode
from jspec.drafting.registry import load_drafter
from jspec.model import load
from jspec.models import llama
from jspec.sampling.processing import SamplingParams

_CURRENT = llama.write_slots


def _before(cache, layer, slots, new, by_row):
  """write_slots as it was up to session 34."""
  if not by_row:
    return _CURRENT(cache, layer, slots, new, by_row)
  write = lambda c, s, n: c.at[layer, s].set(n.astype(c.dtype), mode="drop")
  return jax.vmap(write, in_axes=(1, 0, 0), out_axes=1)(cache, slots, new)


def cache_copies(hlo: str, shape: str) -> int:
  """Copies of arrays of `shape` (e.g. "30,1,256,3,64", any order of its dims) in one iteration
  of the heaviest loop of the entry computation (`jspec.bench.launches.tally`: nested loops times
  their trip counts, conditionals by their largest branch)."""
  comps, entry = computations(hlo)
  dims = sorted(shape.split(","))

  def copy_of_shape(line: str) -> bool:
    found = re.search(r"= \w+\[([0-9,]*)\]", line)
    return opcode(line) == "copy" and bool(found and sorted(found.group(1).split(",")) == dims)

  loops = [_called(line, "body") for line in comps[entry] if opcode(line) == "while"]
  return max((sum(n for (op, _), n in tally(comps, body, keep=copy_of_shape).items()
                  if op == "copy") for body in loops), default=0)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="float32")
  p.add_argument("--drafters", default="ngram,default,skip:10", help="chain drafters beside AR")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--cache-size", type=int, default=256)
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  model = load(args.model, args.weights, scan_layers=True)
  prompt, lengths, key = jnp.zeros((1, 64), jnp.int32), jnp.asarray([10]), jax.random.key(0)
  sp = jax.tree.map(jnp.asarray, SamplingParams())
  N, S = args.max_new_tokens, args.cache_size
  c = model.cfg
  shape = f"{c.num_layers},1,{S},{c.num_kv_heads},{c.head_dim}"
  rows = []
  for name in ["autoregressive"] + args.drafters.split(","):
    drafter = None if name == "autoregressive" else load_drafter(name, model, args.weights)
    programs = {}
    for label, write in (("before", _before), ("after", _CURRENT)):
      llama.write_slots = write
      jax.clear_caches()  # a trace of the other write must not be reused
      try:
        lowered, call = lower_decode(model.params, model.cfg, prompt, lengths, key, sp,
                                     drafter=drafter, max_new_tokens=N, cache_size=S)
        compiled = lowered.compile()
      finally:
        llama.write_slots = _CURRENT
      programs[label] = compiled, call
    best = dict.fromkeys(programs, float("inf"))
    outs = {label: jax.block_until_ready(f(*a)) for label, (f, a) in programs.items()}  # warm
    for _ in range(args.runs):
      for label, (f, a) in programs.items():
        start = time.perf_counter()
        jax.block_until_ready(f(*a))
        best[label] = min(best[label], time.perf_counter() - start)
    row = {"program": name, "seconds": best, "after_speedup": best["before"] / best["after"],
           "cache_copies_per_iteration": {label: cache_copies(f.as_text(), shape)
                                          for label, (f, _) in programs.items()},
           "same_tokens": bool(np.array_equal(np.asarray(outs["before"].tokens),
                                              np.asarray(outs["after"].tokens)))}
    print(row, flush=True)
    rows.append(row)
  save_script_record({"model": args.model, "weights": args.weights, "layers": "stacked",
                      "max_new_tokens": N, "cache_size": S, "greedy": True, "rows": rows},
                     args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
