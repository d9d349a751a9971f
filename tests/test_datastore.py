"""Retrieval drafting (REST): the datastore holds each frequent context's most frequent next token
(a counting reference decides), the device lookup reads it with the builder's hash, the drafter
consults it only where the history has no match and accepts exactly what an offline replay
predicts, output stays the target's (greedy identity, sampled law with a control that must fail),
files round-trip and are refused for another tokenizer. Trees and `rest+X`: tests/test_drafters.py
(KINDS)."""

import collections
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench.profiling import CompileCounter
from jspec.cli import main
from jspec.drafting.ngram import NgramDrafter, ngram_drafter, store_lookup
from jspec.drafting.registry import parse_drafter
from jspec.generate import generate
from jspec.io import datastore as D
from jspec.models.llama import init_params
from jspec.speculative.chain import SpecConfig, speculative_generate
from tests.test_ngram import REPEATING, python_lookup, replayed_accept_hist
from tests.test_speculative import (PROMPTS, SAMPLINGS, TARGET, TINY, TINY_PROMPT, chi_square,
                                    exact_distribution, sample_sequences)


def counting_reference(sequences, n_min, n_max, min_count):
  """{context tuple: next token} by plain counting inside each sequence: contexts seen at least
  min_count times, their most frequent next token, ties to the smallest id."""
  counts = collections.defaultdict(collections.Counter)
  for s in sequences:
    s = [int(t) for t in s]
    for n in range(n_min, n_max + 1):
      for i in range(n, len(s)):
        counts[tuple(s[i - n:i])][s[i]] += 1
  return {ctx: min(c, key=lambda t: (-c[t], t)) for ctx, c in counts.items()
          if sum(c.values()) >= min_count}


def reference_store(reference, n_min, n_max):
  """The store's answer for a context, in Python: the longest suffix the reference holds."""
  def guess(ctx):
    for n in range(min(n_max, len(ctx)), n_min - 1, -1):
      if tuple(ctx[-n:]) in reference:
        return reference[tuple(ctx[-n:])]
    return None
  return guess


def table(sequences, n_min=1, n_max=3, min_count=1) -> D.NgramTable:
  keys, tokens, _ = D.build_table(sequences, n_min=n_min, n_max=n_max, min_count=min_count)
  return D.NgramTable(keys=jnp.asarray(keys), tokens=jnp.asarray(tokens), n_min=n_min, n_max=n_max)


def own_text(target, cfg, n_tokens=24, prompts=None, kv=None):
  """The target's greedy continuations of `prompts` (default: one-token prompts; under the KV
  policy `kv` if given), prompt first: a corpus it will write again."""
  prompts = [[t] for t in range(0, cfg.vocab_size, 3)] if prompts is None else prompts
  out = generate(target, cfg, prompts, max_new_tokens=n_tokens, kv=kv)
  return [np.asarray(list(p) + s) for p, s in zip(prompts, out.sequences())]


def rest_drafter(target, cfg=TARGET, fallback=None, prompts=None, n_min=1) -> NgramDrafter:
  """A lookup whose store holds the target's own text (orders n_min..3)."""
  store = table(own_text(target, cfg, prompts=prompts), n_min=n_min)
  return ngram_drafter(cfg.vocab_size, 2, 4, fallback, store=store)


def test_hash_is_the_same_in_numpy_and_jax():
  rng = np.random.default_rng(0)
  for n in (1, 2, 5):
    ctx = rng.integers(0, 2**31 - 1, (50, n)).astype(np.uint32)
    np.testing.assert_array_equal(D.context_hash(np, ctx),
                                  np.asarray(D.context_hash(jnp, jnp.asarray(ctx))))
  one = np.asarray([[1, 2]], np.uint32)
  assert D.context_hash(np, one) != D.context_hash(np, one[:, ::-1])  # order matters
  assert D.context_hash(np, np.asarray([[0, 2]], np.uint32)) != D.context_hash(np, one[:, 1:])


