"""The decode core every generation loop shares: prompt padding and buckets, the cache plan, stop
ids, prefill and host-side batch validation. `generate` (autoregressive), the speculative engines
and distillation build on it; it imports only the model layer.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.cache import KVCache
from jspec.models.config import Config, is_int
from jspec.models.llama import Params, check_params, forward, place_params
from jspec.sampling.processing import SamplingParams
from jspec.sharding import Mesh, Placement, mesh_from, model_placement

Array = jax.Array
PAD = -1  # output slots past a row's length
MIN_BUCKET = 16
CACHE_ALIGN = 64


def trimmed_rows(tokens: Array, lengths: Array) -> list[list[int]]:
  """Host-side: row b of tokens [B, N] cut to lengths[b]."""
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  return [tokens[b, : lengths[b]].tolist() for b in range(tokens.shape[0])]


def is_stop(tokens: Array, stop_ids: tuple[int, ...]) -> Array:
  if not stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.any(tokens[..., None] == jnp.asarray(stop_ids, jnp.int32), axis=-1)


def check_cache_width(prompt_width: int, cache_size: int) -> None:
  """Trace time, in the pure engines: a prefill of `prompt_width` positions (padded prompts, and a
  probing prefill's masks after them) must fit a cache of `cache_size` slots (a shape error deep
  in XLA otherwise, or entries dropped). The checked wrappers cut the bucket to fit (`plan_cache`);
  rows with too little room left after their prompt end early (`cache_full`)."""
  if prompt_width > cache_size:
    raise ValueError(f"prompts padded to {prompt_width} tokens do not fit cache_size={cache_size} "
                     f"slots. Fix: cache_size >= the longest prompt + max_new_tokens (+ what a "
                     f"speculative round reserves), or pad the prompts less.")


def check_padded_prompts(prompt: Array, prompt_lengths: Array, max_new_tokens: int) -> None:
  """Trace time, in the pure engines: what their shapes and statics show (their ids and lengths
  are the caller's to get right; the checked wrappers check those too), so that a wrong rank or
  dtype is named here rather than by an indexing error deep in the trace."""
  shape, dtype = jnp.shape(prompt), jnp.result_type(prompt)
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"prompt must be [B, P] integer token ids (right-padded rows), got {dtype} "
                     f"{list(shape)}. Fix: jspec.decode.pad_prompts, or generate() on id lists")
  lengths_shape, lengths_dtype = jnp.shape(prompt_lengths), jnp.result_type(prompt_lengths)
  if lengths_shape != shape[:1] or not jnp.issubdtype(lengths_dtype, jnp.integer):
    raise ValueError(f"prompt_lengths must be [B] = [{shape[0]}] integers (each row's length), "
                     f"got {lengths_dtype} {list(lengths_shape)}")
  if not is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def cache_full(lengths: Array, reserve: int, cache_size: int) -> Array:
  """[B] bool: rows whose next step, which writes `reserve` cache slots from slot `lengths` [B]
  on, would run past the cache's `cache_size` slots. The pure engines end such a row there (its
  length then falls short of max_new_tokens without a stop id) rather than let the writes past
  the end be dropped and decode on from a cache missing them; the checked wrappers size the cache
  so that it never happens."""
  return lengths + reserve > cache_size


def prefill(params: Params, cfg: Config, prompt: Array, prompt_lengths: Array,
            cache: KVCache, taps: tuple[int, ...] = ()) -> tuple[Array, Array, KVCache]:
  """Run padded prompts [B, P] through an empty cache; logits [B, V] at each row's last token,
  hidden states (or `taps`, as `forward` gives them) [B, P, ...]."""
  B, P = prompt.shape
  positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  logits, hidden, cache = forward(params, cfg, prompt, positions, cache.with_lengths(
      jnp.zeros((B,), jnp.int32)), logits_indices=(prompt_lengths - 1)[:, None], taps=taps)
  return logits[:, 0], hidden, cache.with_lengths(prompt_lengths)


def prompt_bucket(length: int) -> int:
  """Padded prompt length: the next of 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x them).

  Two buckets per octave bound the padding waste to a third, with few compiled programs.
  """
  if length <= MIN_BUCKET:
    return MIN_BUCKET
  power = 1 << (length - 1).bit_length()  # next power of two >= length
  three_quarters = power // 2 + power // 4
  return three_quarters if length <= three_quarters else power


def plan_cache(cfg: Config, prompt_lengths: Sequence[int], max_new_tokens: int,
               cache_size: int | None = None, reserve: int = 0, reserve_for: str = "",
               reserve_fix: str = "") -> tuple[int, int]:
  """(prompt bucket, cache slots) for these prompts; raises ValueError if they cannot fit.

  `reserve` extra slots (e.g. a speculative draft block, named by `reserve_for`; `reserve_fix`:
  how to need fewer, e.g. "lower gamma") must fit an explicit cache_size too; the text must fit
  the model's positions (without a cache_size, the cache is sized for text and reserve).
  """
  # NumPy integers of a small dtype would wrap in the sums below, and hash apart as statics.
  longest, max_new_tokens, reserve = int(max(prompt_lengths)), int(max_new_tokens), int(reserve)
  cache_size = None if cache_size is None else int(cache_size)
  positions = longest + max_new_tokens  # RoPE positions a row's text reaches
  need = positions + reserve  # cache slots, the reserve past the text included
  reserved = (f" + {reserve} slots reserved" + (f" for {reserve_for}" if reserve_for else "")
              if reserve else "")
  if cache_size and need > cache_size:
    raise ValueError(
        f"prompt of {longest} tokens + max_new_tokens={max_new_tokens}{reserved} needs {need} "
        f"cache slots, more than cache_size={cache_size}. Fix: shorten the prompt, lower "
        f"max_new_tokens" + (f", {reserve_fix}" if reserve_fix else "") + ", or raise cache_size.")
  limit = cfg.max_position_embeddings
  if positions > limit:  # a KV budget's cache is smaller, but RoPE still counts every token; a
    raise ValueError(  # cache_size larger than the positions ran past them before, silently
        f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} makes {positions} "
        f"positions, more than the model's max_position_embeddings={limit}. Fix: shorten the "
        f"prompt or lower max_new_tokens.")
  if cache_size:
    size = cache_size
  else:
    # The reserve holds only drafts past the text's end, never committed (rounds emit at most
    # max_new_tokens), so those slots may lie past max_position_embeddings: a speculative run
    # reaches the positions autoregressive decoding does.
    aligned = lambda n: -(-n // CACHE_ALIGN) * CACHE_ALIGN
    size = min(aligned(prompt_bucket(longest) + max_new_tokens + reserve),
               max(limit, aligned(need)))
  # Padded prompts (and a probing prefill's masks after them, within the reserve) fit the cache:
  # the bucket is cut where the cache would be too small for it (still >= longest).
  return min(prompt_bucket(longest), size - reserve), size


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, bucket: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """Validate token-id prompts and right-pad them to [B, bucket]; returns (tokens, lengths)."""
  if len(prompts) == 0:
    raise ValueError("no prompts given: pass a non-empty list of token-id lists")
  lengths = np.array([len(p) for p in prompts], np.int32)
  out = np.zeros((len(prompts), bucket), np.int32)
  for b, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"prompt {b} is empty: every prompt needs at least one token "
                       f"(e.g. the BOS token)")
    if isinstance(p, str):
      raise ValueError(f"prompt {b} is text ({p[:20]!r}); generation takes token ids. Fix: "
                       f"tokenize it first (Model.encode(text)), or call Model.generate_text.")
    arr = np.asarray(p)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"prompt {b} must be a flat sequence of integer token ids, "
                       f"got dtype {arr.dtype} and shape {arr.shape}")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
      raise ValueError(f"prompt {b} has token ids outside the vocabulary [0, {vocab_size}): "
                       f"{bad[:5].tolist()}. Fix: tokenize with this model's tokenizer.")
    out[b, : len(p)] = arr
  return out, lengths


def stop_id_tuple(stop_ids) -> tuple[int, ...]:
  """stop_ids as a sorted tuple of distinct ints (what a static config can hash; the same set in
  any order or with repeats is one compiled program), text and non-integers refused."""
  if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, Iterable):
    raise TypeError(f"stop_ids must be a sequence of token ids, got {stop_ids!r}. Fix: "
                    f"stop_ids=({stop_ids!r},) for one id.")
  stop_ids = tuple(stop_ids)
  if not all(is_int(s) for s in stop_ids):
    raise ValueError(f"stop_ids must be integer token ids, got {stop_ids!r}")
  return tuple(sorted({int(s) for s in stop_ids}))


def as_prompt_list(prompts) -> list:
  """The prompts as a list of prompts: one flat sequence of ids (a list of ints or a 1-D array)
  is one prompt; other iterables (a generator) are read into a list. The prompts themselves are
  checked by `pad_prompts`."""
  if isinstance(prompts, (np.ndarray, jax.Array)):
    if np.ndim(prompts) == 0:
      raise ValueError(f"prompts is one id ({prompts!r}); generation takes a list of token-id "
                       f"lists. Fix: [[{int(prompts)}]] for a one-token prompt")
    return [prompts] if np.ndim(prompts) == 1 else list(prompts)
  if isinstance(prompts, (str, bytes)):
    raise ValueError(f"prompts is one text ({prompts[:20]!r}); generation takes token ids. Fix: "
                     f"[Model.encode(text)], or Model.generate_text.")
  if not isinstance(prompts, Iterable):
    raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
  prompts = list(prompts)
  if prompts and all(is_int(t) for t in prompts):
    return [prompts]
  for b, p in enumerate(prompts):  # len() of each row comes next (the cache plan)
    if isinstance(p, (np.ndarray, jax.Array)) and np.ndim(p) == 1 or (
        isinstance(p, Sequence) and not isinstance(p, bytes)):  # text: pad_prompts says so
      continue
    raise ValueError(f"prompt {b} is {type(p).__name__} {p!r:.40}, not a sequence of token ids. "
                     f"Fix: prompts as a list of token-id lists, e.g. [[1, 2, 3], [4, 5]]")
  return prompts


@dataclasses.dataclass
class Batch:
  """Validated, padded inputs of one jitted call."""

  tokens: Array  # [B, bucket] int32, right-padded
  lengths: Array  # [B] int32
  key: Array
  sampling: SamplingParams  # fields as arrays: traced, so new values do not recompile
  stop_ids: tuple[int, ...]
  cache_size: int


def prng_key(key) -> Array:
  """The run's PRNG key from an int seed (a Python or NumPy integer) or a JAX key, as given
  (`jax.random.key(seed)`, or a raw `jax.random.PRNGKey(seed)`); anything else is refused here,
  before jit would fail on it."""
  if isinstance(key, jax.Array) and not isinstance(key, jax.core.Tracer) and key.shape == () \
      and jnp.issubdtype(key.dtype, jnp.integer):
    key = int(key)  # a seed held as a JAX scalar
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    if not -2**63 <= int(key) < 2**63:
      raise ValueError(f"seed {int(key)} does not fit a signed 64-bit integer, which "
                       f"jax.random.key takes. Fix: a seed in [-2**63, 2**63).")
    return jax.random.key(int(key))
  array = isinstance(key, (jax.Array, np.ndarray))
  typed = array and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  raw = array and key.dtype == np.uint32 and key.shape[-1:] == (2,)
  if typed or raw:
    if key.shape != (() if typed else (2,)):
      raise ValueError(f"key must be one PRNG key, got {key.shape[0] if key.ndim else ''} keys "
                       f"(shape {tuple(key.shape)}): a run draws from one key, its rows apart. "
                       f"Fix: key=jax.random.key(0); for a key per prompt, a call per prompt (or "
                       f"jax.vmap a pure engine, e.g. generate_tokens, over keys)")
    return jnp.asarray(key)
  raise TypeError(f"key must be an integer seed or a JAX PRNG key, got {type(key).__name__}"
                  f"{'' if not hasattr(key, 'dtype') else f' of dtype {key.dtype}'}. Fix: key=0 "
                  f"or key=jax.random.key(0).")


def prepare_batch(cfg: Config, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                  sampling: SamplingParams, key: Array | int, stop_ids: Sequence[int],
                  cache_size: int | None, reserve: int = 0, reserve_for: str = "",
                  reserve_fix: str = "") -> Batch:
  """Host-side checks and padding shared by every generate entry point."""
  if isinstance(prompts, Iterator):  # read once: a generator is no pytree node JAX looks into
    prompts = list(prompts)
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((prompts, sampling))):
    raise TypeError("the prompts or sampling settings are traced (inside jax.jit or vmap): "
                    "generate, speculative_generate and tree_speculative_generate check and pad "
                    "them on the host. Fix: call them outside your jit, or inside it the pure "
                    "engines on padded arrays (generate_tokens, speculative_generate_tokens, "
                    "tree_speculative_generate_tokens; docs/guide.md, Python API)")
  if not is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  if cache_size is not None and (not is_int(cache_size) or cache_size < 1):
    raise ValueError(f"cache_size must be a positive integer (None: sized for the prompts), got "
                     f"{cache_size!r}")
  if not isinstance(sampling, SamplingParams):
    raise TypeError(f"sampling must be a jspec SamplingParams, got {type(sampling).__name__}. "
                    f"Fix: sampling=SamplingParams(temperature=..., top_k=..., top_p=...), or "
                    f"GREEDY.")
  stop = stop_id_tuple(stop_ids)
  if any(not 0 <= s < cfg.vocab_size for s in stop):
    raise ValueError(f"stop ids {stop} must lie in [0, {cfg.vocab_size})")
  prompts = as_prompt_list(prompts)
  sampling.validate(cfg.vocab_size, batch=len(prompts))
  bucket, size = plan_cache(cfg, [len(p) for p in prompts] or [0], max_new_tokens, cache_size,
                            reserve, reserve_for, reserve_fix)
  tokens, lengths = pad_prompts(prompts, cfg.vocab_size, bucket)
  return Batch(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths),
               key=prng_key(key),
               sampling=sampling.as_arrays(), stop_ids=stop, cache_size=size)


def on_mesh(params: Params, cfg: Config, b: Batch, mesh: Mesh | None
            ) -> tuple[Params, Batch, Placement | None]:
  """Host-side, for a run on `mesh` (None: as given): the model's placement, checked against the
  batch; params placed by their layout (a no-op when `jspec.model.load(..., mesh=)` placed them);
  the prompts split over `dp`."""
  params, tokens, lengths, placement = rows_on_mesh(params, cfg, b.tokens, b.lengths, mesh)
  return params, dataclasses.replace(b, tokens=tokens, lengths=lengths), placement


def rows_on_mesh(params: Params, cfg: Config, tokens: Array, lengths: Array, mesh: Mesh | None
                 ) -> tuple[Params, Array, Array, Placement | None]:
  """on_mesh for rows of tokens [B, T] and their lengths [B] alone (no sampling, no key). The
  params are checked against cfg first; mesh may also be text, "dp=2,tp=4" (as `load` takes)."""
  check_params(params, cfg)
  if isinstance(mesh, str):
    mesh = mesh_from(mesh)
  if mesh is None:
    return params, tokens, lengths, None
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh with axes ('dp', 'tp') or text such as "
                    f"'dp=2,tp=4', got {type(mesh).__name__}. Fix: mesh=jspec.sharding."
                    f"make_mesh(dp, tp).")
  placement = model_placement(cfg, mesh)
  placement.check_batch(tokens.shape[0])
  return (place_params(params, cfg, placement), placement.put_batch(tokens),
          placement.put_batch(lengths), placement)
