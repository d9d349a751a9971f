"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF fetched from PyPI and hash-checked):
jspec's greedy output equals transformers' greedy output on the same GGUF."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jspec.model import load  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the n-th Fibonacci number."]


@pytest.fixture(scope="module")
def model():
  return load("default")


@pytest.fixture(scope="module")
def hf_model(model):
  from pathlib import Path
  path = Path(model.source)
  return transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_default_model_config(model):
  cfg = model.cfg
  assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
      "llama", 30, 576, 9, 3)
  assert cfg.tie_embeddings and cfg.vocab_size == 49152
  assert model.tokenizer.chat_template is not None


def test_greedy_matches_transformers(model, hf_model):
  ids = [model.encode(p, chat=True) for p in PROMPTS]
  out = model.generate_ids(ids, max_new_tokens=32, stop=False)
  for prompt_ids, got in zip(ids, out.sequences()):
    with torch.no_grad():
      t = torch.tensor([prompt_ids])
      want = hf_model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=32,
                               do_sample=False, eos_token_id=None, pad_token_id=0,
                               top_k=None, top_p=None, temperature=None)[0, len(prompt_ids):]
    assert got == want.tolist()
  text = model.tokenizer.decode(out.sequences()[0])
  assert "Paris" in text


def test_prefill_logits_match_transformers(model, hf_model):
  import jax.numpy as jnp
  from jspec.models.cache import KVCache
  from jspec.models.llama import forward
  ids = model.encode(PROMPTS[0], chat=True)
  logits, _, _ = forward(model.params, model.cfg, jnp.asarray([ids]),
                         jnp.arange(len(ids))[None], KVCache.init(model.cfg, 1, len(ids)))
  with torch.no_grad():
    want = hf_model(torch.tensor([ids])).logits.numpy()
  assert np.abs(np.asarray(logits) - want).max() < 2e-3


def test_default_drafter_is_lossless_and_accepts(model):
  """The shipped distilled drafter: greedy output identical to autoregressive, and it accepts
  drafts (a broken or untrained drafter would give block efficiency ~1)."""
  from jspec.drafting.registry import DEFAULT_DRAFTER, load_drafter
  size = sum(f.stat().st_size for f in DEFAULT_DRAFTER.iterdir())
  assert size < 20 * 2**20
  drafter = load_drafter("default", model)
  assert drafter.keep_ids is not None and drafter.keep_ids.shape == (8192,)
  ids = [model.encode(p, chat=True) for p in PROMPTS]
  ar = model.generate_ids(ids, max_new_tokens=48)
  spec = model.generate_ids(ids, max_new_tokens=48, drafter=drafter, gamma=3)
  assert spec.sequences() == ar.sequences()
  assert spec.block_efficiency > 1.1
