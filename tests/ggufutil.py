"""Test helper: tiny Hugging Face checkpoints, and GGUF files written from them as llama.cpp's
convert_hf_to_gguf.py writes them (metadata keys, tensor names, llama q/k permutation, rope_freqs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
QUANTS = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's LlamaModel.permute: HF's rotate-half row order to the original interleaved one."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_params(hf_config: dict) -> dict:
  """The rope dict of a config, whether written as transformers 5's `rope_parameters` or the
  older top-level `rope_theta` plus `rope_scaling`."""
  rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
  rope.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
  if "type" in rope:
    rope.setdefault("rope_type", rope["type"])
  return rope


def llama3_rope_factors(hf_config: dict, head_dim: int) -> np.ndarray | None:
  """llama.cpp's `rope_freqs.weight` for llama3 rope scaling: per-frequency divisors of theta."""
  rope = rope_params(hf_config)
  if str(rope.get("rope_type", "")).lower() != "llama3":
    return None
  freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  factor = rope.get("factor", 8.0)
  low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
  # llama.cpp looks for original_max_position_embeddings at the config's top level, where HF Llama
  # configs lack it, so it uses 8192; HF uses the rope dict's value (8192 too for real Llama 3).
  old_ctx = rope.get("original_max_position_embeddings", hf_config.get("original_max_position_embeddings", 8192))
  factors = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < old_ctx / high:
      factors.append(1.0)
    elif wavelen > old_ctx / low:
      factors.append(factor)
    else:
      smooth = (old_ctx / wavelen - low) / (high - low)
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(factors, dtype=np.float32)


