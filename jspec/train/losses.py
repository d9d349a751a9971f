"""Token-level distillation losses for training a drafter against a target: forward KL, total
variation distance (TVD) and TVD++ (Goel et al., "Direct Alignment of Draft Model for Speculative
Decoding with Chat-Fine-Tuned LLMs", arXiv 2403.00858, Sec. 3, the draft fine-tuning step).

Notation, per token position t: q = softmax(student_logits[t]) over the student's V entries (the
draft), p = the target's distribution given as its top-K (ids, log-probabilities).

Teacher top-K convention
  * teacher_ids[b, t, k] in [0, V) is a real entry; any id outside [0, V) (use -1) is padding and its
    log-probability is ignored (it may be anything, -inf included).
  * Real ids of one position must be distinct (true of a top-k); duplicates are not detected.
  * teacher_logprobs are log-probabilities under the *full* target distribution, so the real
    entries' mass S = sum_k p_k <= 1. The remaining 1 - S is treated as unknown mass attributed to no
    token: p(x) = 0 for every x outside the top-K support (the usual top-k approximation). With
    K = V and all entries real, every loss below is exact.
  * The teacher is constant: no gradient flows into teacher_logprobs.

Losses (each returns the mean over tokens weighted by mask [B, T]; all-zero mask gives 0)
  forward_kl:  KL(p || q) = sum_x p(x) (log p(x) - log q(x)), summed over the top-K support.
               Gradient w.r.t. the student logits z: grad_z = S q - p.
  tvd:         TVD(p, q) = 1/2 sum_x |p(x) - q(x)| over all V entries (p = 0 off the support).
               Its (sub)gradient uses d|u|/du = sign(u) with sign(0) = 0:
               grad_z = q * (g - E_q[g]),  g(x) = 1/2 sign(q(x) - p(x)).
  tvd++:       The paper writes the TVD gradient as a policy gradient (REINFORCE with the draft as
               the policy and the token as the action). Because sum_x grad q(x) = 0,
                 grad TVD = 1/2 sum_x sign(q(x) - p(x)) grad q(x)
                          = -E_{x~q}[ r(x) grad log q(x) ],   r(x) = 1{p(x) > q(x)}
               (away from ties p(x) = q(x)), i.e. TVD is minimised by maximising the expected
               reward r, which is 1 exactly where the draft under-covers the target. TVD++ applies
               the standard policy-gradient variance reduction to this binary reward: subtract the
               mean reward as a baseline and divide by its standard deviation,
                 grad TVD++ = -E_{x~q}[ (r(x) - mu) / sigma * grad log q(x) ].
               (Using 1{q(x) > p(x)} with the opposite sign instead gives the same estimator: the
               two rewards differ by a constant, which the normalisation removes.)

Implementation notes for TVD++
  * We hold the whole distribution q, so the expectation over x ~ q is computed exactly (a sum over
    V with weights q) instead of by sampling; the weights q(x) A(x), A = (r - mu) / sigma, are
    stop_gradient'ed, so the surrogate  -sum_x sg(q(x) A(x)) log q(x)  has exactly the estimator's
    gradient. Its baseline term (mu / sigma) sum_x sg(q) grad log q = (mu / sigma) grad sum_x q is
    identically 0 and is not computed, which also keeps the cost O(K) beyond the log-softmax.
    tests/test_losses.py checks the gradient against a sampled (Monte-Carlo) estimate that does
    subtract the baseline.
  * r uses the strict indicator 1{p > q}. At an exact tie p(x) = q(x) this differs from TVD's
    subgradient (which takes sign(0) = 0); away from ties, baseline="none" reproduces TVD's gradient
    exactly.
  * mu and sigma are statistics of the reward r(x), x ~ q, and receive no gradient. `baseline`
    picks where they are pooled:
      "batch" (default): over every unmasked token in the batch (one draw x ~ q_t per token), the
               usual reward normalisation of policy-gradient practice: mu = weighted mean of
               m_t = E_{q_t}[r], and, as r is 0/1, sigma^2 = mu (1 - mu).
      "token": per position, mu_t = m_t and sigma_t^2 = m_t (1 - m_t) (a per-state baseline).
      "none":  mu = 0, sigma = 1: no variance reduction; the gradient is then exactly TVD's.
    With the exact expectation a constant baseline contributes nothing (E_q[grad log q] = 0), so
    "batch" gives TVD's gradient scaled by 1 / sigma and "token" rescales each position by
    1 / sigma_t; the baseline matters for sampled estimates, which is what it is there for.
  * The VALUE returned by tvd_plus_plus is the true TVD (for logging); only its gradient is the
    TVD++ estimator (value = tvd + surrogate - stop_gradient(surrogate)).
  * Source caveat: the equations above were written from the paper's definitions (TVD, its
    policy-gradient form, and TVD++ as reward normalisation by mean and standard deviation). The
    paper's equation numbers, and whether its mu/sigma are pooled over the batch or per position,
    could not be re-read in the session that wrote this module; `baseline` covers both readings.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array

BASELINES = ("batch", "token", "none")


def validate_inputs(student_logits, teacher_ids, teacher_logprobs, mask) -> None:
  """Raise ValueError unless the four inputs have consistent [B, T, V] / [B, T, K] / [B, T] shapes.

  Reads static shapes and dtypes only, so it works on tracers under jit.
  """
  if student_logits.ndim != 3:
    raise ValueError(f"student_logits must be [B, T, V], got shape {tuple(student_logits.shape)}")
  if not jnp.issubdtype(student_logits.dtype, jnp.floating):
    raise ValueError(f"student_logits must be floating point, got {student_logits.dtype}")
  B, T, V = student_logits.shape
  if V < 1:
    raise ValueError("student_logits has an empty vocabulary axis")
  if teacher_ids.ndim != 3 or tuple(teacher_ids.shape[:2]) != (B, T):
    raise ValueError(f"teacher_ids must be [B, T, K] = [{B}, {T}, K], got shape "
                     f"{tuple(teacher_ids.shape)}")
  if not jnp.issubdtype(teacher_ids.dtype, jnp.integer):
    raise ValueError(f"teacher_ids must be integer, got {teacher_ids.dtype}")
  if teacher_ids.shape[2] < 1:
    raise ValueError("teacher_ids has K = 0 entries per token")
  if tuple(teacher_logprobs.shape) != tuple(teacher_ids.shape):
    raise ValueError(f"teacher_logprobs shape {tuple(teacher_logprobs.shape)} must equal "
                     f"teacher_ids shape {tuple(teacher_ids.shape)}")
  if not jnp.issubdtype(teacher_logprobs.dtype, jnp.floating):
    raise ValueError(f"teacher_logprobs must be floating point, got {teacher_logprobs.dtype}")
  if tuple(mask.shape) != (B, T):
    raise ValueError(f"mask must be [B, T] = [{B}, {T}], got shape {tuple(mask.shape)}")


def _teacher_topk(student_logits: Array, teacher_ids: Array, teacher_logprobs: Array):
  """Student log-probs and the teacher's top-K, aligned entry by entry.

  Returns log_q_k [B, T, K] (student log-prob of each teacher id), p_k [B, T, K] (teacher prob, 0 on
  padding) and valid [B, T, K] bool.
  """
  V = student_logits.shape[-1]
  log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)  # [B, T, V]
  valid = (teacher_ids >= 0) & (teacher_ids < V)  # [B, T, K]
  safe_ids = jnp.where(valid, teacher_ids, 0)
  log_q_k = jnp.take_along_axis(log_q, safe_ids, axis=-1)  # [B, T, K]
  lp = jax.lax.stop_gradient(teacher_logprobs.astype(jnp.float32))
  p_k = jnp.where(valid, jnp.exp(jnp.where(valid, lp, -jnp.inf)), 0.0)  # [B, T, K]
  return log_q_k, p_k, valid


def _weights(mask: Array) -> Array:
  return jnp.asarray(mask).astype(jnp.float32)  # [B, T]


def _masked_mean(per_token: Array, w: Array) -> Array:
  """sum_t w_t l_t / sum_t w_t; 0 when every weight is 0. Masked tokens cannot leak NaN/inf."""
  total = jnp.sum(jnp.where(w > 0, w * per_token, 0.0))
  denom = jnp.sum(w)
  return total / jnp.where(denom > 0, denom, 1.0)


def _kl_per_token(log_q_k: Array, p_k: Array, teacher_logprobs: Array) -> Array:
  """sum_k p_k (log p_k - log q_k) [B, T]; entries with p_k = 0 contribute 0."""
  pos = p_k > 0
  lp = jnp.where(pos, jax.lax.stop_gradient(teacher_logprobs.astype(jnp.float32)), 0.0)
  return jnp.sum(jnp.where(pos, p_k * (lp - log_q_k), 0.0), axis=-1)


def _tvd_per_token(log_q_k: Array, p_k: Array, valid: Array) -> Array:
  """1/2 sum_x |p(x) - q(x)| [B, T] over all V, p = 0 off the support.

  = 1/2 (sum_{support} |p_k - q_k| + (1 - sum_{support} q_k)). |u| is written sg(sign(u)) * u so
  that its gradient at a tie u = 0 is 0 (jnp.abs would give 1).
  """
  q_k = jnp.where(valid, jnp.exp(log_q_k), 0.0)  # [B, T, K]
  diff = q_k - p_k
  abs_diff = jax.lax.stop_gradient(jnp.sign(diff)) * diff
  off_support = 1.0 - jnp.sum(q_k, axis=-1)  # q mass outside the top-K support
  return 0.5 * (jnp.sum(jnp.where(valid, abs_diff, 0.0), axis=-1) + off_support)


def forward_kl(student_logits: Array, teacher_ids: Array, teacher_logprobs: Array,
               mask: Array) -> Array:
  """Masked mean over tokens of KL(p || q) on the teacher's top-K support (exact for K = V)."""
  validate_inputs(student_logits, teacher_ids, teacher_logprobs, mask)
  log_q_k, p_k, _ = _teacher_topk(student_logits, teacher_ids, teacher_logprobs)
  return _masked_mean(_kl_per_token(log_q_k, p_k, teacher_logprobs), _weights(mask))


