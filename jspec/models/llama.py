"""The Llama-family decoder (Llama 2/3, Qwen2, Qwen3): params, layout and a pure forward (its
attention, every form of it, in jspec.models.attention).

Two layouts of the same weights, one forward. Unrolled, each layer owns its arrays and the layer
loop is unrolled (the Pallas tree attention needs it: it takes a static layer). `stack_layers`
stacks every layer's arrays on a leading axis and the decoder becomes one `lax.scan`: one traced
layer instead of L, so a program compiles in a fraction of the time (3.3-6.9x faster through the
whole engine on CPU with jspec's CPU kernels, which read the traced layer in place, at the same
decode speed; 4.3x for a decode step on an H100: benchmarks/README.md). `jspec.model.load`
stacks by default where jspec's CPU kernels run the weights. The stacked KV cache is written in
place either way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models import quant
from jspec.models.cache import KVCache
from jspec.models.config import Config, rope_frequencies
from jspec.models.attention import (attention_fn, attention_mask, recording_mass,
                                    visible_attention)
from jspec.models.numerics import engine_jit, row_sum
from jspec.sharding import ArraySpec, Placement, is_spec, rows_split

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
  """Weights of one decoder layer."""

  attn_norm: Array  # [E]
  wq: Array  # [E, H, D]
  wk: Array  # [E, K, D]
  wv: Array  # [E, K, D]
  wo: Array  # [H, D, E]
  mlp_norm: Array  # [E]
  w_gate: Array  # [E, F]
  w_up: Array  # [E, F]
  w_down: Array  # [F, E]
  bq: Optional[Array] = None  # [H, D]
  bk: Optional[Array] = None  # [K, D]
  bv: Optional[Array] = None  # [K, D]
  bo: Optional[Array] = None  # [E]
  q_norm: Optional[Array] = None  # [D]
  k_norm: Optional[Array] = None  # [D]
  b_gate: Optional[Array] = None  # [F]
  b_up: Optional[Array] = None  # [F]
  b_down: Optional[Array] = None  # [E]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
  embed: Array  # [V, E]
  # One per decoder layer, or (`stack_layers`) one LayerParams whose arrays carry a leading [L].
  layers: tuple[LayerParams, ...] | LayerParams
  final_norm: Array  # [E]
  lm_head: Optional[Array] = None  # [E, V]; None when tied to `embed`


def param_layout(cfg: Config, stacked: bool = False) -> Params:
  """Every parameter once: shape, logical axes, initializer. Init, sharding and loading use it.
  stacked: the layers as one LayerParams with a leading "layers" axis (`stack_layers`)."""
  L, E, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  s = ArraySpec
  opt = lambda cond, spec: spec if cond else None
  layer = LayerParams(
      attn_norm=s((E,), ("embed",), "ones"),
      wq=s((E, H, D), ("embed", "heads", "head_dim")),
      wk=s((E, K, D), ("embed", "kv_heads", "head_dim")),
      wv=s((E, K, D), ("embed", "kv_heads", "head_dim")),
      wo=s((H, D, E), ("heads", "head_dim", "embed")),
      mlp_norm=s((E,), ("embed",), "ones"),
      w_gate=s((E, F), ("embed", "mlp")),
      w_up=s((E, F), ("embed", "mlp")),
      w_down=s((F, E), ("mlp", "embed")),
      bq=opt(cfg.qkv_bias, s((H, D), ("heads", "head_dim"), "zeros")),
      bk=opt(cfg.qkv_bias, s((K, D), ("kv_heads", "head_dim"), "zeros")),
      bv=opt(cfg.qkv_bias, s((K, D), ("kv_heads", "head_dim"), "zeros")),
      bo=opt(cfg.o_bias, s((E,), ("embed",), "zeros")),
      q_norm=opt(cfg.qk_norm, s((D,), ("head_dim",), "ones")),
      k_norm=opt(cfg.qk_norm, s((D,), ("head_dim",), "ones")),
      b_gate=opt(cfg.mlp_bias, s((F,), ("mlp",), "zeros")),
      b_up=opt(cfg.mlp_bias, s((F,), ("mlp",), "zeros")),
      b_down=opt(cfg.mlp_bias, s((E,), ("embed",), "zeros")),
  )
  if stacked:
    layer = jax.tree.map(lambda a: s((L, *a.shape), ("layers", *a.axes), a.init), layer,
                         is_leaf=is_spec)
  return Params(
      embed=s((V, E), ("vocab", "embed")),
      layers=layer if stacked else (layer,) * L,
      final_norm=s((E,), ("embed",), "ones"),
      lm_head=None if cfg.tie_embeddings else s((E, V), ("embed", "vocab")),
  )


def init_params(cfg: Config, key: Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
  """Random parameters (tests, drafter initialisation)."""
  layout = param_layout(cfg)
  specs, treedef = jax.tree.flatten(layout, is_leaf=is_spec)
  keys = jax.random.split(key, len(specs))

  def make(spec: ArraySpec, k: Array) -> Array:
    if spec.init == "ones":
      return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
      return jnp.zeros(spec.shape, dtype)
    return (scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

  return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(specs, keys)])


def layers_stacked(params: Params) -> bool:
  """Whether the layers are stacked (`stack_layers`: the decoder scans) or a tuple (unrolled)."""
  return isinstance(params.layers, LayerParams)


def num_layers(params: Params) -> int:
  return params.layers.attn_norm.shape[0] if layers_stacked(params) else len(params.layers)


def check_params(params: Params, cfg: Config, full_head: bool = True,
                 what: str = "params") -> None:
  """Host-side: refuse params whose shapes are not `cfg`'s. A Config of another model reads them
  silently wrong: ids past a smaller embedding are clamped by the gather, layers past cfg's count
  are skipped. Shapes only (any layout and weight format: stacked, int8, 4-bit, the CPU kernels'
  output-major weights). full_head=False: a VocabTrim head keeps fewer vocabulary columns. what:
  whose params, for the message."""
  if not isinstance(params, Params):
    raise TypeError(f"{what} must be jspec Params (jspec.model.load, init_params), got "
                    f"{type(params).__name__}")
  want = param_layout(cfg)
  stacked = layers_stacked(params)
  L = num_layers(params)

  def fits(got, spec_shape, layer_axis: bool) -> bool:
    # A stacked weight carries the layer axis somewhere in its stored layout (first for arrays,
    # among the output axes for the CPU kernels' weights), or reports the one layer's shape.
    if got == spec_shape:
      return True
    return layer_axis and any(got[:i] + got[i + 1:] == spec_shape
                              for i in range(len(got)) if got[i] == L)

  def refuse(where: str, got, expected) -> None:
    raise ValueError(
        f"{what} do not fit their cfg: {where} is {got}, cfg wants {expected} ({cfg.arch}, vocab "
        f"{cfg.vocab_size}, hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} "
        f"heads, {cfg.num_kv_heads} KV heads of {cfg.head_dim}). Fix: pass the Config the params "
        f"were made with (jspec.model.load returns both; init_params(cfg, ...) makes cfg's).")

  if L != cfg.num_layers:
    refuse("the number of layers", L, cfg.num_layers)
  for name, got in (("embed", params.embed), ("final_norm", params.final_norm)):
    if tuple(got.shape) != getattr(want, name).shape:
      refuse(name, tuple(got.shape), getattr(want, name).shape)
  if params.lm_head is not None:
    E, V = cfg.hidden_size, cfg.vocab_size
    head = tuple(params.lm_head.shape)
    if head[0] != E or (full_head and head != (E, V)):
      refuse("lm_head", head, (E, V) if full_head else (E, "kept ids"))
  layers = ((params.layers, "layers (stacked)"),) if stacked else tuple(
      (layer, f"layer {i}") for i, layer in enumerate(params.layers))
  for layer, where in layers:
    for field in dataclasses.fields(LayerParams):
      got, spec = getattr(layer, field.name), getattr(want.layers[0], field.name)
      if (got is None) != (spec is None):
        refuse(f"{where}.{field.name}", "absent" if got is None else "present",
               "absent" if spec is None else spec.shape)
      if got is not None and not fits(tuple(got.shape), spec.shape, stacked):
        refuse(f"{where}.{field.name}", tuple(got.shape), spec.shape)


def layer_list(params: Params) -> tuple[LayerParams, ...]:
  """Each layer's params, whichever the layout (stacked ones sliced out: for per-layer work outside
  the decoder, such as calibration, export or layer surgery)."""
  if not layers_stacked(params):
    return tuple(params.layers)
  return tuple(jax.tree.map(lambda a, i=i: a[i], params.layers) for i in range(num_layers(params)))


def _stacked(layers: tuple[LayerParams, ...]) -> LayerParams:
  return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def with_layers(params: Params, layers: tuple[LayerParams, ...]) -> Params:
  """params with these layers, in params' layout."""
  if layers_stacked(params):
    return dataclasses.replace(params, layers=_stacked(layers))
  return dataclasses.replace(params, layers=tuple(layers))


