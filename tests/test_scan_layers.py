"""Stacked layers (`llama.stack_layers`, `--scan-layers`): the decoder as one `lax.scan` computes
what the unrolled loop computes (logits, cache, taps, a layer subset, attention records), the
engines stay lossless over it (greedy speculative == greedy autoregressive, chains, trees, layer
skipping, probing, an evicting cache), jspec's CPU kernels read a traced layer of the stacked
weights in place, a program holds one layer whatever the depth, and the Pallas attention, which
needs a static layer, is refused."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench.profiling import CompileCounter
from jspec.drafting.model import ModelDrafter, early_exit_drafter
from jspec.drafting.probe import probe_drafter
from jspec.drafting.skip import layer_influence, skip_drafter
from jspec.generate import generate
from jspec.kv.policy import KVPolicy
from jspec.models.cache import KVCache
from jspec.models.llama import (first_layers, forward, forward_layers, forward_visible, init_params,
                                layer_list, layers_stacked, native_float_params, num_layers,
                                param_layout, quantize_params, stack_layers, unstack_layers)
from jspec.sharding import is_spec
from jspec.speculative.chain import SpecConfig, speculative_generate
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from test_speculative import PROMPTS, TARGET

DEEP = dataclasses.replace(TARGET, num_layers=4)
TOKENS = jnp.asarray([[4, 8, 15, 16, 23, 42], [1, 2, 3, 5, 8, 13]])
POSITIONS = jnp.broadcast_to(jnp.arange(6), (2, 6))


@pytest.fixture(scope="module")
def unrolled():
  return init_params(DEEP, jax.random.key(3), scale=0.3)


@pytest.fixture(scope="module")
def stacked(unrolled):
  return stack_layers(unrolled)


def close(a, b, atol=1e-4):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-4)


def test_stacking_round_trips_and_matches_the_stacked_layout(unrolled, stacked):
  assert layers_stacked(stacked) and not layers_stacked(unrolled)
  assert num_layers(stacked) == num_layers(unrolled) == 4
  assert stacked.layers.wq.shape == (4, *unrolled.layers[0].wq.shape)
  for a, b in zip(layer_list(stacked), unrolled.layers):
    close(a, b, atol=0)
  close(unstack_layers(stacked), unrolled, atol=0)
  close(first_layers(stacked, 3), stack_layers(first_layers(unrolled, 3)), atol=0)
  assert num_layers(first_layers(stacked, 3)) == 3
  assert first_layers(unrolled, 2).layers[1] is unrolled.layers[1]  # unrolled: shared, no copy
  shapes = lambda tree: jax.tree.map(lambda s: s.shape, tree, is_leaf=is_spec)
  assert shapes(param_layout(DEEP, stacked=True)) == jax.tree.map(lambda a: a.shape, stacked)


@pytest.mark.parametrize("taps", [(), (1, 3), (3, 0, 4)])
def test_the_scan_computes_what_the_unrolled_layers_compute(unrolled, stacked, taps):
  want = forward(unrolled, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8), taps=taps)
  got = forward(stacked, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8), taps=taps)
  close(got, want)
  # The cache holds every layer's new entries, each in its own layer.
  assert all(float(jnp.abs(got[2].k[i]).max()) > 0 for i in range(4))


def test_the_scan_keeps_only_the_tapped_streams(stacked):
  """Taps ride in a [len(taps), B, T, E] buffer, not as every layer's stream [L, B, T, E] (at a
  long prefill of a 1.5B model those would be gigabytes)."""
  f = lambda p: forward(p, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8), taps=(1, 3))
  (scan,) = [e for e in jax.make_jaxpr(f)(stacked).jaxpr.eqns if e.primitive.name == "scan"]
  shapes = [v.aval.shape for v in scan.outvars]
  E = DEEP.hidden_size
  assert (2,) + TOKENS.shape + (E,) in shapes
  assert not [s for s in shapes if s[:1] == (4,) and s[-1:] == (E,)], shapes


@pytest.mark.parametrize("keep", [(0, 2, 3), (3, 0, 2, 2)])
def test_a_layer_subset_leaves_the_skipped_layers_alone(unrolled, stacked, keep):
  want = forward_layers(unrolled, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8), keep)
  got = forward_layers(stacked, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8), keep)
  close(got, want)
  assert float(jnp.abs(got[1].k[1]).max()) == 0.0  # layer 1 ran as the identity
  np.testing.assert_allclose(layer_influence(stacked, DEEP, [4, 8, 15, 16]),
                             layer_influence(unrolled, DEEP, [4, 8, 15, 16]), atol=1e-5)


def _primitives(jaxpr) -> list[str]:
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names += _primitives(sub)
  return names


def test_a_layer_subset_scans_the_kept_layers_without_conditionals(stacked):
  """A skip draft step runs len(keep) scan iterations and no lax.cond: on a GPU each conditional
  sends its predicate to the host (30 round trips a draft step of the default model)."""
  keep = (0, 2, 3)
  f = lambda p: forward_layers(p, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8), keep)
  jaxpr = jax.make_jaxpr(f)(stacked).jaxpr
  assert "cond" not in _primitives(jaxpr)
  (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  assert scan.params["length"] == len(keep)


@pytest.mark.parametrize("keep,taps", [((0, 2, 3), (1, 3)), ((0, 2, 3), (0, 4)),
                                       ((0, 1), (3, 2, 1))])  # taps past the last kept layer
def test_a_layer_subset_with_taps_matches_the_unrolled_layers(unrolled, stacked, keep, taps):
  slots = POSITIONS
  visible = jnp.broadcast_to(jnp.tril(jnp.ones((6, 8), bool)), (2, 6, 8))
  run = lambda p: forward_visible(p, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8), slots,
                                  visible, layers=keep, taps=taps)
  close(run(stacked), run(unrolled))


def test_attention_records_come_out_per_layer(unrolled, stacked):
  """H2O's attention mass is recorded by the attention of each layer: the scan returns one
  record per layer, in layer order (a scan that dropped or reordered them fails)."""
  cache = dataclasses.replace(KVCache.init(DEEP, 2, 8),
                              mass=jnp.zeros((4, 2, 8, DEEP.num_kv_heads), jnp.float32))
  weights = jnp.ones((2, 6), jnp.float32)
  want = forward(unrolled, DEEP, TOKENS, POSITIONS, cache, mass_weights=weights)[2].mass
  got = forward(stacked, DEEP, TOKENS, POSITIONS, cache, mass_weights=weights)[2].mass
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  assert not np.allclose(np.asarray(want[0]), np.asarray(want[3]), atol=1e-3)


def test_greedy_speculative_equals_greedy_autoregressive_over_stacked_layers(unrolled, stacked):
  noise = init_params(DEEP, jax.random.key(1), scale=0.3)
  drafter = ModelDrafter(stack_layers(jax.tree.map(
      lambda a, b: a + 0.5 * b if a.ndim > 1 else a, unrolled, noise)), DEEP)
  want = generate(stacked, DEEP, PROMPTS, max_new_tokens=16).sequences()
  # Stacked and unrolled layers round differently in the last bits, never by a token here.
  assert generate(unrolled, DEEP, PROMPTS, max_new_tokens=16).sequences() == want
  chains = {"model": drafter, "early-exit": early_exit_drafter(stacked, DEEP, 2),
            "skip": skip_drafter(stacked, DEEP, (0, 3)), "mtp": probe_drafter(stacked, DEEP, 3)}
  for name, d in chains.items():
    out = speculative_generate(stacked, DEEP, d, PROMPTS,
                               spec=SpecConfig(gamma=3, max_new_tokens=16))
    assert out.sequences() == want, name
  tree = tree_speculative_generate(stacked, DEEP, drafter, PROMPTS,
                                   spec=TreeSpecConfig(tree="dynamic:8", max_new_tokens=16))
  assert tree.sequences() == want


# A key-scored policy with jspec's CPU kernels, an attention-scored one with XLA's (not the other
# two pairs, for the suite's time).
@pytest.mark.parametrize("method, kernels", [("keydiff", "native"), ("h2o+caote", "xla")])
def test_an_evicting_cache_over_stacked_layers_stays_lossless(unrolled, stacked, method, kernels):
  if kernels == "native":
    if jax.default_backend() != "cpu":
      pytest.skip("jspec's CPU kernels")
    stacked = stack_layers(native_float_params(unrolled))
  rng = np.random.default_rng(11)
  prompts = [[int(x) for x in rng.integers(0, 64, 30)], [int(x) for x in rng.integers(0, 64, 9)]]
  policy = KVPolicy(method, budget=16, sinks=2, chunk=8, evict_every=2)
  want = generate(stacked, DEEP, prompts, max_new_tokens=16, kv=policy).sequences()
  out = speculative_generate(stacked, DEEP, early_exit_drafter(stacked, DEEP, 2), prompts,
                             kv=policy, spec=SpecConfig(gamma=3, max_new_tokens=16))
  assert out.sequences() == want


def test_one_layer_is_traced_whatever_the_depth():
  """What makes the scan compile fast: the program holds one layer's matmuls, not L."""
  def dots(cfg, params):
    jaxpr = jax.make_jaxpr(lambda p: forward(p, cfg, TOKENS, POSITIONS,
                                             KVCache.init(cfg, 2, 8))[0])(params)
    return str(jaxpr).count("dot_general")
  counts = {}
  for L in (2, 6):
    cfg = dataclasses.replace(TARGET, num_layers=L)
    params = init_params(cfg, jax.random.key(0))
    counts[L] = (dots(cfg, params), dots(cfg, stack_layers(params)))
  assert counts[2][1] == counts[6][1]  # stacked: independent of depth
  assert counts[6][0] > counts[2][0]  # unrolled: grows with it


