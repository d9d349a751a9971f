"""Native CPU kernels of decoding (float32, int8 and q4 weights), compiled on first use and called from XLA through its FFI.

- `int8_linear` (`int8_matmul.cc`), what decoding runs: int8 x int8 -> int32 sums for float32
  activations quantized per row inside the call (`quantize.h`, the bits of `quant.quantize_rows`)
  and scaled on the way out: a whole projection, no XLA work around it. XLA's own int8 dot streams
  weights at 3-13 GB/s at decode shapes, far below memory speed, so a decode step was bound by it
  (`benchmarks/issue17_int8_step_profile_cpu.json`). `int8_matmul` is its integer core alone
  (int8 operands in, int32 out), where tests check the sums are exact.
- `q4_matmul` (`q4_matmul.cc`): 4-bit weights (groups of 32 inputs, one float16 scale each, and
  optionally one float16 offset: ggml's Q4_0 and Q4_1 blocks, exactly) times float32 activations
  quantized the same way: 0.56 (0.63 with offsets) of the bytes of int8 weights to stream.
- `f32_linear` (`f32_matmul.cc`): the float32 matmul over output-major weights, each output
  summed in one fixed order whatever the number of rows: XLA:CPU's float32 dot slows to ~20 GB/s
  at 2-8 rows, so a verification block cost ~1.5 one-token steps; this streams at memory speed.
- `attention` (`attention.cc`): attention over the stacked KV cache whose sums run in a fixed
  order that depends only on the visible slots, so a token gets the same bits alone or in a
  verification block, over any cache size; XLA needs a token-by-token loop for that (slow).

The C++ sources ship with the package and are compiled once per machine with the system's C++
compiler (`$CXX`, else `c++`, `g++`, `clang++`) and `-march=native`, into `~/.cache/jspec/native`
(keyed by the sources, the flags, the jaxlib version and the CPU). There is no silent fallback:
if the library cannot be built, using it raises, naming the fix.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from jspec.paths import cache_dir

SOURCE_DIR = Path(__file__).parent
SOURCES = tuple(Path(__file__).with_name(f)
                for f in ("int8_matmul.cc", "q4_matmul.cc", "f32_matmul.cc", "attention.cc"))
HEADERS = tuple(Path(__file__).with_name(f) for f in ("parallel.h", "quantize.h"))
INT8 = "jspec_int8_matmul"
INT8_LINEAR = "jspec_int8_linear"
Q4 = "jspec_q4_matmul"
Q4_OFFSET = "jspec_q4_offset_matmul"
F32_LINEAR = "jspec_f32_linear"
ATTENTION = "jspec_attention"
ATTENTION_MASS = "jspec_attention_mass"
Q4_GROUP = 32  # inputs sharing one scale in the 4-bit format
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
PATHS = {1: "avx512-vnni", 0: "portable"}  # what JspecInt8MatmulPath() reports


class NativeKernelError(RuntimeError):
  """The native kernel could not be built or loaded on this machine."""


def _compiler() -> str:
  for name in filter(None, (os.environ.get("CXX"), "c++", "g++", "clang++")):
    found = shutil.which(name)
    if found:
      return found
  raise NativeKernelError(
      "jspec's native CPU kernels (float32, int8 and q4 weights on CPU) need a C++ compiler "
      "and none was found ($CXX, c++, g++, clang++). Fix: install one (e.g. `apt-get install "
      "g++`), or use XLA's dots instead: --weights float32-xla / load(..., 'float32-xla'), "
      "--weights int8-xla (slower on CPU).")


def _cpu_signature() -> str:
  """What -march=native compiles for: the CPU's model and feature flags where Linux tells them."""
  try:
    info = Path("/proc/cpuinfo").read_text()
    return "\n".join(sorted({line for line in info.splitlines()
                             if line.startswith(("model name", "flags", "Features"))}))
  except OSError:
    return platform.processor() or platform.machine()


def _library_path(compiler: str) -> Path:
  key = hashlib.sha256()
  for part in (*(f.read_bytes() for f in SOURCES + HEADERS), compiler.encode(),
               " ".join(FLAGS).encode(), jax.__version__.encode(), jaxlib.__version__.encode(),
               _cpu_signature().encode(), platform.machine().encode()):
    key.update(part)
    key.update(b"\0")
  return cache_dir() / "native" / f"jspec_native-{key.hexdigest()[:16]}.so"


