"""A debug check of what a chain drafter's `propose` claims: q [B, G, V] must be the distributions
its drafts were drawn from. The verifier cannot tell otherwise: log-probabilities, logits or zeros
in q run without an error and sample from another law than the target's (min(1, p/q) takes any
number). `base.check_proposal` catches wrong shapes and dtypes at trace time; the values
are only known in the running program, so this check is a host callback, off by default.

Turn it on for a whole process with JSPEC_CHECK_DRAFTS=1 (read when jspec is imported), or from
Python with `enable()`, which drops JAX's compiled programs (the check is part of the traced
program, so programs compiled without it would run on without it). A failing round raises
`DraftLawError` naming the drafter, the row and draft position, and what was wrong: the checked
wrappers (`speculative_generate`, the Model API) raise it as such; a pure engine under a user's
own jit surfaces it inside JAX's runtime error.

It checks, on every row still generating and every draft it verifies: q >= 0, each distribution
sums to 1 (within 1e-3: float32 sums of a processed vocabulary), and q(draft) > 0 (a draft
outside its own support cannot have been drawn from it). It cannot check that the drafts were
drawn from q (a statistical property: tests/test_speculative.py's harness does that).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

ENABLED = os.environ.get("JSPEC_CHECK_DRAFTS") == "1"
SUM_TOLERANCE = 1e-3


class DraftLawError(ValueError):
  """A drafter's q is not the distribution of its drafts (JSPEC_CHECK_DRAFTS=1)."""


# The message of the last failure, for the checked wrappers to raise outside JAX's runtime error.
last_failure: list[str] = []


def enable(on: bool = True) -> None:
  """Turn the check on (or off) for the programs traced from now on; JAX's compiled programs are
  dropped so that none compiled the other way runs again."""
  global ENABLED
  if on != ENABLED:
    ENABLED = on
    jax.clear_caches()


def _raise_first(name: str, negative, off, picked_zero, sums) -> None:
  """Host side: the first (row, position) that fails, as one readable error."""
  negative, off, picked_zero, sums = map(np.asarray, (negative, off, picked_zero, sums))
  for what, bad in (("has negative entries", negative),
                    ("does not sum to 1", off),
                    ("gives its own draft probability 0", picked_zero)):
    if bad.any():
      row, pos = (int(i) for i in np.argwhere(bad)[0])
      last_failure[:] = [
          f"{name} returned a q that is not the distribution its drafts were drawn from: row "
          f"{row}, draft {pos} {what} (its sum is {float(sums[row, pos]):.6g}). The verifier "
          f"would sample from another law than the target's. Fix: return q as probabilities "
          f"[batch, gamma, vocabulary] (softmax of the processed logits, not log-probabilities "
          f"or logits) and draw each draft from its row of q."]
      raise DraftLawError(last_failure[0])


def check_law(name: str, tokens: Array, q: Array, verified: Array) -> None:
  """Traced: tokens [B, G] int, q [B, G, V], verified [B, G] bool (the drafts verification reads:
  active rows, before a chain's early end). Raises DraftLawError on the host when a verified
  draft's q fails (see the module docstring)."""
  q = q.astype(jnp.float32)
  sums = jnp.sum(q, axis=-1)  # [B, G]
  negative = jnp.any(q < 0, axis=-1) & verified
  off = (jnp.abs(sums - 1.0) > SUM_TOLERANCE) & verified
  at_draft = jnp.take_along_axis(q, jnp.clip(tokens, 0, q.shape[-1] - 1)[..., None], axis=-1)
  picked_zero = (at_draft[..., 0] <= 0) & verified
  jax.debug.callback(lambda *a: _raise_first(name, *a), negative, off, picked_zero, sums)


def run_checked(run):
  """Host side, in the checked wrappers: run() (an engine call) to its end, a failed check raised
  as DraftLawError rather than inside JAX's runtime error. Without the check: run() as it is."""
  if not ENABLED:
    return run()
  last_failure.clear()
  try:
    return jax.block_until_ready(run())
  except Exception:  # JAX wraps what a host callback raises in its own runtime error
    if last_failure:
      raise DraftLawError(last_failure[0]) from None
    raise