def first_layers(params: Params, n: int) -> Params:
  """params with only the first n layers, layout kept (stacked: each array's first n, not every
  layer sliced out and restacked, which would hold a copy of the whole model for a moment)."""
  if layers_stacked(params):
    return dataclasses.replace(params, layers=jax.tree.map(lambda a: a[:n], params.layers))
  return dataclasses.replace(params, layers=tuple(params.layers[:n]))


def map_layers(params: Params, fn: Callable[[LayerParams], LayerParams]) -> Params:
  """params with fn applied to every layer, layout kept."""
  return with_layers(params, tuple(fn(lp) for lp in layer_list(params)))


def stack_layers(params: Params) -> Params:
  """The same weights with every layer's arrays stacked on a leading [L] axis: the decoder then
  runs one `lax.scan` over them (one traced layer: programs compile several times faster). XLA's
  dots read each layer's slice; jspec's CPU kernels (float32, int8 and q4 weights on CPU) read
  the layer in place from the stacked arrays."""
  if layers_stacked(params):
    return params
  return dataclasses.replace(params, layers=_stacked(tuple(params.layers)))


def unstack_layers(params: Params) -> Params:
  """The inverse of `stack_layers`: one LayerParams per layer (the unrolled loop)."""
  return dataclasses.replace(params, layers=layer_list(params))


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(row_sum(x32 * x32) / x.shape[-1] + eps)
  return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope_tables(cfg: Config, positions: Array) -> tuple[Array, Array]:
  """cos, sin of shape [B, T, D/2] for integer positions [B, T]."""
  inv_freq = jnp.asarray(rope_frequencies(cfg))  # [D/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotate-half RoPE (HF convention) on x [B, T, N, D]."""
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)  # [B, T, N, D/2] each
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def write_rows_batched(cache: Array, layer: int | Array, slots: Array, new: Array) -> Array:
  """write_slots' form for a batch split over a mesh: a vmap over the cache's batch axis, so the
  scatter names the batch as a batching dimension and each device writes its own rows."""
  write = lambda c, s, n: c.at[layer, s].set(n.astype(c.dtype), mode="drop")
  return jax.vmap(write, in_axes=(1, 0, 0), out_axes=1)(cache, slots, new)


