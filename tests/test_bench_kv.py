"""jspec bench-kv: task construction (lengths, needles, scoring), the teacher-forced KL path (zero
for a budget that never binds, positive for one that does), records and the plot."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench import kv as bench_kv
from jspec.kv.policy import KVPolicy
from jspec.model import load
from jspec.models.cache import KVCache
from jspec.models.llama import forward
from jspec.score import score

import ggufutil

TEXT = ("The quick brown fox jumps over the lazy dog while the rain in Spain stays mainly in the "
        "plain, and everyone agrees that tests should be able to fail. ")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama",
                                        max_position_embeddings=2048)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  return load(str(d))


def texts():
  return itertools.repeat(TEXT)


@pytest.mark.parametrize("task", ["passkey", "multikey", "vt"])
def test_retrieval_prompts_have_the_context_length_and_their_needles(tiny, task):
  rng = np.random.default_rng(0)
  filler = bench_kv.haystack_ids(tiny.tokenizer, texts(), 400)
  prompt, wanted, others = bench_kv.make_task(task, tiny.tokenizer, filler, 400, rng)
  assert len(prompt) == 400
  text = tiny.tokenizer.decode(prompt)
  assert all(w in text for w in wanted) and all(o in text for o in others)
  assert (len(wanted), len(others)) == {"passkey": (1, 0), "multikey": (1, 3), "vt": (4, 4)}[task]
  assert text.rstrip().endswith("are" if task == "vt" else "is")
  if task == "vt":  # each chain's hops in order: VAR a = value, VAR b = VAR a, ...
    for names in (wanted, others):
      hops = [text.index(f"VAR {names[0]} = ")] + [text.index(f"VAR {b} = VAR {a}.")
                                                   for a, b in zip(names, names[1:])]
      assert hops == sorted(hops)
    value = text.split(f"VAR {wanted[0]} = ")[1][:5]
    assert text.rstrip().endswith(f"assigned the value {value} are")


def test_answers_are_scored_by_the_asked_items_alone():
  assert bench_kv.is_correct(" 12345. Remember", ["12345"], [])
  assert not bench_kv.is_correct(" 1234", ["12345"], [])
  assert not bench_kv.is_correct(" 12345 or 54321", ["12345"], ["54321"])  # hedging is wrong
  chain, decoy = ["ABCDE", "FGHIJ"], ["KLMNO"]
  assert bench_kv.is_correct(" ABCDE, FGHIJ.", chain, decoy)
  assert not bench_kv.is_correct(" ABCDE and more", chain, decoy)  # every hop is needed
  assert not bench_kv.is_correct(" ABCDE, FGHIJ, KLMNO", chain, decoy)
  assert not bench_kv.is_correct(" ABCDEF, FGHIJ", chain, decoy)  # whole names only


def test_kl_is_zero_without_eviction_and_positive_with_it(tiny):
  tokens = jnp.asarray([bench_kv.haystack_ids(tiny.tokenizer, texts(), 200)])
  full = bench_kv.policy_for("full", 0, 200, 0, 32, 0, 0)
  ref = bench_kv._continuation_jit(tiny.params, tiny.cfg, tokens, 160, full)
  # The same run on a cache exactly as big as needed (never evicts) gives the same distributions.
  same = bench_kv._continuation_jit(tiny.params, tiny.cfg, tokens, 160,
                                    KVPolicy("streaming", budget=232, sinks=0, chunk=16))
  kl, agree = bench_kv.kl_and_agreement(ref, same)
  assert abs(kl) < 1e-5 and agree == 1.0
  tight = bench_kv._continuation_jit(tiny.params, tiny.cfg, tokens, 160, KVPolicy(
      "keydiff", budget=24, sinks=2, chunk=16, evict_every=1))
  kl, agree = bench_kv.kl_and_agreement(ref, tight)
  assert kl > 1e-4 and 0.0 <= agree <= 1.0
  # The continuation evicts at the policy's cadence: every 4 tokens is another run than every one.
  every4 = bench_kv._continuation_jit(tiny.params, tiny.cfg, tokens, 160,
                                      KVPolicy("keydiff", budget=24, sinks=2, chunk=16,
                                               evict_every=4))
  assert float(jnp.max(jnp.abs(every4 - tight))) > 1e-4
  # Teacher forcing is right: row i is the next-token distribution after tokens[:160 + i], as one
  # uncached forward over the whole sequence computes it.
  logits, _, _ = forward(tiny.params, tiny.cfg, tokens, jnp.arange(200)[None],
                         KVCache.init(tiny.cfg, 1, 200))
  np.testing.assert_allclose(ref, jax.nn.log_softmax(logits[0, 159:199]), rtol=1e-4, atol=1e-4)


def test_pallas_attention_runs_the_continuation_and_counts_the_slots_it_allocates(tiny):
  """Under the tree-attention kernel the cache is rounded up to its 16-slot blocks: the KL task
  allocated the policy's 58 slots (refused by the kernel) and the bytes counted those 58."""
  import dataclasses
  cfg = dataclasses.replace(tiny.cfg, attention_impl="pallas-interpret")
  policy = KVPolicy("keydiff", budget=42, sinks=2, chunk=16)
  assert policy.slots % 16
  itemsize = 4
  per_slot = cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim * itemsize + 4)
  assert bench_kv.cache_bytes(cfg, policy, itemsize) == -(-policy.slots // 16) * 16 * per_slot
  assert bench_kv.cache_bytes(tiny.cfg, policy, itemsize) == policy.slots * per_slot
  tokens = jnp.asarray([bench_kv.haystack_ids(tiny.tokenizer, texts(), 72)])
  params = load(tiny.source, "float32-xla").params  # the tree kernel takes XLA's formats
  out = bench_kv._continuation_jit(params, cfg, tokens, 64, policy)
  assert out.shape == (8, cfg.vocab_size) and bool(jnp.all(jnp.isfinite(out)))


def test_records_and_plot(tiny, tmp_path):
  setup = bench_kv.BenchKV(methods=["full", "keydiff", "h2o+caote"], budgets=[48], context=160,
                           tasks=["passkey", "kl", "ppl"], num_samples=1, chunk=16, continuation=8,
                           decode_tokens=9, evict_every=3)
  records = bench_kv.run_bench_kv(tiny, setup, texts(), progress=lambda r: None)
  got = {(r["task"], r["method"]) for r in records}
  assert got == {("passkey", "full"), ("passkey", "keydiff"), ("passkey", "h2o+caote"),
                 ("kl", "keydiff"), ("kl", "h2o+caote"), ("ppl", "keydiff"), ("ppl", "h2o+caote")}
  full = next(r for r in records if r["method"] == "full")
  kd = next(r for r in records if r["method"] == "keydiff" and r["task"] == "kl")
  for r in records:
    assert r["seconds"] > 0
    if r["task"] == "passkey":
      assert r["prefill_s"] > 0
      assert r["decode_tokens_per_s"] is None or 0 < r["decode_tokens_per_s"] < 1e7
  assert kd["peak_kv_bytes"] < full["peak_kv_bytes"] and kd["kl"] >= 0
  assert kd["budget"] == 48 and kd["budget_fraction"] == pytest.approx(48 / 160)
  assert kd["evict_every"] == 3 and kd["continuation"] == 8
  # ppl: the budgeted read's perplexity over the full cache's, on the same 160 tokens.
  ppl = next(r for r in records if r["method"] == "keydiff" and r["task"] == "ppl")
  text = bench_kv.haystack_ids(tiny.tokenizer, texts(), 160 + 8)[:160]  # the sample's context
  full_ppl = float(score(tiny.params, tiny.cfg, [text], chunk=16).perplexity()[0])
  assert ppl["full_perplexity"] == pytest.approx(full_ppl, rel=1e-5)
  assert ppl["perplexity_ratio"] == pytest.approx(ppl["perplexity"] / full_ppl, rel=1e-5)
  assert ppl["perplexity_ratio"] != pytest.approx(1.0, abs=1e-4)  # 48 slots of 160 lose something
  pytest.importorskip("matplotlib")
  bench_kv.plot(records, tmp_path / "kv.png")
  assert (tmp_path / "kv.png").stat().st_size > 1000


def test_full_cache_runs_only_when_listed(tiny):
  setup = bench_kv.BenchKV(methods=["streaming"], budgets=[48], context=160, tasks=["passkey"],
                           num_samples=1, chunk=16, time_decode=False)
  records = bench_kv.run_bench_kv(tiny, setup, texts(), progress=lambda r: None)
  assert [(r["method"], r["budget"]) for r in records] == [("streaming", 48)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(methods=["keydif"]), "unknown KV method"),
    (dict(tasks=["needle"]), "unknown task"),
    (dict(decode_tokens=1), "decode_tokens 1"),
    (dict(budgets=[4096]), "must be below the context"),
    (dict(methods=["keydiff"], budgets=[0]), "budget must be a positive integer"),
    (dict(methods=["full", "h2o"], budgets=[64, 4]), "leaves no slot to choose"),
    (dict(methods=["keydiff"], evict_every=0), "evict_every must be a positive integer"),
    (dict(tasks=["kl"], continuation=0), "kl task scores `continuation` tokens"),
])
def test_bad_settings_are_refused(kwargs, match):
  base = dict(methods=["full"], budgets=[64], context=512)
  with pytest.raises(ValueError, match=match):
    bench_kv.BenchKV(**{**base, **kwargs})
