"""Drafter training pipeline on tiny models: distillation data (resumable shards), row alignment,
loss goes down, kill-and-resume equals an uninterrupted run, HF save round trip, clear errors."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

import ggufutil  # noqa: E402
from jspec.io.save import save_hf  # noqa: E402
from jspec.model import load  # noqa: E402
from jspec.models.llama import layer_list  # noqa: E402
from jspec.train import distill, trainer  # noqa: E402
from jspec.models.drafter import drafter_config, spread_layers  # noqa: E402
from jspec.train.drafter import init_drafter  # noqa: E402
from tiny_models import causal_logits  # noqa: E402

TEXTS = [f"Tell me about token{i} and layer{i}." for i in range(12)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path_factory.mktemp("target"), "llama",
                                        max_position_embeddings=1024)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  return load(d)


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory):
  cfg = distill.DataConfig(num_prompts=12, max_prompt_tokens=64, max_new_tokens=24, batch_size=4,
                           top_k=8, temperatures=(0.0, 1.0))
  return distill.build_dataset(target, TEXTS, tmp_path_factory.mktemp("data"), cfg,
                               progress=False), cfg


def test_distillation_data_is_the_targets_own_output(target, data_dir):
  path, cfg = data_dir
  examples = list(distill.iter_examples(path))
  assert len(examples) == 12
  greedy = [ex for ex in examples if ex.top_ids.shape[0]]
  for ex in examples:
    assert ex.top_ids.shape == (len(ex.response), cfg.top_k)
    # The stored top-k is the target's distribution at each response position: recompute it.
    logits = causal_logits(target.params, target.cfg, np.concatenate([ex.prompt, ex.response]))
    logp = jax.nn.log_softmax(logits[len(ex.prompt) - 1: -1])  # predicts response tokens
    want = jnp.take_along_axis(logp, jnp.asarray(ex.top_ids), axis=-1)
    np.testing.assert_allclose(ex.top_logprobs, want, atol=2e-3)  # float16 storage
    np.testing.assert_array_equal(ex.top_ids[:, 0], np.argmax(logp, -1))
  assert greedy


def test_distillation_data_resumes_identically(target, data_dir, tmp_path):
  path, cfg = data_dir
  copy = tmp_path / "copy"
  shutil.copytree(path, copy)
  (copy / "shard_00001.npz").unlink()
  distill.build_dataset(target, TEXTS, copy, cfg, progress=False)
  with np.load(path / "shard_00001.npz") as a, np.load(copy / "shard_00001.npz") as b:
    for k in a.files:
      np.testing.assert_array_equal(a[k], b[k])
  with pytest.raises(ValueError, match="other settings"):
    distill.build_dataset(target, TEXTS, copy, dataclasses.replace(cfg, top_k=4), progress=False)


def test_data_of_another_tokenizer_is_refused(target, data_dir, tmp_path):
  """The manifest records the tokenizer: ids made by another mean other text."""
  from types import SimpleNamespace
  path, cfg = data_dir
  assert distill.read_manifest(path)["tokenizer_sha256"] == target.tokenizer.fingerprint
  distill.load_examples([(path, 0, 1)], target.tokenizer)
  with pytest.raises(ValueError, match="made by a target with another tokenizer"):
    distill.load_examples([(path, 0, 1)], SimpleNamespace(fingerprint="another"))
  # Data made before the manifest recorded it still loads, and resumes.
  old = tmp_path / "old"
  shutil.copytree(path, old)
  manifest = json.loads((old / "manifest.json").read_text())
  del manifest["tokenizer_sha256"]
  (old / "manifest.json").write_text(json.dumps(manifest))
  distill.load_examples([(old, 0, 1)], SimpleNamespace(fingerprint="another"))
  distill.build_dataset(target, TEXTS, old, cfg, progress=False)


def test_examples_from_a_shard_range(data_dir):
  path, cfg = data_dir
  every = list(distill.iter_examples(path))
  tail = list(distill.iter_examples(path, 3, start_shard=1))
  assert len(tail) == 2 * cfg.batch_size  # shards 1 and 2 of 3
  for a, b in zip(tail, every[cfg.batch_size:]):
    np.testing.assert_array_equal(a.response, b.response)
  with pytest.raises(ValueError, match="start shard 3 is outside"):
    list(distill.iter_examples(path, 3, start_shard=3))


def test_corrupt_or_missing_shards_are_named(data_dir, tmp_path):
  path, _ = data_dir
  copy = tmp_path / "copy"
  shutil.copytree(path, copy)
  (copy / "shard_00000.npz").write_bytes(b"not a zip")
  with pytest.raises(ValueError, match="shard_00000.npz is corrupt"):
    list(distill.iter_examples(copy))
  (copy / "shard_00000.npz").unlink()
  with pytest.raises(FileNotFoundError, match="did not finish"):
    list(distill.iter_examples(copy))
  with pytest.raises(FileNotFoundError, match="not a distillation data directory"):
    list(distill.iter_examples(tmp_path))


def test_rows_align_teacher_with_the_token_it_predicts():
  ex = distill.Example(prompt=np.array([5, 6, 7], np.int32), response=np.array([8, 9], np.int32),
                       top_ids=np.array([[8, 1], [9, 2]], np.int32),
                       top_logprobs=np.log(np.array([[.6, .1], [.7, .2]], np.float32)))
  rows = trainer.make_rows([ex], seq_len=8)
  np.testing.assert_array_equal(rows.tokens[0], [5, 6, 7, 8, 9, 0, 0, 0])
  np.testing.assert_array_equal(rows.mask[0], [0, 0, 1, 1, 0, 0, 0, 0])  # positions 2, 3 predict
  np.testing.assert_array_equal(rows.top_ids[0, 2], [8, 1])
  np.testing.assert_array_equal(rows.top_ids[0, 3], [9, 2])
  assert (rows.top_ids[0, [0, 1, 4]] == -1).all()
  short = trainer.make_rows([ex], seq_len=4)  # cut: only the first response token fits
  np.testing.assert_array_equal(short.mask[0], [0, 0, 1, 1])
  vocab_map = np.full(16, -1, np.int32)
  vocab_map[[8, 9]] = [0, 1]
  trimmed = trainer.make_rows([ex], seq_len=8, vocab_map=vocab_map)
  np.testing.assert_array_equal(trimmed.top_ids[0, 2], [0, -1])


def _setup(target, data_dir, loss="kl", **kw):
  path, _ = data_dir
  rows = trainer.make_rows(list(distill.iter_examples(path)), seq_len=48)
  dcfg = drafter_config(target.cfg, 1)
  params = init_drafter(target.params, target.cfg, dcfg, jax.random.key(1), "random")
  tc = trainer.TrainConfig(loss=loss, seq_len=48, batch_size=4, steps=6, lr=3e-3, warmup_steps=1,
                           eval_every=3, checkpoint_every=2, **kw)
  return rows, dcfg, params, tc


@pytest.mark.parametrize("loss,freeze", [("kl", False), ("tvd++", False), ("kl", True)])
def test_training_reduces_the_loss(target, data_dir, tmp_path, loss, freeze):
  rows, dcfg, params, tc = _setup(target, data_dir, loss)
  tc = dataclasses.replace(tc, steps=30, eval_every=30, checkpoint_every=30,
                           freeze_embeddings=freeze)
  objective = jax.jit(lambda p, b: trainer.loss_fn(loss)(
      trainer.student_logits(p, dcfg, b["tokens"]), b["top_ids"], b["top_logprobs"], b["mask"]))
  batch = rows.take(np.arange(len(rows)))
  before = float(objective(params, batch))
  trained, log = trainer.train(params, dcfg, rows, tc, tmp_path, eval_rows=rows, progress=False)
  # TVD against a top-k teacher cannot go below half the mass the top-k leaves out; KL's floor
  # (over the top-k support) is about 0 here.
  mass = np.where(batch["top_ids"] >= 0, np.exp(batch["top_logprobs"]), 0).sum(-1)
  floor = 0.0 if loss == "kl" else float((0.5 * (1 - mass) * batch["mask"]).sum()
                                         / batch["mask"].sum())
  assert float(objective(trained, batch)) - floor < 0.8 * (before - floor)
  assert np.array_equal(trained.embed, params.embed) == freeze
  assert log and 0 <= log[-1]["alpha_sampled"] <= 1 and 1 <= log[-1]["tau_greedy_est"] <= 5


def test_kill_and_resume_matches_an_uninterrupted_run(target, data_dir, tmp_path):
  rows, dcfg, params, tc = _setup(target, data_dir, grad_accum=2)
  full, _ = trainer.train(params, dcfg, rows, tc, tmp_path / "full", progress=False)
  # Killed after 7 micro-steps: the last checkpoint is at micro-step 4 (optimizer step 2).
  trainer.train(params, dcfg, rows, tc, tmp_path / "cut", progress=False, stop_after=7)
  cut_s = trainer.run_summary(tmp_path / "cut")["train_seconds_total"]
  resumed, _ = trainer.train(params, dcfg, rows, tc, tmp_path / "cut", progress=False)
  # The resumed run's total time adds to the killed run's (time behind its checkpoint).
  assert trainer.run_summary(tmp_path / "cut")["train_seconds_total"] > cut_s > 0
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(params))]
  assert any(moved)
  with pytest.raises(ValueError, match=r"other settings \(lr: .* then, 1.0 now\)"):
    trainer.train(params, dcfg, rows, dataclasses.replace(tc, lr=1.0), tmp_path / "cut",
                  progress=False)


def test_corrupted_checkpoint_is_a_clear_error(target, data_dir, tmp_path):
  rows, dcfg, params, tc = _setup(target, data_dir)
  trainer.train(params, dcfg, rows, tc, tmp_path, progress=False, stop_after=2)
  for f in (tmp_path / "checkpoints").rglob("*"):
    if f.is_file() and f.stat().st_size > 0 and "ocdbt" not in f.name:
      f.write_bytes(b"\0" * 16)
  with pytest.raises(ValueError, match="cannot be restored"):
    trainer.train(params, dcfg, rows, tc, tmp_path, progress=False)


def test_evaluate_scores_every_held_out_row_once(target, data_dir):
  rows, dcfg, params, tc = _setup(target, data_dir)
  assert len(rows) % 5  # 12 rows: batches of 5 leave a partial batch of 2
  whole = trainer.evaluate(params, dcfg, rows, tc, batch_size=len(rows))
  assert whole["positions"] == int(rows.mask.sum())
  for bs in (5, 1):
    parts = trainer.evaluate(params, dcfg, rows, tc, batch_size=bs)
    assert parts["positions"] == whole["positions"]
    for k in ("alpha_sampled", "alpha_greedy"):
      assert parts[k] == pytest.approx(whole[k], rel=1e-5)


def test_tau_from_alpha():
  assert trainer.tau_from_alpha(0.0, 4) == 1.0
  assert trainer.tau_from_alpha(1.0, 4) == 5.0
  assert trainer.tau_from_alpha(0.5, 3) == pytest.approx(1 + .5 + .25 + .125)


def test_drafter_init_from_target_and_hf_round_trip(target, tmp_path):
  assert spread_layers(30, 3) == [0, 14, 29] and spread_layers(30, 1) == [0]
  dcfg = drafter_config(target.cfg, 2)
  params = init_drafter(target.params, target.cfg, dcfg, jax.random.key(0), "target")
  np.testing.assert_array_equal(params.layers[1].wq, layer_list(target.params)[1].wq)
  narrow = drafter_config(target.cfg, 1, hidden_size=target.cfg.head_dim)
  small = init_drafter(target.params, target.cfg, narrow, jax.random.key(0), "target")
  assert small.embed.shape == (target.cfg.vocab_size, target.cfg.head_dim)
  out = save_hf(tmp_path / "d", dcfg, params, target.tokenizer, {"recipe": "test"})
  back = load(out, scan_layers=False)
  assert back.cfg == dcfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert back.tokenizer.tokens == target.tokenizer.tokens
  assert back.tokenizer.stop_token_ids == target.tokenizer.stop_token_ids
  with pytest.raises(ValueError, match="multiple of the head dim"):
    drafter_config(target.cfg, 1, hidden_size=target.cfg.head_dim + 1)
  with pytest.raises(ValueError, match="init must be"):
    init_drafter(target.params, target.cfg, dcfg, jax.random.key(0), "pretrained")


def test_recipe_with_vocab_trim_saves_a_compact_drafter_and_trim_vocab_rebuilds_it(
    target, data_dir, tmp_path):
  from jspec.io.drafter import drafter_format
  from jspec.drafting.registry import load_model_drafter
  from jspec.train.recipe import DrafterRecipe, train_drafter, trim_drafter

  path, _ = data_dir
  tc = trainer.TrainConfig(loss="tvd++", seq_len=48, batch_size=2, steps=3, warmup_steps=1,
                           eval_every=3, checkpoint_every=3, freeze_embeddings=True)
  recipe = DrafterRecipe(num_layers=1, vocab_trim=60, data_dirs=(f"{path}:2",), train=tc)
  out = train_drafter(target, tmp_path / "run", recipe, progress=False)
  first = json.loads((out / "jspec.json").read_text())
  assert first["final_eval"]["step"] == 3 and first["train_seconds_total"] > 0
  # Rerunning a finished run (a resume with nothing left) keeps what the run did.
  again = json.loads((train_drafter(target, tmp_path / "run", recipe, progress=False)
                      / "jspec.json").read_text())
  assert again["final_eval"] == first["final_eval"]
  assert again["train_seconds_total"] == first["train_seconds_total"]
  # A rerun with settings that shape another drafter does not resume this one's checkpoint.
  with pytest.raises(ValueError, match="other settings .init: 'target' then, 'random' now"):
    train_drafter(target, tmp_path / "run", dataclasses.replace(recipe, init="random"),
                  progress=False)
  fmt = drafter_format(out)
  assert fmt == {"shares_target_embedding": True, "head_is_table": True, "trimmed_vocab": 60,
                 "dtype": "float16"}
  meta = json.loads((out / "jspec.json").read_text())
  assert meta["data"][0]["shards"] == 2 and meta["train_examples"] + meta["eval_examples"] == 8
  drafter = load_model_drafter(out, target)
  keep = np.asarray(drafter.keep_ids)
  assert len(keep) == 60 and set(target.tokenizer.stop_token_ids) <= set(keep.tolist())
  # The kept ids are the most generated ones in the training part of the data.
  examples = list(distill.iter_examples(path, 2))[:-1]
  counts = distill.token_counts(examples, target.cfg.vocab_size)
  assert counts[keep].sum() >= np.sort(counts)[::-1][:60 - 1].sum()
  # trim-vocab: the full head back (the frozen head is the target's table), and another size.
  full = load_model_drafter(trim_drafter(target, out, (), target.cfg.vocab_size, tmp_path / "f"),
                            target)
  assert full.keep_ids is None
  np.testing.assert_array_equal(np.asarray(full.params.layers[0].wq, np.float16),
                                np.asarray(drafter.params.layers[0].wq, np.float16))
  small = load_model_drafter(trim_drafter(target, out, (str(path),), 20, tmp_path / "s"), target)
  assert small.params.lm_head.shape == (target.cfg.hidden_size, 20)
  with pytest.raises(ValueError, match="cannot read the first 99"):
    train_drafter(target, tmp_path / "bad", dataclasses.replace(recipe, data_dirs=(f"{path}:99",)),
                  progress=False)


def test_a_head_larger_than_the_vocabulary_is_refused_before_any_data_is_made(target, tmp_path,
                                                                              monkeypatch):
  """train-drafter counts the head's ids in the distillation it generates first (hours at real
  sizes): a head past the target's vocabulary was refused only after it."""
  from jspec.train.eagle import EagleRecipe, train_eagle
  from jspec.train.recipe import DrafterRecipe, train_drafter
  monkeypatch.setattr(distill, "build_dataset", lambda *a, **k: pytest.fail("made data first"))
  V = target.cfg.vocab_size
  with pytest.raises(ValueError, match=f"trimmed vocabulary size must be in \\[1, {V}\\]"):
    train_drafter(target, tmp_path / "d", DrafterRecipe(num_layers=1, vocab_trim=V + 1),
                  progress=False)
  with pytest.raises(ValueError, match="trimmed vocabulary size"):
    train_eagle(target, tmp_path / "e", EagleRecipe(data_dirs=("nowhere",), vocab_trim=V + 1),
                progress=False)
  assert not (tmp_path / "d").exists() and not (tmp_path / "e" / "work").exists()


