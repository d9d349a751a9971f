"""Streaming: a run's tokens as they are made, the same tokens as the one-program run.

Each engine's program is split at its `lax.while_loop`: one program prefills and samples the first
token (`Segmented.start`), another runs the same loop body from a given state until all rows are
done or `every` more iterations have run (`Segmented.resume`, the state donated so the KV caches
update in place). The host reads each segment's new tokens while the next one runs. The state
carries the PRNG key, so a streamed run draws exactly what the whole run draws: greedy or sampled,
the tokens are equal (tests/test_streaming.py). A segment costs one dispatch and a copy of the
[B, N] token buffer; measured against the whole run in benchmarks/streaming.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jspec.decode import is_int

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Segmented:
  """A validated, placed run, split at its loop (what the engines' `*_stream` functions build).

  start() -> state; resume(state, every) -> (state, view): the loop run on for `every` ([] int32)
  more iterations or until every row is done, and `view` of the result in buffers of its own;
  finish(state) -> the run's output (as the whole run returns); max_new_tokens: the token
  buffer's useful width.
  """

  start: Callable[[], Any]
  resume: Callable[[Any, Array], tuple[Any, tuple[Array, Array, Array]]]
  finish: Callable[[Any], Any]
  max_new_tokens: int


def view(state) -> tuple[Array, Array, Array]:
  """What the host reads between segments: tokens [B, N'], lengths [B], done [B]."""
  return state.tokens, state.lengths, state.done


class TokenStream:
  """Iterate for each segment's new token ids, a list per row (empty for a row with none new);
  `output` is the run's output (GenerateOutput, SpecOutput, ...) once the iteration has ended.

  The next segment is dispatched before the last one's tokens are read, so the device works while
  the host reads and decodes (each segment's view is its own buffers: the state is donated)."""

  def __init__(self, run: Segmented, every: int, owners: Any = ()):
    if not is_int(every) or every < 1:
      raise ValueError(f"every (loop iterations between reads) must be an integer >= 1, got "
                       f"{every!r}")
    if jax.process_count() > 1:
      raise ValueError("streaming reads every row on this host; with several processes run the "
                       "whole program (generate, speculative_generate) instead")
    self._run, self._every, self._owners = run, int(every), owners
    self.output = None

  def __iter__(self) -> Iterator[list[list[int]]]:
    run, every = self._run, jnp.int32(self._every)
    state = _unshared(run.start(), self._owners)
    sent = np.zeros(state.lengths.shape, np.int32)
    current = jax.device_get(view(state))  # the first token (before the state is donated)
    pending = None if current[2].all() else run.resume(state, every)
    while True:
      tokens, lengths, done = current
      lengths = np.minimum(lengths, run.max_new_tokens)
      new = [tokens[row, sent[row]:lengths[row]].tolist() for row in range(len(lengths))]
      sent = lengths
      if any(new):
        yield new
      if done.all():
        self.output = run.finish(state if pending is None else pending[0])
        return
      state, segment = pending
      pending = run.resume(state, every)  # queued behind this segment, read meanwhile
      current = jax.device_get(segment)


def _unshared(state, owners):
  """The state with any leaf that shares a buffer with `owners`' arrays (the params, a drafter's
  weights: a program may hand an input back as an output) copied: `resume` donates the state,
  which must not free the caller's arrays."""
  theirs = set().union(*map(_buffers, jax.tree.leaves(owners)))
  return jax.tree.map(lambda leaf: jnp.copy(leaf) if _buffers(leaf) & theirs else leaf, state)


def _buffers(leaf) -> set[int]:
  if not isinstance(leaf, jax.Array):
    return set()
  return {shard.data.unsafe_buffer_pointer() for shard in leaf.addressable_shards}


class TextStream:
  """Iterate for each segment's new text: a str (one prompt given as a str) or a list of str, a
  row each ("" for a row with nothing new); `output` once the iteration has ended. The pieces join
  to the text of the whole run (`RowText`)."""

  def __init__(self, tokens: TokenStream, decode: Callable[[list[int]], str], single: bool):
    self._tokens, self._decode, self._single = tokens, decode, single

  @property
  def output(self):
    return self._tokens.output

  def __iter__(self) -> Iterator[str | list[str]]:
    rows: list[RowText] = []
    for new in self._tokens:
      rows = rows or [RowText(self._decode) for _ in new]
      pieces = [row.add(more) for row, more in zip(rows, new)]
      if any(pieces):
        yield pieces[0] if self._single else pieces
    pieces = [row.finish() for row in rows]
    if any(pieces):
      yield pieces[0] if self._single else pieces


class RowText:
  """One row's text as its tokens come, decoding only the newest ones: a piece is what they add to
  the decoded text of the window that starts at the previous piece's tokens (so a tokenizer that
  treats a sequence's first token apart does so on both sides), held back while it ends inside a
  character (a multi-byte character split over tokens). Decoding the whole row each time would
  cost time quadratic in its length. `finish` checks against the whole row decoded once."""

  def __init__(self, decode: Callable[[list[int]], str]):
    self.decode, self.ids, self.sent = decode, [], ""
    self.start = self.read = 0  # the window ids[start:], of which ids[start:read] are sent

  def add(self, more: list[int]) -> str:
    self.ids += more
    before = self.decode(self.ids[self.start:self.read])
    after = self.decode(self.ids[self.start:])
    if not after.startswith(before) or after.endswith("\ufffd"):
      return ""
    piece = after[len(before):]
    self.start, self.read, self.sent = self.read, len(self.ids), self.sent + piece
    return piece

  def finish(self) -> str:
    return self.decode(self.ids)[len(self.sent):]
