"""verify: greedy prefix matching by hand; speculative sampling accepts a perfect drafter, never
emits a filtered token, is statistically lossless (and a wrong rule is caught by the same test);
jit, vmap, the greedy/sampled dispatch and extreme inputs."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.sampling import verify as verify_mod
from jspec.sampling.processing import GREEDY, SamplingParams, argmax, processed_logprobs
from jspec.sampling.verify import accepted_mask, verify, verify_greedy, verify_sampled

# eager JAX compiles every primitive separately, which dominates run time here; jit once instead
greedy_jit = jax.jit(verify_greedy)
sampled_jit = jax.jit(verify_sampled)
verify_jit = jax.jit(verify)
logprobs_jit = jax.jit(processed_logprobs)


def peaked_logits(argmaxes, V, scale=5.0, seed=0):
  """Logits [B, L, V] with the given argmax at each position (noise below the peak)."""
  argmaxes = np.asarray(argmaxes)
  noise = np.random.default_rng(seed).uniform(0, 1, argmaxes.shape + (V,))
  return jnp.asarray(noise + scale * np.eye(V)[argmaxes], jnp.float32)


# ---------------------------------------------------------------------------------------------
# greedy


def test_argmax_is_jnp_argmax_with_ties_nan_and_inf():
  """The two-pass argmax every greedy path uses picks exactly what jnp.argmax picks: the first
  maximum, the first NaN when there is one, index 0 of an all -inf row."""
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 4, (6, 3, 50)).astype(np.float32)  # small integers: many ties
  x[0, 0, [7, 30]] = np.nan
  x[1, 1] = -np.inf
  x[2, 2, 5:] = np.inf
  x[3, 0, 49] = 100.0  # the maximum at the last index
  x[4] = rng.standard_normal((3, 50))
  got = jax.jit(argmax)(jnp.asarray(x))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  assert int(got[0, 0]) == 7 and int(got[1, 1]) == 0 and int(got[2, 2]) == 5


@pytest.mark.parametrize("draft, best, n, nxt", [
    ([3, 1, 4], [3, 1, 4, 7], 3, 7),  # all accepted: bonus = argmax at G
    ([2, 1, 4], [3, 1, 4, 7], 0, 3),  # mismatch at 0 (later matches must not count)
    ([3, 0, 4], [3, 1, 4, 7], 1, 1),  # mismatch in the middle
    ([3, 1, 5], [3, 1, 4, 7], 2, 4),  # mismatch at the last draft position
])
def test_greedy_hand_cases(draft, best, n, nxt):
  n_acc, next_tok = greedy_jit(jnp.asarray([draft], jnp.int32), peaked_logits([best], 9))
  assert (int(n_acc[0]), int(next_tok[0])) == (n, nxt)
  assert n_acc.dtype == jnp.int32 and next_tok.dtype == jnp.int32


def test_greedy_batch_rows_differ():
  draft = jnp.asarray([[3, 1, 4], [2, 1, 4], [3, 0, 4], [3, 1, 5]], jnp.int32)
  logits = peaked_logits([[3, 1, 4, 7], [3, 1, 4, 6], [3, 1, 4, 7], [3, 1, 4, 8]], 9)
  n_acc, next_tok = greedy_jit(draft, logits)
  assert n_acc.tolist() == [3, 0, 1, 2]
  assert next_tok.tolist() == [7, 3, 1, 4]
  assert accepted_mask(n_acc, 3).tolist() == [
      [True, True, True], [False, False, False], [True, False, False], [True, True, False]]


# ---------------------------------------------------------------------------------------------
# sampled: exact cases


def sample_np(rng, probs):
  """One index per row of probs [..., V] (numpy, so tests need no eager JAX ops)."""
  cdf = np.cumsum(np.asarray(probs, np.float64), axis=-1)
  u = rng.random(cdf.shape[:-1] + (1,)) * cdf[..., -1:]
  return np.minimum((u >= cdf).sum(-1), cdf.shape[-1] - 1).astype(np.int32)


def test_perfect_drafter_accepts_everything():
  B, G, V = 4096, 3, 10
  sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
  rng = np.random.default_rng(1)
  logits = np.broadcast_to(2.0 * rng.standard_normal((1, G + 1, V)), (B, G + 1, V))
  logits = logits.astype(np.float32)
  p = np.exp(np.asarray(logprobs_jit(logits, sp)))  # [B, G+1, V]
  draft = sample_np(rng, p[:, :G])
  n_acc, next_tok = sampled_jit(jax.random.key(3), draft, p[:, :G], logits, sp)
  assert (np.asarray(n_acc) == G).all()
  # the bonus token is a draw from p_G
  stat, dof = chi2_statistic(np.bincount(np.asarray(next_tok), minlength=V), p[0, G])
  assert stat < chi2_critical(dof)


def test_zero_target_prob_is_always_rejected():
  B, G, V = 4096, 3, 10
  sp = SamplingParams(temperature=1.0, top_k=3)
  rng = np.random.default_rng(4)
  logits = np.broadcast_to(rng.standard_normal((1, G + 1, V)), (B, G + 1, V)).astype(np.float32)
  p = np.exp(np.asarray(logprobs_jit(logits, sp)))  # [B, G+1, V], 3 nonzero per position
  q_uniform = np.full((B, G, V), 1.0 / V, np.float32)
  # position 0: a perfect draft (q = p, so always accepted); position 1: a token p filters out.
  x0 = sample_np(rng, p[:, 0])
  x1 = np.argmin(logits[:, 1], axis=-1).astype(np.int32)
  draft = np.stack([x0, x1, x1], axis=1)
  q = q_uniform.copy()
  q[:, 0] = p[:, 0]
  n_acc, next_tok = sampled_jit(jax.random.key(6), draft, q, logits, sp)
  assert (np.asarray(n_acc) == 1).all()
  assert (p[0, 1, np.asarray(next_tok)] > 0).all()  # the resample never lands on a filtered token
  # rejecting at position 0 instead: the same guarantee for p_0
  draft[:, 0] = x1
  n_acc, next_tok = sampled_jit(jax.random.key(7), draft, q_uniform, logits, sp)
  assert (np.asarray(n_acc) == 0).all()
  assert (p[0, 0, np.asarray(next_tok)] > 0).all()
  assert len(set(np.asarray(next_tok).tolist())) == 3  # all three allowed tokens do appear


# ---------------------------------------------------------------------------------------------
# sampled: statistical losslessness of the emitted tokens

N_DRAWS = 40_000
G_TOY, V_TOY = 3, 12
CHI2_Z = 3.719  # standard-normal quantile for a 1e-4 upper tail


def chi2_critical(dof):
  """Wilson–Hilferty approximation of the chi-square quantile with upper tail 1e-4."""
  c = 2.0 / (9.0 * dof)
  return dof * (1.0 - c + CHI2_Z * math.sqrt(c)) ** 3


def chi2_statistic(counts, probs):
  """(chi2, dof) of counts against probs; inf if a zero-probability cell was hit.

  Cells expecting fewer than 5 draws are pooled into one bin so the approximation holds.
  """
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  if counts[probs == 0].sum() > 0:
    return math.inf, 1
  expected = probs * counts.sum()
  big = expected >= 5
  obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
  exp = np.append(expected[big], expected[~big].sum())
  obs, exp = obs[exp > 0], exp[exp > 0]
  return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def toy_problem(seed):
  """Context-free toy: fixed target logits per position [G+2, V] and different draft logits.

  The draft is the target plus noise, as for a real drafter: unrelated logits would leave the
  filtered supports nearly disjoint and almost nothing accepted.
  """
  rng = np.random.default_rng(seed)
  target = 1.5 * rng.standard_normal((G_TOY + 2, V_TOY)).astype(np.float32)
  return target, target[:G_TOY + 1] + rng.standard_normal((G_TOY + 1, V_TOY)).astype(np.float32)


@functools.lru_cache
def _simulator(accept_rule, residual_rule):
  """Jitted simulation, one per (possibly monkeypatched) rule pair; values of SamplingParams are
  traced, so every sampling configuration shares one compilation."""
  del accept_rule, residual_rule  # cache keys only: verify_sampled reads the module's rules
  G = G_TOY

  def run(key, target_logits, draft_logits, sp):
    q = jnp.exp(processed_logprobs(draft_logits, sp))  # [G+1, V], the target's processing

    def one(key):
      kd1, kv1, kd2, kv2 = jax.random.split(key, 4)
      x = jax.random.categorical(kd1, jnp.log(q[:G]), axis=-1).astype(jnp.int32)  # [G]
      n1, t1 = verify_sampled(kv1, x[None], q[None, :G], target_logits[None, :G + 1], sp)
      # the step after a rejection at position 0 drafts positions 1..G and verifies them
      y = jax.random.categorical(kd2, jnp.log(q[1:]), axis=-1).astype(jnp.int32)
      n2, t2 = verify_sampled(kv2, y[None], q[None, 1:], target_logits[None, 1:], sp)
      n1, t1, n2, t2 = n1[0], t1[0], n2[0], t2[0]
      first = jnp.where(n1 >= 1, x[0], t1)
      second = jnp.where(n1 >= 2, x[1], jnp.where(n1 == 1, t1, jnp.where(n2 >= 1, y[0], t2)))
      return n1, first, second

    return jax.vmap(one)(jax.random.split(key, N_DRAWS))

  return jax.jit(run)


def simulate(target_logits, draft_logits, sp, seed):
  """Per draw: n_accepted and the first two emitted tokens, a second step filling in after an
  immediate rejection."""
  run = _simulator(verify_mod.accept_draw, verify_mod.residual_distribution)
  return [np.asarray(a) for a in run(jax.random.key(seed), target_logits, draft_logits, sp)]


def losslessness_stats(sp, seed=0):
  """chi2 statistics (first token, joint of first two) and the acceptance check's z-score."""
  target_logits, draft_logits = toy_problem(seed)
  n_acc, first, second = simulate(target_logits, draft_logits, sp, seed + 100)
  p = np.exp(np.asarray(logprobs_jit(target_logits, sp), np.float64))  # [G+2, V]
  q = np.exp(np.asarray(logprobs_jit(draft_logits, sp), np.float64))
  stat1, dof1 = chi2_statistic(np.bincount(first, minlength=V_TOY), p[0])
  stat2, dof2 = chi2_statistic(np.bincount(first * V_TOY + second, minlength=V_TOY ** 2),
                               np.outer(p[0], p[1]).ravel())
  # a lossless rule can still reject too often (always reject and sample p is lossless);
  # E[n_accepted] = sum_k prod_{i<k} alpha_i with alpha_i = sum_v min(p_i, q_i) pins that down.
  alpha = np.minimum(p[:G_TOY], q[:G_TOY]).sum(-1)
  expected_n = np.cumprod(alpha).sum()
  z_accept = (n_acc.mean() - expected_n) / (n_acc.std() / math.sqrt(N_DRAWS))
  return (stat1, dof1), (stat2, dof2), float(z_accept)


SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_k4": SamplingParams(temperature=0.7, top_k=4),
    "p0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_sampled_is_lossless(name):
  (s1, d1), (s2, d2), z = losslessness_stats(SAMPLINGS[name])
  print(f"{name}: first chi2={s1:.1f} (dof {d1}, crit {chi2_critical(d1):.1f}); "
        f"joint chi2={s2:.1f} (dof {d2}, crit {chi2_critical(d2):.1f}); accept z={z:.2f}")
  assert s1 < chi2_critical(d1)
  assert s2 < chi2_critical(d2)
  assert abs(z) < 4.5


def _resample_from_p(p, q):
  return p


def _accept_q_over_p(u, p_x, q_x):
  return u * p_x < q_x


@pytest.mark.parametrize("wrong", [
    ("residual_distribution", _resample_from_p),  # on rejection sample p instead of max(p − q, 0)
    ("accept_draw", _accept_q_over_p),  # accept with min(1, q/p) instead of min(1, p/q)
], ids=["resample_from_p", "accept_q_over_p"])
@pytest.mark.parametrize("name", ["t1", "t0.7_k4"])
def test_wrong_rule_fails_the_same_test(monkeypatch, wrong, name):
  monkeypatch.setattr(verify_mod, *wrong)
  (s1, d1), (s2, d2), _ = losslessness_stats(SAMPLINGS[name])
  print(f"{wrong[0]} {name}: first chi2={s1:.1f} (crit {chi2_critical(d1):.1f}); "
        f"joint chi2={s2:.1f} (crit {chi2_critical(d2):.1f})")
  assert s1 > 5 * chi2_critical(d1)
  assert s2 > 5 * chi2_critical(d2)


