#!/usr/bin/env bash
# Issue #16 (the architecture redesign): the same `jspec bench` run on the tree before the redesign
# (51a6868) and after it, same prompts, same process settings, one after the other. Greedy and
# sampled outputs, accept histograms and tau must match exactly; speeds are compared as ratios.
#   bash benchmarks/run_issue16_equivalence.sh [OLD_REV]
set -euo pipefail
cd "$(dirname "$0")/.."
OLD_REV=${1:-51a6868}
OLD=$(mktemp -d)/jspec-old
git worktree add -f "$OLD" "$OLD_REV" >/dev/null
trap 'git worktree remove --force "$OLD"' EXIT
ARGS=(--model default --dataset mt-bench --num-prompts 5 --max-new-tokens 64 --gamma 3
      --no-transformers --no-overhead)
HERE=$(pwd)
for T in 0 1; do
  for side in old new; do
    root=$([ "$side" = old ] && echo "$OLD" || echo "$HERE")
    # Run from the tree's own root, so `import jspec` finds that tree's package (printed).
    (cd "$root" && PYTHONPATH="$root" python -c "import sys, jspec, jspec.cli; print(jspec.__file__, file=sys.stderr); sys.exit(jspec.cli.main(sys.argv[1:]))" \
      bench "${ARGS[@]}" --temperature "$T" --drafters default,ngram,ngram+default \
      --json "$HERE/benchmarks/issue16_${side}_mt-bench_t${T}_g3_cpu.json")
  done
done
python - <<'PY'
import json
for t in (0, 1):
  old = json.load(open(f"benchmarks/issue16_old_mt-bench_t{t}_g3_cpu.json"))
  new = json.load(open(f"benchmarks/issue16_new_mt-bench_t{t}_g3_cpu.json"))
  for a, b in zip(old, new):
    same = all(a.get(k) == b.get(k) for k in ("new_tokens", "target_calls", "accept_hist",
                                               "block_efficiency", "identical_to_ar"))
    print(f"T={t} {b['method']:<22} {b['drafter']:<14} tau old {a.get('block_efficiency')} new "
          f"{b.get('block_efficiency')} same counts: {same}; tok/s old {a['tokens_per_s']:.1f} "
          f"new {b['tokens_per_s']:.1f} (new/old {b['tokens_per_s'] / a['tokens_per_s']:.3f})")
PY
