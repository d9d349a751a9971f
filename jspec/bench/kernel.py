"""`jspec bench-kernel`: the Pallas kernels timed against what they replace (tree attention
below; the key-similarity kernel of KV eviction at the end).

Each shape is timed three ways on the same inputs: the kernel, the pure-jnp reference
(`tree_attention_reference`, jitted) and the XLA attention the model runs otherwise
(`attention.masked_attention` under a precomputed `attention.attention_mask`, as `attention_fn`
builds it once per forward). Inputs are what a tree-verification step sees: ragged committed lengths, random
draft trees, and NaN in every cache slot at or past lengths + T, so a kernel that reads a slot it
should skip is caught rather than timed.

The kernel's output is checked against the reference before it is timed; a kernel whose output is
not finite or not within the dtype's tolerance gets no timing (kernel_s and the speedups are None,
"correct" is False) so a broken build never shows up as a fast one. In interpret mode (the Pallas
interpreter, for CPU smoke runs) the kernel's seconds measure the interpreter, not the kernel, so
the record says "interpret": true and carries no speedup.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models import attention
from jspec.models.numerics import precision_label
from jspec.pallas.key_similarity import key_similarity, key_similarity_reference, slice_size
from jspec.pallas.tree_attention import BlockSizes, tree_attention, tree_attention_reference
from jspec.bench.profiling import machine_info

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class KernelShape:
  """One attention call: B rows, a cache of S slots, T new (tree) tokens, H query heads over K kv
  heads of width D."""

  name: str
  B: int
  S: int
  T: int
  H: int
  K: int
  D: int


# Model-sized shapes: the default model (SmolLM2-135M: 9 query heads over 3 kv heads of 64), a
# Llama-3-8B-like GQA layer (32 over 8, D=128, long cache) and a Llama-2-7B-like MHA layer.
DEFAULT_SHAPES = (
    KernelShape("smollm2-t16-b1", B=1, S=1024, T=16, H=9, K=3, D=64),
    KernelShape("smollm2-t16-b8", B=8, S=1024, T=16, H=9, K=3, D=64),
    KernelShape("smollm2-t64-b1", B=1, S=1024, T=64, H=9, K=3, D=64),
    KernelShape("smollm2-t64-b8", B=8, S=1024, T=64, H=9, K=3, D=64),
    KernelShape("llama3-8b-t64-b1", B=1, S=4096, T=64, H=32, K=8, D=128),
    KernelShape("llama3-8b-t64-b8", B=8, S=4096, T=64, H=32, K=8, D=128),
    KernelShape("llama2-7b-t32-b4", B=4, S=2048, T=32, H=32, K=32, D=128),
)
# Tiny shapes for interpreted smoke runs on CPU (S a multiple of 128 so the default block_k fits).
SMALL_SHAPES = (
    KernelShape("tiny-b2", B=2, S=256, T=8, H=4, K=2, D=64),
    KernelShape("tiny-gqa3-b3", B=3, S=256, T=16, H=6, K=2, D=32),
)
ALL_SHAPES = {s.name: s for s in DEFAULT_SHAPES + SMALL_SHAPES}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Largest accepted max |out - reference| as a fraction of max |reference|. float32 leaves room for
# TF32 matmuls on GPU (~1e-3); bfloat16 for the kernel's bfloat16 probabilities and output
# rounding (~4e-3). A wrong kernel (a missed block, a leaked NaN, zeros) is off by O(1).
TOLERANCE = {"float32": 1e-2, "bfloat16": 5e-2}

# Jitted once at import: the reference and the model's attention core (mask precomputed, as the
# model computes it once per forward for all layers).
_reference = jax.jit(tree_attention_reference)
_xla_attention = jax.jit(attention.masked_attention)


def select_shapes(names: Optional[str], small: bool) -> list[KernelShape]:
  """Shapes named in `names` (comma-separated, from ALL_SHAPES), else the small or default set."""
  if not names:
    return list(SMALL_SHAPES if small else DEFAULT_SHAPES)
  unknown = [n for n in names.split(",") if n not in ALL_SHAPES]
  if unknown:
    raise ValueError(f"unknown kernel shape(s) {', '.join(unknown)}; known: "
                     f"{', '.join(ALL_SHAPES)}")
  return [ALL_SHAPES[n] for n in names.split(",")]


def random_tree_masks(rng: np.random.Generator, B: int, T: int) -> np.ndarray:
  """Ancestor-or-self masks [B, T, T] of random trees (parent[i] < i, node 0 the root)."""
  masks = np.zeros((B, T, T), bool)
  for b in range(B):
    for i in range(T):
      if i:  # a node sees what its parent sees, and itself
        masks[b, i] = masks[b, int(rng.integers(0, i))]
      masks[b, i, i] = True
  return masks


def ragged_lengths(shape: KernelShape) -> np.ndarray:
  """[B] committed lengths spread evenly over [S // 4, S - T - 1] (the middle when B = 1)."""
  lo, hi = shape.S // 4, shape.S - shape.T - 1
  if shape.B == 1:
    return np.array([(lo + hi) // 2])
  return np.linspace(lo, hi, shape.B).round().astype(np.int64)


def make_inputs(shape: KernelShape, dtype, seed: int = 0):
  """q [B, T, H, D], k, v [B, S, K, D] (NaN at or past lengths + T), lengths [B], masks [B, T, T]
  (ancestor-or-self)."""
  B, S, T, H, K, D = shape.B, shape.S, shape.T, shape.H, shape.K, shape.D
  rng = np.random.default_rng(seed)
  lengths = ragged_lengths(shape)
  q = rng.standard_normal((B, T, H, D), dtype=np.float32)
  k = rng.standard_normal((B, S, K, D), dtype=np.float32)
  v = rng.standard_normal((B, S, K, D), dtype=np.float32)
  for b in range(B):  # never visible: any of it reaching the output turns the output NaN
    k[b, lengths[b] + T:] = np.nan
    v[b, lengths[b] + T:] = np.nan
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(q), cast(k), cast(v), jnp.asarray(lengths, jnp.int32),
          jnp.asarray(random_tree_masks(rng, B, T)))


def median_seconds(fn, args: Sequence, repeats: int, warmup: int) -> float:
  """Median wall seconds of `repeats` calls of fn(*args), each waited for, after `warmup` calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def in_program_seconds(fn, args: Sequence, iters: int = 50, repeats: int = 5) -> float:
  """Seconds one call of fn(*args) costs inside a compiled program: one jitted loop runs it
  `iters` times back to back (median of `repeats` runs, divided by iters), so the Python dispatch
  and launch latency a lone call pays once (tens of microseconds, most of a small cache's time at
  batch 1) is spread thin, as for the eviction that runs inside `generate`'s while_loop. The
  inputs pass an optimization barrier each iteration so XLA cannot hoist the call out."""

  @jax.jit
  def loop(*args):
    def body(_, carry):
      inputs, _ = carry
      inputs = jax.lax.optimization_barrier(inputs)
      return inputs, fn(*inputs)
    first = fn(*args)
    return jax.lax.fori_loop(0, iters, body, (args, first))[1]

  jax.block_until_ready(loop(*args))  # compile, and a warm run
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(loop(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) / (iters + 1)


def compare(out: Array, want: Array) -> tuple[float, float]:
  """(max |out - want|, that over max |want|); NaN if out has any NaN (NaN propagates)."""
  out32, want32 = out.astype(jnp.float32), want.astype(jnp.float32)
  err = float(jnp.max(jnp.abs(out32 - want32)))
  return err, err / max(float(jnp.max(jnp.abs(want32))), 1e-30)


def kernel_backend(backend: Optional[str], interpret: bool) -> str:
  """The kernel flavour to run; ValueError unless this machine can run it compiled (or interpret).

  tree_attention itself raises on CPU only when backend is None; an explicit backend='gpu' on a
  CPU host would reach the Triton lowering and fail obscurely, so the platform is checked here.
  """
  platform = jax.devices()[0].platform
  native = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform)
  if backend is not None and backend not in ("gpu", "tpu"):
    raise ValueError(f"backend must be 'gpu', 'tpu' or None (this machine's), got {backend!r}.")
  if interpret:
    return backend or native or "gpu"
  if native is None or (backend is not None and backend != native):
    want = f"the {backend} kernel needs a {backend.upper()}" if backend else (
        "the kernel runs on GPU (Pallas Triton) or TPU (Mosaic)")
    raise ValueError(
        f"no compiled tree-attention kernel on platform {platform!r}: {want}. Run on a GPU or "
        f"TPU, or interpret the kernel (--interpret, interpret=True) for a correctness smoke run "
        f"whose timings say nothing about kernel speed.")
  return native


def bench_tree_attention(shapes: Sequence[KernelShape], dtype: str = "bfloat16", *,
                         interpret: bool, backend: Optional[str] = None, block_k: int = 128,
                         repeats: int = 20, warmup: int = 3) -> list[dict]:
  """One record per shape: median seconds of the kernel, the reference and the model's XLA
  attention, the kernel's error against the reference, and speedups (compiled runs only).

  A shape whose kernel output is wrong gets correct=False, an "error" message and no kernel
  timing; the caller decides how loud to be (`jspec bench-kernel` exits 1).
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
  if repeats < 1 or warmup < 0:
    raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}.")
  flavour = kernel_backend(backend, interpret)
  device = jax.devices()[0]
  tol = TOLERANCE[dtype]
  blocks = BlockSizes(block_k=block_k)
  records = []
  for shape in shapes:
    q, k, v, lengths, masks = make_inputs(shape, DTYPES[dtype])
    # Jitted: a direct call checks concrete lengths and masks on the host, which is not the
    # kernel's time.
    kernel = jax.jit(lambda *a: tree_attention(*a, block_sizes=blocks, interpret=interpret,
                                               backend=flavour))
    args = (q, k, v, lengths, masks)
    want = jax.block_until_ready(_reference(*args))  # [B, T, H, D]
    if not bool(jnp.isfinite(want.astype(jnp.float32)).all()):
      raise RuntimeError(f"{shape.name}: the reference is not finite; the inputs are broken.")
    # The model's cache holds zeros, not NaN, past lengths + T, and masked_attention reads
    # every slot.
    used = jnp.arange(shape.S)[None, :] < (lengths + shape.T)[:, None]  # [B, S]
    k0 = jnp.where(used[:, :, None, None], k, 0).astype(k.dtype)  # [B, S, K, D]
    v0 = jnp.where(used[:, :, None, None], v, 0).astype(v.dtype)
    full_mask = attention.attention_mask(lengths, shape.S, masks, shape.T)  # [B, T, S]
    xla_args = (q, k0, v0, full_mask)

    errors = []
    err, rel = compare(kernel(*args), want)  # also the kernel's compile
    correct = math.isfinite(err) and rel <= tol
    if not correct:
      errors.append(f"kernel output differs from the reference: max |err| {err:.3g} "
                    f"({rel:.3g} of max |reference|, tolerance {tol:g})")
    xla_err, xla_rel = compare(_xla_attention(*xla_args), want)
    xla_correct = math.isfinite(xla_err) and xla_rel <= tol
    if not xla_correct:
      errors.append(f"XLA attention differs from the reference: max |err| {xla_err:.3g} "
                    f"({xla_rel:.3g} of max |reference|, tolerance {tol:g})")

    kernel_s = median_seconds(kernel, args, repeats, warmup) if correct else None
    reference_s = median_seconds(_reference, args, repeats, warmup)
    xla_s = median_seconds(_xla_attention, xla_args, repeats, warmup) if xla_correct else None
    timed = kernel_s is not None and not interpret
    itemsize = jnp.dtype(DTYPES[dtype]).itemsize
    # The least a kernel must move: the K and V slots below lengths + T, q in, the output out.
    min_bytes = (int((np.asarray(lengths) + shape.T).sum()) * shape.K * shape.D * 2
                 + 2 * shape.B * shape.T * shape.H * shape.D) * itemsize
    records.append({
        "kernel": "tree-attention",
        **dataclasses.asdict(shape),
        "dtype": dtype,
        "block_k": block_k,
        "backend": flavour,
        "interpret": interpret,
        "matmul_precision": precision_label(),
        "device_kind": device.device_kind,
        "platform": device.platform,
        "lengths": [int(x) for x in np.asarray(lengths)],
        "repeats": repeats,
        "warmup": warmup,
        "correct": correct,
        "xla_correct": xla_correct,
        "max_abs_err": err,
        "rel_err": rel,
        "xla_max_abs_err": xla_err,
        "xla_rel_err": xla_rel,
        "tolerance": tol,
        "kernel_s": kernel_s,
        "reference_s": reference_s,
        "xla_s": xla_s,
        "speedup_vs_reference": reference_s / kernel_s if timed else None,
        "speedup_vs_xla": xla_s / kernel_s if timed and xla_s is not None else None,
        "min_bytes": min_bytes,
        "kernel_gbps": min_bytes / kernel_s / 1e9 if timed else None,
        **({"error": "; ".join(errors)} if errors else {}),
        "machine": machine_info(),
    })
  return records


def print_table(records: list[dict]) -> None:
  """Milliseconds per call and speedups, one line per shape; wrong kernels marked WRONG."""
  ms = lambda s: "-" if s is None else f"{s * 1e3:.3f}"
  x = lambda r: "-" if r is None else f"{r:.2f}x"
  print("shape | B | S | T | H/K/D | kernel ms | reference ms | xla ms | vs reference | vs xla | "
        "rel err")
  for r in records:
    print(" | ".join([
        r["name"], str(r["B"]), str(r["S"]), str(r["T"]), f"{r['H']}/{r['K']}/{r['D']}",
        ms(r["kernel_s"]) if r["correct"] else "WRONG", ms(r["reference_s"]),
        ms(r["xla_s"]) if r["xla_correct"] else "WRONG", x(r["speedup_vs_reference"]),
        x(r["speedup_vs_xla"]), f"{r['rel_err']:.2e}"]))
  if records and records[0]["interpret"]:
    print("interpret mode: kernel times are the Pallas interpreter's, not the kernel's; "
          "no speedups.")


# ------------------------------------------------------------------------------------------------
# The key-similarity (KeyDiff) kernel: the whole stacked cache scored, against its jnp reference.


@dataclasses.dataclass(frozen=True)
class CacheShape:
  """A stacked KV cache: L layers, B rows, S slots, K kv heads of width D."""

  name: str
  L: int
  B: int
  S: int
  K: int
  D: int


KEY_SHAPES = (
    CacheShape("smollm2-s2048-b1", L=30, B=1, S=2048, K=3, D=64),
    CacheShape("smollm2-s2048-b8", L=30, B=8, S=2048, K=3, D=64),
    CacheShape("llama3-8b-s8192-b1", L=32, B=1, S=8192, K=8, D=128),
)
SMALL_KEY_SHAPES = (CacheShape("tiny-keys", L=2, B=3, S=256, K=2, D=16),)
_key_reference = jax.jit(key_similarity_reference)


def select_key_shapes(names: Optional[str], small: bool) -> list[CacheShape]:
  known = {s.name: s for s in KEY_SHAPES + SMALL_KEY_SHAPES}
  if not names:
    return list(SMALL_KEY_SHAPES if small else KEY_SHAPES)
  unknown = [n for n in names.split(",") if n not in known]
  if unknown:
    raise ValueError(f"unknown cache shape(s) {', '.join(unknown)}; known: {', '.join(known)}")
  return [known[n] for n in names.split(",")]


def bench_key_similarity(shapes: Sequence[CacheShape], dtype: str = "bfloat16", *,
                         interpret: bool, backend: Optional[str] = None, block_s: int = 64,
                         part: Optional[int] = None, repeats: int = 20, warmup: int = 3
                         ) -> list[dict]:
  """One record per shape: median seconds of the kernel and of the jitted jnp reference, the
  kernel's error over the committed slots (NaN fills the rest, which must not leak into the
  mean), and the speedup (compiled runs only; a wrong kernel gets no timing)."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
  flavour = kernel_backend(backend, interpret)
  device = jax.devices()[0]
  records = []
  for shape in shapes:
    L, B, S, K, D = shape.L, shape.B, shape.S, shape.K, shape.D
    lengths = jnp.asarray(np.linspace(S // 4, S, B).round().astype(np.int32) if B > 1
                          else np.array([3 * S // 4], np.int32))
    keys = jax.random.normal(jax.random.key(0), (L, B, S, K, D), jnp.float32)
    used = (jnp.arange(S)[None, :] < lengths[:, None])[None, :, :, None, None]
    keys = jnp.where(used, keys, jnp.nan).astype(DTYPES[dtype])
    slots = min(part, S) if part else slice_size(S, block_s)  # --part S: one per head
    kernel = lambda k, n: key_similarity(k, n, block_s=block_s, part=slots, interpret=interpret,
                                         backend=flavour)
    valid = used[..., 0]  # [1, B, S, 1]
    want = jnp.where(valid, _key_reference(keys, lengths), 0.0)
    got = jnp.where(valid, kernel(keys, lengths), 0.0)
    err, rel = compare(got, want)
    correct = math.isfinite(err) and rel <= 1e-3  # both accumulate in float32
    kernel_s = median_seconds(kernel, (keys, lengths), repeats, warmup) if correct else None
    reference_s = median_seconds(_key_reference, (keys, lengths), repeats, warmup)
    timed = kernel_s is not None and not interpret
    # And as a call inside a program (the eviction's case): dispatch paid once per loop.
    kernel_in_s = in_program_seconds(kernel, (keys, lengths)) if timed else None
    reference_in_s = in_program_seconds(key_similarity_reference, (keys, lengths)) if timed \
        else None
    min_bytes = int(np.asarray(lengths).sum()) * L * K * D * jnp.dtype(DTYPES[dtype]).itemsize
    records.append({
        "kernel": "key-similarity", **dataclasses.asdict(shape), "dtype": dtype,
        "block_s": block_s, "part": slots, "backend": flavour,
        "interpret": interpret,
        "device_kind": device.device_kind, "platform": device.platform,
        "lengths": [int(x) for x in np.asarray(lengths)], "repeats": repeats, "warmup": warmup,
        "correct": correct, "max_abs_err": err, "rel_err": rel, "kernel_s": kernel_s,
        "reference_s": reference_s,
        "speedup_vs_reference": reference_s / kernel_s if timed else None,
        "min_bytes": min_bytes, "kernel_gbps": min_bytes / kernel_s / 1e9 if timed else None,
        "kernel_in_program_s": kernel_in_s, "reference_in_program_s": reference_in_s,
        "in_program_speedup_vs_reference": reference_in_s / kernel_in_s if timed else None,
        "kernel_in_program_gbps": min_bytes / kernel_in_s / 1e9 if timed else None,
        **({} if correct else {"error": f"kernel scores differ from the reference: max |err| "
                                        f"{err:.3g} ({rel:.3g} relative)"}),
        "machine": machine_info(),
    })
  return records


def print_key_table(records: list[dict]) -> None:
  ms = lambda s: "-" if s is None else f"{s * 1e3:.3f}"
  x = lambda v: "-" if v is None else f"{v:.2f}x"
  print("shape | L/B/S/K/D | kernel ms | reference ms | vs reference | in a program: kernel ms | "
        "reference ms | vs reference | rel err")
  for r in records:
    print(" | ".join([r["name"], f"{r['L']}/{r['B']}/{r['S']}/{r['K']}/{r['D']}",
                      ms(r["kernel_s"]) if r["correct"] else "WRONG", ms(r["reference_s"]),
                      x(r["speedup_vs_reference"]), ms(r["kernel_in_program_s"]),
                      ms(r["reference_in_program_s"]), x(r["in_program_speedup_vs_reference"]),
                      f"{r['rel_err']:.2e}"]))
