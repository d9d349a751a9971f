"""Learning curves of the issue #22 comparison: held-out acceptance vs training tokens, per method
and data size, from the runs of benchmarks/run_issue22_compare.sh.

  python benchmarks/plot_issue22_curves.py [--runs ~/.cache/jspec/drafter-runs/issue22]

Each run's trainer log (work/log.jsonl) holds its periodic held-out evaluation (the trainer's own
5% split of its data, so sizes are not scored on the same rows); `jspec eval-drafter` on shards
no run trained on (benchmarks/issue22_heldout_cpu.json, when present) gives the comparable end
points. Writes benchmarks/issue22_curves_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--runs", type=Path,
                  default=Path.home() / ".cache/jspec/drafter-runs/issue22")
  ap.add_argument("--out", type=Path, default=Path("benchmarks/issue22_curves_cpu"))
  args = ap.parse_args()
  curves = []
  for run in sorted(args.runs.glob("*-*")):
    log = run / "work" / "log.jsonl"
    if not log.is_file():
      continue
    network, shards = run.name.rsplit("-", 1)
    config = json.loads((run / "work" / "train_config.json").read_text())
    meta_file = run / "drafter" / "jspec.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    tokens_per_step = (meta.get("tokens_trained", 0) / config["steps"]) if meta else None
    points = []
    for line in log.read_text().splitlines():
      e = json.loads(line)
      if "alpha_greedy_draft1" not in e:
        continue
      points.append({"step": e["step"],
                     "tokens": None if tokens_per_step is None else round(e["step"] *
                                                                          tokens_per_step),
                     **{k: e[k] for k in e if k.startswith("alpha_")}})
    curves.append({"network": network, "shards": int(shards),
                   "train_examples": meta.get("train_examples"),
                   "train_tokens_per_epoch": meta.get("train_tokens_per_epoch"),
                   "steps": config["steps"], "finished": bool(meta), "points": points})
  # Runs no longer on this machine keep the points an earlier plot recorded.
  if args.out.with_suffix(".json").is_file():
    earlier = json.loads(args.out.with_suffix(".json").read_text())["curves"]
    have = {(c["network"], c["shards"]) for c in curves}
    curves += [c for c in earlier if (c["network"], c["shards"]) not in have]
    curves.sort(key=lambda c: (c["shards"], c["network"]))
  heldout = []  # every record of `jspec eval-drafter` on the held-out shards
  for file in sorted(Path("benchmarks").glob("issue22_heldout*_cpu.json")):
    heldout += json.loads(file.read_text())
  record = {"curves": curves, "heldout": heldout or None,
            "command": "bash benchmarks/run_issue22_compare.sh; "
                       "python benchmarks/plot_issue22_curves.py"}
  args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
  for ax, draft in zip(axes, (1, 2)):
    for c in curves:
      key = f"alpha_greedy_draft{draft}"
      pts = [p for p in c["points"] if key in p]
      if pts:
        ax.plot([p["step"] for p in pts], [p[key] for p in pts], marker="o",
                label=f"{c['network']}, {c['shards']} shards")
    ax.set_title(f"held-out greedy acceptance, draft {draft}")
    ax.set_xlabel("training step (8 rows x 256 tokens)")
    ax.grid(alpha=0.3)
  # The comparable end points: eval-drafter's draft-1 acceptance on the shared held-out shards
  # against the data size (a run's name is NETWORK-SHARDS; ablations are left out).
  sizes = {}
  for r in heldout:
    name = Path(r["drafter"].removeprefix("model:")).parent.name  # e.g. eagle3-12
    if "-" in name and "ablation" not in r.get("command", ""):
      network, shards = name.rsplit("-", 1)
      sizes.setdefault(network, {})[int(shards)] = r["alpha_greedy"]
  for network, by_size in sorted(sizes.items()):
    xs = sorted(by_size)
    axes[2].plot([16 * x for x in xs], [by_size[x] for x in xs], marker="s", label=network)
  axes[2].set_title("held-out shards 38-39 (eval-drafter), draft 1")
  axes[2].set_xlabel("distillation prompts trained on (16 a shard)")
  axes[2].grid(alpha=0.3)
  axes[2].legend()
  axes[0].set_ylabel("acceptance")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(args.out.with_suffix(".png"), dpi=120)
  print(f"wrote {args.out.with_suffix('.json')} and .png ({len(curves)} runs)")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
