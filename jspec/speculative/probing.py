"""Positions a drafter has the verification forward run beside the block: mask positions for
probing drafters (jspec.drafting.probe), a lookahead window (jspec.drafting.lookahead).

A drafter with `probe_masks = k > 0` has the engine append k mask positions after EVERY token of
the verification block (root and draft nodes; ESP, 2603.17942), so whichever token turns out to be
the last accepted one, the k masks that followed it were scored in the same forward:

  block:  b_0 .. b_{T-1}                         (the block's own [B, T, T] visibility)
  masks:  (b_0, 1) .. (b_0, k), (b_1, 1) .. (b_{T-1}, k)     owner-major, after the block
  mask (b, j): position pos(b) + j; sees what b sees, b itself and masks (b, 1) .. (b, j).

No block token sees a mask, so the block's logits are exactly what they are without masks, and
the masks' KV entries sit in the slots after the block's, which the engines never commit (a round
commits accepted block tokens only and sets the cache length to them).

ConFu's contemplate tokens (jspec.drafting.confu) are probe masks (k = 1) with an input embedding
of their own each (`Drafter.probe_inputs`) and P soft prompt tokens after them: soft token m at
the root's position + 1 + m sees what the root sees, the root and soft tokens <= m; every mask
also sees every soft token; no block token sees either.

A lookahead window (`window_layout`) is X more tokens after the block, all following the root:
they see what the root sees and the root, and among themselves what the drafter's pattern says;
like masks, no block token sees them and their KV entries are never committed.

The prefill probes too (`prefill_layout`): k masks after each row's last prompt token, so the
first round drafts from the prompt like every later one does from its last accepted token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def probe_layout(block_mask: Array, positions: Array, k: int, soft: int = 0
                 ) -> tuple[Array, Array]:
  """(mask [B, T(1+k) + P, T(1+k) + P], positions [B, T(1+k) + P]) of the block [B, T]
  (visibility `block_mask` [B, T, T], RoPE `positions` [B, T]) followed by k masks per block token,
  then P = `soft` soft prompt tokens after the root that every mask sees."""
  B, T = positions.shape
  owner = jnp.repeat(jnp.arange(T), k)  # [Tk]: the block token each mask follows
  step = jnp.tile(jnp.arange(1, k + 1), T)  # [Tk]: j of mask (b, j)
  own = (owner[:, None] == owner[None, :]) & (step[None, :] <= step[:, None])  # [Tk, Tk]
  P = soft
  top = jnp.concatenate([block_mask, jnp.zeros((B, T, T * k + P), bool)], axis=2)
  seen_block = block_mask[:, owner].at[:, jnp.arange(T * k), owner].set(True)  # [B, Tk, T]
  middle = jnp.concatenate([seen_block, jnp.broadcast_to(own, (B, T * k, T * k)),
                            jnp.ones((B, T * k, P), bool)], axis=2)
  bottom = jnp.concatenate([jnp.broadcast_to(block_mask[:, :1], (B, P, T)),
                            jnp.zeros((B, P, T * k), bool),
                            jnp.broadcast_to(jnp.tril(jnp.ones((P, P), bool)), (B, P, P))], axis=2)
  mask = jnp.concatenate([top, middle, bottom], axis=1)
  return mask, jnp.concatenate([positions, positions[:, owner] + step,
                                positions[:, :1] + 1 + jnp.arange(P, dtype=positions.dtype)],
                               axis=1)


def window_layout(block_mask: Array, positions: Array, visible, offsets
                  ) -> tuple[Array, Array]:
  """(mask [B, T + X, T + X], positions [B, T + X]) of the block [B, T] (visibility
  `block_mask` [B, T, T], RoPE `positions` [B, T]) followed by X window tokens: window token i
  at the root's position + offsets[i] ([X] ints), seeing the root's view of the block and the
  window tokens visible[i] ([X, X] bool) marks."""
  B, T = positions.shape
  visible, offsets = jnp.asarray(visible, bool), jnp.asarray(offsets, jnp.int32)
  X = offsets.shape[0]
  top = jnp.concatenate([block_mask, jnp.zeros((B, T, X), bool)], axis=2)
  bottom = jnp.concatenate([jnp.broadcast_to(block_mask[:, :1], (B, X, T)),
                            jnp.broadcast_to(visible, (B, X, X))], axis=2)
  return (jnp.concatenate([top, bottom], axis=1),
          jnp.concatenate([positions, positions[:, :1] + offsets[None]], axis=1))


def verification_inputs(drafter, state, block: Array, block_mask: Array | None,
                        positions: Array):
  """(tokens, mask, positions, appended, logits_indices) of the verification forward over
  `block` [B, T] (visibility `block_mask` [B, T, T], None: causal; RoPE `positions` [B, T]) with
  what `drafter` (a jspec.drafting.base.Drafter, its loop state `state`) has ride along: k probe
  masks after every block token (`appended` embeddings), or a lookahead window after the root
  (more tokens). Logits are then read at the block only. Without either, the block as it is."""
  B, T = block.shape
  k, X = drafter.probe_masks, drafter.window_size
  if not (k or X):
    return block, block_mask, positions, None, None
  block_mask = causal(B, T) if block_mask is None else block_mask
  heads = jnp.broadcast_to(jnp.arange(T), (B, T))
  if k:
    mask, positions = probe_layout(block_mask, positions, k, drafter.soft_tokens)
    return block, mask, positions, drafter.probe_inputs(state, block), heads
  mask, positions = window_layout(block_mask, positions, *drafter.window_pattern)
  return (jnp.concatenate([block, drafter.window_tokens(state)], axis=1), mask, positions, None,
          heads)


def verification_width(drafter, T: int) -> int:
  """Positions the verification forward of a T-token block runs (static): the block, then what
  `drafter` has ride along (`verification_inputs`): k masks after each token and soft tokens, or
  a lookahead window. Its KV entries all go past the committed ones."""
  return T * (1 + drafter.probe_masks) + drafter.soft_tokens + drafter.window_size


def causal(B: int, T: int) -> Array:
  """[B, T, T]: a chain block's visibility."""
  return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))


