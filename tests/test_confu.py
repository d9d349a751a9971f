"""ConFu (jspec.models.confu, jspec.drafting.confu, jspec.train.confu): contemplate tokens and the
soft prompt ride in the verification forward without touching the block's logits; training
computes the very taps the engines hand the drafter; its training-time-test passes are the drafts
decoding makes; a zero projection is its EAGLE-3 drafter; output stays exactly the target's
(greedy chains and trees, the sampled law with a control that must fail); one program; the recipe
trains, saves, loads and is evaluated like EAGLE-3's; bad input is refused."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.drafting.base import Features
from jspec.drafting.confu import confu_drafter
from jspec.drafting.feature import EagleDrafter
from jspec.generate import generate
from jspec.models.cache import KVCache
from jspec.models.confu import contemplate_embeddings, init_contemplate
from jspec.models.llama import init_params
from jspec.sampling.processing import SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate
from jspec.speculative.probing import causal, prefill_layout, probe_layout
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from jspec.train.confu import confu_passes, contemplate_taps as contemplate_taps_eager, draw_anchors
from tests.test_eagle3 import TARGET, TINY, misreport_q, noisy_eagle3
from tests.test_speculative import (PROMPTS, SAMPLINGS, assert_one_program, chi_square,
                                    exact_distribution, sample_sequences)
# Jitted: op by op, the target's forwards here compiled several hundred small programs.
from tiny_models import jitted_forward as forward

contemplate_taps = jax.jit(contemplate_taps_eager, static_argnums=(1, 6))

SEQ = [5, 17, 3, 44, 2, 9, 61, 30, 12, 8, 50, 7, 33]


def make_confu(target, cfg, amount=0.02, proj=0.05, key=5, keep_ids=None, soft=2):
  base = noisy_eagle3(target, cfg, amount=amount, keep_ids=keep_ids)
  cp = init_contemplate(target, cfg, jax.random.key(key), experts=4, soft_tokens=soft)
  cp = dataclasses.replace(
      cp, router=cp.router * 50,  # routes that differ from token to token
      proj=proj * jax.random.normal(jax.random.key(key + 1), cp.proj.shape))
  return confu_drafter(base.params, cp, base.cfg, keep_ids, target_params=target)


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def drafter(target):
  return make_confu(target, TARGET)


@functools.partial(jax.jit, static_argnums=(2, 3))  # (op by op: 170 programs a test)
def verification(target, drafter, P, T, soft_inputs=None):
  """(block logits, taps) of a verification forward over SEQ[P-1 : P-1+T] after SEQ[:P-1], with
  the drafter's contemplate tokens and soft prompt."""
  cache = KVCache.init(TARGET, 1, 48)
  _, _, cache = forward(target, TARGET, jnp.asarray([SEQ[:P - 1]]), jnp.arange(P - 1)[None],
                        cache)
  cache = cache.with_lengths(jnp.asarray([P - 1]))
  block = jnp.asarray([SEQ[P - 1:P - 1 + T]])
  mask, pos = probe_layout(causal(1, T), (P - 1 + jnp.arange(T))[None], 1, drafter.soft_tokens)
  inputs = drafter.probe_inputs(None, block)
  if soft_inputs is not None:
    inputs = inputs.at[:, T:].set(soft_inputs)
  logits, hidden, _ = forward(target, TARGET, block, pos, cache, mask, appended=inputs,
                              logits_indices=jnp.arange(T)[None], taps=drafter.feature_layers)
  return logits, hidden


