"""The static settings of an evicting KV cache (a hashable config, passed as a static argument)."""

from __future__ import annotations

import dataclasses

from jspec.models.config import is_int

# Methods that score slots from the cached keys alone (or their positions) work with any attention
# kernel; attention-score methods read the attention mass the forward accumulates in cache.mass
# (XLA attention only). CAOTE ("+caote") sits on top of any attention-score method.
KEY_METHODS = ("keydiff", "streaming")
ATTENTION_METHODS = ("h2o", "tova", "snapkv")
SCORE_IMPLS = ("xla", "pallas", "pallas-interpret")
METHODS = KEY_METHODS + ATTENTION_METHODS + tuple(f"{m}+caote" for m in ATTENTION_METHODS)


# H2O's default recent window (entries). Its paper keeps the most recent tokens beside the heavy
# hitters, half the budget each; without any, H2O drops each new token at once (its accumulated
# mass is one query's). Measured (benchmarks/README.md, session 46): 32 recent entries bring most
# of the gain on the continuous measure (KL to the full cache at 25%: 1.25 with none, 0.38 with
# 32, 0.33 with the paper's half) and keep the heavy hitters' room, which long-context retrieval
# needs (pass key at 8,192 / 25%, H2O + CAOTE: 5/8 with 32, 1/8 with the half).
H2O_RECENT = 32


def default_window(method: str, budget: int, sinks: int, snap_window: int) -> int:
  """The recent window a method keeps unless told otherwise (at most half of what the sinks
  leave): H2O `H2O_RECENT` entries (its paper's recent tokens; the paper's even split is
  `window=(budget - sinks) // 2`), SnapKV its observation window (`snap_window`), which its paper
  keeps beside the entries it selects. StreamingLLM keeps sinks + the newest by definition, and
  KeyDiff and TOVA score the newest entries like any other."""
  half = max(budget - sinks, 0) // 2
  base = method.split("+")[0]
  return min({"h2o": H2O_RECENT, "snapkv": snap_window}.get(base, 0), half)


