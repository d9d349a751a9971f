"""Training ConFu (jspec.models.confu: which of the paper's parts are here and how they are read):
EAGLE-3's training-time test (jspec.train.eagle3) with the contemplate signal, trained end to end
through the frozen target.

Per batch of rows [B, S]:
- Anchor token sampling: A anchor positions per row (distinct, among the positions whose pair is
  scored; drawn per batch from the batch's row indices, so a resumed run draws the same). Only
  anchors get contemplate tokens: the target runs the rows once (no gradient: its K/V are
  constants), then one contemplate token and a copy of the soft prompt per anchor, each seeing
  the row up to its anchor exactly as decoding's would see the context (contemplate at anchor + 1,
  soft token m at anchor + 1 + m), with gradients into the experts, the router and the soft
  prompt through the target's layers (only those up to the highest tap: the later ones cannot
  reach the taps).
- Future prediction replication: the anchor's contemplate feature c is added to the feature of
  the pair at the anchor and to the drafter's own feature in every later pass of the chain
  started there, as decoding adds one c to every draft of a round. Chains started elsewhere read
  no contemplate signal (training them keeps the drafter sound where c says little).
- The loss is EAGLE-3's: decay-weighted forward KL per pass over every chain.

Held-out evaluation puts an anchor at every position (every chain reads its c, as in decoding),
so its acceptance covers the same positions as EAGLE-3's.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.io.drafter import save_eagle
from jspec.models import eagle3
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.confu import (ConFuParams, ContemplateParams, contemplate_embeddings,
                                contemplate_feature, init_contemplate, soft_embeddings)
from jspec.models.llama import Params, forward_visible
from jspec.train import trainer
from jspec.train.eagle import FeatureRows, feature_data
from jspec.train.eagle3 import (Eagle3Loss, evaluate_by_step, ttt_logits, ttt_loss, ttt_sums)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ConFuLoss:
  ttt: Eagle3Loss = Eagle3Loss()
  anchors: int = 32  # contemplate tokens per row in a training batch

  def __post_init__(self):
    if self.anchors < 1:
      raise ValueError(f"ConFu trains with >= 1 anchor per row, got {self.anchors}")


@dataclasses.dataclass
class ConFuRows(FeatureRows):
  """Feature rows plus the frozen target (passed to every step) and the anchors a batch draws:
  `anchors` per row, 0 = every position."""

  target: Params = None
  anchors: int = 0

  def take(self, idx: np.ndarray) -> dict:
    batch = super().take(idx)
    batch["target"] = self.target
    batch["anchors"] = draw_anchors(batch["mask"], self.anchors, idx)
    return batch


def draw_anchors(mask: np.ndarray, count: int, idx: np.ndarray) -> np.ndarray:
  """[B, count] sorted pair indices j (0 .. S - 2) whose pair is scored (mask[j + 1] > 0), drawn
  without replacement from a generator seeded by the rows `idx`; rows with fewer such positions
  repeat their last one (a repeated anchor is the same anchor twice). count 0: every j."""
  B, S = mask.shape
  if count == 0:
    return np.broadcast_to(np.arange(S - 1, dtype=np.int32), (B, S - 1)).copy()
  rng = np.random.default_rng(np.asarray(idx, np.int64))
  out = np.zeros((B, count), np.int32)
  for b in range(B):
    valid = np.nonzero(mask[b, 1:] > 0)[0]
    if len(valid) == 0:
      continue
    pick = np.sort(rng.choice(valid, size=min(count, len(valid)), replace=False))
    out[b] = np.concatenate([pick, np.full(count - len(pick), pick[-1])])
  return out


def contemplate_layout(anchors: Array, S: int, P: int) -> tuple[Array, Array]:
  """(positions [B, A U], visible [B, A U, S + A U]) of U = 1 + P tokens per anchor j (a
  contemplate token at j + 1, then soft token m at j + 1 + m) written after S row slots: each sees
  the row's slots <= j; the contemplate sees its own group, soft token m its group's soft tokens
  <= m."""
  B, A = anchors.shape
  U = 1 + P
  u = jnp.arange(U)
  offset = jnp.concatenate([jnp.ones((1,), jnp.int32), 1 + jnp.arange(P, dtype=jnp.int32)])
  positions = (anchors[:, :, None] + offset[None, None]).reshape(B, A * U)
  row_seen = jnp.arange(S)[None, None, :] <= anchors[:, :, None]  # [B, A, S]
  # group[i, i'] [U, U]: the contemplate (i = 0) sees its whole group, soft token i soft 1 .. i.
  group = jnp.where(u[:, None] == 0, True, (u[None, :] >= 1) & (u[None, :] <= u[:, None]))
  same = jnp.arange(A)[:, None, None, None] == jnp.arange(A)[None, None, :, None]  # [A,1,A,1]
  extra = same & group[None, :, None, :]  # [A, U, A, U]
  visible = jnp.concatenate([
      jnp.broadcast_to(row_seen[:, :, None, :], (B, A, U, S)).reshape(B, A * U, S),
      jnp.broadcast_to(extra.reshape(1, A * U, A * U), (B, A * U, A * U))], axis=2)
  return positions, visible


def contemplate_taps(target: Params, tcfg: Config, cp: ContemplateParams, embed: Array,
                     tokens: Array, anchors: Array, taps: tuple[int, ...]) -> Array:
  """[B, A, len(taps) E]: the target's taps at the contemplate token of each anchor [B, A] of rows
  tokens [B, S], as the verification forward computes them for the contemplate after a token;
  differentiable in `cp`."""
  B, S = tokens.shape
  A, P = anchors.shape[1], cp.soft_tokens
  U = 1 + P
  layers = tuple(range(max(taps)))  # later layers cannot reach the taps
  cache = KVCache.init(tcfg, B, S + A * U, target.embed.dtype)
  positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  causal = jnp.arange(S + A * U)[None, None, :] <= jnp.arange(S)[None, :, None]  # [1, S, S + AU]
  _, cache = forward_visible(target, tcfg, tokens, positions, cache, positions,
                             jnp.broadcast_to(causal, (B, S, S + A * U)), layers=layers)
  cache = jax.lax.stop_gradient(cache)  # the frozen target's view of the rows
  followed = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A]
  emb = contemplate_embeddings(cp, tcfg, embed, followed)  # [B, A, E]
  soft = jnp.broadcast_to(soft_embeddings(cp, B)[:, None], (B, A) + cp.soft.shape)
  x = jnp.concatenate([emb[:, :, None], soft], axis=2).reshape(B, A * U, -1)
  extra_positions, visible = contemplate_layout(anchors, S, P)
  slots = jnp.broadcast_to(S + jnp.arange(A * U, dtype=jnp.int32), (B, A * U))
  out, _ = forward_visible(target, tcfg, tokens[:, :0], extra_positions, cache, slots, visible,
                           appended=x, layers=layers, taps=taps)  # [B, A U, n E]
  return out.reshape(B, A, U, -1)[:, :, 0]


def contemplate_add(params: ConFuParams, cfg: Config, tcfg: Config, batch: dict) -> Array:
  """[B, S - 1, E]: each anchor's contemplate feature at its pair index, zero elsewhere."""
  d, cp = params.drafter, params.contemplate
  tokens, anchors = batch["tokens"], batch["anchors"]
  B, S = tokens.shape
  ctaps = contemplate_taps(batch["target"], tcfg, cp, batch["embed"], tokens, anchors, d.taps)
  c = contemplate_feature(cp, d, cfg, ctaps)  # [B, A, E]
  rows = jnp.arange(B)[:, None]
  return jnp.zeros((B, S - 1, c.shape[-1]), c.dtype).at[rows, anchors].set(c)


