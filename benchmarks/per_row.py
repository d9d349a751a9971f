"""Requests with different sampling settings in one call (settings per row) against what a user
did before them, side by side in one process: each request a call of its own (batch 1), and, for
scale, a batch of the same size whose rows share one setting (all greedy; all sampled).

  python benchmarks/per_row.py --methods none,ngram --json benchmarks/per_row_cpu.json

Prompts go in groups of `--batch`, the i-th prompt of a group under SETTINGS[i % 4] (greedy,
greedy with a repetition penalty, top-p sampling, top-k sampling). Tokens/s count every row's
generated tokens over the wall time of the calls (stop tokens on; each program compiled before
timing; best of `--repeats`). Greedy rows of the per-row call are compared with their own batch-1
calls: the same tokens are expected on a CPU (jspec's kernels reduce each row alike whatever the
batch), not promised elsewhere (a GPU's matmuls may tile a batch of 4 differently from one row at
precision "fast"), so it is recorded, not asserted.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jspec import data
from jspec.bench.profiling import method_script_parser, save_script_record
from jspec.drafting.registry import load_drafter
from jspec.model import load
from jspec.sampling.processing import SamplingParams

SETTINGS = [dict(), dict(repetition_penalty=1.2), dict(temperature=0.7, top_p=0.9),
            dict(temperature=1.0, top_k=50)]
def main() -> None:
  ap = method_script_parser(__doc__, max_new_tokens=64)
  ap.add_argument("--batch", type=int, default=4)
  args = ap.parse_args()
  model = load(args.model, args.weights)
  prompts = [model.encode(t) for t in data.load_prompts(args.dataset, args.num_prompts)]
  B, n = args.batch, args.max_new_tokens
  if len(prompts) < B:
    ap.error(f"--num-prompts must be at least --batch ({B})")
  groups = [prompts[i:i + B] for i in range(0, len(prompts) - B + 1, B)]
  settings = [SETTINGS[i % len(SETTINGS)] for i in range(B)]
  rows = []
  for method in args.methods.split(","):
    drafter = None if method == "none" else load_drafter(method, model, args.weights)

    def call(group, sampling):
      return jax.block_until_ready(model.generate_ids(group, max_new_tokens=n, drafter=drafter,
                                                      sampling=sampling, key=1))

    ways = {  # name -> [(prompts, sampling)] a group's calls
        "per_row": lambda g: [(g, SamplingParams.of_rows(settings))],
        "one_call_each": lambda g: [([p], SamplingParams(**s)) for p, s in zip(g, settings)],
        "uniform_greedy": lambda g: [(g, SamplingParams())],
        "uniform_sampled": lambda g: [(g, SamplingParams(temperature=0.7, top_p=0.9))],
    }
    for way in ways.values():  # compile every bucket's programs
      for g in groups:
        for calls in way(g):
          call(*calls)
    record = {"method": method}
    outputs = {}
    for name, way in ways.items():
      seconds, tokens = 0.0, 0
      for gi, g in enumerate(groups):
        best = None
        for _ in range(args.repeats):
          start = time.perf_counter()
          outs = [call(*calls) for calls in way(g)]
          elapsed = time.perf_counter() - start
          if best is None or elapsed < best[0]:
            best = (elapsed, outs)
        seconds += best[0]
        tokens += sum(int(np.sum(o.lengths)) for o in best[1])
        outputs[name, gi] = best[1]
      record[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    for name in ("one_call_each", "uniform_greedy", "uniform_sampled"):
      record[f"per_row_over_{name}"] = (record["per_row"]["tokens_per_s"]
                                        / record[name]["tokens_per_s"])
    same = True
    for gi in range(len(groups)):
      together = outputs["per_row", gi][0].sequences()
      alone = [o.sequences()[0] for o in outputs["one_call_each", gi]]
      same &= all(together[i] == alone[i] for i, s in enumerate(settings)
                  if s.get("temperature", 0) == 0)
    record["greedy_rows_equal_batch1_calls"] = same
    rows.append(record)
    print(record, flush=True)
  save_script_record({"model": model.source, "weights": args.weights, "dataset": args.dataset,
                      "prompts": len(groups) * B, "batch": B, "max_new_tokens": n,
                      "settings": settings, "rows": rows}, args.json)


if __name__ == "__main__":
  main()