@pytest.mark.parametrize("min_count", [1, 3])
def test_table_holds_the_most_frequent_next_token_of_frequent_contexts(min_count):
  rng = np.random.default_rng(1)
  # A 5-token alphabet, so contexts recur and their next tokens compete; several sequences, so a
  # context running over a boundary would count if the builder joined them.
  sequences = [rng.integers(0, 5, rng.integers(3, 60)) for _ in range(12)]
  reference = counting_reference(sequences, 1, 3, min_count)
  store = table(sequences, 1, 3, min_count)
  guess = reference_store(reference, 1, 3)
  # Every context of the corpus and some that never occur, each looked up on the device.
  contexts = sorted({tuple(s[i - n:i]) for s in sequences for n in (1, 2, 3)
                     for i in range(n, len(s) + 1)} | {(7, 7), (1, 9, 1)})
  L = 4
  history = np.zeros((len(contexts), L), np.int32)
  for b, ctx in enumerate(contexts):
    history[b, :len(ctx)] = ctx
  token, found = store_lookup(store, jnp.asarray(history),
                              jnp.asarray([len(c) for c in contexts], jnp.int32))
  n_found = 0
  for b, ctx in enumerate(contexts):
    want = guess(list(ctx))
    assert bool(found[b]) == (want is not None), ctx
    if want is not None:
      n_found += 1
      assert int(token[b]) == want, ctx
  assert 0 < n_found < len(contexts)  # hits and misses both checked


def test_contexts_never_span_two_sequences():
  keys, _, n_tokens = D.build_table([np.asarray([1, 2]), np.asarray([3, 4])], n_min=1, n_max=2,
                                    min_count=1)
  assert n_tokens == 4
  spanning = D.context_hash(np, np.asarray([[2]], np.uint32))  # 2 is followed by nothing
  assert not np.isin(spanning, keys).any()
  assert np.isin(D.context_hash(np, np.asarray([[1]], np.uint32)), keys).all()
  assert np.isin(D.context_hash(np, np.asarray([[3]], np.uint32)), keys).all()
  assert keys.size == 2


def test_the_history_match_comes_first_the_store_second():
  store = table([np.asarray([1, 2, 9, 1, 2, 9])], 1, 2)  # the store: 2 -> 9, (1, 2) -> 9
  drafter = ngram_drafter(TARGET.vocab_size, 2, 4, store=store)
  history = jnp.asarray([[1, 2, 5, 1, 2, 0],    # the history has (1, 2) -> 5: it wins
                         [4, 1, 2, 0, 0, 0],    # no history match: the store's 9
                         [4, 6, 0, 0, 0, 0]], jnp.int32)  # neither matches
  token, found = drafter.guess(history, jnp.asarray([5, 3, 2], jnp.int32))
  np.testing.assert_array_equal(np.asarray(found), [True, True, False])
  np.testing.assert_array_equal(np.asarray(token)[:2], [5, 9])


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


@pytest.mark.parametrize("gamma", [3])
def test_greedy_identity_and_replay(target, gamma):
  corpus = own_text(target, TARGET)
  drafter = ngram_drafter(TARGET.vocab_size, 2, 4, store=table(corpus))
  prompts = [[3], [30], PROMPTS[0], REPEATING[1]]  # the first two start texts of the corpus
  out = speculative_generate(target, TARGET, drafter, prompts,
                             spec=SpecConfig(gamma=gamma, max_new_tokens=24))
  assert out.sequences() == generate(target, TARGET, prompts, max_new_tokens=24).sequences()
  hist = np.asarray(out.accept_hist)
  store = reference_store(counting_reference(corpus, 1, 3, 1), 1, 3)
  np.testing.assert_array_equal(
      hist, replayed_accept_hist(target, None, prompts, gamma, 24, 2, 4, store=store))
  # One program: other prompts of the same bucket and another store of the same size reuse it.
  other = D.NgramTable(keys=drafter.store.keys, n_min=1, n_max=3,
                       tokens=(drafter.store.tokens + 1) % TARGET.vocab_size)
  with CompileCounter() as counter:
    jax.block_until_ready(speculative_generate(
        target, TARGET, ngram_drafter(TARGET.vocab_size, 2, 4, store=other),
        [[p + 1 for p in prompt] for prompt in prompts],
        spec=SpecConfig(gamma=gamma, max_new_tokens=24)).tokens)
  assert counter.compiles == 0
  # The store made the difference: the lookup alone accepts fewer drafts.
  alone = speculative_generate(target, TARGET, ngram_drafter(TARGET.vocab_size, 2, 4), prompts,
                               spec=SpecConfig(gamma=gamma, max_new_tokens=24))
  assert hist[1:] @ np.arange(1, gamma + 1) > np.asarray(alone.accept_hist)[1:] @ np.arange(
      1, gamma + 1)