def test_contemplate_tokens_leave_the_block_exact_and_see_the_soft_prompt(target, drafter):
  P, T = 5, 4
  logits, hidden = verification(target, drafter, P, T)
  cache = KVCache.init(TARGET, 1, 48)
  plain, _, _ = forward(target, TARGET, jnp.asarray([SEQ[:P - 1 + T]]),
                        jnp.arange(P - 1 + T)[None], cache)
  np.testing.assert_allclose(logits, plain[:, P - 1:], rtol=1e-5, atol=1e-5)
  # Another soft prompt moves every contemplate token and leaves the block as it was.
  other = jnp.full((1, 2, TARGET.hidden_size), 0.7)
  logits2, hidden2 = verification(target, drafter, P, T, soft_inputs=other)
  np.testing.assert_allclose(logits2, logits, rtol=1e-6, atol=1e-6)
  moved = jnp.max(jnp.abs(hidden2[:, T:2 * T] - hidden[:, T:2 * T]), axis=-1)[0]
  assert bool(jnp.all(moved > 1e-3)), moved


taps_at = jax.jit(contemplate_taps, static_argnums=(1, 6))


def test_training_computes_the_taps_the_engines_hand_over(target, drafter):
  """A training anchor's contemplate taps = the verification forward's for the contemplate after
  the last prompt token (prefill) and after the root of a round (no draft accepted)."""
  seq = jnp.asarray([SEQ])
  for P in (3, 7):
    L = jnp.asarray([P])
    mask, pos = prefill_layout(L, P, 1, drafter.soft_tokens)
    _, hidden, _ = forward(target, TARGET, seq[:, :P], pos, KVCache.init(TARGET, 1, 32), mask,
                           appended=drafter.prompt_probe_inputs(seq[:, :P], L),
                           taps=drafter.feature_layers)
    got = taps_at(target, TARGET, drafter.contemplate, drafter.embed, seq,
                  jnp.asarray([[P - 1, 0, 9]]), drafter.feature_layers)
    np.testing.assert_allclose(got[:, 0], hidden[:, P], rtol=1e-4, atol=1e-3)
  P, T = 5, 4
  _, hidden = verification(target, drafter, P, T)
  got = taps_at(target, TARGET, drafter.contemplate, drafter.embed, seq,
                jnp.asarray([[P - 1]]), drafter.feature_layers)
  np.testing.assert_allclose(got[:, 0], hidden[:, T], rtol=1e-4, atol=1e-3)
  # The soft prompt and the experts get gradients through the frozen target.
  grads = jax.jit(jax.grad(lambda cp: jnp.sum(contemplate_taps(
      target, TARGET, cp, drafter.embed, seq, jnp.asarray([[3, 6]]),
      drafter.feature_layers) ** 2)))(drafter.contemplate)
  assert float(jnp.abs(grads.soft).max()) > 0 and float(jnp.abs(grads.experts).max()) > 0


def test_the_router_mixes_top_k_experts(drafter):
  cp = drafter.contemplate
  tokens = jnp.arange(TARGET.vocab_size)
  got = contemplate_embeddings(cp, TARGET, drafter.embed, tokens)  # [V, E]
  e = drafter.embed[tokens]
  e = e / jnp.sqrt(jnp.mean(e * e, -1, keepdims=True) + TARGET.rms_norm_eps)
  scores = np.asarray(e @ cp.router)
  for v in range(TARGET.vocab_size):
    top = np.argsort(-scores[v])[:cp.top_k]
    w = np.exp(scores[v, top] - scores[v, top].max())
    want = (w / w.sum()) @ np.asarray(cp.experts)[top]
    np.testing.assert_allclose(got[v], want, rtol=1e-4, atol=1e-4)
  assert len({tuple(np.argsort(-s)[:cp.top_k]) for s in scores}) > 1  # routes differ


def test_tied_router_scores_still_mix_exactly_top_k_experts(drafter):
  """Two experts with the same router column tie on every token: top_k=1 must take one of them
  (the lower index), not average both."""
  cp = drafter.contemplate
  router = cp.router.at[:, 1].set(cp.router[:, 0])
  experts = cp.experts.at[1].set(cp.experts[0] + 1.0)
  tied = dataclasses.replace(cp, router=router, experts=experts, top_k=1)
  tokens = jnp.arange(TARGET.vocab_size)
  got = np.asarray(contemplate_embeddings(tied, TARGET, drafter.embed, tokens))  # [V, E]
  e = drafter.embed[tokens]
  e = e / jnp.sqrt(jnp.mean(e * e, -1, keepdims=True) + TARGET.rms_norm_eps)
  best = np.argmax(np.asarray(e @ router), axis=-1)  # numpy's argmax: the first of ties
  assert (best == 0).any()  # tokens routed to the tied pair
  np.testing.assert_allclose(got, np.asarray(experts)[best], rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=2)
