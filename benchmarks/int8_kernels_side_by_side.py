"""int8 decoding through jspec's native kernels vs XLA's int8 dot, side by side in one process.

The same model loaded as `int8` (native) and `int8-xla`; each decodes the same HumanEval prompts
greedily, timed in turn prompt by prompt after a compile run; decode tok/s = (new tokens - 1) /
(time - time to first token), the first token timed by a 1-token run.

  python benchmarks/int8_kernels_side_by_side.py --model qwen2.5-coder-1.5b \
      --json benchmarks/issue17_int8_kernels_side_by_side_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time

from jspec.bench.profiling import save_script_record
from jspec.data import load_prompts
from jspec.model import load


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--num-prompts", type=int, default=2)
  p.add_argument("--max-new-tokens", type=int, default=48)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  formats = ("int8", "int8-xla")
  models = {f: load(args.model, f) for f in formats}
  prompts = load_prompts("humaneval", args.num_prompts)
  ids = [models["int8"].encode(t, chat=True) for t in prompts]
  outputs = {f: [] for f in formats}
  times = {f: {"total": 0.0, "first": 0.0, "tokens": 0} for f in formats}

  def run(f, i, n):
    start = time.perf_counter()
    out = models[f].generate_ids([i], max_new_tokens=n).sequences()[0]
    return out, time.perf_counter() - start

  for f in formats:  # compile every program (each prompt's bucket, 1 and all tokens) first
    for i in ids:
      run(f, i, 1), run(f, i, args.max_new_tokens)
  for i in ids:
    for f in formats:
      _, first = run(f, i, 1)
      out, total = run(f, i, args.max_new_tokens)
      outputs[f].append(out)
      times[f]["total"] += total
      times[f]["first"] += first
      times[f]["tokens"] += len(out)
  record = {"model": args.model, "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens,
            # The matmuls give the same bits; attention sums in another order, so texts may part.
            "same_output": outputs["int8"] == outputs["int8-xla"]}
  for f in formats:
    t = times[f]
    record[f] = {"tokens_per_s": t["tokens"] / t["total"],
                 "decode_tokens_per_s": (t["tokens"] - len(ids)) / (t["total"] - t["first"]),
                 "ttft_s": t["first"] / len(ids)}
  record["native_decode_speedup"] = (record["int8"]["decode_tokens_per_s"]
                                     / record["int8-xla"]["decode_tokens_per_s"])
  save_script_record(record, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
