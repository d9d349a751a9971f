"""What a command stamps on its results (the command line that ran, the time), its progress lines
on stderr, and the benchmark prompt sets it reads, as token ids."""

from __future__ import annotations

import shlex
import sys
from datetime import datetime, timezone


_ARGV: list[str] | None = None  # what main() was given (None: the process's own arguments)


def set_command_line(argv: list[str] | None) -> None:
  """Record the arguments main() was given (None: the process's own)."""
  global _ARGV
  _ARGV = None if argv is None else [str(a) for a in argv]


def command_line() -> str:
  """The command line being run, for the records and metadata that say how they were made."""
  return shlex.join(["jspec"] + (sys.argv[1:] if _ARGV is None else _ARGV))  # runnable again


def stamp_records(records: list[dict]) -> str:
  """Mark benchmark records with the UTC time and the command that made them; returns the time."""
  stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  for r in records:
    r["timestamp"] = stamp
    r["command"] = command_line()
  return stamp


def dataset_prompts(model, dataset: str, n: int | None) -> list[list[int]]:
  """The first n prompts of a benchmark set as token ids, chat-templated where the set is chat."""
  from jspec import data
  chat = data.is_chat(dataset) and model.tokenizer.chat_template is not None
  texts = data.load_prompts(dataset, n)
  if n is not None and len(texts) < n:
    print(f"[jspec] note: {dataset} holds {len(texts)} prompts; running all of them "
          f"(--num-prompts {n})", file=sys.stderr)
  return [model.encode(t, chat=chat) for t in texts]


def progress(line: str) -> None:
  """A progress line on stderr (records and tables go to stdout)."""
  print(f"jspec bench: {line}", file=sys.stderr, flush=True)
