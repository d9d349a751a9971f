"""A loaded model: config, params and tokenizer together, with text in and text out."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp

from jspec.generate import GenerateOutput, generate
from jspec.io.checkpoint import load_model as load_weights
from jspec.io.tokenizer import Tokenizer
from jspec.models.config import Config
from jspec.models.llama import Params
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.spec.drafters import (Drafter, ModelDrafter, early_exit_drafter, self_drafter,
                                 trimmed_drafter)
from jspec.spec.engine import SpecConfig, SpecOutput, speculative_generate

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT = "default"


@dataclasses.dataclass
class Model:
  cfg: Config
  params: Params
  tokenizer: Tokenizer
  source: str

  def encode(self, text: str, chat: bool = True, system: str | None = None) -> list[int]:
    """Token ids for a prompt, wrapped in the chat template when `chat`."""
    if chat:
      messages = ([{"role": "system", "content": system}] if system else [])
      messages.append({"role": "user", "content": text})
      text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
      return self.tokenizer.encode(text, add_special_tokens=False)
    return self.tokenizer.encode(text, add_special_tokens=True)

  def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                   sampling: SamplingParams = GREEDY, key: jax.Array | int = 0,
                   stop: bool = True, drafter: Drafter | None = None,
                   gamma: int = 4) -> GenerateOutput | SpecOutput:
    """Autoregressive generation, or speculative when a drafter is given (same output law)."""
    stop_ids = self.tokenizer.stop_token_ids if stop else ()
    if drafter is None:
      return generate(self.params, self.cfg, prompts, max_new_tokens=max_new_tokens,
                      sampling=sampling, key=key, stop_ids=stop_ids)
    spec = SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids))
    return speculative_generate(self.params, self.cfg, drafter, prompts, spec=spec,
                                sampling=sampling, key=key)

  def generate_text(self, prompts: Sequence[str], *, chat: bool = True, **kwargs) -> list[str]:
    """Generate continuations of text prompts; returns the decoded new text per prompt."""
    out = self.generate_ids([self.encode(p, chat) for p in prompts], **kwargs)
    return [self.tokenizer.decode(seq) for seq in out.sequences()]


def resolve_path(name_or_path: str | Path) -> Path:
  """"default" → the fetched default GGUF; anything else must be a local GGUF or HF directory."""
  if str(name_or_path) == DEFAULT:
    from jspec.io.fetch import default_model_path
    return default_model_path()
  path = Path(name_or_path).expanduser()
  if not path.exists():
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} not found: pass 'default', a local .gguf file or a local "
        f"Hugging Face directory (config.json + *.safetensors + tokenizer.json). jspec never "
        f"downloads from a model hub.")
  return path


def load(name_or_path: str | Path = DEFAULT, dtype: str = "float32") -> Model:
  """Load weights and tokenizer from "default", a .gguf file or an HF directory."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  path = resolve_path(name_or_path)
  cfg, params = load_weights(path, DTYPES[dtype])
  tokenizer = Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_hf_dir(path)
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model's "
                     f"vocabulary is {cfg.vocab_size}")
  return Model(cfg=cfg, params=params, tokenizer=tokenizer, source=str(path))


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_source: str) -> None:
  """A draft must tokenize exactly like the target, or its proposals mean other strings."""
  if target.vocab_size != draft.vocab_size:
    raise ValueError(f"drafter {draft_source} has a vocabulary of {draft.vocab_size} tokens, the "
                     f"target {target.vocab_size}: speculative decoding needs the target's tokenizer")
  diff = [i for i, (a, b) in enumerate(zip(target.tokens, draft.tokens)) if a != b]
  if diff:
    i = diff[0]
    raise ValueError(f"drafter {draft_source} tokenizes differently from the target: {len(diff)} "
                     f"token strings differ (first at id {i}: {draft.tokens[i]!r} vs "
                     f"{target.tokens[i]!r}); use a drafter trained with the target's tokenizer")


