"""Bad checkpoints are refused with clear errors: unknown architecture, missing files, pickles."""

import json

import numpy as np
import pytest

from jspec.io.checkpoint import load_gguf, load_hf, load_model
from jspec.models.config import Config, config_from_hf


def write_config(directory, **extra):
  """A minimal valid Llama config.json."""
  (directory / "config.json").write_text(json.dumps({
      "model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, **extra}))


def test_unknown_architecture():
  with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
    config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
  with pytest.raises(ValueError, match="unsupported architecture"):
    Config(arch="mamba", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
           num_heads=1, num_kv_heads=1, head_dim=8)


@pytest.mark.parametrize("size", ["vocab_size", "num_layers", "head_dim", "num_kv_heads"])
def test_config_sizes_are_positive_integers(size):
  sizes = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
               num_kv_heads=1, head_dim=4)
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match=f"Config {size} must be a positive integer, got {bad}"):
      Config(arch="llama", **{**sizes, size: bad})
  import numpy as np
  assert Config(arch="llama", **{**sizes, size: np.int64(sizes[size])}) == Config(arch="llama",
                                                                                  **sizes)


def test_unsupported_rope_scaling():
  hf = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn",
                                                                          "factor": 4.0}}
  with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
    config_from_hf(hf)


def test_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_model(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(tmp_path)
  write_config(tmp_path)
  with pytest.raises(FileNotFoundError, match="safetensors"):
    load_hf(tmp_path)
  with pytest.raises(FileNotFoundError, match="GGUF file"):
    load_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickle_checkpoints_refused(tmp_path, name):
  path = tmp_path / name
  path.write_bytes(b"\x80\x04not really a pickle")
  with pytest.raises(ValueError, match="never unpickles"):
    load_model(path)
  # A directory holding only a pickle checkpoint is refused the same way.
  write_config(tmp_path)
  with pytest.raises(ValueError, match="never unpickles"):
    load_model(tmp_path)


def test_missing_tensor_is_named(tmp_path):
  import numpy as np
  from safetensors.numpy import save_file
  write_config(tmp_path, tie_word_embeddings=True)
  save_file({"model.embed_tokens.weight": np.zeros((9, 8), np.float32)},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="missing tensor for 'layers.0.attn_norm'"):
    load_hf(tmp_path)


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.0.input_layernorm.weight"])
def test_a_tensor_in_two_shards_is_refused(tmp_path, name):
  """Without an index every *.safetensors is read: a stale copy beside the model gave its
  tensors silently (whichever file sorted last won)."""
  import numpy as np
  from safetensors.numpy import save_file
  write_config(tmp_path, tie_word_embeddings=True)
  save_file({"model.embed_tokens.weight": np.zeros((8, 8), np.float32)},
            str(tmp_path / "model.safetensors"))
  save_file({name: np.ones(8, np.float32)}, str(tmp_path / "a.safetensors"))
  save_file({name: np.full(8, 7.0, np.float32)}, str(tmp_path / "b.safetensors"))
  with pytest.raises(ValueError, match=f"tensor '{name}'.*is given twice"):
    load_hf(tmp_path)


def test_truncated_safetensors_is_named(tmp_path):
  import numpy as np
  from safetensors.numpy import save_file
  write_config(tmp_path, tie_word_embeddings=True)
  file = tmp_path / "model.safetensors"
  save_file({"model.embed_tokens.weight": np.zeros((8, 8), np.float32)}, str(file))
  file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
  with pytest.raises(ValueError, match=r"model\.safetensors is truncated or corrupt.*Fix"):
    load_hf(tmp_path)


@pytest.mark.parametrize("text, message", [
    ("{not json", r"config\.json is not valid JSON"),
    ("[1, 2]", r"config\.json holds a JSON list"),
    (json.dumps({"model_type": "llama", "vocab_size": 8, "intermediate_size": 8,
                 "num_hidden_layers": 1, "num_attention_heads": 2}),
     r"config\.json: 'hidden_size' is missing"),
    (json.dumps({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                 "intermediate_size": 8, "num_hidden_layers": "two",
                 "num_attention_heads": 2}),
     r"config\.json: 'num_hidden_layers' must be a positive integer, got 'two'"),
])
def test_bad_config_json_names_the_file_and_field(tmp_path, text, message):
  (tmp_path / "config.json").write_text(text)
  with pytest.raises(ValueError, match=message):
    load_hf(tmp_path)


def test_corrupt_tokenizer_json_is_named(tmp_path):
  from jspec.io.tokenizer import Tokenizer
  (tmp_path / "tokenizer.json").write_text("{")
  with pytest.raises(ValueError, match=r"tokenizer\.json is not a valid tokenizer\.json"):
    Tokenizer.from_hf_dir(tmp_path)
  import tokenizers
  tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
      str(tmp_path / "tokenizer.json"))
  Tokenizer.from_hf_dir(tmp_path)  # a valid file loads
  (tmp_path / "tokenizer_config.json").write_text("{oops")
  with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
    Tokenizer.from_hf_dir(tmp_path)


