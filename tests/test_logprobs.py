"""Token log-probabilities (jspec.sampling.logprobs): every engine reports, for each token it
generates, the log-probability the target gives it, checked against an independent teacher-forced
pass over the prompt and the output; greedy speculative logprobs match autoregressive ones under a
KV budget; streamed runs report the same; bad settings are refused at the call."""

import jax
import numpy as np
import pytest

from jspec.generate import generate, generate_stream
from jspec.kv.policy import KVPolicy
from jspec.models.llama import init_params
from jspec.sampling.processing import SamplingParams, processed_logprobs
from jspec.speculative.chain import SpecConfig, speculative_generate, speculative_generate_stream
from jspec.speculative.tree import (TreeSpecConfig, tree_speculative_generate,
                                    tree_speculative_generate_stream)
from tiny_drafters import perturbed_drafter
from tiny_models import SMALL, causal_logits

CFG = SMALL
PROMPTS = [[5, 17, 3, 44, 2, 9, 61], [8, 1, 30]]
STOP = 3
SAMPLINGS = {"greedy": SamplingParams(),
             "t1-topp": SamplingParams(temperature=1.0, top_p=0.9),
             "t0.7-topk": SamplingParams(temperature=0.7, top_k=5),
             "t0.8-minp": SamplingParams(temperature=0.8, min_p=0.1),
             "greedy-traced": SamplingParams(mode=None),  # greedy decided inside the program
             "t1-traced": SamplingParams(temperature=1.0, top_p=0.9, mode=None)}
MAX_NEW = 14


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def drafter(params):
  return perturbed_drafter(params, CFG, 0.05)


def teacher_forced(params, prompt, seq, kind, sampling) -> np.ndarray:
  """The log-probability of each of seq's tokens from one forward over prompt + seq."""
  logits = causal_logits(params, CFG, prompt + seq)[len(prompt) - 1:len(prompt) - 1 + len(seq)]
  if kind == "model":
    lps = jax.nn.log_softmax(logits, axis=-1)
  elif float(sampling.temperature) == 0:
    return np.zeros(len(seq), np.float32)
  else:
    lps = processed_logprobs(logits, sampling)
  return np.asarray(lps)[np.arange(len(seq)), seq]


def check_against_teacher(params, out, kind, sampling):
  got = np.asarray(out.logprobs)
  assert got.shape == np.asarray(out.tokens).shape
  for row, (prompt, seq) in enumerate(zip(PROMPTS, out.sequences())):
    assert len(seq) >= 2
    np.testing.assert_allclose(got[row, :len(seq)],
                               teacher_forced(params, prompt, seq, kind, sampling), atol=1e-4)
    assert np.all(got[row, len(seq):] == 0)  # padding adds nothing to a row's sum
  assert np.all(np.isfinite(got))


def run(engine, params, drafter, kind, sampling, **kw):
  common = dict(sampling=sampling, key=11)
  if engine == "autoregressive":
    return generate(params, CFG, PROMPTS, max_new_tokens=MAX_NEW, stop_ids=(STOP,),
                    logprobs=kind, **common, **kw)
  if engine == "chain":
    spec = SpecConfig(gamma=3, max_new_tokens=MAX_NEW, stop_ids=(STOP,), logprobs=kind)
    return speculative_generate(params, CFG, drafter, PROMPTS, spec=spec, **common, **kw)
  spec = TreeSpecConfig("fixed:2-2-1", max_new_tokens=MAX_NEW, stop_ids=(STOP,), logprobs=kind)
  return tree_speculative_generate(params, CFG, drafter, PROMPTS, spec=spec, **common, **kw)


# The model's log-probabilities ignore the filters (they only pick the tokens), so "model" runs
# with one greedy and one filtered setting; the processed ("sampled") ones with every setting.
# Each (kind, mode) compiles its own program: the tree engine runs them all, the chain and
# autoregressive engines half each (between them every one), as the reports are gathered alike.
SCORED = [(kind, name) for kind in ("model", "sampled") for name in SAMPLINGS
          if kind == "sampled" or name in ("greedy", "t1-topp")]
CASES = ([("tree", kind, name) for kind, name in SCORED]
         + [("chain", "model", "greedy"), ("chain", "sampled", "t1-topp"),
            ("chain", "sampled", "t0.8-minp")]
         + [("autoregressive", "model", "t1-topp"), ("autoregressive", "sampled", "greedy"),
            ("autoregressive", "sampled", "t0.7-topk"), ("autoregressive", "sampled", "t1-traced")])


@pytest.mark.parametrize("engine, kind, sampling", CASES,
                         ids=[f"{e}-{k}-{s}" for e, k, s in CASES])
