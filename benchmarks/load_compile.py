"""Load and compile times of a model, side by side with transformers' GGUF loading.

- jspec load: `jspec.model.load` (GGUF parse, on-device dequantization, tokenizer), best of 2;
- transformers load: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (float32), once;
- compile cold / warm: `jspec generate` run twice in fresh processes sharing a new persistent
  compilation cache directory (the CLI's default behaviour), as the CLI reports them.

  python benchmarks/load_compile.py --model qwen2.5-coder-1.5b --weights float32 \
      --json benchmarks/issue17_load_compile_cpu.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from jspec.bench.profiling import save_script_record
from jspec.io.load import resolve_path
from jspec.model import load


def cli_run(model: str, weights: str, drafter: str, cache: str) -> dict:
  cmd = [sys.executable, "-m", "jspec.cli", "generate", "--model", model, "--weights", weights,
         "--prompt", "Write a function that reverses a string.", "--chat", "--max-new-tokens",
         "32", "--drafter", drafter, "--gamma", "3"]
  start = time.perf_counter()
  run = subprocess.run(cmd, env=dict(os.environ, JSPEC_COMPILATION_CACHE=cache),
                       capture_output=True, text=True, check=True)
  total = time.perf_counter() - start
  m = re.search(r"load ([\d.]+)s, compile ([\d.]+)s \((\d+) XLA programs built, (\d+) loaded", run.stderr)
  return {"process_s": total, "load_s": float(m.group(1)), "compile_s": float(m.group(2)),
          "programs_built": int(m.group(3)), "programs_loaded_from_cache": int(m.group(4))}


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--weights", default="float32")
  p.add_argument("--drafter", default="none")
  p.add_argument("--no-transformers", action="store_true")
  p.add_argument("--json", required=True)
  args = p.parse_args()
  record = {"model": args.model, "weights": args.weights, "drafter": args.drafter}
  times = []
  for _ in range(2):
    start = time.perf_counter()
    model = load(args.model, args.weights)
    times.append(time.perf_counter() - start)
    del model
  record["jspec_load_s"] = min(times)
  if not args.no_transformers:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    path = resolve_path(args.model)
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                         dtype=torch.float32)
    record["transformers_load_s"] = time.perf_counter() - start
    record["load_speedup_vs_transformers"] = record["transformers_load_s"] / record["jspec_load_s"]
  with tempfile.TemporaryDirectory() as cache:
    record["cold"] = cli_run(args.model, args.weights, args.drafter, cache)
    record["warm"] = cli_run(args.model, args.weights, args.drafter, cache)
  save_script_record(record, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
