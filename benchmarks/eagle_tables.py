"""An EAGLE drafter's draft step over the target's tables as the target stores them vs over dense
float32 copies of them (session 69).

  python benchmarks/eagle_tables.py --json benchmarks/eagle_tables_cpu.json

Until session 69 `eagle_drafter` copied the target's embedding and output head to dense float
arrays (an 8B target's are 2 GB each in float32) and ran the head, the largest matmul of a draft
step, as XLA's float dot whatever the target's format. Now both are read as stored (int8, 4-bit,
the float32 CPU kernel's layout) and the head runs the target's own matmul. This times one round's
parts (`round_components_s`: gamma drafts + the target's verification, and the verification
alone) with the same untrained drafter (`init_eagle`: only shapes and formats matter for time)
over the default model in each format, both forms alternated, best of `--tries`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jspec.bench.profiling import save_script_record
from jspec.bench.speed import round_components_s
from jspec.drafting.feature import EagleDrafter, eagle_drafter
from jspec.model import load
from jspec.models.eagle import init_eagle
from jspec.models.vocab_trim import output_table


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--formats", default="int8,q4,float32")
  p.add_argument("--gamma", type=int, default=3)
  p.add_argument("--repeats", type=int, default=32)
  p.add_argument("--tries", type=int, default=3)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  base = load("default", dtype="float32-xla")
  own, cfg = init_eagle(base.params, base.cfg, jax.random.key(0))
  rows = []
  for fmt in args.formats.split(","):
    model = load("default", dtype=fmt)
    forms = {"dense float32 copies": EagleDrafter(
                 params=own, embed=jnp.asarray(model.params.embed, jnp.float32),
                 head=jnp.asarray(output_table(model.params), jnp.float32), cfg=cfg),
             "as stored": eagle_drafter(own, cfg, model.params)}
    best = {name: [float("inf")] * 2 for name in forms}
    for _ in range(args.tries):
      for name, drafter in forms.items():
        got = round_components_s(model, drafter, gamma=args.gamma, repeats=args.repeats)
        best[name] = [min(a, b) for a, b in zip(best[name], got)]
    for name, (round_s, verify_s) in best.items():
      rows.append({"format": fmt, "tables": name, "round_ms": 1e3 * round_s,
                   "verify_ms": 1e3 * verify_s, "drafts_ms": 1e3 * (round_s - verify_s)})
    old, new = (best[name][0] - best[name][1] for name in forms)
    rows[-1]["drafts_speedup"] = old / new
  save_script_record({"model": "default", "gamma": args.gamma, "repeats": args.repeats,
                      "rows": rows}, args.json)


if __name__ == "__main__":
  main()
