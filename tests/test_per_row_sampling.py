"""Sampling settings given per row (one number per prompt for any of the seven): each row of a
batch runs under its own settings, greedy rows beside sampled ones included. Row b of a per-row
run equals row b of a run whose every row has row b's settings (the same key: a row's random draws
do not depend on the other rows), in every engine; those uniform runs are checked for exactness
elsewhere (test_speculative, test_penalties, test_logprobs), so per-row runs inherit it. A
setting broadcast along the wrong axis, a filter run on a row that asked for none, or a greedy
row drafted or verified as a sampled one fails here."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench.profiling import CompileCounter
from jspec.generate import generate
from jspec.models.llama import init_params
from jspec.sampling.penalties import History, penalize, tree_paths
from jspec.drafting.base import sample_with_probs
from jspec.sampling.processing import Mode, SamplingParams, processed_logprobs, sample, switch
from jspec.sampling.tree_verify import verify_tree
from jspec.sampling.verify import verify
from jspec.speculative.chain import SpecConfig, speculative_generate
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from jspec.tree.draft import draft_fixed
from jspec.tree.structure import Siblings, Tree
from tiny_drafters import perturbed_drafter
from tiny_models import SMALL

CFG = SMALL
PROMPTS = [[5, 17, 3, 44, 2, 9, 61], [8, 1, 30], [7, 7, 7, 12]]
# Row 0 greedy (with a penalty), rows 1 and 2 sampled with different filters and penalties.
ROWS = [dict(repetition_penalty=1.3),
        dict(temperature=0.9, top_k=5, presence_penalty=0.4),
        dict(temperature=1.2, top_p=0.85, min_p=0.05, frequency_penalty=0.3)]
MAX_NEW = 12


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def drafter(params):
  return perturbed_drafter(params, CFG, 0.05)


def test_processing_per_row_is_each_rows_own():
  # V above the filters' 256 candidates: a row with both filters off beside rows that filter
  # must keep its whole vocabulary, not the candidates.
  rows = [dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
          dict(temperature=1.0), dict(temperature=0.9, min_p=0.1)]
  sp = jax.tree.map(jnp.asarray, SamplingParams.of_rows(rows))
  assert sp.mode == Mode(greedy=False, filtered=True, min_p=True)
  logits = 3 * jax.random.normal(jax.random.key(0), (4, 3, 600))  # [B, T, V]
  process = jax.jit(processed_logprobs)  # (op by op: 253 programs)
  for x in (logits, logits[:, 0]):  # [B, T, V] and [B, V]
    got = np.asarray(process(x, sp))
    for b, row in enumerate(rows):
      want = np.asarray(process(x[b:b + 1], SamplingParams(**row)))[0]
      np.testing.assert_array_equal(np.isinf(got[b]), np.isinf(want), err_msg=f"row {b}")
      np.testing.assert_allclose(got[b], want, rtol=1e-6, err_msg=f"row {b}")  # x / t: an ulp
  assert np.all(np.isfinite(got[2]))  # filters off: every token kept


def test_penalties_per_row_are_each_rows_own():
  rows = [dict(repetition_penalty=1.5), dict(presence_penalty=0.7, frequency_penalty=0.2),
          dict(repetition_penalty=0.8, frequency_penalty=1.0)]
  sp = SamplingParams.of_rows(rows)
  V = 11
  history = History.of_prompt(jnp.asarray([[1, 2, 3], [4, 4, 0], [5, 1, 9]]),
                              jnp.asarray([3, 2, 3]), V)
  history = history.add(jnp.asarray([[2, 2], [6, 4], [0, 7]]), jnp.ones((3, 2), bool))
  tree = Tree(tokens=jnp.asarray([[3, 6, 3], [4, 2, 4], [9, 9, 1]], jnp.int32),
              parents=jnp.asarray([[-1, 0, 1]] * 3, jnp.int32),
              depth=jnp.asarray([[1, 2, 3]] * 3, jnp.int32), valid=jnp.ones((3, 3), bool),
              q=jnp.zeros((3, 4, V)), max_depth=3, siblings=Siblings.IID)
  logits = jax.random.normal(jax.random.key(2), (3, 4, V))  # [B, N + 1, V]
  got = np.asarray(penalize(logits, history, sp, tree_paths(tree)))
  for b, row in enumerate(rows):
    one = jax.tree.map(lambda a: a[b:b + 1], (history, tree))
    want = penalize(logits[b:b + 1], one[0], SamplingParams(**row), tree_paths(one[1]))
    np.testing.assert_allclose(got[b], np.asarray(want)[0], rtol=0, atol=0, err_msg=f"row {b}")


def test_a_greedy_row_beside_sampled_ones_is_decided_greedily():
  """Two tokens tie for the largest logit: greedy takes the first, always; a sampled row at
  temperature ~0 would take either. So each function whose greedy and sampled sides differ must
  give the greedy row its greedy side (both rows have the same logits, one greedy, one not)."""
  V = 9
  logits = jnp.zeros((2, V)).at[:, 3].set(5.0).at[:, 7].set(5.0)  # [B, V]
  sp = jax.tree.map(jnp.asarray, SamplingParams(temperature=[0.0, 1.0]))
  drafts = jnp.full((2, 1), 7, jnp.int32)  # the second of the tied tokens
  q = jax.nn.one_hot(drafts, V)  # [B, 1, V]
  tree = Tree(tokens=drafts, parents=jnp.full((2, 1), -1, jnp.int32),
              depth=jnp.ones((2, 1), jnp.int32), valid=jnp.ones((2, 1), bool),
              q=jnp.concatenate([q, jnp.zeros((2, 1, V))], axis=1), max_depth=1,
              siblings=Siblings.FIXED)
  both = jnp.stack([logits, logits], axis=1)  # [B, 2, V]
  seen = {"sample": set(), "sample_with_probs": set(), "verify": set(), "verify_tree": set()}
  jitted = {f.__name__: jax.jit(f) for f in (sample, sample_with_probs, verify, verify_tree)}
  for seed in range(24):
    key = jax.random.key(seed)
    tokens = jitted["sample"](key, logits, sp)
    assert int(tokens[0]) == 3
    seen["sample"].add(int(tokens[1]))
    tokens, probs = jitted["sample_with_probs"](key, logits, sp)
    assert int(tokens[0]) == 3 and float(probs[0, 3]) == 1.0
    seen["sample_with_probs"].add(int(tokens[1]))
    n, nxt = jitted["verify"](key, drafts, q, both, sp)
    assert (int(n[0]), int(nxt[0])) == (0, 3)  # greedy rejects the tied second
    seen["verify"].add(int(n[1]))
    path, n, nxt = jitted["verify_tree"](key, tree, both, sp)
    assert (int(n[0]), int(nxt[0])) == (0, 3)
    seen["verify_tree"].add(int(n[1]))
  # the sampled row takes either side of the tie (the test would pass a sampled greedy row
  # only by luck)
  assert seen == {"sample": {3, 7}, "sample_with_probs": {3, 7}, "verify": {0, 1},
                  "verify_tree": {0, 1}}


def test_a_fixed_tree_drafts_greedy_rows_top_k_and_sampled_rows_their_draws():
  V, B = 40, 3
  table = 2 * jax.random.normal(jax.random.key(3), (V, V))

  def next_logits(tree, frontier):  # [B, W, V]: a bigram table of the frontier's tokens
    tokens = jnp.where(frontier >= 0, jnp.take_along_axis(
        tree.tokens, jnp.maximum(frontier, 0), axis=1), jnp.arange(B)[:, None])
    return table[tokens]

  key, branching = jax.random.key(4), (3, 2)
  sp = SamplingParams(temperature=[0.0, 0.8, 0.0], top_k=[0, 6, 0])
  draft = jax.jit(draft_fixed, static_argnums=(1, 2, 3, 4, 6))  # op by op: ~200 programs
  mixed = draft(key, next_logits, B, V, branching, sp, Siblings.IID, greedy_rows=sp.is_greedy)
  greedy = draft(key, next_logits, B, V, branching, SamplingParams(), Siblings.FIXED)
  sampled = draft(key, next_logits, B, V, branching, SamplingParams(0.8, top_k=6), Siblings.IID)
  for b, want in ((0, greedy), (1, sampled), (2, greedy)):
    np.testing.assert_array_equal(mixed.tokens[b], want.tokens[b], err_msg=f"row {b}")
    np.testing.assert_array_equal(mixed.valid[b], want.valid[b], err_msg=f"row {b}")
  assert len(set(np.asarray(mixed.tokens[0, :3]).tolist())) == 3  # top-3, not one token 3 times


def test_switch_refuses_a_predicate_per_row_unless_told_the_outputs_lead_with_rows():
  pred = jnp.asarray([True, False])
  layers_first = lambda v: jnp.full((2, 2, 3), v)  # [L, B, ...] with L == B
  with pytest.raises(ValueError, match="rows=True"):
    switch(pred, lambda: layers_first(1), lambda: layers_first(0))
  got = switch(pred, lambda: jnp.ones((2, 3)), lambda: jnp.zeros((2, 3)), rows=True)
  np.testing.assert_array_equal(got, [[1, 1, 1], [0, 0, 0]])


def run(engine, params, drafter, sampling, logprobs="sampled"):
  common = dict(sampling=sampling, key=5)
  if engine == "autoregressive":
    return generate(params, CFG, PROMPTS, max_new_tokens=MAX_NEW, logprobs=logprobs, **common)
  if engine == "chain":
    spec = SpecConfig(gamma=3, max_new_tokens=MAX_NEW, logprobs=logprobs)
    return speculative_generate(params, CFG, drafter, PROMPTS, spec=spec, **common)
  spec = TreeSpecConfig(engine, max_new_tokens=MAX_NEW, logprobs=logprobs)
  return tree_speculative_generate(params, CFG, drafter, PROMPTS, spec=spec, **common)


# fixed: a temperature-0 variant (top-k children) the greedy row gives up beside sampled rows.
# ("ngram", a chain with the lookup drafter, went for the suite's time: a case compiles 4 programs.)
@pytest.mark.parametrize("engine", ["autoregressive", "chain", "fixed:2-2-1", "rsd-s:2,3"])
def test_each_row_runs_under_its_own_settings(params, drafter, engine):
  got = run(engine, params, drafter, SamplingParams.of_rows(ROWS))
  assert np.any(np.asarray(got.logprobs)[1:] != 0)
  for b, row in enumerate(ROWS):
    want = run(engine, params, drafter, SamplingParams(**row))
    np.testing.assert_array_equal(np.asarray(got.tokens)[b], np.asarray(want.tokens)[b],
                                  err_msg=f"row {b}")
    np.testing.assert_allclose(np.asarray(got.logprobs)[b], np.asarray(want.logprobs)[b],
                               atol=1e-5, err_msg=f"row {b}")


def test_the_tree_engine_hands_greedy_rows_to_a_fixed_tree(params, drafter, monkeypatch):
  """Greedy verification takes any tree, so tokens alone cannot show a greedy row drafted as a
  sampled one; the plumbing is checked here (the tree itself by the draft_fixed test above)."""
  from jspec.tree import shapes
  handed, original = [], shapes.draft_fixed

  def spy(*args, greedy_rows=None, **kw):
    handed.append(greedy_rows is not None)
    return original(*args, greedy_rows=greedy_rows, **kw)

  monkeypatch.setattr(shapes, "draft_fixed", spy)
  spec = TreeSpecConfig("fixed:3-1-1", max_new_tokens=5)  # a shape no other test traces
  tree_speculative_generate(params, CFG, drafter, PROMPTS, spec=spec, sampling=SamplingParams.of_rows(ROWS))
  assert handed and all(handed)


def test_decided_inside_the_program_gives_the_same_rows(params, drafter):
  want = run("chain", params, drafter, SamplingParams.of_rows(ROWS))
  got = run("chain", params, drafter, SamplingParams.of_rows(ROWS, mode=None))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_new_values_per_row_reuse_the_program(params):
  def call(rows):
    return generate(params, CFG, PROMPTS, max_new_tokens=4, sampling=SamplingParams.of_rows(rows), key=1).tokens

  jax.block_until_ready(call(ROWS))
  changed = [dict(r, temperature=r.get("temperature", 0) and r["temperature"] + 1,
                  top_k=r.get("top_k", 0) and 7.0) for r in ROWS]  # whole numbers: ints, floats
  with CompileCounter() as counter:
    jax.block_until_ready(call(changed))
  assert counter.compiles == 0


def test_settings_per_row_traced_in_your_own_jit(params):
  """A list of traced values inside a user's jit: the mode is decided inside the program."""
  from jspec.generate import generate_tokens
  prompt = jnp.asarray([[5, 17, 3, 0], [8, 1, 30, 0]], jnp.int32)
  lengths = jnp.asarray([3, 3])

  @jax.jit
  def run_rows(t0, t1):
    sp = SamplingParams(temperature=[t0, t1])
    assert sp.mode is None
    return generate_tokens(params, CFG, prompt, lengths, jax.random.key(2), sp, max_new_tokens=5,
                           cache_size=16).tokens

  got = run_rows(0.0, 0.9)
  want = generate(params, CFG, [[5, 17, 3], [8, 1, 30]], max_new_tokens=5,
                  sampling=SamplingParams(temperature=[0.0, 0.9], mode=None), key=2)
  np.testing.assert_array_equal(got[0], np.asarray(want.tokens)[0])