def test_trim_vocab_of_an_independent_model_drafter(target, data_dir, tmp_path):
  """Any model drafter (here an HF directory of another width with its own tied table, as a GGUF
  drafter loads) gets a VocabTrim head from the target's own responses."""
  from jspec.drafting.model import trimmed_drafter
  from jspec.drafting.registry import load_model_drafter
  from jspec.io.drafter import drafter_format
  from jspec.models.llama import quantize_params
  from jspec.models.quant import Int8Weight
  from jspec.models.vocab_trim import trim_head
  from jspec.train.recipe import trim_drafter
  from test_vocab_trim import _same_drafts

  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path / "small", "llama", hidden_size=32,
                                        num_hidden_layers=1, tie_word_embeddings=True, seed=3,
                                        max_position_embeddings=1024)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  path, _ = data_dir
  out = trim_drafter(target, d, (str(path),), 30, tmp_path / "t", dtype="float32")
  assert drafter_format(out) == {"shares_target_embedding": False, "head_is_table": True,
                                 "trimmed_vocab": 30, "dtype": "float32"}
  from safetensors import safe_open
  with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
    assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
  back = load_model_drafter(out, target)
  keep = np.asarray(back.keep_ids)
  original = load_model_drafter(d, target)
  _same_drafts(back, trimmed_drafter(trim_head(original.params, keep), original.cfg, keep))
  # The kept ids are the target's most generated ones, and the record says what they cover.
  counts = distill.token_counts(list(distill.iter_examples(path)), target.cfg.vocab_size)
  assert counts[keep].sum() >= np.sort(counts)[::-1][:30 - len(target.tokenizer.stop_token_ids)].sum()
  record = json.loads((out / "jspec.json").read_text())["vocab_trim"]
  assert record["coverage"] == pytest.approx(counts[keep].sum() / counts.sum())
  assert record["counted_tokens"] == counts.sum()
  # --weights int8 quantizes a compact drafter too (its trimmed head included).
  int8 = load_model_drafter(out, target, "int8")
  assert isinstance(int8.params.lm_head, Int8Weight) and int8.params.lm_head.shape == (32, 30)
  _same_drafts(int8, trimmed_drafter(quantize_params(back.params), back.cfg, keep))
  with pytest.raises(ValueError, match="distill-data"):
    trim_drafter(target, d, (), 30, tmp_path / "nodata")