def write_layer_slice(cache: Array, layer: int | Array, slots: Array, new: Array) -> Array:
  """write_slots' form for a traced layer: the rows go into the layer's own [B, S, K, D] slice,
  which goes back in place."""
  write = lambda c, s, n: c.at[s].set(n.astype(c.dtype), mode="drop")  # one row's [S, K, D]
  own = jax.vmap(write)(jax.lax.dynamic_index_in_dim(cache, layer, keepdims=False), slots, new)
  return jax.lax.dynamic_update_index_in_dim(cache, own, layer, 0)


def write_one_scatter(cache: Array, layer: int | Array, slots: Array, new: Array) -> Array:
  """write_slots' form for a static layer off a mesh: one scatter over explicit rows."""
  rows = jnp.arange(new.shape[0])[:, None]  # [B, 1]
  return cache.at[layer, rows, slots].set(new.astype(cache.dtype), mode="drop")


def write_slots(cache: Array, layer: int | Array, slots: Array, new: Array) -> Array:
  """cache [L, B, S, K, D] with new [B, T, K, D] written at layer `layer`, slots [B, T] of each
  row. Slots past the cache end are dropped (callers validate capacity before they get here).

  Each layout gets the form XLA:CPU runs in place (benchmarks/README.md, "The KV cache write";
  the others copied the whole cache in some programs): a traced layer (stacked layers' scan), its
  slice (the batched vmap made 4 copies a layer; one scatter ran 0.91-0.97x as fast); a static
  layer (unrolled), one scatter (the slice made 2 copies a layer in autoregressive and `skip`
  programs: the next layer's read was fused against the old buffer), or, when the engine being
  traced splits the batch over a mesh's `dp` (`jspec.sharding.rows_split`), the batched vmap, so
  each device writes its own rows (explicit row indices made XLA gather the others' new entries:
  4 all-gathers a layer)."""
  if isinstance(layer, jax.core.Tracer):
    return write_layer_slice(cache, layer, slots, new)
  if rows_split():
    return write_rows_batched(cache, layer, slots, new)
  return write_one_scatter(cache, layer, slots, new)


