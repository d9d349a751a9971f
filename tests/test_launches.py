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
  assert heavy["conditionals"] == 1  # one lax.cond a loop iteration


def test_a_program_without_a_loop_has_no_count():
  text = jax.jit(lambda x: jnp.tanh(x) @ x).lower(jnp.ones((4, 4))).compile().as_text()
  assert loop_launches(text)["launches"] is None


def test_source_drops_the_frames_every_body_instruction_shares():
  line = ('%f = f32[2]{0} fusion(%p), kind=kLoop, calls=%c, metadata={op_name="jit(run)/while/'
          'body/closed_call/attention/vmap()/scatter/inner" stack_frame_id=3}')
  assert source(line) == "attention/vmap()/scatter"
  assert source(line, depth=1) == "attention"
  assert source("%g = f32[2]{0} add(%a, %b)") == "?"


def test_control_flow_sites_name_the_function_and_line():
  def pick(x, p):
    return jax.lax.cond(p > 0, lambda x: x * 2, lambda x: x + 1, x)

  def run(x, p):
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, pick(c[1], p)), (0, x))[1]

  sites = control_flow_sites(jax.jit(run).lower(jnp.ones(3), 1.0).compiler_ir("stablehlo"))
  (conditional,) = sites["conditional"]
  assert re.search(r"\bpick \(test_launches\.py:\d+\)$", conditional), conditional
  assert [w for w in sites["while"] if re.search(r"\brun \(test_launches\.py:\d+\)$", w)]
