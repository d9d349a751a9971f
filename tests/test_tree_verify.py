"""Tree verification: greedy tree verification finds the deepest argmax-consistent path and decodes
exactly like greedy autoregression; SpecInfer (i.i.d.), RSD-C (Gumbel-Top-k), RSD-S (stochastic
beam search), EAGLE-2 (fixed children) trees and a chain emit tokens distributed exactly as the
target's over full speculative rounds (chi-square against enumeration); the first round accepts as
often as the exact rule predicts; an i.i.d. rule on without-replacement siblings is caught."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.sampling.processing import GREEDY, SamplingParams, processed_logprobs
from jspec.sampling.tree_verify import (emitted_tokens, verify_tree, verify_tree_greedy,
                                        verify_tree_sampled)
from jspec.tree.draft import draft_dynamic, draft_fixed, draft_stochastic_beam
from jspec.tree.structure import Siblings, Tree, take
from test_tree_structure import assert_root_paths, random_tree

# ---------------------------------------------------------------------------------------------
# toy language models: logits are a deterministic function of the whole prefix (a hash of it
# picks a row of a table); the draft's table is the target's shrunk and noised.

V = 16
TABLE_ROWS = 4096
_rng = np.random.default_rng(0)
P_TABLE = (1.5 * _rng.standard_normal((TABLE_ROWS, V))).astype(np.float32)
Q_TABLE = (0.7 * P_TABLE + 1.0 * _rng.standard_normal((TABLE_ROWS, V))).astype(np.float32)
H0 = 12345  # the root context of the statistical tests


def mix(h, x):
  """Hash [...] uint32 of a prefix extended by token x."""
  h = (h ^ (jnp.asarray(x).astype(jnp.uint32) + jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
  return h ^ (h >> 15)


def table_row(h):
  return (h * jnp.uint32(0xC2B2AE35)) >> 20  # top 12 bits: [0, TABLE_ROWS)


def slot_hashes(tree: Tree, h):
  """[B, N + 1] prefix hash of every context slot of the tree, the root's being h [B]."""
  hs = jnp.broadcast_to(h[:, None], (h.shape[0], tree.num_nodes + 1))
  for _ in range(tree.max_depth):
    hs = hs.at[:, 1:].set(mix(take(hs, tree.parents + 1), tree.tokens))
  return hs


def toy_drafter(h):
  """next_logits for drafting from the root context h [B]."""
  return lambda tree, frontier: jnp.asarray(Q_TABLE)[table_row(
      take(slot_hashes(tree, h), frontier + 1))]


# method name -> (key, next_logits, batch, sampling) -> Tree
METHODS = {
    "chain": lambda k, f, b, sp: draft_fixed(k, f, b, V, (1, 1, 1), sp, Siblings.IID),
    "specinfer": lambda k, f, b, sp: draft_fixed(k, f, b, V, (3, 2, 1), sp, Siblings.IID),
    "rsd_c": lambda k, f, b, sp: draft_fixed(k, f, b, V, (3, 2, 1), sp,
                                             Siblings.WITHOUT_REPLACEMENT),
    "rsd_s": lambda k, f, b, sp: draft_stochastic_beam(k, f, b, V, depth=3, beam=3, sampling=sp),
    "eagle2": lambda k, f, b, sp: draft_dynamic(f, b, V, depth=3, beam=2, top_k=3, budget=8,
                                                sampling=sp),
}
ROOT_CHILDREN = {"chain": 1, "specinfer": 3, "rsd_c": 3, "rsd_s": 3}

N_SAMPLES = 20_000
L = 3  # emitted tokens compared with the exact distribution


