"""Issue #18 part 4: is one-token decode bound by bytes or by kernel launches on this accelerator,
and what cuts the launches? Measured side by side in one run, each variant in its own process
(XLA flags are per process):

- layouts: the unrolled layer loop jspec runs vs `lax.scan` over stacked layers
  (benchmarks/scan_layers.py's two programs);
- XLA GPU command buffers (CUDA graphs): XLA's default set, none, and the default set plus WHILE
  and CONDITIONAL (the whole decode loop captured as one graph).

Per variant: seconds per decode step (the difference of two runs of the same compiled program,
`--short` and `--long` steps, so prefill/launch of the program cancels), the launches per step
(kernels, library calls and graph launches in the compiled loop body, read off the optimized HLO),
and the fraction of the measured memory bandwidth the step's bytes (weights + the KV cache it
reads) reach. Models are random weights of real shapes: step time does not depend on the values.

  python benchmarks/launch_bound.py --shapes smollm2-135m:float32,llama3-8b:bfloat16 \
      --json benchmarks/accel_gpu_launch_bound.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from jspec.bench.launches import FREE_OPS, computations, opcode

SHAPES = {  # name: Config fields (random weights; the published models' shapes)
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         rope_theta=100000.0, tie_embeddings=True),
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                         head_dim=64, rope_theta=1000000.0, tie_embeddings=True, qkv_bias=True),
    "qwen2.5-1.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                         head_dim=128, rope_theta=1000000.0, tie_embeddings=True, qkv_bias=True),
    "llama3-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      rope_theta=500000.0),
}
_DEFAULT_CMDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
VARIANTS = {  # name: XLA_FLAGS added for the child process
    "xla-default": "",
    "no-command-buffers": "--xla_gpu_enable_command_buffer=",
    "command-buffers+while": f"--xla_gpu_enable_command_buffer={_DEFAULT_CMDS},WHILE,CONDITIONAL",
}
# Datasheet HBM bandwidth (GB/s): the measured copy rate of `memory_bandwidth` undershoots on GPUs
# (an H100 decode streams 2.6 TB/s of weights, its 512 MB copy 2.05), so both fractions are kept.
SPEC_GBPS = {"NVIDIA H100 80GB HBM3": 3350, "NVIDIA H200": 4800}


def launches_per_step(hlo_text: str) -> dict:
  """Instructions that launch device work in the decode loop's body (a nested loop counts once,
  its body not expanded: jspec.bench.launches expands it), from the optimized HLO; `by_op` splits
  them by opcode."""
  comps, _ = computations(hlo_text)
  bodies = [m.group(1) for lines in comps.values() for line in lines
            for m in [re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)] if m]
  if not bodies:
    return {"launches": None, "by_op": {}}
  by_op: dict[str, int] = {}
  for line in comps.get(bodies[-1], []):  # the outermost loop is the last one printed
    op = opcode(line)
    if op not in FREE_OPS:
      by_op[op] = by_op.get(op, 0) + 1
  return {"launches": sum(by_op.values()), "by_op": by_op}


def child(shape: str, dtype: str, layout: str, args) -> dict:
  import jax
  import jax.numpy as jnp

  sys.path.insert(0, str(Path(__file__).parent))
  from scan_layers import decode_program, stacked  # noqa: E402

  from jspec.models import llama
  from jspec.models.cache import KVCache
  from jspec.models.config import Config

  jax.config.update("jax_enable_compilation_cache", False)
  cfg = Config(**SHAPES[shape])
  dt = jnp.dtype(dtype)
  params = llama.init_params(cfg, jax.random.key(0), dt)
  if layout == "scan":
    params = stacked(params)
  cache = KVCache.init(cfg, 1, args.cache_size, dt).with_lengths(
      jnp.asarray([args.context], jnp.int32))
  run = jax.jit(decode_program(cfg, 0, layout == "scan"))
  start = time.perf_counter()
  compiled = run.lower(params, cache, jnp.int32(args.short)).compile()
  compile_s = time.perf_counter() - start

  def best(n: int) -> float:
    steps = jnp.int32(n)
    jax.block_until_ready(compiled(params, cache, steps))
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(compiled(params, cache, steps))
      times.append(time.perf_counter() - start)
    return min(times)

  short_s, long_s = best(args.short), best(args.long)
  step_s = (long_s - short_s) / (args.long - args.short)
  weight_bytes = llama.step_weight_bytes(params, cfg.vocab_size)  # an untied embedding: a row
  kv_bytes = cache.k.nbytes + cache.v.nbytes  # the masked attention reads every slot
  return {"shape": shape, "dtype": dtype, "layout": layout, "compile_s": compile_s,
          "step_ms": step_s * 1e3, "tok_s": 1 / step_s, "program_short_s": short_s,
          "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
          "bytes_per_step_gb": (weight_bytes + kv_bytes) / 1e9,
          "device": jax.devices()[0].device_kind, **launches_per_step(compiled.as_text())}


def bandwidth_child() -> dict:
  import jax

  from jspec.bench.profiling import memory_bandwidth
  return {"device": jax.devices()[0].device_kind, **memory_bandwidth()}


def spawn(argv: list[str], xla_flags: str, timeout: int) -> dict:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), xla_flags) if f)
  try:
    done = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout} s"}
  lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
  if done.returncode or not lines:
    return {"error": (done.stderr or done.stdout).strip()[-1500:]}
  return json.loads(lines[-1])


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default="smollm2-135m:float32,llama3-8b:bfloat16",
                 help=f"SHAPE:DTYPE,... of {sorted(SHAPES)}")
  p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}")
  p.add_argument("--layouts", default="unrolled,scan")
  p.add_argument("--context", type=int, default=512, help="tokens already in the cache")
  p.add_argument("--cache-size", type=int, default=1024)
  p.add_argument("--short", type=int, default=16)
  p.add_argument("--long", type=int, default=144)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--timeout", type=int, default=300, help="seconds per variant")
  p.add_argument("--json")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child == "bandwidth":
    print(json.dumps(bandwidth_child()))
    return 0
  if args.child:
    print(json.dumps(child(*args.child.split(":"), args)))
    return 0
  unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
  if unknown:
    p.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
  common = ["--context", str(args.context), "--cache-size", str(args.cache_size),
            "--short", str(args.short), "--long", str(args.long), "--repeats", str(args.repeats)]
  bandwidth = spawn(["--child", "bandwidth"], "", args.timeout)
  print("bandwidth", bandwidth, flush=True)
  gbps = bandwidth.get("bandwidth_gbps")
  runs = []
  for spec in args.shapes.split(","):
    shape, dtype = spec.split(":")
    if shape not in SHAPES:
      p.error(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    for layout in args.layouts.split(","):
      for variant in args.variants.split(","):
        record = spawn(["--child", f"{shape}:{dtype}:{layout}", *common], VARIANTS[variant],
                       args.timeout)
        record.update(shape=shape, dtype=dtype, layout=layout, variant=variant,
                      xla_flags=VARIANTS[variant])
        if gbps and "step_ms" in record:
          record["bandwidth_fraction"] = (record["bytes_per_step_gb"] /
                                          (record["step_ms"] / 1e3) / gbps)
          spec = SPEC_GBPS.get(record.get("device", ""))
          if spec:
            record["spec_bandwidth_fraction"] = (record["bytes_per_step_gb"] /
                                                 (record["step_ms"] / 1e3) / spec)
          if record.get("launches"):
            record["us_per_launch"] = record["step_ms"] * 1e3 / record["launches"]
        print({k: v for k, v in record.items() if k != "by_op"}, flush=True)
        runs.append(record)
  if args.json:
    from jspec.bench.profiling import save_script_record
    save_script_record({"bandwidth": bandwidth, "context": args.context,
                        "cache_size": args.cache_size, "runs": runs}, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