def test_heldout_acceptance_of_the_target_itself_and_a_trimmed_copy(target, data_dir):
  from jspec.drafting.registry import load_drafter
  from jspec.drafting.model import trimmed_drafter
  from jspec.models.vocab_trim import trim_head
  from jspec.train.recipe import heldout_acceptance

  path, cfg = data_dir
  examples = list(distill.iter_examples(path, 3, start_shard=1))  # 8 responses: one batch
  argmax = np.concatenate([ex.top_ids[:, 0] for ex in examples])
  top_mass = np.concatenate([np.exp(ex.top_logprobs).sum(-1) for ex in examples])
  keep = np.unique(np.concatenate([argmax[::2], np.asarray(target.tokenizer.stop_token_ids)]))
  self_draft = load_drafter("self", target)
  drafters = {"self": self_draft,
              "self-trimmed": trimmed_drafter(trim_head(self_draft.params, keep), target.cfg, keep)}
  out = heldout_acceptance(target, drafters, (f"{path}:1-3",), seq_len=96, gamma=3)
  by_name = {r["drafter"]: r for r in out}
  assert by_name["self"]["positions"] == len(argmax) == by_name["self-trimmed"]["positions"]
  # q = p: every argmax agrees, and sum_x min(p, q) is the stored top-k mass.
  assert by_name["self"]["alpha_greedy"] == 1.0 and by_name["self"]["tau_greedy_est"] == 4.0
  np.testing.assert_allclose(by_name["self"]["alpha_sampled"], top_mass.mean(), atol=2e-3)
  # Trimmed: the argmax survives exactly where the target's argmax is a kept id.
  np.testing.assert_allclose(by_name["self-trimmed"]["alpha_greedy"],
                             np.isin(argmax, keep).mean(), atol=1e-6)
  assert by_name["self-trimmed"]["head_size"] == len(keep) < target.cfg.vocab_size
  assert by_name["self-trimmed"]["data"][0]["start_shard"] == 1
  with pytest.raises(ValueError, match="need at least 8"):
    heldout_acceptance(target, drafters, (f"{path}:2-3",), seq_len=96)