def test_greedy_identity_under_a_kv_budget(target):
  """The store drafts from tokens, not from the cache: under an evicting target cache (KeyDiff,
  a budget far below the text) greedy output is the budgeted target's own, and its drafts pass."""
  from jspec.kv.policy import KVPolicy
  policy = KVPolicy("keydiff", budget=16, sinks=2, chunk=8, evict_every=4)
  prompts = [PROMPTS[0], REPEATING[1], [30]]
  corpus = own_text(target, TARGET, 32, prompts, kv=policy)
  want = [[int(t) for t in c[len(p):]] for c, p in zip(corpus, prompts)]
  store = table(corpus)
  out = speculative_generate(target, TARGET, ngram_drafter(TARGET.vocab_size, 2, 4, store=store),
                             prompts, kv=policy, spec=SpecConfig(gamma=3, max_new_tokens=32))
  assert out.sequences() == want
  assert np.asarray(out.accept_hist)[1:].sum() > 0


@pytest.mark.parametrize("case", ["t1", "t0.7-topk", "topp-minp", "q misreported (control)"])
def test_sampling_is_lossless(monkeypatch, case):
  """TINY_PROMPT repeats nothing, so every draft comes from the store (bigrams of a random
  corpus: all 16 one-token contexts). The control reports a uniform q for the store's
  deterministic drafts, and the same test must catch it."""
  tiny = init_params(TINY, jax.random.key(10), scale=0.8)
  rng = np.random.default_rng(2)
  drafter = ngram_drafter(TINY.vocab_size, 2, 4,
                          store=table([rng.integers(0, TINY.vocab_size, 400)], 1, 2))
  assert python_lookup(TINY_PROMPT, 2, 4) is None
  if case.endswith("(control)"):
    real = NgramDrafter.propose

    def misreported(self, *args, **kwargs):
      tokens, q, state = real(self, *args, **kwargs)
      return tokens, jnp.full_like(q, 1 / q.shape[-1]), state
    monkeypatch.setattr(NgramDrafter, "propose", misreported)
  sp = SAMPLINGS[case if case in SAMPLINGS else "t1"]
  stat, dof, ok = chi_square(sample_sequences(tiny, drafter, sp, gamma=2),
                             exact_distribution(tiny, sp))
  assert ok == (not case.endswith("(control)")), (case, stat, dof)


class _Tok:
  """A stand-in tokenizer: the datastore reads its token strings and size."""

  def __init__(self, tokens):
    self.tokens, self.vocab_size = tokens, len(tokens)

  @property
  def fingerprint(self):  # the real tokenizer's, from these token strings
    from jspec.io.tokenizer import Tokenizer
    return Tokenizer.fingerprint.func(self)