def decoder_layer(cfg: Config, x: Array, lp: LayerParams, i: int | Array, k_cache: Array,
                  v_cache: Array, cos: Array, sin: Array, slots: Array, attend: Callable,
                  attn_in: Optional[Array] = None):
  """Decoder layer `i`; writes its new K/V into the stacked cache at `slots`. attn_in: what the
  Q/K/V projections read instead of the normed residual x (EAGLE-3: [embedding; feature])."""
  B, T, _ = x.shape
  with jax.named_scope("attention"):
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps) if attn_in is None else attn_in
    q = quant.einsum("bte,ehd->bthd", h, lp.wq)  # [B, T, H, D]
    k = quant.einsum("bte,ekd->btkd", h, lp.wk)  # [B, T, K, D]
    v = quant.einsum("bte,ekd->btkd", h, lp.wv)  # [B, T, K, D]
    if lp.bq is not None:
      q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    if lp.q_norm is not None:
      q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
      k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = write_slots(k_cache, i, slots, k)
    v_cache = write_slots(v_cache, i, slots, v)
    out = attend(q, k_cache, v_cache, i)
    # Contract heads and head_dim as one axis so the weight is read in its stored layout.
    attn = quant.einsum("btf,fe->bte", out.reshape(B, T, -1), lp.wo.reshape(-1, cfg.hidden_size))
    if lp.bo is not None:
      attn = attn + lp.bo
    x = x + attn
  with jax.named_scope("mlp"):
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    gate = quant.einsum("bte,ef->btf", h, lp.w_gate)
    up = quant.einsum("bte,ef->btf", h, lp.w_up)
    if lp.b_gate is not None:
      gate, up = gate + lp.b_gate, up + lp.b_up
    down = quant.einsum("btf,fe->bte", jax.nn.silu(gate) * up, lp.w_down)
    if lp.b_down is not None:
      down = down + lp.b_down
    x = x + down
  return x, k_cache, v_cache


def lm_head(params: Params, hidden: Array) -> Array:
  """Logits (float32) from final-normed hidden states [..., E]."""
  if params.lm_head is None:
    return quant.einsum("...e,ve->...v", hidden, params.embed,
                        preferred_element_type=jnp.float32)
  return quant.einsum("...e,ev->...v", hidden, params.lm_head,
                      preferred_element_type=jnp.float32)


def forward(params: Params, cfg: Config, tokens: Array, positions: Array, cache: KVCache,
            mask: Optional[Array] = None, *, logits_indices: Optional[Array] = None,
            mass_weights: Optional[Array] = None, appended: Optional[Array] = None,
            taps: tuple[int, ...] = ()):
  """Run T new tokens per row through the decoder.

  Args:
    tokens: [B, T] int32 token ids.
    positions: [B, T] int32 RoPE positions.
    cache: the KV cache; the new entries are written at slots lengths[b] + t, not committed.
    mask: [B, T, T] bool, which new tokens each new token sees (None: causal). Tree attention
      passes the ancestor mask here.
    logits_indices: optional [B, N] int32: compute logits only at these of the T positions.
    mass_weights: optional [B, T] float32: add to cache.mass (which must exist) every slot's
      attention probability from new token t, weighted by mass_weights[b, t] and averaged over the
      query heads of each KV head (attention-score eviction: H2O, TOVA, SnapKV). [B, T, J]: J
      weightings at once, into a cache.mass of [L, B, S, K, J]. XLA attention only; the
      probabilities are recomputed beside the attention, which stays as it is.
    appended: optional [B, M, E] input embeddings run after the T tokens as M more positions
      (mask-token probing, jspec.drafting.probe); positions and mask then cover T + M.
    taps: static; layers whose input residual stream to return as `hidden` instead, [B, T,
      len(taps) * E] in the order given (EAGLE-3's fused features: `Drafter.feature_layers`);
      tap L (the number of layers) is the last layer's output, before the final norm.

  Returns:
    (logits [B, T or N, V] float32, hidden [B, T, E] after the final norm (or the taps), cache
    with new entries).
  """
  B, T = tokens.shape
  if appended is not None:
    T += appended.shape[1]
  slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
  attend = attention_fn(cfg, cache.lengths, cache.size, mask, T, quant.attention_kernel(params))
  masses = None
  if mass_weights is not None:
    if cfg.attention_impl != "xla" or cache.mass is None:
      raise ValueError(
          "attention-score eviction needs the attention probabilities, which only "
          f"attention_impl='xla' gives (got {cfg.attention_impl!r}), and a cache with a mass "
          "array. Fix: attention_impl='xla', or a policy that needs no scores (keydiff).")
    attend, masses = recording_mass(attend, attention_mask(cache.lengths, cache.size, mask, T),
                                     mass_weights, cfg.kv_repeats,
                                     kernel=quant.attention_kernel(params))
  tapped = dict.fromkeys(taps)  # the layers to tap, filled by _decoder
  hidden, cache = _decoder(params, cfg, tokens, positions, cache, slots, attend, appended,
                           tapped=tapped if taps else None, records=masses)
  if masses is not None:
    cache = dataclasses.replace(cache, mass=cache.mass + jnp.stack(masses))
  picked = hidden
  if logits_indices is not None:
    picked = jnp.take_along_axis(hidden, logits_indices[..., None], axis=1)  # [B, N, E]
  if taps:
    hidden = jnp.concatenate([tapped[i] for i in taps], axis=-1)  # [B, T, len(taps) E]
  return lm_head(params, picked), hidden, cache