@pytest.mark.parametrize("sampling,match", [
    (SamplingParams(temperature=[0.5, 0.7]), r"temperature must be one number for the whole "
                                             r"batch or one per row \(3, one per prompt\)"),
    (SamplingParams(temperature=np.ones((3, 1))), "temperature must be one number"),
    (SamplingParams(temperature=[0.5, -1.0, 0.7]), r"temperature\[1\] must be a finite number"),
    (SamplingParams(temperature=0.7, top_p=[1.0, 0.9, 0.0]), r"top_p\[2\] must be in \(0, 1\]"),
    (SamplingParams(temperature=0.7, top_k=[0, 2.5, 1]), r"top_k\[1\] must be an integer"),
    (SamplingParams(repetition_penalty=[1.0, 1.0, float("nan")]),
     r"repetition_penalty\[2\] must be a finite number > 0"),
    (SamplingParams(temperature=0.7, top_k=[0, float("inf"), 1]), r"top_k\[1\] must be an int"),
    (SamplingParams(temperature=0.7, top_k=[0, 200, 1]), r"top_k\[1\]=200 is more than the"),
])
def test_bad_settings_per_row_are_refused(params, sampling, match):
  with pytest.raises(ValueError, match=match):
    generate(params, CFG, PROMPTS, max_new_tokens=4, sampling=sampling)


