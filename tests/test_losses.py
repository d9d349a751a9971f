"""Distillation losses: hand-computed values and gradients, TVD++ against its policy-gradient
definition (exact numpy reference and Monte-Carlo sampling from q), masking, the teacher padding
convention, and clear errors for bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.train.losses import LOSSES, forward_kl, loss_fn, tvd, tvd_plus_plus, validate_inputs


def one_token(q, ids, p):
  """Inputs for B = T = 1: logits log(q) (so softmax gives q exactly), teacher (ids, log p)."""
  logits = jnp.log(jnp.asarray(q, jnp.float32))[None, None]  # [1, 1, V]
  teacher_ids = jnp.asarray(ids, jnp.int32)[None, None]  # [1, 1, K]
  with np.errstate(divide="ignore"):
    teacher_lp = jnp.asarray(np.log(np.asarray(p, np.float64)), jnp.float32)[None, None]
  return logits, teacher_ids, teacher_lp, jnp.ones((1, 1), jnp.float32)


def grad_logits(fn, logits, ids, lp, mask, **kw):
  return np.asarray(jax.grad(lambda z: fn(z, ids, lp, mask, **kw))(logits))


# Case A, V = 3, full support: q = [.2, .4, .4], p = [.5, .3, .2]; ids listed out of order.
QA, IDS_A, PA = [0.2, 0.4, 0.4], [2, 0, 1], [0.2, 0.5, 0.3]
# Case B, V = 4, top-2 of p = [.05, .5, .3, .15] plus one padding entry (id -1, garbage logprob 1.0,
# which as a real entry would be probability e > 1): q = [.4, .3, .2, .1]; mass .2 is unattributed.
QB, IDS_B, PB = [0.4, 0.3, 0.2, 0.1], [1, -1, 2], [0.5, math.e, 0.3]


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------

def test_values_full_support():
  args = one_token(QA, IDS_A, PA)
  kl = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.4)  # 0.233212
  assert float(forward_kl(*args)) == pytest.approx(kl, abs=1e-6)
  assert float(forward_kl(*args)) == pytest.approx(0.233212, abs=1e-6)
  # 1/2 (|.5-.2| + |.3-.4| + |.2-.4|) = 1/2 (.3 + .1 + .2) = .3
  assert float(tvd(*args)) == pytest.approx(0.3, abs=1e-6)
  for b in ("batch", "token", "none"):  # TVD++'s value is the true TVD
    assert float(tvd_plus_plus(*args, baseline=b)) == pytest.approx(0.3, abs=1e-6)


def test_values_truncated_top_k():
  args = one_token(QB, IDS_B, PB)
  # KL over the support {1, 2} only: .5 ln(.5/.3) + .3 ln(.3/.2) = 0.377052
  kl = 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.2)
  assert float(forward_kl(*args)) == pytest.approx(kl, abs=1e-6)
  assert float(forward_kl(*args)) == pytest.approx(0.377052, abs=1e-6)
  # p = [0, .5, .3, 0] over V: 1/2 (.4 + .2 + .1 + .1) = .4  (the exact, untruncated TVD would be
  # 1/2 (.35 + .2 + .1 + .05) = .35: the unattributed mass is not placed on tokens 0 and 3).
  assert float(tvd(*args)) == pytest.approx(0.4, abs=1e-6)
  assert float(tvd_plus_plus(*args)) == pytest.approx(0.4, abs=1e-6)
  full = one_token(QB, [0, 1, 2, 3], [0.05, 0.5, 0.3, 0.15])
  assert float(tvd(*full)) == pytest.approx(0.35, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# Gradients w.r.t. the student logits z, with dq/dz = diag(q) - q q^T
# ---------------------------------------------------------------------------------------------

def test_kl_gradients():
  # d/dz sum_k p_k (log p_k - log q_k) = -sum_k p_k (e_k - q) = S q - p,  S = sum_k p_k.
  # A: S = 1: q - p = [.2-.5, .4-.3, .4-.2] = [-.3, .1, .2]
  g = grad_logits(forward_kl, *one_token(QA, IDS_A, PA))[0, 0]
  np.testing.assert_allclose(g, [-0.3, 0.1, 0.2], atol=1e-6)
  # B: S = .8, p = [0, .5, .3, 0]: .8 [.4, .3, .2, .1] - p = [.32, -.26, -.14, .08]
  g = grad_logits(forward_kl, *one_token(QB, IDS_B, PB))[0, 0]
  np.testing.assert_allclose(g, [0.32, -0.26, -0.14, 0.08], atol=1e-6)


def test_tvd_gradients():
  # d/dz 1/2 sum_x |p - q| = q * (g - E_q g),  g = 1/2 sign(q - p).
  # A: sign(q - p) = [-, +, +], g = [-.5, .5, .5], E_q g = -.1 + .2 + .2 = .3,
  #    q * (g - .3) = [.2 * -.8, .4 * .2, .4 * .2] = [-.16, .08, .08]
  g = grad_logits(tvd, *one_token(QA, IDS_A, PA))[0, 0]
  np.testing.assert_allclose(g, [-0.16, 0.08, 0.08], atol=1e-6)
  # B: p = [0, .5, .3, 0], sign(q - p) = [+, -, -, +], g = [.5, -.5, -.5, .5], E_q g = 0,
  #    q * g = [.2, -.15, -.1, .05]
  g = grad_logits(tvd, *one_token(QB, IDS_B, PB))[0, 0]
  np.testing.assert_allclose(g, [0.2, -0.15, -0.1, 0.05], atol=1e-6)


def test_tvd_subgradient_at_a_tie_is_zero():
  # q = [.2, .4, .4], p = [.2, .5, .3]: p = q at x = 0, so sign = [0, -, +], g = [0, -.5, .5],
  # E_q g = 0 - .2 + .2 = 0, gradient q * g = [0, -.2, .2]. (jnp.abs would use sign(0) = 1.)
  args = one_token([0.2, 0.4, 0.4], [0, 1, 2], [0.2, 0.5, 0.3])
  np.testing.assert_allclose(grad_logits(tvd, *args)[0, 0], [0.0, -0.2, 0.2], atol=1e-6)


def test_tvd_plus_plus_gradient_by_hand():
  # B: r = 1{p > q} = [0, 1, 1, 0]; mu = E_q r = .3 + .2 = .5; sigma = sqrt(mu (1 - mu)) = .5;
  # A = (r - mu) / sigma = [-1, 1, 1, -1]; grad = -sum_x q(x) A(x) (e_x - q) = -q*A + q * E_q[A]
  # with E_q[A] = -.4 + .3 + .2 - .1 = 0, so grad = [.4, -.3, -.2, .1] (= TVD's gradient / sigma).
  args = one_token(QB, IDS_B, PB)
  for b in ("batch", "token"):  # one token: batch and per-token statistics coincide
    np.testing.assert_allclose(grad_logits(tvd_plus_plus, *args, baseline=b)[0, 0],
                               [0.4, -0.3, -0.2, 0.1], atol=1e-6)
  # No variance reduction (mu = 0, sigma = 1): grad = -q*r + q E_q[r] = [.2, -.15, -.1, .05], TVD's.
  np.testing.assert_allclose(grad_logits(tvd_plus_plus, *args, baseline="none")[0, 0],
                             [0.2, -0.15, -0.1, 0.05], atol=1e-6)


def test_tvd_plus_plus_reward_is_strict_at_a_tie():
  # q = [.2, .4, .4], p = [.2, .5, .3]: r = 1{p > q} = [0, 1, 0] (the tie x = 0 earns nothing),
  # m = .4. "none": grad = -q*r + q m = [0, -.4, 0] + [.08, .16, .16] = [.08, -.24, .16].
  # "batch": sigma = sqrt(.4 * .6) = sqrt(.24), E_q[A] = 0, grad = -q*A = [.08, -.24, .16] / sigma.
  args = one_token([0.2, 0.4, 0.4], [0, 1, 2], [0.2, 0.5, 0.3])
  np.testing.assert_allclose(grad_logits(tvd_plus_plus, *args, baseline="none")[0, 0],
                             [0.08, -0.24, 0.16], atol=1e-6)
  np.testing.assert_allclose(grad_logits(tvd_plus_plus, *args)[0, 0],
                             np.array([0.08, -0.24, 0.16]) / math.sqrt(0.24), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# TVD++ against an independent numpy implementation of the estimator, and against sampling
# ---------------------------------------------------------------------------------------------

B, T, V, K = 2, 3, 7, 4


def random_batch(seed):
  """Random logits, a teacher top-K (some padding, some ids past V), and a mask with one zero."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(B, T, V)).astype(np.float32) * 1.5
  ids = np.stack([rng.permutation(V)[:K] for _ in range(B * T)]).reshape(B, T, K).astype(np.int32)
  p_full = rng.dirichlet(np.ones(V) * 0.7, size=(B, T))  # [B, T, V]
  lp = np.log(np.take_along_axis(p_full, ids, -1)).astype(np.float32)
  ids[0, 1, 3] = -1  # padding
  ids[1, 2, 0] = V + 3  # out of range: padding too
  mask = np.ones((B, T), np.float32)
  mask[1, 0] = 0.0
  return logits, ids, lp, mask