def test_repeated_calls_do_not_recompile(stacked):
  generate(stacked, DEEP, [[1, 2, 3]], max_new_tokens=6)
  with CompileCounter() as counter:
    for prompt in ([4, 5, 6, 7, 8], [9] * 11):
      jax.block_until_ready(generate(stacked, DEEP, [prompt], max_new_tokens=6).tokens)
  assert counter.compiles == 0


NATIVE_FORMATS = {"float32": native_float_params,
                  "int8": lambda p: quantize_params(p, "native"),
                  "q4": lambda p: quantize_params(p, "native", bits=4)}


@pytest.mark.parametrize("fmt", NATIVE_FORMATS)
def test_the_cpu_kernels_read_a_traced_layer_of_stacked_weights(unrolled, fmt):
  """jspec's CPU kernels over stacked layers: the same numbers as unrolled, stacking before or
  after the conversion, and lossless chains and trees over it."""
  if jax.default_backend() != "cpu":
    pytest.skip("jspec's CPU kernels")
  convert = NATIVE_FORMATS[fmt]
  flat, stacked = convert(unrolled), stack_layers(convert(unrolled))
  assert layers_stacked(convert(stack_layers(unrolled)))
  run = lambda p: forward(p, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8))
  want, got = run(flat), run(stacked)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got[2].k), np.asarray(want[2].k), atol=2e-5, rtol=1e-5)
  after = run(convert(stack_layers(unrolled)))[0]
  np.testing.assert_array_equal(np.asarray(after), np.asarray(got[0]))
  # Each layer's own weights: reading one layer for all (a kernel ignoring `layer`) fails this.
  same = stack_layers(dataclasses.replace(flat, layers=(flat.layers[0],) * 4))
  assert not np.allclose(np.asarray(run(same)[0]), np.asarray(got[0]), atol=1e-3)
  ar = generate(stacked, DEEP, PROMPTS, max_new_tokens=12).sequences()
  assert generate(flat, DEEP, PROMPTS, max_new_tokens=12).sequences() == ar
  for d in (skip_drafter(stacked, DEEP, (0, 3)), probe_drafter(stacked, DEEP, 3)):
    chain = speculative_generate(stacked, DEEP, d, PROMPTS,
                                 spec=SpecConfig(gamma=3, max_new_tokens=12))
    assert chain.sequences() == ar
  tree = tree_speculative_generate(stacked, DEEP, early_exit_drafter(stacked, DEEP, 2), PROMPTS,
                                   spec=TreeSpecConfig(tree="dynamic:6", max_new_tokens=12))
  assert tree.sequences() == ar


