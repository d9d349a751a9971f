"""Scoring text (jspec.score): every token's log-probability given those before it, read in chunks,
equals a teacher-forced forward over the whole row; under a KV budget, what chunked prefill of each
prefix predicts next; sums and perplexity; one program per bucket; clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench.profiling import CompileCounter
from jspec.kv.policy import KVPolicy
from jspec.kv.prefill import chunked_prefill
from jspec.model import Model
from jspec.models.attention import attention_slots
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import init_params
from jspec.score import score
from tiny_models import SMALL, causal_logits

CFG = SMALL
ROWS = [list(np.random.default_rng(0).integers(0, 97, 45)), [5, 17, 3], [8] * 20]


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


def teacher_forced(params, row) -> np.ndarray:
  lps = np.asarray(jax.nn.log_softmax(causal_logits(params, CFG, row), axis=-1))
  return np.concatenate([[0.0], lps[np.arange(len(row) - 1), row[1:]]])


@pytest.mark.parametrize("chunk", [4, 16, 128])
def test_scores_are_the_teacher_forced_log_probabilities(params, chunk):
  out = score(params, CFG, ROWS, chunk=chunk)
  got = np.asarray(out.logprobs)
  assert list(np.asarray(out.lengths)) == [len(r) for r in ROWS]
  for i, row in enumerate(ROWS):
    np.testing.assert_allclose(got[i, :len(row)], teacher_forced(params, row), atol=2e-5)
    assert np.all(got[i, len(row):] == 0) and got[i, 0] == 0
  want = [teacher_forced(params, row)[1:].sum() for row in ROWS]
  np.testing.assert_allclose(out.sums(), want, rtol=1e-5)
  np.testing.assert_allclose(out.perplexity(), np.exp(-np.asarray(want) / [len(r) - 1 for r in
                                                                            ROWS]), rtol=1e-5)
  # A continuation's log-likelihood: the tokens from `starts` on.
  np.testing.assert_allclose(out.sums(starts=[40, 1, 10])[0],
                             teacher_forced(params, ROWS[0])[40:].sum(), rtol=1e-5)


@pytest.mark.parametrize("method", ["keydiff", "h2o"])
def test_scores_under_a_budget_are_what_chunked_prefill_of_each_prefix_predicts(params, method):
  kv = KVPolicy(method, budget=12, sinks=2, window=2, chunk=4)
  row = ROWS[0]
  got = np.asarray(score(params, CFG, [row], kv=kv).logprobs)[0]
  cache = KVCache.init(CFG, 1, attention_slots(CFG, kv.slots))
  prefill = jax.jit(lambda p, n: chunked_prefill(params, CFG, p, n, cache, kv)[0])
  for n in range(1, len(row)):  # the prefix of n tokens read under the budget predicts token n
    logits = prefill(jnp.asarray([row[:n] + [0] * (len(row) - n)]), jnp.asarray([n]))
    want = float(jax.nn.log_softmax(logits[0])[row[n]])
    assert abs(got[n] - want) < 2e-5, (n, got[n], want)
  # The budget changed the scores once the text outgrew it.
  full = teacher_forced(params, row)
  assert np.allclose(got[:12], full[:12], atol=2e-5)
  assert not np.allclose(got[20:len(row)], full[20:], atol=1e-3)


def test_one_program_per_bucket(params):
  score(params, CFG, [[1, 2, 3]], chunk=8)
  with CompileCounter() as compiled:
    score(params, CFG, [[4, 5, 6, 7, 8]], chunk=8)
  assert compiled.compiles == 0


def test_model_scores_text(params):
  class ByteTokenizer:
    def encode(self, text, add_special_tokens=True):
      return list(text.encode("utf-8"))

  cfg = Config(arch="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
               num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256)
  model = Model(cfg=cfg, params=init_params(cfg, jax.random.key(4), scale=0.5),
                tokenizer=ByteTokenizer(), source="test")
  out = model.score_text(["héllo wörld", "ab"])
  assert list(np.asarray(out.lengths)) == [13, 2]
  one = model.score_text("ab")
  np.testing.assert_allclose(one.sums(), out.sums()[1:], rtol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sequences=[[1, 2, 97]]), "vocab"),
    (dict(sequences=[[1] * 257]), "max_position_embeddings=256"),
    (dict(sequences=[[1, 2]], chunk=0), "chunk .* must be a positive integer"),
])
def test_bad_input_is_refused(params, kwargs, message):
  with pytest.raises(ValueError, match=message):
    score(params, CFG, **kwargs)


def test_bad_starts_are_refused(params):
  out = score(params, CFG, [[1, 2, 3]])
  with pytest.raises(ValueError, match="starts must lie in"):
    out.sums(starts=0)
  with pytest.raises(ValueError, match="starts must lie in"):
    out.sums(starts=4)
  with pytest.raises(ValueError, match=r"one position or one per row \(1\)"):
    out.sums(starts=[1, 2])


def test_nothing_scored_has_no_perplexity(params):
  out = score(params, CFG, [[1, 2, 3], [4]])
  ppl = out.perplexity()
  assert np.isfinite(ppl[0]) and np.isnan(ppl[1])  # one token: nothing predicts anything
  assert np.isnan(out.perplexity(starts=[3, 1])[0])
  for empty in ([], [[1, 2], []]):
    with pytest.raises(ValueError, match="non-empty rows of token ids"):
      score(params, CFG, empty)