def np_dense(logits, ids, lp):
  """q [B, T, V] and the teacher p [B, T, V] (zero off the valid top-K) in float64 numpy."""
  z = logits.astype(np.float64)
  q = np.exp(z - z.max(-1, keepdims=True))
  q /= q.sum(-1, keepdims=True)
  p = np.zeros_like(q)
  for b, t, k in np.ndindex(*ids.shape):
    if 0 <= ids[b, t, k] < q.shape[-1]:
      p[b, t, ids[b, t, k]] += np.exp(float(lp[b, t, k]))
  return q, p


def safe(sigma):
  """sigma = 0 means the reward is constant under q (so r - mu = 0): any scale will do; use 1."""
  return np.where(sigma > 1e-6, sigma, 1.0)


def np_stats(q, p, w, baseline):
  """Exact reward statistics: r = 1{p > q}; mu, sigma per token [B, T]."""
  r = (p > q).astype(np.float64)
  m = (q * r).sum(-1)  # [B, T], E_{q_t}[r]
  if baseline == "none":
    return r, np.zeros_like(m), np.ones_like(m)
  if baseline == "batch":
    mu = np.full_like(m, (w * m).sum() / w.sum())
    # Var over (t ~ w, x ~ q_t) of r: E[r^2] - mu^2 = mu - mu^2, since r^2 = r.
    return r, mu, safe(np.sqrt(mu - mu ** 2))
  return r, m, safe(np.sqrt(m - m ** 2))


