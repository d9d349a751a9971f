"""Which drafter makes the README's demo fastest: the demo prompt, autoregressive decoding and each
drafter side by side in one process (every method compiled first, then timed in turn, best of 3).

  python benchmarks/demo_drafters.py --json benchmarks/issue23_demo_drafters_cpu.json
"""

import argparse
import json
import time
from pathlib import Path

import jax

import jspec.model
from jspec.bench.profiling import machine_info
from jspec.drafting.registry import load_drafter

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--drafters", default="ngram,ngram@1,default,mtp:3")
  ap.add_argument("--gamma", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--json", type=Path, default=Path("benchmarks/issue23_demo_drafters_cpu.json"))
  args = ap.parse_args()
  model = jspec.model.load("default")
  prompt = model.encode(PROMPT)
  names = ["none"] + args.drafters.split(",")
  drafters = {n: None if n == "none" else load_drafter(n, model) for n in names}

  def run(name):
    extra = {} if drafters[name] is None else {"drafter": drafters[name], "gamma": args.gamma}
    return jax.block_until_ready(model.generate_ids([prompt], max_new_tokens=args.max_new_tokens,
                                                    **extra))

  outs = {n: run(n) for n in names}  # compile
  best = dict.fromkeys(names, float("inf"))
  for _ in range(args.repeats):
    for n in names:
      start = time.perf_counter()
      run(n)
      best[n] = min(best[n], time.perf_counter() - start)
  ar = outs["none"].sequences()
  records = []
  for n in names:
    tokens = int(outs[n].lengths.sum())
    records.append({"drafter": n, "gamma": None if n == "none" else args.gamma,
                    "prompt": PROMPT, "new_tokens": tokens, "tokens_per_s": tokens / best[n],
                    "speedup_vs_ar": best["none"] / best[n],
                    "block_efficiency": float(getattr(outs[n], "block_efficiency", 1.0)),
                    "identical_to_ar": outs[n].sequences() == ar, "timing": f"best of {args.repeats}",
                    "machine": machine_info()})
    print(f"{n:9} {records[-1]['tokens_per_s']:6.1f} tok/s  x{records[-1]['speedup_vs_ar']:.2f}  "
          f"tau {records[-1]['block_efficiency']:.2f}  identical {records[-1]['identical_to_ar']}")
  args.json.write_text(json.dumps(records, indent=1))
  print("wrote", args.json)


if __name__ == "__main__":
  main()