def test_file_round_trip_and_refusals(tmp_path, monkeypatch):
  keys, tokens, n = D.build_table([np.asarray([1, 2, 3, 1, 2, 4, 1, 2, 3])], n_max=2, min_count=1)
  tok = _Tok([f"t{i}" for i in range(8)])
  path = D.save_table(tmp_path / "s.safetensors", keys, tokens, n_min=1, n_max=2, min_count=1,
                      corpus_tokens=n, tokenizer=tok, source="test")
  loaded = D.load_table(path, tok, 8)
  np.testing.assert_array_equal(np.asarray(loaded.keys), keys)
  np.testing.assert_array_equal(np.asarray(loaded.tokens), tokens)
  assert (loaded.n_min, loaded.n_max) == (1, 2)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]  # no .part left
  def interrupted(self, target):
    raise KeyboardInterrupt
  monkeypatch.setattr(Path, "replace", interrupted)  # stopped after writing, before the rename
  with pytest.raises(KeyboardInterrupt):
    D.save_table(tmp_path / "cut.safetensors", keys, tokens, n_min=1, n_max=2, min_count=1,
                 corpus_tokens=n, tokenizer=tok, source="test")
  monkeypatch.undo()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]  # its part file removed
  other = _Tok([f"t{i}" for i in range(7)] + ["x"])
  with pytest.raises(ValueError, match="another tokenizer"):
    D.load_table(path, other, 8)
  with pytest.raises(ValueError, match="damaged"):
    D.load_table(path, tok, 3)  # token ids past the vocabulary
  (tmp_path / "text.safetensors").write_text("not a datastore")
  with pytest.raises(ValueError, match="not a safetensors datastore"):
    D.load_table(tmp_path / "text.safetensors", tok, 8)
  import safetensors.numpy  # a model's weights: metadata that is not JSON
  safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"),
                              metadata={"format": "pt"})
  with pytest.raises(ValueError, match="not a jspec n-gram datastore"):
    parse_drafter(f"rest:{tmp_path / 'model.safetensors'}")
  with pytest.raises(FileNotFoundError, match="jspec build-datastore"):
    parse_drafter(f"rest:{tmp_path / 'missing.safetensors'}")
  assert parse_drafter(f"rest:{path}+self").fallback.kind.name == "self"
  plussed = tmp_path / "a+b" / "s.safetensors"  # a path's own '+' is no +DRAFTER
  plussed.parent.mkdir()
  plussed.write_bytes(path.read_bytes())
  assert parse_drafter(f"rest:{plussed}").arg == str(plussed)
  assert parse_drafter(f"rest:{plussed}+self").arg == str(plussed)
  # Refused while parsing, before `rest` builds its default store (minutes) or anything loads.
  for bad, match in (("ngram+rest", "not itself a lookup"), ("rest+ngram", "not itself a lookup"),
                     ("ngram+lookahead", "not itself a lookup"), ("ngram:1-40", "N2 <= 16"),
                     ("lookahead@0.5", "no adaptive draft length"),
                     ("ngram@0.5@0.9", "one stop threshold")):
    with pytest.raises(ValueError, match=match):
      parse_drafter(bad)
  with pytest.raises(ValueError, match="1 <= n_min <= n_max"):
    D.build_table([np.asarray([1, 2])], n_min=3, n_max=2)
  with pytest.raises(ValueError, match=r"integer token ids in \[0, 2\*\*31\).*holding -2..1"):
    D.build_table([np.asarray([1, -2])])
  for ids in ([1.0, 3.9], [True, False]):  # would key 3.9 as token 3, True as token 1
    with pytest.raises(ValueError, match="integer token ids.*dtype (float64|bool)"):
      D.build_table([np.asarray(ids)])
  assert D.build_table([np.asarray([], np.int32), []], min_count=1)[2] == 0  # empty: fine
  with pytest.raises(ValueError, match="NgramTable"):
    NgramDrafter(vocab=8, store=(keys, tokens))
  empty = D.NgramTable(keys=jnp.zeros((0,), jnp.uint32), tokens=jnp.zeros((0,), jnp.int32),
                       n_min=1, n_max=3)  # a lookup into it failed in an XLA gather
  with pytest.raises(ValueError, match="the n-gram store is empty"):
    NgramDrafter(vocab=8, store=empty)
  orders = D.NgramTable(keys=jnp.asarray(keys), tokens=jnp.asarray(tokens), n_min=0, n_max=3)
  with pytest.raises(ValueError, match="holds contexts of 0-3 tokens"):
    NgramDrafter(vocab=8, store=orders)


