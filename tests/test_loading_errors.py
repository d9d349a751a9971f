"""Bad checkpoints are refused with clear errors: unknown architecture, missing files, pickles."""

import json

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