def forward_rows(params: Params, cfg: Config, tokens: Array,
                 logits_indices: Optional[Array] = None,
                 taps: tuple[int, ...] = ()) -> tuple[Array, Array]:
  """(logits, hidden) of whole rows tokens [B, S] read from position 0 with a fresh cache: the
  teacher-forced pass training uses, through the same `forward` decoding runs."""
  B, S = tokens.shape
  cache = KVCache.init(cfg, B, S, params.embed.dtype)
  positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  logits, hidden, _ = forward(params, cfg, tokens, positions, cache, logits_indices=logits_indices,
                              taps=taps)
  return logits, hidden


def forward_at(params: Params, cfg: Config, tokens: Array, positions: Array, cache: KVCache,
               slots: Array, visible: Array) -> tuple[Array, KVCache]:
  """`forward` for new tokens [B, T] written at any cache `slots` [B, T], each seeing exactly the
  cache slots `visible` [B, T, S] marks (XLA attention) → (logits [B, T, V_head], cache).

  Tree drafting needs it: a frontier node sees its ancestors' slots but not their siblings', which
  forward's [B, T, T] mask over consecutive new tokens cannot express.
  """
  hidden, cache = _decoder(params, cfg, tokens, positions, cache, slots,
                           visible_attention(visible, quant.attention_kernel(params)))
  return lm_head(params, hidden), cache


def forward_visible(params: Params, cfg: Config, tokens: Array, positions: Array,
                    cache: KVCache, slots: Array, visible: Array, *,
                    appended: Optional[Array] = None, layers: Optional[tuple[int, ...]] = None,
                    taps: tuple[int, ...] = ()) -> tuple[Array, KVCache]:
  """New tokens [B, T] (then `appended` [B, M, E] embeddings) written at any cache `slots`
  [B, T + M], each seeing exactly the slots `visible` [B, T + M, S] marks (XLA attention),
  through the decoder layers `layers` (default all) → (hidden [B, T + M, E] after the final norm,
  or with `taps` the residual stream entering those layers [B, T + M, len(taps) E]; cache).
  Training passes whose visibility no block mask expresses use it (ConFu's contemplate tokens)."""
  tapped = dict.fromkeys(taps)
  hidden, cache = _decoder(params, cfg, tokens, positions, cache, slots,
                           visible_attention(visible, quant.attention_kernel(params)), appended,
                           layers=layers, tapped=tapped if taps else None)
  if taps:
    hidden = jnp.concatenate([tapped[i] for i in taps], axis=-1)
  return hidden, cache


def forward_layers(params: Params, cfg: Config, tokens: Array, positions: Array, cache: KVCache,
                   layers: tuple[int, ...]) -> tuple[Array, KVCache]:
  """`forward` of T new causal tokens [B, T] through the decoder layers `layers` only (indices
  of the full model; the residual stream passes the others unchanged), reading and writing those
  layers' entries of the full model's cache → (logits [B, T, V], cache). A layer-skip draft
  (jspec.drafting.skip) shares the target's KV cache this way."""
  B, T = tokens.shape
  slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
  attend = attention_fn(cfg, cache.lengths, cache.size, None, T, quant.attention_kernel(params))
  hidden, cache = _decoder(params, cfg, tokens, positions, cache, slots, attend, layers=layers)
  return lm_head(params, hidden), cache