def test_build_datastore_command_and_rest_drafter(tmp_path, capsys):
  """`jspec build-datastore` from a text file writes what `jspec generate --drafter rest:FILE`
  loads, and the text is the autoregressive one; bad sources and a datastore of another
  tokenizer are refused with the fix."""
  pytest.importorskip("transformers")  # the tiny checkpoint is written through it
  from tests import ggufutil
  model, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path / "m", "llama", max_position_embeddings=512)
  ggufutil.make_tiny_tokenizer_dir(model, 256)
  text = tmp_path / "corpus.txt"
  text.write_text("the cat sat on the mat. " * 20, encoding="utf-8")
  out = tmp_path / "store.safetensors"
  assert main(["build-datastore", "--model", str(model), "--from", str(text), "--min-count", "2",
               "--out", str(out)]) == 0
  assert "rest:" in capsys.readouterr().out
  meta = D.read_metadata(out)
  assert (meta["n_min"], meta["n_max"], meta["min_count"]) == (1, 3, 2)
  base = ["generate", "--model", str(model), "--prompt", "the cat", "--max-new-tokens", "8"]
  assert main(base) == 0
  plain = capsys.readouterr().out
  assert main(base + ["--drafter", f"rest:{out}", "--gamma", "3"]) == 0
  assert capsys.readouterr().out == plain
  assert main(["build-datastore", "--from", str(tmp_path / "none.txt")]) == 2
  assert "no such file" in capsys.readouterr().err
  assert main(["build-datastore", "--model", str(model), "--from", str(text), "--n-max", "9"]) == 2
  assert "--n-max" in capsys.readouterr().err
  # Without --out only the default datastore (ShareGPT, default settings) is written, to the
  # path `--drafter rest` reads as ShareGPT's; a corpus given twice would count twice.
  for extra in ([], ["--from", "sharegpt", "--n-max", "2"]):
    sources = ["--from", str(text)] if not extra else []
    assert main(["build-datastore", "--model", str(model), *sources, *extra]) == 2
    assert "--drafter rest reads" in capsys.readouterr().err
  assert main(["build-datastore", "--model", str(model), "--from", str(text), "--from",
               str(text), "--out", str(tmp_path / "twice.safetensors")]) == 2
  assert "given twice" in capsys.readouterr().err
  other = tmp_path / "other.safetensors"
  D.save_table(other, *D.build_table([np.asarray([1, 2, 1, 2])], min_count=1)[:2], n_min=1,
               n_max=3, min_count=1, corpus_tokens=4, tokenizer=_Tok(["a", "b", "c"]),
               source="test")
  assert main(base + ["--drafter", f"rest:{other}"]) == 2
  assert "another tokenizer" in capsys.readouterr().err


def test_the_default_datastore_is_rebuilt_when_its_file_is_not_sharegpts(tmp_path, monkeypatch,
                                                                          capsys):
  """A file at the default path built from another source or other settings (an older
  build-datastore wrote one there) is not read as ShareGPT's datastore."""
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
  tok = _Tok([f"t{i}" for i in range(8)])
  path = D.default_table_path(tok)
  path.parent.mkdir(parents=True)
  keys, tokens, n = D.build_table([np.asarray([5, 6] * 20)], min_count=1)
  D.save_table(path, keys, tokens, n_min=1, n_max=D.N_MAX, min_count=1, corpus_tokens=n,
               tokenizer=tok, source="corpus.txt")
  monkeypatch.setattr(D, "sharegpt_sequences", lambda *a, **k: [np.asarray([1, 2, 3] * 20)])
  table = D.default_table(tok, 8)
  assert D.read_metadata(path)["source"] == "sharegpt" and "building it again" in (
      capsys.readouterr().err)
  assert set(np.asarray(table.tokens).tolist()) <= {1, 2, 3}