def np_tvdpp_grad(logits, ids, lp, mask, baseline):
  """-E_t E_{x~q_t}[(r - mu)/sigma * d log q_t(x) / dz_t], d log q(x)/dz = e_x - q, with the
  expectation over x written out as a loop over the vocabulary."""
  q, p = np_dense(logits, ids, lp)
  w = mask.astype(np.float64)
  r, mu, sigma = np_stats(q, p, w, baseline)
  g = np.zeros_like(q)
  for b, t in np.ndindex(B, T):
    for x in range(V):
      adv = (r[b, t, x] - mu[b, t]) / sigma[b, t]
      g[b, t] -= w[b, t] * q[b, t, x] * adv * (np.eye(V)[x] - q[b, t])
  return g / w.sum()


@pytest.mark.parametrize("baseline", ["batch", "token", "none"])
def test_tvd_plus_plus_matches_numpy_estimator(baseline):
  logits, ids, lp, mask = random_batch(0)
  g = grad_logits(tvd_plus_plus, jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(lp),
                  jnp.asarray(mask), baseline=baseline)
  np.testing.assert_allclose(g, np_tvdpp_grad(logits, ids, lp, mask, baseline), atol=2e-6)


def mc_policy_gradient(logits, ids, lp, mask, baseline, n, seed):
  """Monte-Carlo REINFORCE: n draws x ~ q_t per token, the reward's mean/std estimated from those
  same draws (pooled over unmasked tokens for "batch", per token for "token"). Returns the estimate
  and its standard error, both [B, T, V]."""
  rng = np.random.default_rng(seed)
  q, p = np_dense(logits, ids, lp)
  w = mask.astype(np.float64)
  r = (p > q).astype(np.float64)
  counts = np.stack([rng.multinomial(n, q[b, t] / q[b, t].sum()) for b, t in np.ndindex(B, T)])
  counts = counts.reshape(B, T, V).astype(np.float64)  # draws of each x, per token
  mean_t = (counts * r).sum(-1) / n  # sample mean reward per token
  if baseline == "none":
    mu, sigma = np.zeros((B, T)), np.ones((B, T))
  elif baseline == "batch":
    mu = np.full((B, T), (w * mean_t).sum() / w.sum())
    sq = (w[..., None] * counts * (r - mu[..., None]) ** 2).sum() / (n * w.sum())
    sigma = safe(np.full((B, T), np.sqrt(sq)))
  else:
    mu = mean_t
    sigma = safe(np.sqrt((counts * (r - mu[..., None]) ** 2).sum(-1) / n))
  est, se = np.zeros_like(q), np.zeros_like(q)
  for b, t in np.ndindex(B, T):
    adv = (r[b, t] - mu[b, t]) / sigma[b, t]  # [V], per sampled x
    per_x = -adv[:, None] * (np.eye(V) - q[b, t][None, :])  # [V (sampled x), V (logit)]
    m1 = (counts[b, t][:, None] * per_x).sum(0) / n
    m2 = (counts[b, t][:, None] * per_x ** 2).sum(0) / n
    scale = w[b, t] / w.sum()
    est[b, t], se[b, t] = scale * m1, scale * np.sqrt(np.maximum(m2 - m1 ** 2, 0) / n)
  return est, se


