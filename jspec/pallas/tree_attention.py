"""Tree attention over a ragged KV cache as a Pallas kernel (Pallas Triton on GPU, Mosaic on TPU).

T new tokens per row (the nodes of a draft tree) attend to the committed prefix of their row,
`lengths[b]` slots, and to the new tokens their tree mask lets them see, which the model has just
written at slots `lengths[b] + u`. The kernel is flash attention (online softmax, float32
accumulation) over key blocks of `block_k` cache slots:

* blocks that lie wholly inside the prefix are visible to every query and need no mask;
* the few blocks that hold the new tokens (the "window") use a [T, window] visibility table built
  from the [B, T, T] tree mask, so the kernel never gathers;
* blocks past `lengths[b] + T` are never read (a loop over the row's block count on GPU; on TPU the
  grid visits them but their index map repeats the last block, so no copy is issued, and
  `pl.when` skips the compute).

GQA: the G query heads of one kv head form one query matrix of T*G rows (row t*G + g), so each
key/value block is read once per kv head, not once per query head.

Layouts. K/V stay in the model's [B, S, K, D] cache layout and are viewed as [B, S, K*D], so a kv
head is a lane-block of width D. On TPU a block's minor dimension must be a multiple of 128 or the
full K*D; when D is not a multiple of 128 a block spans `hb` kv heads (128/D, or all K) and each
head's queries are zero outside its own D lanes, so q @ k^T over the block's lanes is exactly that
head's scores and no unaligned lane slice is needed (on a 128-wide MXU the padded contraction at
D=64 costs no extra passes). On GPU (Triton) every block dimension must be a power
of two: head_dim, block_q and block_k are, and the T*G query rows are zero-padded up to block_q.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

Array = jax.Array

# Finite "minus infinity": exp(NEG - m) underflows to 0 and NEG - NEG is 0, never NaN.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
BACKENDS = ("gpu", "tpu")
TPU_LANES = 128
TPU_SUBLANES = 8
NT_DIMS = (((1,), (1,)), ((), ()))  # contract the last dims: a [M, W] @ b [N, W]^T -> [M, N]


# ------------------------------------------------------------------------------------------------
# 1. Reference.


def visibility(slots: Array, lengths: Array, tree_mask: Optional[Array], T: int) -> Array:
  """Whether each new token of row b sees cache slots `slots[b]` ([B, N] int): [B, T, N] bool."""
  B, N = slots.shape
  rel = (slots - lengths[:, None])[:, None, :]  # [B, 1, N]: index among the new tokens
  if tree_mask is None:
    in_tree = rel <= jnp.arange(T)[None, :, None]  # [B, T, N]
  else:
    idx = jnp.broadcast_to(jnp.clip(rel, 0, T - 1), (B, T, N))
    in_tree = jnp.take_along_axis(tree_mask, idx, axis=2)  # [B, T, N]
  return (rel < 0) | ((rel < T) & in_tree)


def tree_attention_reference(q: Array, k: Array, v: Array, lengths: Array,
                             tree_mask: Optional[Array]) -> Array:
  """Pure-jnp tree attention in float32: q [B, T, H, D], k, v [B, S, K, D] → [B, T, H, D]. A
  query that sees no slot (a tree mask without its diagonal over an empty prefix) gets zeros, as
  the kernel gives (a softmax over nothing is NaN)."""
  B, T, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  lengths = lengths.astype(jnp.int32)
  slots = jnp.broadcast_to(jnp.arange(S), (B, S))  # [B, S]
  visible = visibility(slots, lengths, tree_mask, T)  # [B, T, S], as attention.attention_mask
  # Slots at or past lengths + T are never visible and may hold anything (NaN): keep them out of
  # the value contraction too, where 0 * NaN would leak.
  used = jnp.arange(S)[None, :] < (lengths + T)[:, None]  # [B, S]
  v32 = jnp.where(used[:, :, None, None], v.astype(jnp.float32), 0.0)  # [B, S, K, D]
  qg = q.astype(jnp.float32).reshape(B, T, K, H // K, D)  # [B, T, K, G, D]
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST) * (D ** -0.5)
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)  # [B, K, G, T, S]
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(jnp.any(visible, axis=-1)[:, None, None, :, None], probs, 0.0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v32, precision=lax.Precision.HIGHEST)
  return out.reshape(B, T, H, D).astype(q.dtype)


# ------------------------------------------------------------------------------------------------
# 2. Block sizes and input validation.


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes: `block_k` cache slots per key block, `block_q` query rows (of T*G) per program.

  block_q=None picks the smallest legal tile that holds all T*G rows of a kv head (capped at 128
  on GPU, 256 on TPU), so K/V are read once per kv head. On GPU block_k is a ceiling: pipelining
  stages, then block_k, are cut until the K/V tiles fit the device's shared memory (`_gpu_tiles`).
  """

  block_k: int = 128
  block_q: Optional[int] = None

  def __post_init__(self):
    if not isinstance(self.block_k, int) or self.block_k <= 0:
      raise ValueError(f"BlockSizes.block_k must be a positive int, got {self.block_k!r}.")
    if self.block_q is not None and (not isinstance(self.block_q, int) or self.block_q <= 0):
      raise ValueError(
          f"BlockSizes.block_q must be a positive int or None (automatic), got {self.block_q!r}.")


