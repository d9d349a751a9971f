"""What a stacked layout adds to an autoregressive step: launches per decode-loop iteration of the
compiled AR program, stacked and unrolled, by opcode and by the JAX operation that made them
(`jspec.bench.launches.loop_launches`), and the weight-sized copies in each (none expected: jspec's
CPU kernels read a traced layer of the stacked weights in place).

  python benchmarks/scan_launches.py --model qwen2.5-coder-1.5b --weights int8 \
      --json benchmarks/scan_launches_qwen15_int8_cpu.json
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from jspec.bench.launches import loop_launches
from jspec.bench.profiling import save_script_record
from jspec.bench.programs import lower_decode
from jspec.model import load


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="float32")
  p.add_argument("--cache-size", type=int, default=256)
  p.add_argument("--json", required=True)
  args = p.parse_args()
  layouts = {}
  for layout in ("unrolled", "stacked"):
    model = load(args.model, args.weights, scan_layers=layout == "stacked")
    prompt, lengths = jnp.zeros((1, 32), jnp.int32), jnp.asarray([32], jnp.int32)
    lowered, _ = lower_decode(model.params, model.cfg, prompt, lengths, jax.random.key(0),
                              max_new_tokens=16, cache_size=args.cache_size)
    counts = loop_launches(lowered.compile().as_text(), top=30)
    layouts[layout] = {k: counts[k] for k in ("launches", "host_syncs", "by_op", "by_source")}
    print(layout, counts["launches"], counts["by_op"], flush=True)
  stacked, unrolled = layouts["stacked"]["by_op"], layouts["unrolled"]["by_op"]
  extra = {op: stacked.get(op, 0) - unrolled.get(op, 0) for op in sorted({*stacked, *unrolled})
           if stacked.get(op, 0) != unrolled.get(op, 0)}
  record = {"model": args.model, "weights": args.weights, "cache_size": args.cache_size,
            "num_layers": model.cfg.num_layers, "layouts": layouts,
            "stacked_minus_unrolled_by_op": extra,
            "extra_launches_per_layer": (layouts["stacked"]["launches"]
                                         - layouts["unrolled"]["launches"]) / model.cfg.num_layers}
  save_script_record(record, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
