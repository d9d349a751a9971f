"""Drafter directories: a plain HF model, or a compact one that borrows from its target.

A drafter initialised from the target and trained with its embedding frozen carries a copy of the
target's embedding table (49k x 576 for SmolLM2: 113 MB in float32), and a VocabTrim head is not an
HF layout at all. The compact form stores only what the drafter owns:

  config.json          HF config of the drafter as a full-vocabulary model
  model.safetensors    decoder layers and final norm (+ the embedding unless it is the target's);
                       `lm_head.weight` [M or V, E] unless the head is rows of the table (the
                       target's, or the drafter's own stored one); `jspec.keep_ids` [M] int32
                       when the head is trimmed
  tokenizer files      as in any HF directory (checked against the target's tokenizer)
  jspec.json           {"drafter_format": {"shares_target_embedding": bool, "trimmed_vocab": M or
                       null, "dtype": ...}, ...recipe and measurements}

`read_drafter_dir` is the one reader of a directory's jspec.json: it says which kind of drafter
directory it is ("hf", "compact" or "feature", see DrafterDir); `load_compact` and `load_feature`
rebuild the weights with the loaded target (jspec.drafting.registry turns them into drafters). A
drafter that is neither trimmed nor sharing is written as a plain HF directory that transformers
loads as well.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.io.files import read_json
from jspec.io.save import config_to_hf, params_to_hf, save_hf, save_tokenizer
from jspec.models.config import Config
from jspec.models.drafter import drafter_config
from jspec.models.eagle import EagleParams
from jspec.models.confu import ConFuParams, ContemplateParams, check_contemplate
from jspec.models.eagle3 import Eagle3Params, check_feature_widths, fusion_taps
from jspec.models.llama import LayerParams, Params
from jspec.models.vocab_trim import check_keep_ids, output_table
from jspec.sharding import to_host

FORMAT_KEY = "drafter_format"
FEATURE_KIND = "eagle"  # the format record's "kind" of a feature-level drafter
CONTEMPLATE = ("experts", "router", "soft", "norm", "proj")  # ConFu's tensors, "contemplate.*"
KEEP_IDS = "jspec.keep_ids"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": jnp.bfloat16}


def shares_table(params: Params, target_params: Params) -> bool:
  """Is the drafter's input embedding exactly the target's output table (as init "target" with a
  frozen embedding leaves it)? Then neither needs storing."""
  table = np.asarray(output_table(target_params))
  embed = np.asarray(params.embed)
  return embed.shape == table.shape and np.array_equal(embed, table.astype(embed.dtype))


def save_drafter(path: str | Path, cfg: Config, params: Params, tokenizer, metadata: dict[str, Any],
                 *, keep_ids: np.ndarray | None = None, share_target_table: bool = False,
                 dtype: str = "float32") -> Path:
  """Write a drafter; compact (see module doc) when trimmed or sharing the target's table.

  With `share_target_table` the embedding is left out (the caller vouches for the sharing, see
  `shares_table`); a head that is rows of the table (tied, or its kept rows when trimmed) is
  left out whether the table is the target's or stored here.
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  path = Path(path)
  if keep_ids is None and not share_target_table:
    params = jax.tree.map(lambda x: jnp.asarray(x, DTYPES[dtype]), params)
    return save_hf(path, cfg, params, tokenizer, {**metadata, FORMAT_KEY: {
        "shares_target_embedding": False, "trimmed_vocab": None, "dtype": dtype}})
  import safetensors.numpy

  path.mkdir(parents=True, exist_ok=True)
  head = None if params.lm_head is None else np.asarray(params.lm_head).T  # [M or V, E]
  tied = params.lm_head is None
  if keep_ids is not None:
    keep_ids = check_keep_ids(keep_ids, cfg.vocab_size)
    if head is None or head.shape[0] != len(keep_ids):
      raise ValueError(f"a trimmed drafter needs an LM head of {len(keep_ids)} rows, got "
                       f"{None if head is None else head.shape}")
    # A head that is just the kept rows of the (stored or shared) table needs no storing.
    tied = np.array_equal(head, np.asarray(params.embed)[keep_ids])
  body = dataclasses.replace(params, lm_head=None)
  tensors = params_to_hf(dataclasses.replace(cfg, tie_embeddings=True), body)
  if share_target_table:
    del tensors[EMBED]
  if not tied:
    tensors[HEAD] = head
  tensors = {k: np.asarray(jnp.asarray(v, DTYPES[dtype])) for k, v in tensors.items()}
  if keep_ids is not None:
    tensors[KEEP_IDS] = keep_ids
  (path / "config.json").write_text(json.dumps(config_to_hf(cfg, tokenizer, dtype), indent=2))
  safetensors.numpy.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  if tokenizer is not None:
    save_tokenizer(path, tokenizer)
  fmt = {"shares_target_embedding": share_target_table, "head_is_table": tied,
         "trimmed_vocab": None if keep_ids is None else len(keep_ids), "dtype": dtype}
  (path / "jspec.json").write_text(json.dumps({**metadata, FORMAT_KEY: fmt}, indent=2,
                                              default=str) + "\n")
  return path


