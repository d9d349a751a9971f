"""Streaming: a run's tokens as they are made, the same tokens as the one-program run.

Each engine's program is split at its `lax.while_loop`: one program prefills and samples the first
token (`Segmented.start`), another runs the same loop body from a given state until all rows are
done or `every` more iterations have run (`Segmented.resume`, the state donated so the KV caches
update in place). The host reads each segment's new tokens while the next one runs. The state
carries the PRNG key, so a streamed run draws exactly what the whole run draws: greedy or sampled,
the tokens are equal (tests/test_streaming.py). A segment costs one dispatch and a copy of the
[B, N] token buffer; measured against the whole run in benchmarks/streaming.py.

Under jax.distributed every process iterates the same stream in lockstep (each read gathers the
rows other processes' devices hold: a collective all of them join) and reads every row; a row
halted must be halted by every process.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jspec.decode import is_int
from jspec.models.cache import KVCache
from jspec.sharding import to_host

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


def stream_program(engine: Callable) -> Callable:
  """An engine's start or segment program (taking `placement=`) whose returned state, on a mesh,
  is pinned row by row: every array whose axis 0 is the batch split over the batch rule, the
  others replicated, the KV caches as their engine pinned them. Left to itself XLA gives each
  program's outputs shardings of its own (the start's `done` and `lengths` replicated, a
  segment's split over dp), so the second segment, reading a segment's state, compiled the
  segment program again."""

  @functools.wraps(engine)
  def run(*args, placement=None, **kwargs):
    out = engine(*args, placement=placement, **kwargs)
    if placement is None:
      return out
    batch = (out[0] if isinstance(out, tuple) else out).lengths.shape[0]  # a segment: (state, view)

    def pin(leaf):
      if isinstance(leaf, KVCache):
        return leaf
      if leaf.ndim and leaf.shape[0] == batch:
        return jax.lax.with_sharding_constraint(leaf, placement.batch_sharding(leaf.ndim))
      return placement.replicated(leaf)

    return jax.tree.map(pin, out, is_leaf=lambda x: isinstance(x, KVCache))

  return run


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
    # No segment needs more iterations than there are tokens; a larger int32 `step + every`
    # wrapped negative and every segment ran none.
    self._run, self._every, self._owners = run, min(int(every), run.max_new_tokens), owners
    self._halted: np.ndarray | None = None  # [B] rows the reader has stopped (`halt`)
    self.output = None

  def halt(self, rows) -> None:
    """Stop generating for these rows (indices; e.g. a stop string appeared in their text): they
    are marked done in the state of the next segment dispatched, and the run ends once every row
    is done or halted. Until then a halted row may gain up to two segments' tokens (the one being
    read and the one queued behind it), which `output` keeps and the iteration still yields.
    Under jax.distributed every process must halt the same rows at the same point."""
    if self._halted is None or self.output is not None:
      raise RuntimeError("halt() stops rows of a run while it is iterated: "
                         + ("start iterating first" if self._halted is None else
                            "this run has ended"))
    rows = np.asarray(rows)
    if rows.size == 0:
      return
    B = len(self._halted)
    if rows.dtype == bool or not np.issubdtype(rows.dtype, np.integer) or np.any(
        (rows < 0) | (rows >= B)):
      raise ValueError(f"halt takes row indices in [0, {B}), got {rows.tolist()!r}")
    self._halted[rows] = True

  def __iter__(self) -> Iterator[list[list[int]]]:
    run, every = self._run, jnp.int32(self._every)
    state = _unshared(run.start(), self._owners)
    sent = np.zeros(state.lengths.shape, np.int32)
    self._halted = np.zeros(state.lengths.shape, bool)
    applied = self._halted.copy()  # halted rows already marked done in the state
    current = jax.device_get(readable(view(state)))  # the first token (before it is donated)
    pending = None if current[2].all() else run.resume(state, every)
    while True:
      tokens, lengths, done = current
      lengths = np.minimum(lengths, run.max_new_tokens)
      new = [tokens[row, sent[row]:lengths[row]].tolist() for row in range(len(lengths))]
      sent = lengths
      if any(new):
        yield new
      if (done | self._halted).all():
        if pending is None:
          self.output = readable(run.finish(state))
          return
        state, segment = pending  # the segment queued behind this one: its tokens are yielded too
        pending = None
        current = jax.device_get(readable(segment))
        continue
      state, segment = pending
      if (self._halted & ~applied).any():  # newly stopped rows: done from the next segment on
        applied = self._halted.copy()  # done stays set in the state: sent to the device once
        # As `done` is placed: one process's uncommitted array stays uncommitted (a committed one
        # keys another compile of the segment program); across processes, each its own shards.
        halted = jnp.asarray(applied) if jax.process_count() == 1 else (
            jax.make_array_from_callback(applied.shape, state.done.sharding,
                                         lambda i, a=applied: a[i]))
        state = dataclasses.replace(state, done=state.done | halted)
      pending = run.resume(state, every)  # queued behind this segment, read meanwhile
      current = jax.device_get(readable(segment))


def readable(tree):
  """tree with every array that spans devices of other processes (jax.distributed) and is not
  whole on each made whole on every device of its mesh (an array without a mesh: gathered to a
  host copy), so that this process can read it; as it is in one process. Every process must call
  it (a collective: one a mesh, whatever the number of arrays)."""
  if jax.process_count() == 1:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  by_mesh = {}  # mesh -> indices of the leaves to make whole on it
  for i, x in enumerate(leaves):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      if isinstance(x.sharding, NamedSharding):
        by_mesh.setdefault(x.sharding.mesh, []).append(i)
      else:
        leaves[i] = to_host(x)
  for mesh, indices in by_mesh.items():
    for i, whole in zip(indices, _replicator(mesh)([leaves[i] for i in indices])):
      leaves[i] = whole
  return jax.tree.unflatten(treedef, leaves)


@functools.cache
def _replicator(mesh) -> Callable:
  return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


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
  to the text of the whole run (`RowText`), cut before the first of the `stop` strings
  (`StopAt`): a row whose text reached one stops generating (`TokenStream.halt`), and the run
  ends when every row has stopped, by a stop string, a stop id or its token budget."""

  def __init__(self, tokens: TokenStream, decode: Callable[[list[int]], str], single: bool,
               stop: tuple[str, ...] = ()):
    self._tokens, self._decode, self._single = tokens, decode, single
    self._stop = check_stop(stop)
    self.stopped: list[bool] = []  # per row, once iterated: its text was cut at a stop string

  @property
  def output(self):
    return self._tokens.output

  def __iter__(self) -> Iterator[str | list[str]]:
    rows: list[RowText] = []
    cuts: list[StopAt] = []
    for new in self._tokens:
      rows = rows or [RowText(self._decode) for _ in new]
      cuts = cuts or [StopAt(self._stop) for _ in new]
      pieces = ["" if cut.stopped else cut.add(row.add(more))
                for row, cut, more in zip(rows, cuts, new)]
      stopped = [i for i, cut in enumerate(cuts) if cut.stopped]
      if stopped:
        self._tokens.halt(stopped)
      if any(pieces):
        yield pieces[0] if self._single else pieces
    pieces = ["" if cut.stopped else cut.add(row.finish()) + cut.flush()
              for row, cut in zip(rows, cuts)]
    self.stopped = [cut.stopped for cut in cuts]
    if any(pieces):
      yield pieces[0] if self._single else pieces


