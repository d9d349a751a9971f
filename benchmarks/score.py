"""Scoring text side by side in one process: jspec's `score` (read `--chunk` tokens at a time)
against HF transformers' forward over the whole text, on long real conversations (ShareGPT):
tokens/s each way and how far their per-token log-probabilities are apart; then the perplexity of
the same texts under KV budgets of `--budget-fraction` of their length (jspec.kv policies, the
text read as chunked prefill reads a prompt) against the full cache.

  python benchmarks/score.py --json benchmarks/score_cpu.json

Each program compiled (and each transformers forward run once) before timing; best of `--repeats`.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jspec.bench.profiling import save_script_record
from jspec.bench.speed import _load_transformers
from jspec.data import sharegpt_conversations
from jspec.kv.policy import KVPolicy
from jspec.model import load


def best(fn, repeats: int):
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return min(times), out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="default")
  ap.add_argument("--num-texts", type=int, default=4)
  ap.add_argument("--tokens", type=int, default=2048, help="tokens scored per text")
  ap.add_argument("--chunk", type=int, default=128)
  ap.add_argument("--methods", default="keydiff,streaming,h2o,snapkv,h2o+caote")
  ap.add_argument("--budget-fraction", type=float, default=0.25)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--json", required=True)
  args = ap.parse_args()
  import torch

  model = load(args.model, "float32")
  hf = _load_transformers(model.source)
  rows = []
  for text in sharegpt_conversations():
    ids = model.encode(text, chat=False)
    if len(ids) >= args.tokens:
      rows.append(ids[:args.tokens])
    if len(rows) == args.num_texts:
      break

  def hf_scores(row):
    with torch.no_grad():
      logits = hf(torch.tensor([row])).logits[0].float()
      lps = torch.log_softmax(logits, -1)[torch.arange(len(row) - 1), torch.tensor(row[1:])]
    return np.concatenate([[0.0], lps.numpy()])

  records = []
  jspec_s = hf_s = 0.0
  worst = mean = 0.0
  full_ppl = []
  for row in rows:
    s, out = best(lambda: jax.block_until_ready(model.score_ids([row], chunk=args.chunk)),
                  args.repeats)
    jspec_s += s
    ours = np.asarray(out.logprobs)[0, :len(row)]
    full_ppl.append(float(out.perplexity()[0]))
    s, theirs = best(lambda: hf_scores(row), args.repeats)
    hf_s += s
    worst = max(worst, float(np.abs(ours - theirs).max()))
    mean += float(np.abs(ours - theirs).mean()) / len(rows)
  n = sum(len(r) for r in rows)
  records.append({"what": "full cache", "texts": len(rows), "tokens_per_text": args.tokens,
                  "chunk": args.chunk, "jspec_tokens_per_s": n / jspec_s,
                  "transformers_tokens_per_s": n / hf_s, "jspec_over_transformers": hf_s / jspec_s,
                  "max_abs_logprob_diff": worst, "mean_abs_logprob_diff": mean,
                  "perplexity": full_ppl})
  print(records[-1], flush=True)
  budget = int(args.tokens * args.budget_fraction)
  for method in args.methods.split(","):
    policy = KVPolicy(method, budget=budget, chunk=min(args.chunk, budget))
    ppl = [float(model.score_ids([row], kv=policy).perplexity()[0]) for row in rows]
    records.append({"what": f"{method} at {budget} of {args.tokens}", "method": method,
                    "budget": budget, "perplexity": ppl,
                    "perplexity_over_full": [p / f for p, f in zip(ppl, full_ppl)]})
    print(records[-1], flush=True)
  save_script_record({"model": model.source, "records": records}, args.json)


if __name__ == "__main__":
  main()
