"""A GGUF file, read once: metadata as Python values, tensors as memory-mapped block arrays.

`gguf.GGUFReader` builds a numpy view per metadata item (seconds for a 150k-entry vocabulary) and
dequantizes in 16-row groups through `np.memmap`; loading a 1 GB model spent most of its time
there. This reader parses the header with `struct`, maps tensor data once, and decodes each
tensor on the device, in one jitted pass from its bytes, into the form every format shares:

    weight[row, j] = q[row, j] * scale[row, j // sub] (+ offset[row, j // sub])

with q small integers (int8), so a load is `dequantize(unpack(...))`: every format is decoded to
float, and jspec's own int8 / q4 formats (`jspec.models.quant`) quantize that float again (the
file's blocks are not kept). Layouts follow ggml's
`dequantize_row_*`; the tests check every format against gguf-py's reference dequantizer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import struct
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jspec.models import quant

Array = jax.Array

# ggml_type ids of the formats jspec decodes, and (elements per block, bytes per block) of each.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0",
              Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
BLOCK = {kind: tuple(GGML_QUANT_SIZES[kind]) for kind in TYPE_NAMES}  # the formats jspec decodes

# GGUF metadata value types -> struct format (scalars) or numpy dtype (arrays).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  shape: tuple[int, ...]  # numpy order: the row (ggml's ne0) last
  ggml_type: int
  offset: int  # absolute byte offset in the file

  @property
  def type_name(self) -> str:
    try:
      return GGMLQuantizationType(self.ggml_type).name
    except ValueError:
      return f"ggml type {self.ggml_type}"

  @property
  def nbytes(self) -> int:
    if self.ggml_type not in GGML_QUANT_SIZES:
      raise ValueError(f"tensor {self.name!r} has unknown ggml type {self.ggml_type}")
    block, size = GGML_QUANT_SIZES[self.ggml_type]
    return math.prod(self.shape) // block * size


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Blocks:
  """weight = q * scale (+ offset), the scales shared by `sub` consecutive entries of a row."""
  q: Array  # [R, N] int8 (float formats: the values themselves, float32, scale None)
  scale: Optional[Array]  # [R, N // sub] float32
  offset: Optional[Array]  # [R, N // sub] float32, or None
  sub: int = dataclasses.field(metadata=dict(static=True))


class GGUFFile:
  """Header, metadata and tensor table of a GGUF file; tensor bytes stay memory-mapped."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    if not self.path.is_file():
      raise FileNotFoundError(f"GGUF file {str(self.path)!r} not found. Fix: check the path, or "
                              f"run without a model argument to use the default model.")
    with open(self.path, "rb") as f:
      if f.seek(0, 2) == 0:
        raise ValueError(f"{self.path} is empty (0 bytes), not a GGUF file. Fix: download it again")
      self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = self._map
    if buf[:4] != b"GGUF":
      raise ValueError(f"{self.path} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    try:
      version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
      if version in (2, 3):
        self._read_tables(n_tensors, n_kv)
    except (struct.error, ValueError, OverflowError, MemoryError) as e:
      raise ValueError(f"{self.path} is truncated or corrupt: its header ({len(buf):,} bytes in "
                       f"the file) could not be read ({e}). Fix: download the file again") from None
    if version not in (2, 3):
      raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
    self._check_complete()

  def _read_tables(self, n_tensors: int, n_kv: int) -> None:
    """The metadata and the tensor table after the 24-byte preamble."""
    self._pos = 24
    self.metadata: dict[str, Any] = {}
    for _ in range(n_kv):
      key = self._string()
      (kind,) = self._unpack("<I")
      self.metadata[key] = self._value(kind)
    align = self.metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
      raise ValueError(f"general.alignment={align!r} is not a power of two")
    self.tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
      name = self._string()
      (n_dims,) = self._unpack("<I")
      if not 1 <= n_dims <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions (GGUF tensors have 1 to "
                         f"{MAX_DIMS})")
      dims = self._unpack(f"<{n_dims}Q")
      kind, offset = self._unpack("<IQ")
      if math.prod(dims) >= 2**63:
        raise ValueError(f"tensor {name!r} has dimensions {list(dims)}: more than 2**63 elements")
      if name in self.tensors:
        raise ValueError(f"tensor {name!r} is listed twice in the tensor table")
      self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), kind, offset)
    data_start = -(-self._pos // align) * align
    self._check_layout(align)
    self.tensors = {name: dataclasses.replace(t, offset=data_start + t.offset)
                    for name, t in self.tensors.items()}

  def _check_layout(self, align: int) -> None:
    """Tensor offsets (relative to the data) as ggml writes them and llama.cpp requires: each
    tensor starts where the one before it ends, padded to the alignment, so a corrupt table is an
    error rather than tensors read from the wrong bytes. Past a tensor whose type this gguf
    package does not know (its size unknown) offsets are only checked for alignment."""
    expected = 0
    for t in self.tensors.values():
      if t.offset % align:
        raise ValueError(f"tensor {t.name!r} has offset {t.offset}, not a multiple of the "
                         f"alignment {align}")
      known = t.ggml_type in GGML_QUANT_SIZES
      if known and t.shape[-1] % GGML_QUANT_SIZES[t.ggml_type][0]:
        raise ValueError(f"tensor {t.name!r} rows of {t.shape[-1]} are not whole "
                         f"{t.type_name} blocks of {GGML_QUANT_SIZES[t.ggml_type][0]}")
      if expected is not None and t.offset != expected:
        raise ValueError(f"tensor {t.name!r} has offset {t.offset}, expected {expected} (where "
                         f"the tensor before it ends)")
      if not known:
        expected = None  # its size is unknown: the offsets after it are checked for alignment only
      elif expected is not None:
        expected += -(-t.nbytes // align) * align

  def _check_complete(self) -> None:
    """A file cut short (an interrupted download) fails here, naming the bytes it lacks, not later
    in a reshape of the first tensor that reaches past its end."""
    known = [t for t in self.tensors.values() if t.ggml_type in GGML_QUANT_SIZES]
    if not known:
      return
    last = max(known, key=lambda t: t.offset + t.nbytes)
    needed, size = last.offset + last.nbytes, len(self._map)
    if needed > size:
      raise ValueError(
          f"{self.path} is truncated or corrupt: its tensors need {needed:,} bytes (tensor "
          f"{last.name!r} ends there), the file has {size:,} ({needed - size:,} missing). Fix: "
          f"download the file again (an interrupted copy or download leaves it short)")

  def _unpack(self, fmt: str) -> tuple:
    values = struct.unpack_from(fmt, self._map, self._pos)
    self._pos += struct.calcsize(fmt)
    return values

  def _string(self) -> str:
    (n,) = struct.unpack_from("<Q", self._map, self._pos)
    start = self._pos + 8
    self._pos = start + n
    return self._map[start:start + n].decode("utf-8", errors="replace")

  def _value(self, kind: int) -> Any:
    if kind == _STRING:
      return self._string()
    if kind in _SCALAR:
      return self._unpack(_SCALAR[kind])[0]
    if kind != _ARRAY:
      raise ValueError(f"{self.path}: unknown GGUF metadata value type {kind}")
    item, count = self._unpack("<IQ")
    if item in _NUMPY:  # numeric arrays in one read
      values = np.frombuffer(self._map, _NUMPY[item], count, self._pos)
      self._pos += values.nbytes
      return values.tolist()
    return [self._value(item) for _ in range(count)]

  def raw(self, name: str) -> np.ndarray:
    """The tensor's bytes as [rows, bytes per row] uint8, a view of the mapped file."""
    info = self.tensors[name]
    rows = math.prod(info.shape[:-1])
    return np.frombuffer(self._map, np.uint8, info.nbytes, info.offset).reshape(rows, -1)

  def check_decodable(self, name: str) -> TensorInfo:
    info = self.tensors[name]
    if info.ggml_type not in _UNPACK:
      raise ValueError(
          f"{self.path}: tensor {name!r} is stored as {info.type_name}, which jspec does not "
          f"decode (it reads {', '.join(TYPE_NAMES.values())}). Fix: re-quantize the model to one "
          f"of those (llama.cpp's `llama-quantize`).")
    return info

  def tensor(self, name: str, layout: Optional[Callable[[Array], Array]] = None,
             dtype=jnp.float32) -> Array:
    """The tensor dequantized on the device, [numpy-order shape] or `layout` of it, as `dtype`."""
    info = self.check_decodable(name)
    return materialize(jnp.asarray(self.raw(name)), info.ggml_type, info.shape, layout, dtype)

  def close(self) -> None:
    self._map.close()


def unpack(raw: Array, ggml_type: int) -> Blocks:
  """Blocks over rows [R, N] from a tensor's bytes [R, bytes per row] (traceable)."""
  _, size = BLOCK[ggml_type]
  R = raw.shape[0]
  return _UNPACK[ggml_type](raw.reshape(R, -1, size), R)


def dequantize(b: Blocks) -> Array:
  """float32 [R, N] from unpacked blocks (ggml's order of operations: q * scale + offset)."""
  if b.scale is None:
    return b.q.astype(jnp.float32)
  return quant.dequantize(b.q, b.scale, b.offset, b.sub)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def materialize(raw: Array, ggml_type: int, shape: tuple[int, ...],
                layout: Optional[Callable[[Array], Array]], dtype) -> Array:
  """A tensor's bytes -> dense `dtype` weights in `shape`, then `layout` (reshape/transpose): one
  fused XLA pass. `layout` is a static argument: pass the same function object for every tensor
  that shares it, or each call compiles anew."""
  w = dequantize(unpack(raw, ggml_type)).reshape(shape)
  if layout is not None:
    w = layout(w)
  return w.astype(dtype)


# ----------------------------------------------------------------------------- block formats
# Each takes the raw blocks [R, nb, bytes per block] (uint8, on the device) and returns Blocks over
# [R, nb * block]. They run inside one jit with the dequantization and layout (`materialize`), so
# XLA fuses bit unpacking, scaling and transposition into a pass over the file's bytes.


def _f16(x: Array) -> Array:
  """Little-endian float16 from the last axis of 2 bytes, as float32."""
  return jax.lax.bitcast_convert_type(x, jnp.float16).astype(jnp.float32)


def _nibbles(qs: Array) -> Array:
  """[..., 16] bytes -> [..., 32]: the 16 low nibbles, then the 16 high ones (Q4_0/Q4_1/Q5_*)."""
  return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: Array, n: int) -> Array:
  """[..., 4] bytes of a little-endian uint32 -> its n low bits [..., n] as 0/1."""
  return jnp.unpackbits(qh, axis=-1, bitorder="little")[..., :n]


def _int8(x: Array) -> Array:
  return x.astype(jnp.int8)


def _floats(raw, R, dtype):
  flat = raw.reshape(R, -1, jnp.dtype(dtype).itemsize)
  return Blocks(jax.lax.bitcast_convert_type(flat, dtype).astype(jnp.float32), None, None, 1)


def _bf16(raw, R):
  return Blocks(jax.lax.bitcast_convert_type(raw.reshape(R, -1, 2), jnp.bfloat16)
                .astype(jnp.float32), None, None, 1)


def _q8_0(raw, R):
  d, qs = _f16(raw[..., :2]), jax.lax.bitcast_convert_type(raw[..., 2:], jnp.int8)
  return Blocks(qs.reshape(R, -1), d, None, 32)


def _q4_0(raw, R):
  d, q = _f16(raw[..., :2]), _int8(_nibbles(raw[..., 2:])) - 8
  return Blocks(q.reshape(R, -1), d, None, 32)


def _q4_1(raw, R):
  d, m, q = _f16(raw[..., :2]), _f16(raw[..., 2:4]), _nibbles(raw[..., 4:])
  return Blocks(_int8(q).reshape(R, -1), d, m, 32)


def _q5_0(raw, R):
  d, high = _f16(raw[..., :2]), _bits(raw[..., 2:6], 32)
  q = _int8(_nibbles(raw[..., 6:]) | (high << 4)) - 16
  return Blocks(q.reshape(R, -1), d, None, 32)


def _q5_1(raw, R):
  d, m, high = _f16(raw[..., :2]), _f16(raw[..., 2:4]), _bits(raw[..., 4:8], 32)
  q = _int8(_nibbles(raw[..., 8:]) | (high << 4))
  return Blocks(q.reshape(R, -1), d, m, 32)


def _k_scales(s: Array) -> tuple[Array, Array]:
  """Q4_K/Q5_K: 12 bytes -> 8 six-bit (scale, min) pairs, one per 32-entry sub-block."""
  low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
  high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
  high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
  return (jnp.concatenate([low_sc, high_sc], -1).astype(jnp.float32),
          jnp.concatenate([low_m, high_m], -1).astype(jnp.float32))


def _k_nibbles(qs: Array) -> Array:
  """Q4_K/Q5_K: 128 bytes -> 256 values; each 32-byte chunk gives 32 low then 32 high nibbles."""
  chunks = qs.reshape(*qs.shape[:-1], 4, 32)
  return jnp.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _k_blocks(raw, R, q):
  """Q4_K/Q5_K: super-block scale d and min dmin times each sub-block's six-bit scale and min."""
  d, dmin = _f16(raw[..., 0:2]), _f16(raw[..., 2:4])
  sc, m = _k_scales(raw[..., 4:16])
  return Blocks(_int8(q).reshape(R, -1), (d[..., None] * sc).reshape(R, -1),
                (-(dmin[..., None] * m)).reshape(R, -1), 32)


def _q4_k(raw, R):
  return _k_blocks(raw, R, _k_nibbles(raw[..., 16:144]))


def _q5_k(raw, R):
  qh = raw[..., 16:48]  # bit 2i of byte l: high bit of low nibble l in chunk i, 2i+1: of high
  high = jnp.unpackbits(qh[..., None], axis=-1, bitorder="little")  # [..., 32 l, 8 bits]
  high = jnp.swapaxes(high, -1, -2).reshape(*qh.shape[:-1], 256)  # [..., bit * 32 + l]
  return _k_blocks(raw, R, _k_nibbles(raw[..., 48:176]) | (high << 4))


def _q6_k(raw, R):
  ql, qh = raw[..., 0:128], raw[..., 128:192]
  sc = jax.lax.bitcast_convert_type(raw[..., 192:208], jnp.int8).astype(jnp.float32)  # per 16
  d = _f16(raw[..., 208:210])
  parts = []
  for half in range(2):  # 128 entries each: ql bytes 64*half.., qh bytes 32*half..
    low, high = ql[..., 64 * half:64 * half + 64], qh[..., 32 * half:32 * half + 32]
    parts += [(low[..., :32] & 0x0F) | ((high & 3) << 4),
              (low[..., 32:] & 0x0F) | (((high >> 2) & 3) << 4),
              (low[..., :32] >> 4) | (((high >> 4) & 3) << 4),
              (low[..., 32:] >> 4) | (((high >> 6) & 3) << 4)]
  q = _int8(jnp.concatenate(parts, axis=-1)) - 32
  return Blocks(q.reshape(R, -1), (d[..., None] * sc).reshape(R, -1), None, 16)


_UNPACK = {
    F32: lambda raw, R: _floats(raw, R, jnp.float32),
    F16: lambda raw, R: _floats(raw, R, jnp.float16),
    BF16: _bf16,
    Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1,
    Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
}
