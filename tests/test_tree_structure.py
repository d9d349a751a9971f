"""Token trees: ancestor masks and paths against a brute-force walk, pruning keeps the best
ancestor-closed nodes in topological order, merging deduplicates paths; drafting lays trees out as
documented, Gumbel-Top-k and stochastic beam search draw with the right laws, and the EAGLE-2
dynamic tree matches a plain-Python reference."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.sampling.processing import GREEDY, SamplingParams, processed_logprobs
from jspec.tree.draft import (draft_dynamic, draft_fixed, draft_stochastic_beam,
                              fixed_tree_size)
from jspec.tree.structure import (Siblings, Tree, ancestor_mask, merge, path_to, path_tokens,
                                  positions, prune_to_budget)

# ---------------------------------------------------------------------------------------------
# random trees and brute-force references


def random_tree(rng, B, N, vocab, max_depth, distinct=False, p_valid=0.85, marks=True):
  """Random topological trees with invalid padding; tokens from a small vocabulary, distinct
  among siblings if asked (a parent then takes at most `vocab` children). q is uniform; with
  `marks`, q[:, s, 0] = s tags each context slot so tests can follow nodes through re-indexing."""
  tokens = np.zeros((B, N), int)
  parents = np.full((B, N), -1)
  depth = np.zeros((B, N), int)
  valid = rng.random((B, N)) < p_valid
  for b in range(B):
    used = {}
    for i in range(N):
      cands = [j for j in [-1] + list(range(i))
               if (j < 0 or (valid[b, j] and depth[b, j] < max_depth))
               and not (distinct and len(used.get(j, ())) == vocab)]
      parents[b, i] = cands[rng.integers(len(cands))]
      depth[b, i] = 1 if parents[b, i] < 0 else depth[b, parents[b, i]] + 1
      free = [t for t in range(vocab) if not (distinct and t in used.get(parents[b, i], ()))]
      tokens[b, i] = free[rng.integers(len(free))]
      if valid[b, i]:
        used.setdefault(parents[b, i], set()).add(tokens[b, i])
  q = np.full((B, N + 1, vocab), 1.0 / vocab, np.float32)
  if marks:
    q[:, :, 0] = np.arange(N + 1)
  return Tree(tokens=jnp.asarray(np.where(valid, tokens, 0), jnp.int32),
              parents=jnp.asarray(np.where(valid, parents, -1), jnp.int32),
              depth=jnp.asarray(np.where(valid, depth, 0), jnp.int32), valid=jnp.asarray(valid),
              q=jnp.asarray(q), max_depth=max_depth, siblings=Siblings.IID)


def walk(tree, b, i):
  """Root-to-node list of node indices, by following parents in Python."""
  parents = np.asarray(tree.parents)
  nodes = []
  while i >= 0:
    nodes.append(int(i))
    i = parents[b, i]
  return nodes[::-1]


def token_paths(tree, b):
  """{node: tuple of tokens on its root path} for the valid nodes of row b."""
  tokens, valid = np.asarray(tree.tokens), np.asarray(tree.valid)
  return {i: tuple(int(tokens[b, j]) for j in walk(tree, b, i))
          for i in range(tree.num_nodes) if valid[b, i]}


def assert_root_paths(tree, path, n):
  """Each row's path is a root-to-node chain of valid nodes of length n, then -1 padding."""
  parents, valid = np.asarray(tree.parents), np.asarray(tree.valid)
  for b in range(path.shape[0]):
    nodes = path[b, :n[b]]
    assert (path[b, n[b]:] == -1).all() and valid[b, nodes].all()
    assert [parents[b, i] for i in nodes] == ([-1] + nodes[:-1].tolist())[:len(nodes)]


