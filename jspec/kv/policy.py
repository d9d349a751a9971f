"""The static settings of an evicting KV cache (a hashable config, passed as a static argument)."""

from __future__ import annotations

import dataclasses

# Methods that score slots from the cached keys alone (or their positions): they work with any
# attention kernel. Attention-score methods (H2O, TOVA, SnapKV, CAOTE on top) come with the
# attention statistics the model forward will report.
METHODS = ("keydiff", "streaming")


@dataclasses.dataclass(frozen=True)
class KVPolicy:
  """Keep `budget` committed cache slots per row (in every layer and KV head).

  method: "keydiff" (keep the keys least similar to the mean key of their layer and head) or
    "streaming" (StreamingLLM: the `sinks` first tokens and the most recent ones).
  sinks: the first positions, never evicted (attention sinks).
  window: the most recent committed slots, never evicted.
  chunk: prompt tokens per prefill block; eviction follows each block.
  evict_every: decoding steps between evictions (1: the cache never holds more than budget + 1).
  """

  method: str
  budget: int
  sinks: int = 4
  window: int = 0
  chunk: int = 128
  evict_every: int = 1

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"unknown KV eviction method {self.method!r}; jspec has {METHODS}")
    for name in ("budget", "chunk", "evict_every"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"KVPolicy {name} must be a positive integer, got {value!r}")
    for name in ("sinks", "window"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"KVPolicy {name} must be a non-negative integer, got {value!r}")
    if self.budget <= self.sinks + self.window:
      raise ValueError(
          f"kv budget {self.budget} leaves no slot to choose: it must exceed sinks + window = "
          f"{self.sinks} + {self.window}. Fix: raise the budget or lower sinks/window.")
    if self.chunk > self.budget:
      raise ValueError(f"prefill chunk {self.chunk} is larger than the kv budget {self.budget}: "
                       f"a chunk must fit the budget. Fix: chunk <= budget.")

  @property
  def slots(self) -> int:
    """Physical cache slots per row: the budget plus a working block for the newest tokens."""
    return self.budget + max(self.chunk, self.evict_every)
