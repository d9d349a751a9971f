"""The communication of one speculative round on a mesh, per engine, drafter and sampling mode.

  python benchmarks/ab_revisions.py --old ff6d9c1 --rounds 1 --script-from new \
      --json benchmarks/round_collectives_cpu.json -- benchmarks/round_collectives.py

Compiles (does not run) the chain and tree engines on simulated CPU devices (the device count is
set here before JAX starts) for the 2-layer test model of tests/sharding_checks.py (vocabulary
256, 8 query and 2 KV heads, a 1-layer draft model), and reads every collective of one iteration
of the decoding loop from the HLO (jspec.bench.collectives; counts and buffer bytes are exact, the
same on any machine). Under dp alone a round should move only the loop's exit test and counters.
The record is {"programs": [{"engine", "drafter", "sampling", "mesh", "collectives", "bytes",
"by_op", "branch_collectives", "branch_bytes"}], "jspec": the package measured}.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DEVICES = 8


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", type=Path, required=True)
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={DEVICES}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  import jspec
  from jspec.bench.collectives import decode_loop_collectives, summarize
  try:
    from jspec.bench.collectives import compiled_engine
  except ImportError:  # the old side of the A/B (ff6d9c1) predates it
    def compiled_engine(fn, *args, **static):
      return jax.jit(fn, static_argnums=1, static_argnames=tuple(static)).lower(
          *args, **static).compile()
  from jspec.decode import on_mesh, prepare_batch
  from jspec.drafting.base import place_drafter
  from jspec.drafting.lookahead import lookahead_drafter
  from jspec.drafting.model import ModelDrafter
  from jspec.drafting.ngram import ngram_drafter
  from jspec.drafting.probe import probe_drafter
  from jspec.models.config import Config
  from jspec.models.llama import init_params
  from jspec.sampling.processing import GREEDY, SamplingParams
  from jspec.sharding import make_mesh
  from jspec.speculative.chain import SpecConfig, speculative_generate_tokens
  from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate_tokens

  target_cfg = Config(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, qkv_bias=True)
  draft_cfg = Config(arch="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  target = init_params(target_cfg, jax.random.key(0), scale=0.5)
  draft = init_params(draft_cfg, jax.random.key(1), scale=0.5)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [3, 3, 3], [200, 17], [5, 6, 5, 6],
             [42, 43, 44, 45]]
  drafters = {"model": lambda: ModelDrafter(draft, draft_cfg),
              "ngram": lambda: ngram_drafter(256),
              "ngram+model": lambda: ngram_drafter(256, fallback=ModelDrafter(draft, draft_cfg)),
              "mtp": lambda: probe_drafter(target, target_cfg, 3),
              "lookahead": lambda: lookahead_drafter(target, target_cfg)}
  samplings = {"greedy": GREEDY, "top-k/top-p": SamplingParams(temperature=0.8, top_k=40,
                                                                top_p=0.9)}
  engines = {"chain gamma 3": SpecConfig(gamma=3, max_new_tokens=8),
             "tree fixed:3-2-1": TreeSpecConfig("fixed:3-2-1", max_new_tokens=8),
             "tree dynamic:6": TreeSpecConfig("dynamic:6", max_new_tokens=8),
             "tree rsd-s:3,3": TreeSpecConfig("rsd-s:3,3", max_new_tokens=8)}
  programs = []
  for mesh_shape in ((8, 1), (2, 4)):
    for sampling_name, sampling in samplings.items():
      b = prepare_batch(target_cfg, prompts, max_new_tokens=8, sampling=sampling, key=0,
                        stop_ids=(), cache_size=None)
      placed, b, placement = on_mesh(target, target_cfg, b, make_mesh(*mesh_shape))
      for engine_name, spec in engines.items():
        tree = isinstance(spec, TreeSpecConfig)
        fn = tree_speculative_generate_tokens if tree else speculative_generate_tokens
        for drafter_name, make in drafters.items():
          if drafter_name == "lookahead" and tree:
            continue  # lookahead verifies its own n-gram pool as a tree (pool:G,D)
          drafter = place_drafter(make(), placement, target, placed)
          hlo = compiled_engine(fn, placed, target_cfg, drafter, b.tokens, b.lengths, b.key,
                                b.sampling, spec=spec, placement=placement,
                                cache_size=b.cache_size + (spec.reserve if tree else 8)).as_text()
          step = decode_loop_collectives(hlo, placement.mesh.size)
          record = {"engine": engine_name, "drafter": drafter_name, "sampling": sampling_name,
                    "mesh": {"dp": mesh_shape[0], "tp": mesh_shape[1]}, **summarize(step)}
          programs.append(record)
          print(json.dumps(record), flush=True)
  args.json.write_text(json.dumps({"jspec": str(Path(jspec.__file__).parent),
                                   "programs": programs}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
