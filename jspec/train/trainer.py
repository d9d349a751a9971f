"""Drafter distillation: a jitted AdamW step over teacher-forced target responses, orbax checkpoints,
exact resume.

Rows are `prompt + response` cut to `seq_len` tokens; the loss covers the positions that predict a
response token, against the target's top-k distribution stored there. The data order is a pure
function of (seed, epoch), and the checkpoint holds the step, so a run killed mid-way resumes from
its last checkpoint and reaches the same parameters as an uninterrupted run.

Held-out evaluation estimates block efficiency without a decode: per position, the probability a
draft token is accepted is alpha = sum_x min(p(x), q(x)) (sampling; p from the stored top-k, so a
lower bound) or 1{argmax q = argmax p} (greedy), and a chain of gamma drafts with acceptance
alpha yields tau = (1 - alpha^(gamma+1)) / (1 - alpha) tokens per target call (Leviathan et al.).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from jspec.models.config import Config
from jspec.models.llama import Params, forward_rows
from jspec.train.distill import Example
from jspec.train.losses import acceptance_sums, loss_fn

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  loss: str = "tvd++"  # "kl" | "tvd" | "tvd++"
  seq_len: int = 320
  batch_size: int = 8
  grad_accum: int = 1
  steps: int = 1000
  lr: float = 1e-3
  warmup_steps: int = 50
  weight_decay: float = 0.01
  clip_norm: float = 1.0
  seed: int = 0
  eval_every: int = 100
  checkpoint_every: int = 100
  gamma: int = 4  # for the block-efficiency estimate
  # Keep the embedding and LM head as initialised: with a head copied from the target this keeps
  # the drafter in the target's output space, skips the largest weight gradient, and lets the
  # saved drafter borrow the target's table instead of storing it.
  freeze_embeddings: bool = False

  def __post_init__(self):
    for name, least in (("seq_len", 2), ("batch_size", 1), ("grad_accum", 1), ("steps", 0),
                        ("warmup_steps", 0), ("eval_every", 1), ("checkpoint_every", 1),
                        ("gamma", 1)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"TrainConfig {name} must be an integer >= {least}, got {value!r}")
    for name, positive in (("lr", True), ("weight_decay", False), ("clip_norm", True)):
      value = getattr(self, name)
      if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"TrainConfig {name} must be a finite number "
                         f"{'> 0' if positive else '>= 0'}, got {value!r}")


@dataclasses.dataclass
class Rows:
  """Training rows, padded to seq_len: inputs, loss mask and teacher top-k at every position."""

  tokens: np.ndarray  # [N, S] int32
  mask: np.ndarray  # [N, S] float32: position predicts a response token
  top_ids: np.ndarray  # [N, S, K] int32 (-1 where no teacher)
  top_logprobs: np.ndarray  # [N, S, K] float16

  def __len__(self) -> int:
    return self.tokens.shape[0]

  def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    return {"tokens": self.tokens[idx], "mask": self.mask[idx], "top_ids": self.top_ids[idx],
            "top_logprobs": self.top_logprobs[idx].astype(np.float32)}


def check_resume(workdir: Path, settings: dict, record: str = "recipe.json") -> None:
  """A work directory resumes only the run that made it: the settings that shape the drafter and
  its data ("recipe.json") and the training loop's ("train_config.json", `train`) are recorded
  there and compared on every rerun."""
  settings = json.loads(json.dumps(settings))  # as JSON reads them back (tuples become lists)
  file = workdir / record
  # Compared once the run has saved a checkpoint: a run that failed before (a bad setting caught
  # after the load) may be rerun with the setting fixed.
  if file.is_file() and any(p.name.isdigit() for p in (workdir / "checkpoints").glob("*")):
    old = json.loads(file.read_text())
    # A setting an older jspec did not record is not compared (its runs still resume).
    changed = [f"{k}: {old.get(k)!r} then, {v!r} now" for k, v in settings.items()
               if k in old and old[k] != v]
    if changed:
      raise ValueError(f"{workdir} holds a run made with other settings ({'; '.join(changed)}). "
                       f"Fix: rerun with the first run's settings to resume it, or another --out")
  workdir.mkdir(parents=True, exist_ok=True)
  file.write_text(json.dumps(settings, indent=2))


def make_rows(examples: Sequence[Example], seq_len: int, vocab_map: np.ndarray | None = None,
              allow_empty: bool = False) -> Rows:
  """Rows from examples. `vocab_map` [V] maps full ids to a trimmed vocabulary (-1 = dropped):
  teacher entries outside it become padding. Rows with no response token in seq_len are refused
  unless `allow_empty` (a held-out check beside training, which reports its positions)."""
  n = len(examples)
  K = examples[0].top_ids.shape[1]
  tokens = np.zeros((n, seq_len), np.int32)
  mask = np.zeros((n, seq_len), np.float32)
  top_ids = np.full((n, seq_len, K), -1, np.int32)
  top_lps = np.zeros((n, seq_len, K), np.float16)
  for i, ex in enumerate(examples):
    seq = np.concatenate([ex.prompt, ex.response])[:seq_len]
    tokens[i, : len(seq)] = seq
    P = len(ex.prompt)
    # Position P - 1 + t predicts response token t, under the teacher's distribution there.
    n_resp = max(0, min(len(ex.response), seq_len - P + 1))
    pos = slice(P - 1, P - 1 + n_resp)
    mask[i, pos] = 1.0
    ids = ex.top_ids[:n_resp]
    top_ids[i, pos] = ids if vocab_map is None else vocab_map[ids]
    top_lps[i, pos] = ex.top_logprobs[:n_resp]
  if n and not mask.any() and not allow_empty:
    shortest = min(len(ex.prompt) for ex in examples)
    raise ValueError(f"no response token fits seq_len={seq_len}: the prompts are {shortest} "
                     f"tokens or longer, so every position would be prompt. Fix: seq_len (--seq-"
                     f"len) >= {shortest}, longer to train on more of each response")
  return Rows(tokens, mask, top_ids, top_lps)


def student_logits(params: Params, cfg: Config, tokens: Array) -> Array:
  """Teacher-forced logits [B, S, V] of the drafter, through the same `forward` decoding uses."""
  return forward_rows(params, cfg, tokens)[0]


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps,
                                                max(tc.steps, tc.warmup_steps + 1), tc.lr * 0.1)
  opt = optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                    optax.adamw(schedule, weight_decay=tc.weight_decay))
  return optax.MultiSteps(opt, every_k_schedule=tc.grad_accum) if tc.grad_accum > 1 else opt


def frozen_tables(params: Params, freeze: Callable) -> Params:
  """`freeze` applied to the embedding and the LM head (a VocabTrim head is rows of the table)."""
  head = None if params.lm_head is None else freeze(params.lm_head)
  return dataclasses.replace(params, embed=freeze(params.embed), lm_head=head)


def make_step(cfg: Config, tc: TrainConfig, opt: optax.GradientTransformation,
              objective: Callable | None = None) -> Callable:
  """The jitted optimizer step `step(params, opt_state, batch, key)`; `objective(params, batch,
  key) -> loss` replaces the distillation loss of a plain drafter (e.g. jspec.train.eagle's, whose
  feature noise draws from the key: a function of the seed and the micro-step, so a resumed run
  draws what the unbroken one would)."""
  loss = None if objective is not None else loss_fn(tc.loss)

  def distill_objective(params, batch, key=None):
    if tc.freeze_embeddings:
      params = frozen_tables(params, jax.lax.stop_gradient)
    logits = student_logits(params, cfg, batch["tokens"])
    return loss(logits, batch["top_ids"], batch["top_logprobs"], batch["mask"])

  objective = objective or distill_objective

  @jax.jit
  def step(params, opt_state, batch, key):
    value, grads = jax.value_and_grad(objective)(params, batch, key)
    updates, opt_state = opt.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    if tc.freeze_embeddings and objective is distill_objective:  # weight decay would shrink them
      new = dataclasses.replace(new, embed=params.embed, lm_head=params.lm_head)
    return new, opt_state, value

  return step


def make_eval(cfg: Config) -> Callable:
  @jax.jit
  def evaluate(params, batch):
    logits = student_logits(params, cfg, batch["tokens"])  # [B, S, V]
    return acceptance_sums(logits, batch["top_ids"], batch["top_logprobs"], batch["mask"])

  return evaluate


def tau_from_alpha(alpha: float, gamma: int) -> float:
  """Expected tokens per target call for a chain of gamma drafts, each accepted w.p. alpha."""
  if alpha >= 1.0:
    return gamma + 1.0
  return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def batch_indices(n_rows: int, tc: TrainConfig, step: int) -> np.ndarray:
  """Row indices of micro-batch `step` (a pure function of seed and step: exact resume)."""
  per_epoch = n_rows // tc.batch_size
  if per_epoch == 0:
    raise ValueError(f"{n_rows} training rows cannot fill one batch of {tc.batch_size}")
  epoch, i = divmod(step, per_epoch)
  order = np.random.default_rng([tc.seed, epoch]).permutation(n_rows)
  return order[i * tc.batch_size: (i + 1) * tc.batch_size]


SECONDS_FILE = "train_seconds.json"
LOG_FILE = "log.jsonl"


def run_summary(workdir: str | Path) -> dict:
  """What a (possibly resumed, possibly already finished) run in `workdir` did in total: its last
  evaluation and the training seconds behind its latest checkpoint."""
  workdir = Path(workdir)
  log_file, seconds_file = workdir / LOG_FILE, workdir / SECONDS_FILE
  lines = log_file.read_text().splitlines() if log_file.exists() else []
  seconds = json.loads(seconds_file.read_text())["seconds"] if seconds_file.exists() else None
  return {"final_eval": json.loads(lines[-1]) if lines else None, "train_seconds_total": seconds}


def _manager(directory: Path, keep: int = 2):
  import orbax.checkpoint as ocp
  return ocp.CheckpointManager(directory.absolute(),
                               options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def train(params: Params, cfg: Config, rows: Rows, tc: TrainConfig, workdir: str | Path,
          eval_rows: Rows | None = None, progress: bool = True,
          stop_after: int | None = None, objective: Callable | None = None,
          evaluator: Callable | None = None) -> tuple[Params, list[dict]]:
  """Train (or resume) to tc.steps optimizer steps; checkpoints under workdir/checkpoints.

  Returns the final params and the log (one dict per eval/checkpoint). `stop_after` ends the
  run early after that many micro-steps in this call (tests use it to simulate a kill).
  `objective` (see make_step) and `evaluator(params) -> dict` (run instead of `evaluate` on
  `eval_rows`) train other drafter kinds with the same loop, checkpoints and resume.
  """
  import orbax.checkpoint as ocp

  workdir = Path(workdir)
  check_resume(workdir, dataclasses.asdict(tc), "train_config.json")
  opt = optimizer(tc)
  step_fn = make_step(cfg, tc, opt, objective)
  if evaluator is None and eval_rows is not None:
    eval_fn = make_eval(cfg)
    evaluator = lambda p: evaluate(p, cfg, eval_rows, tc, eval_fn)
  state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0)}
  mngr = _manager(workdir / "checkpoints")
  log_file = workdir / LOG_FILE
  if mngr.latest_step() is not None:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    try:
      state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # orbax raises many types; name the directory and the fix
      raise ValueError(f"checkpoint {workdir / 'checkpoints'} (step {mngr.latest_step()}) cannot "
                       f"be restored: {e}. Fix: delete that step directory to resume from an "
                       f"earlier one, or start in a new workdir") from e
  params, opt_state, start = state["params"], state["opt_state"], int(state["step"])
  if start and progress:
    tqdm.write(f"resuming from the checkpoint at micro-step {start} of {tc.steps * tc.grad_accum} "
               f"in {workdir / 'checkpoints'}")
  # Training seconds behind the latest checkpoint, summed over the calls that made it (a resumed
  # run redoes the micro-steps after its last checkpoint, so their time is not counted twice).
  seconds_file = workdir / SECONDS_FILE
  prior_s = (run_summary(workdir)["train_seconds_total"] or 0.0) if start else 0.0
  micro_total = tc.steps * tc.grad_accum
  log: list[dict] = []
  bar = tqdm(total=micro_total, initial=start, desc=f"train drafter ({tc.loss})",
             disable=not progress)
  t0, tokens_seen, done_here = time.perf_counter(), 0, 0
  seed_key = jax.random.key(tc.seed)
  for micro in range(start, micro_total):
    batch = rows.take(batch_indices(len(rows), tc, micro))
    params, opt_state, value = step_fn(params, opt_state, batch,
                                       jax.random.fold_in(seed_key, micro))
    tokens_seen += int(batch["mask"].sum())
    done_here += 1
    opt_step = (micro + 1) // tc.grad_accum
    boundary = (micro + 1) % tc.grad_accum == 0
    if boundary and (opt_step % tc.checkpoint_every == 0 or micro + 1 == micro_total):
      mngr.save(micro + 1, args=ocp.args.StandardSave(
          {"params": params, "opt_state": opt_state, "step": jnp.int32(micro + 1)}))
      seconds_file.write_text(json.dumps({"micro_step": micro + 1,
                                          "seconds": prior_s + time.perf_counter() - t0}))
    if boundary and evaluator is not None and (opt_step % tc.eval_every == 0
                                               or micro + 1 == micro_total):
      entry = {"step": opt_step, "loss": float(value), **evaluator(params),
               "train_tokens_per_s": tokens_seen / (time.perf_counter() - t0)}
      log.append(entry)
      with log_file.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    bar.update(1)
    bar.set_postfix(loss=f"{float(value):.4f}",
                    tok_per_s=f"{tokens_seen / (time.perf_counter() - t0):.0f}")
    if stop_after is not None and done_here >= stop_after:
      break
  bar.close()
  mngr.wait_until_finished()
  mngr.close()
  return params, log


def evaluate(params: Params, cfg: Config, rows: Rows, tc: TrainConfig,
             eval_fn: Callable | None = None, batch_size: int = 8) -> dict:
  """Acceptance estimates on held-out rows (see the module docstring)."""
  eval_fn = eval_fn or make_eval(cfg)
  sums = jnp.zeros(3)  # overlap, greedy hits, positions: summed on device, read back once
  for i in range(0, len(rows), batch_size):
    # The last batch is padded (to keep one compiled shape) with copies of row i whose loss mask
    # is zeroed, so every held-out row is scored exactly once.
    real = np.arange(i, min(i + batch_size, len(rows)))
    batch = rows.take(np.concatenate([real, np.full(batch_size - len(real), i)]))
    batch["mask"][len(real):] = 0.0
    sums = sums + jnp.stack(eval_fn(params, batch))
  overlap, greedy, weight = (float(x) for x in sums)
  a_sampled, a_greedy = overlap / max(weight, 1), greedy / max(weight, 1)
  return {"alpha_sampled": a_sampled, "alpha_greedy": a_greedy, "positions": int(weight),
          "tau_sampled_est": tau_from_alpha(a_sampled, tc.gamma),
          "tau_greedy_est": tau_from_alpha(a_greedy, tc.gamma)}
