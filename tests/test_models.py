"""The decoder matches transformers: full prefill, and prefill + cached decode == full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ggufutil  # noqa: E402
from jspec.io.checkpoint import load_gguf, load_hf  # noqa: E402
from jspec.models.cache import KVCache  # noqa: E402
from tiny_models import jitted_forward  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # q/k/v/o biases: llama.cpp's converter permutes the q/k biases as it does their weights.
    "llama-bias": ("llama", {"attention_bias": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
}
T = 40


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
  arch, overrides = VARIANTS[request.param]
  d, config, sd = ggufutil.tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch,
                                              **overrides)
  ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
  ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, T))
  with torch.no_grad():
    want = ref(torch.as_tensor(ids)).logits.numpy()
  return arch, d, config, sd, ids, want


def full_forward(cfg, params, ids, cache_size=64):
  B, n = ids.shape
  cache = KVCache.init(cfg, B, cache_size)
  pos = jnp.broadcast_to(jnp.arange(n), (B, n))
  logits, hidden, cache = jitted_forward(params, cfg, jnp.asarray(ids), pos, cache)
  return np.asarray(logits), hidden, cache


def test_prefill_matches_transformers(checkpoint):
  _, d, _, _, ids, want = checkpoint
  cfg, params = load_hf(d)
  got, hidden, _ = full_forward(cfg, params, ids)
  assert hidden.shape == (2, T, cfg.hidden_size)
  assert np.abs(got - want).max() < 1e-4


def test_cached_decode_matches_full_forward(checkpoint):
  """Prefill 25 tokens, then feed the rest one by one (and a 3-token chunk) through the cache."""
  _, d, _, _, ids, want = checkpoint
  cfg, params = load_hf(d)
  cache = KVCache.init(cfg, 2, 64)
  P = 25
  pos = jnp.broadcast_to(jnp.arange(P), (2, P))
  logits, _, cache = jitted_forward(params, cfg, jnp.asarray(ids[:, :P]), pos, cache)
  got = [np.asarray(logits)]
  cache = cache.commit(P)
  t = P
  while t < T:
    n = 3 if t == P else 1  # one multi-token chunk exercises the in-block causal mask
    pos = cache.lengths[:, None] + jnp.arange(n)
    logits, _, cache = jitted_forward(params, cfg, jnp.asarray(ids[:, t:t + n]), pos, cache)
    got.append(np.asarray(logits))
    cache = cache.commit(n)
    t += n
  got = np.concatenate(got, axis=1)
  assert np.abs(got - want).max() < 1e-4


def test_uncommitted_entries_are_invisible(checkpoint):
  """Entries written past `lengths` (a rejected draft) must not change later logits."""
  _, d, _, _, ids, want = checkpoint
  cfg, params = load_hf(d)
  P = 30
  _, _, cache = full_forward(cfg, params, ids[:, :P])
  cache = cache.with_lengths(jnp.full((2,), P))
  junk = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 4)))
  _, _, cache = jitted_forward(params, cfg, junk, P + jnp.arange(4)[None].repeat(2, 0), cache)
  logits, _, _ = jitted_forward(params, cfg, jnp.asarray(ids[:, P:P + 1]), jnp.full((2, 1), P),
                                cache)
  assert np.abs(np.asarray(logits)[:, 0] - want[:, P]).max() < 1e-4


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_gguf_loads_like_original(checkpoint, tmp_path, quant):
  """GGUF (llama: q/k permuted as llama.cpp writes them) loads to the safetensors logits, and to
  exactly what transformers' own GGUF loader computes from the same file."""
  arch, _, config, sd, ids, want = checkpoint
  path = ggufutil.write_gguf(tmp_path / f"{quant}.gguf", config, sd, arch, quant=quant)
  cfg, params = load_gguf(path)
  got, _, _ = full_forward(cfg, params, ids)
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, config=transformers.AutoConfig.from_pretrained(
          checkpoint[1]), dtype=torch.float32).eval()
  with torch.no_grad():
    hf_gguf = ref(torch.as_tensor(ids)).logits.numpy()
  assert np.abs(got - hf_gguf).max() < 1e-4
  tol = 1e-4 if quant == "F32" else 5e-2
  assert np.abs(got - want).max() < tol


def test_gguf_without_unpermute_differs(tmp_path, monkeypatch):
  """The permutation matters: skipping the un-permute gives different logits (the test has teeth)."""
  from jspec.io import checkpoint as ck
  d, config, sd = ggufutil.tiny_hf_checkpoint(tmp_path / "hf", "llama")
  path = ggufutil.write_gguf(tmp_path / "m.gguf", config, sd, "llama")
  cfg, params = load_gguf(path)
  good, _, _ = full_forward(cfg, params, np.arange(20)[None])
  monkeypatch.setattr(ck, "_permuted_heads", lambda cfg, name: None)
  _, bad_params = load_gguf(path)
  bad, _, _ = full_forward(cfg, bad_params, np.arange(20)[None])
  assert np.abs(good - bad).max() > 1e-3


