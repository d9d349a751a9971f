"""Launches per decode-loop iteration read off optimized HLO (jspec.bench.launches)."""

import re

import jax
import jax.numpy as jnp
import pytest

from jspec.bench.launches import control_flow_sites, loop_launches, source


def _program(layers: int, heavy_branch: bool):
  def run(x, w):  # x [4, 16], w [16, 16, 16]
    def step(s):
      i, x = s

      def layer(x, wl):
        return jnp.tanh(x @ wl), None

      x, _ = jax.lax.scan(layer, x, w[:layers])  # one dot per layer
      heavy = lambda x: jnp.sort(jnp.sort(x, axis=0) * 3.0, axis=1)
      light = lambda x: x * 2.0
      x = jax.lax.cond(x.sum() > 0, heavy if heavy_branch else light, light, x)
      return i + 1, x

    return jax.lax.while_loop(lambda s: s[0] < jnp.int32(10), step, (jnp.int32(0), x))[1]

  x, w = jnp.ones((4, 16)), jnp.ones((16, 16, 16))
  return jax.jit(run).lower(x, w).compile().as_text()


@pytest.mark.parametrize("layers", [4, 9])
def test_nested_loops_count_their_body_times_the_trip_count(layers):
  found = loop_launches(_program(layers, heavy_branch=False))
  dots = sum(n for where, n in found["by_source"].items() if where.endswith("dot_general"))
  assert dots == layers  # counting the scan's body once would give 1
  assert found["launches"] >= 2 * layers


def test_a_conditional_counts_its_largest_branch():
  light = loop_launches(_program(4, heavy_branch=False))
  heavy = loop_launches(_program(4, heavy_branch=True))
  assert heavy["by_op"].get("sort", 0) >= 1 and "sort" not in light["by_op"]
  assert heavy["launches"] > light["launches"]
  assert heavy["by_op"]["conditional"] == 1  # one lax.cond a loop iteration
  # Summing the branches instead of taking the largest would count the light one's work too.
  assert heavy["launches_smallest"] < heavy["launches"]


# Optimized-HLO text in the other spellings XLA prints: a pred conditional with true/false
# computations, and a loop whose trip count is not known (each iteration a predicate to the host).
_SYNTHETIC = """\
HloModule synthetic

%add_one (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %a = f32[4]{0} add(%p, %p), metadata={op_name="jit(run)/while/body/cond/branch_1_fun/add"}
}

%twice (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %m = f32[4]{0} multiply(%p, %p)
  %e = f32[4]{0} exponential(%m)
  ROOT %n = f32[4]{0} negate(%e)
}

%inner_body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%s), index=1
  %y = f32[4]{0} sine(%x)
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %y)
}

%inner_cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%s), index=1
  %c = f32[4]{0} conditional(%q, %x, %x), true_computation=%twice, false_computation=%add_one
  %w = (s32[], f32[4]{0}) while(%t0), condition=%inner_cond, body=%inner_body
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %c)
}

%cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_true_false_conditionals_and_loops_of_unknown_trip_count():
  found = loop_launches(_SYNTHETIC)
  # twice (3) + the conditional + the inner loop's predicate, body (sine) and condition (2 runs)
  assert found["launches"] == 3 + 1 + 1 + 1 + 2
  assert found["launches_smallest"] == 1 + 1 + 1 + 1 + 2  # add_one instead of twice
  assert found["host_syncs"] == 2  # the conditional, the inner loop


def test_a_program_without_a_loop_has_no_count():
  text = jax.jit(lambda x: jnp.tanh(x) @ x).lower(jnp.ones((4, 4))).compile().as_text()
  assert loop_launches(text)["launches"] is None


def test_source_drops_the_frames_every_body_instruction_shares():
  line = ('%f = f32[2]{0} fusion(%p), kind=kLoop, calls=%c, metadata={op_name="jit(run)/while/'
          'body/closed_call/attention/vmap()/scatter/inner" stack_frame_id=3}')
  assert source(line) == "attention/vmap()/scatter"
  assert source(line, depth=1) == "attention"
  assert source("%g = f32[2]{0} add(%a, %b)") == "?"
  branch = 'metadata={op_name="jit(run)/while/body/cond/branch_1_fun/branch_0_fun/verify/argmax"}'
  assert source(branch) == "verify/argmax"


def test_control_flow_sites_name_the_function_and_line():
  def pick(x, p):
    return jax.lax.cond(p > 0, lambda x: x * 2, lambda x: x + 1, x)

  def run(x, p):
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, pick(c[1], p)), (0, x))[1]

  sites = control_flow_sites(jax.jit(run).lower(jnp.ones(3), 1.0).compiler_ir("stablehlo"))
  (conditional,) = sites["conditional"]
  assert re.search(r"\bpick \(test_launches\.py:\d+\)$", conditional), conditional
  assert [w for w in sites["while"] if re.search(r"\brun \(test_launches\.py:\d+\)$", w)]


def test_host_syncs_along_the_smallest_branches():
  """A conditional nested in the larger branch syncs only when that branch runs."""
  def run(x, p, q, n):
    def body(i, x):
      return jax.lax.cond(p, lambda: jax.lax.cond(q, jnp.sin, jnp.cos, x) @ x, lambda: x + 1)
    return jax.lax.fori_loop(0, n, body, x)

  text = jax.jit(run).lower(jnp.ones((8, 8)), True, False, 3).compile().as_text()
  found = loop_launches(text)
  assert (found["host_syncs"], found["host_syncs_smallest"]) == (2, 1), found


def test_tally_counts_only_what_keep_accepts_through_loops_and_branches():
  from jspec.bench.launches import _called, computations, opcode, tally

  hlo = _program(9, heavy_branch=True)
  comps, entry = computations(hlo)
  body = next(_called(line, "body") for line in comps[entry] if opcode(line) == "while")
  dots = tally(comps, body, keep=lambda line: source(line).endswith("dot_general"))
  everything = tally(comps, body)
  control = {"conditional", "while"}
  assert sum(n for (op, _), n in dots.items() if op not in control) == 9  # the scan's, times 9
  assert all(where.endswith("dot_general") for op, where in dots if op not in control)
  assert sum(n for (op, _), n in dots.items() if op == "conditional") == 1  # followed, counted
  assert sum(everything.values()) > sum(dots.values())
