"""Streaming against the whole run, side by side in one process: for each decoding method, the
seconds to the first token shown (streamed: the first segment; whole: the whole run, when the text
first appears), the run's tokens/s both ways, and whether the streamed tokens equal the whole run's.

  python benchmarks/streaming.py --methods none,ngram --every 1,4 \
      --json benchmarks/streaming_cpu.json

Greedy, one prompt at a time, each program compiled before timing; the two ways alternate prompt
by prompt, best of `--repeats` each.
"""

from __future__ import annotations

import time

import jax

from jspec import data
from jspec.bench.profiling import method_script_parser, save_script_record
from jspec.drafting.registry import load_drafter
from jspec.model import load


def whole(model, prompt, n, drafter) -> tuple[float, float, list[int]]:
  start = time.perf_counter()
  out = model.generate_ids([prompt], max_new_tokens=n, drafter=drafter)
  seq = out.sequences()[0]  # the host has the text here
  seconds = time.perf_counter() - start
  return seconds, seconds, seq


def streamed(model, prompt, n, drafter, every) -> tuple[float, float, list[int]]:
  start = time.perf_counter()
  first, seq = None, []
  for segment in model.stream_ids([prompt], max_new_tokens=n, drafter=drafter, every=every):
    first = time.perf_counter() - start if first is None else first
    seq += segment[0]
  return first, time.perf_counter() - start, seq


def main() -> None:
  ap = method_script_parser(__doc__)
  ap.add_argument("--every", default="1,4")
  args = ap.parse_args()
  model = load(args.model, args.weights)
  prompts = [model.encode(t) for t in data.load_prompts(args.dataset, args.num_prompts)]
  n = args.max_new_tokens
  rows = []
  for method in args.methods.split(","):
    drafter = None if method == "none" else load_drafter(method, model, args.weights)
    for every in (int(e) for e in args.every.split(",")):
      for p in prompts:  # compile every bucket's programs, both ways
        whole(model, p, n, drafter)
        streamed(model, p, n, drafter, every)
      totals = {"whole": [0.0, 0.0, 0], "streamed": [0.0, 0.0, 0]}
      identical = True
      for p in prompts:
        best = {}
        for _ in range(args.repeats):
          for way, run in (("whole", lambda: whole(model, p, n, drafter)),
                           ("streamed", lambda: streamed(model, p, n, drafter, every))):
            first, seconds, seq = run()
            if way not in best or seconds < best[way][1]:
              best[way] = (first, seconds, seq)
        identical &= best["whole"][2] == best["streamed"][2]
        for way, (first, seconds, seq) in best.items():
          totals[way][0] += first
          totals[way][1] += seconds
          totals[way][2] += len(seq)
      row = {"method": method, "every": every, "identical_tokens": identical}
      for way, (first, seconds, tokens) in totals.items():
        row[f"{way}_first_text_s"] = first / len(prompts)
        row[f"{way}_tokens_per_s"] = tokens / seconds
      row["streamed_over_whole_speed"] = row["streamed_tokens_per_s"] / row["whole_tokens_per_s"]
      rows.append(row)
      print(row, flush=True)
  jax.clear_caches()
  save_script_record({"model": model.source, "weights": args.weights, "dataset": args.dataset,
                      "prompts": len(prompts), "max_new_tokens": n, "rows": rows}, args.json)


if __name__ == "__main__":
  main()
