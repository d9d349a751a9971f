"""Block-quantized weights: int8 codes with one float scale (and optional offset) per `sub`
consecutive entries of a row, the form every GGUF format unpacks to (`jspec.io.gguf_file`).

    weight[..., j] = q[..., j] * scale[..., j // sub] (+ offset[..., j // sub])
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("sub", "dtype"))
def dequantize(q: Array, scale: Array, offset: Optional[Array], sub: int,
               dtype=jnp.float32) -> Array:
  """Dense weights [..., N] from codes q [..., N] and scale/offset [..., N // sub] (float32 math,
  in ggml's order: q * scale + offset, then cast to `dtype`)."""
  *lead, n = q.shape
  w = q.reshape(*lead, n // sub, sub).astype(jnp.float32) * scale[..., None]
  if offset is not None:
    w = w + offset[..., None]
  return w.reshape(*lead, n).astype(dtype)