@pytest.mark.parametrize("baseline", ["batch", "token", "none"])
def test_tvd_plus_plus_gradient_equals_sampled_policy_gradient(baseline):
  logits, ids, lp, mask = random_batch(1)
  exact = grad_logits(tvd_plus_plus, jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(lp),
                      jnp.asarray(mask), baseline=baseline)
  est, se = mc_policy_gradient(logits, ids, lp, mask, baseline, n=400_000, seed=2)
  assert np.abs(exact).max() > 0.02  # the comparison is not trivially between zeros
  np.testing.assert_array_less(np.abs(est - exact), 5 * se + 2e-4)


def test_tvd_gradient_is_the_unnormalised_policy_gradient():
  """The identity TVD++ starts from: grad TVD = -E_{x~q}[1{p > q} grad log q]. Checked against
  sampling, and exactly against TVD++ with the variance reduction switched off."""
  logits, ids, lp, mask = (jnp.asarray(a) for a in random_batch(3))
  g_tvd = grad_logits(tvd, logits, ids, lp, mask)
  np.testing.assert_allclose(grad_logits(tvd_plus_plus, logits, ids, lp, mask, baseline="none"),
                             g_tvd, atol=1e-6)
  est, se = mc_policy_gradient(*(np.asarray(a) for a in (logits, ids, lp, mask)), "none",
                               n=400_000, seed=4)
  np.testing.assert_array_less(np.abs(est - g_tvd), 5 * se + 2e-4)


