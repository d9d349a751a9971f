"""Training EAGLE-3's drafter (jspec.models.eagle3) with its training-time test.

Row position j holds token t_j and the target's taps at j (the residual stream entering layers
2, L/2, L-3: jspec.train.features with `taps`). Pair j is (g_j, t_{j+1}) and predicts t_{j+2}.

Training-time test (arXiv 2503.01840, the reference's `length = 7`): `steps` unrolled passes in
which pass s is exactly the (s + 1)-th draft of a chain started at every row position at once.
For a chain started at j, pass 0 reads the fused target taps g_j; pass s >= 1 reads the drafter's
own output h from pass s - 1 at the same index (the pair at position j + s, fed the true token
t_{j+s+1}, as the reference does). Its query sees what decoding's would: the pairs made from
target features at positions <= j (pass 0's keys, causal) and its own chain's pairs, one per
earlier pass at the same index (the "diagonal"). `ttt_logits` is therefore what `propose` computes
draft by draft (a test checks it).

The loss is token prediction only (no feature regression): pass s's forward KL from the target's
stored top-k distribution of t_{j+s+2} to the drafter's head, weighted decay**s (0.8 in the
reference), with VocabTrim's draft vocabulary as the head's support (teacher ids outside it are
padding: their mass belongs to no draft token and is not renormalised, so a position weighs by the
teacher mass its draft vocabulary holds; the best head at each position is the same either way).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from jspec.io.drafter import save_eagle
from jspec.models import eagle3
from jspec.models.config import Config
from jspec.models.eagle3 import Eagle3Params
from jspec.models.llama import decoder_layer, rope_tables
from jspec.train import trainer
from jspec.train.eagle import feature_data, summed_over_rows
from jspec.train.losses import acceptance_sums, forward_kl

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Eagle3Loss:
  steps: int = 7  # training-time-test passes: drafts 1 .. steps of a chain
  decay: float = 0.8  # pass s weighs decay ** s

  def __post_init__(self):
    if self.steps < 1 or not 0 < self.decay <= 1:
      raise ValueError(f"steps must be >= 1 and decay in (0, 1], got {self.steps}, {self.decay}")


def _diagonal_attention(T: int, passes: int) -> Callable:
  """attend(q, k_all, v_all, layer) for a pass whose cache holds `passes` blocks of T slots (block
  s: pass s's pairs): query t sees block 0's slots <= t and slot t of blocks 1 .. passes - 1."""

  def attend(q: Array, k_all: Array, v_all: Array, i: int) -> Array:
    k, v = k_all[i].astype(q.dtype), v_all[i].astype(q.dtype)  # [B, passes T, K, D]
    B, _, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    k0, v0 = k[:, :T], v[:, :T]
    scores0 = jnp.einsum("btkgd,bskd->btkgs", qg, k0, preferred_element_type=jnp.float32)
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]  # [T, S]
    scores0 = jnp.where(causal[None, :, None, None], scores0, -jnp.inf)
    kd = k[:, T:passes * T].reshape(B, passes - 1, T, K, D)  # the chain's own pairs, a pass each
    vd = v[:, T:passes * T].reshape(B, passes - 1, T, K, D)
    scores_d = jnp.einsum("btkgd,bptkd->btkgp", qg, kd, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(jnp.concatenate([scores0, scores_d], axis=-1) * D ** -0.5, axis=-1)
    probs = probs.astype(v.dtype)
    out = (jnp.einsum("btkgs,bskd->btkgd", probs[..., :T], v0)
           + jnp.einsum("btkgp,bptkd->btkgd", probs[..., T:], vd))
    return out.reshape(B, T, H, D)

  return attend


def ttt_logits(params: Eagle3Params, cfg: Config, embed: Array, tokens: Array, taps: Array,
               steps: int, add: Array | None = None) -> list[Array]:
  """Head logits [B, S - 1, M] of passes 0 .. steps - 1 over rows tokens [B, S] with the target's
  taps [B, S, 3E]: entry j of pass s is the (s + 1)-th draft of a chain started at pair j (it
  scores t_{j+s+2}; entries with j + s + 2 >= S read padding). `add` [B, S - 1, E]: added to
  every feature the chain started at j reads, in every pass (ConFu's contemplate signal)."""
  B, S = tokens.shape
  T = S - 1
  lp = params.layer
  K, D = cfg.num_kv_heads, cfg.head_dim
  dtype = params.fc.dtype
  k_all = jnp.zeros((1, B, steps * T, K, D), dtype)
  v_all = jnp.zeros_like(k_all)
  feats = eagle3.fuse(params, taps[:, :-1])  # [B, T, E]: g_j
  add = 0.0 if add is None else add.astype(feats.dtype)
  feats = feats + add
  out = []
  for s in range(steps):
    # Pass s at index j: the pair at position j + s, token t_{j+s+1} (padding past the row).
    toks = jnp.pad(tokens[:, 1 + s:], ((0, 0), (0, s)))  # [B, T]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + s, (B, T))
    attn_in = eagle3.attention_input(params, cfg, embed, toks, feats)
    cos, sin = rope_tables(cfg, positions)
    slots = jnp.broadcast_to(s * T + jnp.arange(T, dtype=jnp.int32), (B, T))
    h, k_all, v_all = decoder_layer(cfg, feats, lp, 0, k_all, v_all, cos, sin, slots,
                                    _diagonal_attention(T, s + 1), attn_in=attn_in)
    out.append(eagle3.logits(params, cfg, h))
    feats = h + add  # the next pass reads the drafter's own output at the same index
  return out


def _shifted(x: Array, s: int, fill) -> Array:
  """x [B, S, ...] from position 1 + s on, padded with `fill` to S - 1 entries (pass s's
  targets: the teacher's distribution at position j + s + 1 scores t_{j+s+2})."""
  tail = x[:, 1 + s:]
  pad = [(0, 0), (0, s)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(tail, pad, constant_values=fill)


def ttt_loss(passes: list[Array], batch: dict, loss: Eagle3Loss) -> Array:
  """Sum over passes s of decay^s x the forward KL from the teacher's top-k at each pass's target
  position to the drafter's head."""
  total = 0.0
  for s, logits in enumerate(passes):
    mask = _shifted(batch["mask"], s, 0.0)
    ids = _shifted(batch["top_ids"], s, -1)
    lps = _shifted(batch["top_logprobs"], s, 0.0)
    total = total + loss.decay ** s * forward_kl(logits, ids, lps, mask)
  return total


def ttt_sums(passes: list[Array], batch: dict) -> Array:
  """[3 x passes]: per pass, the summed sampled overlap sum_x min(p, q), greedy hits and scored
  positions."""
  sums = []
  for s, logits in enumerate(passes):
    sums += acceptance_sums(logits, _shifted(batch["top_ids"], s, -1),
                            _shifted(batch["top_logprobs"], s, 0.0),
                            _shifted(batch["mask"], s, 0.0))
  return jnp.stack(sums)


def eagle3_objective(cfg: Config, loss: Eagle3Loss) -> Callable:
  def objective(params: Eagle3Params, batch: dict, key: Array | None = None) -> Array:
    return ttt_loss(ttt_logits(params, cfg, batch["embed"], batch["tokens"], batch["feats"],
                               loss.steps), batch, loss)
  return objective


def eagle3_eval(cfg: Config, loss: Eagle3Loss) -> Callable:
  """Jitted sums (sampled overlap, greedy hits) per pass, and the scored positions per pass: pass
  s estimates the acceptance of a chain's (s + 1)-th draft given the s before it were accepted."""
  @jax.jit
  def evaluate(params, batch):
    return ttt_sums(ttt_logits(params, cfg, batch["embed"], batch["tokens"], batch["feats"],
                               loss.steps), batch)
  return evaluate


def evaluate_by_step(params: Eagle3Params, cfg: Config, rows, loss: Eagle3Loss,
                     batch_size: int = 8, eval_fn: Callable | None = None) -> dict:
  """Held-out acceptance of drafts 1 .. steps (each given the ones before it accepted); `eval_fn`
  (params, batch) -> ttt_sums (default: EAGLE-3's)."""
  sums = summed_over_rows(eval_fn or eagle3_eval(cfg, loss), params, rows,
                          batch_size).reshape(loss.steps, 3)
  out = {"positions": int(sums[0, 2])}
  for s in range(loss.steps):
    w = max(sums[s, 2], 1.0)
    out[f"alpha_sampled_draft{s + 1}"] = sums[s, 0] / w
    out[f"alpha_greedy_draft{s + 1}"] = sums[s, 1] / w
  return out


@dataclasses.dataclass(frozen=True)
class Eagle3Recipe:
  data_dirs: tuple[str, ...]  # distillation sets ("DIR", "DIR:N", "DIR:A-B"), as train-drafter's
  vocab_trim: int = 8192  # the draft vocabulary (0: the target's whole vocabulary)
  loss: Eagle3Loss = Eagle3Loss()
  train: trainer.TrainConfig = trainer.TrainConfig(loss="eagle3")
  save_dtype: str = "float16"


def train_eagle3(target, out, recipe: Eagle3Recipe, *, progress: bool = True,
                 command: str = "") -> Path:
  """The target's taps on the distillation rows (cached under out/features), a drafter from
  `init_eagle3`, the shared training loop (orbax checkpoints, exact resume) and a drafter directory
  out/drafter that `--drafter model:DIR` loads."""

  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  tc = recipe.train
  taps = eagle3.fusion_taps(target.cfg.num_layers)
  data = feature_data(target, out, "eagle3", recipe.data_dirs, recipe.vocab_trim, tc.seq_len,
                      taps=taps, progress=progress, loss=recipe.loss)
  params, cfg = eagle3.init_eagle3(target.params, target.cfg, jax.random.key(tc.seed), data.keep)
  eval_fn = eagle3_eval(cfg, recipe.loss)
  t1 = time.perf_counter()
  params, _ = trainer.train(params, cfg, data.train_rows, tc, out / "work", progress=progress,
                            objective=eagle3_objective(cfg, recipe.loss),
                            evaluator=lambda p: evaluate_by_step(p, cfg, data.eval_rows,
                                                                 recipe.loss, eval_fn=eval_fn))
  metadata = data.metadata(recipe, command, target, params, out / "work", network="eagle3",
                           taps=list(taps), train_seconds_this_run=time.perf_counter() - t1)
  return save_eagle(out / "drafter", cfg, params, target.tokenizer, metadata, keep_ids=data.keep,
                    dtype=recipe.save_dtype)