def _decoder(params: Params, cfg: Config, tokens: Array, positions: Array, cache: KVCache,
             slots: Array, attend: Callable, appended: Optional[Array] = None,
             layers: Optional[tuple[int, ...]] = None,
             tapped: Optional[dict] = None,
             records: Optional[list] = None) -> tuple[Array, KVCache]:
  """Embedding (then the `appended` embeddings), every layer (or only those in `layers`; the
  residual stream passes the others unchanged) with new K/V written at `slots` [B, T], final
  norm → hidden [B, T, E]. `tapped`: a dict whose keys are the layers to tap; each receives the
  residual stream entering that layer (key L: the one leaving the last layer, before the norm).
  `records`: the list `attend` appends one array to per layer (`_recording_mass`)."""
  x = quant.take_rows(params.embed, tokens)  # [B, T, E]
  if appended is not None:
    x = jnp.concatenate([x, appended.astype(x.dtype)], axis=1)
  cos, sin = rope_tables(cfg, positions)
  k_all, v_all = cache.k, cache.v
  if layers_stacked(params):
    x, k_all, v_all = _scanned_layers(params, cfg, x, k_all, v_all, cos, sin, slots, attend,
                                      layers, tapped, records)
  else:
    for i, lp in enumerate(params.layers):
      if tapped is not None and i in tapped:
        tapped[i] = x
      if layers is not None and i not in layers:
        continue
      with jax.named_scope(f"layer_{i}"):
        x, k_all, v_all = decoder_layer(cfg, x, lp, i, k_all, v_all, cos, sin, slots, attend)
  if tapped is not None and num_layers(params) in tapped:
    tapped[num_layers(params)] = x  # the last layer's output, before the final norm
  hidden = rms_norm(x, params.final_norm, cfg.rms_norm_eps)  # [B, T, E]
  return hidden, dataclasses.replace(cache, k=k_all, v=v_all)


def _scanned_layers(params: Params, cfg: Config, x: Array, k_all: Array, v_all: Array,
                    cos: Array, sin: Array, slots: Array, attend: Callable,
                    layers: Optional[tuple[int, ...]], tapped: Optional[dict],
                    records: Optional[list]) -> tuple[Array, Array, Array]:
  """`_decoder`'s layer loop over stacked layers as one `lax.scan`: the layer index is traced, so
  attention must read the cache at a traced layer (XLA's or jspec's CPU kernel; not the Pallas
  kernel, which takes a static one). The scan runs over the indices of the layers that run (all,
  or a `layers` subset), each reading its weights at its index; attention records come out as
  the scan's per-layer outputs, taps in a carried [len(taps), B, T, E] buffer (not every layer's
  residual stream: [L, B, T, E] at a long prefill is gigabytes)."""
  if cfg.attention_impl != "xla":
    raise ValueError(f"stacked layers (--scan-layers) need attention_impl='xla' (the tree "
                     f"attention kernel reads a static layer), got {cfg.attention_impl!r}. Fix: "
                     f"attention_impl='xla', or unstacked layers.")
  L = num_layers(params)
  if records is not None and layers is not None:
    raise ValueError("attention records over a subset of layers are not supported")
  # The layers that run, in order, each once (as the unrolled loop runs them). A subset is not a
  # lax.cond around every layer: on a GPU each one sends its predicate to the host, which waits
  # for it (90 round trips a round of skip:10, gamma 3).
  ids = list(range(L)) if layers is None else sorted({i for i in layers if 0 <= i < L})
  # A skipped layer passes the stream on unchanged, so its tap is the next run layer's (or the
  # output's). Each run layer that some tap needs writes one slot of a carried buffer.
  source = {i: next((j for j in ids if j >= i), L) for i in (tapped or {}) if i < L}
  wanted = sorted({j for j in source.values() if j < L})
  tap_slot = jnp.asarray([wanted.index(j) if j in wanted else -1 for j in ids], jnp.int32)
  buffer = jnp.zeros((len(wanted),) + x.shape, x.dtype) if wanted else None  # [N, B, T, E]

  def body(carry, xs):
    (x, k_all, v_all), buffer = carry
    i, slot = xs
    if buffer is not None:  # the residual stream entering layer i, into its slot if tapped
      at = jnp.maximum(slot, 0)
      kept = jax.lax.dynamic_index_in_dim(buffer, at, keepdims=False)
      buffer = jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, x, kept), at, 0)
    # XLA's dots read layer i's slice of each weight; jspec's CPU kernels read it in place.
    lp = jax.tree.map(lambda w: quant.at_layer(w, i), params.layers, is_leaf=quant.on_native_kernel)
    recorded = len(records) if records is not None else 0
    new = decoder_layer(cfg, x, lp, i, k_all, v_all, cos, sin, slots, attend)
    ys = {}
    if records is not None and len(records) > recorded:
      ys["record"] = records.pop()
    return (new, buffer), ys

  xs = (jnp.asarray(ids, jnp.int32), tap_slot)
  ((x, k_all, v_all), buffer), ys = jax.lax.scan(body, ((x, k_all, v_all), buffer), xs)
  if tapped is not None:
    tapped.update({i: x if j == L else buffer[wanted.index(j)] for i, j in source.items()})
  if "record" in ys:
    records.extend(ys["record"][i] for i in range(L))
  return x, k_all, v_all


