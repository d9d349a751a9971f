"""Issue #22: how much the trained ConFu drafter (benchmarks/run_issue22_compare.sh, confu at 12
shards) relies on its contemplate signal: the same drafter with its projection zeroed (what is
left is its co-trained EAGLE-3 part) scored on the same held-out shards by `jspec eval-drafter`'s
code. Writes benchmarks/issue22_heldout_confu_ablation_cpu.json.

  python benchmarks/confu_ablation.py
"""
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from jspec.model import load
from jspec.drafting.registry import load_drafter
from jspec.train.recipe import heldout_acceptance
R = str(Path.home() / ".cache/jspec/drafter-runs/issue22/confu-12/drafter")
target = load("default", "float32-xla")
d = load_drafter(f"model:{R}", target)
off = dataclasses.replace(d, contemplate=dataclasses.replace(d.contemplate, proj=jnp.zeros_like(d.contemplate.proj)))
recs = heldout_acceptance(target, {"confu-12 with proj = 0 (its EAGLE-3 part alone)": off}, (str(Path.home() / ".cache/jspec/distill/i22") + ":38-40",), seq_len=256, gamma=4)
for r in recs:
  r["command"] = "python benchmarks/confu_ablation.py"
print(json.dumps({k: v for k, v in recs[0].items() if k.startswith(("alpha", "tau"))}, indent=1))
json.dump(recs, open("benchmarks/issue22_heldout_confu_ablation_cpu.json", "w"), indent=2)
