"""Load Llama-family weights from a Hugging Face directory (safetensors) or a GGUF file.

Both formats go through one table of regex key mappings that turns each tensor (in the torch
[out, in] layout) into a slice of our stacked `Params`, with a shape check against `param_layout`.
Pickle-based checkpoints (`.bin`, `.pt`, `.pth`, `.ckpt`) are refused: loading them runs code.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jspec.io.files import read_json
from jspec.io.gguf_file import GGUFFile
from jspec.models.config import Config, RopeScaling, config_from_hf
from jspec.models.llama import LayerParams, Params, param_layout

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# Each HF tensor → (field of Params or "layers.<field>", reshape from the torch layout).
# E: hidden, H: heads, K: kv heads, D: head dim. Linear weights arrive as [out, in].
_Reshape = Callable[[np.ndarray, Config], np.ndarray]
_ident: _Reshape = lambda w, c: w
_q = lambda w, c: w.T.reshape(c.hidden_size, c.num_heads, c.head_dim)
_kv = lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim)
_o = lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size)
_qb = lambda w, c: w.reshape(c.num_heads, c.head_dim)
_kvb = lambda w, c: w.reshape(c.num_kv_heads, c.head_dim)
_t = lambda w, c: w.T

HF_KEYS: list[tuple[str, str, _Reshape]] = [
    (r"model\.embed_tokens\.weight", "embed", _ident),
    (r"model\.norm\.weight", "final_norm", _ident),
    (r"lm_head\.weight", "lm_head", _t),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.attn_norm", _ident),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.mlp_norm", _ident),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers.wq", _q),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers.wk", _kv),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers.wv", _kv),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.wo", _o),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "layers.bq", _qb),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "layers.bk", _kvb),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "layers.bv", _kvb),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.bias", "layers.bo", _ident),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers.q_norm", _ident),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers.k_norm", _ident),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.w_gate", _t),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers.w_up", _t),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.w_down", _t),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.bias", "layers.b_gate", _ident),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.bias", "layers.b_up", _ident),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.bias", "layers.b_down", _ident),
]
_HF_PATTERNS = [(re.compile(p + r"$"), f, r) for p, f, r in HF_KEYS]
# Tensors that carry no parameters of ours.
_HF_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")

# GGUF (llama.cpp) tensor names → HF names, so one table serves both formats.
GGUF_TO_HF = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.(weight|bias)", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", r"model.layers.\1.mlp.down_proj.\2"),
]
_GGUF_PATTERNS = [(re.compile(p + r"$"), r) for p, r in GGUF_TO_HF]


def _check_not_pickle(path: Path) -> None:
  if path.suffix in PICKLE_SUFFIXES:
    raise ValueError(
        f"{path} is a pickle-based checkpoint; jspec never unpickles checkpoints because loading "
        f"them can run arbitrary code. Fix: convert it to safetensors (e.g. transformers' "
        f"`save_pretrained(dir, safe_serialization=True)`) or GGUF.")


def assemble_params(cfg: Config, tensors: Iterator[tuple[str, Any]], dtype,
                    source: str) -> Params:
  """Build Params from (HF name, torch-layout array) pairs, checking every shape. In place of the
  array a pair may hold a loader, called as loader(reshape, cfg), that returns the array in our
  layout (`reshape(torch-layout array, cfg)`) itself."""
  layout = param_layout(cfg)
  top: dict[str, np.ndarray] = {}
  per_layer: dict[str, dict[int, np.ndarray]] = {}
  for name, array in tensors:
    for pattern, field, reshape in _HF_PATTERNS:
      m = pattern.match(name)
      if m:
        try:
          if callable(array):  # a loader that lays the tensor out itself (GGUF: on the device)
            value = array(reshape, cfg)
          else:
            value = np.asarray(reshape(np.asarray(array), cfg))  # keeps bf16/f16 as stored
        except (ValueError, TypeError) as e:  # q/k/v/o split into heads by the config's sizes
          raise ValueError(
              f"{source}: tensor {name!r} does not fit the config ({e}): hidden_size="
              f"{cfg.hidden_size}, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, "
              f"head_dim={cfg.head_dim}. Fix: the config that came with these weights") from None
        slot = (per_layer.setdefault(field[7:], {}), int(m.group(1))) if field.startswith(
            "layers.") else (top, field)
        if slot[1] in slot[0]:  # two shards (a stale copy beside the model) give one tensor
          raise ValueError(f"{source}: tensor {name!r} ({field}) is given twice: the weights "
                           f"would depend on which file is read last. Fix: remove the stale "
                           f"*.safetensors, or add a model.safetensors.index.json naming the "
                           f"files to read")
        slot[0][slot[1]] = value
        break
    else:
      if not _HF_IGNORED.match(name):
        raise ValueError(f"{source}: unexpected tensor {name!r}; the checkpoint does not look like "
                         f"a {cfg.arch} decoder jspec understands")

  def finish(field: str, spec, value: np.ndarray | None) -> jax.Array | None:
    if spec is None:
      if value is not None:
        raise ValueError(f"{source}: tensor for {field!r} present but the config says it is absent")
      return None
    if value is None:
      raise ValueError(f"{source}: missing tensor for {field!r} (expected shape {spec.shape})")
    if value.shape != spec.shape:
      raise ValueError(f"{source}: {field!r} has shape {value.shape}, config implies {spec.shape}")
    return jnp.asarray(value, dtype)

  layers = []
  for i, layer_layout in enumerate(layout.layers):
    fields = {}
    for field in LayerParams.__dataclass_fields__:
      value = per_layer.get(field, {}).pop(i, None)
      fields[field] = finish(f"layers.{i}.{field}", getattr(layer_layout, field), value)
    layers.append(LayerParams(**fields))
  extra = {field: sorted(found) for field, found in per_layer.items() if found}
  if extra:
    raise ValueError(f"{source}: tensors for layers the config does not have "
                     f"(num_layers={cfg.num_layers}): {extra}")
  lm_head = top.pop("lm_head", None)
  if cfg.tie_embeddings and lm_head is not None:
    # Some tied checkpoints store a copy of the embedding. Another head would be read by
    # transformers (it unties them, with a warning): refused rather than dropped.
    embed, stored = top.get("embed"), np.asarray(lm_head).T  # the head is kept [E, V]
    if embed is None or stored.shape != np.shape(embed) or not np.array_equal(stored,
                                                                              np.asarray(embed)):
      raise ValueError(f"{source}: the config ties the output head to the embedding "
                       f"(tie_word_embeddings=true) but the checkpoint stores an lm_head.weight "
                       f"that differs from it. Fix: set tie_word_embeddings to false in "
                       f"config.json (transformers then uses the stored head), or drop the tensor.")
    lm_head = None
  return Params(
      embed=finish("embed", layout.embed, top.pop("embed", None)),
      layers=tuple(layers),
      final_norm=finish("final_norm", layout.final_norm, top.pop("final_norm", None)),
      lm_head=finish("lm_head", layout.lm_head, lm_head),
  )


# ----------------------------------------------------------------------------- Hugging Face


def read_safetensors(file: Path) -> Iterator[tuple[str, np.ndarray]]:
  """(name, array) of every tensor in a safetensors file; a truncated or corrupt file is an error
  that names it."""
  from safetensors import SafetensorError, safe_open
  try:
    # framework="flax": numpy cannot decode bfloat16, the dtype most checkpoints are stored in.
    with safe_open(str(file), framework="flax") as f:
      for key in f.keys():
        yield key, np.asarray(f.get_tensor(key))
  except SafetensorError as e:
    raise ValueError(f"{file} is truncated or corrupt ({e}). Fix: download, convert or save it "
                     f"again") from None


def config_from_file(file: Path) -> Config:
  """The Config of an HF config.json; an error names the file."""
  hf = read_json(file)
  try:
    return config_from_hf(hf)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{file}: {e}") from None


def load_hf(path: str | Path, dtype=jnp.float32) -> tuple[Config, Params]:
  """Config and params from an HF model directory with config.json and *.safetensors."""
  path = Path(path)
  _check_not_pickle(path)
  if not path.exists():
    raise FileNotFoundError(f"model directory {path} does not exist")
  if not path.is_dir():
    raise ValueError(f"{path} is neither a directory with config.json nor a .gguf file")
  config_file = path / "config.json"
  if not config_file.is_file():
    raise FileNotFoundError(f"{config_file} not found: an HF model directory needs config.json")
  cfg = config_from_file(config_file)
  index = path / "model.safetensors.index.json"
  if index.is_file():
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has no weight_map: it is not a safetensors index. Fix: restore "
                       f"the file, or delete it to load every *.safetensors in {path}")
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(p.name for p in path.glob("*.safetensors"))
  if not files:
    pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
      _check_not_pickle(path / pickles[0])
    raise FileNotFoundError(f"no *.safetensors weights in {path}")

  def tensors():
    for name in files:
      if not (path / name).is_file():
        raise FileNotFoundError(f"{path / name} listed in the index is missing")
      yield from read_safetensors(path / name)

  return cfg, assemble_params(cfg, tensors(), dtype, str(path))


# ----------------------------------------------------------------------------- GGUF


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> Config:
  arch = meta.get("general.architecture")
  if arch not in ("llama", "qwen2", "qwen3"):
    raise ValueError(f"unsupported GGUF architecture {arch!r}; jspec loads llama, qwen2 and qwen3")
  get = lambda key, default=None: meta.get(f"{arch}.{key}", default)

  def need(key: str) -> int:
    value = get(key)
    if value is None:
      raise ValueError(f"the GGUF file has no {arch}.{key}, which every {arch} model states. "
                       f"Fix: convert the model again with llama.cpp's convert_hf_to_gguf.py")
    return int(value)

  hidden = need("embedding_length")
  heads = need("attention.head_count")
  kv_heads = get("attention.head_count_kv", heads)
  if not np.isscalar(kv_heads):
    raise ValueError(f"{arch}.attention.head_count_kv gives a KV head count per layer "
                     f"({list(kv_heads)[:8]}...): jspec runs decoders whose layers all have the same "
                     f"number of KV heads")
  vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or need("vocab_size")
  head_dim = int(get("attention.key_length") or hidden // heads)
  rotated = get("rope.dimension_count")
  if rotated is not None and int(rotated) != head_dim:
    raise ValueError(f"{arch}.rope.dimension_count={rotated} rotates part of each {head_dim}-wide "
                     f"head: jspec rotates whole heads, as Llama, Qwen2 and Qwen3 do")
  # As llama.cpp reads it: a factor (or the older scale_linear key) with no type scales linearly,
  # the type "none" never scales; a factor of 0 or 1 means no scaling.
  kind = get("rope.scaling.type")
  factor = get("rope.scaling.factor", get("rope.scale_linear"))
  scaling = RopeScaling()
  if kind not in (None, "none", "linear"):
    raise ValueError(f"unsupported GGUF rope scaling {kind!r}; jspec supports none and linear "
                     f"(and Llama 3's frequency factors, rope_freqs.weight)")
  if kind == "linear" and factor is None:
    raise ValueError(f"{arch}.rope.scaling.type is linear but {arch}.rope.scaling.factor is "
                     f"missing: the file does not say how much its RoPE was stretched")
  if kind != "none" and factor is not None and float(factor) not in (0.0, 1.0):
    scaling = RopeScaling(kind="linear", factor=float(factor))
  return Config(
      arch=arch,
      vocab_size=int(vocab),
      hidden_size=hidden,
      intermediate_size=need("feed_forward_length"),
      num_layers=need("block_count"),
      num_heads=heads,
      num_kv_heads=int(kv_heads),
      head_dim=head_dim,
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
      rope_theta=float(get("rope.freq_base", 10000.0)),
      rope_scaling=scaling,
      max_position_embeddings=int(get("context_length", 4096)),
      tie_embeddings="output.weight" not in tensor_names,
      qkv_bias="blk.0.attn_q.bias" in tensor_names,
      o_bias="blk.0.attn_output.bias" in tensor_names,
      mlp_bias="blk.0.ffn_up.bias" in tensor_names,
      qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
  )


def unpermute_llama_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's interleaving of q/k rows ([out, in]) for its non-NEOX RoPE."""
  out = w.shape[0]
  rest = w.shape[1:]
  return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path | GGUFFile, dtype=jnp.float32) -> tuple[Config, Params]:
  """Config and params from a GGUF file of a llama/qwen2/qwen3 model, dequantized."""
  gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
  cfg = config_from_gguf(gguf.metadata, set(gguf.tensors))
  freq_factors = None

  def tensors():
    nonlocal freq_factors
    for name, info in gguf.tensors.items():
      if name == "rope_freqs.weight":
        freq_factors = tuple(float(x) for x in np.asarray(gguf.tensor(name)).reshape(-1))
        continue
      heads = _permuted_heads(cfg, name)
      yield gguf_to_hf_name(name, gguf.path), functools.partial(_load_gguf_tensor, gguf, name,
                                                                heads, dtype)

  params = assemble_params(cfg, tensors(), dtype, str(gguf.path))
  if freq_factors is not None:
    cfg = _with_freq_factors(cfg, freq_factors)
  return cfg, params


