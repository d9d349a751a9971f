"""Issue #4 probe: would n-gram lookup on the context lift the default drafter's greedy tau?

Offline and exact for greedy chains: the target's greedy response to each prompt is generated
once; at every response position each predictor (the trained drafter's argmax, an n-gram lookup
over prompt + response so far, or the hybrid "n-gram where a match exists, else the drafter")
either names the target's next token or not. A greedy chain of gamma drafts from position i is
accepted exactly as far as the run of correct predictions starting there (drafts conditioned on a
correct prefix see the true context), so tau = mean(run + 1) over rounds walked along the text.
No speed is measured: this only bounds what such a drafter could accept.

  python benchmarks/probe_ngram_hybrid.py --dataset mt-bench --num-prompts 20
"""

import argparse
import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jspec import data
from jspec.generate import generate
from jspec.drafting.registry import load_drafter
from jspec.model import load
from jspec.train.trainer import student_logits


def ngram_prediction(ctx: list[int], i: int, n_min: int, n_max: int) -> int | None:
  """The token after the most recent earlier occurrence of the longest suffix of ctx[:i]
  (length n_max down to n_min), or None."""
  for n in range(n_max, n_min - 1, -1):
    suffix = ctx[i - n:i]
    for j in range(i - n - 1, -1, -1):
      if ctx[j:j + n] == suffix:
        return ctx[j + n]
  return None


def chain_rounds(correct: list[bool], gamma: int) -> list[int]:
  """Tokens gained by each greedy round walked along one response (accepted drafts + 1)."""
  rounds, i = [], 0
  while i < len(correct):
    run = 0
    while run < gamma and i + run < len(correct) and correct[i + run]:
      run += 1
    rounds.append(run + 1)
    i += run + 1
  return rounds


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dataset", default="mt-bench")
  ap.add_argument("--num-prompts", type=int, default=20)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--n-min", type=int, default=2)
  ap.add_argument("--n-max", type=int, default=4)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()

  model = load("default")
  drafter = load_drafter("default", model)
  keep = np.asarray(drafter.keep_ids)
  prompts = [model.encode(t, chat=True) for t in data.load_prompts(args.dataset, args.num_prompts)]
  kinds = {"drafter": [], "ngram": [], "hybrid": []}
  found = positions = 0
  for prompt in prompts:
    out = generate(model.params, model.cfg, [prompt], max_new_tokens=args.max_new_tokens)
    response = out.sequences()[0][-args.max_new_tokens:]
    ctx = list(prompt) + list(response)
    logits = student_logits(drafter.params, drafter.cfg, jnp.asarray([ctx], jnp.int32))[0]
    drafted = keep[np.asarray(logits.argmax(-1))]  # [S] full-vocabulary ids
    rows = {k: [] for k in kinds}
    for i in range(len(prompt), len(ctx)):
      d_ok = bool(drafted[i - 1] == ctx[i])
      guess = ngram_prediction(ctx, i, args.n_min, args.n_max)
      n_ok = guess is not None and guess == ctx[i]
      found += guess is not None
      rows["drafter"].append(d_ok)
      rows["ngram"].append(n_ok)
      rows["hybrid"].append(n_ok if guess is not None else d_ok)
    positions += len(rows["drafter"])
    for k in kinds:
      kinds[k].append(rows[k])

  record = {"probe": "ngram_hybrid", "dataset": args.dataset, "temperature": 0.0,
            "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "n_min": args.n_min, "n_max": args.n_max, "positions": positions,
            "ngram_match_fraction": found / positions, "drafter": "default"}
  for k, per_prompt in kinds.items():
    flat = [c for r in per_prompt for c in r]
    record[f"alpha_{k}"] = float(np.mean(flat))
    for g in (1, 3, 5, 8):
      # Rounds do not cross prompts.
      rounds = [n for r in per_prompt for n in chain_rounds(r, g)]
      record[f"tau_{k}_g{g}"] = float(np.mean(rounds))
  record["timestamp"] = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  print(json.dumps(record, indent=1))
  if args.json:
    Path(args.json).write_text(json.dumps([record], indent=1) + "\n")


if __name__ == "__main__":
  main()
