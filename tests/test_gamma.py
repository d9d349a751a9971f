"""`--gamma auto`: the expected-speed arithmetic against hand-computed values, and a calibration
on a tiny model whose self drafter is always accepted (so the measured acceptance is known)."""

import jax
import numpy as np
import pytest

from jspec.bench.gamma import choose_gamma, expected_rows
from jspec.drafting.model import ModelDrafter
from jspec.drafting.ngram import NgramDrafter
from jspec.model import Model
from jspec.models.config import Config
from jspec.models.llama import init_params

CFG = Config(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)


def test_expected_rows_by_hand():
  # Drafts accepted with probability 0.9, 0.6, 0.3; a draft step costs 0.1 of an AR step and
  # verifying T tokens costs 1 + 0.05 (T - 1) AR steps.
  rows = expected_rows([0.9, 0.6, 0.3], 0.1, lambda T: 1 + 0.05 * (T - 1), 1.0)
  want_tokens = [1.9, 2.5, 2.8]
  want_round = [1.15, 1.3, 1.45]
  np.testing.assert_allclose([r["tokens_per_round"] for r in rows], want_tokens)
  np.testing.assert_allclose([r["round_s"] for r in rows], want_round)
  np.testing.assert_allclose([r["speedup_vs_ar"] for r in rows],
                             np.divide(want_tokens, want_round))
  assert max(rows, key=lambda r: r["speedup_vs_ar"])["gamma"] == 3


@pytest.fixture(scope="module")
def tiny():
  params = init_params(CFG, jax.random.key(0), scale=0.3)
  return Model(CFG, params, tokenizer=None, source="tiny")  # calibration needs no text


def test_calibration_of_a_drafter_that_is_always_accepted(tiny):
  choice = choose_gamma(tiny, ModelDrafter(tiny.params, CFG), [3, 1, 4, 1, 5], max_gamma=3,
                        calibration_tokens=16)
  assert choice.accepted_at == (1.0, 1.0, 1.0)  # the target drafting for itself
  assert [r["tokens_per_round"] for r in choice.rows] == [2.0, 3.0, 4.0]
  assert choice.ar_step_s > 0 and all(r["round_s"] > 0 for r in choice.rows)
  assert choice.gamma == max(choice.rows, key=lambda r: r["speedup_vs_ar"])["gamma"]
  assert "<- chosen" in choice.table()


def test_calibration_costs_come_from_the_round_split(tiny, monkeypatch):
  """Draft step = (layers + head) / max_gamma; verifying T tokens is linear between the AR step
  (T = 1) and the measured max_gamma + 1 block."""
  split = {"draft_layers": 0.3, "draft_head": 0.06, "verify_layers": 1.5, "verify_head": 0.5,
           "ar_step": 1.0}
  monkeypatch.setattr("jspec.bench.gamma.round_split_s", lambda *a, **k: split)
  choice = choose_gamma(tiny, ModelDrafter(tiny.params, CFG), [3, 1, 4, 1, 5], max_gamma=3,
                        calibration_tokens=16)
  # gamma g: g * 0.12 + (1 + (2 - 1) * g / 3) seconds; tokens 1 + g (always accepted).
  want = [g * 0.12 + 1 + g / 3 for g in (1, 2, 3)]  # 1.453, 1.907, 2.36
  np.testing.assert_allclose([r["round_s"] for r in choice.rows], want)
  np.testing.assert_allclose([r["speedup_vs_ar"] for r in choice.rows],
                             np.divide([2, 3, 4], want))
  assert choice.gamma == 3 and choice.ar_step_s == 1.0


def test_needs_a_model_drafter(tiny):
  with pytest.raises(ValueError, match="needs a model drafter"):
    choose_gamma(tiny, NgramDrafter(vocab=CFG.vocab_size), [1, 2, 3])


def test_a_calibration_run_needs_a_round(tiny):
  drafter = ModelDrafter(tiny.params, tiny.cfg)
  with pytest.raises(ValueError, match="calibration_tokens must be an integer >= 2"):
    choose_gamma(tiny, drafter, [1, 2, 3], calibration_tokens=1)


def test_calibration_runs_under_the_budget_the_run_will_have(tiny, monkeypatch):
  """Under a KV budget the calibration run evicts as the run will (the target evicts, the self
  drafter keeps a full cache: acceptance below 1, equal to that budgeted run's) and the pieces
  are timed over the budgeted cache at a context it holds, not over the whole prompt."""
  from jspec.kv.policy import KVPolicy
  from jspec.speculative.loop import budgeted_slots
  kv = KVPolicy("h2o", budget=16, sinks=2, chunk=8, evict_every=4)
  prompt = [(5 * i + 3) % 64 for i in range(120)]
  seen = {}
  monkeypatch.setattr("jspec.bench.gamma.round_split_s",
                      lambda *a, context, cache_size, **k: seen.update(
                          context=context, cache_size=cache_size) or {
                          "draft_layers": 0.3, "draft_head": 0.06, "verify_layers": 1.5,
                          "verify_head": 0.5, "ar_step": 1.0})
  drafter = ModelDrafter(tiny.params, CFG)
  choice = choose_gamma(tiny, drafter, prompt, max_gamma=3, calibration_tokens=16, kv=kv)
  want = tiny.generate_ids([prompt], max_new_tokens=16, stop=False, drafter=drafter, gamma=3,
                           kv=kv).acceptance_rate
  np.testing.assert_allclose(choice.accepted_at, want)
  assert min(choice.accepted_at) < 1.0  # the budget changed what the target says
  assert seen == {"context": 16 + 4 - 1, "cache_size": budgeted_slots(kv, drafter, 4)}
