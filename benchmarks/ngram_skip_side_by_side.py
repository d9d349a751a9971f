"""Issue #20: what leaving the model drafter out of fully matched n-gram rounds buys.

Times autoregressive decoding, `ngram+default` as shipped (a round whose every draft the lookup
matched skips the drafter and catches its cache up in one forward after verification) and the
same drafter drafting every round (skip_matched=False), side by side prompt by prompt in one
process (jspec.bench.speed.bench_interleaved). Both spec variants must emit the same tokens and
accept the same counts; only the time may differ.

  python benchmarks/ngram_skip_side_by_side.py --dataset humaneval --num-prompts 6 \
      --json benchmarks/issue20_ngram_skip_humaneval_cpu.json
"""

import argparse
import dataclasses
import json

import numpy as np

from jspec.bench.speed import Method, bench_interleaved
from jspec.bench.profiling import machine_info
from jspec.cli.records import dataset_prompts
from jspec.drafting.registry import load_drafter
from jspec.model import load
from jspec.sampling.processing import SamplingParams


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dataset", default="humaneval")
  ap.add_argument("--num-prompts", type=int, default=6)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--gamma", type=int, default=3)
  ap.add_argument("--fallback", default="default")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  model = load()
  prompts = dataset_prompts(model, args.dataset, args.num_prompts)
  shipped = load_drafter(f"ngram+{args.fallback}", model)
  every_round = dataclasses.replace(shipped, skip_matched=False)
  greedy = SamplingParams(temperature=0.0)
  methods = [Method(model, args.max_new_tokens, greedy, 0, measure_ttft=False)] + [
      Method(model, args.max_new_tokens, greedy, 0, d, args.gamma, measure_ttft=False)
      for d in (shipped, every_round)]
  (ar, _), (skip, _), (full, _) = bench_interleaved(methods, prompts)
  same = skip.outputs == full.outputs and np.array_equal(skip.accept_hist, full.accept_hist)
  rows = []
  for name, run in (("autoregressive", ar), ("skip matched rounds", skip),
                    ("draft every round", full)):
    s = run.summary()
    rows.append({"method": name, "tokens_per_s": s["tokens_per_s"],
                 "speedup_vs_ar": s["tokens_per_s"] / ar.summary()["tokens_per_s"],
                 "tau": (run.round_tokens / run.row_rounds) if run.row_rounds else None,
                 "identical_to_ar": run.outputs == ar.outputs})
    print(f"{name:22s} {rows[-1]['tokens_per_s']:7.1f} tok/s  x{rows[-1]['speedup_vs_ar']:.2f}"
          f"  tau {rows[-1]['tau'] or 1:.2f}  identical {rows[-1]['identical_to_ar']}")
  print("skip and every-round emit the same tokens and acceptances:", same)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"dataset": args.dataset, "num_prompts": args.num_prompts,
                 "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
                 "drafter": f"ngram+{args.fallback}", "same_tokens_and_acceptance": same,
                 "machine": machine_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
