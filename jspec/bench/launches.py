"""How many device launches one iteration of a compiled decode loop makes, read off its optimized
HLO, and where in the JAX program they come from.

On a GPU a small model's decode step is bound by kernel launches, not bytes (benchmarks/README:
715 kernels a step of the default model), so what a speculative round costs beyond a one-token
step is mostly how many more kernels it runs. Counting them needs no timing: every instruction
of the loop body that does device work counts once, a nested loop (the layer scan, a drafter's
steps) counts its body times its known trip count, a conditional its largest branch. Each count
is attributed to the JAX operation that made it (the HLO's `op_name` metadata, shortened), so the
engine's own work (acceptance, cache moves) shows apart from the model's layers.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Callable

from jspec.bench.collectives import parse_computations

# Instructions that move no data on the device (tuples, views, constants) or only mark ordering.
FREE_OPS = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                      "after-all", "opt-barrier", "partition-id", "replica-id"})

_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = ")
_OPCODE = re.compile(r"= [^ ]+(?: [^ ]+)*? ([a-z][\w\-]*)\(")


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """({computation name: its instruction lines}, the entry computation's name)."""
  comps, entry = parse_computations(hlo_text)
  return ({name: [line for line in lines if _INSTRUCTION.match(line)]
           for name, lines in comps.items()}, entry or None)


def opcode(line: str) -> str:
  found = _OPCODE.search(line)
  return found.group(1) if found else "?"


_BRANCH = re.compile(r"branch_\d+_fun")


def source(line: str, depth: int = 3) -> str:
  """The op_name that made an instruction, without the jit(...) root and the loop/call frames
  every instruction of a body shares, cut to its first `depth` parts ("?" when absent)."""
  found = re.search(r'op_name="([^"]+)"', line)
  if not found:
    return "?"
  parts = [p for p in found.group(1).split("/")[1:]
           if p not in ("while", "body", "cond", "closed_call") and not _BRANCH.fullmatch(p)]
  return "/".join(parts[:depth]) or "?"


def _called(line: str, key: str) -> str | None:
  found = re.search(key + r"=%?([\w.\-]+)", line)
  return found.group(1) if found else None


def _branches(line: str) -> list[str]:
  listed = re.search(r"branch_computations=\{([^}]*)\}", line)
  if listed:
    return [b.strip().lstrip("%") for b in listed.group(1).split(",")]
  return [b for b in (_called(line, "true_computation"), _called(line, "false_computation")) if b]


def _trip_count(line: str) -> int | None:
  found = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
  return int(found.group(1)) if found else None


def tally(comps: dict[str, list[str]], name: str, times: int = 1,
          counts: collections.Counter | None = None, depth: int = 3,
          branch: Callable = max, keep: Callable[[str], bool] | None = None
          ) -> collections.Counter:
  """Launches of one run of computation `name`, keyed (opcode, source): nested loops expanded by
  their known trip count (once when unknown), conditionals by their largest branch (`branch=min`:
  the smallest), calls inlined. What makes the host wait counts too: a conditional (on a GPU its
  predicate goes to the host before the branch is launched) and a while loop of unknown trip
  count (the same, each iteration; counted once). `keep(line)`: count only the instructions it
  accepts (e.g. copies of one shape); loops, conditionals and calls are followed either way."""
  counts = collections.Counter() if counts is None else counts
  for line in comps.get(name, []):
    op = opcode(line)
    if op == "while":
      trips = _trip_count(line)
      if trips is None:
        counts[("while", source(line, depth))] += times
      for part, runs in (("body", trips or 1), ("condition", (trips or 1) + 1)):
        tally(comps, _called(line, part), times * runs, counts, depth, branch, keep)
    elif op == "conditional":
      branches = [tally(comps, b, times, None, depth, branch, keep) for b in _branches(line)]
      counts.update(branch(branches, key=lambda c: sum(c.values()),
                           default=collections.Counter()))
      counts[("conditional", source(line, depth))] += times
    elif op == "call" and _called(line, "to_apply"):
      tally(comps, _called(line, "to_apply"), times, counts, depth, branch, keep)
    elif op not in FREE_OPS and (keep is None or keep(line)):
      counts[(op, source(line, depth))] += times
  return counts


def loop_launches(hlo_text: str, depth: int = 3, top: int = 15) -> dict:
  """Launches per iteration of the entry computation's heaviest while loop (the decode loop),
  every conditional taking its largest branch: {"launches", "launches_smallest" (every
  conditional taking its smallest: greedy decoding usually does), "host_syncs" (conditionals and
  loops of unknown trip count run; where they come from: `control_flow_sites`),
  "host_syncs_smallest" (the same along the smallest branches), "by_op": {opcode:
  n}, "by_source": {op_name prefix: n} (the `top` largest), "loop_trip_count"}; {"launches":
  None} when the program has no loop."""
  comps, entry = computations(hlo_text)
  best = None
  for line in comps.get(entry, []):
    if opcode(line) == "while":
      counts = tally(comps, _called(line, "body"), depth=depth)
      if best is None or sum(counts.values()) > sum(best[0].values()):
        best = counts, _trip_count(line), _called(line, "body")
  if best is None:
    return {"launches": None, "launches_smallest": None, "host_syncs": None,
            "host_syncs_smallest": None, "by_op": {},
            "by_source": {}, "loop_trip_count": None}
  counts, trips, body = best
  smallest = tally(comps, body, depth=depth, branch=min)
  by_op, by_source = collections.Counter(), collections.Counter()
  for (op, where), n in counts.items():
    by_op[op] += n
    by_source[where] += n
  syncs_smallest = sum(n for (op, _), n in smallest.items() if op in ("conditional", "while"))
  return {"launches": sum(counts.values()), "launches_smallest": sum(smallest.values()),
          "host_syncs": by_op["conditional"] + by_op["while"],
          "host_syncs_smallest": syncs_smallest,
          "by_op": dict(by_op.most_common()),
          "by_source": dict(by_source.most_common(top)), "loop_trip_count": trips}


def copies_per_loop(hlo_text: str, shape: tuple[int, ...]) -> list[int]:
  """Copies of arrays of `shape` (its dims in any order: a layout change counts) run in one
  iteration of each of the entry computation's loops, in program order (nested loops times their
  trip counts, conditionals by their largest branch): e.g. a budgeted program's prefill chunk
  loop, then its decode loop. A copy is a `copy`, `copy-start` or `transpose` instruction of that
  shape, or a fusion whose root is one (XLA:GPU wraps the copies it inserts in fusions)."""
  comps, entry = computations(hlo_text)
  dims = sorted(shape)
  moves = ("copy", "copy-start", "transpose")

  def of_shape(line: str) -> bool:
    found = re.search(r"= \(?\w+\[([0-9,]*)\]", line)
    return found is not None and sorted(int(d) for d in found.group(1).split(",") if d) == dims

  def root_moves(name: str | None) -> bool:
    root = next((line for line in comps.get(name, []) if line.lstrip().startswith("ROOT")), "")
    return opcode(root) in moves

  def copy_of_shape(line: str) -> bool:
    op = opcode(line)
    moved = op in moves or (op == "fusion" and root_moves(_called(line, "calls")))
    return moved and of_shape(line)

  loops = [_called(line, "body") for line in comps.get(entry, []) if opcode(line) == "while"]
  return [sum(n for (op, _), n in tally(comps, body, keep=copy_of_shape).items()
              if op not in ("conditional", "while")) for body in loops]


def copies_of_shape(hlo_text: str, shape: tuple[int, ...]) -> int:
  """Copies of arrays of `shape` run in one iteration of the entry computation's heaviest loop
  (`copies_per_loop`'s largest): e.g. whole-KV-cache copies a decode step."""
  return max(copies_per_loop(hlo_text, shape), default=0)


_FRAME = re.compile(r'"([^"(]+)"\("([^"]+)":(\d+)')
# Helpers that only pass a lax.cond through: a site names the function that called them.
_PASS_THROUGH = ("switch",)


_PACKAGE = str(Path(__file__).resolve().parents[1]) + "/"  # .../jspec/


def _short(path: str) -> str:
  """jspec's files from the package root (sampling/verify.py), others by their name."""
  path = str(Path(path).resolve())
  return path[len(_PACKAGE):] if path.startswith(_PACKAGE) else path.rsplit("/", 1)[-1]


def control_flow_sites(module) -> dict[str, dict[str, int]]:
  """Where a lowered program's conditionals and while loops come from: {"conditional": {site:
  n}, "while": {site: n}}, each site "function (file:line)" of the innermost traced frame
  outside `_PASS_THROUGH` (a site inside a loop is listed once however often it runs).
  `module`: `jax.jit(f).lower(...).compiler_ir("stablehlo")`."""
  sites = {"conditional": collections.Counter(), "while": collections.Counter()}
  kinds = {"stablehlo.case": "conditional", "stablehlo.if": "conditional",
           "stablehlo.while": "while"}

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          kind = kinds.get(inner.name)
          if kind:
            frame = next((f for f in _FRAME.findall(str(inner.location))
                          if f[0] not in _PASS_THROUGH), None)
            where = "?" if frame is None else f"{frame[0]} ({_short(frame[1])}:{frame[2]})"
            sites[kind][where] += 1
          walk(inner)

  walk(module.operation)
  return {kind: dict(counter.most_common()) for kind, counter in sites.items()}