BASE_HF = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize("extra, message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported.*SiLU"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5.*rotates whole heads"),
    (dict(model_type="mistral", architectures=["LlamaForCausalLM"]),
     "unsupported architecture: model_type='mistral'"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling of type 'linear' lacks factor"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "lacks low_freq_factor, high_freq_factor, original_max_position_embeddings"),
])
def test_configs_that_loaded_as_something_else_are_refused(extra, message):
  """Each loaded before and computed another model than transformers builds from it (a GELU MLP,
  RoPE on part of the head, Mistral as Llama), or failed with a bare KeyError / TypeError."""
  with pytest.raises(ValueError, match=message):
    config_from_hf({**BASE_HF, **extra})


def test_attention_biases_follow_transformers():
  """Qwen2's q/k/v always have biases (attention_bias is ignored there); Qwen3's attention_bias
  puts one on its output projection too, as Llama's does."""
  qwen2 = config_from_hf({**BASE_HF, "model_type": "qwen2", "attention_bias": False})
  assert qwen2.qkv_bias and not qwen2.o_bias
  qwen3 = config_from_hf({**BASE_HF, "model_type": "qwen3", "attention_bias": True})
  assert qwen3.qkv_bias and qwen3.o_bias
  assert not config_from_hf({**BASE_HF, "model_type": "qwen3"}).qkv_bias


def test_config_keys_read_as_transformers_reads_them():
  """A top-level rope_theta beside rope_parameters' won (transformers 5 reads the nested one:
  other logits, silently); Qwen2's mlp_bias made jspec demand MLP biases Qwen2MLP never has;
  Qwen3 without head_dim took hidden / heads where Qwen3Config defaults to 128."""
  both = config_from_hf({**BASE_HF, "rope_theta": 500000.0,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
  assert both.rope_theta == 10000.0
  assert config_from_hf({**BASE_HF, "rope_theta": 500000.0}).rope_theta == 500000.0
  for arch in ("qwen2", "qwen3"):
    assert not config_from_hf({**BASE_HF, "model_type": arch, "mlp_bias": True}).mlp_bias
  assert config_from_hf({**BASE_HF, "mlp_bias": True}).mlp_bias  # Llama's MLP has them
  assert config_from_hf({**BASE_HF, "model_type": "qwen3"}).head_dim == 128
  assert config_from_hf({**BASE_HF, "model_type": "qwen2"}).head_dim == 4


def test_absent_position_limit_is_the_config_class_default():
  """A config without max_position_embeddings got 4096 for every architecture: Llama's limit is
  2048 and Qwen's 32768 in transformers, and the prompt-length check reads it."""
  transformers = pytest.importorskip("transformers")
  classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
             "qwen3": transformers.Qwen3Config}
  for arch, cls in classes.items():
    hf = {k: v for k, v in {**BASE_HF, "model_type": arch}.items()
          if k != "max_position_embeddings"}
    assert config_from_hf(hf).max_position_embeddings == cls().max_position_embeddings, arch


def test_projections_that_do_not_fit_the_heads_name_the_tensor():
  """A q/k/v/o weight split by another head count failed in numpy's reshape, naming nothing."""
  from jspec.io.checkpoint import assemble_params
  cfg = config_from_hf({**BASE_HF, "num_key_value_heads": 1})
  k = np.zeros((8, 8), np.float32)  # two KV heads' rows: the config says one
  with pytest.raises(ValueError, match=r"src: tensor 'model.layers.0.self_attn.k_proj.weight' "
                                       r"does not fit the config.*1 KV heads.*Fix"):
    assemble_params(cfg, [("model.layers.0.self_attn.k_proj.weight", k)], np.float32, "src")


QWEN = {**BASE_HF, "model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 16}


@pytest.mark.parametrize("extra, sliding", [
    ({}, False),  # use_sliding_window defaults to false: the window is never used
    (dict(use_sliding_window=True, max_window_layers=4), False),  # no layer at or past 4
    (dict(use_sliding_window=True, max_window_layers=2), True),  # layers 2 and 3 slide
    (dict(use_sliding_window=True, num_hidden_layers=30), True),  # transformers' default: 28
    (dict(layer_types=["full_attention"] * 3 + ["sliding_attention"]), True),
    (dict(use_sliding_window=True, layer_types=["full_attention"] * 4), False),
])
def test_sliding_window_refused_where_transformers_slides(extra, sliding):
  """transformers builds sliding-window layers from layer_types, or from use_sliding_window and
  max_window_layers; a Qwen config whose layers all attend fully loads (it was refused)."""
  hf = {**QWEN, **extra}
  if sliding:
    with pytest.raises(ValueError, match="sliding-window attention .* not supported"):
      config_from_hf(hf)
  else:
    assert config_from_hf(hf).num_layers == hf["num_hidden_layers"]


def gguf_meta(**extra):
  return {"general.architecture": "llama", "llama.embedding_length": 8,
          "llama.attention.head_count": 2, "llama.feed_forward_length": 8, "llama.block_count": 1,
          "llama.vocab_size": 8, **{f"llama.{k}": v for k, v in extra.items()}}


@pytest.mark.parametrize("extra, kind, factor", [
    ({}, "none", 1.0),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, "linear", 4.0),
    ({"rope.scaling.factor": 4.0}, "linear", 4.0),  # no type: llama.cpp scales linearly
    ({"rope.scale_linear": 2.0}, "linear", 2.0),  # the older key
    ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, "none", 1.0),  # none never scales
    ({"rope.scaling.factor": 1.0}, "none", 1.0),
])
def test_gguf_rope_scaling_as_llama_cpp_reads_it(extra, kind, factor):
  """A factor without a type (and the older rope.scale_linear key) were ignored: old linear-scaled
  conversions loaded unscaled."""
  from jspec.io.checkpoint import config_from_gguf
  scaling = config_from_gguf(gguf_meta(**extra), {"output.weight"}).rope_scaling
  assert (scaling.kind, scaling.factor) == (kind, factor)