def test_batch_baseline_only_rescales_the_exact_gradient():
  """In exact expectation the baseline mu contributes nothing (E_q[grad log q] = 0): TVD++ with
  batch statistics is TVD's gradient divided by the pooled sigma = sqrt(mu (1 - mu))."""
  logits, ids, lp, mask = random_batch(5)
  q, p = np_dense(logits, ids, lp)
  _, mu, sigma = np_stats(q, p, mask.astype(np.float64), "batch")
  assert 0.05 < mu[0, 0] < 0.95
  args = (jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(lp), jnp.asarray(mask))
  np.testing.assert_allclose(grad_logits(tvd_plus_plus, *args),
                             grad_logits(tvd, *args) / sigma[0, 0], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Full-support exactness, masking, padding
# ---------------------------------------------------------------------------------------------

def test_full_support_values_match_dense_reference():
  rng = np.random.default_rng(6)
  logits = rng.normal(size=(B, T, V)).astype(np.float32)
  p_full = rng.dirichlet(np.ones(V), size=(B, T))
  ids = np.stack([rng.permutation(V) for _ in range(B * T)]).reshape(B, T, V).astype(np.int32)
  lp = np.log(np.take_along_axis(p_full, ids, -1)).astype(np.float32)
  mask = np.array([[1, 1, 0], [1, 0.5, 1]], np.float32)  # a fractional weight too
  q, p = np_dense(logits, ids, lp)
  w = mask.astype(np.float64)
  kl = ((p * (np.log(p) - np.log(q))).sum(-1) * w).sum() / w.sum()
  tv = (0.5 * np.abs(p - q).sum(-1) * w).sum() / w.sum()
  args = tuple(jnp.asarray(a) for a in (logits, ids, lp, mask))
  assert float(forward_kl(*args)) == pytest.approx(kl, abs=1e-5)
  assert float(tvd(*args)) == pytest.approx(tv, abs=1e-5)
  assert float(tvd_plus_plus(*args)) == pytest.approx(tv, abs=1e-5)


CASES = [(forward_kl, {}), (tvd, {}), (tvd_plus_plus, {"baseline": "batch"}),
         (tvd_plus_plus, {"baseline": "token"}), (tvd_plus_plus, {"baseline": "none"})]


@pytest.mark.parametrize("fn,kw", CASES)
def test_masked_tokens_change_nothing(fn, kw):
  logits, ids, lp, mask = random_batch(7)
  mask[0, 2] = 0.0  # two masked tokens: [1, 0] (from random_batch) and [0, 2]
  other = logits.copy()
  other[1, 0] = np.array([40.0, -30.0, 0.0, 5.0, 25.0, -8.0, 3.0], np.float32)
  other[0, 2] *= -7.0
  teacher = (jnp.asarray(ids), jnp.asarray(lp), jnp.asarray(mask))
  value_and_grad = jax.value_and_grad(lambda z: fn(z, *teacher, **kw))
  v1, g1 = value_and_grad(jnp.asarray(logits))
  v2, g2 = value_and_grad(jnp.asarray(other))
  assert float(v1) == pytest.approx(float(v2), abs=1e-6)
  np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), atol=1e-6)
  assert np.all(np.asarray(g1)[mask == 0] == 0)
  # ... while an unmasked token's logits do matter.
  changed = logits.copy()
  changed[0, 0] *= -3.0
  assert float(fn(jnp.asarray(changed), *teacher, **kw)) != pytest.approx(float(v1), abs=1e-4)
  # The mask is a weight: scaling every weight (here to a sum below 1) changes neither output.
  v3, g3 = jax.value_and_grad(lambda z: fn(z, *teacher[:2], teacher[2] * 0.1, **kw))(
      jnp.asarray(logits))
  assert float(v3) == pytest.approx(float(v1), abs=1e-6)
  np.testing.assert_allclose(np.asarray(g3), np.asarray(g1), atol=1e-6)


