"""Drafters by name: one table from the CLI/API names to constructors.

A name is KIND or KIND:ARG (`self`, `default`, `early-exit:4`, `model:path/to/dir`, `ngram:2-4`);
a kind that drafts in front of another drafter takes `+NAME` (`ngram+default`). Adding a kind is
one `@register` here. `model:PATH` dispatches on what the path holds (a .gguf file, or a
directory whose kind jspec.io.drafter.read_drafter_dir reports).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Callable, Protocol

import jax

from jspec.drafting.base import Drafter, place_drafter
from jspec.drafting.confu import confu_drafter
from jspec.drafting.feature import eagle3_drafter, eagle_drafter
from jspec.drafting.model import ModelDrafter, early_exit_drafter, self_drafter, trimmed_drafter
from jspec.drafting.lookahead import lookahead_drafter
from jspec.drafting.ngram import ngram_drafter
from jspec.drafting.probe import probe_drafter
from jspec.drafting.skip import calibrated_layers, layer_influence, skip_drafter
from jspec.io.drafter import DrafterDir, load_compact, load_feature, read_drafter_dir
from jspec.io.datastore import default_table, load_table, read_metadata
from jspec.io.fetch import default_model_path
from jspec.io.load import (check_same_tokenizer, dtype_by_name, in_format, layer_in_format,
                           load_float_checkpoint, matrix_in_format, on_xla, resolve_path,
                           source_exists)
from jspec.io.tokenizer import Tokenizer
from jspec.models.confu import ConFuParams
from jspec.models.config import Config
from jspec.models.eagle3 import Eagle3Params
from jspec.models.llama import Params, layers_stacked, num_layers, stack_layers
from jspec.models.vocab_trim import fit_vocab
from jspec.sharding import model_placement

# Made by the command recorded in its jspec.json (see README, "The default drafter").
DEFAULT_DRAFTER = Path(__file__).parent.parent / "drafters" / "smollm2-135m-instruct"


class Target(Protocol):
  """What building a drafter reads of the loaded target (jspec.model.Model has it)."""

  cfg: Config
  params: Params
  tokenizer: Tokenizer
  source: str

  def generate_ids(self, prompts, max_new_tokens: int):
    """Greedy continuations (what `skip:N` calibrates on)."""

  def off_mesh_for(self, batch: int) -> "Target":
    """This target, or the same weights off its mesh where `batch` rows cannot split over dp."""


# build(target, arg, dtype, fallback) -> a drafter; arg is the text after "KIND:" (None without
# one), fallback the drafter named after "+" (kinds with `takes_fallback` only).
Build = Callable[[Target, "str | None", str, "Drafter | None"], Drafter]


@dataclasses.dataclass(frozen=True)
class DrafterKind:
  name: str
  usage: str  # how the name is written, e.g. "early-exit:K"
  help: str
  build: Build
  takes_fallback: bool = False
  # check(arg): the ARG checks that need no target (syntax, ranges, a path that exists), run by
  # parse_drafter before anything loads.
  check: Callable[["str | None"], None] | None = None
  draft_model: bool = False  # a model with a KV cache of its own (draft_kv, --gamma auto)
  reads_dtype: bool = False  # loads its weights in `dtype` (--drafter-weights)
  chains_only: bool = False
  # Its drafts come from logits, so they can be drawn under the target's penalties
  # (--draft-penalties); a lookup's come from a table (its +DRAFTER's from logits).
  draws_logits: bool = True
  own_tree: bool = False  # verifies a tree of its own each round (lookahead's pool): no --gamma
  adaptive: bool = True  # has an adaptive draft length (NAME@P)


KINDS: dict[str, DrafterKind] = {}


def register(name: str, usage: str, help: str, **traits):
  """Decorator: `build` becomes the constructor of drafters named `name[:ARG][+FALLBACK]`;
  `traits`: DrafterKind's other fields (takes_fallback, check, draft_model, ...)."""
  def add(build: Build) -> Build:
    KINDS[name] = DrafterKind(name, usage, help, build, **traits)
    return build
  return add


@dataclasses.dataclass(frozen=True)
class DrafterName:
  """A drafter name, parsed and checked: KIND[:ARG][+FALLBACK][@STOP]."""

  text: str
  kind: DrafterKind
  arg: str | None
  fallback: "DrafterName | None" = None
  stop: float | None = None

  @property
  def kinds(self) -> tuple[DrafterKind, ...]:
    """This name's kind and those of the drafters behind it (`ngram+default`: ngram, default)."""
    return (self.kind,) + (self.fallback.kinds if self.fallback else ())