def test_logprobs_score_the_generated_tokens(params, drafter, engine, kind, sampling):
  sp = SAMPLINGS[sampling]
  out = run(engine, params, drafter, kind, sp)
  check_against_teacher(params, out, kind, sp)
  if engine != "autoregressive":  # rounds accepted drafts, so the path's positions were read
    assert out.block_efficiency > 1.2
  if not sampling.startswith("greedy") and kind == "sampled":  # the filters changed the report
    model = teacher_forced(params, PROMPTS[0], out.sequences()[0], "model", sp)
    assert not np.allclose(np.asarray(out.logprobs)[0, :len(model)], model, atol=1e-3)


@pytest.mark.parametrize("kind", ["model", "sampled"])
def test_a_drafter_that_stops_early_reports_the_targets_logprobs(params, kind):
  """The n-gram lookup drafts only where the context repeats: rounds with no drafts take the
  one-token step (logits padded past it), and cut rounds draw the next token afresh at the cut."""
  from jspec.drafting.ngram import ngram_drafter
  prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 3, 9, 3, 9, 3]]
  sp = SAMPLINGS["t1-topp"]
  spec = SpecConfig(gamma=3, max_new_tokens=MAX_NEW, logprobs=kind)
  out = speculative_generate(params, CFG, ngram_drafter(CFG.vocab_size), prompts, spec=spec,
                             sampling=sp, key=4)
  got = np.asarray(out.logprobs)
  for row, (prompt, seq) in enumerate(zip(prompts, out.sequences())):
    np.testing.assert_allclose(got[row, :len(seq)], teacher_forced(params, prompt, seq, kind, sp),
                               atol=1e-4)
  assert int(out.rounds) > 0


def test_streamed_tree_logprobs_are_the_whole_runs(params, drafter):
  spec = TreeSpecConfig("fixed:2-2-1", max_new_tokens=MAX_NEW, logprobs="sampled")
  kw = dict(spec=spec, sampling=SAMPLINGS["t1-topp"], key=8)
  whole = tree_speculative_generate(params, CFG, drafter, PROMPTS, **kw)
  stream = tree_speculative_generate_stream(params, CFG, drafter, PROMPTS, every=2, **kw)
  list(stream)
  np.testing.assert_array_equal(np.asarray(stream.output.logprobs), np.asarray(whole.logprobs))


@pytest.mark.parametrize("policy", ["keydiff", "h2o"])
@pytest.mark.parametrize("engine", ["chain", "tree"])
def test_speculative_logprobs_under_a_budget_are_the_autoregressive_ones(params, drafter, engine,
                                                                         policy):
  kv = KVPolicy(policy, budget=8, sinks=2, window=2, chunk=4, evict_every=2)
  want = run("autoregressive", params, drafter, "model", SAMPLINGS["greedy"], kv=kv)
  got = run(engine, params, drafter, "model", SAMPLINGS["greedy"], kv=kv)
  assert got.sequences() == want.sequences()
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-4)
  # The budget changed the scores: a full cache's teacher-forced pass disagrees somewhere.
  full = [teacher_forced(params, p, s, "model", None) for p, s in zip(PROMPTS, want.sequences())]
  assert not all(np.allclose(np.asarray(want.logprobs)[i, :len(f)], f, atol=1e-3)
                 for i, f in enumerate(full))


def test_streamed_logprobs_are_the_whole_runs(params, drafter):
  sp = SAMPLINGS["t1-topp"]
  whole = generate(params, CFG, PROMPTS, max_new_tokens=MAX_NEW, sampling=sp, key=3,
                   logprobs="sampled")
  stream = generate_stream(params, CFG, PROMPTS, every=4, max_new_tokens=MAX_NEW, sampling=sp,
                           key=3, logprobs="sampled")
  list(stream)
  np.testing.assert_array_equal(np.asarray(stream.output.logprobs), np.asarray(whole.logprobs))
  spec = SpecConfig(gamma=3, max_new_tokens=MAX_NEW, logprobs="model")
  whole = speculative_generate(params, CFG, drafter, PROMPTS, spec=spec, sampling=sp, key=3)
  stream = speculative_generate_stream(params, CFG, drafter, PROMPTS, every=2, spec=spec,
                                       sampling=sp, key=3)
  list(stream)
  np.testing.assert_array_equal(np.asarray(stream.output.logprobs), np.asarray(whole.logprobs))


def test_logprobs_are_off_unless_asked(params, drafter):
  assert generate(params, CFG, PROMPTS, max_new_tokens=4).logprobs is None
  spec = SpecConfig(gamma=2, max_new_tokens=4)
  assert speculative_generate(params, CFG, drafter, PROMPTS, spec=spec).logprobs is None


@pytest.mark.parametrize("bad", ["raw", True, "MODEL"])
def test_bad_logprobs_kinds_are_refused(params, bad):
  with pytest.raises(ValueError, match="logprobs must be None"):
    generate(params, CFG, PROMPTS, max_new_tokens=4, logprobs=bad)
  with pytest.raises(ValueError, match="logprobs must be None"):
    SpecConfig(gamma=2, max_new_tokens=4, logprobs=bad)
  with pytest.raises(ValueError, match="logprobs must be None"):
    TreeSpecConfig("fixed:2", max_new_tokens=4, logprobs=bad)
