"""The KV cache write (`llama.write_slots`) happens in place: a decode step copies no whole cache,
whatever the layer layout. Two earlier forms did, on the CPU: a vmap over the stacked cache's batch
axis (4 copies a layer inside the layer scan) and the layer's slice written and put back where
the layers are unrolled (XLA fused the next layer's read against the old buffer)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jspec.bench.launches import copies_of_shape
from jspec.bench.programs import lower_decode
from jspec.models import llama
from jspec.models.llama import init_params, stack_layers
from test_speculative import TARGET

DEEP = dataclasses.replace(TARGET, num_layers=4)
CACHE = 64


def _vmap_over_the_batch(cache, layer, slots, new, by_row):
  write = lambda c, s, n: c.at[layer, s].set(n.astype(c.dtype), mode="drop")
  return jax.vmap(write, in_axes=(1, 0, 0), out_axes=1)(cache, slots, new)


def _slice_put_back(cache, layer, slots, new, by_row):
  write = lambda c, s, n: c.at[s].set(n.astype(c.dtype), mode="drop")
  own = jax.vmap(write)(jax.lax.dynamic_index_in_dim(cache, layer, keepdims=False), slots, new)
  return jax.lax.dynamic_update_index_in_dim(cache, own, layer, 0)


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
  jax.clear_caches()
  assert _whole_cache_copies(layouts[layout]) == 0


@pytest.mark.parametrize("layout,form", [("stacked", _vmap_over_the_batch),
                                         ("unrolled", _slice_put_back)])
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
