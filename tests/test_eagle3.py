"""EAGLE-3's drafter (jspec.models.eagle3 through jspec.drafting.feature): the target's taps are
the residual stream entering the fused layers, the drafter's incremental state matches a
from-scratch teacher-forced pass (target features fused for known positions, its own outputs
past them), speculative output stays exactly the target's (greedy chains and trees, sampled
distribution), one compiled program."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.drafting.base import Features
from jspec.drafting.feature import EagleDrafter, eagle3_drafter
from jspec.generate import generate
from jspec.models import eagle3
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import decoder_layer, init_params, rope_tables
from jspec.sampling.processing import SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from tests.test_eagle import drafter_init, drafter_update, greedy_propose
from tests.test_speculative import assert_one_program, PROMPTS, SAMPLINGS, chi_square, exact_distribution, \
    sample_sequences
from tiny_models import jitted_forward

# Four layers: the taps are layers 1, 2, 3 (2, L/2, L-3 coincide on so few).
TARGET = Config(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
TINY = Config(arch="llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=4,
              num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)


def noisy_eagle3(target_params, cfg, key=3, amount=0.3, keep_ids=None):
  """init_eagle3 plus random weights, so every part of the network matters in every check."""
  params, dcfg = eagle3.init_eagle3(target_params, cfg, jax.random.key(0), keep_ids)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(key), len(leaves))
  leaves = [x + amount * jax.random.normal(k, x.shape) if x.ndim > 1 else x
            for x, k in zip(leaves, keys)]
  return eagle3_drafter(jax.tree.unflatten(tree, leaves), dcfg, keep_ids,
                        target_params=target_params)


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def drafter(target):
  # Little noise: an untrained drafter agrees with the target rarely, and the greedy checks want
  # rounds that accept drafts as well as rounds that reject them.
  return noisy_eagle3(target, TARGET, amount=0.02)


def test_fusion_taps():
  assert eagle3.fusion_taps(32) == (2, 16, 29)  # Llama-3.1-8B, as the reference code taps
  assert eagle3.fusion_taps(30) == (2, 15, 27)  # the default model
  assert eagle3.fusion_taps(6) == (1, 3, 5)
  assert eagle3.fusion_taps(4) == (1, 2, 3)
  with pytest.raises(ValueError, match="too few"):
    eagle3.fusion_taps(3)


def test_taps_are_the_residual_stream_entering_the_layers(target):
  seq = jnp.asarray([[5, 17, 3, 44, 2]])
  positions = jnp.arange(5)[None]
  cache = KVCache.init(TARGET, 1, 8)
  _, hidden, _ = jitted_forward(target, TARGET, seq, positions, cache, taps=(3, 1))
  # By hand: the embedding through the layers, the stream kept before layers 3 and 1 (in the
  # order asked).
  x = target.embed[seq]
  cos, sin = rope_tables(TARGET, positions)
  from jspec.models.attention import attention_fn
  attend = attention_fn(TARGET, cache.lengths, cache.size, None, 5)
  slots = jnp.arange(5)[None]
  want, k, v = {}, cache.k, cache.v
  for i, lp in enumerate(target.layers):
    want[i] = x
    x, k, v = decoder_layer(TARGET, x, lp, i, k, v, cos, sin, slots, attend)
  # Within float32 rounding of values up to ~40 (at full XLA optimisation the jitted forward fuses
  # multiply-adds the op-by-op reference rounds apart: 4e-5 seen); another layer's is O(1) off.
  np.testing.assert_allclose(hidden, jnp.concatenate([want[3], want[1]], axis=-1), rtol=1e-5,
                             atol=1e-4)
  assert hidden.shape == (1, 5, 2 * TARGET.hidden_size)


def target_taps(params, cfg, seq, taps):
  n = len(seq)
  _, hidden, _ = jitted_forward(params, cfg, jnp.asarray([seq]), jnp.arange(n)[None],
                                KVCache.init(cfg, 1, n), taps=taps)
  return hidden  # [1, n, 3E]


def teacher_forced(drafter, seq, feats):
  """h of every pair (feats[j], seq[j + 1]) from scratch, feats already fused: [1, n - 1, E]."""
  return _teacher_forced(drafter, jnp.asarray([seq]), feats)


@jax.jit
def _teacher_forced(drafter, seq, feats):  # (op by op, each shape compiled every op)
  n = seq.shape[1]
  cache = KVCache.init(drafter.cfg, 1, n)
  h, _ = eagle3.eagle3_forward(drafter.params, drafter.cfg, drafter.embed, seq[:, 1:],
                               feats[:, : n - 1], jnp.arange(n - 1)[None], cache)
  return h


def test_incremental_state_matches_teacher_forcing(target, drafter):
  seq = [5, 17, 3, 44, 2, 9, 61, 30, 12, 8, 50, 7, 33]
  P, gamma = 6, 4
  taps = target_taps(target, TARGET, seq, drafter.feature_layers)
  fused = eagle3.fuse(drafter.params, taps)  # [1, n, E]
  want = teacher_forced(drafter, seq, fused)
  prompt = jnp.asarray([seq[:P] + [0, 0]])
  state = drafter_init(drafter, prompt, jnp.asarray([P]), Features(
      hidden=jnp.pad(taps[:, :P], ((0, 0), (0, 2), (0, 0))),
      tokens=jnp.asarray([seq[1:P + 1] + [0, 0]]), start=jnp.asarray([0])))
  np.testing.assert_allclose(state.next_feat, want[:, P - 1], rtol=1e-5, atol=1e-4)
  L = P + 1
  _, _, drafted = greedy_propose(drafter, state, jnp.asarray([L]), gamma)
  count = 3  # verification keeps seq[P+1 .. P+3]
  state = drafter_update(drafter, drafted, jnp.asarray([L + count]), Features(
      hidden=taps[:, L - 1: L + gamma], tokens=jnp.asarray([seq[L: L + gamma + 1]]),
      start=jnp.asarray([L - 1])))
  L += count
  assert int(state.cache.lengths[0]) == L - 1
  np.testing.assert_allclose(state.next_feat, want[:, L - 2], rtol=1e-5, atol=1e-4)
  # Draft 1 from h at the last known position; draft 2 reads the drafter's own h (no fc), the
  # training-time-test case.
  tokens, _, _ = greedy_propose(drafter, state, jnp.asarray([L]), 2)
  score = lambda h: int(jnp.argmax(eagle3.logits(drafter.params, drafter.cfg, h)))
  d1 = score(want[0, L - 2])
  feats = fused.at[:, L - 1].set(want[:, L - 2])
  d2 = score(teacher_forced(drafter, seq[:L] + [d1], feats)[0, L - 1])
  assert tokens.tolist() == [[d1, d2]]


def test_greedy_chain_identical_to_autoregressive(target, drafter):
  want = generate(target, TARGET, PROMPTS, max_new_tokens=20).sequences()
  out = speculative_generate(target, TARGET, drafter, PROMPTS,
                             spec=SpecConfig(gamma=3, max_new_tokens=20))
  assert out.sequences() == want
  hist = np.asarray(out.accept_hist)
  assert hist[0] > 0 and hist[1:].sum() > 0  # rejections and acceptances both exercised


def test_greedy_tree_and_trimmed_vocabulary_identical(target):
  want = generate(target, TARGET, PROMPTS, max_new_tokens=16).sequences()
  trimmed = noisy_eagle3(target, TARGET, amount=0.02,
                         keep_ids=np.arange(0, TARGET.vocab_size, 2))
  out = tree_speculative_generate(target, TARGET, trimmed, PROMPTS,
                                  spec=TreeSpecConfig("fixed:3-2-1", max_new_tokens=16))
  assert out.sequences() == want
  assert np.asarray(out.accept_hist)[1:].sum() > 0  # some tree paths were accepted
  out = speculative_generate(target, TARGET, trimmed, PROMPTS,
                             spec=SpecConfig(gamma=3, max_new_tokens=16))
  assert out.sequences() == want
  assert np.asarray(out.accept_hist)[1:].sum() > 0  # some drafts were accepted


@pytest.fixture(scope="module")
def tiny_target():
  return init_params(TINY, jax.random.key(10), scale=0.8)


def misreport_q(monkeypatch, reported):
  """Feature drafters report `reported` [V] as q whatever they drew from (the control)."""
  real = EagleDrafter.sampler

  def misreported(self, sampling):
    draw = real(self, sampling)
    return lambda key, logits: (draw(key, logits)[0],
                                jnp.broadcast_to(reported, (logits.shape[0],) + reported.shape))
  monkeypatch.setattr(EagleDrafter, "sampler", misreported)


@pytest.mark.parametrize("q_reported", ["drawn from", "uniform (control)"])
def test_sampling_is_lossless(tiny_target, monkeypatch, q_reported):
  """A trimmed draft vocabulary (most target tokens ones the drafter cannot propose): the check
  covers the head's map back to target ids too. The control reports a q other than the one the
  drafts were drawn from, and the same test must catch it."""
  keep = [0, 1, 3, 7, 8, 12]
  drafter = noisy_eagle3(tiny_target, TINY, amount=0.8, keep_ids=keep)
  if q_reported != "drawn from":
    misreport_q(monkeypatch, jnp.zeros((TINY.vocab_size,)).at[jnp.asarray(keep)].set(1 / len(keep)))
  sp = SAMPLINGS["t1"]
  stat, dof, ok = chi_square(sample_sequences(tiny_target, drafter, sp, gamma=2, cfg=TINY),
                             exact_distribution(tiny_target, sp, cfg=TINY))
  assert ok == (q_reported == "drawn from"), (stat, dof)


def test_one_program_no_recompile(target, drafter):
  assert_one_program(target, TARGET, drafter)


def test_a_head_without_its_vocabulary_is_refused(target):
  params, dcfg = eagle3.init_eagle3(target, TARGET, jax.random.key(0), np.arange(10))
  with pytest.raises(ValueError, match="keep_ids"):
    eagle3_drafter(params, dcfg, target_params=target)
  with pytest.raises(ValueError, match="12 ids"):
    eagle3_drafter(params, dcfg, np.arange(12), target_params=target)


def test_weights_that_do_not_fit_the_target_are_refused_before_a_trace(target):
  """check_weights compared only the borrowed table with the target: taps=() (the dataclass
  default), two taps, or a narrower target's weights failed as an einsum's label sizes in the
  engine's trace; neither embed nor target_params read .embed off None."""
  params, dcfg = eagle3.init_eagle3(target, TARGET, jax.random.key(0))
  narrow = dataclasses.replace(TARGET, hidden_size=32, head_dim=8)
  small_params, _ = eagle3.init_eagle3(init_params(narrow, jax.random.key(1)), narrow,
                                       jax.random.key(0))
  spec = SpecConfig(gamma=2, max_new_tokens=4)
  for bad, match in ((dataclasses.replace(params, taps=()), r"three target layers.*\(\)"),
                     (dataclasses.replace(params, taps=(1, 2)), r"taps are \(1, 2\)"),
                     (small_params, r"fc \(96, 32\).*the target's width 64")):
    with pytest.raises(ValueError, match=match):
      speculative_generate(target, TARGET, eagle3_drafter(bad, dcfg, target_params=target),
                           PROMPTS, spec=spec)
  with pytest.raises(ValueError, match="embed=.*or target_params="):
    eagle3_drafter(params, dcfg)