# ---------------------------------------------------------------------------------------------
# jit, vmap, dispatch, extreme inputs


def random_case(B=64, G=4, V=11, seed=0):
  rng = np.random.default_rng(seed)
  target_logits = 2.0 * rng.standard_normal((B, G + 1, V)).astype(np.float32)
  q = np.exp(2.0 * rng.standard_normal((B, G, V)))
  q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
  return sample_np(rng, q), q, target_logits


def same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_jit_and_vmap_agree():
  draft, q, logits = random_case()
  sp = SamplingParams(temperature=0.9, top_k=5)
  keys = jax.random.split(jax.random.key(11), 5)
  assert same(sampled_jit(keys[0], draft, q, logits, sp), verify_jit(keys[0], draft, q, logits, sp))
  n_acc, next_tok = jax.jit(jax.vmap(verify, in_axes=(0, None, None, None, None)))(
      keys, draft, q, logits, sp)
  assert n_acc.shape == next_tok.shape == (5, draft.shape[0])
  for i in range(5):
    assert same((n_acc[i], next_tok[i]), sampled_jit(keys[i], draft, q, logits, sp))
  assert len({tuple(np.asarray(t).tolist()) for t in next_tok}) == 5  # the keys matter


def test_dispatch_greedy_vs_sampled():
  draft, q, logits = random_case()
  key = jax.random.key(12)
  greedy = greedy_jit(draft, logits)
  sp = SamplingParams(temperature=1.0)
  sampled = sampled_jit(key, draft, q, logits, sp)
  for mode in ("auto", None):  # the branch picked while tracing (static mode), or by lax.cond
    assert same(verify_jit(key, draft, q, logits, SamplingParams(mode=mode)), greedy)
    assert same(verify_jit(key, draft, q, logits, SamplingParams(1.0, mode=mode)), sampled)
  assert not same(sampled, greedy)  # the two really differ on this input
  # per-row sampling params under vmap (cond becomes select): row 0 greedy, row 1 sampled
  rows = jax.jit(jax.vmap(lambda k, d, qq, l, s: verify(k, d[None], qq[None], l[None], s)))(
      jnp.stack([key, key]), draft[:2], q[:2], logits[:2],
      SamplingParams(temperature=jnp.asarray([0.0, 1.0]), top_k=jnp.asarray([0, 0]),
                     top_p=jnp.asarray([1.0, 1.0]), min_p=jnp.asarray([0.0, 0.0]),
                     repetition_penalty=jnp.asarray([1.0, 1.0]),
                     presence_penalty=jnp.asarray([0.0, 0.0]),
                     frequency_penalty=jnp.asarray([0.0, 0.0])))
  n_acc, next_tok = np.asarray(rows[0])[:, 0], np.asarray(rows[1])[:, 0]
  assert (n_acc[0], next_tok[0]) == (np.asarray(greedy[0])[0], np.asarray(greedy[1])[0])
  s1 = sampled_jit(key, draft[1:2], q[1:2], logits[1:2], sp)
  assert (n_acc[1], next_tok[1]) == (np.asarray(s1[0])[0], np.asarray(s1[1])[0])


