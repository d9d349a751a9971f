"""Attention over the stacked KV cache: which slots each new token sees, XLA's masked GQA
attention, the kernels behind `attention_fn` (the Pallas tree attention, jspec's CPU kernel) and
the attention mass that attention-scored KV eviction reads.

Every form attends q [B, T, H, D] over the cache k_all, v_all [L, B, S, K, D] at a layer, so the
decoder (jspec.models.llama) calls one `attend(q, k_all, v_all, layer)` whichever runs.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jspec import native
from jspec.models.config import Config
from jspec.models.numerics import row_sum

Array = jax.Array


def attention_mask(lengths: Array, size: int, mask: Optional[Array], T: int) -> Array:
  """Which cache slots each new token sees: [B, T, S] bool.

  Slots below `lengths[b]` are the committed prefix (visible to all new tokens); slot
  `lengths[b] + u` holds new token u, visible to new token t iff mask[b, t, u] (causal if None).
  """
  B = lengths.shape[0]
  slot = jnp.arange(size)[None, None, :]  # [1, 1, S]
  rel = slot - lengths[:, None, None]  # [B, 1, S]: index among the new tokens
  if mask is None:
    t = jnp.arange(T)[None, :, None]
    in_block = (rel >= 0) & (rel <= t)
  else:
    idx = jnp.broadcast_to(jnp.clip(rel, 0, T - 1), (B, T, size))
    in_block = (rel >= 0) & (rel < T) & jnp.take_along_axis(mask, idx, axis=2)
  return (rel < 0) | in_block


def masked_attention(q: Array, k: Array, v: Array, mask: Array, per_token: bool = False) -> Array:
  """GQA attention. q [B, T, H, D]; k, v [B, S, K, D]; mask [B, T, S] → [B, T, H, D].

  per_token: attend one query token at a time (a loop over T of the T = 1 computation), so each
  token's output is bit-identical to what a one-token forward computes. XLA's float dots round
  differently for different row counts; int8 weights re-quantize every activation, which turns
  those last-bit differences into whole quantization steps, and greedy speculative decoding
  would then drift from autoregressive decoding.
  """
  if per_token and q.shape[1] > 1:
    one = lambda qm: masked_attention(qm[0][:, None], k, v, qm[1][:, None], True)[:, 0]
    return jnp.moveaxis(jax.lax.map(one, (jnp.moveaxis(q, 1, 0), jnp.moveaxis(mask, 1, 0))), 0, 1)
  B, T, H, D = q.shape
  K = k.shape[2]
  q = q.reshape(B, T, K, H // K, D)
  if per_token:
    probs = fixed_order_probs(q, k, mask).astype(v.dtype)
  else:
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * (D ** -0.5), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(B, T, H, D)


def fixed_order_probs(q: Array, k: Array, visible: Array) -> Array:
  """Attention probabilities [B, K, G, T, S] float32 of q [B, T, K, G, D] over k [B, S, K, D]
  where visible [B, T, S], every sum in row_sum's fixed order: q . k as products summed by
  halving (XLA:CPU's dot picks its accumulation order by the number of cache slots on some
  CPUs: AVX2 without AVX-512 scored a token differently over 64 and 128 slots) and the softmax's
  sum too, so a token's probabilities do not depend on T or on S. A query that sees nothing
  gets zeros."""
  D = q.shape[-1]
  terms = (jnp.moveaxis(q, 1, 3)[:, :, :, :, None].astype(jnp.float32)
           * jnp.moveaxis(k, 1, 2)[:, :, None, None].astype(jnp.float32))  # [B, K, G, T, S, D]
  seen = visible[:, None, None]  # [B, 1, 1, T, S]
  scores = jnp.where(seen, row_sum(terms)[..., 0] * (D ** -0.5), -jnp.inf)  # [B, K, G, T, S]
  top = jnp.max(scores, axis=-1, keepdims=True)  # exact in any order
  e = jnp.where(seen, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  total = row_sum(e)
  return e / jnp.where(total > 0, total, 1.0)


# The tree-attention kernel reads the cache in blocks of at least this many slots.
KERNEL_SLOTS = 16


def attention_slots(cfg: Config, slots: int) -> int:
  """Cache slots to allocate for at least `slots` entries: a whole number of the attention
  kernel's smallest block under Pallas attention (a KV budget's slots are the user's numbers:
  budget + chunk, a verification block), as many as asked under XLA's."""
  if cfg.attention_impl == "xla":
    return slots
  return -(-slots // KERNEL_SLOTS) * KERNEL_SLOTS


def attention_fn(cfg: Config, lengths: Array, size: int, mask: Optional[Array], T: int,
                 kernel: Optional[str] = None) -> Callable:
  """attend(q [B, T, H, D], k_all, v_all [L, B, S, K, D], layer) for cfg.attention_impl.

  "xla": masked softmax over the whole cache in jnp. "pallas" / "pallas-interpret": the tree
  attention kernel reading the stacked cache in place (interpreted on CPU). No fallback between
  them: a kernel that cannot run raises. `kernel`: the attention the weights need
  (`quant.attention_kernel`: int8 weights re-quantize activations, so each token must score the
  same bits in any block); see `visible_attention`.
  """
  if cfg.attention_impl == "xla":
    full_mask = attention_mask(lengths, size, mask, T)  # [B, T, S]
    return visible_attention(full_mask, kernel)
  if kernel:
    raise ValueError(f"int8 weights run with attention_impl='xla' only, as do float32 weights "
                     f"on jspec's CPU kernels (the tree attention kernel is not yet "
                     f"token-invariant), got {cfg.attention_impl!r}. Fix: attention_impl='xla', "
                     f"or load float32 weights with --weights float32-xla")
  from jspec.pallas.tree_attention import BlockSizes, tree_attention
  block_k = next((b for b in (128, 64, 32, KERNEL_SLOTS) if size % b == 0), None)
  if block_k is None:
    raise ValueError(f"attention_impl={cfg.attention_impl!r} needs a KV cache whose size is a "
                     f"multiple of {KERNEL_SLOTS}, got {size}; allocate a multiple of 128 slots")
  blocks = BlockSizes(block_k=block_k)
  interpret = cfg.attention_impl == "pallas-interpret"
  return lambda q, k_all, v_all, i: tree_attention(q, k_all, v_all, lengths, mask, layer=i,
                                                   block_sizes=blocks, interpret=interpret)


def visible_attention(visible: Array, kernel: Optional[str] = None) -> Callable:
  """attend(q, k_all, v_all, layer) where each new token sees exactly the cache slots `visible`
  [B, T, S] marks. None (plain float weights): XLA's attention. int8 weights need a token's bits
  independent of the block and cache around it: with `kernel="xla"` XLA attends one token at a
  time with fixed-order sums (`masked_attention(per_token=True)`); with "native" (int8, q4 and
  float32 weights on jspec's CPU kernels), jspec's CPU kernel (`jspec.native.attention`:
  fixed-order sums over the visible slots, every token at once)."""
  if kernel == "native":
    return lambda q, k_all, v_all, i: _native_attention(q, k_all, v_all, visible,
                                                        _known_layer(i, k_all.shape[0]))
  return lambda q, k_all, v_all, i: masked_attention(q, k_all[i].astype(q.dtype),
                                                     v_all[i].astype(q.dtype), visible,
                                                     kernel is not None)


def _known_layer(i: int | Array, L: int) -> int | Array:
  """i, checked against the L layers where it is a Python int (inside the custom_vjp it is traced,
  and the kernel could only fail the call)."""
  if isinstance(i, int) and not 0 <= i < L:
    raise ValueError(f"layer {i} is out of [0, {L})")
  return i


@jax.custom_vjp
def _native_attention(q: Array, k_all: Array, v_all: Array, visible: Array,
                      layer: int | Array) -> Array:
  """jspec's CPU attention kernel at a static or traced layer, differentiable: its gradients are
  XLA's masked attention's (a model loaded for decoding can also be trained or probed for
  gradients)."""
  return native.attention(q, k_all, v_all, visible, layer)


def _native_attention_fwd(q, k_all, v_all, visible, layer):
  return native.attention(q, k_all, v_all, visible, layer), (q, k_all, v_all, visible, layer)


def _native_attention_bwd(res, dout):
  q, k_all, v_all, visible, layer = res
  _, vjp = jax.vjp(lambda q, k, v: masked_attention(q, k, v, visible), q, k_all[layer],
                   v_all[layer])
  dq, dk, dv = vjp(dout)
  return (dq, jnp.zeros_like(k_all).at[layer].set(dk), jnp.zeros_like(v_all).at[layer].set(dv),
          None, None)


_native_attention.defvjp(_native_attention_fwd, _native_attention_bwd)


def attention_mass(q: Array, k: Array, visible: Array, weights: Array, repeats: int = 1,
                   fixed_order: bool = False) -> Array:
  """[B, S, K] float32: sum over new tokens t of weights[b, t] times the attention probability
  of t on slot s, averaged over the query heads of KV head k. q [B, T, H, D]; k [B, S, K, D];
  visible [B, T, S]. weights [B, T, J] give [B, S, K, J]. repeats: KV heads stored that many
  times in a row (Config.kv_repeats): each copy gets the mean over the original head's query
  heads, so every copy scores, and evicts, as the one head would.

  fixed_order: every sum in an order that depends on neither T nor S (`_token_mass`), so a token
  adds the same bits to a slot's mass in a one-token step and in a verification block, over any
  cache size: the batch-invariant forwards (jspec's CPU kernels) then evict the same slots in
  speculative and autoregressive decoding. XLA's softmax and einsums sum by shape."""
  B, T, H, D = q.shape
  K = k.shape[2]
  if fixed_order:
    mass = _fixed_order_mass(q.reshape(B, T, K, H // K, D), k.astype(q.dtype), visible,
                             weights.astype(jnp.float32))
  else:
    scores = jnp.einsum("btkgd,bskd->bkgts", q.reshape(B, T, K, H // K, D), k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * (D ** -0.5)
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), axis=-1)
    spec = "bkgts,bt->bsk" if weights.ndim == 2 else "bkgts,btj->bskj"
    mass = jnp.einsum(spec, probs, weights.astype(jnp.float32)) / (H // K)  # [B, S, K(, J)]
  return _as_copies(mass, repeats)


def _as_copies(mass: Array, repeats: int) -> Array:
  """mass [B, S, K, ...] with each original KV head's `repeats` stored copies given their mean."""
  if repeats == 1:
    return mass
  B, S, K = mass.shape[:3]
  copies = mass.reshape(B, S, K // repeats, repeats, *mass.shape[3:])
  total = copies[:, :, :, 0]
  for r in range(1, repeats):  # in copy order: the same bits whatever the shape around it
    total = total + copies[:, :, :, r]
  return jnp.repeat(total / repeats, repeats, axis=2)


def _token_mass(q: Array, k: Array, visible: Array) -> Array:
  """[B, S, K]: one token's `fixed_order_probs`, averaged over each KV head's query heads in
  turn. q [B, K, G, D]; k [B, S, K, D]; visible [B, S]."""
  G = q.shape[2]
  probs = fixed_order_probs(q[:, None], k, visible[:, None])[:, :, :, 0]  # [B, K, G, S]
  heads = probs[:, :, 0]
  for g in range(1, G):
    heads = heads + probs[:, :, g]
  return jnp.swapaxes(heads / G, 1, 2)  # [B, S, K]


def _fixed_order_mass(q: Array, k: Array, visible: Array, weights: Array) -> Array:
  """attention_mass with fixed_order: q [B, T, K, G, D]; each token's `_token_mass`, added in
  token order (`in_token_order`)."""
  per_token = jax.lax.map(lambda qv: _token_mass(qv[0], k, qv[1]),
                          (jnp.swapaxes(q, 0, 1), jnp.swapaxes(visible, 0, 1)))  # [T, B, S, K]
  return in_token_order(jnp.swapaxes(per_token, 0, 1), weights)


def in_token_order(per_token: Array, weights: Array) -> Array:
  """sum over t of weights[b, t(, j)] * per_token[b, t] -> [B, S, K(, J)], for per_token
  [B, T, S, K] float32, added in token order to a zero start: a one-token step adds exactly its
  own mass, a block's column j of 0/1 weights exactly token j's, and the block's committed
  tokens fold in the order decoding adds them (`jspec.kv.evict.fold_block_mass`)."""
  per_column = weights.ndim == 3
  w = (weights if per_column else weights[..., None]).astype(jnp.float32)  # [B, T, J]
  B, _, S, K = per_token.shape

  def add(mass, inputs):
    m_t, w_t = inputs  # [B, S, K], [B, J]
    return mass + m_t[..., None] * w_t[:, None, None], None

  mass, _ = jax.lax.scan(add, jnp.zeros((B, S, K, w.shape[-1]), jnp.float32),
                         (jnp.swapaxes(per_token, 0, 1), jnp.swapaxes(w, 0, 1)))
  return mass if per_column else mass[..., 0]


def recording_mass(attend: Callable, visible: Array, weights: Array, repeats: int = 1,
                   kernel: Optional[str] = None):
  """attend as given, also appending each layer's `attention_mass` to the returned list. kernel
  (`visible_attention`'s): "native" takes the probabilities jspec's CPU kernel computes as it
  attends (`jspec.native.attention(with_mass=True)`: its fixed-order sums, no second pass);
  "xla" the fixed-order `attention_mass`; None XLA's."""
  masses = []

  def attend_and_record(q, k_all, v_all, i):
    if kernel == "native":
      out, per_token = native.attention(q, k_all, v_all, visible,
                                        _known_layer(i, k_all.shape[0]), with_mass=True)
      masses.append(_as_copies(in_token_order(per_token, weights), repeats))
      return out
    masses.append(attention_mass(q, k_all[i], visible, weights, repeats,
                                 fixed_order=kernel is not None))
    return attend(q, k_all, v_all, i)

  return attend_and_record, masses
