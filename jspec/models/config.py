"""Model configuration: one frozen, hashable dataclass for every Llama-family decoder we run."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF `model_type` / `architectures[0]` → our architecture name.
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_ARCH_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling. kind: "none", "linear", "llama3" (Llama 3.1/3.2) or "factors"
  (per-frequency divisors, as llama.cpp stores llama3 scaling in GGUF's rope_freqs tensor, each
  frequency also divided by `factor` where the GGUF gives a linear one too)."""

  kind: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192
  freq_factors: tuple[float, ...] | None = None


ATTENTION_IMPLS = ("xla", "pallas", "pallas-interpret")


def is_int(value) -> bool:
  """An integer (Python or NumPy), not a bool and not a float that happens to be whole: what a
  static size must be (2.0 would reach an array shape)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


# The sizes a Config is made of: positive integers (an array shape each).
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "max_position_embeddings", "kv_repeats")


@dataclasses.dataclass(frozen=True)
class Config:
  """Static description of a decoder; passed to jitted functions as a static argument."""

  arch: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  max_position_embeddings: int = 4096
  tie_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2, some Llamas (attention_bias)
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
  # How attention runs (not a property of the checkpoint): "xla" (jnp), "pallas" (the tree
  # attention kernel, GPU/TPU) or "pallas-interpret" (that kernel interpreted: CPU tests).
  attention_impl: str = "xla"
  # Each KV head stored this many times in a row (llama.repeat_kv_heads: tensor parallelism over
  # more devices than KV heads); num_kv_heads counts the copies.
  kv_repeats: int = 1

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"unsupported architecture {self.arch!r}; jspec runs {ARCHITECTURES}")
    for name in _SIZES:
      value = getattr(self, name)
      if not is_int(value) or value < 1:
        raise ValueError(f"Config {name} must be a positive integer, got {value!r}")
      object.__setattr__(self, name, int(value))  # a NumPy integer (GGUF metadata) hashes apart
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got "
                       f"{self.attention_impl!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")


def _hf_arch(hf: dict[str, Any]) -> str:
  model_type = hf.get("model_type")
  if model_type in _HF_MODEL_TYPES:
    return _HF_MODEL_TYPES[model_type]
  # transformers builds the model its model_type names (mistral's sliding window, ...), whatever
  # class `architectures` lists: a model_type of another family is that family.
  for cls in (hf.get("architectures") or ()) if model_type is None else ():
    if cls in _HF_ARCH_CLASSES:
      return _HF_ARCH_CLASSES[cls]
  raise ValueError(
      f"unsupported architecture: model_type={model_type!r}, architectures="
      f"{hf.get('architectures')!r}. jspec runs Llama 2/3, Qwen2 and Qwen3 decoders "
      f"({', '.join(_HF_ARCH_CLASSES)}).")


def rope_scaling_from_hf(scaling: dict[str, Any] | None) -> RopeScaling:
  if not scaling:
    return RopeScaling()
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return RopeScaling()
  fields = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")}.get(kind, ())
  missing = [f for f in fields if scaling.get(f) is None]
  if missing:
    raise ValueError(f"rope_scaling of type {kind!r} lacks {', '.join(missing)} (config.json: "
                     f"{scaling}). Fix: the checkpoint's config.json as its model was trained.")
  if kind == "linear":
    return RopeScaling(kind="linear", factor=float(scaling["factor"]))
  if kind == "llama3":
    return RopeScaling(
        kind="llama3", factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position=int(scaling["original_max_position_embeddings"]))
  raise ValueError(f"unsupported rope_scaling type {kind!r}; jspec supports default, linear, llama3")


def _required_int(hf: dict[str, Any], key: str) -> int:
  """A positive integer field of config.json that every decoder has."""
  value = hf.get(key)
  if value is None:
    raise ValueError(f"{key!r} is missing, which every decoder config gives")
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{key!r} must be a positive integer, got {value!r}")
  return value


def _sliding_layers(hf: dict[str, Any], arch: str) -> list[int]:
  """The layers transformers builds with sliding-window attention (Qwen2/3's rule; its Llama
  has no sliding window and ignores such keys)."""
  if arch == "llama":
    return []
  layer_types = hf.get("layer_types")
  if layer_types is None:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
      return []
    first = hf.get("max_window_layers", 28)  # transformers' default
    return list(range(first, hf.get("num_hidden_layers") or 0))
  return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]


def config_from_hf(hf: dict[str, Any]) -> Config:
  """Config from a Hugging Face `config.json` dictionary."""
  arch = _hf_arch(hf)
  sliding = _sliding_layers(hf, arch)
  if sliding:
    raise ValueError(
        f"sliding-window attention (layers {sliding[0]}..{sliding[-1]} of "
        f"{hf.get('num_hidden_layers')} attend to a window of {hf.get('sliding_window')} tokens) "
        f"is not supported: jspec attends over the whole cache. Fix: a checkpoint whose config "
        f"has use_sliding_window=false (or max_window_layers >= num_hidden_layers)")
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):  # the MLP's gate is SiLU in every decoder jspec runs
    raise ValueError(f"hidden_act={act!r} is not supported: jspec's decoders gate their MLP with "
                     f"SiLU (hidden_act 'silu'), as Llama, Qwen2 and Qwen3 do")
  if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError(f"partial_rotary_factor={hf['partial_rotary_factor']} (RoPE on part of each "
                     f"head) is not supported: jspec rotates whole heads, as Llama, Qwen2 and "
                     f"Qwen3 do")
  num_heads = _required_int(hf, "num_attention_heads")
  hidden = _required_int(hf, "hidden_size")
  # Qwen2/3 checkpoints carry rope_theta at the top level; newer transformers nests it in
  # rope_parameters together with the scaling.
  rope = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
  # Qwen2's q/k/v projections always have biases (transformers ignores attention_bias there);
  # Llama's and Qwen3's follow attention_bias, and so does their output projection.
  bias = arch == "qwen2" or bool(hf.get("attention_bias", False))
  return Config(
      arch=arch,
      vocab_size=_required_int(hf, "vocab_size"),
      hidden_size=hidden,
      intermediate_size=_required_int(hf, "intermediate_size"),
      num_layers=_required_int(hf, "num_hidden_layers"),
      num_heads=num_heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
      # Qwen3Config's head_dim defaults to 128 (not hidden / heads, as Llama's and Qwen2's do).
      head_dim=int(hf.get("head_dim") or (128 if arch == "qwen3" else hidden // num_heads)),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      # Both given (a config edited into the newer layout): transformers 5 reads the nested one.
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      rope_scaling=rope_scaling_from_hf(scaling),
      # Absent: each transformers config class's own default (the length check reads it).
      max_position_embeddings=int(hf.get("max_position_embeddings")
                                  or (2048 if arch == "llama" else 32768)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=bias,
      o_bias=bias and arch in ("llama", "qwen3"),
      mlp_bias=arch == "llama" and bool(hf.get("mlp_bias", False)),  # Qwen's MLPs have none
      qk_norm=arch == "qwen3",
  )


def rope_frequencies(cfg: Config) -> np.ndarray:
  """Inverse frequencies [head_dim // 2] after the configured scaling (host-side constants)."""
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  s = cfg.rope_scaling
  if s.kind == "linear":
    inv = inv / s.factor
  elif s.kind == "llama3":
    # Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    inv = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
  elif s.kind == "factors":
    inv = inv / np.asarray(s.freq_factors, np.float64) / s.factor
  return inv.astype(np.float32)