def tvd(student_logits: Array, teacher_ids: Array, teacher_logprobs: Array, mask: Array) -> Array:
  """Masked mean over tokens of 1/2 sum_x |p(x) - q(x)| over all V (exact for K = V)."""
  validate_inputs(student_logits, teacher_ids, teacher_logprobs, mask)
  log_q_k, p_k, valid = _teacher_topk(student_logits, teacher_ids, teacher_logprobs)
  return _masked_mean(_tvd_per_token(log_q_k, p_k, valid), _weights(mask))


def tvd_reward_stats(q_k: Array, p_k: Array, valid: Array, w: Array,
                     baseline: str) -> tuple[Array, Array, Array]:
  """Reward r_k = 1{p_k > q_k} [B, T, K] and its baseline mu and scale sigma (broadcast to [B, T]).

  m_t = E_{x~q_t}[r(x)] = sum_k q_k r_k, since r = 0 off the support. No gradient flows out.
  """
  if baseline not in BASELINES:
    raise ValueError(f"unknown TVD++ baseline {baseline!r}; choose one of {list(BASELINES)}")
  q_k, p_k = jax.lax.stop_gradient(q_k), jax.lax.stop_gradient(p_k)
  r_k = (valid & (p_k > q_k)).astype(jnp.float32)  # [B, T, K]
  m = jnp.sum(q_k * r_k, axis=-1)  # [B, T]
  if baseline == "none":
    return r_k, jnp.zeros_like(m), jnp.ones_like(m)
  if baseline == "batch":
    mu = jnp.broadcast_to(_masked_mean(m, w), m.shape)
  else:
    mu = m
  var = jnp.clip(mu * (1.0 - mu), 0.0, None)  # r is 0/1, so Var[r] = mu (1 - mu)
  sigma = jnp.sqrt(var)
  # sigma ~ 0 means r is (up to rounding) constant under q, so r - mu ~ 0 wherever q > 0: use 1
  # rather than blow a rounding residue up.
  return r_k, mu, jnp.where(sigma > 1e-6, sigma, 1.0)


