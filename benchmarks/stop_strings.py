"""What stop strings save, side by side in one process: for each decoding method, the whole run to
the token budget (one program; the text cut at the first stop string afterwards) against the
streamed run with `stop_strings=` (rows halted once their text holds one): seconds, tokens
generated, and whether the two texts are the same.

  python benchmarks/stop_strings.py --methods none,ngram --stop '\\n\\n' \\
      --json benchmarks/stop_strings_cpu.json

Greedy, one prompt at a time, each program compiled before timing; the two ways alternate prompt
by prompt, best of `--repeats` each.
"""

from __future__ import annotations

import time

from jspec import data
from jspec.bench.profiling import method_script_parser, save_script_record
from jspec.drafting.registry import load_drafter
from jspec.model import STOP_EVERY, load


def cut(text: str, stop: list[str]) -> str:
  hits = [i for i in (text.find(s) for s in stop) if i >= 0]
  return text[:min(hits)] if hits else text


def main() -> None:
  ap = method_script_parser(__doc__, max_new_tokens=256)
  ap.add_argument("--stop", action="append", default=None,
                  help="stop text (escapes \\n and \\t read as such); default: a blank line")
  args = ap.parse_args()
  stop = [s.replace("\\n", "\n").replace("\\t", "\t") for s in (args.stop or ["\\n\\n"])]
  model = load(args.model, args.weights)
  texts = data.load_prompts(args.dataset, args.num_prompts)
  n = args.max_new_tokens
  rows = []
  for method in args.methods.split(","):
    drafter = None if method == "none" else load_drafter(method, model, args.weights)
    kw = dict(max_new_tokens=n, drafter=drafter)

    def to_budget(text):  # without stop_strings=: the whole run, then cut the text
      start = time.perf_counter()
      out = model.generate_ids([model.encode(text)], **kw)
      answer = model.tokenizer.decode(out.sequences()[0])
      return time.perf_counter() - start, cut(answer, stop), int(out.lengths[0])

    def stopped(text):
      start = time.perf_counter()
      stream = model.stream_text(text, every=STOP_EVERY, stop_strings=stop, **kw)
      answer = "".join(stream)
      return time.perf_counter() - start, answer, int(stream.output.lengths[0])

    for text in texts:  # compile every bucket's programs
      to_budget(text)
      stopped(text)
    totals = {"to_budget": [0.0, 0], "stopped": [0.0, 0]}
    same, stopped_early = True, 0
    for text in texts:
      best = {}
      for _ in range(args.repeats):
        for way, run in (("to_budget", to_budget), ("stopped", stopped)):
          result = run(text)
          if way not in best or result[0] < best[way][0]:
            best[way] = result
      same &= best["to_budget"][1] == best["stopped"][1]
      stopped_early += best["stopped"][2] < best["to_budget"][2]
      for way, (seconds, _, tokens) in best.items():
        totals[way][0] += seconds
        totals[way][1] += tokens
    row = {"method": method, "same_text": same, "prompts_stopped_early": stopped_early}
    for way, (seconds, tokens) in totals.items():
      row[f"{way}_s"] = seconds
      row[f"{way}_tokens"] = tokens
    row["time_saved_fraction"] = 1 - row["stopped_s"] / row["to_budget_s"]
    rows.append(row)
    print(row, flush=True)
  save_script_record({"model": model.source, "weights": args.weights, "dataset": args.dataset,
                      "prompts": len(texts), "max_new_tokens": n, "stop": stop, "rows": rows},
                     args.json)


if __name__ == "__main__":
  main()