@dataclasses.dataclass(frozen=True)
class KVPolicy:
  """Keep `budget` committed cache slots per row (in every layer and KV head).

  method: "keydiff" (keep the keys least similar to the mean key of their layer and head),
    "streaming" (StreamingLLM: the `sinks` first tokens and the most recent ones), "h2o"
    (attention accumulated over every query so far), "tova" (the newest query's attention),
    "snapkv" (attention of the last `snap_window` queries of each block, pooled over
    `snap_kernel` neighbouring kept positions), or any of the last three + "+caote" (CAOTE: the
    error in the attention output that evicting the slot would cause, from those scores and the
    values).
  sinks: the first positions, never evicted (attention sinks).
  window: the most recent committed positions, never evicted. None (the default): the method's
    own, `default_window`: H2O keeps 32 recent entries beside its heavy hitters and SnapKV its
    observation window, as their papers keep recent tokens; the others keep none. The number in
    force is `recent` (window stays as given, so `dataclasses.replace(policy, budget=...)`
    resolves the default again for the new budget).
  chunk: prompt tokens per prefill block; eviction follows each block.
  evict_every: a row is evicted down to the budget once it holds budget + evict_every entries
    (1: every decoded token once the budget is full). The default, 16, lets speculative rounds of
    up to 15 drafts through whole (a round stops at the next eviction to stay exact), costs no
    memory while it is at most `chunk`, and tracked the full cache at least as closely as 1 in
    every policy measured (far closer for KeyDiff and H2O: benchmarks/README.md, session 45).
  snap_window, snap_kernel: SnapKV's observation window (queries) and pooling width (kept
    positions).
  score_impl: how KeyDiff's scores are computed: "xla" (jnp), "pallas" (the key-similarity kernel,
    GPU/TPU) or "pallas-interpret" (that kernel interpreted: CPU tests).
  """

  method: str
  budget: int
  sinks: int = 4
  window: int | None = None
  chunk: int = 128
  evict_every: int = 16
  snap_window: int = 32
  snap_kernel: int = 5
  score_impl: str = "xla"
  recent: int = dataclasses.field(init=False, compare=False)  # the window in force

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"unknown KV eviction method {self.method!r}; jspec has {METHODS}")
    for name, least in (("budget", 1), ("chunk", 1), ("evict_every", 1), ("snap_window", 1),
                        ("snap_kernel", 1), ("sinks", 0), ("window", 0)):
      value = getattr(self, name)
      if value is None and name == "window":
        continue
      if not is_int(value) or value < least:
        raise ValueError(f"KVPolicy {name} must be {'a positive' if least else 'a non-negative'} "
                         f"integer, got {value!r}")
      object.__setattr__(self, name, int(value))  # NumPy integers too (one hash for one value)
    object.__setattr__(self, "recent", self.window if self.window is not None else
                       default_window(self.method, self.budget, self.sinks, self.snap_window))
    if self.score_impl not in SCORE_IMPLS:
      raise ValueError(f"score_impl must be one of {SCORE_IMPLS}, got {self.score_impl!r}")
    if self.score_impl != "xla" and self.base != "keydiff":
      raise ValueError(f"score_impl={self.score_impl!r} is the key-similarity kernel, which "
                       f"scores KeyDiff only; method {self.method!r} runs with score_impl='xla'")
    if self.budget <= self.sinks + self.recent:
      raise ValueError(
          f"kv budget {self.budget} leaves no slot to choose: it must exceed sinks + window = "
          f"{self.sinks} + {self.recent}. Fix: raise the budget or lower sinks/window.")
    if self.chunk > self.budget:
      raise ValueError(f"prefill chunk {self.chunk} is larger than the kv budget {self.budget}: "
                       f"a chunk must fit the budget. Fix: chunk <= budget.")
    if self.base == "keydiff" and self.budget == 1:
      # Two unit keys are equally far from their mean: every choice would be rounding's.
      raise ValueError("KeyDiff ranks keys by their cosine to the mean of the row's normalised "
                       "keys; a budget of 1 evicts between two keys, always equally far from "
                       "their mean (a tie that rounding breaks, so speculative and "
                       "autoregressive runs part). Fix: budget >= 2, or method='streaming'")

  @classmethod
  def never_full(cls, tokens: int, chunk: int) -> "KVPolicy":
    """A budget that `tokens` tokens read `chunk` at a time never fill: chunked prefill that
    evicts nothing (the full cache, in the same program as a budgeted one)."""
    return cls("streaming", budget=tokens + chunk, sinks=0, chunk=chunk)

  @property
  def base(self) -> str:
    """The scoring method under "+caote"."""
    return self.method.split("+")[0]

  @property
  def caote(self) -> bool:
    return self.method.endswith("+caote")

  @property
  def needs_attention(self) -> bool:
    return self.base in ATTENTION_METHODS

  @property
  def full_row(self) -> int:
    """The most committed entries a row holds: it is evicted once it would hold one more."""
    return self.budget + self.evict_every - 1

  @property
  def slots(self) -> int:
    """Physical cache slots per row: the budget plus a working block for the newest tokens."""
    return self.budget + max(self.chunk, self.evict_every)

  def within(self, entries: int) -> "KVPolicy":
    """This policy for a run none of whose rows ever commits more than `entries` cache entries
    (the prompt bucket, max_new_tokens and a round's reserve): a budget it cannot fill, or an
    evict_every past what it can reach, evicts exactly as the smallest valid one it cannot (no
    eviction at all), which holds far fewer slots. A budget of 8,192 for a 20-token chat held
    8,208 slots and an evict_every of 100,000 held 100,016, each attended at every step."""
    entries = int(entries)
    budget = self.budget
    if budget >= entries:  # never over the budget: any budget from `entries` on is the same
      budget = max(entries, self.chunk, self.sinks + (self.window or 0) + 1, 2)
    # Due at budget + evict_every entries: past `entries`, every such value never is.
    evict_every = min(self.evict_every, max(1, entries + 1 - budget))
    if (budget, evict_every) == (self.budget, self.evict_every):
      return self
    return dataclasses.replace(self, budget=budget, evict_every=evict_every)


def check_kv(cfg, kv: KVPolicy | None, name: str = "kv") -> None:
  """Host-side, before anything is traced: `kv` is a KVPolicy (or None) whose scores the model's
  attention (cfg.attention_impl) can give."""
  if kv is None:
    return
  if not isinstance(kv, KVPolicy):
    raise TypeError(f"{name} must be a jspec.kv.policy.KVPolicy, got {type(kv).__name__}. Fix: "
                    f"{name}=KVPolicy('keydiff', budget=N)")
  if kv.needs_attention and cfg.attention_impl != "xla":
    raise ValueError(f"{name} policy {kv.method!r} scores slots by attention probabilities, which "
                     f"attention_impl={cfg.attention_impl!r} does not give. Fix: "
                     f"attention_impl='xla', or kv method 'keydiff' (keys only).")
