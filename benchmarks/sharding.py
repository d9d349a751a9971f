"""What sharding costs and buys: per-token time and communication per decode step vs mesh shape.

  python benchmarks/sharding.py --devices 8 --json benchmarks/issue21_sharding_cpu.json

On a CPU the devices are simulated (XLA_FLAGS=--xla_force_host_platform_device_count, set here
before JAX starts): they share the host's cores, so their times show what partitioning and the
collectives cost in one program, not what more chips buy. The communication is exact either way:
read from each compiled program's HLO (jspec.bench.collectives: every collective of one iteration
of the decode loop, its buffer bytes and group size), beside the volume computed from the model's
shape (Megatron's split: 2 all-reduces of [B/dp, T, E] a layer plus one for the embedding lookup
from a vocabulary-sharded table, T = 1 for a step and gamma + 1 for a chain round).

Rows: the default model (SmolLM2-135M: 9 heads, 3 KV heads, vocabulary 49152: tp in {1, 3}) on
8 MT-Bench prompts, autoregressive and chain speculative decoding (the default drafter replicated,
as jspec places it, and sharded like the target for comparison); then communication only (compile,
no run) for a Llama-shaped model whose sizes divide by 8 (tp up to 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--num-prompts", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--json", type=Path, default=Path("benchmarks/issue21_sharding_cpu.json"))
  args = ap.parse_args()
  if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS",
                          f"--xla_force_host_platform_device_count={args.devices}")
  import jax

  from jspec import data
  from jspec.bench.collectives import compiled_engine, decode_loop_collectives, summarize
  from jspec.decode import prepare_batch
  from jspec.drafting.base import place_drafter
  from jspec.drafting.registry import load_drafter
  from jspec.generate import generate, generate_tokens
  from jspec.model import load
  from jspec.models.config import Config
  from jspec.models.llama import init_params, param_layout
  from jspec.sampling.processing import GREEDY
  from jspec.sharding import make_mesh, model_placement, shardings
  from jspec.speculative.chain import SpecConfig, speculative_generate, speculative_generate_tokens

  n_dev = len(jax.devices())
  model = load("default", "float32-xla")
  cfg = model.cfg
  prompts = [model.encode(t) for t in data.load_prompts("mt-bench", args.num_prompts)]
  B, N = len(prompts), args.max_new_tokens
  drafter = load_drafter("default", model, "float32-xla")
  spec = SpecConfig(gamma=3, max_new_tokens=N)

  def predicted(cfg, dp, tp, T, itemsize=4):
    """Bytes per device of the step's all-reduces (Megatron) and a ring's bytes sent."""
    if tp == 1:
      return 0, 0.0
    one = (B // dp) * T * cfg.hidden_size * itemsize
    count = 2 * cfg.num_layers + 1
    return count * one, count * 2 * (tp - 1) / tp * one

  def lowered_hlo(fn, *a, **kw):
    return compiled_engine(fn, *a, **kw).as_text()

  def communication(params, cfg, mesh, drafter=None):
    ids = [[t % cfg.vocab_size for t in p] for p in prompts]
    b = prepare_batch(cfg, ids, max_new_tokens=N, sampling=GREEDY, key=0, stop_ids=(),
                      cache_size=None, reserve=0 if drafter is None else spec.gamma + 1,
                      reserve_for="gamma + 1")
    placement = model_placement(cfg, mesh)
    placement.check_batch(B)
    b = dataclasses.replace(b, tokens=placement.put_batch(b.tokens),
                            lengths=placement.put_batch(b.lengths))
    placed = params  # placed already (or abstract: shapes with shardings, never allocated)
    if drafter is None:
      hlo = lowered_hlo(generate_tokens, placed, cfg, b.tokens, b.lengths, b.key, b.sampling,
                        max_new_tokens=N, cache_size=b.cache_size, placement=placement)
    else:
      hlo = lowered_hlo(speculative_generate_tokens, placed, cfg, drafter, b.tokens, b.lengths,
                        b.key, b.sampling, spec=spec, cache_size=b.cache_size,
                        placement=placement)
    return summarize(decode_loop_collectives(hlo, mesh.size))

  def timed(run):
    out = jax.block_until_ready(run())  # compile + first run
    best = float("inf")
    for _ in range(args.repeats):
      start = time.perf_counter()
      out = jax.block_until_ready(run())
      best = min(best, time.perf_counter() - start)
    return out, best

  records = []
  meshes = [(dp, tp) for dp, tp in ((1, 1), (2, 1), (4, 1), (8, 1), (1, 3), (2, 3))
            if dp * tp <= n_dev and B % dp == 0]
  reference = {}
  for dp, tp in meshes:
    mesh = make_mesh(dp, tp)
    placement = model_placement(cfg, mesh)
    params = placement.put(model.params, param_layout(cfg))
    variants = [("ar", None, None), ("chain", "default (replicated)", place_drafter(
        drafter, placement, model.params, params))]
    if tp > 1:
      dcfg = drafter.cfg
      sharded = dataclasses.replace(drafter, params=model_placement(dcfg, mesh).put(
          drafter.params, param_layout(dcfg)))
      variants.append(("chain", "default (sharded over tp)", sharded))
    for method, name, d in variants:
      if d is None:
        run = lambda: generate(params, cfg, prompts, max_new_tokens=N, mesh=mesh)
      else:
        run = lambda: speculative_generate(params, cfg, d, prompts, spec=spec, mesh=mesh)
      out, seconds = timed(run)
      seqs = out.sequences()
      reference.setdefault(method, seqs)
      tokens = int(out.lengths.sum())
      steps = int(out.steps) if d is None else int(out.rounds)
      comm = communication(params, cfg, mesh, d)
      pred, pred_wire = predicted(cfg, dp, tp, 1 if d is None else spec.gamma + 1)
      records.append({
          "model": "default", "method": method, "drafter": name, "dp": dp, "tp": tp,
          "devices": dp * tp, "batch": B, "max_new_tokens": N, "tokens": tokens,
          "seconds": round(seconds, 4), "tok_per_s": round(tokens / seconds, 2),
          "ms_per_step": round(1e3 * seconds / max(steps, 1), 3), "steps": steps,
          "identical_to_one_device": seqs == reference[method],
          "kv_heads_sharded": placement.rules.kv_heads == "tp",
          "step_collectives": comm, "predicted_allreduce_bytes": pred,
          "predicted_wire_bytes": round(pred_wire)})
      print(json.dumps({k: records[-1][k] for k in ("method", "drafter", "dp", "tp", "tok_per_s",
                                                   "ms_per_step", "identical_to_one_device")}),
            {k: comm[k] for k in ("collectives", "bytes", "wire_bytes")}, "predicted", pred,
            flush=True)

  # Communication only, a model whose sizes divide by 8 (a Llama-2-7B layer shape, 2 layers).
  big = Config(arch="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
               num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128)
  abstract = jax.eval_shape(lambda: init_params(big, jax.random.key(0)))
  for dp, tp in ((1, 2), (1, 4), (1, 8), (2, 4), (4, 2), (8, 1)):
    if dp * tp > n_dev or B % dp:
      continue
    mesh = make_mesh(dp, tp)
    placement = model_placement(big, mesh)
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          abstract, shardings(param_layout(big), mesh, placement.rules))
    comm = communication(params, big, mesh)
    pred, pred_wire = predicted(big, dp, tp, 1)
    records.append({"model": "llama-7b-shape-2-layers", "method": "ar", "dp": dp, "tp": tp,
                    "devices": dp * tp, "batch": B, "step_collectives": comm,
                    "kv_heads_sharded": model_placement(big, mesh).rules.kv_heads == "tp",
                    "predicted_allreduce_bytes": pred, "predicted_wire_bytes": round(pred_wire)})
    print("7b-shape", dp, tp, {k: comm[k] for k in ("collectives", "bytes", "wire_bytes")},
          "predicted", pred, flush=True)

  meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
          "jax": jax.__version__, "backend": jax.default_backend(), "devices": n_dev,
          "simulated_devices": jax.default_backend() == "cpu",
          "command": "python " + " ".join(sys.argv)}
  for r in records:
    r.update(meta)
  args.json.write_text(json.dumps(records, indent=1) + "\n")
  print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