def test_eval_drafter_cli(target, data_dir, tmp_path, capsys):
  from jspec.cli import main

  path, _ = data_dir
  out = tmp_path / "eval.json"
  assert main(["eval-drafter", "--target", str(target.source), "--drafters", "self,early-exit:1",
               "--data", f"{path}:1-3", "--seq-len", "96", "--json", str(out)]) == 0
  records = json.loads(out.read_text())
  assert [r["drafter"] for r in records] == ["self", "early-exit:1"]
  assert records[0]["alpha_greedy"] == 1.0 and records[1]["draft_layers"] == 1
  assert "early-exit:1" in capsys.readouterr().out
  assert main(["eval-drafter", "--target", str(target.source), "--drafters", "none",
               "--data", f"{path}:1-3"]) == 2
  assert "--drafters 'none': eval-drafter scores draft models" in capsys.readouterr().err


# ---------------------------------------------------------------------------- feature drafter
def test_eagle_objective_is_smooth_l1_plus_weighted_kl(target):
  from jspec.models.eagle import init_eagle
  from jspec.train.eagle import EagleLoss, _passes, eagle_objective
  from jspec.train.losses import forward_kl
  params, dcfg = init_eagle(target.params, target.cfg, jax.random.key(0))
  B, S, E, K = 2, 6, target.cfg.hidden_size, 3
  rng = np.random.default_rng(0)
  batch = {"tokens": jnp.asarray(rng.integers(0, 200, (B, S)), jnp.int32),
           "feats": jnp.asarray(rng.normal(size=(B, S, E)) * 2, jnp.float32),
           "mask": jnp.asarray(rng.integers(0, 2, (B, S)), jnp.float32).at[:, 1:3].set(1.0),
           "top_ids": jnp.asarray(rng.integers(0, 200, (B, S, K)), jnp.int32),
           "top_logprobs": jnp.log(jnp.full((B, S, K), 1 / K)),
           "embed": target.params.embed, "head": target.params.embed}
  loss = EagleLoss(cls_weight=0.3, unroll=1)
  (pred, logits), = _passes(params, dcfg, batch, loss, None)
  d = np.abs(np.asarray(pred) - np.asarray(batch["feats"])[:, 1:])
  per = np.where(d < 1, 0.5 * d ** 2, d - 0.5).mean(-1)
  m = np.asarray(batch["mask"])[:, 1:]
  want = (per * m).sum() / m.sum() + 0.3 * float(forward_kl(
      logits, batch["top_ids"][:, 1:], batch["top_logprobs"][:, 1:], batch["mask"][:, 1:]))
  np.testing.assert_allclose(float(eagle_objective(dcfg, loss)(params, batch)), want, rtol=1e-5)
  # Unroll 2 adds a second pass whose pair j reads pass one's prediction of f_j.
  two = _passes(params, dcfg, batch, EagleLoss(unroll=2), None)
  assert not np.allclose(two[1][0], two[0][0])
  np.testing.assert_allclose(two[0][0], pred, rtol=1e-6)


