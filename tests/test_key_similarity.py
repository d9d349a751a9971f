"""The key-similarity (KeyDiff) Pallas kernel: interpreted on CPU against its jnp reference, with
NaN in every slot past a row's length (a kernel that lets one into the mean is caught), and the
KeyDiff eviction it drives equal to the jnp one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.generate import generate
from jspec.kv.policy import KVPolicy
from jspec.models.llama import init_params
from jspec.pallas.key_similarity import key_similarity, key_similarity_reference
from tiny_models import SMALL_512


def nan_padded_keys(L, B, S, K, D, lengths, dtype=jnp.float32, seed=0):
  keys = jax.random.normal(jax.random.key(seed), (L, B, S, K, D), jnp.float32)
  used = (jnp.arange(S)[None, :] < jnp.asarray(lengths)[:, None])[None, :, :, None, None]
  return jnp.where(used, keys, jnp.nan).astype(dtype), used[..., 0]


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("L,B,S,K,D,block_s,lengths,dtype", [
    (2, 3, 128, 2, 16, 32, [100, 1, 128], jnp.float32),
    (1, 2, 256, 3, 128, 64, [7, 200], jnp.bfloat16),
    (3, 1, 64, 1, 32, 16, [33], jnp.float32),
])
def test_kernel_matches_reference_and_ignores_nan_past_lengths(L, B, S, K, D, block_s, lengths,
                                                               dtype, backend):
  if backend == "tpu" and (D % 128 or block_s % 8):
    pytest.skip("TPU tiles need head_dim % 128 == 0")
  keys, used = nan_padded_keys(L, B, S, K, D, lengths, dtype)
  n = jnp.asarray(lengths, jnp.int32)
  got = key_similarity(keys, n, block_s=block_s, interpret=True, backend=backend)
  want = key_similarity_reference(keys, n)
  assert got.shape == (L, B, S, K) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.where(used, got, 0), np.where(used, want, 0), rtol=2e-5,
                             atol=2e-6)
  assert np.isfinite(np.where(used, got, 0)).all()


@pytest.mark.parametrize("S,part", [(128, 32), (128, 64), (128, 128), (96, 32), (160, 32)])
def test_slices_of_a_head_add_up_to_its_anchor(S, part):
  """Several programs per head: lengths that end mid-slice, on a slice edge, before the second
  slice, and a full row; a slice that summed past its row's length (or skipped its last partial
  block) would move the anchor. 3 and 5 slices pad the sums to 4 and 8 (Triton's powers of two):
  padding that was not zero, or a slice left out, would too."""
  lengths = [45, 64, 3, S]
  keys, used = nan_padded_keys(2, 4, S, 2, 16, lengths)
  n = jnp.asarray(lengths, jnp.int32)
  got = key_similarity(keys, n, block_s=16, part=part, interpret=True, backend="gpu")
  np.testing.assert_allclose(np.where(used, got, 0),
                             np.where(used, key_similarity_reference(keys, n), 0), rtol=2e-5,
                             atol=2e-6)


def test_slice_size_divides_the_cache_in_whole_blocks():
  from jspec.pallas.key_similarity import slice_size
  assert slice_size(2048, 128) == 512 and slice_size(640, 64) == 320 and slice_size(640, 128) == 128
  assert slice_size(96, 32) == 96 and slice_size(8192, 64, target=1024) == 1024


def test_reference_is_minus_the_cosine_to_the_mean_unit_key():
  k = np.zeros((1, 1, 4, 1, 2), np.float32)
  k[0, 0, :, 0] = [[2, 0], [1, 0], [1, 0], [0, 9]]  # unit keys' mean (0.75, 0.25): norms ignored
  got = np.asarray(key_similarity_reference(jnp.asarray(k), jnp.asarray([4])))[0, 0, :, 0]
  mean = np.array([0.75, 0.25])
  want = [-(row @ mean) / np.linalg.norm(row) / np.linalg.norm(mean) for row in k[0, 0, :, 0]]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[3] > got[0]  # the odd key out scores highest: it is kept


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_s=40), "dividing the cache size"),
    (dict(block_s=8, backend="gpu"), "power of two"),
    (dict(block_s=16, part=40), "multiple of block_s"),
])
def test_bad_inputs_are_refused(kwargs, match):
  keys, _ = nan_padded_keys(1, 1, 96, 1, 16, [10])
  with pytest.raises(ValueError, match=match):
    key_similarity(keys, jnp.asarray([10]), interpret=True, **kwargs)
  with pytest.raises(ValueError, match="stacked cache"):
    key_similarity(keys[0], jnp.asarray([10]), interpret=True)


# The compiled kernel of the machine's accelerator: skipped on a CPU-only host (CI), run where the
# device tool lends a GPU.
ACCELERATOR = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")
needs_kernel = pytest.mark.skipif(not ACCELERATOR, reason="no compiled kernel on a CPU-only host")


@pytest.mark.skipif(ACCELERATOR, reason="a compiled kernel exists here")
def test_a_host_without_the_kernel_names_it_and_the_setting():
  keys, _ = nan_padded_keys(1, 1, 96, 1, 16, [10])
  with pytest.raises(ValueError, match="key_similarity .KVPolicy score_impl='pallas'.*"
                                       "has no compiled kernel.*pallas-interpret"):
    key_similarity(keys, jnp.asarray([10]))


@pytest.mark.parametrize("impl", ["pallas-interpret", pytest.param("pallas", marks=needs_kernel)])
def test_keydiff_eviction_with_the_kernel_equals_the_jnp_scores(impl):
  cfg = SMALL_512
  params = init_params(cfg, jax.random.key(0), scale=0.3)
  prompt = [int(x) for x in np.random.default_rng(0).integers(0, 97, 60)]
  outs = [generate(params, cfg, [prompt], max_new_tokens=8,
                   kv=KVPolicy("keydiff", budget=24, sinks=2, chunk=8, score_impl=score_impl,
                               evict_every=1),
                   record_top_k=2)
          for score_impl in ("xla", impl)]
  assert outs[0].sequences() == outs[1].sequences()
  np.testing.assert_allclose(outs[0].top_logprobs, outs[1].top_logprobs, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="scores KeyDiff only"):
    KVPolicy("h2o", budget=24, chunk=8, score_impl="pallas")


@pytest.mark.parametrize("S,block_s", [(640, 64), (2048, 128)])
def test_gpu_build_lowers_to_triton_for_a_long_cache(S, block_s):
  """Lowered for CUDA on this CPU machine (no GPU needed): the kernel must go to Triton. Left to
  pallas_call's default it went to Mosaic GPU, which refused both caches (a copy of 4 bytes, and
  273 KB of shared memory for the [S, D] keys) before a GPU ever ran it."""
  export = pytest.importorskip("jax.export")
  from jspec.pallas.key_similarity import _key_similarity, slice_size

  def lowered():
    part = slice_size(S, block_s)
    f = jax.jit(lambda k, n: _key_similarity(k, n, block_s, part, False, "gpu"))
    return export.export(f, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((2, 2, S, 3, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((2,), jnp.int32))

  try:
    text = lowered().mlir_module()
  except Exception as e:  # noqa: BLE001 - a lowering that fails is this test's failure
    pytest.fail(f"the GPU kernel does not lower for CUDA: {type(e).__name__}: {str(e)[:300]}")
  assert "__gpu$xla.gpu.triton" in text


@needs_kernel
@pytest.mark.parametrize("S,block_s,dtype", [(640, 64, jnp.bfloat16), (2048, 128, jnp.float32)])
def test_compiled_kernel_matches_reference(S, block_s, dtype):
  lengths = [S, S // 3, 5]
  keys, used = nan_padded_keys(2, 3, S, 3, 128, lengths, dtype)
  n = jnp.asarray(lengths, jnp.int32)
  got = key_similarity(keys, n, block_s=block_s)
  want = key_similarity_reference(keys, n)
  np.testing.assert_allclose(np.where(used, got, 0), np.where(used, want, 0), rtol=1e-4,
                             atol=1e-5)