@functools.lru_cache
def simulator(method: str, siblings: Siblings | None = None):
  """Jitted full speculative decoding of >= L tokens per row from root hashes h0 [B].

  Returns (tokens [B, L], accepted nodes in the first round [B]). `siblings` overrides the
  tree's sibling rule (the negative control). Sampling values are traced: one compile per method.
  """
  draft = METHODS[method]

  def run(key, h0, sampling):
    B = h0.shape[0]

    def body(state):
      key, out, count, h, first_n = state
      key, k_draft, k_verify = jax.random.split(key, 3)
      tree = draft(k_draft, toy_drafter(h), B, sampling)
      if siblings is not None:
        tree = dataclasses.replace(tree, siblings=siblings)
      target_logits = jnp.asarray(P_TABLE)[table_row(slot_hashes(tree, h))]  # [B, N+1, V]
      path, n, nxt = verify_tree(k_verify, tree, target_logits, sampling)
      emitted = emitted_tokens(tree, path, n, nxt)  # [B, D+1]
      idx = jnp.arange(emitted.shape[1])
      cols = jnp.where(idx <= n[:, None], count[:, None] + idx, out.shape[1])
      out = out.at[jnp.arange(B)[:, None], cols].set(emitted, mode="drop")
      for j in range(emitted.shape[1]):
        h = jnp.where(j <= n, mix(h, emitted[:, j]), h)
      first_n = jnp.where(count == 0, n, first_n)
      return key, out, count + n + 1, h, first_n

    state = (key, jnp.full((B, L + 8), -1, jnp.int32), jnp.zeros((B,), jnp.int32), h0,
             jnp.zeros((B,), jnp.int32))
    state = jax.lax.while_loop(lambda s: jnp.any(s[2] < L), body, state)
    return state[1][:, :L], state[4]

  return jax.jit(run)


def rng_key(seed):
  """An RBG key: the simulations compile in half the time of threefry's."""
  return jax.random.key(seed, impl="rbg")


def simulate(method, sampling, seed, siblings=None, h0=None):
  h0 = jnp.full((N_SAMPLES,), H0, jnp.uint32) if h0 is None else h0
  tokens, first_n = simulator(method, siblings)(rng_key(seed), h0, sampling)
  return np.asarray(tokens), np.asarray(first_n)


# ---------------------------------------------------------------------------------------------
# exact distributions and the chi-square test

CHI2_Z = 3.719  # standard-normal quantile for a 1e-4 upper tail


def chi2_critical(dof):
  """Wilson–Hilferty approximation of the chi-square quantile with upper tail 1e-4."""
  c = 2.0 / (9.0 * dof)
  return dof * (1.0 - c + CHI2_Z * math.sqrt(c)) ** 3


def chi2_statistic(counts, probs):
  """(chi2, dof) of counts against probs; inf if a zero-probability cell was hit. Cells expecting
  fewer than 5 draws are pooled into one bin so the approximation holds."""
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  if counts[probs == 0].sum() > 0:
    return math.inf, 1
  expected = probs * counts.sum()
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  obs, exp = obs[exp > 0], exp[exp > 0]
  return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


@jax.jit
def _context_probs(h0, sampling):
  """Target and draft distributions after 0, 1 and 2 tokens from h0: [V], [V, V], [V, V, V]."""
  t = jnp.arange(V, dtype=jnp.uint32)
  hashes = (h0, mix(h0, t), mix(mix(h0, t)[:, None], t[None, :]))
  probs = lambda table, h: jnp.exp(processed_logprobs(jnp.asarray(table)[table_row(h)], sampling))
  return [probs(P_TABLE, h) for h in hashes], probs(Q_TABLE, h0)


def context_probs(sampling, h0=H0):
  p, q = _context_probs(jnp.uint32(h0), sampling)
  return [np.asarray(x, np.float64) for x in p], np.asarray(q, np.float64)


def exact_joint(sampling, h0=H0):
  """Exact probabilities [V, V, V] of the first three tokens the target emits from h0."""
  (p1, p2, p3), _ = context_probs(sampling, h0)
  return p1[:, None, None] * p2[:, :, None] * p3


def lossless_stats(tokens, sampling):
  """chi2 (stat, dof) of the first two and the first three emitted tokens."""
  joint = exact_joint(sampling)
  two = tokens[:, 0] * V + tokens[:, 1]
  three = two * V + tokens[:, 2]
  return (chi2_statistic(np.bincount(two, minlength=V * V), joint.sum(-1).ravel()),
          chi2_statistic(np.bincount(three, minlength=V ** 3), joint.ravel()))


