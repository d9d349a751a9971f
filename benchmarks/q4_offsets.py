"""4-bit weights with and without a float16 offset per group of 32 (`quant.quantize_q4`), side by
side with int8 and float32 on the same model in one process: perplexity on a text and greedy
decode speed, the formats interleaved prompt by prompt (`jspec.bench.speed.bench_interleaved`).

The default model's GGUF is Q4_1 (a scale and an offset per 32 weights), so q4 with offsets
reads the file's own blocks exactly; the symmetric form re-rounds them (15 levels, no offset).

  python benchmarks/q4_offsets.py --json benchmarks/q4_offsets_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from jspec.bench.profiling import machine_info
from jspec.bench.speed import Method, bench_interleaved
from jspec.cli.records import dataset_prompts
from jspec.model import load
from jspec.models.llama import native_float_params, quantize_params
from jspec.sampling.processing import GREEDY
from jspec.score import score


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--json", required=True)
  p.add_argument("--model", default="default")
  p.add_argument("--text", default="ARCHITECTURE.md", help="the text scored for perplexity")
  p.add_argument("--num-prompts", type=int, default=4)
  p.add_argument("--max-new-tokens", type=int, default=64)
  args = p.parse_args()
  base = load(args.model, "float32-xla", scan_layers=False)
  formats = {
      "float32": native_float_params(base.params),
      "int8": quantize_params(base.params, "native"),
      "q4": quantize_params(base.params, "native", bits=4),
      "q4_symmetric": quantize_params(base.params, "native", bits=4, q4_offsets=False)}
  models = {name: dataclasses.replace(base, params=params) for name, params in formats.items()}
  text = base.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"),
                               add_special_tokens=False)
  perplexity = {name: float(score(m.params, m.cfg, [text]).perplexity()[0])
                for name, m in models.items()}
  prompts = dataset_prompts(base, "mt-bench", args.num_prompts)
  runs = bench_interleaved([Method(m, args.max_new_tokens, GREEDY, 0) for m in models.values()],
                           prompts)
  records = []
  for (name, m), (run, _) in zip(models.items(), runs):
    summary = run.summary()
    records.append({"weights": name, "perplexity": perplexity[name], "text": args.text,
                    "text_tokens": len(text), **summary})
  q4_rate = next(r["decode_tokens_per_s"] for r in records if r["weights"] == "q4")
  for r in records:
    r["decode_speed_vs_q4"] = r["decode_tokens_per_s"] / q4_rate
    print(f"{r['weights']:<13} perplexity {r['perplexity']:8.2f}  decode "
          f"{r['decode_tokens_per_s']:6.1f} tok/s ({r['decode_speed_vs_q4']:.2f}x q4)")
  Path(args.json).write_text(json.dumps(
      {"model": args.model, "dataset": "mt-bench", "max_new_tokens": args.max_new_tokens,
       "results": records, "machine": machine_info(),
       "command": " ".join(["python"] + sys.argv)}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
