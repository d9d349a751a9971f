"""Streaming (jspec.streaming): a streamed run yields the tokens the one-program run makes, as it
makes them, for every engine, greedy and sampled, under a KV budget; its programs compile once;
the caller's arrays survive the donated state; text pieces join to the whole text."""

import threading

import jax
import numpy as np
import pytest

from jspec.bench.profiling import CompileCounter
from jspec.drafting.model import ModelDrafter
from jspec.generate import generate, generate_stream
from jspec.kv.policy import KVPolicy
from jspec.model import Model
from jspec.streaming import StopAt
from jspec.models.config import Config
from jspec.models.llama import init_params
from jspec.sampling.processing import SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate, speculative_generate_stream
from jspec.speculative.tree import (TreeSpecConfig, tree_speculative_generate,
                                    tree_speculative_generate_stream)
from tiny_drafters import perturbed_drafter
from tiny_models import SMALL

CFG = SMALL
PROMPTS = [[5, 17, 3, 44, 2, 9, 61], [8, 1, 30]]
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def drafter(params):
  return perturbed_drafter(params, CFG, 0.5)


def joined(stream) -> tuple[list[list[int]], list[list[list[int]]]]:
  """(each row's ids joined over the stream, the segments as yielded)."""
  segments = list(stream)
  rows = [sum((segment[row] for segment in segments), []) for row in range(len(PROMPTS))]
  return rows, segments


def assert_same_output(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("every", [1, 3])
def test_autoregressive_stream_is_the_whole_run(params, sampling, every):
  kw = dict(max_new_tokens=12, sampling=sampling, key=7, stop_ids=(3,))
  want = generate(params, CFG, PROMPTS, **kw)
  stream = generate_stream(params, CFG, PROMPTS, every=every, **kw)
  assert stream.output is None
  rows, segments = joined(stream)
  assert rows == want.sequences()
  assert_same_output(stream.output, want)
  # The first segment is the prefill's token alone; then `every` tokens a row at most.
  assert segments[0] == [[t[0]] for t in want.sequences()]
  assert max(len(row) for segment in segments[1:] for row in segment) <= every
  assert len(segments) > 1


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_chain_stream_is_the_whole_run(params, drafter, sampling):
  kw = dict(spec=SpecConfig(gamma=3, max_new_tokens=14), sampling=sampling, key=3)
  want = speculative_generate(params, CFG, drafter, PROMPTS, **kw)
  stream = speculative_generate_stream(params, CFG, drafter, PROMPTS, **kw)
  rows, segments = joined(stream)
  assert rows == want.sequences()
  assert_same_output(stream.output, want)
  assert len(segments) == int(want.rounds) + 1  # the first token, then one segment a round
  assert int(want.round_tokens) > int(want.row_rounds)  # some rounds accepted drafts


def test_tree_stream_under_a_kv_budget_is_the_whole_run(params, drafter):
  kv = KVPolicy("keydiff", budget=16, sinks=2, chunk=8, evict_every=4)
  kw = dict(spec=TreeSpecConfig("fixed:2-2-1", max_new_tokens=12), sampling=SAMPLED, key=5,
            kv=kv)
  want = tree_speculative_generate(params, CFG, drafter, [[1] * 30, [2, 3, 4]], **kw)
  stream = tree_speculative_generate_stream(params, CFG, drafter, [[1] * 30, [2, 3, 4]],
                                            every=2, **kw)
  rows, _ = joined(stream)
  assert rows == want.sequences()
  assert_same_output(stream.output, want)


def test_streams_compile_once_and_leave_the_callers_arrays(params, drafter):
  kw = dict(spec=SpecConfig(gamma=2, max_new_tokens=8))
  list(speculative_generate_stream(params, CFG, drafter, PROMPTS, **kw))
  list(generate_stream(params, CFG, PROMPTS, max_new_tokens=6))
  with CompileCounter() as compiled:  # other prompts of the same bucket, another key
    stream = speculative_generate_stream(params, CFG, drafter, [[9, 9, 9], [4]], key=1, **kw)
    list(stream)
    list(generate_stream(params, CFG, [[7, 7], [1, 2, 3, 4]], max_new_tokens=6, key=2))
  assert compiled.compiles == 0, compiled.compiles
  # The resumed states were donated; the params and the drafter's weights were not.
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((params, drafter)))
  assert stream.output.sequences() == speculative_generate(
      params, CFG, drafter, [[9, 9, 9], [4]], key=1, **kw).sequences()


