"""Adaptive draft length (`Drafter.with_stop`): a chain that ends early is verified only up to its
end, a round in which no row drafts runs a one-token target step, output stays the target's
(greedy identity for every drafter kind that stops, the sampled law), and the stop rule itself
(the drafter's confidence, the lookup's first miss) ends chains where it says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.drafting.base import draft_chain, unsure, valid_drafts
from jspec.drafting.model import ModelDrafter
from jspec.drafting.ngram import ngram_drafter
from jspec.drafting.probe import probe_drafter
from jspec.generate import generate
from jspec.models.llama import init_params
from jspec.sampling.processing import SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate
from test_datastore import rest_drafter
from test_eagle import noisy_eagle
from test_ngram import REPEATING
from test_speculative import (PROMPTS, TARGET, TINY, chi_square, exact_distribution,
                              noised_drafter, sample_sequences)

PROMPT_SET = PROMPTS[:2] + REPEATING[:2]


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


def test_draft_chain_ends_each_row_at_its_first_unsure_draft():
  """Row 0 is sure at drafts 0 and 1, unsure at 2; row 1 unsure at once: drafts -1 from there
  on, and the loop stops feeding once both rows have ended (3 of 5 steps)."""
  V, G = 8, 5
  sure, unsure_logits = jnp.eye(V)[1] * 20.0, jnp.zeros(V)
  plan = jnp.stack([jnp.stack([sure, sure, unsure_logits, sure, sure]),
                    jnp.stack([unsure_logits] * G)])  # [B, G, V]: logits of each draft
  fed = []

  def step(i, prev):
    fed.append(i)
    return jax.lax.dynamic_index_in_dim(plan, i, 1, False), i + 1

  sample = lambda key, logits: (jnp.argmax(logits, -1).astype(jnp.int32),
                                jax.nn.softmax(logits, -1))
  tokens, _, steps = jax.jit(lambda: draft_chain(jax.random.key(0), G, plan[:, 0], jnp.int32(1),
                                                 step, sample, stop=unsure(0.5)))()
  np.testing.assert_array_equal(np.asarray(tokens), [[1, 1, -1, -1, -1], [-1] * G])
  assert int(steps) == 3  # fed drafts 1 and 2, then every row had ended
  drafts, n_valid = valid_drafts(tokens)
  assert list(np.asarray(n_valid)) == [2, 0] and int(drafts.min()) == 0


def test_a_lookup_match_stands_against_the_fallbacks_stop():
  """ngram+X@P: where the lookup matches, its draft stands whatever the fallback's confidence
  (so a row's drafts do not depend on the other rows: the round in which every row matches
  skips the fallback and keeps them all, a batch with a fresh row ran the stop over them)."""
  from jspec.drafting.base import Features
  from jspec.models.config import Config
  from jspec.sampling.processing import GREEDY
  draft_cfg = Config(arch="llama", vocab_size=TARGET.vocab_size, hidden_size=32,
                     intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16, max_position_embeddings=256)
  fallback = ModelDrafter(init_params(draft_cfg, jax.random.key(5), scale=0.3), draft_cfg)
  drafter = ngram_drafter(TARGET.vocab_size, fallback=fallback).with_stop(0.99)
  repeating, fresh = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 7, 6, 5, 11, 12, 13, 14, 10]

  def drafts(rows):
    prompts = jnp.asarray(rows, jnp.int32)
    n = jnp.full((len(rows),), prompts.shape[1], jnp.int32)
    features = Features(hidden=jnp.zeros((len(rows), prompts.shape[1], TARGET.hidden_size)),
                        tokens=prompts, start=jnp.zeros_like(n))
    state = drafter.init(prompts, n, 32, features)
    return np.asarray(drafter.propose(state, prompts[:, -2:], n, jax.random.key(0), GREEDY,
                                      3)[0])
  np.testing.assert_array_equal(drafts([repeating]), [[3, 4, 1]])
  np.testing.assert_array_equal(drafts([repeating, fresh])[0], [3, 4, 1])


def test_a_round_with_no_draft_is_a_one_token_step(target):
  """A prompt without a repeated 2-gram: the stop-on-miss lookup drafts nothing in the one round,
  which then verifies nothing (the narrow one-token forward) and emits the target's token."""
  lookup = ngram_drafter(TARGET.vocab_size, 2, 4).with_stop(1.0)
  fresh = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
  out = speculative_generate(target, TARGET, lookup, fresh, spec=SpecConfig(3, 2))
  assert int(out.rounds) == 1 and list(np.asarray(out.accept_hist)) == [1, 0, 0, 0]
  assert out.sequences() == generate(target, TARGET, fresh, max_new_tokens=2).sequences()


KINDS = {
    "ngram": lambda t: ngram_drafter(TARGET.vocab_size).with_stop(1.0),
    "model": lambda t: noised_drafter(t, 0.5).with_stop(0.6),
    "ngram+model": lambda t: ngram_drafter(TARGET.vocab_size,
                                           fallback=noised_drafter(t, 0.5)).with_stop(0.6),
    "mtp": lambda t: probe_drafter(t, TARGET, 3).with_stop(0.2),
    "rest": lambda t: rest_drafter(t, prompts=PROMPT_SET[2:], n_min=2).with_stop(1.0),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_stopping_drafters_are_greedy_identical_to_autoregressive(target, kind):
  ar = generate(target, TARGET, PROMPT_SET, max_new_tokens=14).sequences()
  out = speculative_generate(target, TARGET, KINDS[kind](target), PROMPT_SET,
                             spec=SpecConfig(gamma=3, max_new_tokens=14))
  assert out.sequences() == ar, kind


def test_a_stopping_model_drafter_keeps_the_sampled_law():
  target = init_params(TINY, jax.random.key(10), scale=0.8)
  drafter = ModelDrafter(init_params(TINY, jax.random.key(11), scale=0.8), TINY).with_stop(0.3)
  sp = SamplingParams(temperature=1.0)
  stat, dof, ok = chi_square(sample_sequences(target, drafter, sp, gamma=3),
                             exact_distribution(target, sp))
  assert ok, (stat, dof)


def test_drafters_that_cannot_stop_and_bad_thresholds_are_refused(target):
  with pytest.raises(ValueError, match=r"no adaptive draft length: drop the stop threshold "
                                       r"\(the @P of a drafter name NAME@P\)"):
    noisy_eagle(target, TARGET, amount=0.1).with_stop(0.5)
  with pytest.raises(ValueError, match=r"probability in \(0, 1\]"):
    noised_drafter(target, 0.5).with_stop(0.0)
  with pytest.raises(ValueError, match=r"probability in \(0, 1\]"):
    ngram_drafter(TARGET.vocab_size).with_stop(1.5)
