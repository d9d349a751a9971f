"""KeyDiff's score as a Pallas kernel: how unlike the anchor of its layer and KV head each cached
key is, read straight from the stacked cache.

score[l, b, s, n] = -cos(k[l, b, s, n], anchor[l, b, n]),
anchor = mean over s' < lengths[b] of k[l, b, s', n] / ||k[l, b, s', n]||  (KeyDiff's anchor is
the mean of the *normalised* keys, so a few long keys do not pull it their way)

Two passes over the keys, each with one program per (layer, row, KV head, slice of `part` slots)
streaming its slice in blocks of `block_s`: the first sums the committed unit keys of its slice,
the second adds its head's slice sums into the anchor's direction and writes each slot's score
(two launches, nothing in XLA between them). The cache is read as a free [L, B, S, K*D] view, so
nothing is copied out of it first, and the [S, S] or [S, D] intermediates of a jnp formulation
never exist. One program per head left the default model's 90 heads as 90 programs on a 132-SM
GPU: 0.90x the jnp reference at batch 1 on an H100, where slices of 256-512 slots give 1.5x per
call and 2.7-3.2x inside a compiled loop (where eviction runs), 3.0x and 4.3-4.5x at batch 8
(benchmarks/issue19_keysim_h100_s34_*.json). On a Llama-3-8B cache both sides stream the keys
twice near the HBM rate (~1.05x): beating that needs a one-pass anchor kept in the cache.
Selection (the entries to drop: `jax.lax.top_k` of the eviction's width in jspec.kv.evict) stays
in XLA: a sort does not profit from a hand-written kernel here.

Layout: 1. reference, 2. validation, 3. kernels, 4. jitted wrapper with `interpret`.
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
# 3. Kernels: two passes, each one program per (layer, row, KV head, slice of `part` slots).


def _unit_keys(k_ref, j, block_s):  # [bs, D] block j of this slice's keys over their norms
  keys = k_ref[pl.ds(j * block_s, block_s), :].astype(jnp.float32)
  norms = jnp.sqrt(jnp.sum(keys * keys, axis=1, keepdims=True))
  return keys / jnp.maximum(norms, EPS)


def _sum_kernel(lengths_ref, k_ref, o_ref, *, block_s: int):
  """Pass 1, program (l, b, n, p): o_ref [1, D] the sum of the committed unit keys among slots
  [p * part, (p + 1) * part) of head n (k_ref [part, D]); blocks past the length are not read."""
  part, D = k_ref.shape
  start = pl.program_id(3) * part
  length = lengths_ref[()]
  offsets = start + lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)

  def add_block(j, total):
    unit = jnp.where(j * block_s + offsets < length, _unit_keys(k_ref, j, block_s), 0.0)
    return total + jnp.sum(unit, axis=0, keepdims=True)

  n_blocks = jnp.clip(lax.div(length - start + block_s - 1, block_s), 0, part // block_s)
  o_ref[...] = lax.fori_loop(0, n_blocks, add_block, jnp.zeros((1, D), jnp.float32))


def _score_kernel(sums_ref, k_ref, o_ref, *, block_s: int):
  """Pass 2, program (l, b, n, p): o_ref [1, part] minus the cosine of each key of the slice to
  the anchor's direction, which is the direction of the sum of pass 1's slice sums (sums_ref
  [P2, D], zero rows past the last slice): dividing by the count would not change it."""
  part, _ = k_ref.shape
  total = jnp.sum(sums_ref[...], axis=0, keepdims=True)  # [1, D]
  direction = total / jnp.maximum(jnp.sqrt(jnp.sum(total * total)), EPS)

  def score_block(j, carry):
    o_ref[0, pl.ds(j * block_s, block_s)] = -jnp.sum(_unit_keys(k_ref, j, block_s) * direction,
                                                     axis=1)
    return carry

  lax.fori_loop(0, part // block_s, score_block, 0)


# ------------------------------------------------------------------------------------------------
# 4. Wrapper.


def block_size(S: int) -> int:
  """The largest of 128, 64, 32, 16 dividing S; ValueError if none does."""
  for block_s in (128, 64, 32, 16):
    if S % block_s == 0:
      return block_s
  raise ValueError(f"the key-similarity kernel needs a cache of a multiple of 16 slots, got {S}: "
                   f"pick the KV budget and chunk so that budget + chunk is one")


def slice_size(S: int, block_s: int, target: int = 512) -> int:
  """Slots per program: the largest multiple of block_s that divides S and is at most
  max(target, block_s). A slice per program spreads one head's cache over many programs (one per
  head left 90 programs for the default model's cache on a 132-SM GPU and ran at 1x the jnp
  reference), while each still streams several blocks."""
  best = block_s
  for part in range(block_s, min(S, max(target, block_s)) + 1, block_s):
    if S % part == 0:
      best = part
  return best


@functools.partial(jax.jit, static_argnames=("block_s", "part", "interpret", "backend"))
def _key_similarity(k, lengths, block_s, part, interpret, backend):
  L, B, S, K, D = k.shape
  P = S // part
  P2 = 1 << (P - 1).bit_length()  # Triton blocks are powers of two: P2 - P slices of zeros
  k2 = k.reshape(L, B, S, K * D)  # a free view: head n is lanes [n*D, (n+1)*D)
  # Triton by name: without its compiler params, pallas_call on CUDA lowers to Mosaic GPU, whose
  # whole-block copies of the keys into shared memory do not fit a long cache.
  params = pltriton.CompilerParams(num_warps=4, num_stages=1) if backend == "gpu" else None
  keys = pl.BlockSpec((None, None, part, D), lambda l, b, n, p: (l, b, p, n))  # a head's slice
  # Pass 1 over P2 slices: those past the cache read its last slice (a valid block) and, every
  # slot of theirs lying past the length, write zeros.
  padded = pl.BlockSpec((None, None, part, D), lambda l, b, n, p: (l, b, jnp.minimum(p, P - 1), n))
  sums = pl.pallas_call(
      functools.partial(_sum_kernel, block_s=block_s),
      grid=(L, B, K, P2),
      in_specs=[pl.BlockSpec((None,), lambda l, b, n, p: (b,)), padded],  # lengths[b], keys
      out_specs=pl.BlockSpec((None, None, None, 1, D), lambda l, b, n, p: (l, b, n, p, 0)),
      out_shape=jax.ShapeDtypeStruct((L, B, K, P2, D), jnp.float32),
      compiler_params=params, interpret=interpret, name="key_similarity_sums",
  )(lengths.astype(jnp.int32), k2)
  # Pass 2 reads its head's P2 slice sums and adds them itself: no XLA op between the passes.
  out = pl.pallas_call(
      functools.partial(_score_kernel, block_s=block_s),
      grid=(L, B, K, P),
      in_specs=[pl.BlockSpec((None, None, None, P2, D), lambda l, b, n, p: (l, b, n, 0, 0)),
                keys],
      out_specs=pl.BlockSpec((None, None, None, 1, part), lambda l, b, n, p: (l, b, n, 0, p)),
      out_shape=jax.ShapeDtypeStruct((L, B, K, 1, S), jnp.float32),
      compiler_params=params, interpret=interpret, name="key_similarity_scores",
  )(sums, k2)
  return jnp.moveaxis(out[:, :, :, 0], 2, 3)  # [L, B, S, K]


def key_similarity(k: Array, lengths: Array, *, block_s: int = 64, part: Optional[int] = None,
                   interpret: bool = False, backend: Optional[str] = None) -> Array:
  """KeyDiff scores [L, B, S, K] float32 (higher = less like the mean key = keep) of the stacked
  cache k [L, B, S, K, D] whose rows hold lengths [B] committed keys.

  block_s: slots per block (divides S). part: slots per program (a multiple of block_s dividing
  S; default `slice_size`). interpret: run in the Pallas interpreter (CPU tests). backend: "gpu"
  (Triton), "tpu" (Mosaic) or None for this machine's.
  """
  backend = resolve_backend(backend, interpret,
                            "key_similarity (KVPolicy score_impl='pallas', KeyDiff's scores)")
  validate_inputs(k, lengths, block_s, backend)
  S = k.shape[2]
  part = slice_size(S, block_s) if part is None else part
  if not isinstance(part, int) or part % block_s or S % part:
    raise ValueError(f"part={part} must be a multiple of block_s={block_s} dividing the cache "
                     f"size S={S}")
  if backend == "tpu" and part % 128 and part != S:
    raise ValueError(f"on TPU part must be a multiple of 128 (a lane block of scores) or the "
                     f"whole cache S={S}, got {part}")
  return _key_similarity(k, lengths, block_s, part, interpret, backend)  # one body for both