def build() -> Path:
  """The compiled library for this machine, compiling it if it is not cached yet."""
  compiler = _compiler()
  out = _library_path(compiler)
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    tmp_out = Path(tmp) / out.name
    # One compiler process a source, all at once (the machine's cores compile in parallel: ~15 s
    # in one process on 2 cores, the first-use wait of every CPU model load), then one link.
    compile_flags = [f for f in FLAGS if f != "-shared"]
    objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
    steps = [[compiler, *compile_flags, f"-I{jax.ffi.include_dir()}", f"-I{SOURCE_DIR}", "-c",
              str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objects)]
    running = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)) for cmd in steps]
    results = []
    for cmd, proc in running:  # read each one's output as it ends (a full pipe would stall it)
      stderr = proc.communicate()[1]
      results.append((cmd, proc.returncode, stderr))
    link = [compiler, *FLAGS, *map(str, objects), "-o", str(tmp_out)]
    if all(code == 0 for _, code, _ in results):
      proc = subprocess.run(link, capture_output=True, text=True)
      results.append((link, proc.returncode, proc.stderr))
    failed = [(cmd, err) for cmd, code, err in results if code != 0]
    if failed:
      cmd, stderr = failed[0]
      errors = [line for line in stderr.splitlines() if "error" in line] or [stderr]
      raise NativeKernelError(
          f"compiling jspec's native CPU kernels failed ({' '.join(cmd)}):\n"
          f"{chr(10).join(errors)[:3000]}\n"
          f"Fix: a C++17 compiler with jaxlib's FFI headers, or use XLA's dots instead: "
          f"--weights float32-xla / load(..., 'float32-xla'), --weights int8-xla.")
    os.replace(tmp_out, out)  # atomic: concurrent builders each publish a whole file
  return out


@functools.cache
def _library() -> ctypes.CDLL:
  lib = ctypes.CDLL(str(build()))
  jax.ffi.register_ffi_target(INT8, jax.ffi.pycapsule(lib.JspecInt8Matmul), platform="cpu")
  jax.ffi.register_ffi_target(INT8_LINEAR, jax.ffi.pycapsule(lib.JspecInt8Linear), platform="cpu")
  jax.ffi.register_ffi_target(Q4, jax.ffi.pycapsule(lib.JspecQ4Matmul), platform="cpu")
  jax.ffi.register_ffi_target(Q4_OFFSET, jax.ffi.pycapsule(lib.JspecQ4OffsetMatmul),
                              platform="cpu")
  jax.ffi.register_ffi_target(F32_LINEAR, jax.ffi.pycapsule(lib.JspecF32Linear), platform="cpu")
  jax.ffi.register_ffi_target(ATTENTION, jax.ffi.pycapsule(lib.JspecAttention), platform="cpu")
  jax.ffi.register_ffi_target(ATTENTION_MASS, jax.ffi.pycapsule(lib.JspecAttentionMass),
                              platform="cpu")
  return lib


def kernel_path() -> str:
  """Which code path the compiled kernel uses on this CPU ("avx512-vnni" or "portable")."""
  return PATHS[_library().JspecInt8MatmulPath()]


def int8_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """y [M, N] int32 = x [M, K] int8 . w [N, K] int8^T, exact (CPU only)."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"int8_matmul takes x [M, K] and w [N, K], got {x.shape} and {w.shape}")
  if x.dtype != jnp.int8 or w.dtype != jnp.int8:
    raise ValueError(f"int8_matmul takes int8 operands, got {x.dtype} and {w.dtype}")
  _library()
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.int32)
  return jax.ffi.ffi_call(INT8, out, vmap_method="sequential")(x, w)


def _layer_index(layer, L: int, name: str) -> jax.Array:
  """`layer` (a Python or traced integer) as the int32 scalar the kernels read; out of [0, L)
  raises here when it is known, and fails the kernel's call when it is traced."""
  index = jnp.asarray(layer)
  if index.shape != () or not jnp.issubdtype(index.dtype, jnp.integer):
    raise ValueError(f"{name}: layer must be an integer scalar, got {index.dtype}{index.shape}")
  if not isinstance(index, jax.core.Tracer) and not 0 <= int(index) < L:
    raise ValueError(f"{name}: layer {int(index)} is out of [0, {L})")
  return index.astype(jnp.int32)


