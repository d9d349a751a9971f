"""What SamplingParams' static mode saves: compile time and the conditionals left in a decode loop,
each program lowered twice side by side in one process, once with the static mode the settings
give (as `generate` and the CLI pass them) and once with `mode=None` (greedy and sampled decided
inside the loop, as every program was before session 35).

  python benchmarks/sampling_mode.py --scan-layers --weights float32-xla --drafters ngram,default \
      --json benchmarks/sampling_mode_cpu.json

No compilation cache: every compile is cold. Per program and setting: compile seconds (best of
`--tries`), run seconds (a prompt of zeros, `--max-new-tokens` tokens; best of `--runs`, the
two modes alternating), host syncs and launches per loop iteration (`jspec.bench.launches.loop_launches`), and
the sites of the conditionals left before optimization. Host syncs (conditionals and loops of
unknown trip count in the loop body) are counted along the largest branches (sampling with
filters, their fallback search) and along the smallest (what a greedy run of a mode=None program
executes).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jspec.bench.launches import control_flow_sites, loop_launches
from jspec.bench.profiling import save_script_record
from jspec.bench.programs import lower_decode
from jspec.drafting.registry import load_drafter
from jspec.model import load
from jspec.sampling.processing import SamplingParams


def compile_seconds(lower, tries: int) -> tuple[float, tuple, object]:
  """(best compile seconds, what `lower()` gave: (the lowered program, its call arguments), the
  compiled form); each try starts from cleared caches (JAX keeps compiled programs in memory
  otherwise)."""
  best, program, compiled = float("inf"), None, None
  for _ in range(tries):
    jax.clear_caches()
    program = lower()  # (lowered, call arguments)
    start = time.perf_counter()
    compiled = program[0].compile()
    best = min(best, time.perf_counter() - start)
  return best, program, compiled


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--weights", default="float32")
  p.add_argument("--scan-layers", action="store_true")
  p.add_argument("--drafters", default="ngram,default", help="chain drafters beside AR")
  p.add_argument("--settings", default="0,0.7,0.7/0.9",
                 help="temperature[/top_p] per setting, comma separated")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--cache-size", type=int, default=256)
  p.add_argument("--tries", type=int, default=2)
  p.add_argument("--runs", type=int, default=5,
                 help="runs of each compiled program, the two modes alternating; best kept")
  p.add_argument("--json", required=True)
  args = p.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  model = load(args.model, args.weights, scan_layers=args.scan_layers)
  prompt, lengths, key = jnp.zeros((1, 64), jnp.int32), jnp.asarray([10]), jax.random.key(0)
  N, S = args.max_new_tokens, args.cache_size
  rows = []
  for name in ["autoregressive"] + args.drafters.split(","):
    drafter = None if name == "autoregressive" else load_drafter(name, model, args.weights)
    for setting in args.settings.split(","):
      t, _, top_p = setting.partition("/")
      row = {"program": name, "temperature": float(t), "top_p": float(top_p or 1.0)}
      runs = {}
      for label, mode in (("static", "auto"), ("dynamic", None)):
        sp = jax.tree.map(jnp.asarray, SamplingParams(row["temperature"], top_p=row["top_p"],
                                                      mode=mode))

        def lower():
          return lower_decode(model.params, model.cfg, prompt, lengths, key, sp,
                              drafter=drafter, max_new_tokens=N, cache_size=S)

        seconds, (lowered, call_args), compiled = compile_seconds(lower, args.tries)
        runs[label] = (compiled, call_args)
        launches = loop_launches(compiled.as_text())
        row[label] = {"mode": repr(sp.mode), "compile_s": seconds,
                      "host_syncs": launches["host_syncs"],
                      "host_syncs_smallest": launches["host_syncs_smallest"],
                      "launches": launches["launches"],
                      "conditionals": control_flow_sites(
                          lowered.compiler_ir("stablehlo"))["conditional"]}
      row["compile_dynamic_over_static"] = row["dynamic"]["compile_s"] / row["static"]["compile_s"]
      best = {label: float("inf") for label in runs}
      for label, (compiled, call_args) in runs.items():
        jax.block_until_ready(compiled(*call_args))  # warm
      for _ in range(args.runs):
        for label, (compiled, call_args) in runs.items():
          start = time.perf_counter()
          jax.block_until_ready(compiled(*call_args))
          best[label] = min(best[label], time.perf_counter() - start)
      for label in runs:
        row[label]["run_s"] = best[label]
      row["run_dynamic_over_static"] = best["dynamic"] / best["static"]
      print({k: (v if not isinstance(v, dict) else {
          x: v[x] for x in ("compile_s", "run_s", "host_syncs", "host_syncs_smallest")})
             for k, v in row.items()}, flush=True)
      rows.append(row)
  save_script_record({"model": args.model, "weights": args.weights,
                      "scan_layers": args.scan_layers, "max_new_tokens": N, "cache_size": S,
                      "rows": rows}, args.json)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