def resolve_backend(backend: Optional[str], interpret: bool,
                    kernel: str = "tree_attention (Config.attention_impl='pallas')") -> str:
  """The kernel flavour to build: "gpu" (Triton) or "tpu" (Mosaic). `kernel` names the kernel
  and the setting that asked for it, for the error on a platform without one."""
  if backend is None:
    platform = jax.default_backend()
    if platform == "tpu":
      return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
      return "gpu"
    if not interpret:
      raise ValueError(
          f"{kernel} has no compiled kernel for platform {platform!r}: run it on GPU or TPU, or "
          "interpret it ('pallas-interpret', or interpret=True with backend='gpu' or 'tpu' to "
          "pick which kernel to interpret).")
    return "gpu"
  if backend not in BACKENDS:
    raise ValueError(
        f"backend must be one of {BACKENDS} or None (this machine's), got {backend!r}.")
  return backend


def _check_block_k(block_k: int, S: int, backend: str):
  if S % block_k:
    divisors = [b for b in (512, 256, 128, 64, 32, 16) if S % b == 0]
    raise ValueError(
        f"block_k={block_k} does not divide the cache size S={S}: pick a block_k that divides S"
        f"{f' (e.g. {divisors[0]})' if divisors else ''} or allocate the cache with a multiple of "
        f"block_k slots.")
  if backend == "tpu" and block_k % TPU_LANES:
    raise ValueError(
        f"block_k={block_k} must be a multiple of {TPU_LANES} on TPU (it is the lane dimension of "
        f"the mask tile): use block_k=128, 256 or 512.")
  if backend == "gpu" and (not _is_pow2(block_k) or block_k < 16):
    raise ValueError(
        f"block_k={block_k} must be a power of two >= 16 on GPU (Triton tiles are powers of two "
        f"and tl.dot needs 16): use block_k=32, 64 or 128.")


def _block_q(block_sizes: BlockSizes, M: int, backend: str) -> int:
  """Query rows per program for M = T*G rows, validated for the backend."""
  bq = block_sizes.block_q
  if backend == "gpu":
    if bq is None:
      return min(128, max(16, _next_pow2(M)))
    if not _is_pow2(bq) or bq < 16:
      raise ValueError(
          f"block_q={bq} must be a power of two >= 16 on GPU (Triton tiles are powers of two and "
          f"tl.dot needs 16): use 16, 32, 64 or 128, or None for automatic.")
    return bq
  if bq is None:
    return min(256, _round_up(M, TPU_SUBLANES))
  if bq % TPU_SUBLANES:
    raise ValueError(
        f"block_q={bq} must be a multiple of {TPU_SUBLANES} on TPU (the sublane tile): use "
        f"{_round_up(bq, TPU_SUBLANES)}, or None for automatic.")
  return bq


