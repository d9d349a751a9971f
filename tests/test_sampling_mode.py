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
from jspec.bench.programs import lower_decode
from jspec.drafting.model import ModelDrafter
from jspec.drafting.ngram import ngram_drafter
from jspec.generate import generate
from jspec.models.llama import init_params
from jspec.sampling.processing import Mode, SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate
from jspec.speculative.tree import TreeSpecConfig
from tiny_models import SMALL

CFG = SMALL
DRAFT_CFG = dataclasses.replace(CFG, num_layers=1)
PROMPTS = [[5, 6, 7, 5, 6], [9, 3]]


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


def test_mode_is_read_off_the_values():
  assert SamplingParams().mode == Mode(greedy=True, filtered=False)
  assert SamplingParams(0.7).mode == Mode(greedy=False, filtered=False)
  assert SamplingParams(0.7, top_k=5).mode == Mode(greedy=False, filtered=True)
  assert SamplingParams(0.7, top_p=0.9).mode == Mode(greedy=False, filtered=True)
  # filters change only sampled rows: greedy with top-k is greedy's own program
  assert SamplingParams(np.float32(0.0), jnp.asarray(3)).mode == Mode(greedy=True, filtered=False)
  assert SamplingParams([0.0, 0.7], top_k=[5, 0], min_p=[0.1, 0.0]).mode == Mode(
      greedy=False, filtered=False, greedy_rows=True)
  assert SamplingParams([0.0, 0.7], top_k=[5, 3]).mode == Mode(False, True, greedy_rows=True)
  # a copy with new values gets their mode, never the old one's: read again, or None
  assert dataclasses.replace(SamplingParams(0.7), temperature=0.0).mode.greedy
  assert dataclasses.replace(SamplingParams(), temperature=jnp.asarray([0.0, 0.7])).mode == Mode(
      greedy=False, filtered=False, greedy_rows=True)  # one per row: greedy and sampled rows
  assert jax.jit(lambda t: jnp.asarray(
      dataclasses.replace(SamplingParams(), temperature=t).mode is None))(0.7)
  # values mapped to arrays (what the engines receive) keep it; to numbers, theirs
  assert jax.tree.map(jnp.asarray, SamplingParams(0.7)).mode == Mode(False, False)
  assert jax.tree.map(jnp.asarray, SamplingParams(0.7, mode=None)).mode is None
  # top_k 1 and min_p 1: both filters on; presence and frequency penalties 1: penalized
  assert jax.tree.map(lambda v: v * 0 + 1, SamplingParams(0.0)).mode == Mode(False, True, True,
                                                                              True)
  assert SamplingParams(0.7, min_p=0.1).mode == Mode(greedy=False, filtered=False, min_p=True)
  # values traced when the params are built: decided inside the program
  assert jax.jit(lambda t: jnp.asarray(SamplingParams(t).mode is None))(0.5)
  # one per row: a branch is on when any row needs it
  assert SamplingParams([0.5, 0.9], top_k=np.array([0, 4])).mode == Mode(False, True)
  assert SamplingParams((0.0, 0.0), repetition_penalty=[1.0, 1.3]).mode == Mode(True, False,
                                                                                penalized=True)
  with pytest.raises(ValueError, match="mode must be 'auto'"):
    SamplingParams(0.7, mode="static")


def sampling_sites(lowered) -> set[str]:
  """The functions of jspec.sampling and jspec.drafting whose lax.cond a program still holds."""
  sites = control_flow_sites(lowered.compiler_ir("stablehlo"))["conditional"]
  return {site.split(" ")[0] for site in sites if "sampling/" in site or "drafting/" in site}


def test_a_static_mode_compiles_only_its_branches(params):
  prompt, lengths, key = jnp.zeros((1, 16), jnp.int32), jnp.asarray([3]), jax.random.key(0)
  lookup = ngram_drafter(CFG.vocab_size, 2, 4)
  model = ModelDrafter(init_params(DRAFT_CFG, jax.random.key(1), scale=0.3), DRAFT_CFG)
  chain = SpecConfig(gamma=3, max_new_tokens=4)

  def sites(sp) -> dict[str, set[str]]:
    sp = jax.tree.map(jnp.asarray, sp)  # as jspec.decode.Batch passes them
    args = (prompt, lengths, key, sp)
    lowered = {
        "ar": lower_decode(params, CFG, *args, max_new_tokens=4, cache_size=32),
        "ngram": lower_decode(params, CFG, *args, drafter=lookup, spec=chain, cache_size=32),
        "model": lower_decode(params, CFG, *args, drafter=model, spec=chain, cache_size=32),
        "tree": lower_decode(  # the tree's draft has a greedy_variant
            params, CFG, *args, drafter=model, cache_size=32,
            spec=TreeSpecConfig("fixed:3-2-1", max_new_tokens=4)),
    }
    return {name: sampling_sites(low) for name, (low, _) in lowered.items()}

  for sp in (SamplingParams(), SamplingParams(0.7)):
    assert sites(sp) == dict.fromkeys(("ar", "ngram", "model", "tree"), set()), sp
  for name, found in sites(SamplingParams(0.7, top_p=0.9)).items():  # the search's own alone
    assert found == {"_top_k_top_p", "bisected_threshold"}, (name, found)
  dynamic = sites(SamplingParams(mode=None))
  assert {"sample", "processed_logprobs"} <= dynamic["ar"], dynamic["ar"]
  assert {"verify", "processed_logprobs"} <= dynamic["ngram"], dynamic["ngram"]
  assert {"verify", "sample_with_probs"} <= dynamic["model"], dynamic["model"]
  assert {"verify_tree", "Drafter.draft_tree"} <= dynamic["tree"], dynamic["tree"]


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