def assert_well_formed(tree):
  """Topological order, depths consistent with parents, valid nodes first-class, padding inert."""
  tokens, parents, depth, valid = map(np.asarray, (tree.tokens, tree.parents, tree.depth,
                                                   tree.valid))
  ids = np.arange(tree.num_nodes)
  assert (parents < ids).all()
  pv = np.take_along_axis(valid, np.maximum(parents, 0), 1)
  pd = np.take_along_axis(depth, np.maximum(parents, 0), 1)
  assert (~valid | (parents < 0) | pv).all()
  assert (~valid | (depth == np.where(parents < 0, 1, pd + 1))).all()
  assert (depth <= tree.max_depth).all()
  assert ((valid) | ((parents == -1) & (depth == 0))).all()


# ---------------------------------------------------------------------------------------------
# structure helpers

anc_jit = jax.jit(ancestor_mask)
path_jit = jax.jit(path_to)


@pytest.mark.parametrize("N, D, seed", [(1, 1, 0), (9, 3, 1), (24, 6, 2)])
def test_ancestor_mask_matches_walk(N, D, seed):
  B = 32
  tree = random_tree(np.random.default_rng(seed), B, N, 5, D)
  mask = np.asarray(anc_jit(tree))
  valid = np.asarray(tree.valid)
  for b in range(B):
    for i in range(N):
      want = np.zeros(N, bool)
      want[walk(tree, b, i) if valid[b, i] else [i]] = True
      np.testing.assert_array_equal(mask[b, i], want)
  assert_well_formed(tree)


def test_set_node_columns_drops_columns_outside_the_row():
  """Columns outside [0, L) are dropped; a negative one wrapped into the neighbouring node's row."""
  from jspec.tree.structure import set_node_columns
  x = jnp.zeros((1, 2, 4))
  cols = jnp.asarray([[[-1, 1], [4, 2]]])  # [B, W, 2]
  got = np.asarray(set_node_columns(x, cols, 1.0))
  np.testing.assert_array_equal(got, [[[0, 1, 0, 0], [0, 0, 1, 0]]])


def test_positions_path_to_and_path_tokens():
  B, N, D = 32, 16, 5
  tree = random_tree(np.random.default_rng(3), B, N, 5, D)
  lengths = jnp.arange(B, dtype=jnp.int32) + 7
  np.testing.assert_array_equal(positions(tree, lengths),
                                np.asarray(lengths)[:, None] + np.asarray(tree.depth) - 1)
  valid = np.asarray(tree.valid)
  for i in [-1] + list(range(N)):
    path, n = map(np.asarray, path_jit(tree, jnp.full((B,), i, jnp.int32)))
    toks = np.asarray(path_tokens(tree, jnp.asarray(path)))
    assert path.shape == (B, D)
    for b in range(B):
      want = walk(tree, b, i) if i >= 0 and valid[b, i] else []
      if i >= 0 and not valid[b, i]:
        continue  # the path to a padding node is not defined
      assert n[b] == len(want) and path[b, :n[b]].tolist() == want
      assert (path[b, n[b]:] == -1).all() and (toks[b, n[b]:] == -1).all()
      np.testing.assert_array_equal(toks[b, :n[b]], np.asarray(tree.tokens)[b, want])


def kept_nodes(pruned):
  """Original indices of a re-indexed tree's valid nodes, read from the q[:, s, 0] = s marks."""
  ids = np.asarray(pruned.q)[:, 1:, 0].astype(int) - 1
  return [ids[b][np.asarray(pruned.valid)[b]] for b in range(ids.shape[0])]


