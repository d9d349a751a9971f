"""tree_attention: both kernels (GPU/Triton and TPU/Mosaic programs, run in the Pallas interpreter)
equal the jnp reference on ragged rows with random trees and causal masks, never touch the NaN
slots past lengths + T, reject bad inputs with clear errors, and lower for cuda and tpu."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench.kernel import random_tree_masks
from jspec.models import attention
from jspec.pallas.tree_attention import BlockSizes, tree_attention, tree_attention_reference

BACKEND_BLOCK_K = {"gpu": 32, "tpu": 128}  # small GPU blocks: the window straddles up to 3 blocks
# eager jnp compiles every primitive per shape, which would dominate run time: jit once instead
reference = jax.jit(tree_attention_reference)
model_attention = jax.jit(lambda q, k, v, lengths, mask: attention.masked_attention(
    q, k, v, attention.attention_mask(lengths, k.shape[1], mask, q.shape[1])))
# (D, H, K, T): every pair of head_dim, GQA ratio (G=1, G=3) and tree size appears at least once
TREE_CASES = [(64, 6, 2, 8), (64, 4, 4, 32), (64, 6, 2, 64),
              (128, 4, 4, 8), (128, 6, 2, 32), (128, 4, 4, 64)]


def make_inputs(B, S, H, K, D, T, block_k, dtype=jnp.float32, seed=0):
  """q, k, v, lengths, tree masks; rows: empty prefix, window across a block edge, nearly full."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, H, D))
  k = rng.standard_normal((B, S, K, D))
  v = rng.standard_normal((B, S, K, D))
  lengths = np.array([0, max(1, block_k - T // 2 - 1), S - T - 1][:B] + [S // 3] * (B - 3))
  for b in range(B):  # any slot at or past lengths + T that reaches the output (0 * NaN) is NaN
    k[b, lengths[b] + T:] = np.nan
    v[b, lengths[b] + T:] = np.nan
  cast = lambda x: jnp.asarray(x, dtype)
  masks = jnp.asarray(random_tree_masks(rng, B, T))  # [B, T, T]
  return cast(q), cast(k), cast(v), jnp.asarray(lengths, jnp.int32), masks


def run_kernel(q, k, v, lengths, mask, backend, block_k):
  return tree_attention(q, k, v, lengths, mask, block_sizes=BlockSizes(block_k=block_k),
                        interpret=True, backend=backend)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("D,H,K,T", TREE_CASES)
def test_tree_mask_matches_reference(backend, D, H, K, T):
  block_k = BACKEND_BLOCK_K[backend]
  q, k, v, lengths, mask = make_inputs(3, 256 if backend == "gpu" else 384, H, K, D, T, block_k)
  out = run_kernel(q, k, v, lengths, mask, backend, block_k)
  want = reference(q, k, v, lengths, mask)
  assert bool(jnp.isfinite(out).all())
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("H,K,D,T", [(8, 2, 64, 32), (6, 2, 128, 8)])
def test_causal_matches_reference(backend, H, K, D, T):
  block_k = BACKEND_BLOCK_K[backend]
  q, k, v, lengths, _ = make_inputs(4, 384, H, K, D, T, block_k, seed=1)
  out = run_kernel(q, k, v, lengths, None, backend, block_k)
  np.testing.assert_allclose(out, reference(q, k, v, lengths, None),
                             atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_bfloat16(backend):
  block_k = BACKEND_BLOCK_K[backend]
  q, k, v, lengths, mask = make_inputs(3, 256, 8, 2, 64, 32, block_k, jnp.bfloat16, seed=2)
  out = run_kernel(q, k, v, lengths, mask, backend, block_k)
  assert out.dtype == jnp.bfloat16
  want = reference(q, k, v, lengths, mask)
  np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=3e-2, rtol=3e-2)


def test_explicit_block_q_and_default_backend():
  """Several query blocks per kv head (block_q < T*G); backend=None interprets the GPU kernel."""
  q, k, v, lengths, mask = make_inputs(2, 128, 6, 2, 64, 32, 32, seed=3)
  want = reference(q, k, v, lengths, mask)
  for kwargs in ({"backend": "gpu", "block_sizes": BlockSizes(32, block_q=16)},
                 {"backend": "tpu", "block_sizes": BlockSizes(128, block_q=24)},
                 {"block_sizes": BlockSizes(64)}):
    out = tree_attention(q, k, v, lengths, mask, interpret=True, **kwargs)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=str(kwargs))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_stacked_cache_layer(backend):
  """layer=i reads layer i of a stacked [L, B, S, K, D] cache in place."""
  block_k = BACKEND_BLOCK_K[backend]
  q, k, v, lengths, mask = make_inputs(3, 256, 6, 2, 64, 8, block_k, seed=6)
  k_all = jnp.stack([jnp.full_like(k, jnp.nan), k, jnp.full_like(k, jnp.nan)])  # [L, B, S, K, D]
  v_all = jnp.stack([jnp.full_like(v, jnp.nan), v, jnp.full_like(v, jnp.nan)])
  out = tree_attention(q, k_all, v_all, lengths, mask, block_sizes=BlockSizes(block_k),
                       interpret=True, backend=backend, layer=1)
  np.testing.assert_allclose(out, reference(q, k, v, lengths, mask), atol=2e-5, rtol=2e-5)


def test_reference_is_the_models_attention():
  """The reference equals attention.masked_attention under attention.attention_mask (finite
  caches)."""
  B, S, H, K, D, T = 3, 96, 6, 2, 64, 16
  q, k, v, lengths, mask = make_inputs(B, S, H, K, D, T, 32, seed=4)
  k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
  for m in (mask, None):
    want = model_attention(q, k, v, lengths, m)
    np.testing.assert_allclose(reference(q, k, v, lengths, m), want,
                               atol=2e-5, rtol=2e-5)


def test_nan_poison_is_effective():
  """Attention that touches the unused slots at all (as _attend does) is NaN on these inputs."""
  B, S, H, K, D, T = 3, 96, 4, 4, 64, 8
  q, k, v, lengths, mask = make_inputs(B, S, H, K, D, T, 32, seed=5)
  naive = model_attention(q, k, v, lengths, mask)
  assert bool(jnp.isnan(naive).all())


def _shapes(B=2, T=8, H=4, K=2, D=64, S=256, dtype=jnp.float32):
  return (jnp.zeros((B, T, H, D), dtype), jnp.zeros((B, S, K, D), dtype),
          jnp.zeros((B, S, K, D), dtype), jnp.zeros((B,), jnp.int32), jnp.ones((B, T, T), bool))


def _replace(args, i, x):
  return args[:i] + (x,) + args[i + 1:]


BAD_INPUTS = [
    ("q 3-d", lambda a: _replace(a, 0, a[0][0]), {}, r"q must be \[B, T, H, D\]"),
    ("v shape", lambda a: _replace(a, 2, a[2][:, :128]), {}, r"v must have the shape of k"),
    ("batch", lambda a: _replace(a, 0, a[0][:1]), {}, r"q has batch 1 but the cache k has batch 2"),
    ("head_dim", lambda a: _replace(a, 0, jnp.zeros((2, 8, 4, 32))), {}, r"head_dim 32 but k/v"),
    ("gqa", lambda a: _replace(a, 0, jnp.zeros((2, 8, 3, 64))), {}, r"H=3 must be a multiple of"),
    ("dtype mix", lambda a: _replace(a, 0, a[0].astype(jnp.bfloat16)), {}, r"share one dtype"),
    ("int q", lambda a: _replace(a, 0, a[0].astype(jnp.int32)), {}, r"q has dtype int32"),
    ("lengths", lambda a: _replace(a, 3, jnp.zeros((3,), jnp.int32)), {}, r"lengths must be"),
    ("mask shape", lambda a: _replace(a, 4, jnp.ones((2, 8, 9), bool)), {},
     r"tree_mask must be \[B, T, T\]"),
    ("mask dtype", lambda a: _replace(a, 4, jnp.ones((2, 8, 8), jnp.int32)), {},
     r"tree_mask must be bool"),
    ("mask diagonal", lambda a: _replace(a, 4, ~jnp.eye(8, dtype=bool)[None].repeat(2, 0)), {},
     r"tree_mask must let every new token see itself"),
    ("past the cache", lambda a: _replace(a, 3, jnp.asarray([0, 250], jnp.int32)), {},
     r"lengths \+ T must be <= the cache size S=256"),
    ("block_k divides S", lambda a: a, {"block_sizes": BlockSizes(96)},
     r"block_k=96 does not divide the cache size S=256"),
    ("tpu block_k", lambda a: a, {"block_sizes": BlockSizes(64), "backend": "tpu"},
     r"multiple of 128 on TPU"),
    ("gpu block_q", lambda a: a, {"block_sizes": BlockSizes(128, block_q=24)},
     r"block_q=24 must be a power of two"),
    ("tpu block_q", lambda a: a, {"block_sizes": BlockSizes(128, block_q=12), "backend": "tpu"},
     r"block_q=12 must be a multiple of 8 on TPU"),
    ("gpu head_dim", lambda a: tuple(x if i > 2 else jnp.zeros(x.shape[:-1] + (96,))
                                     for i, x in enumerate(a)), {}, r"D=96 is not supported"),
    ("backend", lambda a: a, {"backend": "cuda"}, r"backend must be one of"),
    ("stacked without layer", lambda a: _replace(_replace(a, 1, a[1][None]), 2, a[2][None]), {},
     r"for the stacked \[L, B, S, K, D\] cache pass layer=i"),
    ("layer without stack", lambda a: a, {"layer": 0}, r"k must be the stacked cache"),
    ("layer range", lambda a: _replace(_replace(a, 1, a[1][None]), 2, a[2][None]), {"layer": 1},
     r"layer must be a Python int in \[0, 1\)"),
]


@pytest.mark.parametrize("name,edit,kwargs,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_validation_errors(name, edit, kwargs, message):
  kwargs = {"interpret": True, "backend": "gpu", **kwargs}
  with pytest.raises(ValueError, match=message):
    tree_attention(*edit(_shapes()), **kwargs)


def test_block_sizes_validated():
  with pytest.raises(ValueError, match="block_k must be a positive int"):
    BlockSizes(0)
  with pytest.raises(ValueError, match="block_q must be a positive int or None"):
    BlockSizes(128, block_q=-8)


def test_no_kernel_for_cpu_without_interpret():
  if jax.default_backend() != "cpu":
    pytest.skip("only meaningful on a CPU-only host")
  with pytest.raises(ValueError, match="no compiled kernel for platform 'cpu'"):
    tree_attention(*_shapes())


def _export(platform, backend, D, H=6, K=2, T=32, dtype=jnp.bfloat16, layer=None):
  """StableHLO text of tree_attention exported for `platform` from abstract inputs."""
  args = _shapes(T=T, H=H, K=K, D=D, S=512, dtype=dtype)
  if layer is not None:  # a stacked cache of 4 layers
    args = _replace(_replace(args, 1, jnp.stack([args[1]] * 4)), 2, jnp.stack([args[2]] * 4))
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
  checks = []
  if platform == "cuda":  # Triton kernels have no cross-version stability promise; fine here
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  f = jax.jit(functools.partial(tree_attention, backend=backend, layer=layer))
  return jax.export.export(f, platforms=(platform,), disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("D,dtype,layer", [(64, jnp.bfloat16, None), (64, jnp.float32, 2),
                                           (128, jnp.bfloat16, 2), (128, jnp.float32, None)])
def test_lowers_for_tpu(D, dtype, layer):
  text = _export("tpu", "tpu", D, dtype=dtype, layer=layer)
  assert re.findall(r"custom_call @(\S+)\(", text) == ["tpu_custom_call"]
  assert 'kernel_name = "tree_attention_tpu"' in text


@pytest.mark.parametrize("D,dtype,layer", [(64, jnp.bfloat16, None), (64, jnp.float32, 2),
                                           (128, jnp.bfloat16, 2), (128, jnp.float32, None)])
def test_lowers_for_cuda_triton(D, dtype, layer):
  text = _export("cuda", "gpu", D, dtype=dtype, layer=layer)
  assert re.findall(r"custom_call @(\S+)\(", text) == ["__gpu$xla.gpu.triton"]
  assert 'name = "tree_attention_gpu"' in text


# The compiled kernel of the machine's accelerator against the reference: skipped on a CPU-only
# host (there the interpreted kernels above stand in). On an accelerator the suite runs in exact
# precision (conftest), so float32 is held to float32 tolerances.
NATIVE = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend())
needs_kernel = pytest.mark.skipif(NATIVE is None, reason="no compiled kernel on a CPU-only host")


@needs_kernel
@pytest.mark.parametrize("D,H,K,T", TREE_CASES[:3])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_compiled_kernel_matches_reference(D, H, K, T, dtype, tol):
  block_k = BACKEND_BLOCK_K[NATIVE]
  q, k, v, lengths, mask = make_inputs(3, 384, H, K, D, T, block_k, dtype, seed=3)
  out = jax.jit(functools.partial(tree_attention, block_sizes=BlockSizes(block_k=block_k)))(
      q, k, v, lengths, mask)
  assert out.dtype == dtype and bool(jnp.isfinite(out.astype(jnp.float32)).all())
  np.testing.assert_allclose(out.astype(np.float32), reference(q, k, v, lengths, mask)
                             .astype(np.float32), atol=tol, rtol=tol)


@needs_kernel
def test_compiled_kernel_reads_a_stacked_cache_causally():
  block_k = BACKEND_BLOCK_K[NATIVE]
  q, k, v, lengths, _ = make_inputs(4, 384, 8, 2, 64, 32, block_k, seed=4)
  k_all, v_all = jnp.stack([k * 0.5, k]), jnp.stack([v * 0.5, v])  # layer 1 is (k, v)
  out = jax.jit(functools.partial(tree_attention, block_sizes=BlockSizes(block_k=block_k),
                                  layer=1))(q, k_all, v_all, lengths, None)
  np.testing.assert_allclose(out, reference(q, k, v, lengths, None), atol=2e-5, rtol=2e-5)


def test_gpu_tiles_fit_shared_memory():
  """float32 tiles at full precision need twice the bytes (an H100 refused 262,656 of 232,448 for
  block_k=128, W=64, two stages): stages are cut, then block_k halved, never silently too big."""
  from jspec.pallas.tree_attention import _gpu_tiles
  h100 = 232448
  assert _gpu_tiles(128, 64, jnp.bfloat16, h100) == (128, 2)
  assert _gpu_tiles(128, 128, jnp.bfloat16, h100) == (128, 2)
  assert _gpu_tiles(128, 64, jnp.float32, h100) == (128, 1)
  assert _gpu_tiles(128, 128, jnp.float32, h100) == (64, 1)
  assert _gpu_tiles(64, 128, jnp.bfloat16, 101376) == (64, 2)  # a smaller ask is kept
  with pytest.raises(ValueError, match="shared memory"):
    _gpu_tiles(128, 1024, jnp.float32, 48 * 1024)


def test_gpu_tiles_need_a_compute_capability_unless_interpreted(monkeypatch):
  """The Triton kernel sizes its K/V tiles by the GPU's shared memory: a GPU that reports no NVIDIA
  compute capability is refused (not given an H100's budget); interpreted or exported from a host
  without a GPU, the H100's."""
  from jspec.pallas import tree_attention as ta

  class Device:
    def __init__(self, **attrs):
      self.__dict__.update(attrs)

  assert ta._gpu_smem_budget(True) == ta._GPU_SMEM_BYTES[(9, 0)]
  monkeypatch.setattr(jax, "devices", lambda: [Device(platform="cpu")])  # exporting for a GPU
  assert ta._gpu_smem_budget(False) == ta._GPU_SMEM_BYTES[(9, 0)]
  monkeypatch.setattr(jax, "devices", lambda: [Device(platform="gpu")])
  with pytest.raises(ValueError, match="compute capability.*attention_impl='xla'"):
    ta._gpu_smem_budget(False)
  monkeypatch.setattr(jax, "devices", lambda: [Device(platform="gpu", compute_capability="8.6")])
  assert ta._gpu_smem_budget(False) == ta._GPU_SMEM_DEFAULT
  monkeypatch.setattr(jax, "devices", lambda: [Device(platform="gpu", compute_capability="9.0")])
  assert ta._gpu_smem_budget(False) == ta._GPU_SMEM_BYTES[(9, 0)]


def test_a_query_that_sees_nothing_gets_zeros_in_kernel_and_reference():
  """Under a caller's jit the mask is not checked: a row without its diagonal over an empty
  prefix attends to nothing, and the reference (NaN before) agrees with the kernel's zeros."""
  B, T, H, K, D, S = 1, 4, 2, 1, 16, 16
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, H, D)).astype(np.float32))
  k = jnp.asarray(rng.standard_normal((B, S, K, D)).astype(np.float32))
  v = jnp.asarray(rng.standard_normal((B, S, K, D)).astype(np.float32))
  lengths = jnp.zeros((B,), jnp.int32)
  mask = jnp.tril(jnp.ones((T, T), bool))[None].at[0, 2, 2].set(False)  # row 2 sees 0, 1
  mask = mask.at[0, 2].set(False)  # row 2 sees nothing
  got = jax.jit(lambda *a: tree_attention(*a, interpret=True, backend="gpu",
                                          block_sizes=BlockSizes(16)))(q, k, v, lengths, mask)
  want = tree_attention_reference(q, k, v, lengths, mask)
  np.testing.assert_array_equal(np.asarray(want)[0, 2], 0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
