"""Where a speculative round goes beyond a one-token step: kernel launches per iteration of each
decode loop (read off the optimized HLO, by the JAX operation that made them) beside its measured
time, and what a forward of T tokens costs alone, side by side in one process.

On the H100 (session 34) a chain round with a drafter that does no model work (`ngram`) cost
2.9 ms against 1.4-1.5 ms for an autoregressive token of the launch-bound default model: this says
whether the round runs more kernels (and which) or its forward of gamma + 1 tokens costs more.

  python benchmarks/round_anatomy.py --scan-layers --weights float32-xla --precision exact \
      --drafters ngram,mtp:3,skip:10,default --json benchmarks/round_anatomy_cpu.json

Per program: launches per loop iteration (`jspec.bench.launches.loop_launches`: nested loops
expanded by their trip counts, every conditional by its largest branch, and by its smallest),
split by opcode and by the op_name prefix that made them; host syncs (conditionals and loops of
unknown trip count run) and where in jspec they come from; milliseconds per iteration (the
compiled program's best wall time over its loop iterations: autoregressive tokens or speculative
rounds, one prefill included); tau. Then `forward_width_s`: one target forward of 1, gamma + 1,
... tokens in a loop. The sampling settings reach the programs as the engines pass them (arrays,
SamplingParams' static mode: no greedy/sampled conditional in the loop); `--dynamic-sampling`
(mode=None) puts those switches back in every iteration, as every program had them before
session 35: set beside a default run, what they cost.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jspec import data
from jspec.bench.launches import control_flow_sites, loop_launches
from jspec.bench.profiling import save_script_record
from jspec.bench.programs import lower_decode
from jspec.bench.round_split import best_seconds, forward_width_s
from jspec.drafting.registry import load_drafter
from jspec.io import compilation_cache
from jspec.model import load
from jspec.models.numerics import matmul_precision
from jspec.sampling.processing import SamplingParams
from jspec.speculative.chain import SpecConfig


def measure(name: str, lowered, args, tries: int, count_iterations) -> dict:
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  wall = best_seconds(compiled, *args, repeats=1, tries=tries)
  out = compiled(*args)
  iterations, tokens = count_iterations(out)
  return {"program": name, "compile_s": compile_s, "wall_s": wall, "iterations": iterations,
          "tokens": tokens, "ms_per_iteration": wall / iterations * 1e3,
          "tau": tokens / iterations, **loop_launches(compiled.as_text()),
          "sites": control_flow_sites(lowered.compiler_ir("stablehlo"))}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="float32")
  p.add_argument("--scan-layers", action="store_true")
  p.add_argument("--precision", default="exact", choices=("fast", "exact"))
  p.add_argument("--drafters", default="ngram,mtp:3,skip:10,default", help="chain drafters")
  p.add_argument("--gamma", type=int, default=3)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--dynamic-sampling", action="store_true",
                 help="SamplingParams(mode=None): greedy and sampled decided inside the loop")
  p.add_argument("--dataset", default="mt-bench")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--prompt-bucket", type=int, default=128)
  p.add_argument("--cache-size", type=int, default=512)
  p.add_argument("--widths", default="1,4,7,16", help="forward widths to time")
  p.add_argument("--tries", type=int, default=3)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  compilation_cache.enable()  # $JSPEC_COMPILATION_CACHE: a rerun on a warm machine loads them
  model = load(args.model, args.weights, scan_layers=args.scan_layers)
  chat = data.is_chat(args.dataset) and model.tokenizer.chat_template is not None
  ids = model.encode(data.load_prompts(args.dataset, 1)[0], chat=chat)[:args.prompt_bucket]
  prompt = jnp.zeros((1, args.prompt_bucket), jnp.int32).at[0, :len(ids)].set(
      jnp.asarray(ids, jnp.int32))
  lengths = jnp.asarray([len(ids)], jnp.int32)
  key = jax.random.key(0)
  # Arrays, as the engines receive them (jspec.decode.Batch); the mode stays static unless asked.
  mode = None if args.dynamic_sampling else "auto"
  sampling = jax.tree.map(jnp.asarray, SamplingParams(temperature=args.temperature, mode=mode))
  N, S = args.max_new_tokens, args.cache_size
  rows = []
  record = {"model": args.model, "weights": args.weights, "scan_layers": args.scan_layers,
            "precision": args.precision, "gamma": args.gamma, "temperature": args.temperature,
            "sampling_mode": repr(sampling.mode),
            "max_new_tokens": N, "cache_size": S, "prompt_tokens": len(ids),
            "xla_flags": os.environ.get("XLA_FLAGS"), "programs": rows, "complete": False}

  def add(row: dict) -> None:  # each program's row kept as it comes: a lease may cut the run
    if rows and row["launches"] and rows[0]["launches"]:
      row["launches_vs_ar_step"] = row["launches"] / rows[0]["launches"]
      row["ms_vs_ar_step"] = row["ms_per_iteration"] / rows[0]["ms_per_iteration"]
    rows.append(row)
    print({k: v for k, v in row.items() if k not in ("by_op", "by_source", "sites")},
          flush=True)
    Path(args.json).write_text(json.dumps(record, indent=1))

  with matmul_precision(args.precision):
    ar, call = lower_decode(model.params, model.cfg, prompt, lengths, key, sampling,
                            max_new_tokens=N, cache_size=S)
    add(measure("autoregressive", ar, call, args.tries, lambda out: (N, N)))
    spec = SpecConfig(gamma=args.gamma, max_new_tokens=N)
    for name in args.drafters.split(","):
      drafter = load_drafter(name, model, args.weights)
      lowered, call = lower_decode(model.params, model.cfg, prompt, lengths, key, sampling,
                                   drafter=drafter, spec=spec, cache_size=S)
      add(measure(name, lowered, call, args.tries,
                  lambda out: (int(out.rounds.max()), int(out.lengths.max()))))
    widths = tuple(int(w) for w in args.widths.split(","))
    forward = forward_width_s(model.params, model.cfg, widths, cache_size=S)
  record.update(complete=True, forward_ms={
      str(t): {k.replace("_s", "_ms"): v * 1e3 for k, v in f.items()} for t, f in forward.items()})
  save_script_record(record, args.json)
  print("program | launches / iteration (smallest branches) | host syncs | ms / iteration | "
        "x AR step (launches, ms) | tau")
  for row in rows:
    print(f"{row['program']} | {row['launches']} ({row['launches_smallest']}) | "
          f"{row['host_syncs']} | {row['ms_per_iteration']:.3f} | "
          f"{row.get('launches_vs_ar_step', 1):.2f}, {row.get('ms_vs_ar_step', 1):.2f} | "
          f"{row['tau']:.2f}")
  print("forward of T tokens, ms:", {t: round(f["total_s"] * 1e3, 3) for t, f in forward.items()})
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