@pytest.mark.parametrize("monotone", [False, True], ids=["random", "cumulative"])
def test_prune_keeps_best_ancestor_closed_nodes(monotone):
  B, N, D, budget = 32, 20, 5, 8
  rng = np.random.default_rng(4)
  tree = random_tree(rng, B, N, 6, D, p_valid=0.6)
  raw = rng.standard_normal((B, N)).astype(np.float32)
  if monotone:  # cumulative log-probabilities: never above the parent's
    parents = np.asarray(tree.parents)
    raw = -np.abs(raw)
    for i in range(N):
      raw[:, i] += np.where(parents[:, i] >= 0, raw[np.arange(B), np.maximum(parents[:, i], 0)], 0)
  pruned = jax.jit(prune_to_budget, static_argnums=2)(tree, jnp.asarray(raw), budget)
  assert pruned.num_nodes == budget and pruned.siblings == Siblings.FIXED
  assert pruned.q.shape == (B, budget + 1, tree.q.shape[-1])
  assert_well_formed(pruned)
  valid = np.asarray(tree.valid)
  for b, kept in enumerate(kept_nodes(pruned)):
    # reference: rank by the minimum score on the root path, ties to the lower index
    eff = {i: min(raw[b, j] for j in walk(tree, b, i)) for i in range(N) if valid[b, i]}
    want = sorted(sorted(eff, key=lambda i: (-eff[i], i))[:budget])
    assert kept.tolist() == want  # the right set, in the original (topological) order
    if monotone:
      assert want == sorted(sorted(eff, key=lambda i: (-raw[b, i], i))[:budget])
    new = {n: kept[n] for n in range(len(kept))}
    for n, old in new.items():  # parents, tokens and depths follow the nodes
      p = int(pruned.parents[b, n])
      assert (new[p] if p >= 0 else -1) == int(tree.parents[b, old])
      assert int(pruned.tokens[b, n]) == int(tree.tokens[b, old])
      assert int(pruned.depth[b, n]) == int(tree.depth[b, old])
    assert len(kept) == min(budget, valid[b].sum())


def test_merge_deduplicates_paths():
  B, N, D = 24, 14, 4
  rng = np.random.default_rng(5)
  a = random_tree(rng, B, N, 2, D)  # two tokens: the trees share many paths
  b_tree = random_tree(rng, B, N - 4, 2, D)
  b_tree = dataclasses.replace(b_tree, q=b_tree.q.at[:, 1:, 0].add(100.0))  # mark b's slots
  merged = jax.jit(merge)(a, b_tree)
  assert merged.num_nodes == 2 * N - 4 and merged.siblings == Siblings.FIXED
  assert_well_formed(merged)
  for b in range(B):
    pa, pb, pm = token_paths(a, b), token_paths(b_tree, b), token_paths(merged, b)
    assert sorted(pm.values()) == sorted(set(pa.values()) | set(pb.values()))  # each once
    assert (np.asarray(merged.valid)[b] == (np.arange(2 * N - 4) < len(pm))).all()
    marks = np.asarray(merged.q)[b, 1:, 0]
    for n, path in pm.items():  # a path of `a` keeps a's node (and q), else b's first one
      in_a = [i for i, p in pa.items() if p == path]
      want = min(in_a) + 1 if in_a else 101 + min(i for i, p in pb.items() if p == path)
      assert marks[n] == want
  again = jax.jit(merge)(a, a)
  for b in range(B):
    assert sorted(token_paths(again, b).values()) == sorted(set(token_paths(a, b).values()))


# ---------------------------------------------------------------------------------------------
# drafting, with a toy drafter whose logits depend on the whole path:
# logits(x_1..x_d) = BASE + sum_i EMB[i, x_i]

V = 12
_rng = np.random.default_rng(6)
BASE = (1.5 * _rng.standard_normal(V)).astype(np.float32)
EMB = (1.5 * _rng.standard_normal((8, V, V))).astype(np.float32)


def path_logits(path):
  """Drafter logits [V] after a token path (numpy reference)."""
  return BASE + sum(EMB[i, t] for i, t in enumerate(path))


def toy_next_logits(tree, frontier):
  """[B, W, V] drafter logits at the frontier nodes' contexts."""
  out = []
  for w in range(frontier.shape[1]):
    path, _ = path_to(tree, frontier[:, w])
    toks = path_tokens(tree, path)  # [B, D]
    depth_ids = jnp.arange(toks.shape[1])
    emb = jnp.asarray(EMB)[depth_ids, jnp.maximum(toks, 0)]  # [B, D, V]
    out.append(BASE + jnp.sum(jnp.where((toks >= 0)[..., None], emb, 0.0), axis=1))
  return jnp.stack(out, axis=1)