def _with_layer_axis(w: jax.Array, layer, ndim: int, name: str) -> tuple[jax.Array, jax.Array]:
  """(w with a leading layers axis, the layer to read): the kernels read one layer of weights
  stacked on a leading [L] axis in place, whatever the layer (a traced one in a scan over stacked
  layers); a single layer's weights [...] come as [1, ...] and layer 0."""
  if layer is None:
    return w[None], jnp.zeros((), jnp.int32)
  if w.ndim != ndim + 1:
    raise ValueError(f"{name} with a layer takes weights stacked on a leading [L] axis, got "
                     f"shape {w.shape}")
  return w, _layer_index(layer, w.shape[0], name)


def int8_linear(x: jax.Array, w: jax.Array, w_scale: jax.Array, layer=None) -> jax.Array:
  """y [M, N] float32 = quantize(x) . w^T * x_scale * w_scale for float32 x [M, K], int8 w [N, K]
  and its per-row scale w_scale [N]: x quantized per row as `jspec.models.quant.quantize_rows`
  does, to the bit, and the int8 sums exact (CPU only). A projection in one call. `layer` (an
  integer, traced or not): w [L, N, K] and w_scale [L, N] hold every layer's, read at `layer`."""
  given = (x.shape, w.shape, w_scale.shape)
  w, index = _with_layer_axis(w, layer, 2, "int8_linear")
  w_scale, _ = _with_layer_axis(w_scale, layer, 1, "int8_linear")
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2] or w_scale.shape != w.shape[:2]:
    raise ValueError(f"int8_linear takes x [M, K], w [N, K] and w_scale [N] (w and w_scale with a "
                     f"leading [L] with a layer), got shapes {given}")
  if x.dtype != jnp.float32 or w.dtype != jnp.int8 or w_scale.dtype != jnp.float32:
    raise ValueError(f"int8_linear takes float32 x, int8 w and float32 w_scale, got {x.dtype}, "
                     f"{w.dtype} and {w_scale.dtype}")
  _library()
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(INT8_LINEAR, out, vmap_method="sequential")(x, w, w_scale, index)


def f32_linear(x: jax.Array, w: jax.Array, layer=None) -> jax.Array:
  """y [M, N] float32 = x [M, K] . w [N, K]^T, every y[m, n] summed in the same order whatever M
  (CPU only). `layer` (an integer, traced or not): w [L, N, K] holds every layer's, read at
  `layer` in place. Differentiable: its gradients are XLA dots."""
  given = (x.shape, w.shape)
  w, index = _with_layer_axis(w, layer, 2, "f32_linear")
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
    raise ValueError(f"f32_linear takes x [M, K] and w [N, K] (or [L, N, K] with a layer), got "
                     f"shapes {given}")
  if x.dtype != jnp.float32 or w.dtype != jnp.float32:
    raise ValueError(f"f32_linear takes float32 operands, got {x.dtype} and {w.dtype}")
  _library()
  return _f32_linear(x, w, index)


