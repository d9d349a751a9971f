"""N-gram lookup drafting: the lookup equals a plain-Python prompt lookup, the engine accepts
exactly what an offline replay of that lookup predicts, output stays the target's (greedy
identity, sampled distribution), one compiled program, clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.decode import prepare_batch
from jspec.generate import generate
from jspec.models.llama import init_params
from jspec.bench.profiling import CompileCounter
from jspec.sampling.processing import SamplingParams
from jspec.drafting.model import ModelDrafter
from jspec.speculative.chain import SpecConfig, speculative_generate, speculative_loop
from jspec.drafting.ngram import lookup, ngram_drafter
from tiny_models import causal_logits
from tests.test_speculative import (PROMPTS, SAMPLINGS, TARGET, TINY, chi_square,
                                    exact_distribution, noised_drafter, own_program,
                                    sample_sequences)

# Prompts that repeat themselves, so the lookup has something to find.
REPEATING = [[5, 17, 3, 5, 17, 3, 5, 17], [8, 1, 8, 1, 8], PROMPTS[2] + PROMPTS[2][:6], [7, 7, 7]]


def python_lookup(ctx: list[int], n_min: int, n_max: int) -> int | None:
  """What follows the most recent earlier occurrence of ctx's longest matching suffix."""
  i = len(ctx)
  for n in range(n_max, n_min - 1, -1):
    for j in range(i - n - 1, -1, -1):
      if ctx[j:j + n] == ctx[i - n:i]:
        return ctx[j + n]
  return None


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (2, 4), (1, 3)])
def test_lookup_matches_python(n_min, n_max):
  rng = np.random.default_rng(0)
  B, L = 64, 24
  history = rng.integers(0, 4, (B, L))  # a 4-token alphabet: many matches of every length
  length = rng.integers(0, L + 1, B)
  token, found = lookup(jnp.asarray(history, jnp.int32), jnp.asarray(length, jnp.int32),
                        n_min, n_max)
  for b in range(B):
    want = python_lookup(list(history[b, :length[b]]), n_min, n_max)
    assert bool(found[b]) == (want is not None), b
    if want is not None:
      assert int(token[b]) == want, b


def test_lookup_ignores_tokens_past_length():
  history = jnp.asarray([[1, 2, 3, 9, 9, 1, 2, 3, 4]], jnp.int32)
  token, found = lookup(history, jnp.asarray([5], jnp.int32), 1, 3)  # context [1, 2, 3, 9, 9]
  assert bool(found[0]) and int(token[0]) == 9  # "9" follows the earlier 9, not the later 4
  token, found = lookup(history, jnp.asarray([3], jnp.int32), 1, 3)  # context [1, 2, 3]
  assert not bool(found[0])


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


def replayed_accept_hist(target, drafter_logits, prompts, gamma, n_tokens, n_min, n_max,
                         store=None):
  """accept_hist of a greedy chain, replayed offline: draft i of a round is right exactly when
  the lookup (else `store(context)` when given and not None, else the model drafter's argmax,
  else the previous token) on the true context names the target's next token, and a round
  accepts the run of right drafts."""
  want = generate(target, TARGET, prompts, max_new_tokens=n_tokens + gamma + 1).sequences()
  hist = np.zeros(gamma + 1, np.int64)
  for prompt, out in zip(prompts, want):
    ctx = list(prompt) + list(out)
    argmax = None if drafter_logits is None else drafter_logits(ctx)
    right = []
    for i in range(len(prompt) + 1, len(ctx)):
      guess = python_lookup(ctx[:i], n_min, n_max)
      if guess is None and store is not None:
        guess = store(ctx[:i])
      if guess is None:
        guess = ctx[i - 1] if argmax is None else argmax[i - 1]
      right.append(guess == ctx[i])
    emitted, i = 1, 0  # the prefill emitted the first token
    while emitted < n_tokens:
      run = 0
      while run < gamma and right[i + run]:
        run += 1
      hist[run] += 1
      emitted += run + 1
      i += run + 1
  return hist


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_pure_lookup_greedy_identity_and_replay(target, gamma):
  drafter = ngram_drafter(TARGET.vocab_size, 1, 3)
  out = speculative_generate(target, TARGET, drafter, REPEATING,
                             spec=SpecConfig(gamma=gamma, max_new_tokens=24))
  assert out.sequences() == generate(target, TARGET, REPEATING, max_new_tokens=24).sequences()
  hist = np.asarray(out.accept_hist)
  assert hist[0] > 0 and hist[1:].sum() > 0  # rejections and acceptances both exercised
  np.testing.assert_array_equal(
      hist, replayed_accept_hist(target, None, REPEATING, gamma, 24, 1, 3))


