"""The KV cache write (`llama.write_slots`) happens in place: a decode step copies no whole cache,
whatever the layer layout. Two earlier forms did, on the CPU: a vmap over the stacked cache's batch
axis (4 copies a layer inside the layer scan) and the layer's slice written and put back where
the layers are unrolled (XLA fused the next layer's read against the old buffer)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jspec.bench.launches import copies_of_shape
from jspec.bench.programs import lower_decode
from jspec.kv.policy import KVPolicy
from jspec.models import llama
from jspec.models.llama import init_params, stack_layers
from jspec.sharding import Placement, rows_split, traced_under_placement
from test_speculative import TARGET

DEEP = dataclasses.replace(TARGET, num_layers=4)
CACHE = 64


@pytest.fixture(scope="module")
def layouts():
  params = init_params(DEEP, jax.random.key(3), scale=0.3)
  return {"unrolled": params, "stacked": stack_layers(params)}


def _whole_cache_copies(params) -> int:
  prompt = jnp.asarray([[3, 1, 4, 1, 5, 0, 0, 0]], jnp.int32)
  lowered, _ = lower_decode(params, DEEP, prompt, jnp.asarray([5]), jax.random.key(0),
                            max_new_tokens=8, cache_size=CACHE)
  shape = (DEEP.num_layers, 1, CACHE, DEEP.num_kv_heads, DEEP.head_dim)
  return copies_of_shape(lowered.compile().as_text(), shape)


@pytest.mark.parametrize("layout", ["unrolled", "stacked"])
def test_a_decode_step_copies_no_whole_cache(layouts, layout):
  if jax.default_backend() != "cpu":
    pytest.skip("the forms are chosen for XLA:CPU; a GPU's copies are the lease's cachewrite")
  jax.clear_caches()
  assert _whole_cache_copies(layouts[layout]) == 0


@pytest.mark.parametrize("layout,form", [("stacked", llama.write_rows_batched),
                                         ("unrolled", llama.write_layer_slice)])
def test_the_count_sees_the_copies_of_the_earlier_writes(layouts, layout, form, monkeypatch):
  """The control: each earlier form, in the layout where it copied, is counted (on a CPU; an
  accelerator's compiler lays the cache out its own way)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the copies are XLA:CPU's")
  monkeypatch.setattr(llama, "write_slots", form)
  jax.clear_caches()
  try:
    assert _whole_cache_copies(layouts[layout]) >= DEEP.num_layers
  finally:
    monkeypatch.undo()
    jax.clear_caches()  # no trace of the earlier form outlives the test


@pytest.mark.parametrize("method", ["keydiff", "h2o+caote"])
def test_evicting_every_token_copies_no_whole_cache_over_stacked_layers(layouts, method):
  """Under a KV budget the decode step also evicts: refilling the freed slots moves a few entries
  in place (compacting the whole cache, before session 38, copied it twice a step here)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the copies are XLA:CPU's")
  policy = KVPolicy(method, budget=32, sinks=2, chunk=16, evict_every=1)
  lowered, _ = lower_decode(layouts["stacked"], DEEP, jnp.zeros((1, 40), jnp.int32),
                            jnp.asarray([40]), jax.random.key(0), max_new_tokens=8, cache_size=0,
                            kv=policy)
  shape = (DEEP.num_layers, 1, policy.slots, DEEP.num_kv_heads, DEEP.head_dim)
  assert copies_of_shape(lowered.compile().as_text(), shape) == 0


@pytest.mark.parametrize("layer", [0, 2])
def test_every_form_writes_the_same_values_and_drops_slots_past_the_end(layer):
  L, B, S, K, D = 3, 2, 8, 2, 4
  cache = jax.random.normal(jax.random.key(0), (L, B, S, K, D))
  new = jax.random.normal(jax.random.key(1), (B, 3, K, D))
  slots = jnp.asarray([[1, 2, 3], [6, 7, 8]])  # row 1's last slot is past the end: dropped
  want = np.asarray(cache).copy()
  for b in range(B):
    for t in range(3):
      if slots[b, t] < S:
        want[layer, b, int(slots[b, t])] = np.asarray(new[b, t])
  forms = {"batched": llama.write_rows_batched, "slice": llama.write_layer_slice,
           "scatter": llama.write_one_scatter}
  for name, form in forms.items():
    np.testing.assert_array_equal(form(cache, layer, slots, new), want, err_msg=name)
    traced = jax.jit(form)(cache, jnp.int32(layer), slots, new)  # the layer as a traced index
    np.testing.assert_array_equal(traced, want, err_msg=name + " traced")
  # write_slots picks a form by layout (and placement): the values are the same
  np.testing.assert_array_equal(llama.write_slots(cache, layer, slots, new), want)
  np.testing.assert_array_equal(jax.jit(llama.write_slots)(cache, jnp.int32(layer), slots, new),
                                want)


def test_rows_split_reads_the_placement_being_traced():
  device = jax.devices()[0]
  mesh = lambda dp: Mesh(np.asarray([device] * dp).reshape(dp, 1), ("dp", "tp"))  # read only
  seen = {}

  @traced_under_placement
  def engine(name, placement=None):
    seen[name] = rows_split()

  engine("off a mesh")
  engine("dp=1", placement=Placement(mesh(1)))
  engine("dp=2", placement=Placement(mesh(2)))
  assert seen == {"off a mesh": False, "dp=1": False, "dp=2": True}
  assert rows_split() is False  # nothing is being traced now
