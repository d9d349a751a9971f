"""What a compiled program communicates: the collectives of its decode loop, read from the HLO.

XLA's SPMD partitioner decides where data moves; this reads its decisions back from the compiled
text (`jax.jit(f).lower(...).compile().as_text()`): every all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute, its buffer bytes and its group size, and which of them run once
per iteration of the decoding `while` loop. Collectives inside a `conditional` (a `lax.cond`
branch: sampling vs greedy, top-k/top-p filters on or off) are kept apart: only one branch runs.
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (" + "|".join(COLLECTIVES)
                 + r")(?:-start)?\((.*)$")
_SHAPE = re.compile(r"\b(pred|[sufb]f?\d+)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_PREDICATED = re.compile(r"(?:true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str  # "all-reduce", ...
  bytes: int  # the result buffer on one device
  group: int  # devices taking part in one group
  in_branch: bool  # inside a lax.cond branch (runs only when that branch is taken)
  repeats: int  # times per decode step (nested loops with a known trip count)
  depth: int = 0  # how many lax.cond branches it is nested in

  @property
  def wire_bytes(self) -> float:
    """Bytes one device sends for it in a ring algorithm (the usual cost model)."""
    n = self.group
    if n <= 1:
      return 0.0
    if self.op == "all-reduce":
      return 2 * (n - 1) / n * self.bytes
    if self.op == "collective-permute":
      return float(self.bytes)
    return (n - 1) / n * self.bytes * (n if self.op == "reduce-scatter" else 1)


def _shape_bytes(text: str, started: bool = False) -> int:
  """Bytes of a result shape; tuples sum, except an async `-start`'s (operand, result, context)
  tuple, which counts its largest element: the result."""
  sizes = []
  for dtype, dims in _SHAPE.findall(text):
    size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    sizes.append(size * _BYTES.get(dtype, 4))
  return max(sizes, default=0) if started else sum(sizes)


def _group_size(line: str, devices: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  if m:
    return 2
  return devices


def parse_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """{computation name: its lines}, and the ENTRY computation's name."""
  comps, entry, name = {}, "", None
  for line in hlo.splitlines():
    m = _HEADER.match(line)
    if m:
      name = m.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name is not None:
      if line.strip() == "}":
        name = None
      else:
        comps[name].append(line)
  return comps, entry


def _walk(comps, name, devices, depth, repeats, out, seen):
  if (name, depth) in seen or name not in comps:
    return
  seen.add((name, depth))
  for line in comps[name]:
    m = _OP.match(line)
    if m and "-done(" not in line:
      started = f"{m.group(2)}-start(" in line
      out.append(Collective(m.group(2), _shape_bytes(m.group(1), started),
                            _group_size(line, devices), depth > 0, repeats, depth))
    reps = repeats
    if " while(" in line:
      trip = _TRIP.search(line)
      reps = repeats * (int(trip.group(1)) if trip else 1)
    for callee in _CALLS.findall(line):
      _walk(comps, callee, devices, depth, reps, out, seen)
    for group in _BRANCHES.findall(line):
      for callee in re.findall(r"%?([\w.\-]+)", group):
        _walk(comps, callee, devices, depth + 1, repeats, out, seen)
    for callee in _PREDICATED.findall(line):
      _walk(comps, callee, devices, depth + 1, repeats, out, seen)


def compiled_engine(fn, *args, **static):
  """Engine `fn` (args: params, cfg, ...; every keyword static, `placement=` among them) compiled
  as jit compiles it: `.as_text()` is the HLO the functions here read."""
  import jax
  return jax.jit(fn, static_argnums=1, static_argnames=tuple(static)).lower(
      *args, **static).compile()


def decode_loop_collectives(hlo: str, devices: int) -> list[Collective]:
  """The collectives of one iteration of the program's decoding loop: the top-level `while` of
  the ENTRY computation with no known trip count (its exit depends on the tokens; XLA's own loops
  are counted) and the largest body."""
  comps, entry = parse_computations(hlo)
  loops = []
  for line in comps.get(entry, []):
    if " while(" in line and not _TRIP.search(line):
      body = re.search(r"body=%?([\w.\-]+)", line).group(1)
      cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
      loops.append((len("\n".join(comps.get(body, []))), body, cond))
  if not loops:
    raise ValueError("no data-dependent while loop in the program's ENTRY computation")
  out: list[Collective] = []
  _, body, cond = max(loops)
  seen: set = set()
  for name in (cond, body):  # the exit test (e.g. "every row done?" over dp) runs each step too
    _walk(comps, name, devices, 0, 1, out, seen)
  return out


def program_collectives(hlo: str, devices: int) -> list[Collective]:
  """Every collective of a whole program (ENTRY and what it calls), loops counted by their known
  trip counts."""
  comps, entry = parse_computations(hlo)
  out: list[Collective] = []
  _walk(comps, entry, devices, 0, 1, out, set())
  return out


def summarize(collectives: list[Collective]) -> dict:
  """Counts and bytes per step: always (outside any branch) and in branches (upper bound)."""
  def total(cs, field):
    return sum(getattr(c, field) * c.repeats for c in cs)
  always = [c for c in collectives if not c.in_branch]
  branch = [c for c in collectives if c.in_branch]
  return {
      "collectives": sum(c.repeats for c in always), "bytes": total(always, "bytes"),
      "wire_bytes": round(total(always, "wire_bytes")),
      "by_op": {op: sum(c.repeats for c in always if c.op == op) for op in COLLECTIVES
                if any(c.op == op for c in always)},
      "branch_collectives": sum(c.repeats for c in branch), "branch_bytes": total(branch, "bytes"),
  }
