"""The feature-level drafter (EAGLE): its incremental state matches a from-scratch teacher-forced
pass, speculative output stays exactly the target's (greedy identity, sampled distribution), one
compiled program, and its training reduces the loss."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.generate import generate
from jspec.models.cache import KVCache
from jspec.models.llama import init_params
from jspec.sampling.processing import GREEDY
from jspec.drafting.base import Features
from jspec.drafting.feature import eagle_drafter
from jspec.models.eagle import eagle_forward, head_logits, init_eagle
from jspec.speculative.chain import SpecConfig, speculative_generate
from tests.test_speculative import (assert_one_program, PROMPTS, SAMPLINGS, TARGET, TINY, chi_square,
                                    exact_distribution, sample_sequences)
from tiny_models import jitted_forward


def noisy_eagle(target_params, cfg, key=3, amount=0.3, keep_ids=None):
  """init_eagle plus random weights, so the drafter's layer and fc matter in every check."""
  params, dcfg = init_eagle(target_params, cfg, jax.random.key(0))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(key), len(leaves))
  leaves = [x + amount * jax.random.normal(k, x.shape) if x.ndim > 1 else x
            for x, k in zip(leaves, keys)]
  return eagle_drafter(jax.tree.unflatten(tree, leaves), dcfg, target_params, keep_ids)


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def drafter(target):
  return noisy_eagle(target, TARGET)


def target_hidden(params, cfg, seq):
  n = len(seq)
  _, hidden, _ = jitted_forward(params, cfg, jnp.asarray([seq]), jnp.arange(n)[None],
                                KVCache.init(cfg, 1, n))
  return hidden  # [1, n, E]


def teacher_forced(drafter, seq, feats):
  """f̂ of every pair (feats[j], seq[j + 1]) from scratch: [1, n - 1, E]."""
  return _teacher_forced(drafter, jnp.asarray([seq]), feats)


@jax.jit
def _teacher_forced(drafter, seq, feats):  # (op by op, each shape compiled every op)
  n = seq.shape[1]
  cache = KVCache.init(drafter.cfg, 1, n)
  pred, _ = eagle_forward(drafter.params, drafter.cfg, drafter.embed, seq[:, 1:],
                          feats[:, : n - 1], jnp.arange(n - 1)[None], cache)
  return pred


# Jitted for the incremental-state tests: op by op, a drafter's init, propose and update
# compiled several hundred small programs a test.
@functools.partial(jax.jit, static_argnames=("cache_size",))
def drafter_init(drafter, prompt, lengths, features, cache_size=32):
  return drafter.init(prompt, lengths, cache_size, features)


@functools.partial(jax.jit, static_argnames=("n",))
def greedy_propose(drafter, state, lengths, n):
  return drafter.propose(state, None, lengths, jax.random.key(0), GREEDY, n)


@jax.jit
def drafter_update(drafter, drafted, seq_len, features):
  return drafter.update(drafted, seq_len, features)


def test_incremental_state_matches_teacher_forcing(target, drafter):
  seq = [5, 17, 3, 44, 2, 9, 61, 30, 12, 8, 50, 7, 33]
  P, gamma = 6, 4
  hidden = target_hidden(target, TARGET, seq)
  want = teacher_forced(drafter, seq, hidden)  # [1, n - 1, E]
  cache_size = 32
  prompt = jnp.asarray([seq[:P] + [0, 0]])
  # The prefill's features: each prompt position's state and the token after it (the target's
  # first sample, seq[P], after the last).
  state = drafter_init(drafter, prompt, jnp.asarray([P]), Features(
      hidden=jnp.pad(hidden[:, :P], ((0, 0), (0, 2), (0, 0))),
      tokens=jnp.asarray([seq[1:P + 1] + [0, 0]]), start=jnp.asarray([0])), cache_size=cache_size)
  np.testing.assert_allclose(state.next_feat, want[:, P - 1], atol=1e-5)
  # A round drafts (its pairs land in the cache), then verification keeps 3 tokens
  # seq[P+1 .. P+3]: the state must be as if those had been fed from the start.
  L = P + 1
  _, _, drafted = greedy_propose(drafter, state, jnp.asarray([L]), gamma)
  count = 3
  block = hidden[:, L - 1: L - 1 + gamma + 1]  # the verified block's states
  emitted = jnp.asarray([seq[L: L + gamma + 1]])
  state = drafter_update(drafter, drafted, jnp.asarray([L + count]),
                         Features(hidden=block, tokens=emitted, start=jnp.asarray([L - 1])))
  L += count
  assert int(state.cache.lengths[0]) == L - 1
  np.testing.assert_allclose(state.next_feat, want[:, L - 2], atol=1e-5)
  # Drafts 1 and 2 of the next round: from f̂_{L-1}, then from the pair (f̂_{L-1}, draft 1).
  tokens, probs, _ = greedy_propose(drafter, state, jnp.asarray([L]), 2)
  d1 = int(jnp.argmax(head_logits(drafter.head, want[0, L - 2])))
  feats = hidden.at[:, L - 1].set(want[:, L - 2])
  pred2 = teacher_forced(drafter, seq[:L] + [d1], feats)[:, L - 1]
  d2 = int(jnp.argmax(head_logits(drafter.head, pred2[0])))
  assert tokens.tolist() == [[d1, d2]]
  np.testing.assert_allclose(probs[0, 1], jax.nn.one_hot(d2, TARGET.vocab_size))


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_identical_to_autoregressive(target, drafter, gamma):
  want = generate(target, TARGET, PROMPTS, max_new_tokens=20).sequences()
  out = speculative_generate(target, TARGET, drafter, PROMPTS,
                             spec=SpecConfig(gamma=gamma, max_new_tokens=20))
  assert out.sequences() == want
  hist = np.asarray(out.accept_hist)
  assert hist[0] > 0 and hist[1:].sum() > 0  # rejections and acceptances both exercised