@dataclasses.dataclass(frozen=True)
class DrafterDir:
  """What a drafter directory's jspec.json says it holds."""

  path: Path
  kind: str  # "hf": a plain HF model (transformers loads it too); "compact"; "feature"
  format: dict[str, Any] | None  # the drafter_format record; None for "hf"
  metadata: dict[str, Any]  # all of jspec.json: recipe, command, measurements


def read_drafter_dir(path: str | Path) -> DrafterDir:
  """The one reader of a drafter directory's jspec.json (a directory without one is "hf")."""
  path = Path(path)
  meta = path / "jspec.json"
  metadata = read_json(meta, missing_ok=True)
  fmt = metadata.get(FORMAT_KEY)
  if fmt is not None and not isinstance(fmt, dict):
    raise ValueError(f"{meta}: {FORMAT_KEY!r} must be an object, got {fmt!r}. Fix: restore the "
                     f"file jspec saved with the drafter")
  if fmt is not None and fmt.get("kind") == FEATURE_KIND:
    return DrafterDir(path, "feature", fmt, metadata)
  if fmt is None or (not fmt.get("shares_target_embedding") and fmt.get("trimmed_vocab") is None):
    return DrafterDir(path, "hf", None, metadata)
  return DrafterDir(path, "compact", fmt, metadata)


def drafter_format(path: str | Path) -> dict[str, Any] | None:
  """The format record of a compact or feature drafter directory, None for a plain HF one."""
  return read_drafter_dir(path).format


def load_compact(stored: DrafterDir | str | Path, target_params: Params,
                 dtype=jnp.float32) -> tuple[Config, Params, np.ndarray | None]:
  """(cfg, params, keep_ids or None) of a compact drafter directory (a path, or what
  read_drafter_dir read of it), completed from the target."""
  from jspec.io.checkpoint import assemble_params, config_from_file, read_safetensors

  stored = stored if isinstance(stored, DrafterDir) else read_drafter_dir(stored)
  path, fmt = stored.path, stored.format
  if stored.kind != "compact":
    raise ValueError(f"{path} is not a compact drafter directory (its jspec.json says "
                     f"{stored.kind!r})")
  cfg = config_from_file(path / "config.json")
  file = path / "model.safetensors"
  if not file.is_file():
    raise FileNotFoundError(f"{file} not found: the drafter directory is incomplete")
  tensors = dict(read_safetensors(file))
  keep = tensors.pop(KEEP_IDS, None)
  if (keep is None) != (fmt.get("trimmed_vocab") is None):
    raise ValueError(f"{path}: jspec.json and model.safetensors disagree about the trimmed head")
  if keep is not None:
    keep = check_keep_ids(keep, cfg.vocab_size)
  if fmt["shares_target_embedding"]:
    table = to_host(output_table(target_params)).astype(np.float32)  # a mesh's too
    if table.shape != (cfg.vocab_size, cfg.hidden_size):
      raise ValueError(
          f"{path} borrows its embedding from the target, but the target's table is "
          f"{table.shape} and the drafter needs ({cfg.vocab_size}, {cfg.hidden_size}): this "
          f"drafter was made for another target model")
    tensors[EMBED] = table
  head = tensors.pop(HEAD, None)
  if head is None and not fmt.get("head_is_table", True):
    raise ValueError(f"{path}: model.safetensors lacks {HEAD}")
  if head is None and keep is not None:
    head = tensors[EMBED][keep]
  params = assemble_params(dataclasses.replace(cfg, tie_embeddings=True), iter(tensors.items()),
                           dtype, str(path))
  if head is not None:
    expected = (cfg.vocab_size if keep is None else len(keep), cfg.hidden_size)
    if head.shape != expected:
      raise ValueError(f"{path}: {HEAD} has shape {head.shape}, expected {expected}")
    params = dataclasses.replace(params, lm_head=jnp.asarray(head.T, dtype))
  return cfg, params, keep