@jax.custom_vjp
def _f32_linear(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(F32_LINEAR, out, vmap_method="sequential")(x, w, layer)


def _f32_linear_fwd(x, w, layer):
  return _f32_linear(x, w, layer), (x, w, layer)


def _f32_linear_bwd(res, dy):
  # dw is the whole stacked weight's, zero but at `layer`: a scan over stacked layers then adds L
  # such arrays (training on these weights is slower stacked; jspec trains on XLA's formats).
  x, w, layer = res
  dw = jnp.zeros_like(w).at[layer].set(dy.T @ x)  # [L, N, K]: only the layer read
  return dy @ w[layer], dw, None


_f32_linear.defvjp(_f32_linear_fwd, _f32_linear_bwd)


def q4_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, layer=None,
              offset: jax.Array | None = None) -> jax.Array:
  """y [M, N] float32 = quantize(x) . w^T * x_scale for float32 x [M, K] (quantized per row as
  `jspec.models.quant.quantize_rows` does) and 4-bit w given as codes [N, K / 2] uint8 (two codes
  a byte in `jspec.models.quant.pack_q4`'s order) and scale [N, K / 32] float16, one per group of
  32 inputs (CPU only): w = scale * (code - 8), or with `offset` (float16, scale's shape)
  w = scale * code + offset. `layer` (an integer, traced or not): codes, scale and offset hold
  every layer's on a leading [L] axis, read at `layer` in place."""
  given = (x.shape, codes.shape, scale.shape, None if offset is None else offset.shape)
  codes, index = _with_layer_axis(codes, layer, 2, "q4_matmul")
  scale, _ = _with_layer_axis(scale, layer, 2, "q4_matmul")
  if offset is not None:
    offset, _ = _with_layer_axis(offset, layer, 2, "q4_matmul")
  M, K = x.shape
  N = codes.shape[1]
  L = codes.shape[0]
  if (x.ndim != 2 or K % Q4_GROUP or codes.shape != (L, N, K // 2)
      or scale.shape != (L, N, K // Q4_GROUP)
      or (offset is not None and offset.shape != scale.shape)):
    raise ValueError(f"q4_matmul takes x [M, K] (K a multiple of {Q4_GROUP}), codes [N, K / 2] "
                     f"and scale (and offset) [N, K / {Q4_GROUP}] (all but x with a leading [L] "
                     f"with a layer), got shapes {given}")
  if (x.dtype != jnp.float32 or codes.dtype != jnp.uint8 or scale.dtype != jnp.float16
      or (offset is not None and offset.dtype != jnp.float16)):
    raise ValueError(f"q4_matmul takes float32 x, uint8 codes and float16 scales and offsets, "
                     f"got {x.dtype}, {codes.dtype}, {scale.dtype}"
                     f"{'' if offset is None else ', ' + str(offset.dtype)}")
  _library()
  out = jax.ShapeDtypeStruct((M, N), jnp.float32)
  if offset is None:
    return jax.ffi.ffi_call(Q4, out, vmap_method="sequential")(x, codes, scale, index)
  return jax.ffi.ffi_call(Q4_OFFSET, out, vmap_method="sequential")(x, codes, scale, offset,
                                                                     index)


def attention(q: jax.Array, k_all: jax.Array, v_all: jax.Array, visible: jax.Array,
              layer, with_mass: bool = False):
  """GQA attention of q [B, T, H, D] over layer `layer` (an integer, traced or not) of the stacked
  cache k_all, v_all [L, B, S, K, D] (float32), each token seeing the slots visible [B, T, S]
  marks -> [B, T, H, D]. A token's bits depend only on its query and its visible slots (CPU
  only). with_mass: also [B, T, S, K], each token's attention probabilities averaged over the
  query heads of each KV head (0 on slots it does not see), with the same guarantee."""
  B, T, H, D = q.shape
  L, Bk, S, K, Dk = k_all.shape
  index = _layer_index(layer, L, "attention")
  if (v_all.shape != k_all.shape or (Bk, Dk) != (B, D) or visible.shape != (B, T, S)
      or H % K or H // K > 64):
    raise ValueError(f"attention takes q [B, T, H, D], k, v [L, B, S, K, D], visible [B, T, S] "
                     f"(at most 64 query heads per KV head) and 0 <= layer < L, got {q.shape}, "
                     f"{k_all.shape}, {v_all.shape}, "
                     f"{visible.shape}, layer {layer}")
  if not q.dtype == k_all.dtype == v_all.dtype == jnp.float32:
    raise ValueError(f"native attention reads a float32 cache and float32 queries, got "
                     f"{q.dtype}, {k_all.dtype}, {v_all.dtype}: allocate the KV cache in float32")
  _library()
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  if with_mass:
    mass = jax.ShapeDtypeStruct((B, T, S, K), jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_MASS, (out, mass), vmap_method="sequential")(
        q, k_all, v_all, visible.astype(jnp.bool_), index)
  return jax.ffi.ffi_call(ATTENTION, out, vmap_method="sequential")(
      q, k_all, v_all, visible.astype(jnp.bool_), index)
