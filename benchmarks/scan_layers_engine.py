"""Unrolled vs stacked layers (`--scan-layers`) through the whole engine, side by side in one
process: for each layout and decoding method, the seconds spent compiling its programs, decode
speed, tau, and whether its tokens equal the same layout's autoregressive ones (and the unrolled
layout's, method for method).

  python benchmarks/scan_layers_engine.py --weights float32-xla \
      --methods none,ngram,mtp:3,skip:10 --json benchmarks/scan_layers_engine_cpu.json

JAX's persistent compilation cache is off, so every program is built here.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from jspec import data
from jspec.bench.profiling import CompileCounter, save_script_record
from jspec.drafting.registry import load_drafter
from jspec.model import load


def run(model, drafter, prompts, n, gamma):
  outs, seconds = [], 0.0
  for p in prompts:
    start = time.perf_counter()
    out = model.generate_ids([p], max_new_tokens=n, drafter=drafter, gamma=gamma)
    jax.block_until_ready(out.tokens)
    seconds += time.perf_counter() - start
    outs.append(out)
  return outs, seconds


def measure(model, weights: str, method: str, prompts, n: int, gamma: int) -> dict:
  drafter = None if method == "none" else load_drafter(method, model, weights)
  with CompileCounter() as counter:  # every prompt's buckets: their programs are built here
    run(model, drafter, prompts, n, gamma)
  with CompileCounter() as timed:  # nothing compiles here (until session 36 the other buckets did)
    outs, seconds = run(model, drafter, prompts, n, gamma)
  new = sum(len(o.sequences()[0]) for o in outs)
  record = {"method": method, "compile_s": counter.seconds, "programs_built": counter.built,
            "programs_built_while_timed": timed.built,
            "tok_s": new / seconds, "tokens": [o.sequences()[0] for o in outs]}
  if drafter is not None:
    record["tau"] = sum(o.block_efficiency for o in outs) / len(outs)
  return record


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="float32-xla")
  p.add_argument("--methods", default="none,ngram,mtp:3,skip:10")
  p.add_argument("--dataset", default="mt-bench")
  p.add_argument("--num-prompts", type=int, default=3)
  p.add_argument("--max-new-tokens", type=int, default=48)
  p.add_argument("--gamma", type=int, default=3)
  p.add_argument("--order", default="unrolled,stacked",
                 help="the layouts in the order they run (run both orders to see any warm-up "
                      "bias); 'default' adds jspec's default format (--weights float32: on CPU "
                      "its native kernel) unrolled, the CPU default until session 37 (stacked since)")
  p.add_argument("--json", required=True)
  args = p.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  record = {"model": args.model, "weights": args.weights, "dataset": args.dataset,
            "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
            "gamma": args.gamma, "order": args.order,
            "layouts": {}}
  for layout in args.order.split(","):
    weights = "float32" if layout == "default" else args.weights
    model = load(args.model, weights, scan_layers=layout == "stacked")
    chat = data.is_chat(args.dataset) and model.tokenizer.chat_template is not None
    prompts = [model.encode(t, chat=chat) for t in data.load_prompts(args.dataset,
                                                                     args.num_prompts)]
    rows = []
    for method in args.methods.split(","):
      rows.append(measure(model, weights, method, prompts, args.max_new_tokens, args.gamma))
      print(layout, {k: v for k, v in rows[-1].items() if k != "tokens"}, flush=True)
    record["layouts"][layout] = rows
  ar = {layout: rows[0]["tokens"] for layout, rows in record["layouts"].items()}
  summary = []
  default = record["layouts"].get("default") or [{}] * len(record["layouts"]["stacked"])
  for u, s, d in zip(record["layouts"]["unrolled"], record["layouts"]["stacked"], default):
    summary.append({
        "method": u["method"], "compile_s_unrolled": u["compile_s"],
        "compile_s_stacked": s["compile_s"], "compile_speedup": u["compile_s"] / s["compile_s"],
        "tok_s_unrolled": u["tok_s"], "tok_s_stacked": s["tok_s"],
        "stacked_speed_ratio": s["tok_s"] / u["tok_s"],
        "tau_unrolled": u.get("tau"), "tau_stacked": s.get("tau"),
        "identical_to_ar_unrolled": u["tokens"] == ar["unrolled"],
        "identical_to_ar_stacked": s["tokens"] == ar["stacked"],
        "stacked_equals_unrolled": s["tokens"] == u["tokens"]})
    if d:
      summary[-1].update(tok_s_default=d["tok_s"], stacked_vs_default=s["tok_s"] / d["tok_s"],
                         compile_s_default=d["compile_s"],
                         identical_to_ar_default=d["tokens"] == ar["default"])
    print(summary[-1], flush=True)
  record["summary"] = summary
  for rows in record["layouts"].values():
    for row in rows:
      del row["tokens"]
  save_script_record(record, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