def test_training_time_test_passes_are_the_drafts_decoding_makes(target, drafter):
  """Pass s of the training-time test at index j is the (s + 1)-th draft of a chain that starts
  after pair j, drafted with the true tokens fed: the same distribution `propose` gives."""
  from jspec.train.eagle3 import ttt_logits
  seq = [5, 17, 3, 44, 2, 9, 61, 30, 12, 8, 50, 7, 33]
  steps = 4
  taps = target_taps(target, TARGET, seq, drafter.feature_layers)
  passes = jax.jit(ttt_logits, static_argnums=(1, 5))(  # (op by op: ~300 programs)
      drafter.params, drafter.cfg, drafter.embed, jnp.asarray([seq]), taps, steps)

  @functools.partial(jax.jit, static_argnums=0)
  def forced_drafts(P, drafter, taps):
    state = drafter.init(jnp.asarray([seq[:P]]), jnp.asarray([P]), 32, Features(
        hidden=taps[:, :P], tokens=jnp.asarray([seq[1:P + 1]]), start=jnp.asarray([0])))
    truth = jnp.asarray(seq[P + 1: P + 1 + steps])
    force = lambda i, tokens, token, probs: (jnp.full_like(token, truth[i]), probs,
                                             jnp.zeros(token.shape, bool))
    return drafter.propose(state, None, jnp.asarray([P + 1]), jax.random.key(0),
                           SamplingParams(temperature=1.0), steps, pick=force)[1]

  for j in (0, 6):
    q = forced_drafts(j + 1, drafter, taps)  # prompt t_0 .. t_j: pairs 0 .. j hold features
    for s in range(steps):
      np.testing.assert_allclose(q[0, s], jax.nn.softmax(passes[s][0, j]), atol=2e-5,
                                 err_msg=f"chain after pair {j}, draft {s + 1}")


def test_bench_round_components_time_an_eagle3_drafter(target, drafter):
  import types
  from jspec.bench.speed import round_components_s
  model = types.SimpleNamespace(cfg=TARGET, params=target)
  round_s, verify_s = round_components_s(model, drafter, gamma=3, prompt_len=8, cache_size=64,
                                         repeats=2)
  assert round_s > 0 and verify_s > 0