# Step-by-step use outside `generate`: the cache argument is donated, so XLA updates it in place.
# Not traced under a placement: on a batch-sharded cache its write is one scatter over explicit
# rows, correct but gathered over dp (the engines, `traced_under_placement`, write row by row).
_forward_jit = engine_jit(forward, static_argnums=(1,), donate_argnames=("cache",))


def forward_jit(params: Params, cfg: Config, tokens: Array, positions: Array, cache: KVCache,
                *args, **kwargs):
  """`forward`, jitted, the cache donated; a step whose new entries would run past the cache's
  end is refused (its writes would be dropped, and its tokens attend without their own keys: wrong
  logits, no error). Checked on the host where the lengths are concrete (one [B] read; under a
  caller's jit they are traced and the caller owns the room)."""
  lengths = cache.lengths
  if not isinstance(lengths, jax.core.Tracer):
    appended = kwargs.get("appended")
    width = tokens.shape[1] + (0 if appended is None else appended.shape[1])
    longest = int(np.max(np.asarray(lengths))) if np.size(lengths) else 0
    if longest + width > cache.size:
      raise ValueError(f"a forward of {width} new tokens from cache length {longest} needs "
                       f"{longest + width} slots; the cache has {cache.size}: the entries past its "
                       f"end would be dropped. Fix: a larger cache (KVCache.init(cfg, batch, "
                       f"size)), or a KV budget that evicts (jspec.kv)")
  return _forward_jit(params, cfg, tokens, positions, cache, *args, **kwargs)


# Input (contracted) axes of each quantizable weight; norms and biases stay in float.
_INT8_INPUT_AXES = {"wq": (0,), "wk": (0,), "wv": (0,), "wo": (0, 1), "w_gate": (0,), "w_up": (0,),
                    "w_down": (0,)}


def quantize_params(params: Params, kernel: str = "xla", bits: int = 8,
                    q4_offsets: bool = True) -> Params:
  """Every projection, the LM head and the embedding table as int8 per output channel
  (`jspec.models.quant.Int8Weight`, whose matmuls run `kernel`: "xla" or "native"); the
  embedding per row, which is its output channel when it is the tied LM head. bits=4: the
  decoder layers' projections in 4 bits instead (`quant.Q4Weight`, native kernel only; with a
  float16 offset a group unless q4_offsets=False)."""
  _check_bits(bits, kernel)
  q8 = lambda w, axes: quant.quantize_int8(w, axes, kernel)
  layer = functools.partial(quantize_layer, kernel=kernel, bits=bits, q4_offsets=q4_offsets)
  return dataclasses.replace(
      map_layers(params, layer), embed=q8(params.embed, (1,)),
      lm_head=None if params.lm_head is None else q8(params.lm_head, (0,)))


def _check_bits(bits: int, kernel: str) -> None:
  if bits not in (4, 8) or (bits == 4 and kernel != "native"):
    raise ValueError(f"weights quantize to 8 bits (kernel 'xla' or 'native') or 4 bits (kernel "
                     f"'native'), got {bits} bits with kernel {kernel!r}")


