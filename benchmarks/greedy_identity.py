"""Greedy identity per weight format and precision: is greedy speculative output token-identical
to greedy autoregressive output, and where does it part when it is not?

For each weight format (--weights) and precision ("fast", "exact"), every prompt is decoded
greedily by the autoregressive loop and by chains with each drafter; the record says, per
drafter, how many prompts came out identical and the first position where each other one parted.
On CPU both precisions compute full float32; on a GPU "fast" is TF32 (jspec.models.numerics).

  python benchmarks/greedy_identity.py --model default --drafters self,default \
      --weights float32,bfloat16,int8 --dataset mt-bench --num-prompts 16 --max-new-tokens 64 \
      --json benchmarks/issue18_greedy_identity_cpu.json
"""

from __future__ import annotations

import argparse

import jax

from jspec.bench.profiling import save_script_record
from jspec import data
from jspec.drafting.registry import load_drafter
from jspec.model import load


def first_difference(a: list[int], b: list[int]) -> int | None:
  """The first position where two outputs differ (a length when one is a prefix), None if equal."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="default")
  ap.add_argument("--drafters", default="self,default")
  ap.add_argument("--weights", default="float32,bfloat16")
  ap.add_argument("--precisions", default="fast,exact")
  ap.add_argument("--dataset", default="mt-bench", choices=["mt-bench", "humaneval"])
  ap.add_argument("--num-prompts", type=int, default=16)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--json", required=True)
  args = ap.parse_args()
  rows = []
  for weights in args.weights.split(","):
    model = load(args.model, weights)
    chat = data.is_chat(args.dataset) and model.tokenizer.chat_template is not None
    prompts = [model.encode(t, chat=chat) for t in data.load_prompts(args.dataset, args.num_prompts)]
    drafters = {name: load_drafter(name, model, weights) for name in args.drafters.split(",")}
    for precision in args.precisions.split(","):
      run = lambda p, **kw: model.generate_ids([p], max_new_tokens=args.max_new_tokens,
                                               precision=precision, **kw).sequences()[0]
      ar = [run(p) for p in prompts]
      for name, drafter in drafters.items():
        chain = {} if drafter.own_tree is not None else {"gamma": args.gamma}
        parted = [first_difference(a, run(p, drafter=drafter, **chain))
                  for p, a in zip(prompts, ar)]
        rows.append({"weights": weights, "precision": precision, "drafter": name,
                     "gamma": args.gamma, "prompts": len(prompts),
                     "identical": sum(d is None for d in parted),
                     "first_difference": [d for d in parted if d is not None]})
        print(rows[-1], flush=True)
      jax.clear_caches()
  save_script_record({"model": args.model, "dataset": args.dataset,
                      "max_new_tokens": args.max_new_tokens, "backend": jax.default_backend(),
                      "rows": rows}, args.json)


if __name__ == "__main__":
  main()