@pytest.mark.parametrize("extra, message", [
    ({"rope.scaling.type": "linear"}, "linear but llama.rope.scaling.factor is missing"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "unsupported GGUF rope scaling"),
    ({"rope.dimension_count": 2}, "rope.dimension_count=2 rotates part of each 4-wide head"),
    ({"attention.head_count_kv": [2, 1]}, "a KV head count per layer"),
])
def test_gguf_metadata_jspec_cannot_run_is_refused(extra, message):
  from jspec.io.checkpoint import config_from_gguf
  with pytest.raises(ValueError, match=message):
    config_from_gguf(gguf_meta(**extra), {"output.weight"})


@pytest.mark.parametrize("key", ["embedding_length", "attention.head_count",
                                 "feed_forward_length", "block_count", "vocab_size"])
def test_a_gguf_without_a_hyperparameter_names_the_key(key):
  """A missing size was int(None): a TypeError naming nothing (and the CLI printed a traceback)."""
  from jspec.io.checkpoint import config_from_gguf
  meta = {k: v for k, v in gguf_meta().items() if k != f"llama.{key}"}
  with pytest.raises(ValueError, match=f"no llama.{key},.*Fix"):
    config_from_gguf(meta, {"output.weight"})


def test_a_tied_config_beside_another_stored_head_is_refused(tmp_path):
  """tie_word_embeddings=true with an lm_head.weight that is not the embedding: the head was
  dropped silently (transformers uses it, untied); a stored copy of the embedding still loads."""
  import numpy as np
  from safetensors.numpy import save_file
  rng = np.random.default_rng(0)
  write_config(tmp_path, tie_word_embeddings=True)
  names = {"model.norm.weight": (8,), "model.layers.0.input_layernorm.weight": (8,),
           "model.layers.0.post_attention_layernorm.weight": (8,)}
  for proj, shape in (("q", (8, 8)), ("k", (8, 8)), ("v", (8, 8)), ("o", (8, 8))):
    names[f"model.layers.0.self_attn.{proj}_proj.weight"] = shape
  for proj in ("gate", "up", "down"):
    names[f"model.layers.0.mlp.{proj}_proj.weight"] = (8, 8)
  tensors = {n: rng.normal(size=s).astype(np.float32) for n, s in names.items()}
  embed = rng.normal(size=(8, 8)).astype(np.float32)
  save_file({**tensors, "model.embed_tokens.weight": embed, "lm_head.weight": embed.copy()},
            str(tmp_path / "model.safetensors"))
  cfg, params = load_hf(tmp_path)
  assert cfg.tie_embeddings and params.lm_head is None
  save_file({**tensors, "model.embed_tokens.weight": embed, "lm_head.weight": embed + 1},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="ties the output head.*differs from it.*Fix: set "
                                       "tie_word_embeddings to false"):
    load_hf(tmp_path)


def test_gguf_frequency_factors_keep_a_linear_factor():
  """llama.cpp applies rope_freqs.weight and a linear factor both (the factors alone were kept);
  a factor count that is not the head's frequency count is refused."""
  import numpy as np
  from jspec.io.checkpoint import _with_freq_factors, config_from_gguf
  from jspec.models.config import rope_frequencies
  factors = (1.0, 8.0)  # a 4-wide head has 2 frequencies
  plain = config_from_gguf(gguf_meta(), {"output.weight"})
  linear = config_from_gguf(gguf_meta(**{"rope.scaling.factor": 4.0}), {"output.weight"})
  base = rope_frequencies(plain)
  np.testing.assert_allclose(rope_frequencies(_with_freq_factors(plain, factors)),
                             base / np.array(factors), rtol=1e-6)
  np.testing.assert_allclose(rope_frequencies(_with_freq_factors(linear, factors)),
                             base / np.array(factors) / 4.0, rtol=1e-6)
  with pytest.raises(ValueError, match="holds 3 frequency factors.*has 2 frequencies"):
    _with_freq_factors(plain, (1.0, 2.0, 4.0))