def quantize_layer(lp: LayerParams, kernel: str = "xla", bits: int = 8,
                   q4_offsets: bool = True) -> LayerParams:
  """One decoder layer's projections as `quantize_params` stores them."""
  _check_bits(bits, kernel)
  if bits == 4:
    project = lambda w, axes: quant.quantize_q4(w, axes, offset=q4_offsets)
  else:
    project = lambda w, axes: quant.quantize_int8(w, axes, kernel)
  return dataclasses.replace(lp, **{name: project(getattr(lp, name), axes)
                                    for name, axes in _INT8_INPUT_AXES.items()})


def place_params(params: Params, cfg: Config, placement: Placement | None) -> Params:
  """Params on `placement`'s mesh by `param_layout` (a no-op for arrays already there; None: as
  they are). jspec's CPU kernels take whole weights in their own layout, which XLA cannot split,
  so their formats are refused: load with --weights float32-xla or bfloat16 for a mesh."""
  if placement is None:
    return params
  kinds = (quant.Int8Weight, quant.Q4Weight, quant.DenseWeight)
  custom = [x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, kinds))
            if isinstance(x, kinds)]
  if custom:
    raise ValueError(
        f"weights in {type(custom[0]).__name__} form (jspec's quantized or native-kernel storage) "
        f"are not placed on a mesh. Fix: load the model with "
        f"--weights float32-xla or bfloat16 (jspec.model.load(..., mesh=...) picks float32-xla "
        f"for the default float32), or drop --mesh / mesh=.")
  return placement.put(params, param_layout(cfg, stacked=layers_stacked(params)))


def repeat_kv_heads(params: Params, cfg: Config, times: int) -> tuple[Params, Config]:
  """(params, cfg) with every KV head repeated `times` times in a row: query head h reads copy
  h // (H / (K * times)) of KV head h // (H / K), the same numbers, so the outputs do not change.
  What tensor parallelism over more devices than KV heads needs (tp = K * times): each device
  then holds one KV head, the one its query heads read, and the KV cache splits tp ways instead of
  being replicated (vLLM's choice too). `jspec.model.load(..., mesh=)` does it."""
  if times == 1:
    return params, cfg
  rep = lambda w, axis: None if w is None else jnp.repeat(w, times, axis=axis)
  repeated = lambda lp: dataclasses.replace(lp, wk=rep(lp.wk, 1), wv=rep(lp.wv, 1),
                                            bk=rep(lp.bk, 0), bv=rep(lp.bv, 0))
  return (map_layers(params, repeated),
          dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * times,
                              kv_repeats=cfg.kv_repeats * times))


def native_float_params(params: Params) -> Params:
  """Float32 params with every projection, the LM head and the embedding table in the layout of
  jspec's float32 CPU kernel (`quant.DenseWeight`): the same numbers, matmuls that cost about the
  same at 1 to 8 rows (a verification block) and score a token with the same bits in any block."""
  return dataclasses.replace(
      map_layers(params, native_float_layer), embed=quant.dense_native(params.embed, (1,)),
      lm_head=None if params.lm_head is None else quant.dense_native(params.lm_head, (0,)))


def native_float_layer(lp: LayerParams) -> LayerParams:
  """One decoder layer's projections as `native_float_params` stores them."""
  return dataclasses.replace(lp, **{name: quant.dense_native(getattr(lp, name), axes)
                                    for name, axes in _INT8_INPUT_AXES.items()})


def param_bytes(params: Params) -> int:
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def _bytes_on_one_device(x) -> int:
  """A leaf's bytes on the first device holding it (all of it when unplaced or replicated)."""
  shards = getattr(x, "addressable_shards", None)
  if not shards:
    return int(np.prod(x.shape) * x.dtype.itemsize)
  first = shards[0].device
  return int(sum(s.data.nbytes for s in shards if s.device == first))


def step_weight_bytes(params: Params, vocab_size: int) -> int:
  """Weight bytes one decode step streams on one device: its shard of every weight, except that
  an untied model's input embedding is read a row per token, not whole (a tied one is the head's
  matrix, read whole). What a bandwidth fraction divides by one device's bandwidth."""
  total = sum(_bytes_on_one_device(x) for x in jax.tree.leaves(params))
  if params.lm_head is not None:
    embed = sum(_bytes_on_one_device(x) for x in jax.tree.leaves(params.embed))
    total -= embed - embed // vocab_size
  return int(total)