def confu_passes(params: ConFuParams, cfg: Config, tcfg: Config, batch: dict,
                 steps: int) -> list[Array]:
  return ttt_logits(params.drafter, cfg, batch["embed"], batch["tokens"], batch["feats"], steps,
                    add=contemplate_add(params, cfg, tcfg, batch))


def confu_objective(cfg: Config, tcfg: Config, loss: ConFuLoss) -> Callable:
  def objective(params: ConFuParams, batch: dict, key: Array | None = None) -> Array:
    return ttt_loss(confu_passes(params, cfg, tcfg, batch, loss.ttt.steps), batch, loss.ttt)
  return objective


def confu_eval(cfg: Config, tcfg: Config, loss: ConFuLoss) -> Callable:
  """Jitted ttt_sums of a batch (whose anchors are every position)."""
  return jax.jit(lambda params, batch: ttt_sums(
      confu_passes(params, cfg, tcfg, batch, loss.ttt.steps), batch))


def heldout(params: ConFuParams, cfg: Config, tcfg: Config, rows: FeatureRows, target: Params,
            loss: ConFuLoss, batch_size: int = 8, eval_fn: Callable | None = None) -> dict:
  """Held-out acceptance of drafts 1 .. steps, every chain reading its contemplate signal."""
  rows = with_target(rows, target, 0)
  return evaluate_by_step(params, cfg, rows, loss.ttt, batch_size,
                          eval_fn=eval_fn or confu_eval(cfg, tcfg, loss))


