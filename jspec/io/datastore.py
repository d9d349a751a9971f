"""An n-gram datastore for retrieval drafting (REST, He et al. 2023, arXiv 2311.08252): for every
context of n tokens (n_min <= n <= n_max) seen often enough in a corpus, the token that most
often followed it. The `rest` drafter (jspec.drafting.ngram) looks a context up here where the
prompt-lookup history finds nothing.

REST retrieves from a suffix array and verifies a trie of many continuations; jspec keeps the
retrieval on the device inside the decode loop, so the corpus is summarised once into two sorted
arrays that a binary search reads: `keys` [K] uint32, a hash of (n, context), and `tokens` [K]
int32, the most frequent next token. A draft is deterministic given its prefix, so verification
stays exact at any temperature (as for prompt lookup). A hash collision can only make a draft
wrong (then rejected), never the output: 32-bit keys over a few million contexts make that rare
(about K / 2**32 of the lookups that should miss).

Files are safetensors (`keys`, `tokens`) with the orders, the count threshold, the corpus size
and the SHA-256 of the tokenizer's token strings in the metadata; loading checks the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np

from jspec.io.tokenizer import Tokenizer
from jspec.paths import cache_dir

FORMAT = "jspec-ngram-datastore-1"
# Defaults measured on the default model (benchmarks/README.md, "Retrieval drafting"): orders
# above 3 and singleton contexts add nothing to the acceptance and multiply the table's size.
N_MAX = 3
MIN_COUNT = 8
MAX_ORDER = 8  # the longest context a table keys on (tokens)

_SEED, _PRIME, _MIX1, _MIX2 = 0x9E3779B1, 0x01000193, 0x2C1B3C6D, 0x297A2D39


def context_hash(xp, context) -> "np.ndarray":
  """uint32 hash [...] of context [..., n] (int, oldest token first) and its length n; the same
  bits from numpy (building) and jax.numpy (looking up)."""
  u = xp.uint32
  n = context.shape[-1]
  h = xp.full(context.shape[:-1], (n * _SEED) & 0xFFFFFFFF, dtype=u)
  for i in range(n):
    h = (h ^ context[..., i].astype(u)) * u(_PRIME)
  h = (h ^ (h >> u(15))) * u(_MIX1)
  h = (h ^ (h >> u(12))) * u(_MIX2)
  return h ^ (h >> u(15))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramTable:
  """The datastore on the device: sorted hash keys and the next token of each (see the module
  docstring). n_min/n_max: the context lengths it holds."""

  keys: jax.Array  # [K] uint32, ascending
  tokens: jax.Array  # [K] int32
  n_min: int = dataclasses.field(metadata=dict(static=True))
  n_max: int = dataclasses.field(metadata=dict(static=True))

  @property
  def size(self) -> int:
    return int(self.keys.shape[0])


def check_orders(n_min, n_max, what: str) -> None:
  """The context lengths a datastore keys on: integers 1 <= n_min <= n_max <= MAX_ORDER."""
  integers = all(isinstance(n, numbers.Integral) and not isinstance(n, bool)
                 for n in (n_min, n_max))
  if not (integers and 1 <= n_min <= n_max <= MAX_ORDER):
    raise ValueError(f"{what} holds contexts of {n_min!r}-{n_max!r} tokens; a datastore needs "
                     f"1 <= n_min <= n_max <= {MAX_ORDER}. Fix: build it with jspec "
                     f"build-datastore (or build_table) and load_table")


def build_table(sequences: Iterable[np.ndarray], *, n_min: int = 1, n_max: int = N_MAX,
                min_count: int = MIN_COUNT) -> tuple[np.ndarray, np.ndarray, int]:
  """(keys [K] uint32 sorted, tokens [K] int32, corpus tokens) from token sequences: each context
  of n_min..n_max tokens inside one sequence that occurs >= min_count times, with the token that
  followed it most often (ties: the smallest id)."""
  check_orders(n_min, n_max, "the datastore asked for")
  if min_count < 1:
    raise ValueError(f"min_count must be >= 1, got {min_count}")
  parts = []
  for s in sequences:
    s = np.asarray(s)
    integer = np.issubdtype(s.dtype, np.integer) or (s.size == 0 and s.dtype == np.float64)
    if s.ndim != 1 or not integer or (s.size and (s.min() < 0 or s.max() >= 2**31)):
      raise ValueError(f"datastore sequences are 1-D arrays of integer token ids in [0, 2**31), "
                       f"got one of shape {s.shape} and dtype {s.dtype}"
                       + (f" holding {s.min()}..{s.max()}" if s.size and integer else ""))
    parts += [s.astype(np.int64), np.array([-1])]  # -1 separates sequences
  corpus = np.concatenate(parts) if parts else np.zeros(0, np.int64)
  n_tokens = int((corpus >= 0).sum())
  keys, tokens = [], []
  for n in range(n_min, n_max + 1):
    if corpus.size <= n:
      continue
    windows = np.lib.stride_tricks.sliding_window_view(corpus, n + 1)  # [P, n + 1]
    windows = windows[(windows >= 0).all(axis=1)]
    if not windows.shape[0]:
      continue
    h = context_hash(np, windows[:, :n].astype(np.uint32)).astype(np.uint64)
    pairs, counts = np.unique((h << np.uint64(32)) | windows[:, n].astype(np.uint64),
                              return_counts=True)
    key = pairs >> np.uint64(32)
    order = np.lexsort((-counts, key))  # each key's most frequent next token first
    key, pairs, counts = key[order], pairs[order], counts[order]
    first = np.r_[True, key[1:] != key[:-1]]
    totals = np.add.reduceat(counts, np.flatnonzero(first))
    keep = totals >= min_count
    keys.append(key[first][keep].astype(np.uint32))
    tokens.append((pairs[first][keep] & np.uint64(0xFFFFFFFF)).astype(np.int32))
  keys = np.concatenate(keys) if keys else np.zeros(0, np.uint32)
  tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
  order = np.argsort(keys, kind="stable")  # distinct orders hash apart; a collision keeps one
  keys, tokens = keys[order], tokens[order]
  unique = np.ones(keys.size, bool)
  unique[1:] = keys[1:] != keys[:-1]
  return keys[unique], tokens[unique], n_tokens


def save_table(path: str | Path, keys: np.ndarray, tokens: np.ndarray, *, n_min: int, n_max: int,
               min_count: int, corpus_tokens: int, tokenizer: Tokenizer, source: str) -> Path:
  import safetensors.numpy
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  meta = dict(format=FORMAT, n_min=n_min, n_max=n_max, min_count=min_count,
              corpus_tokens=corpus_tokens, vocab_size=tokenizer.vocab_size,
              tokenizer_sha256=tokenizer.fingerprint, source=source)
  # A name of this process's own: two processes building the same table (the default one, on
  # first use) each write their file whole, and the last rename wins with the same content.
  tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
  try:
    safetensors.numpy.save_file({"keys": keys, "tokens": tokens}, str(tmp),
                                metadata={k: json.dumps(v) for k, v in meta.items()})
    tmp.replace(path)
  finally:
    tmp.unlink(missing_ok=True)
  return path


def read_metadata(path: str | Path) -> dict:
  from safetensors import safe_open
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no datastore at {path}. Fix: build one with `jspec build-datastore "
                            f"--out {path}`, or use `--drafter rest` for the default one")
  try:
    with safe_open(str(path), framework="numpy") as f:
      meta = f.metadata() or {}
  except Exception as e:  # a text file, a truncated download: say which file
    raise ValueError(f"{path} is not a safetensors datastore ({e})") from None
  if meta.get("format") != json.dumps(FORMAT):  # compared as text: others' metadata is not JSON
    raise ValueError(f"{path} is not a jspec n-gram datastore (format "
                     f"{meta.get('format')!r}, expected {FORMAT!r}); build one with "
                     f"`jspec build-datastore`")
  return {k: json.loads(v) for k, v in meta.items()}


def load_table(path: str | Path, tokenizer: Tokenizer, vocab_size: int) -> NgramTable:
  """The datastore at `path` for a target with this tokenizer and vocabulary size; refused with
  the fix when it was built for another tokenizer."""
  import safetensors.numpy
  meta = read_metadata(path)
  if meta["tokenizer_sha256"] != tokenizer.fingerprint:
    raise ValueError(f"datastore {path} was built with another tokenizer ({meta['vocab_size']} "
                     f"tokens, from {meta['source']}): its drafts would mean other strings. Fix: "
                     f"build one for this target with `jspec build-datastore --model ...`")
  arrays = safetensors.numpy.load_file(str(path))
  keys, tokens = arrays["keys"], arrays["tokens"]
  if keys.dtype != np.uint32 or tokens.dtype != np.int32 or keys.shape != tokens.shape or (
      keys.size and (np.any(keys[1:] < keys[:-1]) or tokens.min() < 0
                     or tokens.max() >= vocab_size)):
    raise ValueError(f"datastore {path} is damaged (keys must be sorted uint32, tokens int32 ids "
                     f"< {vocab_size}); rebuild it with `jspec build-datastore`")
  if keys.size == 0:
    raise ValueError(f"datastore {path} is empty; rebuild it from more text or a lower "
                     f"--min-count")
  return NgramTable(keys=jax.numpy.asarray(keys), tokens=jax.numpy.asarray(tokens),
                    n_min=int(meta["n_min"]), n_max=int(meta["n_max"]))


def sharegpt_sequences(tokenizer: Tokenizer, path: str | Path | None = None,
                       progress: bool = True) -> list[np.ndarray]:
  """The assistant turns of every ShareGPT conversation whose first human turn overlaps no
  evaluation prompt (jspec.data.eval_prompts), tokenized without special tokens."""
  from jspec import data
  overlaps = data.Overlap(data.normalise(t) for t in data.eval_prompts())
  texts, start = [], time.time()
  for conversation in data.sharegpt_turns(path):
    first = conversation[0] if conversation else ("", "")
    if first[0] == "human" and overlaps(data.normalise(first[1])):
      continue
    texts += [text for who, text in conversation if who == "gpt"]
  encoded = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
  if progress:
    print(f"jspec: tokenized {len(texts)} ShareGPT answers in {time.time() - start:.0f} s",
          file=sys.stderr)
  return [np.asarray(e.ids, np.int64) for e in encoded]


def default_table_path(tokenizer: Tokenizer, n_max: int = N_MAX, min_count: int = MIN_COUNT
                       ) -> Path:
  return (cache_dir() / "datastores"
          / f"sharegpt-{FORMAT}-{tokenizer.fingerprint[:16]}-n1-{n_max}-c{min_count}"
          f".safetensors")  # a new format builds a new file


def write_table(out: str | Path, sequences: Iterable[np.ndarray], tokenizer: Tokenizer,
                source: str, *, n_max: int = N_MAX, min_count: int = MIN_COUNT
                ) -> tuple[Path, int, int]:
  """Build the datastore of `sequences` and save it: (path, contexts, corpus tokens). An empty
  table is refused with the fix."""
  keys, tokens, n_tokens = build_table(sequences, n_max=n_max, min_count=min_count)
  if not keys.size:
    raise ValueError(f"no context of 1-{n_max} tokens occurs {min_count} times in {n_tokens} "
                     f"tokens: give more text or a lower --min-count")
  out = save_table(out, keys, tokens, n_min=1, n_max=n_max, min_count=min_count,
                   corpus_tokens=n_tokens, tokenizer=tokenizer, source=source)
  return out, int(keys.size), n_tokens


def _is_default(meta: dict) -> bool:
  """Whether a datastore's metadata says it is the default one (ShareGPT, default settings)."""
  return (meta.get("source"), meta.get("n_max"), meta.get("min_count")) == (
      "sharegpt", N_MAX, MIN_COUNT)


def default_table(tokenizer: Tokenizer, vocab_size: int, progress: bool = True) -> NgramTable:
  """The ShareGPT datastore for this tokenizer, built once (a few minutes) into the cache."""
  path = default_table_path(tokenizer)
  if path.is_file() and not _is_default(read_metadata(path)):
    if progress:  # written by an older jspec's build-datastore from another source: replaced
      print(f"jspec: {path} was not built from ShareGPT with the default settings; building "
            f"it again", file=sys.stderr)
    path.unlink()
  if not path.is_file():
    if progress:
      print(f"jspec: building the n-gram datastore for this tokenizer from ShareGPT (once, into "
            f"{path.parent}) ...", file=sys.stderr)
    start = time.time()
    _, contexts, n_tokens = write_table(path, sharegpt_sequences(tokenizer, progress=progress),
                                        tokenizer, "sharegpt")
    if progress:
      print(f"jspec: datastore of {contexts} contexts from {n_tokens} ShareGPT tokens written to "
            f"{path} ({time.time() - start:.0f} s)", file=sys.stderr)
  return load_table(path, tokenizer, vocab_size)