def test_bfloat16_close_to_float32(tmp_path):
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path, "llama")
  cfg, p32 = load_hf(d)
  _, p16 = load_hf(d, dtype=jnp.bfloat16)
  assert p16.layers[0].wq.dtype == jnp.bfloat16
  ids = np.arange(16)[None]
  a, _, _ = full_forward(cfg, p32, ids)
  b, _, _ = full_forward(cfg, p16, ids)
  assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_forward_jit_donates_cache(tmp_path):
  from jspec.models.llama import forward_jit
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path, "llama")
  cfg, params = load_hf(d)
  cache = KVCache.init(cfg, 1, 32)
  ids = jnp.arange(5)[None]
  _, _, new = forward_jit(params, cfg, ids, jnp.arange(5)[None], cache)
  assert cache.k.is_deleted() and cache.v.is_deleted()  # donated: updated in place
  np.testing.assert_allclose(np.asarray(new.k), np.asarray(
      jitted_forward(params, cfg, ids, jnp.arange(5)[None], KVCache.init(cfg, 1, 32))[2].k),
      atol=1e-6)


def test_sharded_safetensors_checkpoint(tmp_path):
  """A checkpoint split over several files with an index loads like the single file."""
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path / "one", "qwen2")
  model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
  model.save_pretrained(tmp_path / "many", safe_serialization=True, max_shard_size="50KB")
  files = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
  assert len(files) > 2 and (tmp_path / "many" / "model.safetensors.index.json").is_file()
  cfg, one = load_hf(d)
  _, many = load_hf(tmp_path / "many")
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_checkpoint(tmp_path):
  """Most real checkpoints are stored in bfloat16 (which numpy cannot decode on its own)."""
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path / "f32", "qwen3")
  model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
  model.save_pretrained(tmp_path / "bf16", safe_serialization=True)
  cfg, p32 = load_hf(tmp_path / "bf16", dtype=jnp.float32)
  _, p16 = load_hf(tmp_path / "bf16", dtype=jnp.bfloat16)
  assert p16.layers[0].wq.dtype == jnp.bfloat16 and p32.layers[0].wq.dtype == jnp.float32
  # float32 loading of bf16 weights is exact: every bf16 value is a float32 value.
  np.testing.assert_array_equal(np.asarray(p16.layers[0].wq, np.float32), np.asarray(p32.layers[0].wq))
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 16))
  with torch.no_grad():
    want = model.float()(torch.as_tensor(ids)).logits.numpy()
  got, _, _ = full_forward(cfg, p32, ids)
  assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_streams_one_row_of_an_untied_embedding(tied):
  """The bandwidth figures' bytes a step: the whole head, but of an untied input embedding one
  row a token (the whole table was counted: Llama-3-8B's 1.05 GB of 16.2)."""
  from jspec.models.config import Config
  from jspec.models.llama import init_params, param_bytes, step_weight_bytes
  cfg = Config(arch="llama", vocab_size=96, hidden_size=16, intermediate_size=32, num_layers=1,
               num_heads=2, num_kv_heads=1, head_dim=8, tie_embeddings=tied)
  params = init_params(cfg, jax.random.key(0))
  table = params.embed.size * params.embed.dtype.itemsize
  row = table // cfg.vocab_size
  assert step_weight_bytes(params, cfg.vocab_size) == param_bytes(params) - (0 if tied else
                                                                             table - row)


def test_forward_jit_refuses_a_step_past_the_cache_end(tmp_path):
  """A step whose entries would not fit: dropped writes and wrong logits before (0.2 off a roomy
  cache's), now an error naming the fix; the step that fills the last slot still runs."""
  from jspec.models.llama import forward_jit
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path, "llama")
  cfg, params = load_hf(d)
  cache = KVCache.init(cfg, 1, 8)
  _, _, cache = forward_jit(params, cfg, jnp.arange(7)[None], jnp.arange(7)[None], cache)
  cache = cache.commit(7)
  _, _, full = forward_jit(params, cfg, jnp.asarray([[3]]), jnp.asarray([[7]]), cache)
  with pytest.raises(ValueError, match="needs 9 slots; the cache has 8.*Fix: a larger cache"):
    forward_jit(params, cfg, jnp.asarray([[3]]), jnp.asarray([[8]]), full.commit(1))
  # Under a caller's jit the lengths are traced: no host check, the caller owns the room.
  roomy = KVCache.init(cfg, 1, 16).with_lengths(jnp.asarray([7], jnp.int32))
  logits = jax.jit(lambda c: forward_jit(params, cfg, jnp.asarray([[3]]), jnp.asarray([[7]]),
                                         c)[0])(roomy)
  assert logits.shape == (1, 1, cfg.vocab_size)
