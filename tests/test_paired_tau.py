"""Paired block efficiency (jspec.bench.paired_tau): each round equals the engine's first round from the
same context (greedy, exactly), rounds at temperature 1 are independent draws whose mean matches
the exactly computed acceptance of one speculative-sampling step, and the paired records."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.cache import KVCache
from jspec.models.llama import init_params
from jspec.bench.paired_tau import (PairedResult, clustered_se, context_groups,
                                    contexts_from_responses, paired_tau)
from jspec.kv.policy import KVPolicy
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.drafting.model import ModelDrafter
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from jspec.tree.shapes import parse_tree
from test_speculative import PROMPTS, TARGET, TINY, TINY_PROMPT, noised_drafter
from tiny_models import jitted_forward


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


@pytest.mark.parametrize("tree", ["chain:3", "rsd-c:3-2-1", "dynamic:10,3,2,3"])
def test_greedy_rounds_equal_the_engines_first_round(target, tree):
  drafter = noised_drafter(target, 0.1)
  shape = parse_tree(tree)
  contexts = [p + [11, 12][:i % 3] for i, p in enumerate(PROMPTS * 2)]  # ragged, 8 contexts
  res = paired_tau(target, TARGET, drafter, contexts, [shape], sampling=GREEDY, rounds=3,
                   batch=3, progress=False)
  n = res.n_acc[0]  # [C, R]
  assert (n == n[:, :1]).all()  # greedy rounds are deterministic
  for c, ctx in enumerate(contexts):
    out = tree_speculative_generate(target, TARGET, drafter, [ctx],
                                    spec=TreeSpecConfig(shape, max_new_tokens=2))
    hist = np.asarray(out.accept_hist)  # one round (the second token ends the run)
    assert hist.sum() == 1 and np.argmax(hist) == n[c, 0], (c, ctx, hist)
  assert 0 < n.mean() < shape.max_depth  # rejections and acceptances both happened


def test_a_context_whose_first_token_is_a_stop_starts_no_round(target):
  """The engine ends a row whose first sampled token is a stop id: bench-tau must not score
  rounds from it (nor pair it), and scores every other context as before."""
  drafter = noised_drafter(target, 0.1)
  shape = parse_tree("chain:2")
  contexts = [p + [11, 12][:i % 3] for i, p in enumerate(PROMPTS * 2)]
  first = [int(np.argmax(np.asarray(jitted_forward(
      target, TARGET, jnp.asarray([c]), jnp.arange(len(c))[None],
      KVCache.init(TARGET, 1, len(c)))[0][0, -1]))) for c in contexts]
  stop = first[0]
  ends = np.array([f == stop for f in first])
  assert ends.any() and not ends.all()
  plain = paired_tau(target, TARGET, drafter, contexts, [shape], sampling=GREEDY, rounds=2,
                     batch=len(contexts), progress=False)
  res = paired_tau(target, TARGET, drafter, contexts, [shape], sampling=GREEDY, rounds=2,
                   batch=len(contexts), progress=False, stop_ids=[stop])
  np.testing.assert_array_equal(res.scored, ~ends)
  assert (res.n_acc[:, ends] == -1).all()
  np.testing.assert_array_equal(res.n_acc[:, ~ends], plain.n_acc[:, ~ends])
  rec = res.records()[0]
  assert rec["contexts"] == (~ends).sum() and rec["contexts_at_stop"] == ends.sum()
  assert [t is None for t in rec["per_context_tau"]] == ends.tolist()
  assert rec["tau"] == pytest.approx(plain.n_acc[0, ~ends].mean() + 1)
  assert sum(rec["accept_hist"]) == (~ends).sum() * 2


@pytest.mark.parametrize("method,every", [("h2o", 4), ("keydiff", 4), ("keydiff", 1)])
def test_greedy_rounds_under_a_budget_equal_the_budgeted_engines_first_round(target, method,
                                                                              every):
  """Under a KV budget each round is the budgeted engine's first round (the prompt's chunked
  prefill evicting to the budget; H2O fed by the verification's queries). At evict_every 1 a
  prompt that filled the budget is due for eviction after its next token, so the engine uses no
  draft: every round must score 0 (its cut), whatever the tree accepted. KeyDiff budgets the
  drafter's cache too."""
  drafter = noised_drafter(target, 0.1)
  shape = parse_tree("rsd-c:3-2-1")
  kv = KVPolicy(method, budget=10, sinks=2, chunk=4, evict_every=every)
  draft_kv = kv if method == "keydiff" else None
  # 17..22 tokens: past the budget of 10, and one prompt bucket (24): one program each engine.
  contexts = [[(7 * i + 3 * j) % 64 for j in range(17 + i)] for i in range(6)]
  res = paired_tau(target, TARGET, drafter, contexts, [shape], sampling=GREEDY, rounds=2,
                   batch=3, progress=False, kv=kv, draft_kv=draft_kv)
  n = res.n_acc[0]  # [C, R]
  for c, ctx in enumerate(contexts):
    out = tree_speculative_generate(target, TARGET, drafter, [ctx], kv=kv, draft_kv=draft_kv,
                                    spec=TreeSpecConfig(shape, max_new_tokens=2))
    hist = np.asarray(out.accept_hist)
    assert hist.sum() == 1 and np.argmax(hist) == n[c, 0], (c, hist, n[c])
  if every == 1:
    assert (n == 0).all()
  else:
    full = paired_tau(target, TARGET, drafter, contexts, [shape], sampling=GREEDY, rounds=1,
                      batch=3, progress=False).n_acc[0, :, 0]
    assert 0 < n.mean() and (full != n[:, 0]).any(), (full, n[:, 0])  # the budget mattered