def reject_all_probability(p, q, siblings, tokens=None, k=1):
  """Exact probability that recursive rejection rejects all k root children (FIXED: `tokens`)."""
  if siblings == Siblings.FIXED:
    r = 1.0
    for x in tokens:
      r *= 1.0 - p[x]
      p = np.where(np.arange(V) == x, 0.0, p)
      p = p / p.sum() if p.sum() > 0 else p
    return r
  if siblings == Siblings.IID:
    r = 1.0
    for _ in range(k):
      res = np.maximum(p - q, 0.0)
      r *= res.sum()
      p = res / max(res.sum(), 1e-300)
    return r

  def rec(p, q, left):  # without replacement: expectation over the ordered draws
    if left == 0:
      return 1.0
    res = np.maximum(p - q, 0.0)
    if res.sum() <= 0:
      return 0.0
    total = 0.0
    for x in np.nonzero(q > 0)[0]:  # P(draw x and reject it) = max(q(x) - p(x), 0)
      if q[x] > p[x]:
        rest = np.where(np.arange(V) == x, 0.0, q)
        total += (q[x] - p[x]) * rec(res / res.sum(), rest / rest.sum(), left - 1)
    return total

  return rec(p, q, k)


SAMPLINGS = {"t1": SamplingParams(temperature=1.0), "t0.8_k5": SamplingParams(0.8, top_k=5)}


# ---------------------------------------------------------------------------------------------
# statistical losslessness over full speculative rounds


# Both settings for the two sibling rules' trees (SpecInfer's i.i.d., RSD-S's without
# replacement) and one each for the others (each case runs its own 20k rows).
LOSSLESS_CASES = [("chain", "t1"), ("specinfer", "t1"), ("specinfer", "t0.8_k5"),
                  ("rsd_c", "t0.8_k5"), ("rsd_s", "t1"), ("rsd_s", "t0.8_k5"),
                  ("eagle2", "t0.8_k5")]


@pytest.mark.parametrize("method, sampling", LOSSLESS_CASES)
def test_tree_speculative_sampling_is_lossless(method, sampling):
  sp = SAMPLINGS[sampling]
  tokens, first_n = simulate(method, sp, seed=list(METHODS).index(method) * 10 + len(sampling))
  (s2, d2), (s3, d3) = lossless_stats(tokens, sp)
  # the first round's acceptance of a root child, against the exact rule
  (p, _, _), q = context_probs(sp)
  if method == "eagle2":  # a deterministic tree: its root children give the exact rate
    tree = jax.jit(lambda sp: METHODS[method](None, toy_drafter(
        jnp.full((1,), H0, jnp.uint32)), 1, sp))(sp)
    roots = np.asarray(tree.tokens[0])[np.asarray(tree.valid[0] & (tree.parents[0] == -1))]
    reject = reject_all_probability(p, q, Siblings.FIXED, tokens=roots)
  else:
    siblings = Siblings.IID if method in ("chain", "specinfer") else Siblings.WITHOUT_REPLACEMENT
    reject = reject_all_probability(p, q, siblings, k=ROOT_CHILDREN[method])
  rate = (first_n >= 1).mean()
  z = (rate - (1 - reject)) / math.sqrt(max(reject * (1 - reject), 1e-12) / len(first_n))
  print(f"{method} {sampling}: chi2 two={s2:.1f} (dof {d2}, crit {chi2_critical(d2):.1f}) "
        f"three={s3:.1f} (dof {d3}, crit {chi2_critical(d3):.1f}); first-round accept "
        f"{rate:.4f} vs exact {1 - reject:.4f} (z={z:.2f}); mean first-round nodes "
        f"{first_n.mean():.2f}")
  assert s2 < chi2_critical(d2)
  assert s3 < chi2_critical(d3)
  assert abs(z) < 4.5
  assert 0.05 < 1 - reject < 0.95  # the acceptance check is informative here


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_iid_rule_on_without_replacement_siblings_is_caught(sampling):
  """SpecInfer's rule on Gumbel-Top-k siblings (q_i = q instead of q minus earlier siblings) is
  biased; the chi-square test above sees it. At temperature 1 the bias is small (first-token TV
  about 0.02: at 20k draws the statistic is 1.3-1.7x the critical value), so there this pools
  three runs of the same program (60k draws) and asks for twice the critical value."""
  sp = SAMPLINGS[sampling]
  runs = 3 if sampling == "t1" else 1
  tokens = np.concatenate([simulate("rsd_c", sp, seed=70 + i, siblings=Siblings.IID)[0]
                           for i in range(runs)])
  (s2, d2), (s3, d3) = lossless_stats(tokens, sp)
  print(f"iid rule on RSD-C {sampling}: chi2 two={s2:.1f} (crit {chi2_critical(d2):.1f}) "
        f"three={s3:.1f} (crit {chi2_critical(d3):.1f})")
  assert s2 > 2 * chi2_critical(d2)
  assert s3 > chi2_critical(d3)


