"""A process's first `jspec.model.load` of a weight format: what a Python-API user pays before
the first token (the CLI's persistent compilation cache is off here, as it is for the API by
default). One load per process, so no earlier load has compiled anything for it.

  python benchmarks/ab_revisions.py --old a2e80ea --rounds 3 --script-from new \
      --json benchmarks/first_load_int8_cpu.json -- benchmarks/first_load.py --weights int8
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["JSPEC_COMPILATION_CACHE"] = "off"

import jax  # noqa: E402

from jspec.bench.profiling import save_script_record  # noqa: E402
from jspec.model import load  # noqa: E402


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="int8")
  p.add_argument("--json", required=True)
  args = p.parse_args()
  start = time.perf_counter()
  model = load(args.model, args.weights)
  jax.block_until_ready(jax.tree.leaves(model.params))
  save_script_record({"model": args.model, "weights": args.weights,
                      "first_load_s": time.perf_counter() - start}, args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