def check_stop(stop) -> tuple[str, ...]:
  """Host-side: stop strings as a tuple (one str is one stop string; None or () none)."""
  if stop is None:
    return ()
  stop = (stop,) if isinstance(stop, str) else stop
  if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
    raise ValueError(f"stop_strings must be a non-empty string or a list of them (text that ends "
                     f"an answer, cut before it), got {stop!r}. Fix: stop_strings=['\\n\\n'] "
                     f"(token ids that end an answer: the tokenizer's stop ids, stop=True)")
  return tuple(stop)


class StopAt:
  """One row's text pieces cut before the earliest-starting occurrence of any stop string. Text
  from where a stop string might still begin (the tail ends with a stop string's prefix) is held
  back until later pieces settle it, and so is a complete stop string while a longer one that
  would start before it is still open: so text given out never turns out to hold part of a stop
  string, and the pieces join to the whole text cut at its first stop string, wherever the pieces
  split it (one piece or a character at a time alike)."""

  def __init__(self, stop: tuple[str, ...]):
    self.stop, self.held, self.stopped = stop, "", False

  def add(self, piece: str) -> str:
    if self.stopped:
      return ""
    text = self.held + piece
    hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
    # Where the earliest stop string still open could begin: the longest tail that a stop string
    # starts with (and is not all of).
    keep = max((k for s in self.stop for k in range(1, min(len(s), len(text) + 1))
                if text.endswith(s[:k])), default=0)
    open_at = len(text) - keep
    if hits and min(hits) <= open_at:  # nothing still open could start before it
      self.stopped, self.held = True, ""
      return text[:min(hits)]
    self.held = text[open_at:]
    return text[:open_at]

  def flush(self) -> str:
    """What is held back, once the row has ended: up to a complete stop string in it, if any."""
    held, self.held = ("" if self.stopped else self.held), ""
    hits = [i for i in (held.find(s) for s in self.stop) if i >= 0]
    if hits:
      self.stopped = True
      return held[:min(hits)]
    return held


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
    if not more:  # the window stays: a SentencePiece decode drops a first token's space
      return ""
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