def test_bad_settings_are_refused_before_anything_runs(params):
  with pytest.raises(ValueError, match="every .* integer >= 1"):
    generate_stream(params, CFG, PROMPTS, max_new_tokens=4, every=0)
  with pytest.raises(ValueError, match="token id"):  # generate's own checks, at the call
    generate_stream(params, CFG, [[1, 500]], max_new_tokens=4)


class ByteTokenizer:
  """Token ids are UTF-8 bytes: a character of several bytes spans several tokens."""
  stop_token_ids = ()

  def encode(self, text, add_special_tokens=True):
    return list(text.encode("utf-8"))

  def decode(self, ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_pieces_join_to_the_whole_text_and_never_split_a_character():
  cfg = Config(arch="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
               num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256)
  model = Model(cfg=cfg, params=init_params(cfg, jax.random.key(4), scale=0.5),
                tokenizer=ByteTokenizer(), source="test")
  # Sampling draws the bytes of multi-byte characters (and invalid ones) along the way.
  kw = dict(chat=False, max_new_tokens=40, sampling=SamplingParams(temperature=1.0), key=11)
  want = model.generate_text(["héllo", "→"], **kw)
  stream = model.stream_text(["héllo", "→"], **kw)
  pieces = list(stream)
  assert ["".join(p[row] for p in pieces) for row in range(2)] == want
  held = [p[row] for p in pieces[:-1] for row in range(2)]
  assert not any(piece.endswith("\ufffd") for piece in held)
  ids = stream.output.sequences()
  assert any(b >= 0x80 for row in ids for b in row)  # the bytes did include non-ASCII ones
  one = list(model.stream_text("héllo", **kw))
  assert all(isinstance(piece, str) for piece in one) and "".join(one) == want[0]


def test_a_state_sharing_the_callers_buffers_is_copied_before_donation(params):
  from jspec.streaming import _buffers, _unshared
  own = jax.numpy.ones(3)
  state = _unshared({"shared": params.embed, "own": own}, params)
  assert state["own"] is own
  assert not _buffers(state["shared"]) & _buffers(params.embed)
  np.testing.assert_array_equal(state["shared"], params.embed)


@pytest.mark.parametrize("stop, pieces, want", [
    (("\n\n",), ["a\n", "\nb"], "a"),  # split over two pieces
    (("\n\n",), ["a\n", "b\n", "\n"], "a\nb"),  # a held prefix that was not one
    (("ND", "END"), ["xE", "N", "D y"], "x"),  # the earliest start wins, whatever the order
    (("abc",), ["ab", "ab", "abc"], "abab"),  # a held prefix that restarts
    (("zz",), ["no", " stop"], "no stop"),  # never: everything, the held tail flushed at the end
    (("abc", "b"), ["ab", "c"], ""),  # "b" completes first, but "abc" starts earlier
    (("abc", "b"), ["xab"], "xa"),  # ... and when the row ends before "abc" could complete
    (("he",), ["hello"], ""),  # a stop string opening the answer
])
def test_stop_strings_cut_wherever_the_pieces_split_them(stop, pieces, want):
  cut = StopAt(stop)
  out = [cut.add(p) for p in pieces]
  assert "".join(out) + cut.flush() == want
  assert cut.stopped == (want != "".join(pieces))
  for given in out:  # nothing given out holds a stop string's start that turned out to be one
    assert not any(s in given for s in stop)


def test_stop_strings_cut_the_same_however_the_text_is_split():
  """Random texts and stop strings (overlapping, nested, repeated letters), fed whole, a character
  at a time and in random pieces: always the whole text cut at its earliest stop string."""
  rng = np.random.default_rng(0)
  word = lambda n: "".join(rng.choice(list("ab\n"), n))
  for _ in range(400):
    text = word(int(rng.integers(0, 14)))
    stop = tuple(word(int(rng.integers(1, 4))) for _ in range(int(rng.integers(1, 4))))
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    want = text[:min(hits)] if hits else text
    bounds = sorted(set(rng.integers(0, len(text) + 1, 3).tolist()) | {0, len(text)})
    for pieces in ([text], list(text), [text[a:b] for a, b in zip(bounds, bounds[1:])]):
      cut = StopAt(stop)
      assert "".join(cut.add(p) for p in pieces) + cut.flush() == want, (text, stop, pieces)
      assert cut.stopped == bool(hits)


@pytest.mark.parametrize("drafter_on", [False, True], ids=["autoregressive", "chain"])
def test_stop_strings_end_each_row_early_at_its_text(drafter_on):
  cfg = Config(arch="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
               num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=512)
  params = init_params(cfg, jax.random.key(4), scale=0.5)
  model = Model(cfg=cfg, params=params, tokenizer=ByteTokenizer(), source="test")
  kw = dict(chat=False, max_new_tokens=120, sampling=SamplingParams(temperature=1.0), key=3)
  if drafter_on:
    kw["drafter"] = ModelDrafter(params, cfg)  # the target itself: every draft accepted
  prompts = ["héllo", "abc"]
  full = model.generate_text(prompts, **kw)
  # A stop string from each row's own text: three characters from its 41st (three tokens at
  # least: the tokenizer's are bytes); rows stop at different places.
  stops = [text[40:43] for text in full]
  assert all(len(s) == 3 for s in stops)
  want = [text[:min(i for i in (text.find(s) for s in stops) if i >= 0)] for text in full]
  assert want[0] != full[0] and want[1] != full[1]
  assert model.generate_text(prompts, stop_strings=stops, **kw) == want
  stream = model.stream_text(prompts, every=2, stop_strings=stops, **kw)
  pieces = list(stream)
  assert ["".join(p[row] for p in pieces) for row in range(2)] == want
  # Rows halted soon after their stop string: the run did not go on to the token budget.
  assert int(stream.output.lengths.max()) < 120
  assert int(stream.output.lengths.max()) <= max(len(w.encode()) for w in want) + 4 * (
      5 if drafter_on else 1) + 3
  one = model.generate_text(prompts[0], stop_strings=stops[0], **kw)
  assert one == [full[0][:full[0].index(stops[0])]]


@pytest.mark.parametrize("bad", ["", [""], ["x", 3], b"x", 7])
def test_bad_stop_strings_are_refused(bad):
  model = Model(cfg=CFG, params=None, tokenizer=ByteTokenizer(), source="test")
  with pytest.raises(ValueError, match="stop_strings must be a non-empty string"):
    model.generate_text("x", stop_strings=bad)
  with pytest.raises(ValueError, match="stop_strings must be a non-empty string"):
    model.stream_text("x", stop_strings=bad)


def test_the_text_api_refuses_ids_and_empty_lists():
  model = Model(cfg=CFG, params=None, tokenizer=ByteTokenizer(), source="test")
  for call in (model.generate_text, model.stream_text):
    with pytest.raises(TypeError, match="take texts, got a list among the prompts.*generate_ids"):
      call([[1, 2, 3]])
    with pytest.raises(ValueError, match="no prompts"):
      call([])


def test_every_without_stop_strings_is_refused():
  """every= sets how often generate_text checks stop strings; without them nothing reads it (a
  TypeError from generate_ids before)."""
  model = Model(cfg=CFG, params=None, tokenizer=ByteTokenizer(), source="test")
  with pytest.raises(ValueError, match="every=2 sets how often stop strings are checked.*Fix"):
    model.generate_text("x", every=2)


def test_halted_rows_stop_and_the_others_run_on(params):
  kw = dict(max_new_tokens=30, sampling=SAMPLED, key=9)
  want = generate(params, CFG, PROMPTS, **kw).sequences()
  def halted(rows=(0,)):
    stream = generate_stream(params, CFG, PROMPTS, every=2, **kw)
    for i, _ in enumerate(stream):
      if i == 1:
        stream.halt(list(rows))
    return stream.output.sequences()

  halted(rows=())  # compiles the stream's programs
  with CompileCounter() as compiled:
    first = halted()
  # The halted state runs the same segment program (its `done` was rebuilt committed to its
  # device, which keyed a second compile: 3.7 s on the default model at its first stop string).
  assert not [name for name in compiled.programs if "segment" in name], compiled.programs
  with CompileCounter() as compiled:
    got = halted()
  assert got == first
  assert got[1] == want[1]  # untouched
  assert got[0] == want[0][:len(got[0])] and len(got[0]) <= 2 * 2 + 3  # halted within 2 segments
  assert compiled.built == 0  # a halt changes the state's values, not its shapes or placement
  # (so the segment program runs on: no second one for the halted state)


def test_a_halt_that_ends_the_run_yields_what_output_keeps(params):
  """Halting the last running row ended the iteration at once, and `output` held the queued
  segment's tokens, which were never yielded."""
  kw = dict(max_new_tokens=30, stop_ids=())
  stream = generate_stream(params, CFG, PROMPTS, every=2, **kw)
  rows = [[] for _ in PROMPTS]
  for i, segment in enumerate(stream):
    rows = [row + new for row, new in zip(rows, segment)]
    if i == 0:
      stream.halt([0, 1])
  assert rows == stream.output.sequences()
  assert 2 < len(rows[0]) < 30  # the queued segment's tokens came too, and the run stopped


def test_an_every_past_the_run_streams_it_whole(params):
  """every near 2**31: `step + every` wrapped negative in int32, every segment ran no iteration
  and the host loop re-dispatched forever; 2**31 overflowed when the iteration began."""
  want = generate(params, CFG, PROMPTS, max_new_tokens=6).sequences()
  for every in (2**31 - 1, 2**31, 2**62):
    stream = generate_stream(params, CFG, PROMPTS, every=every, max_new_tokens=6)
    got = []  # read in a thread: the old loop never returned
    reader = threading.Thread(target=lambda: got.append(joined(stream)[0]), daemon=True)
    reader.start()
    reader.join(timeout=120)
    assert got == [want], f"every={every}: " + ("no end" if reader.is_alive() else "wrong ids")


def test_halt_refuses_what_is_not_a_row_of_a_running_stream(params):
  stream = generate_stream(params, CFG, PROMPTS, every=2, max_new_tokens=6)
  with pytest.raises(RuntimeError, match="start iterating first"):
    stream.halt([0])
  for _ in stream:
    for bad in ([True, False], [2], [-1], [0.5]):
      with pytest.raises(ValueError, match=r"row indices in \[0, 2\)"):
        stream.halt(bad)
    stream.halt([])  # nothing to halt
  with pytest.raises(RuntimeError, match="this run has ended"):
    stream.halt([0])


def test_a_row_with_no_new_tokens_keeps_its_text_window():
  """A segment that gives a row no new ids leaves its decode window as it was: a SentencePiece
  decoder strips a sequence's first space, so restarting the window there streamed
  'helloworld againn' for 'hello world again'."""
  from jspec.io.tokenizer import Tokenizer
  from jspec.streaming import RowText
  pieces = ["<unk>", "<s>", "</s>", "\u2581", "\u2581hello", "\u2581world", "\u2581again"]
  tokenizer = Tokenizer.from_gguf_metadata({
      "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
      "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1],
      "tokenizer.ggml.scores": [0.0] * 3 + [-1.0, -2.0, -3.0, -4.0],
      "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
      "tokenizer.ggml.unknown_token_id": 0})
  assert tokenizer.decode([4, 5, 6]) == "hello world again"
  row = RowText(tokenizer.decode)
  text = "".join(row.add(more) for more in ([4], [], [5], [6]))
  assert text == "hello world again" and row.finish() == ""