def test_sampled_rounds_match_exact_acceptance():
  """chain:1 at T = 1: E[accepted] = E_{x1 ~ p}[sum_x min(p(x | c, x1), q(x | c, x1))], where x1 is
  the first token the target samples (one per context row)."""
  target = init_params(TINY, jax.random.key(10), scale=0.3)
  noise = init_params(TINY, jax.random.key(11), scale=0.3)
  draft = jax.tree.map(lambda a, b: a + 0.3 * b if a.ndim > 1 else a, target, noise)
  V = TINY.vocab_size
  sp = SamplingParams(temperature=1.0)

  def probs(params, seqs):
    seqs = jnp.asarray(seqs)
    n = seqs.shape[1]
    logits = jitted_forward(params, TINY, seqs, jnp.broadcast_to(jnp.arange(n), seqs.shape),
                            KVCache.init(TINY, seqs.shape[0], n))[0][:, -1]
    return np.asarray(jax.nn.softmax(logits.astype(jnp.float32)), np.float64)

  p1 = probs(target, [TINY_PROMPT])[0]  # [V]
  nxt = [TINY_PROMPT + [x] for x in range(V)]
  overlap = np.minimum(probs(target, nxt), probs(draft, nxt)).sum(axis=1)  # [V]
  want = float(p1 @ overlap)
  res = paired_tau(target, TINY, ModelDrafter(draft, TINY), [TINY_PROMPT] * 256,
                   [parse_tree("chain:1")], sampling=sp, rounds=40, batch=64, progress=False)
  n = res.n_acc[0]  # [C, R]
  assert (n != n[:, :1]).any()  # rounds from one context are different draws
  # Standard error from the per-context means (first tokens differ between contexts).
  se = n.mean(axis=1).std(ddof=1) / np.sqrt(n.shape[0])
  assert abs(n.mean() - want) < 4 * se + 1e-3, (n.mean(), want, se)
  assert 0.1 < want < 0.9  # the test can tell acceptance apart from all or nothing


def test_records_and_paired_differences():
  shapes = [parse_tree("rsd-c:2-1"), parse_tree("specinfer:2-1"), parse_tree("chain:2")]
  rng = np.random.default_rng(0)
  n_acc = rng.integers(0, 3, size=(3, 50, 4)).astype(np.int32)
  n_acc[1] = n_acc[0]  # identical scores: difference exactly 0
  recs = PairedResult(shapes, n_acc).records()
  taus = [r for r in recs if r["kind"] == "paired_tau"]
  diffs = [r for r in recs if r["kind"] == "paired_difference"]
  assert [r["tree"] for r in taus] == [str(s) for s in shapes]
  np.testing.assert_allclose([r["tau"] for r in taus], n_acc.mean(axis=(1, 2)) + 1)
  assert all(sum(r["accept_hist"]) == 200 for r in taus)
  np.testing.assert_allclose([r["per_context_tau"] for r in taus], n_acc.mean(axis=2) + 1,
                             atol=1e-4)
  # rsd-c:2-1 and specinfer:2-1 have 4 nodes, chain:2 has 2: one pair only.
  assert len(diffs) == 1 and diffs[0]["tau_a_minus_b"] == 0.0