def test_stacked_cpu_kernel_weights_are_read_in_place(unrolled):
  """The scan hands the kernels the whole stacked weight and the traced layer: no weight is
  sliced out (XLA's dots slice every layer's weights each step, the whole model's bytes)."""
  if jax.default_backend() != "cpu":
    pytest.skip("jspec's CPU kernels")
  f = lambda p: forward(p, DEEP, TOKENS[:, :1], POSITIONS[:, :1], KVCache.init(DEEP, 2, 8))[0]
  def slices(params):
    hlo = jax.jit(f).lower(params).as_text()
    return sum(line.count("dynamic_slice") for line in hlo.splitlines())
  stacked_native, stacked_xla = stack_layers(native_float_params(unrolled)), stack_layers(unrolled)
  # XLA's dots: one slice per weight and norm; the kernels' weights: only the norms'.
  assert slices(stacked_xla) - slices(stacked_native) >= 7, slices(stacked_native)


def test_gradients_through_the_cpu_kernels_at_a_traced_layer(unrolled):
  """The kernels' custom gradients over stacked weights equal the unrolled ones, layer by layer."""
  if jax.default_backend() != "cpu":
    pytest.skip("jspec's CPU kernels")
  flat = native_float_params(unrolled)
  loss = lambda p: jnp.sum(forward(p, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8))[0] ** 2)
  grad = jax.jit(jax.grad(loss))  # op by op: 229 programs
  want, got = grad(flat), grad(stack_layers(flat))
  for a, b in zip(layer_list(got), want.layers, strict=True):
    close(a, b, atol=1e-3)
  assert float(jnp.abs(got.layers.wq.stored[3]).max()) > 0  # the last layer's own gradient


def test_formats_that_need_a_static_layer_are_refused(unrolled, stacked):
  interpreted = dataclasses.replace(DEEP, attention_impl="pallas-interpret")
  with pytest.raises(ValueError, match="attention_impl='xla'"):
    forward(stacked, interpreted, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 16))
  # int8 on XLA's dot scans (its per-token attention reads a traced layer like any other).
  int8 = stack_layers(quantize_params(unrolled, "xla"))
  got = forward(int8, DEEP, TOKENS, POSITIONS, KVCache.init(DEEP, 2, 8))[0]
  want = forward(quantize_params(unrolled, "xla"), DEEP, TOKENS, POSITIONS,
                 KVCache.init(DEEP, 2, 8))[0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