def with_target(rows: FeatureRows, target: Params, anchors: int) -> ConFuRows:
  fields = {f.name: getattr(rows, f.name) for f in dataclasses.fields(FeatureRows)}
  return ConFuRows(**fields, target=target, anchors=anchors)


@dataclasses.dataclass(frozen=True)
class ConFuRecipe:
  data_dirs: tuple[str, ...]  # distillation sets ("DIR", "DIR:N", "DIR:A-B"), as train-drafter's
  vocab_trim: int = 8192
  loss: ConFuLoss = ConFuLoss()
  experts: int = 4
  expert_top_k: int = 2
  soft_tokens: int = 2
  train: trainer.TrainConfig = trainer.TrainConfig(loss="confu")
  save_dtype: str = "float16"


def init_confu(target, recipe: ConFuRecipe, key: Array, keep=None) -> tuple[ConFuParams, Config]:
  """EAGLE-3's fresh drafter (the same init as `train-eagle --network eagle3` with the same seed)
  and fresh contemplate weights (proj zero: at step 0 the drafter is that EAGLE-3 drafter)."""
  params, cfg = eagle3.init_eagle3(target.params, target.cfg, key, keep)
  cp = init_contemplate(target.params, target.cfg, jax.random.fold_in(key, 1),
                        experts=recipe.experts, soft_tokens=recipe.soft_tokens,
                        top_k=recipe.expert_top_k)
  return ConFuParams(drafter=params, contemplate=cp), cfg


def train_confu(target, out, recipe: ConFuRecipe, *, progress: bool = True,
                command: str = "") -> Path:
  """EAGLE-3's data (taps cached under out/features), the contemplate weights trained with it
  through the frozen target, and a drafter directory out/drafter that `--drafter model:DIR`
  loads."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  tc = recipe.train
  taps = eagle3.fusion_taps(target.cfg.num_layers)
  data = feature_data(target, out, "confu", recipe.data_dirs, recipe.vocab_trim, tc.seq_len,
                      taps=taps, progress=progress, loss=recipe.loss)
  params, cfg = init_confu(target, recipe, jax.random.key(tc.seed), data.keep)
  tcfg = target.cfg
  eval_fn = confu_eval(cfg, tcfg, recipe.loss)
  t1 = time.perf_counter()
  params, _ = trainer.train(
      params, cfg, with_target(data.train_rows, target.params, recipe.loss.anchors), tc,
      out / "work", progress=progress, objective=confu_objective(cfg, tcfg, recipe.loss),
      evaluator=lambda p: heldout(p, cfg, tcfg, data.eval_rows, target.params, recipe.loss,
                                  eval_fn=eval_fn))
  metadata = data.metadata(recipe, command, target, params, out / "work", network="confu",
                           taps=list(taps), train_seconds_this_run=time.perf_counter() - t1)
  return save_eagle(out / "drafter", cfg, params, target.tokenizer, metadata, keep_ids=data.keep,
                    dtype=recipe.save_dtype)