def _encode(w: np.ndarray, quant: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
  """A tensor as llama.cpp stores it: 1-D tensors (norms, biases) in F32, 2-D weights in `quant`."""
  w = np.ascontiguousarray(w, dtype=np.float32)
  qtype = QUANTS[quant][0]
  if w.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32:
    return w, None
  if qtype == gguf.GGMLQuantizationType.F16:
    return w.astype(np.float16), None
  try:
    return gguf.quants.quantize(w, qtype), qtype
  except gguf.QuantError:  # rows not a multiple of the block size: llama.cpp falls back to F16
    return w.astype(np.float16), None


def write_gguf(path, hf_config: dict, state_dict: dict[str, np.ndarray], arch: str,
               tokenizer_dir: str | None = None, quant: str = "F32") -> Path:
  """Write `state_dict` (HF names) as a GGUF of `arch` at `path`, the way llama.cpp converts it."""
  if arch not in ARCHS:
    raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
  if quant not in QUANTS:
    raise ValueError(f"quant must be one of {sorted(QUANTS)}, got {quant!r}")
  c = hf_config
  n_layer, n_head = c["num_hidden_layers"], c["num_attention_heads"]
  n_head_kv = c.get("num_key_value_heads") or n_head
  head_dim = c.get("head_dim") or c["hidden_size"] // n_head
  rope = rope_params(c)

  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_name(f"tiny-{arch}")
  w.add_block_count(n_layer)
  w.add_context_length(c["max_position_embeddings"])
  w.add_embedding_length(c["hidden_size"])
  w.add_feed_forward_length(c["intermediate_size"])
  w.add_head_count(n_head)
  w.add_head_count_kv(n_head_kv)
  w.add_rope_freq_base(float(rope["rope_theta"]))
  w.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
  if c.get("head_dim") is not None:  # llama.cpp writes these whenever the config names head_dim
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
  w.add_rope_dimension_count(head_dim)
  w.add_vocab_size(c["vocab_size"])
  w.add_file_type(QUANTS[quant][1])
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  if tokenizer_dir is not None:
    _add_tokenizer(w, tokenizer_dir, c["vocab_size"])

  if (factors := llama3_rope_factors(c, head_dim)) is not None:
    w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
  tied = c.get("tie_word_embeddings", False)
  names = gguf.get_tensor_name_map(ARCHS[arch], n_layer)
  for hf_name, t in state_dict.items():
    if hf_name == "lm_head.weight" and tied:
      continue
    if arch == "llama":  # undo HF's q/k row order so llama.cpp's interleaved rope applies
      if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        t = permute(t, n_head)
      elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        t = permute(t, n_head_kv)
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
      raise ValueError(f"no GGUF name for tensor {hf_name!r} of arch {arch}")
    data, raw_dtype = _encode(t, quant)
    w.add_tensor(name, data, raw_dtype=raw_dtype)

  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _add_tokenizer(w: gguf.GGUFWriter, tokenizer_dir, vocab_size: int) -> None:
  """gpt2-style (byte-level BPE) tokenizer metadata, as llama.cpp's _set_vocab_gpt2 writes it."""
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
  by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
  added = tok.get_added_tokens_decoder()
  if max(by_id) >= vocab_size:
    raise ValueError(f"tokenizer has ids up to {max(by_id)}, model vocab is {vocab_size}")
  tokens, types = [], []
  for i in range(vocab_size):  # llama.cpp pads holes in the vocabulary up to the model's size
    if i not in by_id:
      tokens.append(f"[PAD{i}]")
      types.append(gguf.TokenType.UNUSED)
    else:
      tokens.append(by_id[i])
      types.append(gguf.TokenType.NORMAL if i not in added else
                   gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
  w.add_tokenizer_model("gpt2")
  # llama.cpp names the pre-tokenizer by hashing a test string's encoding; "default" is its GPT-2
  # regex, the one transformers' GPT2Tokenizer also uses, and our tiny tokenizers' ByteLevel split.
  w.add_tokenizer_pre("default")
  w.add_token_list(tokens)
  w.add_token_types(types)
  # merges, bos/eos/unk/pad ids, add_bos_token and chat template, read as llama.cpp reads them
  gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(w, quiet=True)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = """The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens with
a small model and verifies them with a large one in a single forward pass, so the output matches the
large model exactly while it runs fewer sequential steps. A key-value cache stores the attention keys
and values of every previous position; compressing it trades a little accuracy for memory.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))
Write a short poem about the sea. Explain why the sky is blue. What is 12 + 30? Answer: 42.
"""


def make_tiny_tokenizer_dir(dir, vocab_size: int = 256, chat_template: str | None = CHATML) -> Path:
  """Save a byte-level BPE tokenizer with exactly `vocab_size` ids to `dir`, HF-style.

  Ids 0-2 are <|endoftext|> (bos, eos, pad), <|im_start|>, <|im_end|>. With fewer than 256 + 3 + 1
  ids the base alphabet is printable ASCII plus newline and tab, so other characters are dropped.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  byte_chars = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < 256 + len(SPECIALS) + 1:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    spell = bytes_to_unicode()
    byte_chars = [spell[b] for b in [9, 10, *range(32, 127)]]
  if vocab_size <= len(SPECIALS) + len(byte_chars):
    raise ValueError(f"vocab_size {vocab_size} leaves no room for merges")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                initial_alphabet=byte_chars, limit_alphabet=len(byte_chars),
                                show_progress=False)
  # Numbered words give the trainer a new merge each, enough to fill any vocabulary size.
  corpus = [_CORPUS] + [f"{w}{i}" for i in range(vocab_size) for w in ("token", "layer")]
  tok.train_from_iterator(corpus, trainer)
  if tok.get_vocab_size() != vocab_size:
    raise ValueError(f"trained {tok.get_vocab_size()} ids, wanted {vocab_size}")
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[0],
                                 pad_token=SPECIALS[0], additional_special_tokens=list(SPECIALS[1:]))
  if chat_template:
    fast.chat_template = chat_template
  fast.save_pretrained(dir)
  return Path(dir)


def tiny_hf_checkpoint(tmpdir, arch: str, **overrides) -> tuple[Path, dict, dict[str, np.ndarray]]:
  """A seeded random float32 model of `arch` saved as an HF safetensors dir, with its config dict
  and numpy state dict (HF names, as saved: no lm_head when tied).

  Overrides go to the config class; `seed` seeds the weights. llama3 rope scaling, e.g.:
  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor":
  1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}.
  """
  import safetensors.numpy
  import torch
  import transformers

  seed = overrides.pop("seed", 0)
  kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
  if arch == "llama":
    cls = transformers.LlamaConfig
  elif arch == "qwen2":
    cls = transformers.Qwen2Config  # q/k/v biases are built in
  elif arch == "qwen3":
    # Qwen3's head_dim is independent of hidden/heads; 128 is every real Qwen3's and the only one
    # transformers' GGUF loader can use, since it ignores qwen3.attention.key_length.
    cls, kwargs["head_dim"] = transformers.Qwen3Config, 128
  else:
    raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
  config = cls(**{**kwargs, **overrides})
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  with torch.no_grad():  # default init leaves norms at 1 and biases at 0; randomize them so they count
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  out = Path(tmpdir)
  model.save_pretrained(out, safe_serialization=True)
  state_dict = safetensors.numpy.load_file(out / "model.safetensors")
  return out, json.loads((out / "config.json").read_text()), state_dict