def test_eagle_feature_noise_reaches_the_optimizer_step(target):
  """--noise perturbs the input features in training (the step passed the objective no key, so
  noise 5 trained exactly what noise 0 did); the key is the seed's and the micro-step's."""
  from jspec.models.eagle import init_eagle
  from jspec.train.eagle import EagleLoss, eagle_objective
  params, dcfg = init_eagle(target.params, target.cfg, jax.random.key(0))
  B, S, E, K = 2, 6, target.cfg.hidden_size, 3
  rng = np.random.default_rng(1)
  batch = {"tokens": jnp.asarray(rng.integers(0, 200, (B, S)), jnp.int32),
           "feats": jnp.asarray(rng.normal(size=(B, S, E)), jnp.float32),
           "mask": jnp.ones((B, S), jnp.float32),
           "top_ids": jnp.asarray(rng.integers(0, 200, (B, S, K)), jnp.int32),
           "top_logprobs": jnp.log(jnp.full((B, S, K), 1 / K)),
           "embed": target.params.embed, "head": target.params.embed}
  tc = trainer.TrainConfig(loss="eagle", steps=5, warmup_steps=0)
  opt = trainer.optimizer(tc)
  key = jax.random.key(3)
  values = {}
  for noise in (0.0, 0.0, 5.0):
    step = trainer.make_step(dcfg, tc, opt, eagle_objective(dcfg, EagleLoss(noise=noise)))
    values.setdefault(noise, []).append(float(step(params, opt.init(params), batch, key)[2]))
  assert values[0.0][0] == values[0.0][1] and values[5.0][0] != values[0.0][0], values