def save_eagle(path: str | Path, cfg: Config, params, tokenizer, metadata: dict[str, Any], *,
               keep_ids: np.ndarray | None = None, dtype: str = "float16") -> Path:
  """A feature-level drafter (jspec.models.eagle): its own weights only (`fc`, `layer.*`, `norm`,
  `jspec.keep_ids`); it borrows the target's embedding and output table at load time. An EAGLE-3
  drafter (jspec.models.eagle3) also stores its `head` and `hidden_norm`, and its taps."""
  import safetensors.numpy

  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  cast = lambda x: np.asarray(jnp.asarray(x, DTYPES[dtype]))
  confu = isinstance(params, ConFuParams)
  contemplate = params.contemplate if confu else None
  params = params.drafter if confu else params
  tensors = {"fc": cast(params.fc), "norm": cast(params.norm)}
  if confu:  # ConFu's contemplate weights beside its EAGLE-3 drafter's
    tensors.update({f"contemplate.{f}": cast(getattr(contemplate, f)) for f in CONTEMPLATE})
  eagle3 = isinstance(params, Eagle3Params)
  if eagle3:  # its own head over the draft vocabulary, and the feature's norm
    tensors.update(head=cast(params.head), hidden_norm=cast(params.hidden_norm))
  for f in dataclasses.fields(params.layer):
    value = getattr(params.layer, f.name)
    if value is not None:
      tensors[f"layer.{f.name}"] = cast(value)
  if keep_ids is not None:
    tensors[KEEP_IDS] = check_keep_ids(keep_ids, cfg.vocab_size)
  safetensors.numpy.save_file(tensors, str(path / "model.safetensors"),
                              metadata={"format": "jspec-eagle"})
  if tokenizer is not None:
    save_tokenizer(path, tokenizer)
  fmt = {"kind": FEATURE_KIND, "config": dataclasses.asdict(cfg),
         "trimmed_vocab": None if keep_ids is None else len(keep_ids), "dtype": dtype,
         "network": "confu" if confu else "eagle3" if eagle3 else "eagle"}
  if eagle3:
    fmt["taps"] = list(params.taps)
  if confu:
    fmt["expert_top_k"] = contemplate.top_k
  (path / "jspec.json").write_text(json.dumps({**metadata, FORMAT_KEY: fmt}, indent=2,
                                              default=str) + "\n")
  return path


def load_feature(stored: DrafterDir | str | Path, target_cfg: Config, dtype=jnp.float32
                 ) -> tuple[Config, EagleParams | Eagle3Params, np.ndarray | None]:
  """(cfg, params, keep_ids or None) of a feature-level drafter directory (a path, or what
  read_drafter_dir read of it); it borrows the target's tables when it is built
  (jspec.drafting.feature.eagle_drafter)."""
  from jspec.io.checkpoint import read_safetensors

  stored = stored if isinstance(stored, DrafterDir) else read_drafter_dir(stored)
  path, fmt = stored.path, stored.format
  if stored.kind != "feature":
    raise ValueError(f"{path} is not a feature-level drafter directory")
  # A target whose KV heads were repeated for a mesh (Config.kv_repeats) is the same model.
  cfg = drafter_config(dataclasses.replace(
      target_cfg, num_kv_heads=target_cfg.num_kv_heads // target_cfg.kv_repeats, kv_repeats=1), 1)
  trained_for = {k: v for k, v in fmt["config"].items() if k in (
      "hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")}
  mine = {k: getattr(cfg, k) for k in trained_for}
  if trained_for != mine:
    raise ValueError(f"{path} is a feature drafter for a target with {trained_for}, but this "
                     f"target gives {mine}: it was trained for another target model")
  file = path / "model.safetensors"
  if not file.is_file():
    raise FileNotFoundError(f"{file} not found: the drafter directory is incomplete")
  tensors = dict(read_safetensors(file))
  keep = tensors.pop(KEEP_IDS, None)
  layer_fields = {f.name for f in dataclasses.fields(LayerParams)}
  layer = {k.split(".", 1)[1]: jnp.asarray(v, dtype) for k, v in tensors.items()
           if k.startswith("layer.") and k.split(".", 1)[1] in layer_fields}
  network = fmt.get("network", "eagle")
  eagle3 = network in ("eagle3", "confu")
  try:
    if eagle3:
      taps = tuple(fmt["taps"])
      if taps != fusion_taps(target_cfg.num_layers):
        raise ValueError(f"{path} fuses target layers {taps}, but this target's are "
                         f"{fusion_taps(target_cfg.num_layers)}: it was trained for another "
                         f"target model")
      params = Eagle3Params(fc=jnp.asarray(tensors["fc"], dtype), layer=LayerParams(**layer),
                            norm=jnp.asarray(tensors["norm"], dtype),
                            hidden_norm=jnp.asarray(tensors["hidden_norm"], dtype),
                            head=jnp.asarray(tensors["head"], dtype), taps=taps)
    else:
      params = EagleParams(fc=jnp.asarray(tensors["fc"], dtype), layer=LayerParams(**layer),
                           norm=jnp.asarray(tensors["norm"], dtype))
    contemplate = None
    if network == "confu":
      contemplate = ContemplateParams(
          **{f: jnp.asarray(tensors[f"contemplate.{f}"], dtype) for f in CONTEMPLATE},
          top_k=int(fmt["expert_top_k"]))
  except (KeyError, TypeError) as e:
    raise ValueError(f"{file} lacks drafter weights ({e}): not a complete feature "
                     f"drafter") from e
  check_feature_widths(params, cfg.hidden_size,
                       head_rows=cfg.vocab_size if keep is None else len(keep), where=str(file))
  if contemplate is not None:
    check_contemplate(contemplate, params, cfg)
    params = ConFuParams(drafter=params, contemplate=contemplate)
  return cfg, params, keep
