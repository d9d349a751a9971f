"""`--gamma auto`: the chain length with the most expected tokens per second for this target, this
drafter and this machine, from measured acceptance and measured costs.

Expected tokens of a round of gamma drafts: 1 + sum_{i <= gamma} P(draft i accepted). A draft's
acceptance depends only on the drafts before it, so ONE calibration run at `max_gamma` measures
every shorter chain too: P(draft i accepted) = accepted_at[i - 1] / row_rounds.
Cost of a round: gamma drafter steps + one target forward of gamma + 1 tokens, from the round
split (`bench.round_split`: each piece jitted and timed alone) at max_gamma; the verification
forward is linear between the one-token step (also the baseline: one autoregressive step) and the
max_gamma + 1 token block. This is the expected speed-up of Leviathan et al. (2023, section 3.4)
with the acceptance per position measured instead of assumed constant. Under a KV budget both are
measured as the run will go: the calibration run evicts like it, and the pieces are timed over a
budget-sized cache at a context the budget holds.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jspec.bench.round_split import round_split_s
from jspec.decode import plan_cache
from jspec.drafting.model import ModelDrafter
from jspec.kv.policy import KVPolicy
from jspec.model import Model
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.speculative.loop import budgeted_slots


@dataclasses.dataclass(frozen=True)
class GammaChoice:
  gamma: int
  rows: tuple[dict, ...]  # per gamma: tokens_per_round, round_s, speedup_vs_ar
  accepted_at: tuple[float, ...]  # P(draft i accepted), i = 1 .. max_gamma
  ar_step_s: float

  def table(self) -> str:
    lines = ["gamma  tokens/round  round s  expected speed-up vs AR"]
    for r in self.rows:
      mark = "  <- chosen" if r["gamma"] == self.gamma else ""
      lines.append(f"{r['gamma']:5d}  {r['tokens_per_round']:12.2f}  {r['round_s']:7.3f}  "
                   f"{r['speedup_vs_ar']:6.2f}x{mark}")
    return "\n".join(lines)


def expected_rows(accepted_at: Sequence[float], draft_step_s: float, verify_s,
                  ar_step_s: float) -> list[dict]:
  """Per gamma 1 .. len(accepted_at): expected tokens per round, seconds per round (gamma draft
  steps + `verify_s(gamma + 1)`) and the expected speed-up over one token per `ar_step_s`."""
  rows = []
  for gamma in range(1, len(accepted_at) + 1):
    tokens = 1.0 + float(np.sum(accepted_at[:gamma]))
    round_s = gamma * draft_step_s + verify_s(gamma + 1)
    rows.append({"gamma": gamma, "tokens_per_round": tokens, "round_s": round_s,
                 "speedup_vs_ar": tokens * ar_step_s / round_s})
  return rows


def choose_gamma(model: Model, drafter: ModelDrafter, prompt: Sequence[int], *,
                 max_gamma: int = 8, sampling: SamplingParams = GREEDY, key: int = 0,
                 calibration_tokens: int = 64, kv: KVPolicy | None = None,
                 draft_kv: KVPolicy | None = None) -> GammaChoice:
  """Calibrate on `prompt` (one speculative run at max_gamma + the round split) and pick gamma.

  kv, draft_kv: the budget the run will have (`Model.generate_ids`): calibrating on a full cache
  would prefill a long prompt whole (the memory the budget exists to avoid) and time forwards over
  a cache the run never has."""
  sampling.require_uniform("gamma='auto' (a calibration run)")
  if not isinstance(drafter, ModelDrafter):
    raise ValueError(f"--gamma auto times the drafter's network, so it needs a model drafter "
                     f"(default, self, early-exit:K, model:PATH), got {type(drafter).__name__}; "
                     f"pass a number, e.g. --gamma 4")
  if int(max_gamma) != max_gamma or max_gamma < 1:
    raise ValueError(f"max_gamma must be an integer >= 1, got {max_gamma}")
  if int(calibration_tokens) != calibration_tokens or calibration_tokens < 2:
    raise ValueError(f"calibration_tokens must be an integer >= 2 (the first token is sampled "
                     f"before any verification round), got {calibration_tokens}")
  out = model.off_mesh_for(1).generate_ids([prompt], max_new_tokens=calibration_tokens,
                                           sampling=sampling, key=key, stop=False,
                                           drafter=drafter, gamma=max_gamma, kv=kv,
                                           draft_kv=draft_kv)
  accepted_at = out.acceptance_rate  # [max_gamma]: P(draft i accepted)
  context = len(prompt) + calibration_tokens // 2
  if kv is None:
    _, cache_size = plan_cache(model.cfg, [len(prompt)], calibration_tokens,
                               reserve=max_gamma + 1)
  else:  # the budgeted target's slots, holding at most a full row's entries
    cache_size = budgeted_slots(kv, drafter, max_gamma + 1)
    context = min(context, kv.full_row)
  split = round_split_s(model.params, model.cfg, drafter, max_gamma,
                        sampling.as_arrays(), context=context,
                        cache_size=cache_size)
  draft_step_s = (split["draft_layers"] + split["draft_head"]) / max_gamma
  ar_step_s = split["ar_step"]
  block_s = split["verify_layers"] + split["verify_head"]  # max_gamma + 1 tokens
  verify_s = lambda T: ar_step_s + (block_s - ar_step_s) * (T - 1) / max_gamma
  rows = expected_rows(accepted_at, draft_step_s, verify_s, ar_step_s)
  best = max(rows, key=lambda r: r["speedup_vs_ar"])
  return GammaChoice(gamma=best["gamma"], rows=tuple(rows),
                     accepted_at=tuple(float(a) for a in accepted_at), ar_step_s=ar_step_s)