def prefilled(drafter, target, P):
  """The drafter's state after the prompt SEQ[:P], from the engines' prefill layout."""
  seq = jnp.asarray([SEQ[:P]])
  L = jnp.asarray([P])
  mask, pos = prefill_layout(L, P, 1, drafter.soft_tokens)
  _, hidden, _ = forward(target, TARGET, seq, pos, KVCache.init(TARGET, 1, 32), mask,
                         appended=drafter.prompt_probe_inputs(seq, L),
                         taps=drafter.feature_layers)
  return drafter.init(seq, L, 32, Features(
      hidden=hidden[:, :P], tokens=jnp.asarray([SEQ[1:P + 1]]), start=jnp.asarray([0]),
      probe_hidden=hidden[:, P:P + 1]))


def test_training_time_test_passes_are_the_drafts_decoding_makes(target, drafter):
  """With one anchor at j, pass s at j is the (s + 1)-th draft `propose` makes after the prompt
  t_0 .. t_j with the true tokens forced: the contemplate feature in the anchor's pair and in
  every draft (future prediction replication) exactly as decoding feeds it."""
  from jspec.models.confu import ConFuParams
  from jspec.train.eagle3 import ttt_logits
  steps = 4
  seq = jnp.asarray([SEQ])
  _, taps, _ = forward(target, TARGET, seq, jnp.arange(len(SEQ))[None],
                       KVCache.init(TARGET, 1, len(SEQ)), taps=drafter.feature_layers)
  params = ConFuParams(drafter.params, drafter.contemplate)

  @functools.partial(jax.jit, static_argnums=0)  # (op by op: 509 programs)
  def passes_and_drafts(j, params, drafter, target, taps):
    batch = {"target": target, "embed": drafter.embed, "tokens": seq, "feats": taps,
             "anchors": jnp.asarray([[j]])}
    passes = confu_passes(params, drafter.cfg, TARGET, batch, steps)
    state = prefilled(drafter, target, j + 1)
    truth = jnp.asarray(SEQ[j + 2: j + 2 + steps])
    force = lambda i, tokens, token, probs: (jnp.full_like(token, truth[i]), probs,
                                             jnp.zeros(token.shape, bool))
    _, q, _ = drafter.propose(state, None, jnp.asarray([j + 2]), jax.random.key(0),
                              SamplingParams(temperature=1.0), steps, pick=force)
    plain = ttt_logits(drafter.params, drafter.cfg, drafter.embed, seq, taps, steps)
    return passes, q, plain

  for j in (2, 6):
    passes, q, plain = passes_and_drafts(j, params, drafter, target, taps)
    for s in range(steps):
      np.testing.assert_allclose(q[0, s], jax.nn.softmax(passes[s][0, j]), atol=3e-5,
                                 err_msg=f"chain after pair {j}, draft {s + 1}")
      # ... and the contemplate signal is in it: without it the drafts differ.
      assert float(jnp.max(jnp.abs(jax.nn.softmax(plain[s][0, j]) - q[0, s]))) > 1e-4