# ---------------------------------------------------------------------------------------------
# greedy

greedy_jit = jax.jit(verify_tree_greedy)
sampled_jit = jax.jit(verify_tree_sampled)


def test_logits_without_a_slot_per_context_are_refused():
  """target_logits [B, N, V] (the root's context forgotten) were clipped onto other nodes'
  contexts: a plausible wrong path, greedy and sampled, no error."""
  rng = np.random.default_rng(2)
  tree = random_tree(rng, 2, 5, 4, 3, marks=False)
  short = jnp.asarray(rng.standard_normal((2, 5, 4)).astype(np.float32))
  with pytest.raises(ValueError, match=r"target_logits must be \[B, N \+ 1, V\]"):
    verify_tree_greedy(tree, short)
  with pytest.raises(ValueError, match=r"target_logits must be \[B, N \+ 1, V\]"):
    verify_tree(jax.random.key(0), tree, short, SamplingParams(temperature=1.0))


def test_greedy_is_the_deepest_argmax_path():
  rng = np.random.default_rng(1)
  B, N, vocab, D = 256, 12, 3, 5
  tree = random_tree(rng, B, N, vocab, D, marks=False)
  logits = rng.standard_normal((B, N + 1, vocab)).astype(np.float32)
  path, n, nxt = greedy_jit(tree, logits)
  path, n, nxt = np.asarray(path), np.asarray(n), np.asarray(nxt)
  tokens, parents, valid = (np.asarray(a) for a in (tree.tokens, tree.parents, tree.valid))
  best = logits.argmax(-1)
  for b in range(B):
    def chain(i):  # root-to-node list, or None if some token is not the argmax at its parent
      nodes = []
      while i >= 0:
        if tokens[b, i] != best[b, parents[b, i] + 1]:
          return None
        nodes.append(i)
        i = parents[b, i]
      return nodes[::-1]
    ok = [c for i in range(N) if valid[b, i] and (c := chain(i)) is not None]
    want = max(ok, key=len) if ok else []
    assert n[b] == len(want)
    got = path[b, :n[b]].tolist()
    assert chain(got[-1]) == got if got else True  # a real argmax path of that length
    assert [tokens[b, i] for i in got] == [tokens[b, i] for i in want]
    assert nxt[b] == best[b, (got[-1] + 1) if got else 0]
  assert_root_paths(tree, path, n)
  assert 0 < (n == 0).sum() < B and (n >= 3).sum() > 0  # both outcomes occur


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_tree_decoding_equals_greedy_autoregressive(method):
  h0 = jax.random.bits(jax.random.key(2), (N_SAMPLES,), jnp.uint32)  # a different prompt per row
  tokens, first_n = simulate(method, GREEDY, seed=3, h0=h0)
  h, want = h0, []
  for _ in range(L):
    t = jnp.argmax(jnp.asarray(P_TABLE)[table_row(h)], axis=-1)
    want.append(np.asarray(t))
    h = mix(h, t)
  np.testing.assert_array_equal(tokens, np.stack(want, 1))
  assert first_n.max() >= 2 and first_n.min() == 0  # trees were used, rejections happened


# ---------------------------------------------------------------------------------------------
# verifier corner cases


