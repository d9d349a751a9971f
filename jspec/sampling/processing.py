"""Sampling parameters and the logits → processed distribution step shared by every sampler.

Speculative verification compares the target's and the draft's *processed* distributions, so the
same function (temperature, then top-k, then top-p, then min-p) must serve both; it lives here,
once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jspec.sharding import top_k_by_rows

Array = jax.Array
T = TypeVar("T")


class Mode(NamedTuple):
  """Which branches of sampling a program needs, when the settings are known while tracing."""

  greedy: bool  # temperature 0 (every row): argmax and greedy verification, nothing else
  filtered: bool  # top-k or top-p on (a sampled row): the threshold search runs
  min_p: bool = False  # min-p on (a sampled row): tokens below min_p x the top probability go
  penalized: bool = False  # a repetition, presence or frequency penalty on (sampling.penalties)
  # Rows at temperature 0 beside sampled rows (settings given per row): each greedy/sampled choice
  # is made row by row inside the program (both sides computed, `switch`); greedy is then False.
  greedy_rows: bool = False


def _host_values(value) -> np.ndarray | None:
  """value as float64 numbers (one, or one per row) when the host holds them: Python or NumPy
  numbers and arrays; None for anything else (jax arrays, tracers, text)."""
  if isinstance(value, (bool, int, float, np.generic, np.ndarray)):
    array = np.asarray(value)
    if array.ndim <= 1 and (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
      return array.astype(np.float64)
  return None


def _concrete(value) -> np.ndarray | None:
  """_host_values, and also a jax array of one number or one per row that this host can read
  (not a tracer; reading waits for the device once, when the params are built)."""
  values = _host_values(value)
  if values is not None or not isinstance(value, jax.Array) or value.ndim > 1:
    return values
  if not (jnp.issubdtype(value.dtype, jnp.number) or value.dtype == bool):
    return None
  try:  # a tracer raises here; so does an array held by other hosts
    return np.asarray(value, np.float64) if value.is_fully_addressable else None  # bfloat16 too
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def _on_a_sampled_row(on: np.ndarray, temperature: np.ndarray) -> bool:
  """Whether a row at temperature > 0 has `on` (any row's, when the rows given differ in number:
  validate refuses those settings with the lengths named)."""
  try:
    return bool(np.any(on & (temperature != 0)))
  except ValueError:
    return bool(np.any(on))


def _mode_of(values) -> Mode | None:
  """The mode the settings (in _FIELDS' order; each a number or one per row) give, or None when
  any is not known on the host. A branch is on when any row needs it: the filters when a sampled
  row has one (a greedy row's argmax is the same with or without), the penalties on any row."""
  if any(v is None for v in values):
    return None
  t, k, p, m, r, a, f = values
  greedy_rows = bool(np.any(t == 0))
  greedy = bool(np.all(t == 0))
  return Mode(greedy=greedy, filtered=_on_a_sampled_row((k > 0) | (p < 1), t),
              min_p=_on_a_sampled_row(m > 0, t),
              penalized=bool(np.any(r != 1) or np.any(a != 0) or np.any(f != 0)),
              greedy_rows=greedy_rows and not greedy)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 switch those filters off;
  repetition_penalty 1, presence_penalty 0 and frequency_penalty 0 switch the penalties off.

  min_p keeps the tokens whose probability (after temperature) is at least min_p times the most
  likely token's (Nguyen et al. 2407.01082), applied after top-k and top-p as transformers orders
  them. The penalties (jspec.sampling.penalties) change the raw logits before all of that, from
  the text so far: repetition_penalty as transformers and vLLM (a token of the prompt or the output
  has a positive logit divided by it, a negative one multiplied), presence_penalty and
  frequency_penalty as OpenAI's API (subtracted once if the token was generated, and per time). The
  seven settings are pytree data, so new values do not recompile. Which branches a program
  needs (`mode`: greedy or not, filters on or off, penalties on or off) is static, read off the
  values when they are numbers: a greedy program then holds no sampling code and no
  greedy/sampled switch (on a GPU each lax.cond in the decode loop is a round trip to the host),
  and compiles 1.7-2x faster. A change of mode (greedy to sampled, a filter or a penalty turned
  on or off) compiles another program; other changes (0.7 -> 0.9) do not. `mode=None` keeps one
  program for every setting (the switches decided inside it), as do values traced when the
  params are built, `dataclasses.replace` included. Pytree operations keep the mode they
  flattened (values mapped to jax arrays or tracers keep it; mapped to new host numbers, Python
  or NumPy, it is read again).

  Each setting is one number for every row or one per row ([B]: a list, tuple or array). The
  mode then reads all rows (a branch is on when any row needs it); greedy rows beside sampled
  ones (`Mode.greedy_rows`) make `is_greedy` one bool per row, and every `switch` on it computes
  both sides and keeps each row's own.
  """

  temperature: float | Array = 0.0
  top_k: int | Array = 0
  top_p: float | Array = 1.0
  min_p: float | Array = 0.0
  repetition_penalty: float | Array = 1.0
  presence_penalty: float | Array = 0.0
  frequency_penalty: float | Array = 0.0
  mode: Mode | None | str = "auto"

  def __post_init__(self):
    for name in _FIELDS:  # one per row as a list or tuple: an array (a pytree leaf, not a node)
      value = getattr(self, name)
      if isinstance(value, (list, tuple)):
        traced = any(isinstance(v, jax.Array) for v in value)  # traced in a jit: stay traced
        object.__setattr__(self, name, jnp.asarray(value) if traced else np.asarray(value))
    if self.mode is None:
      return
    if self.mode != "auto" and not isinstance(self.mode, Mode):
      raise ValueError(f"SamplingParams mode must be 'auto' (read off the values), None (decided "
                       f"inside the program) or a Mode; got {self.mode!r}")
    # A Mode passed in (dataclasses.replace passes the old one) is read again from the values.
    object.__setattr__(self, "mode", _mode_of([_concrete(getattr(self, n)) for n in _FIELDS]))

  def _compared(self) -> tuple:
    """What == and hash() read: the mode and each setting's numbers where this host holds them
    (1 and 1.0 alike, a list and an array of the same numbers alike), else the setting's identity
    (a tracer, an array other hosts hold). Settings per row are arrays, whose own == answers
    element by element and which cannot be hashed."""
    def key(value):
      numbers = _concrete(value)
      return (("id", id(value)) if numbers is None
              else (numbers.shape, tuple(numbers.reshape(-1).tolist())))
    return (self.mode,) + tuple(key(getattr(self, n)) for n in _FIELDS)

  def __eq__(self, other) -> bool:
    if not isinstance(other, SamplingParams):
      return NotImplemented
    return self._compared() == other._compared()

  def __hash__(self) -> int:
    return hash(self._compared())

  def validate(self, vocab_size: int | None = None, batch: int | None = None
               ) -> "SamplingParams":
    """Check concrete values on the host (top_k against `vocab_size` when given; settings given
    per row against the `batch` size when given); returns self for chaining."""
    values = {name: _setting(name, getattr(self, name), batch) for name in _FIELDS}
    lengths = {name: v.shape[0] for name, v in values.items() if v.ndim}
    if len(set(lengths.values())) > 1:
      raise ValueError(f"settings given per row must give as many rows each, got {lengths}")

    def check(name: str, ok, rule: str) -> None:
      bad = np.flatnonzero(~np.asarray(ok, bool).reshape(-1))
      if bad.size:
        row = "" if values[name].ndim == 0 else f"[{bad[0]}]"
        value = values[name].reshape(-1)[bad[0]]
        raise ValueError(f"{name}{row} {rule}, got {value:g}")

    t, k, p, m, r = (values[n] for n in _FIELDS[:5])
    check("temperature", np.isfinite(t) & (t >= 0), "must be a finite number >= 0 (0 = greedy)")
    check("top_k", np.isfinite(k) & (np.round(k) == k) & (k >= 0),
          "must be an integer >= 0 (0 = off)")
    if vocab_size is not None and np.any(k > vocab_size):
      row = "" if k.ndim == 0 else f"[{np.flatnonzero(k > vocab_size)[0]}]"
      value = k.reshape(-1)[np.flatnonzero(k.reshape(-1) > vocab_size)[0]]
      raise ValueError(f"top_k{row}={value:g} is more than the vocabulary's {vocab_size} "
                       f"tokens. Fix: top_k <= {vocab_size}, or 0 (off).")
    check("top_p", (p > 0) & (p <= 1), "must be in (0, 1] (1 = off)")
    check("min_p", (m >= 0) & (m <= 1), "must be in [0, 1] (0 = off)")
    check("repetition_penalty", np.isfinite(r) & (r > 0),
          "must be a finite number > 0 (1 = off; above 1 discourages repeats)")
    for name in ("presence_penalty", "frequency_penalty"):
      check(name, np.isfinite(values[name]),
            "must be a finite number (0 = off; positive discourages repeats)")
    return self

  @classmethod
  def of_rows(cls, rows, **kw) -> "SamplingParams":
    """Settings per row from one dict of settings per prompt (absent keys: the defaults), e.g.
    `SamplingParams.of_rows([dict(), dict(temperature=0.7, top_p=0.9)])`."""
    rows = list(rows)
    unknown = {key for row in rows for key in row} - set(_FIELDS)
    if unknown:
      raise ValueError(f"unknown sampling settings {sorted(unknown)}; the settings are {_FIELDS}")
    return cls(**{name: [row.get(name, getattr(GREEDY, name)) for row in rows]
                  for name in _FIELDS}, **kw)

  def as_arrays(self) -> "SamplingParams":
    """The settings as jax arrays of fixed dtypes (top_k int32, the rest float32), the mode kept:
    what a jitted call takes, so 1 and 0.7, or [0, 1] and [0, 0.7], give the same program."""
    return _unflatten(self.mode, [jnp.asarray(getattr(self, n),
                                              jnp.int32 if n == "top_k" else jnp.float32)
                                  for n in _FIELDS])

  @property
  def settings_per_row(self) -> list[str]:
    """The names of the settings given one per row (empty: one number each)."""
    return [n for n in _FIELDS if np.ndim(getattr(self, n))]

  def require_uniform(self, who: str) -> "SamplingParams":
    """self, when every setting is one number for the whole batch; a clear error for settings
    per row where `who` (a benchmark comparing settings, a calibration) takes one of each."""
    if self.settings_per_row:
      raise ValueError(f"{who} takes one number per sampling setting, got one per row for "
                       f"{', '.join(self.settings_per_row)}. Fix: run it once per setting.")
    return self

  @property
  def is_greedy(self) -> bool | Array:
    """A Python bool when the mode is static; else traced: one bool, or one per row [B] when
    the settings are given per row (`switch` then picks a side row by row)."""
    if self.mode is not None and not self.mode.greedy_rows:
      return self.mode.greedy
    return jnp.asarray(self.temperature) == 0

  @property
  def filters_on(self) -> bool | Array:
    if self.mode is not None:
      return self.mode.filtered
    return jnp.any(((jnp.asarray(self.top_k) > 0) | (jnp.asarray(self.top_p) < 1))
                   & (jnp.asarray(self.temperature) != 0))

  @property
  def min_p_on(self) -> bool | Array:
    if self.mode is not None:
      return self.mode.min_p
    return jnp.any((jnp.asarray(self.min_p) > 0) & (jnp.asarray(self.temperature) != 0))

  @property
  def penalized(self) -> bool | Array:
    """A penalty on: the next token's law depends on the text so far (jspec.sampling.penalties)."""
    if self.mode is not None:
      return self.mode.penalized
    return jnp.any((jnp.asarray(self.repetition_penalty) != 1)
                   | (jnp.asarray(self.presence_penalty) != 0)
                   | (jnp.asarray(self.frequency_penalty) != 0))

  @property
  def needs_history(self) -> bool:
    """Static: whether a program carries the text's token counts (penalties on, or decided
    inside the program)."""
    return self.mode is None or self.mode.penalized


_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty")


def _setting(name: str, value, batch: int | None) -> np.ndarray:
  """One sampling setting as host numbers: one real number (Python, NumPy or a one-number
  array) for every row, or one per row [batch]."""
  if isinstance(value, (str, bytes)) or value is None:
    raise TypeError(f"{name} must be a number, got {value!r}")
  array = np.asarray(value)
  if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
    raise TypeError(f"{name} must be a number, got {value!r} of dtype {array.dtype}")
  if array.ndim > 1 or (array.ndim == 1 and batch is not None and array.shape[0] != batch):
    raise ValueError(f"{name} must be one number for the whole batch or one per row "
                     f"({'[B]' if batch is None else f'{batch}, one per prompt'}), "
                     f"got an array of shape {array.shape}")
  return array.astype(np.float64)


def _unflatten(mode: Mode | None, values) -> SamplingParams:
  """Without __init__: jax arrays and tracers keep the flattened mode; host numbers (Python or
  NumPy, one or one per row) give theirs."""
  sp = object.__new__(SamplingParams)
  for name, value in zip(_FIELDS, values):
    object.__setattr__(sp, name, value)
  if mode is not None:
    mode = _mode_of([_host_values(v) for v in values]) or mode
  object.__setattr__(sp, "mode", mode)
  return sp


jax.tree_util.register_pytree_with_keys(
    SamplingParams,
    lambda sp: (tuple((jax.tree_util.GetAttrKey(n), getattr(sp, n)) for n in _FIELDS), sp.mode),
    _unflatten,
    lambda sp: (tuple(getattr(sp, n) for n in _FIELDS), sp.mode))


def switch(pred: bool | Array, on_true: Callable[[], T], on_false: Callable[[], T], *,
           rows: bool = False) -> T:
  """lax.cond when pred is one traced bool; when it is a Python bool, only the branch it picks is
  traced. With `rows` (every output leads with the batch axis), pred may be one bool per row [B]
  (`SamplingParams.is_greedy` with greedy rows beside sampled ones): both sides run and each row
  keeps its own. Without it such a pred is refused: an output laid out [L, B, ...] would be
  selected along the wrong axis, silently when L == B."""
  if isinstance(pred, bool):
    return on_true() if pred else on_false()
  if jnp.ndim(pred) == 0:
    return jax.lax.cond(pred, on_true, on_false)
  if not rows:
    raise ValueError(f"switch got one predicate per row (shape {jnp.shape(pred)}), but its "
                     f"outputs are not declared batch-leading: pass rows=True if every output "
                     f"leads with the batch axis, else branch per row yourself")
  return jax.tree.map(lambda a, b: jnp.where(per_row(pred, a), a, b), on_true(), on_false())


def per_row(value, x: Array) -> Array:
  """A setting (one number, or one per row [B]) shaped to broadcast against x [B, ...]."""
  value = jnp.asarray(value)
  if value.ndim == 0:
    return value
  if value.ndim != 1 or x.ndim == 0 or x.shape[0] != value.shape[0]:
    raise ValueError(f"a sampling setting given per row (shape {value.shape}) does not match "
                     f"an array of rows of shape {x.shape}: settings per row need arrays that "
                     f"lead with the batch axis")
  return value.reshape(value.shape + (1,) * (x.ndim - 1))


GREEDY = SamplingParams()


def processed_logprobs(logits: Array, sp: SamplingParams) -> Array:
  """Log-probabilities [..., V] after temperature, top-k, top-p and min-p; filtered tokens are
  -inf.

  Ties at a top-k or top-p threshold are all kept: top-k's as transformers keeps them, and top-p
  then reads the distribution over every token top-k kept, ties included, as transformers does;
  at top-p's own edge transformers keeps the tied tokens that come first in its sort, jspec
  keeps them all (no token's fate hangs on its id). For temperature 0 this
  returns the temperature-1e-6 distribution, unfiltered (a greedy row's argmax is the same either
  way, and a tree that draws a greedy row's children from this law must not see its neighbours'
  settings through the mode); callers treat greedy separately with argmax. The
  filters' threshold search is skipped when both are off (`switch` on `sp.filters_on`). min-p
  keeps x >= max(x) + log(min_p) of the scaled logits x: a ratio to the most likely token, which
  renormalising after top-k and top-p leaves as it was, so its order among them matters only in
  that it keeps fewer (a shorter prefix of the sorted tokens) or more, never others.
  """
  greedy = sp.is_greedy  # static where the mode says; else one bool, or one per row
  temperature = per_row(jnp.asarray(sp.temperature, jnp.float32), logits)
  # A positive temperature divides as given (1e-9 is sharper than 1e-6; below 1e-30 float32
  # logits would overflow); 0 stands for 1e-6.
  x = logits.astype(jnp.float32) / jnp.where(temperature > 0, jnp.maximum(temperature, 1e-30),
                                             1e-6)
  k = jnp.where(greedy, 0, jnp.asarray(sp.top_k, jnp.int32))
  top_p = jnp.where(greedy, 1.0, jnp.asarray(sp.top_p, jnp.float32))
  min_p = jnp.where(greedy, 0.0, jnp.asarray(sp.min_p, jnp.float32))
  filtered = switch(sp.filters_on, lambda: _top_k_top_p(x, k, top_p), lambda: x)
  filtered = switch(sp.min_p_on, lambda: _min_p(filtered, x, min_p), lambda: filtered)
  return jax.nn.log_softmax(filtered, axis=-1)


def _min_p(filtered: Array, x: Array, min_p) -> Array:
  """filtered [..., V] less the tokens whose scaled logit x is below the largest's by more than
  -log(min_p): a probability under min_p times the most likely token's (kept: at least it)."""
  min_p = _per_position(jnp.asarray(min_p, jnp.float32), x)
  floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(min_p)
  return jnp.where(x < floor, -jnp.inf, filtered)


def _per_position(value: Array, x: Array) -> Array:
  """A setting (one number, or one per row) as [..., 1] against x [..., V]."""
  return jnp.broadcast_to(per_row(value, x), x.shape[:-1] + (1,))


# How many of the largest logits a row's top-k/top-p filter looks at before falling back to
# bisection over the vocabulary: top-k up to this many, and top-p whenever the nucleus is no larger.
CANDIDATES = 256


def _top_k_top_p(x: Array, k: Array, top_p: Array) -> Array:
  """Mask with -inf what top-k (k > 0) and then top-p keep out of the scaled logits x [..., V].

  Both filters need only the largest values: the threshold is the smallest kept one. So the
  exact top-m values (m = CANDIDATES) are found first, each device taking the top m of its own
  vocabulary shard on a mesh (`vocab_split`; only S*m candidates a row move, not V logits). When
  the filter may reach past them (top-k with k > m, or a nucleus of more than m tokens in any
  row: lax.cond), the threshold is bisected instead: 32 halvings of the float range, each a
  masked sum over the vocabulary (shard by shard: a [B, 1] all-reduce, no row gathered). The
  mask then applies shard by shard. No sort of the vocabulary: on one CPU a sort of 4 rows of a
  49k vocabulary takes 36 ms, the candidates 0.6. Which of the two runs is decided for the whole
  array at once; both are exact, but a token within float32 rounding of top_p's edge may fall
  either side depending on which ran.
  """
  k, top_p = _per_position(k, x), _per_position(top_p, x)  # [..., 1]
  threshold, fits, log_z_all = candidate_threshold(x, k, top_p)
  threshold = jax.lax.cond(jnp.all(fits), lambda: threshold,
                           lambda: bisected_threshold(x, k, top_p, log_z_all))
  # A row with both filters off (settings per row, beside rows that filter) keeps every token,
  # not the candidates alone.
  return jnp.where((x < threshold) & ((k > 0) | (top_p < 1)), -jnp.inf, x)


def candidate_threshold(x: Array, k: Array, top_p: Array) -> tuple[Array, Array, Array]:
  """(threshold, fits, log_z_all), each [..., 1]: the filters' threshold read from the top
  CANDIDATES values of x [..., V] alone, whether it is exact (the filter fits in them), and the
  log normalizer over the whole vocabulary (k, top_p: [..., 1])."""
  m = min(x.shape[-1], CANDIDATES)
  # top-p reads the distribution top-k leaves, whose normalizer over all V logits (k = 0) is a
  # sum reduced shard by shard; over the top k (k > 0) it needs only the sorted values.
  log_z_all = jax.nn.logsumexp(x, axis=-1, keepdims=True)  # [..., 1]
  desc = _largest(x, m)
  threshold, mass = _threshold(desc, k, top_p, log_z_all)
  # Ties with top-k's k-th value past the candidates: top-p's normalizer would miss them.
  k_th = jnp.take_along_axis(desc, jnp.clip(k, 1, m) - 1, axis=-1)
  spills = (k > 0) & (top_p < 1) & (desc[..., -1:] >= k_th)
  fits = (k <= m) & ((k > 0) | (mass >= top_p) | (top_p >= 1)) & ~spills | (m == x.shape[-1])
  return threshold, fits, log_z_all


def _largest(x: Array, m: int) -> Array:
  """The m largest values of x [..., V] along the last axis, largest first. On a mesh that splits
  the vocabulary, each device takes the top m of its own shard and only those move (XLA would
  gather whole rows to run top_k on a sharded axis; `top_k_by_rows`)."""
  # On a mesh every array of V logits is taken as split like the target's: a draft head that is
  # replicated pays one small all-gather ([B, tp x m]) where it needed none; one that borrows the
  # target's table (compact drafters) is split and would otherwise gather whole rows.
  return top_k_by_rows(x, m, indices=False, over_vocab=True)[0]


def bisected_threshold(x: Array, k: Array, top_p: Array, log_z_all: Array) -> Array:
  """The threshold [..., 1] `_threshold` reads from the sorted values, found by bisection over
  x [..., V] without sorting it. top-k's threshold is the k-th largest value: the smallest v
  with fewer than k values above it. top-p's is the smallest v (>= top-k's) whose mass strictly
  above it is < top_p under the top-k distribution; that mass is a step function of v, so the
  smallest such float is one of the values (ties kept, as in the sorted reading)."""
  lowest = jnp.full(k.shape, _LOWEST)
  t_k = jax.lax.cond(  # skipped when no row asks for top-k
      jnp.any(k > 0),
      lambda: jnp.where(k > 0, _smallest_where(
          x, lambda v: jnp.sum(x > v, -1, keepdims=True) < k), _LOWEST),
      lambda: lowest)
  p = jnp.exp(x - log_z_all)  # [..., V] under the whole vocabulary's normalizer
  # What top-k keeps: its k largest and every token tied with the k-th.
  z_k = jnp.sum(jnp.where(x >= t_k, p, 0), axis=-1, keepdims=True)
  z = jnp.where(k > 0, z_k, 1.0)

  def nucleus_ends(v):
    mass_above = jnp.sum(jnp.where(x > v, p, 0), axis=-1, keepdims=True)
    return (v >= t_k) & ((mass_above < top_p * z) | (top_p >= 1))

  # top_p = 1 everywhere: top-k alone, its threshold already found.
  return jax.lax.cond(jnp.all(top_p >= 1), lambda: jnp.maximum(t_k, jnp.min(x, -1, keepdims=True)),
                      lambda: _smallest_where(x, nucleus_ends))


_LOWEST = jnp.finfo(jnp.float32).min


def _smallest_where(x: Array, pred) -> Array:
  """The smallest float32 v [..., 1] with pred(v) true, for pred false below some point and true
  from it on, searched between x's smallest and largest values: a bisection over the floats'
  order-preserving uint32 codes (32 halvings find it exactly)."""
  lo = _code(jnp.min(x, axis=-1, keepdims=True))
  hi = _code(jnp.max(x, axis=-1, keepdims=True))  # pred(max) holds for the filters above

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = pred(_value(mid))
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  lo, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
  return _value(hi)


def _code(v: Array) -> Array:
  """float32 -> uint32 preserving order (negative floats flipped, positive ones above them)."""
  bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _value(code: Array) -> Array:
  bits = jnp.where(code >> 31 == 1, code & jnp.uint32(0x7FFFFFFF), ~code)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _threshold(desc: Array, k: Array, top_p: Array, log_z_all: Array) -> tuple[Array, Array]:
  """(threshold [..., 1], mass [..., 1]) from a row's largest values `desc` [..., n] (largest
  first): the smallest value top-k and top-p keep (ties kept), and the probability `desc` holds
  under the top-k distribution (the nucleus fits in `desc` when that is at least top_p)."""
  n = desc.shape[-1]
  t_k = jnp.take_along_axis(desc, jnp.clip(k, 1, n) - 1, axis=-1)  # top-k's k-th value
  desc = jnp.where((k > 0) & (desc < t_k), -jnp.inf, desc)  # ties with the k-th kept
  log_z = jnp.where(k > 0, jax.nn.logsumexp(desc, axis=-1, keepdims=True), log_z_all)
  probs = jnp.exp(desc - log_z)
  mass = jnp.cumsum(probs, axis=-1)
  # keep a token while the mass strictly before it is < top_p (top_p = 1: top-k alone).
  keep = ((mass - probs < top_p) | (top_p >= 1)) & (desc > -jnp.inf)
  keep = keep.at[..., 0].set(True)
  n_keep = jnp.sum(keep, axis=-1, keepdims=True)
  return jnp.take_along_axis(desc, n_keep - 1, axis=-1), mass[..., -1:]


def argmax(logits: Array) -> Array:
  """jnp.argmax(logits, axis=-1) as int32 (the first maximum; the first NaN if any), in two
  vectorised passes: XLA:CPU runs argmax's (value, index) reduction ~5x slower over a 150k
  vocabulary (5 rows: 2.0 vs 0.34 ms, beside 8.7 ms for a 1.5B int8 model's LM head)."""
  V = logits.shape[-1]
  top = jnp.max(logits, axis=-1, keepdims=True)
  hit = (logits == top) | jnp.isnan(logits)
  return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def sample(key: Array, logits: Array, sp: SamplingParams,
           processed: Array | None = None) -> Array:
  """One token per row from logits [B, V]: argmax when greedy, else the processed distribution
  (`processed`: processed_logprobs(logits, sp), when the caller has it)."""
  return switch(
      sp.is_greedy,
      lambda: argmax(logits),
      lambda: jax.random.categorical(
          key, processed_logprobs(logits, sp) if processed is None else processed,
          axis=-1).astype(jnp.int32),
      rows=True)
