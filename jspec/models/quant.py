"""Block-quantized weights: int8 codes with one float scale (and optional offset) per `sub`
consecutive entries of a row, the form every GGUF format unpacks to (`jspec.io.gguf_file`).

    weight[..., j] = q[..., j] * scale[..., j // sub] (+ offset[..., j // sub])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec import native
from jspec.native import Q4_GROUP

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


# ----------------------------------------------------------------------------- int8 matmuls
# Weights int8 with one scale per output channel; activations quantized to int8 per token on the
# fly (llama.cpp's scheme on CPU, but with one scale a token where its Q8 activations take one a
# block of 32: coarser). The dot runs int8 x int8 -> int32, exact,
# which XLA's CPU backend maps to VNNI/AVX-512 kernels 2-3x faster than its float32 dot at 2-8
# rows; dequantizing the weights to float inside the matmul instead (weight-only) is SLOWER than
# float32 there, because XLA materializes the converted weights (benchmarks/issue17_matmul_cpu.json).
# Every token's activations are scaled on their own, so the int8 part of a matmul does not depend
# on which other tokens share the forward (`jspec.models.numerics`: what else that takes).


def _output_major(ndim: int, in_axes: tuple[int, ...]) -> tuple[int, ...]:
  """w's axes in the native kernels' storage order: its output axes, then its input axes."""
  return tuple(a for a in range(ndim) if a not in in_axes) + tuple(in_axes)


def _logical_shape(stored_shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
  """w's shape from its stored shape and the storage order of its axes."""
  stored = dict(zip(order, stored_shape))
  return tuple(stored[a] for a in range(len(stored_shape)))


