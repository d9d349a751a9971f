"""Training prompts for draft-model distillation: ShareGPT first human turns, disjoint from the
evaluation prompts (MT-Bench, HumanEval).

The ShareGPT reader and the overlap with the evaluation prompts live in jspec.data (the n-gram
datastore reads them too).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterable
from pathlib import Path

from jspec.data import Overlap, eval_prompts, iter_sharegpt, normalise
from jspec.io.fetch import SHAREGPT, fetch

MAX_CHARS = 4000  # longer first turns (~7% of them) are mostly pasted documents, logs or code


def training_prompts(n: int, *, seed: int = 0, max_chars: int = MAX_CHARS,
                     exclude: Iterable[str] | None = None, path: str | Path | None = None,
                     stats: collections.Counter | None = None) -> list[str]:
  """Up to `n` distinct ShareGPT first human turns of at most `max_chars` characters, shuffled by
  `seed`, none overlapping a text in `exclude` (default: eval_prompts()).

  Prompts are stripped; duplicates (after `normalise`) keep their first occurrence. Overlap means
  equal after `normalise`, or one containing the other where both have >= MIN_OVERLAP_CHARS
  characters. `path=None` fetches SHAREGPT. `stats`, when given, also counts "too_long",
  "duplicate", "excluded" and "kept" (before the cut to `n`).
  Example: `training_prompts(1000, seed=0)`.
  """
  stats = collections.Counter() if stats is None else stats
  overlaps = Overlap(normalise(t) for t in (eval_prompts() if exclude is None else exclude))
  seen, kept = set(), []
  for _, text in iter_sharegpt(fetch(SHAREGPT) if path is None else path, stats):
    text = text.strip()
    key = normalise(text)
    if len(text) > max_chars:
      stats["too_long"] += 1
    elif key in seen:
      stats["duplicate"] += 1
    elif overlaps(key):
      seen.add(key)
      stats["excluded"] += 1
    else:
      seen.add(key)
      kept.append(text)
  stats["kept"] = len(kept)
  random.Random(seed).shuffle(kept)
  return kept[:n]
