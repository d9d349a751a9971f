"""The GGUF test writer matches llama.cpp's conventions: transformers, which reads GGUF the way
llama.cpp writes it (un-permuting llama q/k), loads its files into the original model."""

import json

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ggufutil  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# Max abs logit error against the float32 original; logits here span about +-1.
TOL = {"F32": 1e-4, "F16": 3e-3, "Q8_0": 5e-2}


def _logits(model, ids):
  with torch.no_grad():
    return model(torch.as_tensor(ids)).logits.numpy()


def _reference(tmp_path, arch, **overrides):
  """The HF checkpoint, and its float32 logits on random tokens."""
  d, config, sd = ggufutil.tiny_hf_checkpoint(tmp_path / "hf", arch, **overrides)
  ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
  ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 40))
  return d, config, sd, ids, _logits(ref, ids)


def _load_gguf(path, **kw):
  # The GGUF sits alone in its directory, as in a GGUF repo: next to HF files, transformers mixes
  # their tokenizer_config.json in and the GGUF's special tokens get lost.
  return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kw).eval()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_transformers_loads_gguf(tmp_path, arch, tied):
  _, config, sd, ids, want = _reference(tmp_path, arch, tie_word_embeddings=tied)
  assert ("lm_head.weight" in sd) != tied
  for quant in ("F32", "F16", "Q8_0"):
    path = ggufutil.write_gguf(tmp_path / "gguf" / f"{quant}.gguf", config, sd, arch, quant=quant)
    model = _load_gguf(path)
    assert model.dtype == torch.float32  # the legacy loader dequantizes everything to float32
    assert model.config.tie_word_embeddings == tied
    err = np.abs(_logits(model, ids) - want).max()
    assert err < TOL[quant], (quant, err)


def test_gguf_layout(tmp_path):
  _, config, sd = ggufutil.tiny_hf_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
  r = gguf.GGUFReader(ggufutil.write_gguf(tmp_path / "m.gguf", config, sd, "qwen3", quant="Q8_0"))
  field = lambda k: r.fields[k].contents()  # noqa: E731
  assert field("general.architecture") == "qwen3"
  assert (field("qwen3.block_count"), field("qwen3.embedding_length")) == (2, 64)
  assert (field("qwen3.attention.head_count"), field("qwen3.attention.head_count_kv")) == (4, 2)
  assert field("qwen3.attention.key_length") == field("qwen3.rope.dimension_count") == 128
  assert field("qwen3.vocab_size") == 256
  types = {t.name: t.tensor_type for t in r.tensors}
  assert "output.weight" not in types
  assert types["token_embd.weight"] == types["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
  assert types["blk.0.attn_k_norm.weight"] == types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
  assert len(types) == 2 + 11 * 2


def test_llama_permutation_matters(tmp_path, monkeypatch):
  _, config, sd, ids, want = _reference(tmp_path, "llama")
  monkeypatch.setattr(ggufutil, "permute", lambda w, n_head: w)
  path = ggufutil.write_gguf(tmp_path / "gguf" / "m.gguf", config, sd, "llama")
  assert np.abs(_logits(_load_gguf(path), ids) - want).max() > 1e-3


def test_llama3_rope_freqs(tmp_path):
  d, config, sd, ids, want = _reference(tmp_path, "llama", rope_parameters=LLAMA3_ROPE)
  path = ggufutil.write_gguf(tmp_path / "gguf" / "m.gguf", config, sd, "llama")
  factors = next(t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight").data
  # llama.cpp divides each rope frequency by its factor: the ratio of HF's plain to scaled inv_freq
  ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
  plain = 1.0 / (10000.0 ** (np.arange(0, 16, 2, dtype=np.float32) / 16))
  np.testing.assert_allclose(factors, plain / ref.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
  assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
  # transformers ignores rope_freqs and builds the config without scaling, so give it HF's config
  cfg = transformers.AutoConfig.from_pretrained(d)
  assert np.abs(_logits(_load_gguf(path, config=cfg), ids) - want).max() < TOL["F32"]
  assert np.abs(_logits(_load_gguf(path), ids) - want).max() > 1e-3


def test_a_llama3_gguf_saves_as_a_config_transformers_runs(tmp_path):
  """rope_freqs (per-frequency factors) had no config.json form: saving a Llama 3 GGUF model, or
  a drafter made for one (which takes the target's RoPE), failed, train-drafter only after its
  whole run. Saved, they are the Llama 3 parameters, and transformers gives the original logits."""
  from jspec.io.checkpoint import load_gguf
  from jspec.io.save import save_hf
  _, config, sd, ids, want = _reference(tmp_path, "llama", rope_parameters=LLAMA3_ROPE)
  path = ggufutil.write_gguf(tmp_path / "gguf" / "m.gguf", config, sd, "llama")
  cfg, params = load_gguf(path)
  assert cfg.rope_scaling.kind == "factors"
  saved = save_hf(tmp_path / "saved", cfg, params)
  written = json.loads((saved / "config.json").read_text())["rope_scaling"]
  assert {k: written[k] for k in LLAMA3_ROPE if k != "rope_theta"} == {
      k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
  model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
  assert np.abs(_logits(model, ids) - want).max() < TOL["F32"]


def test_factors_no_llama3_ramp_gives_are_refused_on_save():
  import dataclasses
  from jspec.io.save import config_to_hf
  from jspec.models.config import Config, RopeScaling
  cfg = Config(arch="llama", vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1,
               num_heads=2, num_kv_heads=2, head_dim=16)
  odd = dataclasses.replace(cfg, rope_scaling=RopeScaling(
      kind="factors", freq_factors=(1.0, 3.0, 1.5, 8.0, 2.0, 8.0, 8.0, 8.0)))  # no ramp
  with pytest.raises(ValueError, match="not Llama 3's ramp"):
    config_to_hf(odd)


@pytest.mark.parametrize("vocab_size", [128, 256, 320])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tokenizer_metadata(tmp_path, arch, vocab_size):
  from tokenizers import Tokenizer

  d, config, sd = ggufutil.tiny_hf_checkpoint(tmp_path / "hf", arch, vocab_size=vocab_size)
  ggufutil.make_tiny_tokenizer_dir(d, vocab_size)
  path = ggufutil.write_gguf(tmp_path / "gguf" / "m.gguf", config, sd, arch, tokenizer_dir=str(d))
  ref = Tokenizer.from_file(str(d / "tokenizer.json"))
  assert ref.get_vocab_size() == vocab_size
  tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  assert len(tok) == vocab_size
  assert (tok.bos_token, tok.eos_token_id, tok.pad_token_id) == ("<|endoftext|>", 0, 0)
  for text in ["Hello world!  123 4567\n\n  it's", "def add(a, b):\n\treturn a + b", "<|im_start|>user\nhi<|im_end|>"]:
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text).ids, text
  msgs = [{"role": "user", "content": "hi"}]
  assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  r = gguf.GGUFReader(path)
  assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
  assert r.fields["tokenizer.ggml.token_type"].contents()[:4] == [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL]
  assert _load_gguf(path).config.vocab_size == vocab_size
