"""What repetition / presence / frequency penalties cost and change, side by side in one process:
for each decoding method and penalty setting, tokens/s against the same method without
penalties, block efficiency (tau) of speculative methods, whether speculative output equals
autoregressive output under the same penalties (greedy), and how repetitive the text is (the
share of repeated 4-grams in each answer).

  python benchmarks/penalties.py --methods none,ngram,default --json benchmarks/penalties_cpu.json

`--tree SHAPE` drafts token trees of that shape (a tree string, e.g. fixed:3-2-1) instead of
chains.

One prompt at a time, each program compiled before timing; the settings alternate prompt by
prompt, best of `--repeats` each.
"""

from __future__ import annotations

import time

import jax

from jspec import data
from jspec.bench.profiling import method_script_parser, save_script_record
from jspec.drafting.registry import load_drafter
from jspec.model import load
from jspec.sampling.processing import SamplingParams

SETTINGS = {
    "off": SamplingParams(),
    "repetition1.2": SamplingParams(repetition_penalty=1.2),
    "presence0.5-frequency0.5": SamplingParams(presence_penalty=0.5, frequency_penalty=0.5),
}


def timed(model, prompt, n, drafter, sampling, tree=None):
  start = time.perf_counter()
  out = jax.block_until_ready(model.generate_ids([prompt], max_new_tokens=n, drafter=drafter,
                                                 sampling=sampling, key=1,
                                                 tree=None if drafter is None else tree))
  return time.perf_counter() - start, out


def repeated_4grams(tokens: list[int]) -> tuple[int, int]:
  """(4-grams that occurred earlier in the answer, 4-grams in it)."""
  grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
  seen, repeats = set(), 0
  for g in grams:
    repeats += g in seen
    seen.add(g)
  return repeats, len(grams)


def main() -> None:
  ap = method_script_parser(__doc__)
  ap.add_argument("--settings", default=",".join(SETTINGS))
  ap.add_argument("--draft-penalties", action="store_true",
                  help="also run each speculative method with its drafter proposing under the "
                       "penalties (Drafter.with_draft_penalties), as method+dp")
  ap.add_argument("--tree", default=None, help="draft trees of this shape (e.g. fixed:3-2-1) "
                                               "instead of chains")
  args = ap.parse_args()
  if args.methods.split(",")[0] != "none":
    ap.error("--methods must start with none: speculative runs are compared with its tokens")
  model = load(args.model, args.weights)
  prompts = [model.encode(t) for t in data.load_prompts(args.dataset, args.num_prompts)]
  n = args.max_new_tokens
  names = args.settings.split(",")
  autoregressive = {}  # (setting, prompt index) -> greedy autoregressive tokens
  rows = []
  runs = []  # (row name, drafter)
  for method in args.methods.split(","):
    drafter = None if method == "none" else load_drafter(method, model, args.weights)
    runs.append((method, drafter))
    if drafter is not None and args.draft_penalties:
      try:
        runs.append((method + "+dp", drafter.with_draft_penalties()))
      except ValueError:  # a lookup alone, lookahead: nothing drawn from logits to penalize
        pass
  for method, drafter in runs:
    for p in prompts:  # compile every bucket's programs
      for name in names:
        timed(model, p, n, drafter, SETTINGS[name], args.tree)
    seconds, tokens, identical = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {}
    repeats, grams, rounds = dict.fromkeys(names, 0), dict.fromkeys(names, 0), {}
    for i, p in enumerate(prompts):
      best = {}
      for _ in range(args.repeats):
        for name in names:
          s, out = timed(model, p, n, drafter, SETTINGS[name], args.tree)
          if name not in best or s < best[name][0]:
            best[name] = (s, out)
      for name in names:
        s, out = best[name]
        seq = out.sequences()[0]
        seconds[name] += s
        tokens[name] += len(seq)
        r, g = repeated_4grams(seq)
        repeats[name] += r
        grams[name] += g
        if method == "none":
          autoregressive[name, i] = seq
        else:
          identical[name] = identical.get(name, True) and seq == autoregressive.get((name, i))
          verified, emitted = rounds.get(name, (0, 0))
          rounds[name] = (verified + int(out.row_rounds), emitted + int(out.round_tokens))
    for name in names:
      row = {"method": method, "setting": name, "tokens": tokens[name],
             "tokens_per_s": tokens[name] / seconds[name],
             "over_unpenalized_speed": (tokens[name] / seconds[name])
                                       / (tokens["off"] / seconds["off"]) if "off" in names
             else None,
             "repeated_4gram_share": repeats[name] / max(grams[name], 1)}
      if method != "none":
        verified, emitted = rounds[name]
        row.update(tau=emitted / max(verified, 1), identical_to_autoregressive=identical[name])
      rows.append(row)
      print(row, flush=True)
  save_script_record({"model": model.source, "weights": args.weights, "dataset": args.dataset,
                      "tree": args.tree,
                      "prompts": len(prompts), "max_new_tokens": n,
                      "settings": {k: {f: float(getattr(v, f)) for f in (
                          "repetition_penalty", "presence_penalty", "frequency_penalty")}
                                   for k, v in SETTINGS.items() if k in names},
                      "rows": rows}, args.json)


if __name__ == "__main__":
  main()