def test_a_feature_run_resumed_with_other_loss_settings_is_refused(tmp_path):
  """The loss settings (cls_weight, unroll, noise; EAGLE-3's and ConFu's passes and anchors) bind
  a feature run's work directory like its data settings (a resume switched objective silently)."""
  from jspec.train.eagle import EagleLoss, feature_data
  for loss in (EagleLoss(cls_weight=0.1, unroll=2), EagleLoss(cls_weight=10.0, unroll=2)):
    if loss.cls_weight == 10.0:
      (tmp_path / "work" / "checkpoints" / "2").mkdir(parents=True)  # the first run saved one
      with pytest.raises(ValueError, match="other settings .*loss: .*cls_weight.: 0.1.*then"):
        feature_data(None, tmp_path, "eagle", (), 0, 12, loss=loss)
    else:
      with pytest.raises(ValueError, match="pass --data"):  # recorded, then no data given
        feature_data(None, tmp_path, "eagle", (), 0, 12, loss=loss)


def test_eagle_recipe_trains_resumes_saves_and_decodes_losslessly(target, data_dir, tmp_path):
  from jspec.generate import generate
  from jspec.drafting.registry import load_drafter
  from jspec.drafting.feature import EagleDrafter
  from jspec.models.eagle import init_eagle
  from jspec.speculative.chain import SpecConfig, speculative_generate
  from jspec.train.eagle import EagleLoss, EagleRecipe, eagle_objective, train_eagle
  from jspec.train.features import cached_features

  path, _ = data_dir
  tc = trainer.TrainConfig(loss="eagle", seq_len=48, batch_size=4, steps=24, lr=3e-3,
                           warmup_steps=1, eval_every=12, checkpoint_every=4)
  recipe = EagleRecipe(data_dirs=(str(path),), vocab_trim=60, train=tc)
  out = train_eagle(target, tmp_path / "run", recipe, progress=False)
  log = [json.loads(l) for l in (tmp_path / "run/work/log.jsonl").read_text().splitlines()]
  assert [e["step"] for e in log] == [12, 24]
  # Other data settings into this run's directory: refused before any feature is computed.
  features = sorted((tmp_path / "run/features").iterdir())
  with pytest.raises(ValueError, match="vocab_trim: 60 then, 30 now"):
    train_eagle(target, tmp_path / "run", dataclasses.replace(recipe, vocab_trim=30),
                progress=False)
  assert sorted((tmp_path / "run/features").iterdir()) == features
  assert 0 <= log[-1]["alpha_greedy_draft2"] <= 1 and log[-1]["positions"] > 0
  # Training lowered the objective on the training rows.
  rows = trainer.make_rows(list(distill.iter_examples(path)), 48)
  feats = cached_features(target.params, target.cfg, rows.tokens,
                          tmp_path / "run/features/all.npy", progress=False)
  drafter = load_drafter(f"model:{out}", target)
  assert isinstance(drafter, EagleDrafter) and drafter.head.shape[0] == 60
  init, dcfg = init_eagle(target.params, target.cfg, jax.random.key(0))
  from jspec.train.eagle import with_features
  table = target.params.embed
  full_rows = with_features(rows, feats, table, table)
  batch = full_rows.take(np.arange(len(rows)))
  objective = jax.jit(eagle_objective(dcfg, EagleLoss()))
  trained = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), drafter.params)
  assert float(objective(trained, batch)) < 0.8 * float(objective(init, batch))
  # Kill and resume: the same parameters as the uninterrupted run.
  shutil.copytree(tmp_path / "run/features", tmp_path / "cut/features")
  import jspec.train.trainer as tr
  real_train = tr.train
  calls = []
  def killed(*a, **kw):
    calls.append(1)
    return real_train(*a, **kw, stop_after=10) if len(calls) == 1 else real_train(*a, **kw)
  tr.train = killed
  try:
    train_eagle(target, tmp_path / "cut", recipe, progress=False)
    cut = train_eagle(target, tmp_path / "cut", recipe, progress=False)
  finally:
    tr.train = real_train
  resumed = load_drafter(f"model:{cut}", target)
  for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Lossless greedy decoding with the trained drafter.
  prompts = [list(r[r > 0][:10]) for r in rows.tokens[:3]]
  want = generate(target.params, target.cfg, prompts, max_new_tokens=12).sequences()
  got = speculative_generate(target.params, target.cfg, drafter, prompts,
                             spec=SpecConfig(gamma=3, max_new_tokens=12))
  assert got.sequences() == want
  # A cache of features made for other rows is refused, not silently reused.
  with pytest.raises(ValueError, match="other rows"):
    cached_features(target.params, target.cfg, rows.tokens[:, :40],
                    tmp_path / "run/features/all.npy", progress=False)
  # A corrupt drafter file is a clear error.
  (out / "model.safetensors").write_bytes(b"garbage")
  with pytest.raises(ValueError, match="corrupt"):
    load_drafter(f"model:{out}", target)


@pytest.fixture(scope="module")
def target6(tmp_path_factory):
  """A 6-layer target: EAGLE-3 fuses three distinct layers (1, 3, 5 here)."""
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path_factory.mktemp("target6"), "llama",
                                        max_position_embeddings=1024, num_hidden_layers=6)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  return load(d)


def assert_decodes_losslessly(target, drafter, rows):
  """Greedy chains and trees with a trained drafter equal the target's own greedy output."""
  from jspec.generate import generate
  from jspec.speculative.chain import SpecConfig, speculative_generate
  from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
  prompts = [list(r[r > 0][:10]) for r in rows.tokens[:3]]
  want = generate(target.params, target.cfg, prompts, max_new_tokens=12).sequences()
  got = speculative_generate(target.params, target.cfg, drafter, prompts,
                             spec=SpecConfig(gamma=3, max_new_tokens=12))
  assert got.sequences() == want
  got = tree_speculative_generate(target.params, target.cfg, drafter, prompts,
                                  spec=TreeSpecConfig("fixed:2-2-1", max_new_tokens=12))
  assert got.sequences() == want