def test_a_drafter_for_a_target_of_another_width_is_refused(target):
  """A feature drafter trained for another target reads hidden states of another width: one
  clear error before any trace (an opt_einsum shape error before)."""
  narrow_cfg = dataclasses.replace(TARGET, hidden_size=32, num_heads=2)
  narrow = noisy_eagle(init_params(narrow_cfg, jax.random.key(1), scale=0.3), narrow_cfg)
  with pytest.raises(ValueError, match=r"reads a target of hidden size 32 .* this target's is 64"):
    speculative_generate(target, TARGET, narrow, PROMPTS[:1],
                         spec=SpecConfig(gamma=2, max_new_tokens=4))


def test_trimmed_greedy_identical(target):
  keep = np.arange(0, TARGET.vocab_size, 2)
  drafter = noisy_eagle(target, TARGET, keep_ids=keep)
  want = generate(target, TARGET, PROMPTS, max_new_tokens=16).sequences()
  out = speculative_generate(target, TARGET, drafter, PROMPTS,
                             spec=SpecConfig(gamma=3, max_new_tokens=16))
  assert out.sequences() == want


@pytest.fixture(scope="module")
def tiny_target():
  return init_params(TINY, jax.random.key(10), scale=0.8)


@pytest.mark.parametrize("name", ["t1", "t0.7-topk"])
def test_sampling_is_lossless(tiny_target, name):
  drafter = noisy_eagle(tiny_target, TINY, amount=0.8)
  sp = SAMPLINGS[name]
  stat, dof, ok = chi_square(sample_sequences(tiny_target, drafter, sp, gamma=2),
                             exact_distribution(tiny_target, sp))
  assert ok, (name, stat, dof)


def test_trimmed_sampling_is_lossless(tiny_target):
  drafter = noisy_eagle(tiny_target, TINY, amount=0.8, keep_ids=[0, 1, 3, 7, 8, 12])
  sp = SAMPLINGS["t1"]
  stat, dof, ok = chi_square(sample_sequences(tiny_target, drafter, sp, gamma=2),
                             exact_distribution(tiny_target, sp))
  assert ok, (stat, dof)


def test_one_program_no_recompile(target, drafter):
  assert_one_program(target, TARGET, drafter)


def test_bench_round_components_time_a_feature_drafter(target, drafter):
  import types
  from jspec.bench.speed import round_components_s
  model = types.SimpleNamespace(cfg=TARGET, params=target)
  round_s, verify_s = round_components_s(model, drafter, gamma=3, prompt_len=8, cache_size=64,
                                         repeats=2)
  assert round_s > 0 and verify_s > 0


@pytest.mark.parametrize("form, tied", [("int8", False), ("int8-native", True), ("q4", False),
                                        ("native-float", True)])
def test_the_targets_tables_are_read_as_it_stores_them(form, tied):
  """An EAGLE drafter over a quantized target borrows the target's embedding and head as stored:
  no dense float copy (an 8B target's is 2 GB each) and the head's matmul is the target's own,
  so its logits are the target's head applied to the drafter's features; greedy output stays
  the target's."""
  from jspec.models.llama import lm_head, native_float_params, quantize_params
  cfg = dataclasses.replace(TARGET, tie_embeddings=tied)
  dense = init_params(cfg, jax.random.key(0), scale=0.3)
  stored = {"int8": lambda p: quantize_params(p),
            "int8-native": lambda p: quantize_params(p, kernel="native"),
            "q4": lambda p: quantize_params(p, kernel="native", bits=4),
            "native-float": native_float_params}[form](dense)
  own = noisy_eagle(dense, cfg)  # the drafter's own weights float: only the tables vary
  drafter = eagle_drafter(own.params, own.cfg, stored)
  table = stored.embed if tied else stored.lm_head
  assert drafter.embed is stored.embed
  assert (drafter.head.embed if tied else drafter.head.lm_head) is table
  assert not isinstance(table, jax.Array)  # (the forms under test all store a weight object)
  feats = jax.random.normal(jax.random.key(4), (2, 3, cfg.hidden_size))
  np.testing.assert_array_equal(drafter._logits(feats), lm_head(stored, feats))
  # The drafter's proposals read the same rows the dense tables give (to the target's rounding).
  np.testing.assert_allclose(drafter._logits(feats),
                             head_logits(jnp.asarray(dense.embed if tied else dense.lm_head.T),
                                         feats), rtol=0.05, atol=0.3)
  want = generate(stored, cfg, PROMPTS, max_new_tokens=12).sequences()
  out = speculative_generate(stored, cfg, drafter, PROMPTS,
                             spec=SpecConfig(gamma=3, max_new_tokens=12))
  assert out.sequences() == want
