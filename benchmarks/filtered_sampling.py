"""top-k/top-p from the largest logits vs a sort of the vocabulary: speed on one device, data moved
per decode step on a mesh.

  python benchmarks/filtered_sampling.py --json benchmarks/issue21_filtered_sampling_cpu.json

Two filters side by side in one process: "sort" (jspec before: sort each row's vocabulary, read the
threshold) and "candidates" (jspec.sampling.processing: the top 256 values, a bisection of the
threshold when the filter reaches past them). Rows:
- speed: the default model generating MT-Bench answers with filtered sampling, both filters, the
  same key; tok/s, and how often the candidates sufficed (teacher-forced over the generated
  tokens: `candidate_threshold`'s `fits` at every position).
- communication: the default model's decode step compiled on a dp=1 x tp=3 mesh of simulated
  devices (a subprocess), every gather of the step read from the HLO, in lax.cond branches too,
  with their depth (sampling 1, filters 2, the bisection 3).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"top-k 40, top-p 0.9, T 0.8": (0.8, 40, 0.9), "top-p 0.9, T 1": (1.0, 0, 0.9),
            "top-k 50, T 1": (1.0, 50, 1.0)}


def sort_filter(x, k, top_p):
  """jspec's filter before the candidates: a sort of the whole vocabulary."""
  import jax
  import jax.numpy as jnp
  V = x.shape[-1]
  desc = -jnp.sort(-x, axis=-1)
  desc = jnp.where((k > 0) & (jnp.arange(V) >= k), -jnp.inf, desc)
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = ((mass_before < top_p) | (top_p >= 1)) & (desc > -jnp.inf)
  keep = keep.at[..., 0].set(True)
  threshold = jnp.take_along_axis(desc, jnp.sum(keep, axis=-1, keepdims=True) - 1, axis=-1)
  return jnp.where(x < threshold, -jnp.inf, x)