def parse_drafter(name: str) -> DrafterName | None:
  """The parsed name (None for "none"); every check that needs no target runs here, so a bad
  name fails before any model loads. Errors name the drafter."""
  if name == "none":
    return None
  base, at, stop = name.rpartition("@")
  if at and re.fullmatch(r"[0-9.]+", stop):
    inner = parse_drafter(base)
    if inner is None:
      raise ValueError(f"drafter {name!r}: 'none' drafts nothing to stop")
    if inner.stop is not None:
      raise ValueError(f"drafter {name!r}: one stop threshold @P per drafter name")
    if not inner.kind.adaptive:
      raise ValueError(f"drafter {name!r}: {inner.kind.name} has no adaptive draft length; "
                       f"drop the @P")
    try:
      p = float(stop)
    except ValueError:
      raise ValueError(f"drafter {name!r}: @P takes a probability, got {stop!r}") from None
    if not 0 < p <= 1:
      raise ValueError(f"drafter {name!r}: @P takes a probability in (0, 1], got {p}")
    return dataclasses.replace(inner, text=name, stop=p)
  match = re.fullmatch(r"([a-z][a-z-]*)(.*)", name, flags=re.DOTALL)
  kind = KINDS.get(match.group(1)) if match else None
  if kind is None:
    raise ValueError(f"unknown drafter {name!r}; expected {drafter_help()}")
  rest, fallback = match.group(2), None
  cut = _fallback_cut(rest) if kind.takes_fallback else None
  if cut is not None:
    rest, inner = rest[:cut], rest[cut + 1:]
    behind = KINDS.get(re.match(r"[a-z-]*", inner).group())
    if behind is None or behind.takes_fallback or behind.own_tree:
      raise ValueError(f"drafter {name!r}: after '+' name a drafter that is not itself a lookup "
                       f"(default, self, early-exit:K, model:PATH, mtp, skip:N)")
    fallback = parse_drafter(inner)
  if rest and not rest.startswith(":"):
    raise ValueError(f"unknown drafter {name!r}; expected {drafter_help()}")
  arg = rest[1:] if rest else None
  if kind.check is not None:
    try:
      kind.check(arg)
    except (ValueError, FileNotFoundError) as e:
      raise _renamed(e, _naming(name, e)) from None
  return DrafterName(name, kind, arg, fallback)


def _fallback_cut(rest: str) -> int | None:
  """Where a lookup's "+DRAFTER" begins in what follows its kind: the first "+" that leads a
  drafter's kind name or ends the text (a datastore path may hold a "+" of its own)."""
  for match in re.finditer(r"\+", rest):
    after = re.match(r"[a-z][a-z-]*", rest[match.end():])
    if after is None and match.end() == len(rest) or after and after.group() in {*KINDS, "none"}:
      return match.start()
  return None


def has_draft_model(name: str) -> bool:
  """Whether drafter `name` drafts with a model of its own (a KV cache a --kv-drafter budgets)."""
  parsed = parse_drafter(name)
  return parsed is not None and any(kind.draft_model for kind in parsed.kinds)


def _renamed(error: Exception, message: str) -> Exception:
  """The error again with `message`: a FileNotFoundError stays one, anything else a ValueError
  (a subclass such as json's JSONDecodeError takes other arguments)."""
  return (FileNotFoundError if isinstance(error, FileNotFoundError) else ValueError)(message)


def _naming(name: str, error: Exception) -> str:
  """The error's message, led by the drafter's name unless it already says it."""
  text = str(error)
  return text if repr(name) in text else f"drafter {name!r}: {text}"


def drafter_help() -> str:
  return " | ".join(["none"] + [f"{k.usage} ({k.help})" for k in KINDS.values()]) + (
      "; any NAME@P: adaptive draft length, a chain ends before the first draft the drafter is "
      "less than P sure of (n-gram: at its first miss), e.g. default@0.4, ngram@1")