@pytest.mark.parametrize("fn", [forward_kl, tvd, tvd_plus_plus])
def test_all_masked_gives_zero_without_nan(fn):
  logits, ids, lp, _ = (jnp.asarray(a) for a in random_batch(8))
  mask = jnp.zeros((B, T), bool)
  v, g = jax.value_and_grad(lambda z: fn(z, ids, lp, mask))(logits)
  assert float(v) == 0.0 and np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("fn", [forward_kl, tvd, tvd_plus_plus])
def test_padding_entries_are_ignored(fn):
  """Top-2 of case B given plainly, then with padding (id -1, id >= V) carrying garbage logprobs,
  and with a real id whose logprob is -inf (probability 0): same value, same gradient."""
  q = [0.4, 0.3, 0.2, 0.1]
  plain = one_token(q, [1, 2], [0.5, 0.3])
  padded = one_token(q, [-1, 2, 9, 1], [0.9, 0.3, 0.7, 0.5])
  padded = (padded[0], padded[1], padded[2].at[0, 0, 0].set(jnp.inf).at[0, 0, 2].set(3.0),
            padded[3])
  zero_p = one_token(q, [1, 0, 2], [0.5, 0.0, 0.3])  # log 0 = -inf on a real id
  ref_v, ref_g = float(fn(*plain)), grad_logits(fn, *plain)
  for args in (padded, zero_p):
    assert float(fn(*args)) == pytest.approx(ref_v, abs=1e-6)
    g = grad_logits(fn, *args)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, ref_g, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# jit / vmap, registry, errors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(LOSSES))
def test_jit_and_vmap_agree_with_eager(name):
  fn = loss_fn(name)
  logits, ids, lp, mask = (jnp.asarray(a) for a in random_batch(9))
  eager = fn(logits, ids, lp, mask)
  assert float(jax.jit(fn)(logits, ids, lp, mask)) == pytest.approx(float(eager), abs=1e-6)
  stacked = jax.vmap(fn)(*(jnp.stack([a, a]) for a in (logits, ids, lp, mask)))
  np.testing.assert_allclose(np.asarray(stacked), [float(eager)] * 2, atol=1e-6)


def test_loss_registry():
  assert loss_fn("kl") is forward_kl and loss_fn("tvd") is tvd and loss_fn("tvd++") is tvd_plus_plus
  with pytest.raises(ValueError, match=r"unknown distillation loss 'jsd'.*'kl', 'tvd', 'tvd\+\+'"):
    loss_fn("jsd")


def test_unknown_baseline_raises():
  with pytest.raises(ValueError, match="baseline 'mean'.*batch"):
    tvd_plus_plus(*one_token(QA, IDS_A, PA), baseline="mean")


def _good():
  return (jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 4), jnp.int32), jnp.zeros((2, 3, 4)),
          jnp.ones((2, 3)))


@pytest.mark.parametrize("i,bad,msg", [
    (0, jnp.zeros((2, 3)), "student_logits must be"),
    (0, jnp.zeros((2, 3, 5), jnp.int32), "floating point"),
    (1, jnp.zeros((2, 4, 4), jnp.int32), "teacher_ids must be"),
    (1, jnp.zeros((2, 3, 4)), "integer"),
    (1, jnp.zeros((2, 3, 0), jnp.int32), "K = 0"),
    (2, jnp.zeros((2, 3, 3)), "teacher_logprobs shape"),
    (3, jnp.ones((3, 2)), "mask must be"),
    (3, jnp.ones((2, 3, 1)), "mask must be"),
])
def test_bad_shapes_raise(i, bad, msg):
  args = list(_good())
  validate_inputs(*args)  # the good inputs pass
  args[i] = bad
  for fn in (forward_kl, tvd, tvd_plus_plus):
    with pytest.raises(ValueError, match=msg):
      fn(*args)
  with pytest.raises(ValueError, match=msg):  # raised at trace time under jit as well
    jax.jit(tvd_plus_plus)(*args)
