"""Layer-skip self-speculation (jspec.drafting.skip): the kept layers run exactly as the target's,
the draft reads the target's committed KV and leaves nothing behind, output stays the target's
(greedy identity, the sampled law with a control that must fail), the calibration skips the
layers that change the residual stream least, and bad skip sets are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.drafting.ngram import ngram_drafter
from jspec.drafting.skip import (SkipDrafter, calibrated_layers, layer_influence, skip_drafter)
from jspec.generate import generate
from jspec.models.cache import KVCache
from jspec.models.llama import forward_layers, init_params
from jspec.sampling.processing import SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from test_ngram import REPEATING
from tiny_models import jitted_forward
from test_speculative import (PROMPTS, TARGET, TINY, chi_square, exact_distribution, own_program,
                              sample_sequences)

DEEP = dataclasses.replace(TARGET, num_layers=4)
DEEP_TINY = dataclasses.replace(TINY, num_layers=3)
PROMPT_SET = PROMPTS[:2] + REPEATING[:2]
jitted_layers = jax.jit(forward_layers, static_argnums=(1, 5))  # keep: the layers, static


@pytest.fixture(scope="module")
def deep():
  return init_params(DEEP, jax.random.key(3), scale=0.3)


def test_kept_layers_compute_what_a_model_of_those_layers_does(deep):
  keep = (0, 2, 3)
  tokens = jnp.asarray([[4, 8, 15, 16, 23, 42]])
  positions = jnp.arange(6)[None]
  got, cache = jitted_layers(deep, DEEP, tokens, positions, KVCache.init(DEEP, 1, 8), keep)
  sub_cfg = dataclasses.replace(DEEP, num_layers=3)
  sub = dataclasses.replace(deep, layers=[deep.layers[i] for i in keep])
  want, _, _ = jitted_forward(sub, sub_cfg, tokens, positions, KVCache.init(sub_cfg, 1, 8))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
  # The skipped layer's cache entries were not written.
  assert float(jnp.abs(cache.k[1]).max()) == 0.0 and float(jnp.abs(cache.k[2]).max()) > 0.0


@pytest.mark.parametrize("evicted", [0, 3])
def test_the_draft_reads_the_targets_kv_and_leaves_the_length(deep, evicted):
  """After a full-model prefill, the draft's q at each of its steps (T=1) is the kept layers'
  softmax over the target's own cached entries and the tokens it drafted before; its entries sit
  past the committed length, which is unchanged. Under a KV budget (`evicted` entries dropped before:
  seq_len - 1 exceeds the cache's length) the slots follow the kept entries and the RoPE positions
  count the evicted ones: read at the slots' positions, q would differ."""
  prompt = jnp.asarray([[4, 8, 15, 16, 23]])
  cache = KVCache.init(DEEP, 1, 16)
  _, _, cache = jitted_forward(deep, DEEP, prompt, jnp.arange(5)[None], cache)
  cache = cache.commit(5)
  drafter = skip_drafter(deep, DEEP, (0, 3))
  last2 = jnp.asarray([[23, 42]])
  seq_len = 6 + evicted  # the root (42) is the last known token, not yet in the cache
  propose = jax.jit(lambda d, *args: d.propose_shared(*args, 3))  # op by op: 270 programs
  tokens, q, _, shared = propose(drafter, drafter.init(None, None, 0, None), cache, last2,
                                 jnp.asarray([seq_len]), jax.random.key(0),
                                 SamplingParams(temperature=1.0))
  assert int(shared.lengths[0]) == 5
  np.testing.assert_array_equal(np.asarray(shared.k[:, :, :5]), np.asarray(cache.k[:, :, :5]))

  def chain_q(offset):  # [3, V]: the kept layers' softmax over root, d1, d2 at 5 + offset + i
    fed = jnp.concatenate([last2[:, 1:], tokens[:, :2]], axis=1)
    logits, _ = jitted_layers(deep, DEEP, fed, 5 + offset + jnp.arange(3)[None], cache, (0, 3))
    return np.asarray(jax.nn.softmax(logits[0], axis=-1))

  np.testing.assert_allclose(np.asarray(q[0]), chain_q(evicted), atol=1e-5)
  if evicted:
    assert np.abs(np.asarray(q[0]) - chain_q(0)).max() > 1e-3


def test_skip_drafts_are_greedy_identical_to_autoregressive(deep):
  ar = generate(deep, DEEP, PROMPT_SET, max_new_tokens=14).sequences()
  skip = skip_drafter(deep, DEEP, (0, 3))
  for drafter in (skip, skip.with_stop(0.5), ngram_drafter(DEEP.vocab_size, fallback=skip)):
    out = speculative_generate(deep, DEEP, drafter, PROMPT_SET,
                               spec=SpecConfig(gamma=3, max_new_tokens=14))
    assert out.sequences() == ar


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _UniformQ(SkipDrafter):
  """The negative control: drafts drawn right, q reported uniform."""

  uniform_q: str = own_program()

  def propose_shared(self, state, cache, last2, seq_len, key, sampling, gamma, pick=None):
    tokens, q, state, cache = super().propose_shared(state, cache, last2, seq_len, key, sampling,
                                                     gamma, pick)
    return tokens, jnp.full_like(q, 1.0 / q.shape[-1]), state, cache


@pytest.mark.parametrize("control", [False, True])
def test_sampled_skip_drafts_follow_the_target_distribution(control):
  target = init_params(DEEP_TINY, jax.random.key(10), scale=0.8)
  kind = _UniformQ if control else SkipDrafter
  drafter = kind(params=target, cfg=DEEP_TINY, layers=(0, 2))
  sp = SamplingParams(temperature=1.0)
  codes = sample_sequences(target, drafter, sp, gamma=2, cfg=DEEP_TINY)
  stat, dof, ok = chi_square(codes, exact_distribution(target, sp, cfg=DEEP_TINY))
  assert ok != control, (control, stat, dof)


def test_calibration_skips_the_layers_that_change_the_stream_least(deep):
  influence = layer_influence(deep, DEEP, PROMPTS[0] + PROMPTS[1])
  assert influence.shape == (4,) and (influence >= 0).all()
  # A layer made to do nothing (zero output projections) has no influence and is skipped first.
  quiet = dataclasses.replace(deep, layers=list(deep.layers))
  quiet.layers[2] = dataclasses.replace(quiet.layers[2], wo=quiet.layers[2].wo * 0,
                                        w_down=quiet.layers[2].w_down * 0)
  influence = layer_influence(quiet, DEEP, PROMPTS[0] + PROMPTS[1])
  assert influence[2] < 1e-5 < influence[1]
  assert calibrated_layers(influence, 1) == (0, 1, 3)


def test_influence_reads_each_layers_input_and_output_and_ignores_the_padding(deep):
  """The calibration pads its text to a prompt bucket; the padding must not enter the mean, and
  tap L (the last layer's output) must be the stream the final norm reads."""
  tokens = [4, 8, 15, 16, 23, 42, 7]  # 7 tokens: padded to 16
  T, L = len(tokens), DEEP.num_layers
  ids, positions = jnp.asarray([tokens]), jnp.arange(T)[None]
  _, streams, _ = jitted_forward(deep, DEEP, ids, positions, KVCache.init(DEEP, 1, T),
                                 taps=tuple(range(L + 1)))
  x = np.asarray(streams[0], np.float64).reshape(T, L + 1, -1)
  cos = (x[:, :-1] * x[:, 1:]).sum(-1) / (np.linalg.norm(x[:, :-1], axis=-1)
                                          * np.linalg.norm(x[:, 1:], axis=-1))
  np.testing.assert_allclose(layer_influence(deep, DEEP, tokens), 1 - cos.mean(0), atol=1e-5)
  _, hidden, _ = jitted_forward(deep, DEEP, ids, positions, KVCache.init(DEEP, 1, T))
  last = x[:, L]
  normed = last / np.sqrt((last ** 2).mean(-1, keepdims=True) + DEEP.rms_norm_eps)
  np.testing.assert_allclose(normed * np.asarray(deep.final_norm), np.asarray(hidden[0]),
                             rtol=1e-4, atol=1e-5)


def test_bad_skip_sets_are_refused(deep):
  with pytest.raises(ValueError, match="non-empty ascending"):
    skip_drafter(deep, DEEP, ())
  with pytest.raises(ValueError, match="runs all 4 layers"):
    skip_drafter(deep, DEEP, (0, 1, 2, 3))
  with pytest.raises(ValueError, match=r"skips 1 \.\. 2 of the target's 4 layers"):
    calibrated_layers(np.zeros(4), 3)
  with pytest.raises(ValueError, match="chains only"):
    tree_speculative_generate(deep, DEEP, skip_drafter(deep, DEEP, (0, 3)), PROMPTS[:1],
                              spec=TreeSpecConfig("fixed:2", max_new_tokens=4))