_logprobs = jax.jit(processed_logprobs)


def q_of(path, sampling):
  return np.exp(np.asarray(_logprobs(path_logits(path), sampling), np.float64))


@pytest.mark.parametrize("siblings", list(Siblings), ids=lambda s: s.value)
def test_draft_fixed_layout(siblings):
  B, branching = 16, (3, 2, 2)
  sp = SamplingParams(temperature=0.9, top_k=8)
  tree = jax.jit(lambda k: draft_fixed(k, toy_next_logits, B, V, branching, sp, siblings))(
      jax.random.key(7))
  N = fixed_tree_size(branching)
  assert tree.num_nodes == N == 3 + 6 + 12 and tree.siblings == siblings
  assert np.asarray(tree.valid).all()
  assert_well_formed(tree)
  np.testing.assert_array_equal(np.asarray(tree.depth)[0], [1] * 3 + [2] * 6 + [3] * 12)
  np.testing.assert_array_equal(np.asarray(tree.parents)[0],
                                [-1] * 3 + [0, 0, 1, 1, 2, 2] + list(np.repeat(np.arange(3, 9), 2)))
  q = np.asarray(tree.q, np.float64)
  for b in range(B):
    paths = token_paths(tree, b)
    for s in range(N + 1):
      if s > 9:  # leaves: never drawn from
        assert (q[b, s] == 0).all()
        continue
      want = q_of(paths[s - 1] if s else (), sp)
      np.testing.assert_allclose(q[b, s], want, rtol=1e-5, atol=1e-6)
      kids = [int(tree.tokens[b, i]) for i in range(N) if int(tree.parents[b, i]) == s - 1]
      assert all(want[k] > 0 for k in kids)
      if siblings == Siblings.FIXED:
        assert kids == np.argsort(-want, kind="stable")[:len(kids)].tolist()
      if siblings != Siblings.IID:
        assert len(set(kids)) == len(kids)


def chi2_ok(counts, probs, z=3.719):
  """Chi-square goodness of fit at upper tail 1e-4 (cells expecting < 5 pooled)."""
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  if counts[probs == 0].sum() > 0:
    return False
  exp = probs * counts.sum()
  big = exp >= 5
  obs, exp = np.append(counts[big], counts[~big].sum()), np.append(exp[big], exp[~big].sum())
  stat, dof = ((obs - exp) ** 2 / np.maximum(exp, 1e-300))[exp > 0].sum(), (exp > 0).sum() - 1
  c = 2.0 / (9.0 * dof)
  return stat < dof * (1.0 - c + z * math.sqrt(c)) ** 3


DRAWS = 20_000


def test_gumbel_top_k_children_are_ordered_draws_without_replacement():
  sp = SamplingParams(temperature=1.0)
  tree = jax.jit(lambda k: draft_fixed(k, toy_next_logits, DRAWS, V, (3,), sp,
                                       Siblings.WITHOUT_REPLACEMENT))(jax.random.key(8))
  x = np.asarray(tree.tokens)  # [DRAWS, 3]
  q = q_of((), sp)
  pair = q[:, None] * q[None, :] / (1 - q[:, None]) * (1 - np.eye(V))  # P(x1, x2)
  assert chi2_ok(np.bincount(x[:, 0] * V + x[:, 1], minlength=V * V), pair.ravel())
  assert (x[:, 0] != x[:, 1]).all() and (x[:, 1] != x[:, 2]).all() and (x[:, 0] != x[:, 2]).all()


@pytest.mark.parametrize("sp, beam", [(SamplingParams(1.0), 3), (SamplingParams(0.8, top_k=4), 5)],
                         ids=["t1", "k4_beam5"])