def test_per_row_settings_where_one_number_is_needed():
  with pytest.raises(ValueError, match="as many rows each"):
    SamplingParams(temperature=[0.5, 0.7], top_p=[0.9, 0.9, 0.9]).validate()
  with pytest.raises(ValueError, match="jspec bench takes one number per sampling setting, got "
                                       "one per row for temperature"):
    SamplingParams(temperature=[0.5, 0.7]).require_uniform("jspec bench")
  assert SamplingParams(0.5).require_uniform("x").temperature == 0.5
  with pytest.raises(ValueError, match=r"unknown sampling settings \['temprature'\]"):
    SamplingParams.of_rows([dict(temprature=0.5)])


def test_a_greedy_rows_processing_does_not_depend_on_its_neighbours():
  # A filter on a greedy row changes nothing (its argmax), and the mode turns filters on only for
  # sampled rows: so a greedy row is never filtered, alone or beside a row whose filter is on
  # (specinfer / rsd trees draw a greedy row's children from this law).
  logits = jax.random.normal(jax.random.key(3), (2, 50)) * 3
  alone = processed_logprobs(logits[:1], SamplingParams(0.0, top_k=2, min_p=0.5))
  beside = processed_logprobs(logits, SamplingParams([0.0, 0.9], top_k=[2, 3], min_p=[0.5, 0.0]))
  np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(beside[0]))
  assert np.isfinite(np.asarray(beside[0])).all() and np.isfinite(np.asarray(beside[1])).sum() == 3


