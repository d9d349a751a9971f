"""What reporting token log-probabilities costs, side by side in one process: for each decoding
method and sampling setting, tokens/s with `logprobs=None`, "model" and "sampled", whether the
tokens stay the same, and how far a speculative run's logprobs are from autoregressive decoding's
on the same tokens (greedy; the verification forward computes them, not one-token steps).

  python benchmarks/logprobs.py --methods none,ngram --json benchmarks/logprobs_cpu.json

One prompt at a time, each program compiled before timing; the three settings alternate prompt
by prompt, best of `--repeats` each.
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

KINDS = (None, "model", "sampled")
SAMPLINGS = {"greedy": SamplingParams(), "t1-topp0.9": SamplingParams(temperature=1.0, top_p=0.9)}


def timed(model, prompt, n, drafter, sampling, kind):
  start = time.perf_counter()
  out = jax.block_until_ready(model.generate_ids([prompt], max_new_tokens=n, drafter=drafter,
                                                 sampling=sampling, key=1, logprobs=kind))
  return time.perf_counter() - start, out


def main() -> None:
  ap = method_script_parser(__doc__)
  ap.add_argument("--samplings", default="greedy,t1-topp0.9")
  args = ap.parse_args()
  model = load(args.model, args.weights)
  prompts = [model.encode(t) for t in data.load_prompts(args.dataset, args.num_prompts)]
  n = args.max_new_tokens
  ar_logprobs = {}  # greedy autoregressive "model" logprobs per prompt, the speculative reference
  rows = []
  for method in args.methods.split(","):
    drafter = None if method == "none" else load_drafter(method, model, args.weights)
    for name in args.samplings.split(","):
      sampling = SAMPLINGS[name]
      for p in prompts:  # compile every bucket's programs
        for kind in KINDS:
          timed(model, p, n, drafter, sampling, kind)
      seconds = dict.fromkeys(KINDS, 0.0)
      tokens, identical, worst, compared = 0, True, 0.0, 0
      for i, p in enumerate(prompts):
        best = {}
        for _ in range(args.repeats):
          for kind in KINDS:
            s, out = timed(model, p, n, drafter, sampling, kind)
            if kind not in best or s < best[kind][0]:
              best[kind] = (s, out)
        seqs = [best[kind][1].sequences()[0] for kind in KINDS]
        identical &= all(seq == seqs[0] for seq in seqs)
        tokens += len(seqs[0])
        for kind in KINDS:
          seconds[kind] += best[kind][0]
        if name == "greedy":
          lps = np.asarray(best["model"][1].logprobs)[0, :len(seqs[0])]
          if method == "none":
            ar_logprobs[i] = (seqs[0], lps)
          elif i in ar_logprobs and ar_logprobs[i][0] == seqs[0]:
            worst = max(worst, float(np.abs(lps - ar_logprobs[i][1]).max()))
            compared += 1
      row = {"method": method, "sampling": name, "tokens": tokens, "identical_tokens": identical}
      for kind in KINDS:
        row[f"tokens_per_s_{kind or 'off'}"] = tokens / seconds[kind]
      for kind in KINDS[1:]:
        row[f"{kind}_over_off_speed"] = row[f"tokens_per_s_{kind}"] / row["tokens_per_s_off"]
      if name == "greedy" and method != "none":
        row["prompts_compared_with_autoregressive"] = compared  # same tokens as AR's
        row["max_abs_diff_vs_autoregressive_logprobs"] = worst if compared else None
      rows.append(row)
      print(row, flush=True)
  save_script_record({"model": model.source, "weights": args.weights, "dataset": args.dataset,
                      "prompts": len(prompts), "max_new_tokens": n, "rows": rows}, args.json)


if __name__ == "__main__":
  main()