@pytest.mark.parametrize("siblings", list(Siblings), ids=lambda s: s.value)
def test_sampled_rules_reproduce_greedy_on_one_hot_targets(siblings):
  """With one-hot p (and q of full support) every rule accepts exactly the argmax children."""
  rng = np.random.default_rng(4)
  B, N, vocab, D = 256, 12, 4, 4
  tree = random_tree(rng, B, N, vocab, D, distinct=True, marks=False)
  tree = dataclasses.replace(tree, siblings=siblings)
  best = rng.integers(0, vocab, (B, N + 1))
  best[:, 0] = np.where(rng.random(B) < 0.7, np.asarray(tree.tokens[:, 0]), best[:, 0])
  logits = np.where(np.eye(vocab)[best] > 0, 1e4, -1e4).astype(np.float32)
  got = sampled_jit(rng_key(5), tree, logits, SamplingParams(1.0))
  want = greedy_jit(tree, logits)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert_root_paths(tree, *map(np.asarray, want[:2]))
  assert (np.asarray(want[1]) >= 2).sum() > 10


def test_zero_q_and_padding_are_safe():
  """q = 0 at drafted tokens (an illegal draft) gives no NaN and accepts only valid root paths."""
  rng = np.random.default_rng(6)
  B, N, vocab, D = 256, 12, 4, 4
  tree = random_tree(rng, B, N, vocab, D, marks=False)
  logits = rng.standard_normal((B, N + 1, vocab)).astype(np.float32)
  for siblings in Siblings:
    bad = dataclasses.replace(tree, q=jnp.zeros_like(tree.q), siblings=siblings)
    path, n, nxt = map(np.asarray, sampled_jit(rng_key(7), bad, logits,
                                               SamplingParams(1.0, top_k=2)))
    assert ((nxt >= 0) & (nxt < vocab)).all()
    assert_root_paths(tree, path, n)
    assert n.max() >= 2


def test_dispatch_and_vmap():
  rng = np.random.default_rng(8)
  B, N, vocab, D = 256, 12, 4, 4  # the shapes above: the jitted verifiers are reused
  tree = random_tree(rng, B, N, vocab, D, marks=False)
  logits = (2 * rng.standard_normal((B, N + 1, vocab))).astype(np.float32)
  key = jax.random.key(9)  # threefry: its draws do not change under vmap (RBG's do)
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b))
  verify_jit = jax.jit(verify_tree)
  sp = SamplingParams(temperature=1.0, top_k=3)
  for mode in ("auto", None):  # the branch picked while tracing (static mode), or by lax.cond
    assert same(verify_jit(key, tree, logits, SamplingParams(mode=mode)),
                greedy_jit(tree, logits))
    assert same(verify_jit(key, tree, logits, SamplingParams(1.0, top_k=3, mode=mode)),
                sampled_jit(key, tree, logits, sp))
  assert not same(verify_jit(key, tree, logits, sp), greedy_jit(tree, logits))
  keys = jax.random.split(key, 3)
  batched = jax.jit(jax.vmap(verify_tree, in_axes=(0, None, None, None)))(keys, tree, logits, sp)
  for i in range(3):
    assert same([a[i] for a in batched], verify_jit(keys[i], tree, logits, sp))


def test_ids_outside_the_vocabulary_are_never_accepted():
  """A node of -3 (take_along_axis would wrap it to token V - 3) or V is never on the path, even
  where the target and the draft put all their mass on token V - 3; every sibling rule."""
  B, N, V = 8, 3, 6
  chain = dict(parents=jnp.tile(jnp.asarray([-1, 0, 1]), (B, 1)),
               depth=jnp.tile(jnp.asarray([1, 2, 3]), (B, 1)), valid=jnp.ones((B, N), bool),
               q=jax.nn.one_hot(jnp.full((B, N + 1), V - 3), V), max_depth=3)
  logits = np.where(np.arange(V) == V - 3, 1e4, -1e4) * np.ones((B, N + 1, V), np.float32)
  for siblings in Siblings:
    for bad in (-3, V):
      tree = Tree(tokens=jnp.full((B, N), bad, jnp.int32), siblings=siblings, **chain)
      _, n_acc, next_tok = sampled_jit(rng_key(0), tree, logits.astype(np.float32),
                                       SamplingParams(1.0))
      assert (np.asarray(n_acc) == 0).all(), (siblings, bad)
      assert (np.asarray(next_tok) == V - 3).all()
