"""VocabTrim and compact drafter directories: kept-id choice, proposals mapped back into the full
vocabulary, save/load round trips that borrow the target's embedding, clear errors.
(Losslessness with a trimmed drafter is tested in test_speculative.py.)"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

import ggufutil  # noqa: E402
from jspec.io.drafter import drafter_format, save_drafter, shares_table  # noqa: E402
from jspec.drafting.registry import load_model_drafter  # noqa: E402
from jspec.model import load  # noqa: E402
from jspec.models.config import Config  # noqa: E402
from jspec.models.llama import init_params  # noqa: E402
from jspec.sampling.processing import GREEDY, SamplingParams  # noqa: E402
from jspec.drafting.model import ModelDrafter, trimmed_drafter  # noqa: E402
from jspec.models.vocab_trim import full_to_trimmed, most_frequent_ids, trim_head  # noqa: E402
from jspec.models.drafter import drafter_config  # noqa: E402
from jspec.train.drafter import init_drafter  # noqa: E402

CFG = Config(arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1,
             num_heads=2, num_kv_heads=1, head_dim=16, tie_embeddings=True)


def test_most_frequent_ids():
  counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
  np.testing.assert_array_equal(most_frequent_ids(counts, 3), [2, 3, 5])
  np.testing.assert_array_equal(most_frequent_ids(counts, 3, always=[6]), [2, 3, 6])
  np.testing.assert_array_equal(most_frequent_ids(counts, 4), [0, 2, 3, 5])  # ties: lower id
  np.testing.assert_array_equal(full_to_trimmed(np.array([2, 5]), 6), [-1, -1, 0, -1, -1, 1])
  with pytest.raises(ValueError, match="size"):
    most_frequent_ids(counts, 0)
  with pytest.raises(ValueError, match="lie in"):
    most_frequent_ids(counts, 3, always=[8])


# Jitted: op by op, a drafter's init and propose compiled ~100 small programs a call.
@functools.partial(jax.jit, static_argnames=("sampling", "gamma"))
def _propose(drafter, sampling, key=0, gamma=3):
  prompt = jnp.asarray([[5, 9, 11, 2], [7, 3, 0, 0]], jnp.int32)
  lengths = jnp.asarray([4, 2], jnp.int32)
  state = drafter.init(prompt, lengths, 32, features=None)  # a model drafter reads no features
  last2 = jnp.stack([prompt[jnp.arange(2), lengths - 2], prompt[jnp.arange(2), lengths - 1]], 1)
  return drafter.propose(state, last2, lengths, jax.random.key(key), sampling, gamma)


def test_trimmed_proposals_live_in_the_full_vocabulary():
  params = init_params(CFG, jax.random.key(0), scale=0.5)
  keep = np.array([1, 4, 5, 10, 17, 30, 47])
  full = ModelDrafter(params, CFG)
  trimmed = trimmed_drafter(trim_head(params, keep), CFG, keep)
  sp = SamplingParams(temperature=1.0)
  for key in range(4):
    tokens, probs, _ = _propose(trimmed, sp, key)
    assert np.isin(np.asarray(tokens), keep).all()
    probs = np.asarray(probs)  # [B, G, V]
    assert probs.shape[-1] == CFG.vocab_size
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert (probs[..., np.setdiff1d(np.arange(CFG.vocab_size), keep)] == 0).all()
    assert (np.take_along_axis(probs, np.asarray(tokens)[..., None], -1) > 0).all()
  # First draft position: q is the full head's distribution restricted to the kept ids.
  _, full_probs, _ = _propose(full, sp)
  _, trim_probs, _ = _propose(trimmed, sp)
  restricted = np.asarray(full_probs)[:, 0][:, keep]
  np.testing.assert_allclose(np.asarray(trim_probs)[:, 0][:, keep],
                             restricted / restricted.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
  # Greedy: the argmax among the kept ids, one-hot in the full vocabulary.
  tokens, probs, _ = _propose(trimmed, GREEDY)
  logits_first = np.asarray(jnp.log(full_probs[:, 0]))
  np.testing.assert_array_equal(np.asarray(tokens)[:, 0], keep[logits_first[:, keep].argmax(-1)])
  np.testing.assert_array_equal(np.asarray(probs).sum(-1), 1.0)


def test_trimmed_drafter_needs_a_matching_head():
  params = init_params(CFG, jax.random.key(0))
  with pytest.raises(ValueError, match="trim_head"):
    trimmed_drafter(params, CFG, [1, 2, 3])
  with pytest.raises(ValueError, match="distinct"):
    trimmed_drafter(trim_head(params, [1, 2, 3]), CFG, [1, 2, 2])
  with pytest.raises(ValueError, match=r"lie in \[0, 48\)"):
    trim_head(params, [1, 48])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path_factory.mktemp("target"), "llama",
                                        max_position_embeddings=256)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  return load(d)


def _same_drafts(a: ModelDrafter, b: ModelDrafter):
  for sp in (GREEDY, SamplingParams(temperature=1.0)):
    ta, pa, _ = _propose(a, sp)
    tb, pb, _ = _propose(b, sp)
    np.testing.assert_array_equal(np.asarray(ta), np.asarray(tb))
    np.testing.assert_allclose(np.asarray(pa), np.asarray(pb), atol=1e-6)


@pytest.mark.parametrize("trim", [None, 40])
def test_compact_drafter_round_trip(target, tmp_path, trim):
  dcfg = drafter_config(target.cfg, 1)
  params = init_drafter(target.params, target.cfg, dcfg, jax.random.key(0), "target")
  # Layers change in training; the (frozen) table is still the target's.
  params = dataclasses.replace(params, layers=tuple(
      jax.tree.map(lambda x: x * 1.01, lp) for lp in params.layers))
  assert shares_table(params, target.params)
  keep = None
  if trim:
    counts = np.random.default_rng(0).integers(0, 100, target.cfg.vocab_size)
    keep = most_frequent_ids(counts, trim, always=target.tokenizer.stop_token_ids)
    params = trim_head(params, keep)
  out = save_drafter(tmp_path / "d", dcfg, params, target.tokenizer, {"recipe": "test"},
                     keep_ids=keep, share_target_table=True)
  fmt = drafter_format(out)
  assert fmt["shares_target_embedding"] and fmt["trimmed_vocab"] == trim and fmt["head_is_table"]
  from safetensors import safe_open
  with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
    names = set(f.keys())
  assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
  back = load_model_drafter(out, target)
  want = ModelDrafter(params, dcfg) if keep is None else trimmed_drafter(params, dcfg, keep)
  assert back.cfg == dcfg
  _same_drafts(back, want)
  # A trained (no longer the table) trimmed head is stored, and float16 storage loads back.
  if trim:
    params = dataclasses.replace(params, lm_head=params.lm_head * 0.5)
    out = save_drafter(tmp_path / "h", dcfg, params, target.tokenizer, {}, keep_ids=keep,
                       share_target_table=True, dtype="float16")
    assert not drafter_format(out)["head_is_table"]
    import json  # config.json says what is stored (it said float32 whatever the dtype)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    back = load_model_drafter(out, target)
    np.testing.assert_allclose(np.asarray(back.params.lm_head), np.asarray(params.lm_head),
                               rtol=1e-3, atol=1e-3)


def test_plain_drafter_directory_still_loads_in_transformers(target, tmp_path):
  import transformers
  dcfg = drafter_config(target.cfg, 1)
  params = init_drafter(target.params, target.cfg, dcfg, jax.random.key(0), "target")
  out = save_drafter(tmp_path / "p", dcfg, params, target.tokenizer, {})
  assert drafter_format(out) is None  # neither trimmed nor borrowing: a normal HF directory
  transformers.AutoModelForCausalLM.from_pretrained(out)
  _same_drafts(load_model_drafter(out, target), ModelDrafter(params, dcfg))


def test_compact_drafter_errors(target, tmp_path):
  dcfg = drafter_config(target.cfg, 1)
  params = init_drafter(target.params, target.cfg, dcfg, jax.random.key(0), "target")
  out = save_drafter(tmp_path / "d", dcfg, params, target.tokenizer, {}, share_target_table=True)
  # Another target whose table has another width cannot lend its embedding.
  d2, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path / "other", "llama", hidden_size=48,
                                         max_position_embeddings=256)
  ggufutil.make_tiny_tokenizer_dir(d2, 256)
  with pytest.raises(ValueError, match="made for another target"):
    load_model_drafter(out, load(d2))
  # A drafter with another tokenizer is refused before anything else.
  d3, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path / "third", "llama", max_position_embeddings=256)
  ggufutil.make_tiny_tokenizer_dir(d3, 200)
  with pytest.raises(ValueError, match="tokenizer"):
    load_model_drafter(out, load(d3))
  (out / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="incomplete"):
    load_model_drafter(out, target)


def test_default_drafter_refuses_another_target(target):
  from jspec.drafting.registry import load_drafter
  with pytest.raises(ValueError, match="distilled from the default model"):
    load_drafter("default", target)


@pytest.mark.parametrize("text,match", [('{"drafter_format": ', "is not valid JSON"),
                                        ("[]", "holds a JSON list"),
                                        ('{"drafter_format": "x"}', "'drafter_format' must be")])
def test_a_broken_drafter_record_is_named(tmp_path, text, match):
  from jspec.io.drafter import read_drafter_dir
  (tmp_path / "jspec.json").write_text(text)
  with pytest.raises(ValueError, match=match) as err:
    read_drafter_dir(tmp_path)
  assert "jspec.json" in str(err.value)


@pytest.mark.parametrize("kernel", ["xla", "native"])
def test_a_quantized_untied_head_is_borrowed_dequantized(kernel):
  """Compact and EAGLE drafters read the target's head as a [V, E] table: an int8 untied head
  (Llama-3-class targets) was `AttributeError: 'Int8Weight' object has no attribute 'T'`."""
  from jspec.drafting.feature import eagle_drafter
  from jspec.models.eagle import init_eagle
  from jspec.models.llama import init_params, quantize_params
  from jspec.models.vocab_trim import output_table
  from tiny_models import SMALL
  assert not SMALL.tie_embeddings
  params = init_params(SMALL, jax.random.key(0))
  quantized = quantize_params(params, kernel)
  table = output_table(quantized)  # [V, E]
  assert table.shape == (SMALL.vocab_size, SMALL.hidden_size)
  np.testing.assert_allclose(np.asarray(table), np.asarray(params.lm_head).T, atol=0.02)
  eagle, ecfg = init_eagle(params, SMALL, jax.random.key(1))
  drafter = eagle_drafter(eagle, ecfg, quantized, keep_ids=[0, 5, 9])
  np.testing.assert_array_equal(np.asarray(drafter.head), np.asarray(table)[[0, 5, 9]])


@pytest.mark.parametrize("draft_vocab, tied", [(264, True), (288, False)])
def test_a_drafter_padded_to_another_vocab_size_is_fitted(tmp_path, draft_vocab, tied):
  """One tokenizer, two paddings (Qwen2.5-0.5B 151,936 rows, 7B 152,064): the drafter loaded, then
  the engine refused it as "needs a drafter with the target's tokenizer". A smaller drafter emits
  only its own ids; a larger one drops its padding rows; proposals are its own model's."""
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path / "t", "llama", vocab_size=272,
                                        max_position_embeddings=256)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  target = load(d)
  dd, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path / "d", "llama", vocab_size=draft_vocab,
                                         num_hidden_layers=1, tie_word_embeddings=tied, seed=1,
                                         max_position_embeddings=256)
  ggufutil.make_tiny_tokenizer_dir(dd, 256)
  fitted = load_model_drafter(dd, target)
  own = load(dd)
  assert fitted.vocab_size == 272 and own.cfg.vocab_size == draft_vocab
  reference = ModelDrafter(own.params, own.cfg)
  sp = SamplingParams(temperature=1.0)
  _, got, _ = _propose(fitted, sp)
  _, want, _ = _propose(reference, sp)
  got, want = np.asarray(got)[:, 0], np.asarray(want)[:, 0]  # [B, V], [B, V_d]: first position
  V = min(draft_vocab, 272)
  restricted = want[:, :V] / want[:, :V].sum(-1, keepdims=True)
  np.testing.assert_allclose(got[:, :V], restricted, rtol=1e-5, atol=1e-7)
  assert (got[:, V:] == 0).all()
  if draft_vocab < 272:  # a kept-id head that trim-vocab cannot rebuild: said, not mistaken
    from jspec.train.recipe import trim_drafter
    with pytest.raises(ValueError, match="264 vocabulary rows, the target 272"):
      trim_drafter(target, dd, (), 100, tmp_path / "trimmed")
  _, q8, _ = _propose(load_model_drafter(dd, target, "int8"), sp)  # fitted before quantizing
  np.testing.assert_allclose(np.asarray(q8)[:, 0], got, atol=0.02)
  ids = target.tokenizer.encode("token1 layer2")
  ar = target.generate_ids([ids], max_new_tokens=12).sequences()
  spec = target.generate_ids([ids], max_new_tokens=12, drafter=fitted, gamma=3).sequences()
  assert spec == ar


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):  # EAGLE-3 fuses three distinct layers: 4 at least
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path_factory.mktemp("deep"), "llama",
                                        num_hidden_layers=4, max_position_embeddings=256)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  return load(d)


