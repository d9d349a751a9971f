"""The KV cache write's forms side by side in one process, in either layer layout: each program
compiled once per form of `write_slots`, then run alternately.

  python benchmarks/cache_write.py --layout stacked --drafters ngram,default,skip:10 \
      --json benchmarks/cache_write_stacked_cpu.json

Forms: "vmap" (up to session 34, off a mesh too: a vmap over the [L, B, S, K, D] cache's batch
axis; XLA:CPU copied the whole stacked cache into a batch-major layout and back at every layer of
the scan), "slice" (session 35: the rows written into the layer's own slice, put back in place;
where the layers are unrolled, XLA:CPU copied the whole cache twice a layer), "now"
(`jspec.models.llama.write_slots` since session 36: the slice form for stacked layers, one
scatter over explicit rows for unrolled ones off a mesh).

Per program: seconds for `--max-new-tokens` tokens (best of `--runs`), each form's speed-up over
the first, full-cache copies a loop iteration (copies whose shape is the cache's, nested loops
times their trip counts), and whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.launches import copies_of_shape
from jspec.bench.profiling import save_script_record
from jspec.bench.programs import lower_decode
from jspec.drafting.registry import load_drafter
from jspec.io import compilation_cache
from jspec.model import load
from jspec.models import llama
from jspec.sampling.processing import SamplingParams

_NOW = llama.write_slots
# Each form as write_slots took it: sessions <= 34 wrote every XLA-dot program row by row, 35
# through the layer's slice.
FORMS = {"vmap": llama.write_rows_batched, "slice": llama.write_layer_slice, "now": _NOW}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="float32-xla",
                 help="XLA-dot weights (the native kernels' one scatter never changed)")
  p.add_argument("--layout", choices=("stacked", "unrolled"), default="stacked")
  p.add_argument("--forms", default="vmap,slice,now", help=f"of {sorted(FORMS)}; the first is "
                 "the baseline of the speed-ups")
  p.add_argument("--drafters", default="ngram,default,skip:10",
                 help="chain drafters beside AR ('' for AR alone)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--cache-size", type=int, default=256)
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  compilation_cache.enable()  # $JSPEC_COMPILATION_CACHE: a rerun on a warm machine loads them
  model = load(args.model, args.weights, scan_layers=args.layout == "stacked")
  forms = args.forms.split(",")
  prompt, lengths, key = jnp.zeros((1, 64), jnp.int32), jnp.asarray([10]), jax.random.key(0)
  sp = jax.tree.map(jnp.asarray, SamplingParams())
  N, S = args.max_new_tokens, args.cache_size
  c = model.cfg
  shape = (c.num_layers, 1, S, c.num_kv_heads, c.head_dim)
  rows = []
  for name in ["autoregressive"] + [d for d in args.drafters.split(",") if d]:
    drafter = None if name == "autoregressive" else load_drafter(name, model, args.weights)
    programs = {}
    for label in forms:
      llama.write_slots = FORMS[label]
      jax.clear_caches()  # a trace of the other write must not be reused
      try:
        lowered, call = lower_decode(model.params, model.cfg, prompt, lengths, key, sp,
                                     drafter=drafter, max_new_tokens=N, cache_size=S)
        compiled = lowered.compile()
      finally:
        llama.write_slots = _NOW
      programs[label] = compiled, call
    best = dict.fromkeys(programs, float("inf"))
    outs = {label: jax.block_until_ready(f(*a)) for label, (f, a) in programs.items()}  # warm
    for _ in range(args.runs):
      for label, (f, a) in programs.items():
        start = time.perf_counter()
        jax.block_until_ready(f(*a))
        best[label] = min(best[label], time.perf_counter() - start)
    first = forms[0]
    row = {"program": name, "seconds": best,
           "speedup_over_" + first: {label: best[first] / best[label] for label in forms},
           "cache_copies_per_iteration": {label: copies_of_shape(f.as_text(), shape)
                                          for label, (f, _) in programs.items()},
           "same_tokens": all(np.array_equal(np.asarray(outs[first].tokens),
                                             np.asarray(outs[label].tokens)) for label in forms)}
    print(row, flush=True)
    rows.append(row)  # saved row by row: a lease's time limit may cut the run
    save_script_record({"model": args.model, "weights": args.weights, "layers": args.layout,
                        "forms": forms, "max_new_tokens": N, "cache_size": S, "greedy": True,
                        "rows": rows}, args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
