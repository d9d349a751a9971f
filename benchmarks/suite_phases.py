"""Where the test suite's time goes, test by test: tracing (jaxprs), lowering (MLIR), XLA compiling,
the number of programs compiled, and the rest (running, Python, subprocesses' own work).

A pytest plugin; each process (every xdist worker) writes its rows to OUT/<pid>.json:

  SUITE_PHASES_OUT=/tmp/phases python -m pytest -p benchmarks.suite_phases
  python benchmarks/suite_phases.py /tmp/phases [--json benchmarks/suite_phases_cpu.json]

Nested programs count once, in the outermost call (a jit inside a traced function is not a compile
of its own). A test that runs jax functions eagerly compiles each operation for every new shape:
hundreds of programs, each lowered and compiled (a jitted helper compiles one).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import time
from pathlib import Path

import pytest

PHASES = ("trace", "lower", "compile")
_totals = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "programs": 0}
_depth = [0]
_rows: list[dict] = []


def _timed(module, name: str, phase: str) -> None:
  """Wrap module.name so its outermost calls add their seconds to _totals[phase]."""
  original = getattr(module, name)

  @functools.wraps(original)
  def wrapper(*args, **kwargs):
    if _depth[0]:
      return original(*args, **kwargs)
    _depth[0] += 1
    start = time.perf_counter()
    try:
      return original(*args, **kwargs)
    finally:
      _depth[0] -= 1
      _totals[phase] += time.perf_counter() - start
      _totals["programs"] += phase == "compile"

  setattr(module, name, wrapper)


def pytest_configure(config):
  from jax._src import compiler, pjit  # private: the three phases have no public hooks
  from jax._src.interpreters import pxla
  _timed(pjit, "_trace_for_jit", "trace")
  _timed(pxla, "lower_sharding_computation", "lower")
  _timed(compiler, "backend_compile_and_load", "compile")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  before, start = dict(_totals), time.perf_counter()
  yield
  row = {"test": item.nodeid, "seconds": time.perf_counter() - start}
  row.update({k: _totals[k] - before[k] for k in _totals})
  _rows.append(row)


def pytest_sessionfinish(session):
  out = Path(os.environ.get("SUITE_PHASES_OUT", "suite_phases"))
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{os.getpid()}.json").write_text(json.dumps(_rows))


def summarize(rows: list[dict], top: int = 30) -> dict:
  """Totals, the files by seconds, and the tests that compile the most programs."""
  total = {k: round(sum(r[k] for r in rows), 1) for k in ("seconds",) + PHASES + ("programs",)}
  total["rest"] = round(total["seconds"] - sum(total[k] for k in PHASES), 1)
  files = collections.defaultdict(lambda: collections.Counter())
  for r in rows:
    files[r["test"].split("::")[0]].update({k: r[k] for k in ("seconds",) + PHASES + ("programs",)})
  by_file = sorted(({"file": f, **{k: round(v, 1) for k, v in c.items()}}
                    for f, c in files.items()), key=lambda r: -r["seconds"])
  most = sorted(rows, key=lambda r: -r["programs"])[:top]
  return {"tests": len(rows), "total": total, "files": by_file,
          "most_programs": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}
                            for r in most]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out", help="the folder SUITE_PHASES_OUT named")
  parser.add_argument("--json", help="write the summary here")
  parser.add_argument("--top", type=int, default=30)
  parser.add_argument("--note", default="", help="where and how it was measured (kept in --json)")
  args = parser.parse_args()
  rows = [r for f in sorted(Path(args.out).glob("*.json")) for r in json.loads(f.read_text())]
  summary = {"note": args.note, **summarize(rows, args.top)}
  t = summary["total"]
  print(f"{summary['tests']} tests: {t['seconds']:.0f} s = trace {t['trace']:.0f} + lower "
        f"{t['lower']:.0f} + compile {t['compile']:.0f} ({t['programs']} programs) + rest "
        f"{t['rest']:.0f}")
  for r in summary["files"][:25]:
    print(f"{r['seconds']:7.1f} s  compile {r['compile']:6.1f}  programs {r['programs']:5d}  "
          f"{r['file']}")
  print("most programs compiled:")
  for r in summary["most_programs"]:
    print(f"{r['programs']:5d}  lower+compile {r['lower'] + r['compile']:5.1f} s  {r['test']}")
  if args.json:
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
  main()