def test_params_per_row_compare_and_hash_by_their_numbers():
  a = SamplingParams([0.5, 0.7], top_k=5)
  same = SamplingParams(np.array([0.5, 0.7]), top_k=np.int64(5))
  assert a == same and hash(a) == hash(same) and {a: "row settings"}[same] == "row settings"
  assert a != SamplingParams([0.5, 0.8], top_k=5) and a != SamplingParams([0.5, 0.7])
  assert SamplingParams(0.5) != SamplingParams([0.5])  # one number is not one row's
  assert SamplingParams(1) == SamplingParams(1.0) == SamplingParams(jnp.float32(1.0))
  assert SamplingParams() != SamplingParams(mode=None)  # another program


def test_mode_per_row():
  assert SamplingParams.of_rows(ROWS).mode == Mode(greedy=False, filtered=True, min_p=True, penalized=True,
                                    greedy_rows=True)
  assert SamplingParams.of_rows([{}, {}]).mode == Mode(greedy=True, filtered=False)  # every row greedy
  sp = SamplingParams.of_rows(ROWS)
  np.testing.assert_array_equal(sp.is_greedy, [True, False, False])
  # replace reads the mode again: no row greedy now
  assert not dataclasses.replace(sp, temperature=[0.5, 0.9, 1.2]).mode.greedy_rows