def test_contexts_and_bad_input(target):
  assert contexts_from_responses([[1, 2]], [[5, 6, 7]], 2) == [[1, 2], [1, 2, 5, 6]]
  with pytest.raises(ValueError, match="stride"):
    contexts_from_responses([[1]], [[2]], 0)
  drafter = noised_drafter(target, 0.1)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    paired_tau(target, TARGET, drafter, [[1, 999]], [parse_tree("chain:2")], sampling=GREEDY,
               progress=False)
  with pytest.raises(ValueError, match="reaches past the model's max_position_embeddings.*counts "
                                       "every node's acceptance"):
    paired_tau(target, TARGET, drafter, [[1] * 250], [parse_tree("chain:8")], sampling=GREEDY,
               progress=False)
  with pytest.raises(ValueError, match="rounds"):
    paired_tau(target, TARGET, drafter, [[1]], [parse_tree("chain:2")], sampling=GREEDY,
               rounds=0, progress=False)
  # A probe one mask deep read mask 1's logits at every depth of a deeper tree; lookahead's pool
  # is empty in a context's first round (every tree empty): both were scored without a word.
  from jspec.drafting.lookahead import lookahead_drafter
  from jspec.drafting.probe import probe_drafter
  with pytest.raises(ValueError, match="needs 3 masks"):
    paired_tau(target, TARGET, probe_drafter(target, TARGET, masks=1), [[1, 2]],
               [parse_tree("chain:3")], sampling=GREEDY, progress=False)
  with pytest.raises(ValueError, match="pool is still empty"):
    paired_tau(target, TARGET, lookahead_drafter(target, TARGET), [[1, 2]],
               [parse_tree("chain:2")], sampling=GREEDY, progress=False)
  with pytest.raises(ValueError, match="stops chains only"):
    paired_tau(target, TARGET, drafter.with_stop(0.5), [[1, 2]], [parse_tree("chain:2")],
               sampling=GREEDY, progress=False)


def test_standard_errors_cluster_contexts_by_response():
  """Contexts cut from one response are correlated: their error is that of the responses' means
  when a response's contexts agree, and the independent-samples error when each is its own."""
  v = np.array([1.0, 1.0, 1.0, 3.0, 3.0, 3.0])
  assert clustered_se(v, np.array([0, 0, 0, 1, 1, 1])) == pytest.approx(1.0)  # 2 means: 1, 3
  assert clustered_se(v, np.arange(6)) == pytest.approx(v.std(ddof=1) / np.sqrt(6))
  assert clustered_se(v, np.zeros(6)) == 0.0  # one cluster: no estimate
  responses = [[5, 6, 7], [], [8, 9]]
  contexts = contexts_from_responses([[1], [2], [3]], responses, 2)
  groups = context_groups(responses, 2)
  assert len(groups) == len(contexts) and groups == [0, 0, 1, 2]
  assert [c[0] for c in contexts] == [[1], [2], [3]][0] * 2 + [2, 3]
  shapes = [parse_tree("chain:2"), parse_tree("rsd-c:2-1"), parse_tree("specinfer:2-1")]
  rng = np.random.default_rng(1)
  n_acc = np.repeat(rng.integers(0, 3, size=(3, 5, 1)), 4, axis=1)  # 5 responses x 4 alike
  n_acc = np.repeat(n_acc, 2, axis=2).astype(np.int32)
  g = np.repeat(np.arange(5), 4)
  recs = PairedResult(shapes, n_acc, g).records()
  tau, iid = recs[0], PairedResult(shapes, n_acc).records()[0]
  means = n_acc[0, ::4, 0] + 1.0
  assert tau["tau_se"] == pytest.approx(means.std(ddof=1) / np.sqrt(5))
  assert tau["tau_se"] > 1.5 * iid["tau_se"] and tau["responses"] == 5 and iid["responses"] == 20
  d = next(r for r in recs if r["kind"] == "paired_difference")
  dm = (n_acc[1] - n_acc[2])[::4, 0].astype(float)
  assert d["se"] == pytest.approx(dm.std(ddof=1) / np.sqrt(5))