def probe_hidden(hidden: Array, T: int, k: int, end: Array) -> Array:
  """[B, k, E]: the hidden states of the k masks after block token `end` [B] (hidden [B,
  T(1+k), E] from a forward over probe_layout's block)."""
  B, _, E = hidden.shape
  masks = hidden[:, T:T + T * k].reshape(B, T, k, E)
  return jnp.take_along_axis(masks, end[:, None, None, None], axis=1)[:, 0]


def prefill_layout(prompt_lengths: Array, P: int, k: int, soft: int = 0
                   ) -> tuple[Array, Array]:
  """(mask [B, P + k + S, P + k + S], positions [B, P + k + S]) of padded prompts [B, P]
  followed by k masks after each row's last real token, then S = `soft` soft prompt tokens: mask
  j at position prompt_length - 1 + j, seeing the row's prompt, masks 1 .. j and every soft token;
  soft token m at position prompt_length + m, seeing the prompt and soft tokens <= m (the padding
  past a row's length is never seen)."""
  B = prompt_lengths.shape[0]
  S = soft
  top = jnp.concatenate([causal(B, P), jnp.zeros((B, P, k + S), bool)], axis=2)
  prompt_seen = jnp.arange(P)[None, None, :] < prompt_lengths[:, None, None]  # [B, 1, P]
  own = jnp.tril(jnp.ones((k, k), bool))
  middle = jnp.concatenate([jnp.broadcast_to(prompt_seen, (B, k, P)),
                            jnp.broadcast_to(own, (B, k, k)), jnp.ones((B, k, S), bool)], axis=2)
  bottom = jnp.concatenate([jnp.broadcast_to(prompt_seen, (B, S, P)), jnp.zeros((B, S, k), bool),
                            jnp.broadcast_to(jnp.tril(jnp.ones((S, S), bool)), (B, S, S))], axis=2)
  positions = jnp.concatenate(
      [jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)),
       (prompt_lengths - 1)[:, None] + jnp.arange(1, k + 1, dtype=jnp.int32),
       prompt_lengths[:, None] + jnp.arange(S, dtype=jnp.int32)], axis=1)
  return jnp.concatenate([top, middle, bottom], axis=1), positions