@pytest.mark.parametrize("sp", [GREEDY, SamplingParams(1.0), SamplingParams(0.7, top_k=3),
                                SamplingParams(1.0, top_p=0.5)], ids=["greedy", "t1", "k3", "p0.5"])
def test_extreme_logits_and_one_hot_q(sp):
  B, G, V = 64, 4, 11  # random_case's shapes, so the jitted functions are reused
  rng = np.random.default_rng(3)
  best = rng.integers(0, V, (B, G + 1))
  logits = np.where(np.eye(V)[best] > 0, 1e4, -1e4).astype(np.float32)  # p is one-hot
  # drafts hit the target's token most of the time; q is one-hot (zeros off the drafted token)
  draft = np.where(rng.random((B, G)) < 0.6, best[:, :G], rng.integers(0, V, (B, G)))
  draft = draft.astype(np.int32)
  q = np.eye(V, dtype=np.float32)[draft]
  assert not np.isnan(np.asarray(logprobs_jit(logits, sp))).any()
  # with one-hot p and q every accept/reject is certain, so sampling must reproduce greedy
  got = verify_jit(jax.random.key(13), draft, q, logits, sp)
  want = greedy_jit(draft, logits)
  assert same(got, want)
  assert len(set(np.asarray(want[0]).tolist())) == G + 1  # every n_accepted 0..G occurs