def _tpu_heads_per_block(K: int, D: int) -> int:
  """kv heads per TPU lane-block: 1 if D is lane-aligned, else enough heads to fill 128 lanes."""
  if D % TPU_LANES == 0:
    return 1
  if TPU_LANES % D == 0 and K % (TPU_LANES // D) == 0:
    return TPU_LANES // D
  return K  # the block is the whole K*D minor dimension


def validate_inputs(q: Array, k: Array, v: Array, lengths: Array, tree_mask: Optional[Array],
                    block_sizes: BlockSizes, backend: str, layer: Optional[int]):
  """Raise ValueError naming the problem and the fix; returns nothing."""
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, D], got shape {q.shape}.")
  if layer is None and k.ndim != 4:
    raise ValueError(
        f"k must be one layer's cache [B, S, K, D], got shape {k.shape}; for the stacked "
        f"[L, B, S, K, D] cache pass layer=i.")
  if layer is not None:
    if k.ndim != 5:
      raise ValueError(
          f"with layer={layer}, k must be the stacked cache [L, B, S, K, D], got shape {k.shape}; "
          f"for one layer's [B, S, K, D] cache leave layer=None.")
    if not isinstance(layer, int) or not 0 <= layer < k.shape[0]:
      raise ValueError(f"layer must be a Python int in [0, {k.shape[0]}), got {layer!r}.")
  if v.shape != k.shape:
    raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}.")
  B, T, H, D = q.shape
  S, K, Dk = k.shape[-3:]
  if k.shape[-4] != B:
    raise ValueError(f"q has batch {B} but the cache k has batch {k.shape[-4]}: they must match.")
  if Dk != D:
    raise ValueError(f"q has head_dim {D} but k/v have head_dim {Dk}: they must match.")
  if H % K:
    raise ValueError(
        f"num_heads H={H} must be a multiple of num_kv_heads K={K} (GQA: query head h reads kv "
        f"head h // (H // K)).")
  if not 1 <= T <= S:
    raise ValueError(f"T={T} new tokens must be between 1 and the cache size S={S}.")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.dtype not in SUPPORTED_DTYPES:
      raise ValueError(
          f"{name} has dtype {x.dtype}; supported: float32, bfloat16, float16. Cast it first.")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(
        f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}: cast the cache to "
        f"q.dtype (as the model's XLA path does) or q to the cache dtype.")
  if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be an integer array of shape ({B},), got {lengths.dtype}"
                     f"{list(lengths.shape)}.")
  if tree_mask is not None:
    if tree_mask.shape != (B, T, T):
      raise ValueError(
          f"tree_mask must be [B, T, T] = {(B, T, T)} (new token i sees new token j), got "
          f"{tree_mask.shape}; pass None for causal.")
    if tree_mask.dtype != jnp.bool_:
      raise ValueError(
          f"tree_mask must be bool, got {tree_mask.dtype}: pass tree_mask.astype(bool).")
    if not isinstance(tree_mask, jax.core.Tracer) and not np.diagonal(
        np.asarray(tree_mask), axis1=1, axis2=2).all():  # numpy: no trace op under make_jaxpr
      raise ValueError("tree_mask must let every new token see itself (its diagonal all True): "
                       "a token that sees nothing attends to nothing")
  if not isinstance(lengths, jax.core.Tracer) and int(np.max(np.asarray(lengths))) + T > S:
    raise ValueError(f"lengths + T must be <= the cache size S={S} (the new tokens' K/V sit at "
                     f"slots lengths[b] + t), got max(lengths) = {int(np.max(np.asarray(lengths)))}"
                     f", T = {T}")
  if backend == "gpu" and (not _is_pow2(D) or not 16 <= D <= 256):
    raise ValueError(
        f"head_dim D={D} is not supported by the GPU kernel: Triton tiles need a power of two in "
        f"[16, 256]. Use backend='tpu', or the XLA attention path for this model.")
  _check_block_k(block_sizes.block_k, S, backend)
  _block_q(block_sizes, T * (H // K), backend)


# ------------------------------------------------------------------------------------------------
# 3. Kernels.


def _attend_block(q: Array, k: Array, v: Array, visible: Optional[Array],
                  carry: tuple[Array, Array, Array], scale: float):
  """One online-softmax step of q [M, W] over keys k and values v [bk, W]; carry (m, l, acc)."""
  m_prev, l_prev, acc_prev = carry  # [M, 1], [M, 1], [M, W] float32
  s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * scale  # [M, bk]
  if visible is not None:
    s = jnp.where(visible, s, NEG)
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [M, 1]
  alpha = jnp.exp(m_prev - m_next)  # [M, 1]
  p = jnp.exp(s - m_next)  # [M, bk]
  if visible is not None:
    p = jnp.where(visible, p, 0.0)  # a row with nothing visible yet keeps l = 0
  l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
  pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [M, W]
  return m_next, l_next, alpha * acc_prev + pv


def _normalize(acc: Array, l: Array) -> Array:
  return acc / jnp.where(l == 0.0, 1.0, l)


def _gpu_kernel(
    lengths_ref,  # [] int32, this row's committed length
    q_ref,  # [bq, D] query rows of one kv head
    k_ref, v_ref,  # [S, D] this row's cache for that kv head
    mask_ref,  # [bq, NW] int32 visibility of the window slots
    o_ref,  # [bq, D]
    *, T: int, block_k: int, scale: float,
):
  """Program (b, n, i): loops over the row's key blocks; the trip counts depend on lengths[b]."""
  length = lengths_ref[()]
  q = q_ref[...]
  bq, W = q.shape
  first_window = lax.div(length, block_k)  # blocks before it are all prefix
  n_blocks = jnp.minimum(lax.div(length + T + block_k - 1, block_k), k_ref.shape[0] // block_k)

  def prefix_block(j, carry):
    slots = pl.ds(j * block_k, block_k)
    return _attend_block(q, k_ref[slots, :], v_ref[slots, :], None, carry, scale)

  def window_block(j, carry):
    start = j * block_k
    slots = pl.ds(start, block_k)
    visible = mask_ref[:, pl.ds((j - first_window) * block_k, block_k)] != 0  # [bq, bk]
    used = (start + jnp.arange(block_k))[:, None] < length + T  # [bk, 1]
    v = jnp.where(used, v_ref[slots, :].astype(jnp.float32), 0.0).astype(v_ref.dtype)
    return _attend_block(q, k_ref[slots, :], v, visible, carry, scale)

  carry = (jnp.full((bq, 1), NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
           jnp.zeros((bq, W), jnp.float32))
  carry = lax.fori_loop(0, first_window, prefix_block, carry)
  _, l, acc = lax.fori_loop(first_window, n_blocks, window_block, carry)
  o_ref[...] = _normalize(acc, l).astype(o_ref.dtype)


def _tpu_kernel(
    lengths_ref,  # [B] int32 in SMEM (scalar prefetch)
    q_ref,  # [hb, bq, W] query rows of hb kv heads, head j's queries in lanes [j*D, (j+1)*D)
    k_ref, v_ref,  # [bk, W] key block j of row b, kv heads n*hb .. n*hb + hb - 1
    mask_ref,  # [bq, bk] int32 visibility (window blocks only)
    o_ref,  # [hb, bq, W]
    m_ref, l_ref,  # [hb, bq, 128] float32 scratch, lane-replicated running max / denominator
    acc_ref,  # [hb, bq, W] float32 scratch
    *, T: int, scale: float,
):
  """Grid step (b, n, i, j): query block i of kv-head group n against key block j of row b."""
  b, j = pl.program_id(0), pl.program_id(3)
  block_k = k_ref.shape[0]
  length = lengths_ref[b]
  start = j * block_k

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def update(v, visible):
    k = k_ref[...]
    for h in range(q_ref.shape[0]):
      carry = (m_ref[h][:, :1], l_ref[h][:, :1], acc_ref[h])
      m, l, acc = _attend_block(q_ref[h], k, v, visible, carry, scale)
      m_ref[h] = jnp.broadcast_to(m, m_ref.shape[1:])
      l_ref[h] = jnp.broadcast_to(l, l_ref.shape[1:])
      acc_ref[h] = acc

  @pl.when(start + block_k <= length)
  def _prefix():
    update(v_ref[...], None)

  @pl.when((start + block_k > length) & (start < length + T))
  def _window():
    used = start + lax.broadcasted_iota(jnp.int32, v_ref.shape, 0) < length + T  # [bk, W]
    v = jnp.where(used, v_ref[...].astype(jnp.float32), 0.0).astype(v_ref.dtype)
    update(v, mask_ref[...] != 0)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    for h in range(q_ref.shape[0]):
      o_ref[h] = _normalize(acc_ref[h], l_ref[h][:, :1]).astype(o_ref.dtype)


def _window_visibility(lengths: Array, tree_mask: Optional[Array], T: int, block_k: int,
                       n_window: int) -> Array:
  """[B, T, n_window * block_k] bool: visibility of the slots from block lengths // block_k on."""
  base = (lengths // block_k) * block_k  # [B] first slot of the window
  slots = base[:, None] + jnp.arange(n_window * block_k)[None, :]  # [B, NW]
  return visibility(slots, lengths, tree_mask, T)


# Shared memory per block on NVIDIA GPUs (the opt-in maximum), by compute capability major.minor.
_GPU_SMEM_BYTES = {(9, 0): 232448, (8, 0): 166912, (8, 7): 166912}
_GPU_SMEM_DEFAULT = 101376  # sm_86 / sm_89 and later consumer parts


def _gpu_smem_budget(interpret: bool) -> int:
  """Shared memory a block may use on this GPU; interpreted, or lowered on a host without a GPU
  (exported for one), an H100's: the tiles are chosen as there."""
  device = jax.devices()[0]
  if interpret or device.platform not in ("gpu", "cuda", "rocm"):
    return _GPU_SMEM_BYTES[(9, 0)]
  try:
    major, minor = (int(x) for x in str(device.compute_capability).split("."))
  except (AttributeError, ValueError):
    raise ValueError(f"tree attention's GPU kernel sizes its tiles by an NVIDIA compute "
                     f"capability, which {device} does not report. Fix: attention_impl='xla' "
                     f"on this device") from None
  return _GPU_SMEM_BYTES.get((major, minor), _GPU_SMEM_DEFAULT)


def _gpu_tiles(block_k: int, W: int, dtype, budget: int) -> tuple[int, int]:
  """(block_k, num_stages) whose K and V tiles fit the shared memory `budget`: Triton keeps
  num_stages copies of the [block_k, W] K and V tiles, and float32 dots at full precision hold
  each tile twice (measured on an H100: 262,656 bytes asked for float32, block_k=128, W=64, two
  stages). The asked block_k is a ceiling: a smaller power of two divides S as well, and the
  output does not depend on the tiling."""
  itemsize = jnp.dtype(dtype).itemsize
  per_slot = 2 * W * itemsize * (2 if itemsize == 4 else 1)  # bytes per cache slot per stage
  bk = block_k
  while bk >= 16:
    for stages in (2, 1):
      if stages * bk * per_slot + 4096 <= budget:
        return bk, stages
    bk //= 2
  raise ValueError(f"tree attention: a [16, {W}] {jnp.dtype(dtype).name} K/V tile does not fit "
                   f"this GPU's {budget} bytes of shared memory; use attention_impl='xla'.")


def _pallas_tree_attention(q, k, v, lengths, tree_mask, block_sizes, backend, interpret, layer):
  """Layouts in, pallas_call, layout out (shapes already validated)."""
  B, T, H, D = q.shape
  S, K = k.shape[-3], k.shape[-2]
  G = H // K
  M = T * G  # query rows per kv head, row t*G + g
  bk = block_sizes.block_k
  bq = _block_q(block_sizes, M, backend)
  Mp = _round_up(M, bq)
  hb = 1 if backend == "gpu" else _tpu_heads_per_block(K, D)
  N, W = K // hb, hb * D  # kv-head groups, lanes per group
  if backend == "gpu":
    bk, num_stages = _gpu_tiles(bk, W, k.dtype, _gpu_smem_budget(interpret))
  n_window = (bk + T - 2) // bk + 1  # key blocks the T new slots can straddle
  scale = D ** -0.5

  lengths = lengths.astype(jnp.int32)
  visible = _window_visibility(lengths, tree_mask, T, bk, n_window)  # [B, T, NW]
  visible = jnp.repeat(visible, G, axis=1)  # [B, M, NW]
  visible = jnp.pad(visible, ((0, 0), (0, Mp - M), (0, 0))).astype(jnp.int32)  # [B, Mp, NW]

  qk = q.reshape(B, T, N, hb, G, D).transpose(0, 2, 3, 1, 4, 5).reshape(B, N, hb, M, D)
  qk = jnp.pad(qk, ((0, 0), (0, 0), (0, 0), (0, Mp - M), (0, 0)))  # [B, N, hb, Mp, D]
  if hb > 1:  # head j's queries in lanes [j*D, (j+1)*D) of the group's W lanes, zeros elsewhere
    eye = jnp.eye(hb, dtype=q.dtype)[:, None, :, None]  # [hb, 1, hb, 1]
    qk = (qk[:, :, :, :, None, :] * eye).reshape(B, N, hb, Mp, W)  # [B, N, hb, Mp, W]
  # Free views of the cache as [L, B, S, K*D]; layer `layer` is picked by the index maps, so a
  # stacked cache is read in place (slicing it first would copy the layer out before the call).
  k2, v2 = k.reshape(-1, B, S, K * D), v.reshape(-1, B, S, K * D)
  layer = 0 if layer is None else layer
  out_shape = jax.ShapeDtypeStruct((B, N, hb, Mp, W), q.dtype)

  if backend == "gpu":
    kernel = functools.partial(_gpu_kernel, T=T, block_k=bk, scale=scale)
    rows = pl.BlockSpec((None, None, None, bq, W), lambda b, n, i: (b, n, 0, i, 0))
    out = pl.pallas_call(
        kernel,
        grid=(B, N, Mp // bq),
        in_specs=[
            pl.BlockSpec((None,), lambda b, n, i: (b,)),  # lengths
            rows,  # q
            pl.BlockSpec((None, None, S, W), lambda b, n, i: (layer, b, 0, n)),  # k
            pl.BlockSpec((None, None, S, W), lambda b, n, i: (layer, b, 0, n)),  # v
            pl.BlockSpec((None, bq, visible.shape[2]), lambda b, n, i: (b, i, 0)),  # mask
        ],
        out_specs=rows,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4 if bq * W <= 64 * 128 else 8,
                                                num_stages=num_stages),
        interpret=interpret,
        name="tree_attention_gpu",
    )(lengths, qk, k2, v2, visible)
  else:
    n_kv = S // bk

    def kv_index(b, n, i, j, lengths_ref):
      last = jnp.minimum(lax.div(lengths_ref[b] + T - 1, bk), n_kv - 1)
      return layer, b, jnp.minimum(j, last), n  # past the last block: same index, no new copy

    def mask_index(b, n, i, j, lengths_ref):
      return b, i, jnp.clip(j - lax.div(lengths_ref[b], bk), 0, n_window - 1)

    rows = pl.BlockSpec((None, None, hb, bq, W), lambda b, n, i, j, lengths_ref: (b, n, 0, i, 0))
    kernel = functools.partial(_tpu_kernel, T=T, scale=scale)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, N, Mp // bq, n_kv),
            in_specs=[
                rows,  # q
                pl.BlockSpec((None, None, bk, W), kv_index),  # k
                pl.BlockSpec((None, None, bk, W), kv_index),  # v
                pl.BlockSpec((None, bq, bk), mask_index),  # mask
            ],
            out_specs=rows,
            scratch_shapes=[
                pltpu.VMEM((hb, bq, TPU_LANES), jnp.float32),  # m
                pltpu.VMEM((hb, bq, TPU_LANES), jnp.float32),  # l
                pltpu.VMEM((hb, bq, W), jnp.float32),  # acc
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_tpu",
    )(lengths, qk, k2, v2, visible)

  if hb > 1:  # keep each head's own lanes: [B, N, hb, Mp, hb, D] -> diagonal over the two hb axes
    out = jnp.diagonal(out.reshape(B, N, hb, Mp, hb, D), axis1=2, axis2=4)  # [B, N, Mp, D, hb]
    out = out.transpose(0, 1, 4, 2, 3)  # [B, N, hb, Mp, D]
  out = out[:, :, :, :M].reshape(B, N, hb, T, G, D)
  return out.transpose(0, 3, 1, 2, 4, 5).reshape(B, T, H, D)


# ------------------------------------------------------------------------------------------------
# 4. Public entry point.


def tree_attention(q: Array, k: Array, v: Array, lengths: Array, tree_mask: Optional[Array],
                   *, block_sizes: BlockSizes = BlockSizes(), interpret: bool = False,
                   backend: Optional[str] = None, layer: Optional[int] = None) -> Array:
  """Tree attention of q [B, T, H, D] over the cache k, v [B, S, K, D] → [B, T, H, D].

  Args:
    q: queries of the T new tokens of each row.
    k, v: the cache [B, S, K, D] after the new tokens' K/V were written at slots lengths[b] + t.
      Slots at or past lengths[b] + T never reach the output (they may hold NaN); every
      lengths[b] + T must be <= S.
    lengths: [B] int32 committed prefix length per row (ragged).
    tree_mask: [B, T, T] bool, new token i sees new token j (must include the diagonal), or None
      for causal.
    block_sizes: tiles; block_k must divide S.
    interpret: run the kernel in the Pallas interpreter (CPU tests).
    backend: "gpu" (Pallas Triton), "tpu" (Mosaic) or None for this machine's; on CPU with
      interpret=True, None interprets the GPU kernel.
    layer: None, or a static int when k, v are the model's stacked [L, B, S, K, D] cache: the
      kernel then reads layer `layer` in place.
  """
  backend = resolve_backend(backend, interpret)
  # Checked before the jit, so that concrete lengths and masks (a direct call) are checked too;
  # inside a caller's jit they are traced and only their shapes are.
  validate_inputs(q, k, v, lengths, tree_mask, block_sizes, backend, layer)
  return _tree_attention_jit(q, k, v, lengths, tree_mask, block_sizes=block_sizes,
                             interpret=interpret, backend=backend, layer=layer)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "backend", "layer"))
def _tree_attention_jit(q: Array, k: Array, v: Array, lengths: Array, tree_mask: Optional[Array],
                        *, block_sizes: BlockSizes, interpret: bool, backend: str,
                        layer: Optional[int]) -> Array:
  return _pallas_tree_attention(q, k, v, lengths, tree_mask, block_sizes, backend, interpret,
                                layer)