def gguf_to_hf_name(name: str, source) -> str:
  for pattern, repl in _GGUF_PATTERNS:
    if pattern.match(name):
      return pattern.sub(repl, name)
  raise ValueError(f"{source}: unexpected GGUF tensor {name!r}")


def _permuted_heads(cfg: Config, name: str) -> int | None:
  """Llama GGUFs store q/k rows interleaved for llama.cpp's RoPE, and their biases alike (the
  converter permutes both): the head count to undo it."""
  if cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
    return cfg.num_heads
  if cfg.arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
    return cfg.num_kv_heads
  return None


def _load_gguf_tensor(gguf: GGUFFile, name: str, heads: int | None, dtype, reshape: _Reshape,
                      cfg: Config):
  return gguf.tensor(name, layout=_gguf_layout(reshape, cfg, heads), dtype=dtype)


@functools.lru_cache(maxsize=None)
def _gguf_layout(reshape: _Reshape, cfg: Config, heads: int | None) -> Callable:
  """One function object per (reshape, config, permutation), so each jit compiles once."""
  def layout(w):
    return reshape(w if heads is None else unpermute_llama_qk(w, heads), cfg)
  return layout


def _with_freq_factors(cfg: Config, factors: tuple[float, ...]) -> Config:
  """llama.cpp divides each frequency by its factor and scales positions linearly as well where
  the file also gives a linear factor: both are kept."""
  if len(factors) != cfg.head_dim // 2:
    raise ValueError(f"rope_freqs.weight holds {len(factors)} frequency factors, but a "
                     f"{cfg.head_dim}-wide head has {cfg.head_dim // 2} frequencies")
  linear = cfg.rope_scaling.factor if cfg.rope_scaling.kind == "linear" else 1.0
  return dataclasses.replace(cfg, rope_scaling=RopeScaling(kind="factors", factor=linear,
                                                           freq_factors=factors))


def load_model(path: str | Path, dtype=jnp.float32) -> tuple[Config, Params]:
  """Dispatch on the path: a .gguf file or an HF directory."""
  path = Path(path)
  _check_not_pickle(path)
  if path.suffix == ".gguf":
    return load_gguf(path, dtype)
  return load_hf(path, dtype)