def test_eagle3_recipe_trains_saves_and_decodes_losslessly(target6, tmp_path):
  from jspec.drafting.feature import EagleDrafter
  from jspec.drafting.registry import load_drafter
  from jspec.models.eagle3 import Eagle3Params, init_eagle3
  from jspec.models.vocab_trim import full_to_trimmed
  from jspec.train.eagle import with_features
  from jspec.train.eagle3 import Eagle3Loss, Eagle3Recipe, eagle3_objective, train_eagle3
  from jspec.train.features import cached_features

  cfg = distill.DataConfig(num_prompts=12, max_prompt_tokens=64, max_new_tokens=24, batch_size=4,
                           top_k=8, temperatures=(0.0, 1.0))
  path = distill.build_dataset(target6, TEXTS, tmp_path / "data", cfg, progress=False)
  tc = trainer.TrainConfig(loss="eagle3", seq_len=48, batch_size=4, steps=24, lr=3e-3,
                           warmup_steps=1, eval_every=12, checkpoint_every=12)
  recipe = Eagle3Recipe(data_dirs=(str(path),), vocab_trim=60, train=tc,
                        loss=Eagle3Loss(steps=3))
  out = train_eagle3(target6, tmp_path / "run", recipe, progress=False)
  log = [json.loads(l) for l in (tmp_path / "run/work/log.jsonl").read_text().splitlines()]
  assert [e["step"] for e in log] == [12, 24]
  assert 0 <= log[-1]["alpha_greedy_draft3"] <= 1 and log[-1]["positions"] > 0
  drafter = load_drafter(f"model:{out}", target6)
  assert isinstance(drafter, EagleDrafter) and isinstance(drafter.params, Eagle3Params)
  assert drafter.params.head.shape[0] == 60 and drafter.feature_layers == (1, 3, 5)
  # Training lowered the objective on the training rows (the trained head is in the draft
  # vocabulary the saved drafter names).
  keep = np.asarray(drafter.keep_ids)
  rows = trainer.make_rows(list(distill.iter_examples(path)), 48,
                           full_to_trimmed(keep, target6.cfg.vocab_size))
  feats = cached_features(target6.params, target6.cfg, rows.tokens,
                          tmp_path / "run/features/taps.npy", progress=False,
                          taps=drafter.feature_layers)
  batch = with_features(rows, feats, target6.params.embed, None).take(np.arange(len(rows)))
  # Pass s at index j scores t_{j+s+2}: the teacher's top-1 there is that very token on the
  # greedy (T=0) half of the rows and often on the sampled half; one position off, rarely.
  from jspec.train.eagle3 import _shifted
  for s_ in range(3):
    top1 = np.asarray(_shifted(jnp.asarray(rows.top_ids), s_, -1))[..., 0]  # [N, S-1]
    nxt = full_to_trimmed(keep, target6.cfg.vocab_size)[rows.tokens[:, 2 + s_:]]
    m = np.asarray(_shifted(jnp.asarray(rows.mask), s_, 0.0))[:, :nxt.shape[1]] > 0
    hits = (top1[:, :nxt.shape[1]] == nxt) & m & (nxt >= 0)
    assert hits.sum() >= 0.4 * (m & (nxt >= 0)).sum(), (s_, hits.sum(), m.sum())
  objective = jax.jit(eagle3_objective(drafter.cfg, Eagle3Loss(steps=3)))
  init, _ = init_eagle3(target6.params, target6.cfg, jax.random.key(0), keep)
  trained = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), drafter.params)
  assert float(objective(trained, batch)) < 0.8 * float(objective(init, batch))
  assert_decodes_losslessly(target6, drafter, rows)
  # Held-out acceptance (jspec eval-drafter): every draft of the chain scored, tau from them.
  from jspec.train.recipe import heldout_acceptance
  [rec] = heldout_acceptance(target6, {"eagle3": drafter}, (str(path),), seq_len=48, gamma=3)
  alphas = [rec[f"alpha_greedy_draft{i}"] for i in (1, 2, 3)]
  assert all(0 <= a <= 1 for a in alphas) and rec["alpha_greedy"] == alphas[0]
  want_tau = 1 + alphas[0] + alphas[0] * alphas[1] + alphas[0] * alphas[1] * alphas[2]
  assert rec["tau_greedy_est"] == pytest.approx(want_tau)
  # A drafter made for another target (other layers fused) is refused by name.
  fmt_file = out / "jspec.json"
  meta = json.loads(fmt_file.read_text())
  meta["drafter_format"]["taps"] = [2, 3, 4]
  fmt_file.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="fuses target layers"):
    load_drafter(f"model:{out}", target6)


