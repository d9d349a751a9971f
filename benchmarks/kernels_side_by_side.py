"""One model in two weight formats (jspec's native CPU kernels vs XLA's dots), side by side in one
process: autoregressive decoding and, with --drafter, speculative decoding in each.

Each format decodes the same prompts greedily, timed in turn prompt by prompt after a compile run;
decode tok/s = (new tokens - 1) / (time - time to first token), the first token timed by a
1-token run.

  python benchmarks/kernels_side_by_side.py --model qwen2.5-coder-1.5b \\
      --json benchmarks/issue17_int8_kernels_side_by_side_cpu.json
  python benchmarks/kernels_side_by_side.py --model default --formats float32,float32-xla \\
      --num-prompts 6 --max-new-tokens 64 --drafter ngram@1 --gamma 3 \\
      --json benchmarks/issue20_f32_kernels_side_by_side_humaneval_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time

from jspec.bench.profiling import save_script_record
from jspec.data import load_prompts
from jspec.drafting.registry import load_drafter
from jspec.model import load


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--formats", default="int8,int8-xla", help="native format, then XLA's")
  p.add_argument("--dataset", default="humaneval")
  p.add_argument("--num-prompts", type=int, default=2)
  p.add_argument("--max-new-tokens", type=int, default=48)
  p.add_argument("--drafter", default=None, help="also decode speculatively with this drafter")
  p.add_argument("--gamma", type=int, default=3)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  formats = tuple(args.formats.split(","))
  models = {f: load(args.model, f) for f in formats}
  drafters = {f: load_drafter(args.drafter, models[f], f) for f in formats} if args.drafter else {}
  prompts = load_prompts(args.dataset, args.num_prompts)
  ids = [models[formats[0]].encode(t, chat=True) for t in prompts]
  methods = [(f, m) for f in formats for m in (("ar", "spec") if drafters else ("ar",))]
  outputs = {fm: [] for fm in methods}
  times = {fm: {"total": 0.0, "first": 0.0, "tokens": 0} for fm in methods}

  def run(fm, i, n):
    f, m = fm
    kw = dict(drafter=drafters[f], gamma=args.gamma) if m == "spec" else {}
    start = time.perf_counter()
    out = models[f].generate_ids([i], max_new_tokens=n, **kw).sequences()[0]
    return out, time.perf_counter() - start

  for fm in methods:  # compile every program (each prompt's bucket, 1 and all tokens) first
    for i in ids:
      run(fm, i, 1), run(fm, i, args.max_new_tokens)
  for i in ids:
    for fm in methods:
      _, first = run(fm, i, 1)
      out, total = run(fm, i, args.max_new_tokens)
      outputs[fm].append(out)
      times[fm]["total"] += total
      times[fm]["first"] += first
      times[fm]["tokens"] += len(out)
  native, xla = formats
  record = {"model": args.model, "dataset": args.dataset, "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens, "drafter": args.drafter, "gamma": args.gamma,
            # int8: the matmuls give the same bits and attention sums in another order; float32:
            # both sum in other orders. Texts may part at near-ties.
            "same_output": outputs[(native, "ar")] == outputs[(xla, "ar")]}
  for f, m in methods:
    t = times[(f, m)]
    record[f"{f}_{m}"] = {"tokens_per_s": t["tokens"] / t["total"],
                          "decode_tokens_per_s": (t["tokens"] - len(ids)) / (t["total"] - t["first"]),
                          "ttft_s": t["first"] / len(ids)}
    if m == "spec":
      record[f"{f}_spec"]["identical_to_ar"] = outputs[(f, "spec")] == outputs[(f, "ar")]
      record[f"{f}_spec"]["speedup_vs_ar"] = (record[f"{f}_spec"]["tokens_per_s"]
                                              / record[f"{f}_ar"]["tokens_per_s"])
  record["native_decode_speedup"] = (record[f"{native}_ar"]["decode_tokens_per_s"]
                                     / record[f"{xla}_ar"]["decode_tokens_per_s"])
  record["native_end_to_end_speedup"] = (record[f"{native}_ar"]["tokens_per_s"]
                                         / record[f"{xla}_ar"]["tokens_per_s"])
  save_script_record(record, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