def tvd_plus_plus(student_logits: Array, teacher_ids: Array, teacher_logprobs: Array, mask: Array,
                  *, baseline: str = "batch") -> Array:
  """TVD++: value = the true masked-mean TVD (for logging); gradient = the paper's normalised
  policy-gradient estimator -E_{x~q}[(r(x) - mu) / sigma grad log q(x)], r = 1{p > q}, with the
  expectation over x ~ q taken exactly. `baseline` in {"batch", "token", "none"} (module doc).
  """
  validate_inputs(student_logits, teacher_ids, teacher_logprobs, mask)
  log_q_k, p_k, valid = _teacher_topk(student_logits, teacher_ids, teacher_logprobs)
  w = _weights(mask)
  true_tvd = _tvd_per_token(log_q_k, p_k, valid)  # [B, T]
  q_k = jnp.where(valid, jnp.exp(log_q_k), 0.0)  # [B, T, K]
  r_k, _, sigma = tvd_reward_stats(q_k, p_k, valid, w, baseline)
  # Surrogate -sum_x sg(q(x) A(x)) log q(x) with A = (r - mu) / sigma. Its baseline part,
  # (mu / sigma) sum_x sg(q(x)) grad log q(x) = (mu / sigma) grad sum_x q(x), is exactly 0 when the
  # expectation over x ~ q is exact, so it is left out; r = 0 off the support, so what remains lives
  # on the K teacher ids. (The Monte-Carlo test in tests/test_losses.py keeps the baseline.)
  surrogate = -jnp.sum(jax.lax.stop_gradient(q_k * r_k) * log_q_k, axis=-1) / sigma  # [B, T]
  per_token = jax.lax.stop_gradient(true_tvd) + surrogate - jax.lax.stop_gradient(surrogate)
  return _masked_mean(per_token, w)