def test_zero_q_at_drafted_token_is_safe():
  draft, q, logits = random_case()
  B, G = draft.shape
  q = q.copy()
  q[np.arange(B)[:, None], np.arange(G)[None], draft] = 0.0
  n_acc, next_tok = sampled_jit(jax.random.key(14), draft, q, logits, SamplingParams(1.0))
  assert (np.asarray(n_acc) == G).all()  # q(x) = 0 < p(x): the guard accepts, no NaN path
  assert ((np.asarray(next_tok) >= 0) & (np.asarray(next_tok) < logits.shape[-1])).all()


def test_empty_residual_falls_back_to_p():
  # q ≥ p everywhere (here q = 2p, as from a drafter that does not normalise): half the drafts
  # are rejected, yet max(p − q, 0) is all zero; the correction must still come from p.
  B, G, V = 4096, 3, 10
  sp = SamplingParams(temperature=1.0, top_k=3)
  rng = np.random.default_rng(5)
  logits = np.broadcast_to(rng.standard_normal((1, G + 1, V)), (B, G + 1, V)).astype(np.float32)
  p = np.exp(np.asarray(logprobs_jit(logits, sp)))  # [B, G+1, V]
  draft = sample_np(rng, p[:, :G])
  n_acc, next_tok = sampled_jit(jax.random.key(15), draft, 2 * p[:, :G], logits, sp)
  n_acc, next_tok = np.asarray(n_acc), np.asarray(next_tok)
  assert 0.4 < (n_acc == 0).mean() < 0.6
  assert (p[np.arange(B), n_acc, next_tok] > 0).all()


def test_ids_outside_the_vocabulary_are_never_accepted():
  """A draft of -3 (a drafter's bug: take_along_axis wraps it to token V - 3) or V is rejected,
  even where the target and the draft put all their mass on token V - 3."""
  B, G, V = 64, 2, 10
  logits = np.full((B, G + 1, V), -1e4, np.float32)
  logits[..., V - 3] = 1e4  # p = one-hot at V - 3
  q = np.zeros((B, G, V), np.float32)
  q[..., V - 3] = 1.0
  for bad in (-3, V):
    draft = np.full((B, G), bad, np.int32)
    n_acc, next_tok = sampled_jit(jax.random.key(0), draft, q, logits, SamplingParams(1.0))
    assert (np.asarray(n_acc) == 0).all(), bad
    assert (np.asarray(next_tok) == V - 3).all()
