"""Plot issue #5's sweep: block efficiency tau (and speed vs autoregressive) against the target's
per-call node budget N, one line per tree method, one column per (dataset, temperature).

  python benchmarks/plot_trees.py [--glob 'benchmarks/trees_*_n*_cpu.json'] [--out PNG]

Reads the JSON records that benchmarks/run_issue5_trees.sh writes (`jspec bench --tree ...`).
"""

from __future__ import annotations

import argparse
import glob
import json
from collections import defaultdict
from pathlib import Path

STYLE = {"chain": ("black", "o"), "specinfer": ("tab:blue", "s"), "rsd-c": ("tab:orange", "^"),
         "rsd-s": ("tab:red", "v"), "dynamic": ("tab:green", "D"), "fixed": ("tab:gray", "x")}


# Files whose autoregressive baseline ran beside another CPU job (a helper's tests): their tau is
# valid, their speeds are not comparable (AR at 24 tok/s instead of ~32). Plotted without speed.
SPEED_NOT_COMPARABLE = {"trees_mt-bench_t1_n4-8-16_cpu.json"}


def load(pattern: str) -> list[dict]:
  records = []
  for path in sorted(glob.glob(pattern)):
    for r in json.loads(Path(path).read_text()):
      if r["method"] == "jspec-tree":
        if Path(path).name in SPEED_NOT_COMPARABLE:
          r = dict(r, speedup_vs_ar=float("nan"))
        records.append(r)
  return records


def table(records: list[dict]) -> dict:
  """(dataset, temperature) -> method -> sorted [(budget N, tau, speedup vs AR)]."""
  out = defaultdict(lambda: defaultdict(list))
  for r in records:
    n = r["tree_nodes"] - 1
    out[(r["dataset"], r["temperature"])][r["tree_method"]].append(
        (n, r["block_efficiency"], r["speedup_vs_ar"]))
  return {k: {m: sorted(v) for m, v in d.items()} for k, d in sorted(out.items())}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--glob", default="benchmarks/trees_*_n*_cpu.json")
  p.add_argument("--out", type=Path, default=Path("benchmarks/trees_tau_vs_budget_cpu.png"))
  p.add_argument("--title", default="jspec token trees, default model + default drafter")
  args = p.parse_args()
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  data = table(load(args.glob))
  if not data:
    raise SystemExit(f"no tree records match {args.glob}")
  fig, axes = plt.subplots(2, len(data), figsize=(4.2 * len(data), 7), squeeze=False)
  for col, ((dataset, temp), methods) in enumerate(data.items()):
    for method, rows in methods.items():
      color, marker = STYLE.get(method, ("tab:purple", "."))
      n, tau, speed = zip(*rows)
      axes[0, col].plot(n, tau, color=color, marker=marker, label=method)
      axes[1, col].plot(n, speed, color=color, marker=marker, label=method)
      print(f"{dataset} T={temp:g} {method:9s} " +
            "  ".join(f"N={a}: tau {b:.3f} / " + (f"{c:.2f}x" if c == c else "-") for a, b, c in rows))
    axes[0, col].set_title(f"{dataset}, T={temp:g}")
    for row, label in ((0, "block efficiency tau"), (1, "speed vs autoregressive")):
      ax = axes[row, col]
      ax.set_xscale("log", base=2)
      ax.set_xticks([4, 8, 16, 32, 64], labels=["4", "8", "16", "32", "64"])
      ax.set_xlabel("node budget N (draft tokens per target call)")
      ax.set_ylabel(label)
      ax.grid(alpha=0.3)
    axes[1, col].axhline(1.0, color="gray", lw=0.8, ls="--")
  axes[0, 0].legend()
  machine = load(args.glob)[0].get("machine", {})
  fig.suptitle(f"{args.title} ({machine.get('processor') or machine.get('cpu') or 'CPU'})",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