KERNELS = ("xla", "native")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
  """A weight w stored as q (int8) * scale (float32, q's shape with 1 on the input axes, over
  which a matmul contracts): one scale per output channel. `in_axes` are w's input axes.

  `kernel` picks the int8 x int8 matmul and with it q's layout: "xla" keeps w's own layout and
  runs XLA's dot; "native" stores q output-major (w's output axes, then its input axes: each
  output channel's weights contiguous) for jspec's CPU kernel (`jspec.native`), which streams
  them at memory speed where XLA:CPU's int8 dot does not.
  """

  q: Array
  scale: Array
  in_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  kernel: str = dataclasses.field(default="xla", metadata=dict(static=True))

  @property
  def _order(self) -> tuple[int, ...]:
    """w's axes in q's storage order."""
    if self.kernel == "xla":
      return tuple(range(self.q.ndim))
    return _output_major(self.q.ndim, self.in_axes)

  @property
  def shape(self) -> tuple[int, ...]:
    """w's shape (whatever q's layout)."""
    return _logical_shape(self.q.shape, self._order)

  @property
  def dtype(self):
    """The dtype the layer computes in (what a float weight's dtype tells its callers)."""
    return self.scale.dtype

  def out_scale(self) -> Array:
    """The scale over the output axes only, in their order: a matmul's output layout."""
    stored_in = tuple(self._order.index(a) for a in self.in_axes)
    return jnp.squeeze(self.scale, stored_in)

  def reshape(self, *shape) -> "Int8Weight":
    """Reshape leading input axes (e.g. wo [H, D, E] -> [H * D, E]); output axes stay."""
    n_out = self.q.ndim - len(self.in_axes)
    if self.in_axes != tuple(range(len(self.in_axes))) or shape[-n_out:] != self.shape[-n_out:]:
      raise ValueError(f"Int8Weight.reshape keeps the trailing output axes: {self.shape} "
                       f"(input axes {self.in_axes}) -> {shape}")
    new_in = tuple(range(len(shape) - n_out))
    out_shape = self.shape[-n_out:]
    if self.kernel == "native":  # stored [out..., in...]: merge the trailing input axes
      q = self.q.reshape(*out_shape, *shape[:len(new_in)])
      scale = self.out_scale().reshape(out_shape + (1,) * len(new_in))
    else:
      q = self.q.reshape(*shape)
      scale = self.out_scale().reshape((1,) * len(new_in) + out_shape)
    return Int8Weight(q, scale, new_in, self.kernel)

  def dense(self) -> Array:
    """w in its own layout, dequantized."""
    w = self.q.astype(self.scale.dtype) * self.scale
    return jnp.transpose(w, np.argsort(self._order))

  def __jax_array__(self) -> Array:
    # Code that reads a table as an array (a drafter borrowing the target's embedding, savers)
    # gets the dequantized weights; the model's matmuls never take this path.
    return self.dense()

  def __array__(self, dtype=None, copy=None):
    return np.asarray(self.dense(), dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Q4Weight:
  """A weight w (input axes `in_axes` first, output axes after: a decoder projection) in 4 bits:
  groups of 32 consecutive inputs of an output channel share one float16 scale and, in the
  asymmetric form, one float16 offset: w = scale * code + offset with codes 0..15 (ggml's Q4_1
  block), or without offsets w = scale * (code - 8) (its Q4_0 block). Stored output-major for
  jspec's CPU kernel (`jspec.native.q4_matmul`): codes [N, K / 2] uint8, two codes a byte in
  `pack_q4`'s order, scale and offset [N, K / 32] float16, N and K the flattened output and
  input sizes. Activations are quantized to int8 per token, as for Int8Weight; its models run the
  native attention too."""

  codes: Array
  scale: Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  in_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  offset: Optional[Array] = None

  @property
  def dtype(self):
    """The dtype the layer computes in (the scales are float16 only to stream fewer bytes)."""
    return jnp.dtype(jnp.float32)

  def reshape(self, *shape) -> "Q4Weight":
    """Merge the leading input axes (wo [H, D, E] -> [H * D, E]); the stored codes do not move."""
    n_out = len(self.shape) - len(self.in_axes)
    size = int(np.prod(self.shape))
    if -1 in shape:  # as numpy reads it
      known = int(np.prod([d for d in shape if d != -1]))
      shape = tuple(size // known if d == -1 else d for d in shape)
    if tuple(shape[-n_out:]) != self.shape[-n_out:] or int(np.prod(shape)) != size:
      raise ValueError(f"Q4Weight.reshape keeps the trailing output axes: {self.shape} -> {shape}")
    return Q4Weight(self.codes, self.scale, tuple(shape), tuple(range(len(shape) - n_out)),
                    self.offset)

  def dense(self) -> Array:
    """w in its own layout, dequantized."""
    N, half = self.codes.shape
    q = unpack_q4(self.codes).astype(jnp.float32).reshape(N, -1, Q4_GROUP)  # [N, G, 32]
    scale = self.scale[..., None].astype(jnp.float32)
    if self.offset is None:
      w = (q - 8) * scale
    else:
      w = q * scale + self.offset[..., None].astype(jnp.float32)
    w = w.reshape(N, 2 * half)  # [N, K]
    n_in = len(self.in_axes)
    w = w.reshape(*self.shape[n_in:], *self.shape[:n_in])
    n_out = len(self.shape) - n_in
    return jnp.transpose(w, tuple(range(n_out, n_out + n_in)) + tuple(range(n_out)))

  def __jax_array__(self) -> Array:
    return self.dense()

  def __array__(self, dtype=None, copy=None):
    return np.asarray(self.dense(), dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseWeight:
  """A float32 weight stored output-major (w's output axes, then its input axes: each output
  channel's weights contiguous) for jspec's CPU kernel (`jspec.native.f32_linear`), which streams
  them at memory speed at 1-8 rows and sums every output in one order whatever the rows; XLA's
  float32 dot slows at 2-8 rows (a verification block). Not quantized: the same numbers as w."""

  stored: Array
  in_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

  @property
  def _order(self) -> tuple[int, ...]:
    return _output_major(self.stored.ndim, self.in_axes)

  @property
  def shape(self) -> tuple[int, ...]:
    """w's shape (whatever the stored layout)."""
    return _logical_shape(self.stored.shape, self._order)

  @property
  def dtype(self):
    return self.stored.dtype

  def reshape(self, *shape) -> "DenseWeight":
    """Merge leading input axes (wo [H, D, E] -> [H * D, E]); the output axes stay."""
    n_out = self.stored.ndim - len(self.in_axes)
    if self.in_axes != tuple(range(len(self.in_axes))) or shape[-n_out:] != self.shape[-n_out:]:
      raise ValueError(f"DenseWeight.reshape keeps the trailing output axes: {self.shape} "
                       f"(input axes {self.in_axes}) -> {shape}")
    n_in = len(shape) - n_out
    out_shape = self.shape[-n_out:]
    return DenseWeight(self.stored.reshape(*out_shape, *shape[:n_in]), tuple(range(n_in)))

  def dense(self) -> Array:
    """w in its own layout."""
    return jnp.transpose(self.stored, np.argsort(self._order))

  # Read as the array it holds by code written for plain weights (training, VocabTrim, savers).
  @property
  def ndim(self) -> int:
    return self.stored.ndim

  @property
  def T(self) -> Array:
    return self.dense().T

  def __getitem__(self, index) -> Array:
    if self._order == tuple(range(self.stored.ndim)):  # stored as w (the embedding): no copy
      return self.stored[index]
    return self.dense()[index]

  def astype(self, dtype) -> Array:
    return self.dense().astype(dtype)

  def __jax_array__(self) -> Array:
    return self.dense()

  def __array__(self, dtype=None, copy=None):
    return np.asarray(self.dense(), dtype)


def on_native_kernel(w) -> bool:
  """Whether w is a weight one of jspec's CPU kernels reads in its own layout."""
  return (isinstance(w, (Q4Weight, DenseWeight))
          or (isinstance(w, Int8Weight) and w.kernel == "native"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerOf:
  """Layer `layer` of a weight for jspec's CPU kernels whose arrays are stacked on a leading [L]
  axis (stacked layers: `llama.stack_layers`), a traced layer inside the decoder's scan. The
  kernels read that layer's rows in place, so a decode step copies no weights (slicing a layer out
  of every stacked weight wrote the whole model each step; a float32 prefill past
  NATIVE_F32_MAX_ROWS rows still slices, for XLA's dot). Reads as the one layer's weight."""

  stacked: Int8Weight | Q4Weight | DenseWeight  # every array [L, ...]
  layer: Array  # int32 []

  def _one(self):
    """The one layer's weight, abstract (its shape, dtype and static fields)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.stacked)

  @property
  def shape(self) -> tuple[int, ...]:
    return self._one().shape

  @property
  def dtype(self):
    return self._one().dtype

  def reshape(self, *shape) -> "LayerOf":
    """The one layer's `reshape`, made on every layer at once (the stored bytes do not move)."""
    return LayerOf(jax.vmap(lambda w: w.reshape(*shape))(self.stacked), self.layer)


def at_layer(w, layer: Array):
  """Layer `layer` (traced) of a stacked weight or array: a `LayerOf` view for the CPU kernels'
  weights, the sliced array otherwise (XLA's dots read a layer's slice)."""
  if on_native_kernel(w):
    return LayerOf(w, layer)
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), w)


def dense_native(w: Array, in_axes: tuple[int, ...]) -> DenseWeight:
  """float32 w with input axes `in_axes` in the CPU kernel's output-major layout."""
  if isinstance(w, DenseWeight) and w.in_axes == tuple(in_axes):
    return w
  w = jnp.asarray(w)
  if w.dtype != jnp.float32:
    raise ValueError(f"the native float32 kernel takes float32 weights, got {w.dtype}")
  return DenseWeight(jnp.transpose(w, _output_major(w.ndim, in_axes)), tuple(in_axes))


def quantize_q4(w: Array, in_axes: tuple[int, ...], offset: bool = True) -> Q4Weight:
  """4 bits in groups of 32 inputs. offset=True (ggml's Q4_1 rule): each group's range [min, max]
  in 16 steps, scale (max - min) / 15 and offset min in float16, so a weight dequantized from a
  Q4_1 block (a GGUF's) comes back to its very codes, scale and offset. offset=False: symmetric,
  each group's max |w| maps to 7 (15 of the 16 codes used, no offsets to read)."""
  in_axes = tuple(in_axes)
  if in_axes != tuple(range(len(in_axes))):
    raise ValueError(f"q4 weights take their input axes first, got input axes {in_axes}")
  w = jnp.asarray(w, jnp.float32)
  K = int(np.prod(w.shape[:len(in_axes)]))
  if K % Q4_GROUP:
    raise ValueError(f"q4 weights need an input size that is a multiple of {Q4_GROUP}, got "
                     f"{K} (weight {w.shape}). Fix: int8 weights (--weights int8, "
                     f"load(..., dtype='int8')).")
  if offset:
    codes, scale, offsets = _q4_offset_codes(w, K)
    return Q4Weight(codes, scale, tuple(w.shape), in_axes, offsets)
  codes, scale = _q4_codes(w, K)
  return Q4Weight(codes, scale, tuple(w.shape), in_axes)


# One program per weight shape: op by op, a model's quantization compiled ~170 small programs
# (3 s of a 4-bit load); the bits are the same either way.
@functools.partial(jax.jit, static_argnames=("K",))
def _q4_codes(w: Array, K: int) -> tuple[Array, Array]:
  """quantize_q4's packed codes [N, K / 2] and float16 scales [N, K / 32] of w (K inputs)."""
  wt = w.reshape(K, -1).T.reshape(-1, K // Q4_GROUP, Q4_GROUP)  # [N, G, 32]
  # float16 scales (what the kernel reads); the codes are rounded against them.
  scale = jnp.minimum(jnp.max(jnp.abs(wt), axis=-1) / 7.0, np.finfo(np.float16).max)
  scale = jnp.where(scale == 0, 1.0, scale).astype(jnp.float16)  # [N, G]
  scale = jnp.where(scale == 0, jnp.float16(1.0), scale)  # underflowed to zero in float16
  q = (jnp.clip(jnp.round(wt / scale[..., None].astype(jnp.float32)), -7, 7) + 8
       ).astype(jnp.uint8)
  return pack_q4(q.reshape(q.shape[0], K)), scale


@functools.partial(jax.jit, static_argnames=("K",))
def _q4_offset_codes(w: Array, K: int) -> tuple[Array, Array, Array]:
  """quantize_q4's packed codes [N, K / 2], float16 scales and offsets [N, K / 32] (offset=True)."""
  wt = w.reshape(K, -1).T.reshape(-1, K // Q4_GROUP, Q4_GROUP)  # [N, G, 32]
  f16 = np.finfo(np.float16).max
  low, high = jnp.min(wt, axis=-1), jnp.max(wt, axis=-1)  # [N, G]
  # Codes are rounded against the float16 scale and offset the kernel reads. Rounded from a Q4_1
  # block's dequantized weights, (max - min) / 15 is its scale to within float32 rounding, and
  # float16 rounding gives that scale back exactly.
  scale = jnp.minimum((high - low) / 15.0, f16).astype(jnp.float16)
  offset = jnp.clip(low, -f16, f16).astype(jnp.float16)
  scale32 = scale.astype(jnp.float32)
  inverse = jnp.where(scale32 > 0, 1.0 / jnp.where(scale32 > 0, scale32, 1.0), 0.0)
  q = jnp.clip(jnp.round((wt - offset[..., None].astype(jnp.float32)) * inverse[..., None]),
               0, 15).astype(jnp.uint8)
  return pack_q4(q.reshape(q.shape[0], K)), scale, offset


Q4_LANES = 16  # groups in a superblock of the packed layout (one vector lane each)


def _q4_superblocks(G: int) -> list[tuple[int, int]]:
  """(first group, groups) of each superblock of a row of G groups: 16 at a time, the rest last."""
  return [(g0, min(Q4_LANES, G - g0)) for g0 in range(0, G, Q4_LANES)]


def pack_q4(q: Array) -> Array:
  """Codes [N, K] (0..15) -> bytes [N, K / 2] in the kernel's order (`jspec/native/q4_matmul.cc`):
  groups of 32 inputs taken 16 at a time (the last superblock holds what is left); a superblock of
  g groups is 4 chunks c of 4 g bytes, byte 4 l + i of chunk c holding input 32 l + 4 c + i of its
  l-th group in the low nibble and input 32 l + 16 + 4 c + i in the high nibble."""
  N, K = q.shape
  groups = q.reshape(N, K // Q4_GROUP, 2, 4, 4)  # [N, G, half, c, i]
  parts = []
  for g0, g in _q4_superblocks(K // Q4_GROUP):
    block = jnp.transpose(groups[:, g0:g0 + g], (0, 3, 1, 4, 2))  # [N, c, l, i, half]
    parts.append((block[..., 0] | (block[..., 1] << 4)).reshape(N, -1))
  return jnp.concatenate(parts, axis=1)


def unpack_q4(codes: Array) -> Array:
  """pack_q4's inverse: bytes [N, K / 2] -> codes [N, K]."""
  N, half = codes.shape
  parts, start = [], 0
  for _, g in _q4_superblocks(2 * half // Q4_GROUP):
    block = codes[:, start:start + 16 * g].reshape(N, 4, g, 4)  # [N, c, l, i]
    start += 16 * g
    nibbles = jnp.stack([block & 15, block >> 4], axis=-1)  # [N, c, l, i, half]
    parts.append(jnp.transpose(nibbles, (0, 2, 4, 1, 3)).reshape(N, g * Q4_GROUP))
  return jnp.concatenate(parts, axis=1)


def format_name(params) -> str:
  """What a model's weights are, for records: "q4" (4-bit projections), "int8", or the float
  dtype of its embedding ("float32", "bfloat16")."""
  kinds = (Int8Weight, Q4Weight)
  weights = [x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, kinds))
             if isinstance(x, kinds)]
  if any(isinstance(w, Q4Weight) for w in weights):
    return "q4"
  return "int8" if weights else str(params.embed.dtype)


def is_quantized(tree) -> bool:
  """Whether any weight in the pytree is int8."""
  return int8_kernel(tree) is not None


def _is_weight(x) -> bool:
  return isinstance(x, (Int8Weight, Q4Weight, DenseWeight))


def attention_kernel(tree) -> Optional[str]:
  """The attention the pytree's weights need (`attention.attention_fn`): "native" (jspec's CPU
  kernel, fixed-order sums) for weights on the native kernels, "xla" (XLA's, one token at a time)
  for int8 weights on XLA's dot, None (XLA's masked attention) for plain float weights."""
  w = next((x for x in jax.tree.leaves(tree, is_leaf=_is_weight) if _is_weight(x)), None)
  if isinstance(w, DenseWeight):
    return "native"
  return int8_kernel(tree)


def int8_kernel(tree) -> Optional[str]:
  """The kernel of the pytree's quantized weights ("xla" or "native"; 4-bit weights run only the
  native one), None if it has none."""
  quantized = (Int8Weight, Q4Weight)
  w = next((x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, quantized))
            if isinstance(x, quantized)), None)
  return None if w is None else "native" if isinstance(w, Q4Weight) else w.kernel


SCALE_BITS = 17  # significant bits of an int8 scale: 7-bit codes times them are exact in float32


def exact_product_scale(scale: Array) -> Array:
  """Positive scales rounded up to SCALE_BITS significant bits, so that code * scale is exact in
  float32 for every int8 code. Then the product rounds alike whether or not a compiler fuses it
  into the add that follows (an FMA rounds once, a multiply then an add twice): XLA:CPU fused an
  embedding row's q * scale into layer 0's residual add where the rows fed it directly and not
  where probe masks were concatenated after them, and int8 mask-token probing then left greedy
  autoregressive output. Rounding up keeps max |w| / scale <= 127."""
  mantissa, exponent = jnp.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
  return jnp.ldexp(jnp.ceil(mantissa * 2.0 ** SCALE_BITS) / 2.0 ** SCALE_BITS, exponent)


def quantize_int8(w: Array, in_axes: tuple[int, ...], kernel: str = "xla") -> Int8Weight:
  """Symmetric int8 with one scale per output channel: the max |w| over the input axes `in_axes`
  maps to 127 (scale: w's shape without them). `kernel`: see Int8Weight."""
  if kernel not in KERNELS:
    raise ValueError(f"int8 kernel must be one of {KERNELS}, got {kernel!r}")
  return _quantize_int8(jnp.asarray(w, jnp.float32), tuple(in_axes), kernel)


@functools.partial(jax.jit, static_argnames=("in_axes", "kernel"))  # as _q4_codes: one program
def _quantize_int8(w: Array, in_axes: tuple[int, ...], kernel: str) -> Int8Weight:
  scale = jnp.max(jnp.abs(w), axis=in_axes, keepdims=True) / 127.0
  scale = exact_product_scale(jnp.where(scale == 0, 1.0, scale))
  q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
  if kernel == "native":
    order = _output_major(q.ndim, in_axes)
    return Int8Weight(jnp.transpose(q, order), jnp.transpose(scale, order), in_axes, kernel)
  return Int8Weight(q, scale, in_axes)


_INV_127 = np.float32(1) / np.float32(127)


def quantize_rows(x: Array) -> tuple[Array, Array]:
  """Per-token symmetric int8 of activations x [..., K] -> (int8 [..., K], scale [..., 1])."""
  # Reciprocals multiplied, not divisions: XLA rewrites x / c and x / broadcast(s) that way
  # anyway, and spelling it out defines the bits that jspec's CPU kernels reproduce when they
  # quantize inside their calls (jspec/native/quantize.h).
  scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32) * _INV_127
  scale = jnp.where(scale == 0, 1.0, scale)
  inverse = 1.0 / scale
  return jnp.clip(jnp.round(x * inverse), -127, 127).astype(jnp.int8), scale


def einsum(spec: str, x: Array, w, preferred_element_type=None) -> Array:
  """jnp.einsum(spec, x, w) for a float w, or the int8 x int8 matmul for an Int8Weight. `spec`
  contracts x's last axis (or axes already flattened into it) with w's input axes; its output is
  x's leading axes then w's output axes (the layout every projection of the decoder has)."""
  if isinstance(w, LayerOf):
    return _kernel_einsum(x, w.stacked, w.layer, preferred_element_type)
  if on_native_kernel(w):
    return _kernel_einsum(x, w, None, preferred_element_type)
  if not isinstance(w, Int8Weight):
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
  lead = x.shape[:-1]
  single = int(np.prod(lead)) == 1
  if single:  # XLA's int8 matrix-vector path is 3x slower than its 2-row matmul: add a zero row
    x = jnp.concatenate([x, jnp.zeros_like(x)], axis=-2)
  xq, xs = quantize_rows(x)
  y = jnp.einsum(spec, xq, w.q, preferred_element_type=jnp.int32)  # exact
  out_dims = y.ndim - len(lead)
  xs = xs.reshape(*xs.shape[:-1], *([1] * out_dims))
  y = y.astype(jnp.float32) * xs * w.out_scale()
  if single:
    y = jax.lax.slice_in_dim(y, 0, 1, axis=len(lead) - 1)
  return y.astype(preferred_element_type or x.dtype)


def _out_shape(w) -> tuple[int, ...]:
  """The output axes' shape of a CPU-kernel weight (4 bits: input axes first; the others are
  stored output-major)."""
  if isinstance(w, Q4Weight):
    return w.shape[len(w.in_axes):]
  stored = w.stored if isinstance(w, DenseWeight) else w.q
  return tuple(stored.shape[:len(stored.shape) - len(w.in_axes)])


def _kernel_operands(w) -> tuple[Array, ...]:
  """The arrays w's CPU kernel reads: the output-major weight as [N, K] (4 bits: codes [N, K / 2]
  and scales (and offsets) [N, K / 32]; int8: its [N] scales too)."""
  if isinstance(w, Q4Weight):
    return (w.codes, w.scale) if w.offset is None else (w.codes, w.scale, w.offset)
  stored = w.stored if isinstance(w, DenseWeight) else w.q
  table = stored.reshape(int(np.prod(_out_shape(w))), -1)
  if isinstance(w, DenseWeight):
    return (table,)
  return table, w.out_scale().reshape(-1).astype(jnp.float32)


# Rows up to which float32 matmuls run jspec's kernel: decode steps, verification blocks and trees
# (where a token must score the same bits in any block). Past it (a prefill) the matmul is
# compute-bound, and XLA's dot, which reaches this CPU's peak there (~1.3x the kernel at 128
# rows), is the faster program; a prefill's bits need not match a decode step's.
NATIVE_F32_MAX_ROWS = 64


def _kernel_einsum(x: Array, w, layer: Optional[Array], preferred_element_type=None) -> Array:
  """quant.einsum through jspec's CPU kernels: every row of x against w's output-major rows (int8
  and 4 bits: the activations quantized and the result scaled inside the call, the same bits as
  XLA's int8 path). `layer`: w's arrays are stacked on a leading [L] axis, read at that layer."""
  if layer is None:
    one, operands = w, _kernel_operands(w)
  else:
    one, operands = LayerOf(w, layer)._one(), jax.vmap(_kernel_operands)(w)
  lead, out_shape = x.shape[:-1], _out_shape(one)
  rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [M, K] (M may be 0)
  if isinstance(one, Q4Weight):
    y = native.q4_matmul(rows, *operands[:2], layer=layer,
                         offset=operands[2] if len(operands) > 2 else None)
  elif isinstance(one, Int8Weight):
    y = native.int8_linear(rows, *operands, layer=layer)
  elif rows.shape[0] > NATIVE_F32_MAX_ROWS:
    table = operands[0] if layer is None else jax.lax.dynamic_index_in_dim(
        operands[0], layer, keepdims=False)  # one layer's weights, for a prefill
    y = jnp.einsum("mk,nk->mn", rows, table, preferred_element_type=jnp.float32)
  else:
    y = native.f32_linear(rows, operands[0], layer=layer)  # [M, N]
  return y.reshape(*lead, *out_shape).astype(preferred_element_type or x.dtype)


def take_rows(table, ids: Array) -> Array:
  """table[ids] for a float table [V, E], or the dequantized rows of an int8 one (scale per row:
  quantized over its input axis 1, the tied LM head's)."""
  if isinstance(table, DenseWeight):
    if table.in_axes != (1,):
      raise ValueError(f"take_rows reads a table stored by rows (input axes (1,)), got input "
                       f"axes {table.in_axes}")
    return table.stored[ids]
  if not isinstance(table, Int8Weight):
    return jnp.asarray(table)[ids]
  if table.in_axes != (1,):
    raise ValueError(f"take_rows reads an int8 table quantized per row (input axes (1,)), got "
                     f"input axes {table.in_axes}")
  return table.q[ids].astype(table.scale.dtype) * table.scale[ids]  # scale [V, 1]
