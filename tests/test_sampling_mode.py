"""SamplingParams' static mode: read off number-valued settings, it leaves a greedy program without
sampling code or greedy/sampled switches (each a host round trip per decode step on a GPU) and a
sampled one without the greedy path; `mode=None` keeps every setting in one program. Both give
the same tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench.launches import control_flow_sites
from jspec.drafting.ngram import ngram_drafter
from jspec.generate import generate, generate_tokens
from jspec.models.config import Config
from jspec.models.llama import init_params
from jspec.sampling.processing import Mode, SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate, speculative_generate_tokens

CFG = Config(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
PROMPTS = [[5, 6, 7, 5, 6], [9, 3]]


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


def test_mode_is_read_off_the_values():
  assert SamplingParams().mode == Mode(greedy=True, filtered=False)
  assert SamplingParams(0.7).mode == Mode(greedy=False, filtered=False)
  assert SamplingParams(0.7, top_k=5).mode == Mode(greedy=False, filtered=True)
  assert SamplingParams(0.7, top_p=0.9).mode == Mode(greedy=False, filtered=True)
  assert SamplingParams(np.float32(0.0), jnp.asarray(3)).mode == Mode(greedy=True, filtered=True)
  # a copy with new values gets their mode, never the old one's
  assert dataclasses.replace(SamplingParams(0.7), temperature=0.0).mode.greedy
  # values as arrays (what the engines receive) keep it; mode=None stays None
  assert jax.tree.map(jnp.asarray, SamplingParams(0.7)).mode == Mode(False, False)
  assert jax.tree.map(jnp.asarray, SamplingParams(0.7, mode=None)).mode is None
  # values traced when the params are built, or one per row: decided inside the program
  assert jax.jit(lambda t: jnp.asarray(SamplingParams(t).mode is None))(0.5)
  assert SamplingParams(jnp.asarray([0.0, 0.5])).mode is None


def sampling_sites(lowered) -> set[str]:
  """The functions of jspec.sampling and jspec.drafting whose lax.cond a program still holds."""
  sites = control_flow_sites(lowered.compiler_ir("stablehlo"))["conditional"]
  return {site.split(" ")[0] for site in sites if "sampling/" in site or "drafting/" in site}


def test_a_static_mode_compiles_only_its_branches(params):
  ar = jax.jit(generate_tokens, static_argnums=1, static_argnames=("max_new_tokens", "cache_size"))
  spec = jax.jit(speculative_generate_tokens, static_argnums=1,
                 static_argnames=("spec", "cache_size"))
  prompt, lengths, key = jnp.zeros((1, 16), jnp.int32), jnp.asarray([3]), jax.random.key(0)
  drafter = ngram_drafter(CFG.vocab_size, 2, 4)

  def sites(sp):
    sp = jax.tree.map(jnp.asarray, sp)  # as jspec.decode.Batch passes them
    return (sampling_sites(ar.lower(params, CFG, prompt, lengths, key, sp, max_new_tokens=4,
                                    cache_size=32)),
            sampling_sites(spec.lower(params, CFG, drafter, prompt, lengths, key, sp,
                                      spec=SpecConfig(gamma=3, max_new_tokens=4), cache_size=32)))

  assert sites(SamplingParams()) == (set(), set())
  assert sites(SamplingParams(0.7)) == (set(), set())
  ar_filtered, spec_filtered = sites(SamplingParams(0.7, top_p=0.9))
  assert "sample" not in ar_filtered and "processed_logprobs" not in ar_filtered
  assert "verify" not in spec_filtered and "_top_k_top_p" in spec_filtered  # the search's own
  ar_dynamic, spec_dynamic = sites(SamplingParams(mode=None))
  assert {"sample", "processed_logprobs"} <= ar_dynamic
  assert {"verify", "processed_logprobs"} <= spec_dynamic


@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.8), dict(temperature=1.0,
                                                                             top_p=0.8, top_k=20)])
def test_static_and_dynamic_modes_give_the_same_tokens(params, settings):
  static, dynamic = SamplingParams(**settings), SamplingParams(**settings, mode=None)
  want = generate(params, CFG, PROMPTS, max_new_tokens=10, sampling=dynamic, key=4)
  got = generate(params, CFG, PROMPTS, max_new_tokens=10, sampling=static, key=4)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  spec = SpecConfig(gamma=3, max_new_tokens=10)
  drafter = ngram_drafter(CFG.vocab_size, 1, 3)
  want = speculative_generate(params, CFG, drafter, PROMPTS, spec=spec, sampling=dynamic, key=4)
  got = speculative_generate(params, CFG, drafter, PROMPTS, spec=spec, sampling=static, key=4)
  np.testing.assert_array_equal(got.tokens, want.tokens)