@pytest.mark.parametrize("network", ["eagle", "eagle3", "confu"])
def test_a_feature_drafter_runs_its_own_matmuls_in_the_weights_asked_for(deep_target, tmp_path,
                                                                         network):
  """--drafter-weights int8 / q4 / float32 reached compact and model drafters only: a feature
  drafter loaded float32-xla whatever was asked (and bench recorded the format asked for)."""
  from jspec.io.drafter import save_eagle
  from jspec.models import quant
  from jspec.models.confu import ConFuParams, init_contemplate
  from jspec.models.eagle import eagle_forward, init_eagle
  from jspec.models.eagle3 import eagle3_forward, init_eagle3, logits
  from jspec.models.cache import KVCache
  target = deep_target
  key = jax.random.key(2)
  if network == "eagle":
    params, dcfg = init_eagle(target.params, target.cfg, key)
  else:
    params, dcfg = init_eagle3(target.params, target.cfg, key)
  noise = lambda x: x + 0.05 * jax.random.normal(key, x.shape) if x.ndim > 1 else x
  params = jax.tree.map(noise, params)
  if network == "confu":
    params = ConFuParams(params, init_contemplate(target.params, target.cfg, key))
  out = save_eagle(tmp_path / network, dcfg, params, target.tokenizer, {}, dtype="float32")
  float_drafter = load_model_drafter(out, target, "float32-xla")
  feats = jax.random.normal(jax.random.key(3), (1, 5, target.cfg.hidden_size))
  tokens = jnp.asarray([[3, 9, 27, 81, 243]], jnp.int32)

  def run(d):
    forward = eagle_forward if network == "eagle" else eagle3_forward
    h, _ = forward(d.params, d.cfg, d.embed, tokens, feats, jnp.arange(5)[None],
                   KVCache.init(d.cfg, 1, 8))
    return h if network == "eagle" else logits(d.params, d.cfg, h)

  want = np.asarray(run(float_drafter))
  for fmt, layer_kind, matrix_kind in (("int8", quant.Int8Weight, quant.Int8Weight),
                                       ("q4", quant.Q4Weight, quant.Int8Weight),
                                       ("float32", quant.DenseWeight, quant.DenseWeight)):
    drafter = load_model_drafter(out, target, fmt)
    assert isinstance(drafter.params.layer.wq, layer_kind)
    assert isinstance(drafter.params.fc, matrix_kind)
    if network != "eagle":
      assert isinstance(drafter.params.head, matrix_kind)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(run(drafter)), want, atol=(
        1e-5 if fmt == "float32" else 0.05) * scale)
  ids = target.tokenizer.encode("token1 layer2")
  ar = target.generate_ids([ids], max_new_tokens=10).sequences()
  spec = target.generate_ids([ids], max_new_tokens=10, drafter=drafter, gamma=2).sequences()
  assert spec == ar