def test_confu_recipe_trains_saves_and_decodes_losslessly(target6, tmp_path):
  from jspec.drafting.confu import ConFuDrafter
  from jspec.drafting.registry import load_drafter
  from jspec.models.confu import ConFuParams
  from jspec.models.vocab_trim import full_to_trimmed
  from jspec.train.confu import (ConFuLoss, ConFuRecipe, confu_objective, init_confu,
                                 train_confu, with_target)
  from jspec.train.eagle import with_features
  from jspec.train.eagle3 import Eagle3Loss
  from jspec.train.features import cached_features
  from jspec.train.recipe import heldout_acceptance

  cfg = distill.DataConfig(num_prompts=12, max_prompt_tokens=64, max_new_tokens=24, batch_size=4,
                           top_k=8, temperatures=(0.0, 1.0))
  path = distill.build_dataset(target6, TEXTS, tmp_path / "data", cfg, progress=False)
  tc = trainer.TrainConfig(loss="confu", seq_len=48, batch_size=4, steps=24, lr=3e-3,
                           warmup_steps=1, eval_every=12, checkpoint_every=12)
  recipe = ConFuRecipe(data_dirs=(str(path),), vocab_trim=60, train=tc, soft_tokens=2,
                       loss=ConFuLoss(ttt=Eagle3Loss(steps=3), anchors=6))
  out = train_confu(target6, tmp_path / "run", recipe, progress=False)
  log = [json.loads(l) for l in (tmp_path / "run/work/log.jsonl").read_text().splitlines()]
  assert [e["step"] for e in log] == [12, 24]
  assert 0 <= log[-1]["alpha_greedy_draft3"] <= 1 and log[-1]["positions"] > 0
  drafter = load_drafter(f"model:{out}", target6)
  assert isinstance(drafter, ConFuDrafter) and drafter.soft_tokens == 2
  assert float(jnp.abs(drafter.contemplate.proj).max()) > 0  # the signal was learned
  # Training lowered the objective on the training rows, anchors as training draws them.
  keep = np.asarray(drafter.keep_ids)
  rows = trainer.make_rows(list(distill.iter_examples(path)), 48,
                           full_to_trimmed(keep, target6.cfg.vocab_size))
  feats = cached_features(target6.params, target6.cfg, rows.tokens,
                          tmp_path / "run/features/taps.npy", progress=False,
                          taps=drafter.feature_layers)
  batch = with_target(with_features(rows, feats, target6.params.embed, None), target6.params,
                      6).take(np.arange(len(rows)))
  objective = jax.jit(confu_objective(drafter.cfg, target6.cfg, recipe.loss))
  init, _ = init_confu(target6, recipe, jax.random.key(0), keep)
  trained = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                         ConFuParams(drafter.params, drafter.contemplate))
  assert float(objective(trained, batch)) < 0.8 * float(objective(init, batch))
  assert_decodes_losslessly(target6, drafter, rows)
  # Held-out acceptance (jspec eval-drafter), every draft of the chain scored.
  [rec] = heldout_acceptance(target6, {"confu": drafter}, (str(path),), seq_len=48, gamma=3)
  alphas = [rec[f"alpha_greedy_draft{i}"] for i in (1, 2, 3)]
  assert all(0 <= a <= 1 for a in alphas) and rec["positions"] > 0
  # A file without ConFu's weights is refused by name.
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(out / "model.safetensors"))
  del tensors["contemplate.soft"]
  save_file(tensors, str(out / "model.safetensors"))
  with pytest.raises(ValueError, match="lacks drafter weights"):
    load_drafter(f"model:{out}", target6)


@pytest.mark.parametrize("field", ["num_prompts", "max_new_tokens", "batch_size", "top_k"])
def test_data_settings_below_one_are_refused(field):
  with pytest.raises(ValueError, match=f"DataConfig {field} must be an integer >= 1, got 0"):
    distill.DataConfig(**{field: 0})


def test_rows_refuse_a_seq_len_that_leaves_no_response_token():
  """Prompts longer than seq_len leave nothing to learn: refused, not a run at loss 0."""
  ex = distill.Example(prompt=np.arange(10, dtype=np.int32), response=np.arange(4, dtype=np.int32),
                       top_ids=np.zeros((4, 2), np.int32), top_logprobs=np.zeros((4, 2), np.float32))
  assert trainer.make_rows([ex], seq_len=10).mask.sum() == 1  # the last prompt position
  with pytest.raises(ValueError, match="no response token fits seq_len=9.*>= 10"):
    trainer.make_rows([ex], seq_len=9)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=float("nan")), "lr must be a finite number > 0"),
    (dict(lr=-0.1), "lr must be a finite number > 0"),
    (dict(steps=-3), "steps must be an integer >= 0"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0"),
    (dict(seq_len=4.0), "seq_len must be an integer >= 2"),
])
def test_train_config_refuses_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    trainer.TrainConfig(**kwargs)


def test_resume_settings_bind_once_a_checkpoint_exists(tmp_path):
  """A run that failed before its first checkpoint may be rerun with a setting fixed; once it
  has saved one, other settings are refused, naming what changed."""
  work = tmp_path / "work"
  trainer.check_resume(work, {"layers": 2, "data": ("a",)})
  trainer.check_resume(work, {"layers": 3, "data": ("a",)})  # nothing saved yet
  (work / "checkpoints" / "4").mkdir(parents=True)
  trainer.check_resume(work, {"layers": 3, "data": ("a",)})  # the same: resumes
  with pytest.raises(ValueError, match="layers: 3 then, 2 now"):
    trainer.check_resume(work, {"layers": 2, "data": ("a",)})