def load_model_drafter(path: str | Path, target: Model, dtype: str = "float32"):
  """A draft model from a .gguf file, an HF directory or a compact drafter directory (one that
  borrows the target's embedding and/or has a VocabTrim head; see jspec.io.drafter)."""
  from jspec.io.drafter import drafter_format, is_eagle_dir, load_compact, load_eagle

  path = resolve_path(path)
  if path.is_dir() and is_eagle_dir(path):
    if dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_same_tokenizer(target.tokenizer, Tokenizer.from_hf_dir(path), str(path))
    return load_eagle(path, target.cfg, target.params, DTYPES[dtype])
  if path.is_dir() and drafter_format(path) is not None:
    if dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_same_tokenizer(target.tokenizer, Tokenizer.from_hf_dir(path), str(path))
    cfg, params, keep = load_compact(path, target.cfg, target.params, DTYPES[dtype])
    return ModelDrafter(params, cfg) if keep is None else trimmed_drafter(params, cfg, keep)
  draft = load(path, dtype)
  check_same_tokenizer(target.tokenizer, draft.tokenizer, draft.source)
  return ModelDrafter(draft.params, draft.cfg)


DRAFTER_HELP = ("none | default (the distilled drafter shipped for the default model) | self (the "
                "target drafts for itself: engine check) | early-exit:K (the target's first K "
                "layers + its head) | model:PATH (a .gguf, HF or compact drafter directory with "
                "the target's tokenizer) | ngram[:N1-N2] (n-gram lookup on the context, "
                "longest suffix N2 down to N1, default 1-4) | ngram[:N1-N2]+DRAFTER (lookup where "
                "it matches, the model drafter DRAFTER elsewhere, default 2-4; e.g. "
                "ngram+default)")
# Made by the command recorded in its jspec.json (see README, "The default drafter").
DEFAULT_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"


def default_drafter_path(target: Model) -> Path:
  """The shipped drafter directory; it is trained for the default model only."""
  from jspec.io.fetch import default_model_path
  if Path(target.source) != default_model_path():
    raise ValueError(f"--drafter default is distilled from the default model; the target is "
                     f"{target.source}. Train one for it with `jspec train-drafter --target ...` "
                     f"and pass --drafter model:DIR")
  if not (DEFAULT_DRAFTER / "model.safetensors").is_file():
    raise FileNotFoundError(f"the default drafter is missing from {DEFAULT_DRAFTER}: reinstall "
                            f"jspec, or pass --drafter model:DIR")
  return DEFAULT_DRAFTER


def load_drafter(name: str, target: Model, dtype: str = "float32") -> Drafter | None:
  """A drafter by name: """ + DRAFTER_HELP
  if name == "none":
    return None
  if name == "default":
    return load_model_drafter(default_drafter_path(target), target, dtype)
  if name == "self":
    return self_drafter(target.params, target.cfg)
  if name.startswith("early-exit:"):
    layers = name.split(":", 1)[1]
    if not layers.isdigit() or not 1 <= int(layers) < target.cfg.num_layers:
      raise ValueError(f"early-exit:K needs 1 <= K < {target.cfg.num_layers}, got {name!r}")
    return early_exit_drafter(target.params, target.cfg, int(layers))
  if name.startswith("model:"):
    return load_model_drafter(name.split(":", 1)[1], target, dtype)
  if name == "ngram" or name.startswith(("ngram:", "ngram+")):
    return _ngram_drafter(name, target, dtype)
  raise ValueError(f"unknown drafter {name!r}; expected {DRAFTER_HELP}")


def _ngram_drafter(name: str, target: Model, dtype: str):
  """ngram[:N1-N2][+DRAFTER] (see DRAFTER_HELP)."""
  from jspec.spec.ngram import ngram_drafter
  lookup, plus, rest = name.partition("+")
  n_min, n_max = None, 4
  if lookup != "ngram":
    lo, dash, hi = lookup[len("ngram:"):].partition("-")
    if not (lo.isdigit() and dash and hi.isdigit()):
      raise ValueError(f"n-gram drafter {name!r}: write ngram:N1-N2 (e.g. ngram:2-4), "
                       f"optionally +DRAFTER")
    n_min, n_max = int(lo), int(hi)
  fallback = None
  if plus:
    if not rest or rest == "none" or rest.startswith("ngram"):
      raise ValueError(f"n-gram drafter {name!r}: after '+' name a model drafter (default, self, "
                       f"early-exit:K, model:PATH)")
    fallback = load_drafter(rest, target, dtype)  # NgramDrafter refuses a non-model drafter
  return ngram_drafter(target.cfg.vocab_size, n_min, n_max, fallback)
