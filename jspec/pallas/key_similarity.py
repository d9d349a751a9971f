"""KeyDiff's score as a Pallas kernel: how unlike the anchor of its layer and KV head each cached
key is, read straight from the stacked cache.

score[l, b, s, n] = -cos(k[l, b, s, n], anchor[l, b, n]),
anchor = mean over s' < lengths[b] of k[l, b, s', n] / ||k[l, b, s', n]||  (KeyDiff's anchor is
the mean of the *normalised* keys, so a few long keys do not pull it their way)

One program per (layer, row, KV head) streams that head's keys twice in blocks of `block_s` slots:
once to sum the committed keys (the mean), once to write each slot's score. The cache is read as
a free [L, B, S, K*D] view, so nothing is copied out of it first, and the [S, S] or [S, D]
intermediates of a jnp formulation never exist. Selection (the `budget` best slots) stays in XLA
(`jax.lax.top_k` in jspec.kv.evict): a sort does not profit from a hand-written kernel here.

Layout: 1. reference, 2. validation, 3. kernel, 4. jitted wrapper with `interpret`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas.tree_attention import resolve_backend

Array = jax.Array
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
EPS = 1e-12


# ------------------------------------------------------------------------------------------------
# 1. Reference.


def key_similarity_reference(k: Array, lengths: Array) -> Array:
  """[L, B, S, K] float32 minus cosine similarity of each key of k [L, B, S, K, D] to the mean of
  the normalised first lengths[b] keys of its layer, row and KV head (slots past lengths[b] get a
  score too; callers mask them)."""
  S = k.shape[2]
  k = k.astype(jnp.float32)
  unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), EPS)
  valid = (jnp.arange(S)[None, :] < lengths[:, None])[None, :, :, None, None]  # [1, B, S, 1, 1]
  count = jnp.maximum(lengths, 1).astype(jnp.float32)[None, :, None, None]
  anchor = jnp.where(valid, unit, 0.0).sum(axis=2) / count  # [L, B, K, D]
  cos = jnp.einsum("lbskd,lbkd->lbsk", unit, anchor)
  return -cos / jnp.maximum(jnp.linalg.norm(anchor, axis=-1)[:, :, None, :], EPS)


# ------------------------------------------------------------------------------------------------
# 2. Validation.


def validate_inputs(k: Array, lengths: Array, block_s: int, backend: str) -> None:
  if k.ndim != 5:
    raise ValueError(f"key_similarity takes the stacked cache k [L, B, S, K, D], got shape "
                     f"{k.shape}")
  if k.dtype not in SUPPORTED_DTYPES:
    raise ValueError(f"key_similarity supports {[d.__name__ for d in SUPPORTED_DTYPES]}, got "
                     f"{k.dtype}")
  L, B, S, K, D = k.shape
  if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be [B]=[{B}] integers, got {lengths.shape} {lengths.dtype}")
  if not isinstance(block_s, int) or block_s <= 0 or S % block_s:
    raise ValueError(f"block_s={block_s} must be a positive int dividing the cache size S={S}")
  if backend == "gpu":
    for name, n in (("block_s", block_s), ("head_dim", D)):
      if n < 16 or n & (n - 1):
        raise ValueError(f"{name}={n} must be a power of two >= 16 on GPU (Triton tiles are "
                         f"powers of two)")
  if backend == "tpu" and (block_s % 8 or D % 128):
    raise ValueError(f"on TPU block_s must be a multiple of 8 and head_dim of 128 (a lane "
                     f"block per head), got block_s={block_s}, head_dim={D}")


# ------------------------------------------------------------------------------------------------
# 3. Kernel.


def _kernel(lengths_ref, k_ref, o_ref, *, block_s: int):
  """Program (l, b, n): lengths_ref the row's committed length; k_ref [S, D] the keys of KV head n
  of row b in layer l; o_ref [1, S] their scores."""
  S, D = k_ref.shape
  length = lengths_ref[()]
  offsets = lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)

  def unit_keys(j):  # [bs, D] block j's keys over their norms
    keys = k_ref[pl.ds(j * block_s, block_s), :].astype(jnp.float32)
    norms = jnp.sqrt(jnp.sum(keys * keys, axis=1, keepdims=True))
    return keys / jnp.maximum(norms, EPS)

  def add_block(j, total):  # total [1, D]: sum of the committed unit keys so far
    unit = jnp.where(j * block_s + offsets < length, unit_keys(j), 0.0)
    return total + jnp.sum(unit, axis=0, keepdims=True)

  n_valid = lax.div(length + block_s - 1, block_s)
  total = lax.fori_loop(0, n_valid, add_block, jnp.zeros((1, D), jnp.float32))
  anchor = total / jnp.maximum(length, 1).astype(jnp.float32)  # [1, D]
  anchor_norm = jnp.sqrt(jnp.sum(anchor * anchor, axis=1, keepdims=True))  # [1, 1]

  def score_block(j, carry):
    cos = jnp.sum(unit_keys(j) * anchor, axis=1)  # [bs]
    o_ref[0, pl.ds(j * block_s, block_s)] = -cos / jnp.maximum(anchor_norm[0, 0], EPS)
    return carry

  lax.fori_loop(0, S // block_s, score_block, 0)


# ------------------------------------------------------------------------------------------------
# 4. Wrapper.


def block_size(S: int) -> int:
  """The largest of 128, 64, 32, 16 dividing S; ValueError if none does."""
  for block_s in (128, 64, 32, 16):
    if S % block_s == 0:
      return block_s
  raise ValueError(f"the key-similarity kernel needs a cache of a multiple of 16 slots, got {S}: "
                   f"pick the KV budget and chunk so that budget + chunk is one")


@functools.partial(jax.jit, static_argnames=("block_s", "interpret", "backend"))
def _key_similarity(k, lengths, block_s, interpret, backend):
  L, B, S, K, D = k.shape
  # Triton by name: without its compiler params, pallas_call on CUDA lowers to Mosaic GPU, whose
  # whole-block copies of the [S, D] keys into shared memory do not fit a long cache.
  params = pltriton.CompilerParams(num_warps=4, num_stages=1) if backend == "gpu" else None
  k2 = k.reshape(L, B, S, K * D)  # a free view: head n is lanes [n*D, (n+1)*D)
  out = pl.pallas_call(
      functools.partial(_kernel, block_s=block_s),
      grid=(L, B, K),
      in_specs=[
          pl.BlockSpec((None,), lambda l, b, n: (b,)),  # lengths[b]
          pl.BlockSpec((None, None, S, D), lambda l, b, n: (l, b, 0, n)),  # k of one head
      ],
      out_specs=pl.BlockSpec((None, None, None, 1, S), lambda l, b, n: (l, b, n, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((L, B, K, 1, S), jnp.float32),
      compiler_params=params,
      interpret=interpret,
      name="key_similarity",
  )(lengths.astype(jnp.int32), k2)
  return jnp.moveaxis(out[:, :, :, 0], 2, 3)  # [L, B, S, K]


def key_similarity(k: Array, lengths: Array, *, block_s: int = 64, interpret: bool = False,
                   backend: Optional[str] = None) -> Array:
  """KeyDiff scores [L, B, S, K] float32 (higher = less like the mean key = keep) of the stacked
  cache k [L, B, S, K, D] whose rows hold lengths [B] committed keys.

  block_s: slots per block (divides S). interpret: run in the Pallas interpreter (CPU tests).
  backend: "gpu" (Triton), "tpu" (Mosaic) or None for this machine's.
  """
  backend = resolve_backend(backend, interpret)
  validate_inputs(k, lengths, block_s, backend)
  return _key_similarity(k, lengths, block_s, interpret, backend)  # one body for both backends