LOSSES: dict[str, Callable[..., Array]] = {"kl": forward_kl, "tvd": tvd, "tvd++": tvd_plus_plus}


def loss_fn(name: str) -> Callable[..., Array]:
  """The loss called `name`, one of LOSSES; ValueError naming the valid choices otherwise."""
  try:
    return LOSSES[name]
  except (KeyError, TypeError):
    raise ValueError(f"unknown distillation loss {name!r}; choose one of {sorted(LOSSES)}") from None


def acceptance_sums(student_logits: Array, teacher_ids: Array, teacher_logprobs: Array,
                    mask: Array) -> tuple[Array, Array, Array]:
  """Held-out acceptance estimates, summed over the scored positions: (sampled, sum_x min(p, q)
  over the teacher's top-k; greedy, the student's argmax is the teacher's; positions scored).
  student_logits [..., V]; teacher_ids, teacher_logprobs [..., K] (ids -1: padding); mask [...]."""
  p = jnp.where(teacher_ids >= 0, jnp.exp(teacher_logprobs), 0.0)
  q_at = jnp.take_along_axis(jax.nn.softmax(student_logits, axis=-1),
                             jnp.maximum(teacher_ids, 0), axis=-1)
  overlap = jnp.sum(jnp.minimum(p, q_at), axis=-1)
  greedy = (jnp.argmax(student_logits, axis=-1) == teacher_ids[..., 0]).astype(jnp.float32)
  return jnp.sum(overlap * mask), jnp.sum(greedy * mask), jnp.sum(mask)
