"""One benchmark script run side by side at two revisions of jspec: the old revision checked out
in a temporary git worktree, each side in its own process from its own tree (so `import jspec`
finds that tree's package), alternating old, new, old, new, ... on the same machine.

  python benchmarks/ab_revisions.py --old 4d26651 --rounds 2 --json benchmarks/X.json -- \
      benchmarks/kv_evict_cost.py --methods keydiff,h2o+caote --every 1,4

The script (a path relative to the repository root) must take `--json PATH`; each side runs its
own revision's copy, or with `--script-from new` the new one (the same measuring code over both
packages: the script must then use only what both revisions have). The records are gathered into
one file: {"old": rev, "new": rev, "script", "script_from", "args", "runs": [{"side", "round",
"record"}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str, cwd: Path = ROOT) -> str:
  return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                        text=True).stdout.strip()


def run_side(tree: Path, script: Path, args: list[str], out: Path) -> dict:
  env = dict(os.environ, PYTHONPATH=str(tree))
  subprocess.run([sys.executable, str(script), *args, "--json", str(out)], cwd=tree, env=env,
                 check=True)
  return json.loads(out.read_text())


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--old", required=True, help="the old revision (any git rev)")
  p.add_argument("--rounds", type=int, default=2, help="old/new pairs, alternated")
  p.add_argument("--script-from", choices=("each", "new"), default="each",
                 help="each side runs its own copy of the script, or both the new one")
  p.add_argument("--json", required=True)
  p.add_argument("script", help="the benchmark script, then its arguments after --")
  p.add_argument("args", nargs=argparse.REMAINDER)
  a = p.parse_args()
  args = a.args[1:] if a.args[:1] == ["--"] else a.args
  revs = {"old": git("rev-parse", a.old), "new": git("rev-parse", "HEAD")}
  if git("status", "--porcelain", "--untracked-files=no"):
    print("ab_revisions: uncommitted changes are measured as 'new' but recorded as HEAD",
          file=sys.stderr)
  runs = []
  with tempfile.TemporaryDirectory() as tmp:
    old_tree = Path(tmp) / "old"
    git("worktree", "add", "--detach", "-f", str(old_tree), revs["old"])
    try:
      for round_ in range(a.rounds):
        for side, tree in (("old", old_tree), ("new", ROOT)):
          print(f"ab_revisions: round {round_}, {side} ({revs[side][:9]})", file=sys.stderr,
                flush=True)
          script = (ROOT if a.script_from == "new" else tree) / a.script
          record = run_side(tree, script, args, Path(tmp) / f"{side}{round_}.json")
          runs.append({"side": side, "round": round_, "record": record})
          # Saved after every run, so an interrupted comparison keeps what it measured.
          Path(a.json).write_text(json.dumps(
              {"old": revs["old"], "new": revs["new"], "script": a.script,
               "script_from": a.script_from, "args": args, "runs": runs}, indent=1) + "\n")
    finally:
      git("worktree", "remove", "--force", str(old_tree))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