def speed(args) -> list[dict]:
  import jax
  import numpy as np

  from jspec import data
  from jspec.model import load
  from jspec.sampling import processing
  from jspec.sampling.processing import SamplingParams

  model = load("default", args.weights)
  prompts = [model.encode(t) for t in data.load_prompts("mt-bench", args.num_prompts)]
  new_filter = processing._top_k_top_p
  records = []
  for name, (t, k, p) in SETTINGS.items():
    sp = SamplingParams(temperature=t, top_k=k, top_p=p)
    row = {"part": "speed", "sampling": name, "weights": args.weights,
           "batch": len(prompts), "max_new_tokens": args.max_new_tokens}
    for label, fn in (("sort", sort_filter), ("candidates", new_filter)):
      processing._top_k_top_p = fn
      jax.clear_caches()  # the filter is read when the program is traced
      run = lambda: model.generate_ids(prompts, max_new_tokens=args.max_new_tokens, sampling=sp,
                                      key=args.seed, stop=False)
      out = jax.block_until_ready(run())  # compile, warm up
      best = float("inf")
      for _ in range(args.repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
      tokens = int(np.asarray(out.lengths).sum())
      row[f"{label}_tok_per_s"] = round(tokens / best, 2)
      row[f"{label}_seconds"] = round(best, 4)
      row[f"{label}_sequences"] = out.sequences()
    processing._top_k_top_p = new_filter
    row["speedup"] = round(row["candidates_tok_per_s"] / row["sort_tok_per_s"], 3)
    row["same_tokens"] = row.pop("sort_sequences") == row["candidates_sequences"]
    row["candidates_fit"] = fit_fraction(model, prompts, row.pop("candidates_sequences"), t, k, p)
    records.append(row)
    print(json.dumps(row), flush=True)
  return records


def fit_fraction(model, prompts, answers, t, k, p) -> float:
  """Share of the generated positions whose filter the top 256 candidates decide alone."""
  import jax.numpy as jnp
  import numpy as np

  from jspec.models.cache import KVCache
  from jspec.models.llama import forward
  from jspec.sampling.processing import candidate_threshold

  fits, total = 0, 0
  params = model.params
  for prompt, answer in zip(prompts, answers):
    ids = jnp.asarray([prompt + answer[:-1]], jnp.int32)
    cache = KVCache.init(model.cfg, 1, ids.shape[1] + 1)
    logits, _, _ = forward(params, model.cfg, ids, jnp.arange(ids.shape[1])[None], cache)
    x = logits[0, len(prompt) - 1:].astype(jnp.float32) / t  # [answer, V]
    n = x.shape[0]
    ok = candidate_threshold(x, jnp.full((n, 1), k), jnp.full((n, 1), p))[1]
    fits += int(np.asarray(ok).sum())
    total += n
  return round(fits / max(total, 1), 4)


def communication(args) -> list[dict]:
  import jax

  from jspec.bench.collectives import decode_loop_collectives
  from jspec.decode import prepare_batch
  from jspec.generate import generate_tokens
  from jspec.model import load
  from jspec.models.llama import param_layout
  from jspec.sampling import processing
  from jspec.sampling.processing import SamplingParams
  from jspec.sharding import make_mesh, model_placement, shardings

  model = load("default", "float32-xla")
  cfg = model.cfg
  mesh = make_mesh(1, 3)
  placement = model_placement(cfg, mesh)
  params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        model.params, shardings(param_layout(cfg), mesh, placement.rules))
  prompts = [[1, 2, 3]] * args.num_prompts
  sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
  b = prepare_batch(cfg, prompts, max_new_tokens=8, sampling=sp, key=0, stop_ids=(),
                    cache_size=None)
  tokens, lengths = placement.put_batch(b.tokens), placement.put_batch(b.lengths)
  records = []
  new_filter = processing._top_k_top_p
  for label, fn in (("sort", sort_filter), ("candidates", new_filter)):
    processing._top_k_top_p = fn
    jax.clear_caches()
    hlo = jax.jit(generate_tokens, static_argnums=1,
                  static_argnames=("max_new_tokens", "cache_size", "placement")).lower(
        params, cfg, tokens, lengths, b.key, b.sampling, max_new_tokens=8,
        cache_size=b.cache_size, placement=placement).compile().as_text()
    gathers = [c for c in decode_loop_collectives(hlo, mesh.size) if c.op != "all-reduce"]
    records.append({
        "part": "communication", "filter": label, "mesh": "dp=1,tp=3", "batch": len(prompts),
        "vocab": cfg.vocab_size, "candidates": processing.CANDIDATES,
        # (op, bytes, lax.cond depth): sampling is depth 1 (vs greedy), the filters 2 (on or
        # off), the bisection past the candidates 3
        "gathers_in_step": sorted(((c.op, c.bytes, c.depth) for c in gathers), reverse=True),
        "largest_gather_bytes": max((c.bytes for c in gathers), default=0),
        "largest_gather_bytes_without_fallback": max(
            (c.bytes for c in gathers if c.depth <= 2), default=0),
        "row_bytes": len(prompts) * cfg.vocab_size * 4,
        "candidate_bytes": len(prompts) * 3 * processing.CANDIDATES * 4})
    print(json.dumps(records[-1]), flush=True)
  processing._top_k_top_p = new_filter
  return records


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=("all", "speed", "communication"), default="all")
  ap.add_argument("--weights", default="float32")
  ap.add_argument("--num-prompts", type=int, default=4)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", type=Path,
                  default=Path("benchmarks/issue21_filtered_sampling_cpu.json"))
  args = ap.parse_args()
  records = []
  if args.part in ("all", "speed"):
    records += speed(args)
  if args.part == "communication":
    records += communication(args)
  if args.part == "all":  # simulated devices must be set before JAX starts: a fresh process
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, __file__, "--part", "communication", "--num-prompts",
                          str(args.num_prompts), "--json", "/dev/null"], env=env, check=True,
                         capture_output=True, text=True).stdout
    records += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  import jax
  meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
          "jax": jax.__version__, "backend": jax.default_backend(),
          "command": "python " + " ".join(sys.argv)}
  for r in records:
    r.update(meta)
  if str(args.json) != "/dev/null":
    args.json.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