@pytest.mark.parametrize("gamma", [1, 3])
def test_hybrid_greedy_identity_and_replay(target, gamma):
  model = noised_drafter(target, 0.5)
  drafter = ngram_drafter(TARGET.vocab_size, 2, 3, fallback=model)

  def model_argmax(ctx):
    return np.asarray(causal_logits(model.params, TARGET, ctx).argmax(-1))

  out = speculative_generate(target, TARGET, drafter, REPEATING,
                             spec=SpecConfig(gamma=gamma, max_new_tokens=24))
  assert out.sequences() == generate(target, TARGET, REPEATING, max_new_tokens=24).sequences()
  np.testing.assert_array_equal(
      np.asarray(out.accept_hist),
      replayed_accept_hist(target, model_argmax, REPEATING, gamma, 24, 2, 3))
  # The lookup changed what was accepted: the model drafter alone accepts differently.
  alone = speculative_generate(target, TARGET, model, REPEATING,
                               spec=SpecConfig(gamma=gamma, max_new_tokens=24))
  assert not np.array_equal(np.asarray(alone.accept_hist), np.asarray(out.accept_hist))


TINY_REPEATING = [3, 7, 1, 3, 7]


@pytest.fixture(scope="module")
def tiny_target():
  return init_params(TINY, jax.random.key(10), scale=0.8)


def test_tiny_prompt_has_matches():  # else the statistical tests below would not test a lookup
  _, found = lookup(jnp.asarray([TINY_REPEATING]), jnp.asarray([len(TINY_REPEATING)]), 1, 2)
  assert bool(found[0])


# The lookup alone at t1, the hybrid (a model fallback) with the filters on.
@pytest.mark.parametrize("hybrid, name", [(False, "t1"), (True, "t0.7-topk")])
def test_sampling_is_lossless(tiny_target, name, hybrid):
  sp = SAMPLINGS[name]
  fallback = ModelDrafter(init_params(TINY, jax.random.key(11), scale=0.8), TINY) if hybrid else None
  drafter = ngram_drafter(TINY.vocab_size, 1, 2, fallback=fallback)
  stat, dof, ok = chi_square(sample_sequences(tiny_target, drafter, sp, 2, TINY_REPEATING),
                             exact_distribution(tiny_target, sp, prompt=TINY_REPEATING))
  assert ok, (name, hybrid, stat, dof)


def test_one_program_no_recompile(target):
  drafter = ngram_drafter(TARGET.vocab_size, 2, 4, fallback=noised_drafter(target, 0.5))
  spec = SpecConfig(gamma=3, max_new_tokens=12)
  for temp in (0.0, 0.5):  # a greedy program and a sampled one (SamplingParams' static mode)
    speculative_generate(target, TARGET, drafter, [[1, 2, 3]], spec=spec,
                         sampling=SamplingParams(temperature=temp))
  with CompileCounter() as counter:
    for prompt, temp in (([4, 5, 4, 5], 0.0), ([9] * 11, 1.0), ([2, 2], 0.7)):
      jax.block_until_ready(speculative_generate(
          target, TARGET, drafter, [prompt], spec=spec,
          sampling=SamplingParams(temperature=temp), key=3).tokens)
  assert counter.compiles == 0


