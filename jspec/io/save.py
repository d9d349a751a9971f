"""Save a model as a Hugging Face directory: config.json, model.safetensors, tokenizer files.

The inverse of `checkpoint.load_hf`: trained drafters are written this way so that jspec
(`--drafter model:DIR`) and transformers (`assistant_model=`) load the same files.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jspec.io.tokenizer import Tokenizer
from jspec.models.config import Config, RopeScaling, rope_frequencies
from jspec.models.llama import Params, layer_list

_HF_CLASSES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
               "qwen3": ("qwen3", "Qwen3ForCausalLM")}


def llama3_scaling(cfg: Config) -> RopeScaling | None:
  """Llama 3's scaling parameters (low_freq_factor 1, as every Llama 3 has) that give the same
  frequencies as the per-frequency factors a GGUF's rope_freqs holds (llama.cpp writes Llama 3's
  ramp that way), to float32 rounding; None if no such ramp gives them. The mid-band factors
  fix the ramp: 1/f = (1 - s)/factor + s with s = (L * inv / 2pi - 1) / (high - 1)."""
  s = cfg.rope_scaling
  f = np.asarray(s.freq_factors, np.float64)
  if s.factor not in (0.0, 1.0) or f.min() < 1.0 or f.max() <= 1.0:
    return None  # a linear factor as well, or no factor above 1: not Llama 3's form
  factor = float(f.max())
  plain = rope_frequencies(dataclasses.replace(cfg, rope_scaling=RopeScaling())).astype(
      np.float64)
  smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
  mid = (smooth > 1e-6) & (smooth < 1 - 1e-6)
  candidates = [(1.0, 4.0, 8192)]  # Llama 3.1 / 3.2's own, for heads too narrow to fit a ramp
  if mid.sum() >= 2:  # smooth = a * inv / 2pi + b, b = -1 / (high - 1), a = L / (high - 1)
    a, b = np.polyfit(plain[mid] / (2 * np.pi), smooth[mid], 1)
    if b < 0:
      high = 1 - 1 / b
      candidates.insert(0, (1.0, float(f"{high:.6g}"), int(round(-a / b))))
  want = rope_frequencies(cfg)
  for low, high, length in candidates:
    guess = RopeScaling(kind="llama3", factor=float(f"{factor:.6g}"), low_freq_factor=low,
                        high_freq_factor=high, original_max_position=length)
    got = rope_frequencies(dataclasses.replace(cfg, rope_scaling=guess))
    if high > low and length > 0 and np.allclose(got, want, rtol=1e-6, atol=0):
      return guess
  return None


def config_to_hf(cfg: Config, tokenizer: Tokenizer | None = None,
                 dtype: str = "float32") -> dict[str, Any]:
  """The config.json dict transformers (and `config_from_hf`) read back into `cfg`; a GGUF's
  per-frequency RoPE factors as the Llama 3 parameters that give them (`llama3_scaling`)."""
  model_type, cls = _HF_CLASSES[cfg.arch]
  scaling = cfg.rope_scaling
  if scaling.kind == "factors" and (llama3 := llama3_scaling(cfg)) is not None:
    scaling = llama3
  if scaling.kind == "none":
    rope_scaling = None
  elif scaling.kind == "linear":
    rope_scaling = {"rope_type": "linear", "factor": scaling.factor}
  elif scaling.kind == "llama3":
    rope_scaling = {"rope_type": "llama3", "factor": scaling.factor,
                    "low_freq_factor": scaling.low_freq_factor,
                    "high_freq_factor": scaling.high_freq_factor,
                    "original_max_position_embeddings": scaling.original_max_position}
  else:
    raise ValueError(f"RoPE scaling {scaling.kind!r} has no config.json form: these per-frequency "
                     f"factors (rope_freqs.weight) are not Llama 3's ramp, which config.json "
                     f"can state")
  if cfg.qkv_bias != cfg.o_bias and cfg.arch != "qwen2":
    raise ValueError("config.json has one attention_bias flag for q/k/v and o; this model has "
                     f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias}")
  hf = {
      "architectures": [cls], "model_type": model_type, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
      "rope_scaling": rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "torch_dtype": dtype,
  }
  if cfg.arch != "qwen2":  # qwen2's q/k/v biases are implied by its architecture
    hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
  if tokenizer is not None:
    hf.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
  return hf


def params_to_hf(cfg: Config, params: Params) -> dict[str, np.ndarray]:
  """HF tensor names → arrays in the torch [out, in] layout (float32 or the params' dtype)."""
  E = cfg.hidden_size
  arr = lambda x: np.asarray(x)
  out = {"model.embed_tokens.weight": arr(params.embed), "model.norm.weight": arr(params.final_norm)}
  if params.lm_head is not None:
    out["lm_head.weight"] = arr(params.lm_head).T
  for i, lp in enumerate(layer_list(params)):
    pre = f"model.layers.{i}."
    names = {
        "input_layernorm.weight": lp.attn_norm, "post_attention_layernorm.weight": lp.mlp_norm,
        "self_attn.q_proj.weight": arr(lp.wq).reshape(E, -1).T,
        "self_attn.k_proj.weight": arr(lp.wk).reshape(E, -1).T,
        "self_attn.v_proj.weight": arr(lp.wv).reshape(E, -1).T,
        "self_attn.o_proj.weight": arr(lp.wo).reshape(-1, E).T,
        "self_attn.q_proj.bias": lp.bq, "self_attn.k_proj.bias": lp.bk,
        "self_attn.v_proj.bias": lp.bv, "self_attn.o_proj.bias": lp.bo,
        "self_attn.q_norm.weight": lp.q_norm, "self_attn.k_norm.weight": lp.k_norm,
        "mlp.gate_proj.weight": arr(lp.w_gate).T, "mlp.up_proj.weight": arr(lp.w_up).T,
        "mlp.down_proj.weight": arr(lp.w_down).T, "mlp.gate_proj.bias": lp.b_gate,
        "mlp.up_proj.bias": lp.b_up, "mlp.down_proj.bias": lp.b_down,
    }
    for name, value in names.items():
      if value is not None:
        out[pre + name] = arr(value).reshape(-1) if name.endswith("bias") else arr(value)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_tokenizer(path: Path, tokenizer: Tokenizer) -> None:
  """tokenizer.json plus the config that `Tokenizer.from_hf_dir` and transformers read."""
  tokenizer.backend.save(str(path / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tokenizer.add_bos,
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "model_max_length": 1 << 30}
  if tokenizer.chat_template:
    config["chat_template"] = tokenizer.chat_template
  (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
  generation = {"bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": list(tokenizer.stop_token_ids) or tokenizer.eos_token_id}
  (path / "generation_config.json").write_text(json.dumps(generation, indent=2))


def save_hf(path: str | Path, cfg: Config, params: Params, tokenizer: Tokenizer | None = None,
            metadata: dict[str, Any] | None = None) -> Path:
  """Write `params` as an HF directory (created if needed); `metadata` goes to jspec.json."""
  import safetensors.numpy

  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = params_to_hf(cfg, params)
  dtype = str(tensors["model.embed_tokens.weight"].dtype) if "model.embed_tokens.weight" in (
      tensors) else "float32"
  (path / "config.json").write_text(json.dumps(config_to_hf(cfg, tokenizer, dtype), indent=2))
  safetensors.numpy.save_file(tensors, str(path / "model.safetensors"),
                              metadata={"format": "pt"})
  if tokenizer is not None:
    save_tokenizer(path, tokenizer)
  if metadata is not None:
    (path / "jspec.json").write_text(json.dumps(metadata, indent=2, default=str) + "\n")
  return path
