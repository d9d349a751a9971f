"""The README's demo command end to end, stacked layers (the CPU default since session 37) against
unrolled (`--no-scan-layers`), each a fresh process with JAX's persistent compilation cache off,
the two alternating: wall seconds from launch to exit, and the load, compile and decode figures
the CLI reports, plus whether both print the same text.

  python benchmarks/demo_layers.py --runs 3 --json benchmarks/demo_layers_cpu.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from jspec.bench.profiling import save_script_record

DEMO = ["jspec", "generate", "--model", "default", "--drafter", "ngram", "--gamma", "3",
        "--prompt", "Write a Python function that returns the n-th Fibonacci number, with a "
        "docstring."]
LAYOUTS = {"stacked": "--scan-layers", "unrolled": "--no-scan-layers"}
REPORT = re.compile(r"load ([\d.]+)s, compile ([\d.]+)s .* tokens in ([\d.]+)s = ([\d.]+) tokens/s")


def once(flag: str) -> dict:
  env = dict(os.environ, JSPEC_COMPILATION_CACHE="off")
  start = time.perf_counter()
  done = subprocess.run(DEMO + [flag], capture_output=True, text=True, env=env, check=True)
  wall = time.perf_counter() - start
  found = REPORT.search(done.stderr)
  if found is None:
    raise RuntimeError(f"no figures in the CLI's report: {done.stderr[-500:]}")
  load_s, compile_s, decode_s, tok_s = map(float, found.groups())
  return {"wall_s": wall, "load_s": load_s, "compile_s": compile_s, "decode_s": decode_s,
          "tok_s": tok_s, "text": done.stdout}


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--runs", type=int, default=3)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  runs = {layout: [] for layout in LAYOUTS}
  for _ in range(args.runs):
    for layout, flag in LAYOUTS.items():
      runs[layout].append(once(flag))
      print(layout, {k: v for k, v in runs[layout][-1].items() if k != "text"}, flush=True)
  best = {layout: {k: min(r[k] for r in rows) for k in ("wall_s", "compile_s", "decode_s")}
          for layout, rows in runs.items()}
  texts = {r["text"] for rows in runs.values() for r in rows}
  for rows in runs.values():
    for r in rows:
      del r["text"]
  record = {"command_timed": " ".join(DEMO), "runs": runs, "best": best,
            "wall_speedup": best["unrolled"]["wall_s"] / best["stacked"]["wall_s"],
            "compile_speedup": best["unrolled"]["compile_s"] / best["stacked"]["compile_s"],
            "decode_ratio": best["unrolled"]["decode_s"] / best["stacked"]["decode_s"],
            "same_text": len(texts) == 1}
  save_script_record(record, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