def test_bad_input(target):
  with pytest.raises(ValueError, match="n_min <= n_max"):
    ngram_drafter(TARGET.vocab_size, 3, 2)
  with pytest.raises(ValueError, match="n_min <= n_max"):
    ngram_drafter(TARGET.vocab_size, 0, 2)
  with pytest.raises(ValueError, match="not itself a lookup"):
    ngram_drafter(TARGET.vocab_size, 2, 4, fallback=ngram_drafter(TARGET.vocab_size))
  with pytest.raises(ValueError, match="not itself a lookup"):
    ngram_drafter(TARGET.vocab_size, 2, 4, fallback=object())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _NoCatchUp(ModelDrafter):
  """Control: a fallback that forgets the rounds the lookup left it out of. (Without a field of
  its own, _loop_jit ran ModelDrafter's catching-up loop for it now and then: `differs == 0`,
  the "lost" entries matching to 5e-6.)"""

  forgets: str = own_program()

  def catch_up(self, state, tokens, seq_len):
    return state


_loop_jit = jax.jit(speculative_loop, static_argnums=1, static_argnames=("spec", "cache_size"))


def _cycling_target(target):
  """The target without its attention outputs (wo = 0): each position's logits then depend on its
  token alone, so greedy decoding follows a map f over the vocabulary and, from any token, falls
  into a cycle of f that it never leaves. Prompts made of that cycle make the lookup match every
  draft on any CPU (a random model's own text repeats by accident, and where it does depends on
  the machine's rounding). Also the one-token prompts the cycles were reached from: rounds with
  misses first, matched rounds once the text is on the cycle."""
  cycling = dataclasses.replace(target, layers=tuple(
      dataclasses.replace(lp, wo=jnp.zeros_like(lp.wo)) for lp in target.layers))
  out = generate(cycling, TARGET, [[t] for t in range(TARGET.vocab_size)], max_new_tokens=1)
  f = [seq[0] for seq in out.sequences()]
  prompts = []
  for start in (0, TARGET.vocab_size // 2):
    t = start
    for _ in range(TARGET.vocab_size):  # onto the cycle
      t = f[t]
    cycle = [t]
    while f[cycle[-1]] != t:
      cycle.append(f[cycle[-1]])
    prompts.append((cycle * (2 + 8 // len(cycle)))[:2 * len(cycle) + 4])
  return cycling, prompts, [[0], [TARGET.vocab_size // 2]]


@pytest.mark.parametrize("temperature", [0.0, 0.3])  # sampled, but cold enough to repeat
def test_rounds_the_lookup_matched_skip_the_fallback_and_change_nothing(target, temperature):
  """Leaving the fallback out of fully matched rounds gives the same tokens, acceptances and
  (after its catch-up forward) the same fallback KV entries as drafting every round; a fallback
  that skips without catching up ends with different entries (so rounds were skipped)."""
  model = noised_drafter(target, 0.5)
  target, cycles, tails = _cycling_target(target)
  spec = SpecConfig(gamma=3, max_new_tokens=24)
  sampling = SamplingParams(temperature=temperature)

  def run(fallback, skip, prompt):
    drafter = dataclasses.replace(ngram_drafter(TARGET.vocab_size, 2, 3, fallback=fallback),
                                  skip_matched=skip)
    b = prepare_batch(TARGET, [prompt], max_new_tokens=24, sampling=sampling, key=5,
                      stop_ids=(), cache_size=None, reserve=4, reserve_for="the block")
    s = _loop_jit(target, TARGET, drafter, b.tokens, b.lengths, b.key, b.sampling, spec=spec,
                  cache_size=b.cache_size)
    known = int(s.seq_len[0]) - 2  # the fallback's entries a next round would read
    return (np.asarray(s.tokens[0, :24]), np.asarray(s.accept_hist),
            np.asarray(s.draft.inner.cache.k[:, 0, :known]))

  forgetful = _NoCatchUp(params=model.params, cfg=model.cfg)
  differs, seen = 0, []
  for prompt in cycles + tails:
    tokens, hist, kv = run(model, False, prompt)
    skip_tokens, skip_hist, skip_kv = run(model, True, prompt)
    np.testing.assert_array_equal(skip_tokens, tokens)
    np.testing.assert_array_equal(skip_hist, hist)
    np.testing.assert_allclose(skip_kv, kv, atol=1e-5)
    _, _, lost_kv = run(forgetful, True, prompt)
    differs += not np.allclose(lost_kv, kv, atol=1e-5)
    seen.append((prompt, tokens.tolist(), hist.tolist(), float(np.abs(lost_kv - kv).max())))
  assert differs >= (len(cycles) if temperature == 0 else 1), (differs, seen)