def test_stochastic_beam_search(sp, beam):
  """The best final beam is an exact draw from q over sequences (Gumbel-max over sequences), each
  layer is sorted, siblings are distinct, and candidates q excludes never appear."""
  depth = 3
  draft = jax.jit(lambda k, sp: draft_stochastic_beam(k, toy_next_logits, DRAWS, V, depth=depth,
                                                      beam=beam, sampling=sp))
  tree = draft(jax.random.key(9), sp)
  assert tree.num_nodes == depth * beam and tree.siblings == Siblings.WITHOUT_REPLACEMENT
  assert_well_formed(tree)
  tokens, parents, valid = map(np.asarray, (tree.tokens, tree.parents, tree.valid))
  np.testing.assert_array_equal(np.asarray(tree.depth)[valid],
                                (np.arange(depth * beam) // beam + 1)[None].repeat(DRAWS, 0)[valid])
  assert valid[:, ::beam].all()  # every layer has its best candidate
  # top-4 filtering leaves 4 root children for a beam of 5: the fifth slot is padding
  assert valid[:, :beam].sum(1).max() == min(beam, int((q_of((), sp) > 0).sum()))
  for b in range(50):  # siblings distinct, and drawn from the support of q
    paths = token_paths(tree, b)
    for i, path in paths.items():
      assert q_of(path[:-1], sp)[path[-1]] > 0
    kids = {}
    for i in paths:
      kids.setdefault(int(parents[b, i]), []).append(int(tokens[b, i]))
    assert all(len(set(k)) == len(k) for k in kids.values())
  # the first node of the last layer carries the maximum over all sequences: a draw from q
  rows = np.arange(DRAWS)
  n3 = np.full(DRAWS, (depth - 1) * beam)
  n2 = parents[rows, n3]
  n1 = parents[rows, n2]
  seq = np.stack([tokens[rows, n1], tokens[rows, n2], tokens[rows, n3]], 1)  # [DRAWS, 3]
  q12 = q_of((), sp)[:, None] * np.stack([q_of((a,), sp) for a in range(V)])
  counts = np.bincount(seq[:, 0] * V + seq[:, 1], minlength=V * V)
  assert chi2_ok(counts, q12.ravel())
  a, c = np.unravel_index(np.argmax(counts), (V, V))  # the third token given the likeliest pair
  rows = (seq[:, 0] == a) & (seq[:, 1] == c)
  assert chi2_ok(np.bincount(seq[rows, 2], minlength=V), q_of((a, c), sp))


def eagle2_reference(row_logits, depth, beam, top_k, budget):
  """Plain-Python EAGLE-2: {token path: cumulative log q} of the kept nodes (greedy ranking)."""
  def logq(path):
    x = row_logits(path)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()
  layer, pool = [((), 0.0)], {}
  for _ in range(depth):
    cands = []
    for path, s in layer:
      lq = logq(path)
      for t in np.argsort(-lq, kind="stable")[:top_k]:
        cands.append((path + (int(t),), s + lq[t]))
    pool.update(cands)
    layer = sorted(cands, key=lambda c: -c[1])[:beam]
  return dict(sorted(pool.items(), key=lambda c: -c[1])[:budget])


def test_dynamic_tree_matches_reference():
  B, depth, beam, top_k, budget = 4, 4, 3, 3, 10
  tree = jax.jit(lambda: draft_dynamic(toy_next_logits, B, V, depth=depth, beam=beam, top_k=top_k,
                                       budget=budget, sampling=GREEDY))()
  assert tree.num_nodes == budget and tree.siblings == Siblings.FIXED
  assert_well_formed(tree)
  want = eagle2_reference(path_logits, depth, beam, top_k, budget)
  for b in range(B):  # the toy drafter does not depend on the row
    assert sorted(token_paths(tree, b).values()) == sorted(want)
  assert max(len(p) for p in want) >= 3  # the budget went deep, not only wide