def test_a_zero_projection_is_its_eagle3_drafter(target):
  confu = make_confu(target, TARGET, proj=0.0)
  eagle3 = EagleDrafter(params=confu.params, embed=confu.embed, head=None, cfg=confu.cfg)
  key = jax.random.key(3)
  sp = SamplingParams(temperature=1.0)
  P = 6
  state = prefilled(confu, target, P)
  base = eagle3.init(jnp.asarray([SEQ[:P]]), jnp.asarray([P]), 32, Features(
      hidden=prefilled_taps(target, confu, P), tokens=jnp.asarray([SEQ[1:P + 1]]),
      start=jnp.asarray([0])))
  propose = jax.jit(lambda d, state: d.propose(state, None, jnp.asarray([P + 1]), key, sp, 3))
  a, b = propose(confu, state), propose(eagle3, base)
  np.testing.assert_allclose(a[1], b[1], atol=1e-5)
  assert a[0].tolist() == b[0].tolist()


def prefilled_taps(target, drafter, P):
  _, taps, _ = forward(target, TARGET, jnp.asarray([SEQ[:P]]), jnp.arange(P)[None],
                       KVCache.init(TARGET, 1, 32), taps=drafter.feature_layers)
  return taps


def test_greedy_chains_and_trees_identical_to_autoregressive(target, drafter):
  want = generate(target, TARGET, PROMPTS, max_new_tokens=20).sequences()
  out = speculative_generate(target, TARGET, drafter, PROMPTS,
                             spec=SpecConfig(gamma=3, max_new_tokens=20))
  assert out.sequences() == want
  assert np.asarray(out.accept_hist)[1:].sum() > 0  # some drafts were accepted
  trimmed = make_confu(target, TARGET, keep_ids=np.arange(0, TARGET.vocab_size, 2), soft=3)
  out = tree_speculative_generate(target, TARGET, trimmed, PROMPTS,
                                  spec=TreeSpecConfig("fixed:3-2-1", max_new_tokens=20))
  assert out.sequences() == want
  assert np.asarray(out.accept_hist)[1:].sum() > 0


@pytest.fixture(scope="module")
def tiny_target():
  return init_params(TINY, jax.random.key(10), scale=0.8)


@pytest.mark.parametrize("q_reported", ["drawn from", "uniform (control)"])
def test_sampling_is_lossless(tiny_target, monkeypatch, q_reported):
  """The control reports a q other than the one the drafts were drawn from; the same test must
  catch it."""
  drafter = make_confu(tiny_target, TINY, amount=0.8, proj=0.3)
  if q_reported != "drawn from":
    misreport_q(monkeypatch, jnp.full((TINY.vocab_size,), 1 / TINY.vocab_size))
  sp = SAMPLINGS["t1"]
  stat, dof, ok = chi_square(sample_sequences(tiny_target, drafter, sp, gamma=2, cfg=TINY),
                             exact_distribution(tiny_target, sp, cfg=TINY))
  assert ok == (q_reported == "drawn from"), (stat, dof)


def test_one_program_no_recompile(target, drafter):
  assert_one_program(target, TARGET, drafter)


def test_anchors_are_distinct_scored_positions_and_reproducible():
  mask = np.zeros((3, 20), np.float32)
  mask[0, 5:15] = 1
  mask[1, 2:4] = 1  # two scored pairs only: the anchors repeat the last
  idx = np.asarray([4, 9, 11])
  a = draw_anchors(mask, 4, idx)
  assert a.shape == (3, 4)
  assert len(set(a[0])) == 4 and all(mask[0, j + 1] > 0 for j in a[0])
  assert list(a[1]) == [1, 2, 2, 2] and list(a[2]) == [0, 0, 0, 0]
  np.testing.assert_array_equal(draw_anchors(mask, 4, idx), a)
  np.testing.assert_array_equal(draw_anchors(mask, 0, idx)[0], np.arange(19))


def test_refusals(target, drafter):
  bad = dataclasses.replace(drafter.contemplate, proj=jnp.zeros((3, 3)))
  with pytest.raises(ValueError, match="do not fit"):
    confu_drafter(drafter.params, bad, drafter.cfg, target_params=target)
  with pytest.raises(ValueError, match="top_k"):
    init_contemplate(target, TARGET, jax.random.key(0), experts=2, top_k=3)