def load_drafter(name: str, target: Target, dtype: str = "float32") -> Drafter | None:
  """The drafter called `name` for `target`; None for "none". See drafter_help(). `NAME@P`:
  that drafter with adaptive draft length (`Drafter.with_stop(P)`: a chain ends before the first
  draft it is less than P sure of; an n-gram lookup at its first miss).

  A target loaded on a mesh (`jspec.model.load(..., mesh=)`) gets its drafter placed there once
  (`place_drafter`), a draft model's weights in XLA's formats (jspec's CPU kernels do not shard).
  A target with stacked layers (`load(..., scan_layers=True)`) gets draft models stacked alike.
  """
  mesh = getattr(target, "mesh", None)
  stacked = layers_stacked(target.params)
  if mesh is None and not stacked:
    return _load_drafter(name, target, dtype)
  if mesh is not None:
    if dtype == "q4":
      raise ValueError("--drafter-weights q4 runs jspec's CPU kernel, which cannot run on a "
                       "mesh. Fix: float32 or int8 drafter weights (--drafter-weights, "
                       "load_drafter(..., dtype=)) with the mesh, or drop --mesh.")
    dtype = on_xla(dtype)
  drafter = _load_drafter(name, target, dtype)
  if drafter is not None and stacked:
    drafter = _with_stacked_models(drafter)
  if drafter is not None and mesh is not None:
    drafter = place_drafter(drafter, model_placement(target.cfg, mesh), target.params,
                            target.params)
  return drafter


def _with_stacked_models(drafter: Drafter) -> Drafter:
  """The drafter with every draft model's layers stacked (`stack_layers`; those that share the
  target's params already are)."""
  def stacked(x):
    if isinstance(x, Params) and num_layers(x) and not layers_stacked(x):
      return stack_layers(x)
    return x
  return jax.tree.map(stacked, drafter, is_leaf=lambda x: isinstance(x, Params))


def _load_drafter(name: str, target: Target, dtype: str) -> Drafter | None:
  parsed = parse_drafter(name)
  return None if parsed is None else _build(parsed, target, dtype)


def _build(name: DrafterName, target: Target, dtype: str) -> Drafter:
  fallback = None if name.fallback is None else _build(name.fallback, target, dtype)
  try:
    drafter = name.kind.build(target, name.arg, dtype, fallback)
  except (ValueError, FileNotFoundError) as e:
    raise _renamed(e, _naming(name.text, e)) from None
  return drafter if name.stop is None else drafter.with_stop(name.stop)


def _no_arg(kind: str, arg: str | None) -> None:
  if arg is not None:
    raise ValueError(f"drafter {kind!r} takes no ':' argument, got {kind}:{arg}")


def _digits(usage: str):
  """A check that ARG is a whole number (its range depends on the target: checked at build)."""
  def check(arg: str | None) -> None:
    if arg is None or not arg.isdigit():
      raise ValueError(f"write {usage} with a whole number {usage.split(':')[1]}")
  return check


@register("default", "default", "the distilled drafter shipped for the default model",
          check=functools.partial(_no_arg, "default"), draft_model=True, reads_dtype=True)
def _default(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  return load_model_drafter(default_drafter_path(target), target, dtype)


@register("self", "self", "the target drafts for itself: engine check",
          check=functools.partial(_no_arg, "self"), draft_model=True)
def _self(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  return self_drafter(target.params, target.cfg)


@register("early-exit", "early-exit:K", "the target's first K layers + its head",
          check=_digits("early-exit:K"), draft_model=True)
def _early_exit(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  if not 1 <= int(arg) < target.cfg.num_layers:
    raise ValueError(f"early-exit:K needs 1 <= K < {target.cfg.num_layers}, got "
                     f"'early-exit:{arg}'")
  return early_exit_drafter(target.params, target.cfg, int(arg))


def _check_model_path(arg: str | None) -> None:
  if not arg:
    raise ValueError("model:PATH needs a path to a drafter (a .gguf file or a directory)")
  if not source_exists(arg):
    raise FileNotFoundError(f"no drafter at {arg!r} (no such file or directory). Fix: a .gguf "
                            f"file, an HF directory or a drafter directory written by jspec "
                            f"train-drafter / train-eagle (its drafter/ folder)")


@register("model", "model:PATH", "a .gguf, HF, compact or feature-level drafter directory with "
                                 "the target's tokenizer", check=_check_model_path,
          draft_model=True, reads_dtype=True)
def _model(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  return load_model_drafter(arg, target, dtype)


def _ngram_sizes(arg: str | None) -> tuple[int | None, int]:
  if arg is None:
    return None, 4
  lo, dash, hi = arg.partition("-")
  if not (lo.isdigit() and dash and hi.isdigit()):
    raise ValueError(f"n-gram drafter 'ngram:{arg}': write ngram:N1-N2 (e.g. ngram:2-4), "
                     f"optionally +DRAFTER")
  if not 1 <= int(lo) <= int(hi) <= 16:
    raise ValueError(f"n-gram drafter 'ngram:{arg}': needs 1 <= N1 <= N2 <= 16")
  return int(lo), int(hi)


@register("ngram", "ngram[:N1-N2][+DRAFTER]",
          "n-gram lookup on the context, longest suffix N2 down to N1, default 1-4; with "
          "+DRAFTER the lookup where it matches and DRAFTER elsewhere, default 2-4, e.g. "
          "ngram+default", takes_fallback=True, check=_ngram_sizes, draws_logits=False)
def _ngram(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  return ngram_drafter(target.cfg.vocab_size, *_ngram_sizes(arg), fallback)


def _check_datastore(arg: str | None) -> None:
  if arg is not None:
    if not arg:
      raise ValueError("rest:PATH needs the path of a datastore from `jspec build-datastore`")
    read_metadata(arg)  # exists and is a datastore; its tokenizer is checked at build


@register("rest", "rest[:PATH][+DRAFTER]",
          "retrieval drafting (REST): n-gram lookup on the context (2-4), else the most frequent "
          "continuation in an n-gram datastore: by default ShareGPT's answers, built once for the "
          "target's tokenizer; PATH: a file from `jspec build-datastore`; with +DRAFTER, DRAFTER "
          "where neither matches", takes_fallback=True, check=_check_datastore,
          draws_logits=False)
def _rest(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  V = target.cfg.vocab_size
  store = (default_table(target.tokenizer, V) if arg is None
           else load_table(arg, target.tokenizer, V))
  return ngram_drafter(V, 2, 4, fallback, store=store)


def _mtp_masks(arg: str | None) -> None:
  if arg is not None and not (arg.isdigit() and 1 <= int(arg) <= 8):
    raise ValueError(f"mtp:K takes K = 1 .. 8 mask positions per token, got 'mtp:{arg}'")


@register("mtp", "mtp[:K]", "mask-token probing (ESP): the target's own logits at K mask "
                           "positions after each verified token draft the next K tokens, in the "
                           "same forward; no drafter model. K = 2 by default, chains of gamma <= K "
                           "or trees at most K deep, e.g. --tree dynamic:8,2,1,4",
          check=_mtp_masks)
def _mtp(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  return probe_drafter(target.params, target.cfg, 2 if arg is None else int(arg))


def _lookahead_sizes(arg: str | None) -> tuple[int, int, int]:
  if arg is None:
    return 5, 4, 5
  parts = arg.split("-")
  if len(parts) != 3 or not all(p.isdigit() for p in parts):
    raise ValueError(f"write lookahead:W-N-G (window, n-gram size, guess set), e.g. "
                     f"lookahead:5-4-5; got 'lookahead:{arg}'")
  width, ngram, guesses = (int(p) for p in parts)
  if not (1 <= width <= 64 and 2 <= ngram <= 9 and 1 <= guesses <= 64):
    raise ValueError(f"lookahead:W-N-G needs 1 <= W <= 64, 2 <= N <= 9, 1 <= G <= 64; got "
                     f"'lookahead:{arg}'")
  return width, ngram, guesses


@register("lookahead", "lookahead[:W-N-G]",
          "lookahead decoding (Jacobi iterations + an n-gram pool): the target's own window of "
          "W columns x N - 1 levels runs in each verification forward, and up to G pooled "
          "n-grams of N - 1 tokens are verified as one tree; no drafter model. Default 5-4-5",
          check=_lookahead_sizes, draws_logits=False, own_tree=True, adaptive=False)
def _lookahead(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  return lookahead_drafter(target.params, target.cfg, *_lookahead_sizes(arg))


# What the target writes to calibrate a layer-skip draft on (its own greedy continuations).
SKIP_CALIBRATION = ("Explain step by step how a hash map handles collisions, with a short example.",
                    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n")


@register("skip", "skip:N", "layer skipping: the target drafts with all but N of its layers "
                            "(those that change its residual stream least on text it generated), "
                            "sharing its KV cache; chains only", check=_digits("skip:N"),
          chains_only=True)
def _skip(target: Target, arg: str | None, dtype: str, fallback) -> Drafter:
  L = target.cfg.num_layers
  calibrated_layers(list(range(L)), int(arg))  # the range check, before any compute
  prompts = [target.tokenizer.encode(text) for text in SKIP_CALIBRATION]
  out = target.off_mesh_for(len(prompts)).generate_ids(prompts, max_new_tokens=48).sequences()
  influence = sum(layer_influence(target.params, target.cfg, p + o) for p, o in zip(prompts, out))
  return skip_drafter(target.params, target.cfg, calibrated_layers(influence, int(arg)))


def default_drafter_path(target: Target) -> Path:
  """The shipped drafter directory; it is trained for the default model only."""
  if Path(target.source) != default_model_path():
    raise ValueError(f"--drafter default is distilled from the default model; the target is "
                     f"{target.source}. Train one for it with `jspec train-drafter --target ...` "
                     f"and pass --drafter model:DIR")
  if not (DEFAULT_DRAFTER / "model.safetensors").is_file():
    raise FileNotFoundError(f"the default drafter is missing from {DEFAULT_DRAFTER}: reinstall "
                            f"jspec, or pass --drafter model:DIR")
  return DEFAULT_DRAFTER


def _compact_dir(stored: DrafterDir, target: Target, dtype: str) -> Drafter:
  cfg, params, keep = load_compact(stored, target.params, dtype_by_name(dtype))
  params = in_format(params, dtype)
  return ModelDrafter(params, cfg) if keep is None else trimmed_drafter(params, cfg, keep)


def _feature_dir(stored: DrafterDir, target: Target, dtype: str) -> Drafter:
  cfg, params, keep = load_feature(stored, target.cfg, dtype_by_name(dtype))
  params = _feature_in_format(params, dtype)
  if isinstance(params, ConFuParams):
    return confu_drafter(params.drafter, params.contemplate, cfg, keep,
                         target_params=target.params)
  if isinstance(params, Eagle3Params):
    return eagle3_drafter(params, cfg, keep, target_params=target.params)
  return eagle_drafter(params, cfg, target.params, keep)  # the target's tables as stored


def _feature_in_format(params, dtype: str):
  """A feature drafter's own matmuls (its layer, fc and EAGLE-3's head) in format `dtype`; the
  target's tables it borrows stay as the target stores them."""
  own = params.drafter if isinstance(params, ConFuParams) else params
  own = dataclasses.replace(own, layer=layer_in_format(own.layer, dtype),
                            fc=matrix_in_format(own.fc, (0,), dtype))
  if isinstance(own, Eagle3Params):
    own = dataclasses.replace(own, head=matrix_in_format(own.head, (1,), dtype))
  return dataclasses.replace(params, drafter=own) if isinstance(params, ConFuParams) else own


# Drafter directories that borrow from the target, by read_drafter_dir's kind.
_BORROWING_DIRS = {"compact": _compact_dir, "feature": _feature_dir}


def load_model_drafter(path: str | Path, target: Target, dtype: str = "float32") -> Drafter:
  """A draft model from a .gguf file, an HF directory, a compact drafter directory (one that
  borrows the target's embedding and/or has a VocabTrim head) or a feature-level drafter
  directory (see jspec.io.drafter). A draft model with the target's tokenizer but a vocabulary
  padded to another size is fitted to the target's (jspec.models.vocab_trim.fit_vocab)."""
  path = resolve_path(path)
  stored = read_drafter_dir(path) if path.is_dir() else None
  if stored is not None and stored.kind in _BORROWING_DIRS:
    dtype_by_name(dtype)
    check_same_tokenizer(target.tokenizer, Tokenizer.from_hf_dir(path), str(path))
    return _BORROWING_DIRS[stored.kind](stored, target, dtype)
  cfg, params, tokenizer, source = load_float_checkpoint(path, dtype)
  check_same_tokenizer(target.tokenizer, tokenizer, str(source))
  params, cfg, keep = fit_vocab(params, cfg, target.cfg.vocab_size)
  params = in_format(params, dtype)
  return ModelDrafter(params, cfg) if keep is None else trimmed_drafter(params, cfg, keep)
