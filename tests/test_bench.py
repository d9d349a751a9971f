"""`jspec bench`'s timing order: methods compared in one run are timed prompt by prompt."""

import dataclasses
from types import SimpleNamespace

import pytest

from jspec.bench.speed import Method, Run, bench_interleaved


@dataclasses.dataclass
class LoggedMethod(Method):
  """A method that records when it is compiled and timed instead of decoding."""

  name: str = ""
  log: list = dataclasses.field(default_factory=list)

  def warm(self, prompts):
    self.log.append(("warm", self.name))
    return {"compile_s": 0.0}

  def time_prompt(self, run: Run, p):
    self.log.append((p[0], self.name))
    run.wall_s.append(1.0)


def test_methods_are_compiled_first_then_timed_prompt_by_prompt():
  log = []
  methods = [LoggedMethod(None, 4, None, 0, name=n, log=log) for n in ("ar", "chain", "tree")]
  prompts = [[10], [11], [12]]
  results = bench_interleaved(methods, prompts)
  assert log[:3] == [("warm", "ar"), ("warm", "chain"), ("warm", "tree")]
  # A slowdown halfway through then lands on every method alike.
  assert log[3:] == [(p[0], n) for p in prompts for n in ("ar", "chain", "tree")]
  assert [len(run.wall_s) for run, _ in results] == [3, 3, 3]
  assert [extra for _, extra in results] == [{"compile_s": 0.0}] * 3


def test_transformers_runs_on_the_gpu_jax_uses_in_jspecs_dtype(monkeypatch):
  import jax
  import jax.numpy as jnp
  torch = pytest.importorskip("torch")
  from jspec.bench.speed import torch_placement

  def model(dtype):
    return SimpleNamespace(params=SimpleNamespace(embed=jnp.zeros((2, 2), dtype)))

  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA box running JAX on CPU
  assert torch_placement(model(jnp.float32)) == ("cpu", "float32")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
  assert torch_placement(model(jnp.bfloat16)) == ("cuda", "bfloat16")
  monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch build
  assert torch_placement(model(jnp.float32)) == ("cpu", "float32")
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # torch has no TPU backend
  monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
  assert torch_placement(model(jnp.float32)) == ("cpu", "float32")


def test_decode_rate_is_withheld_when_the_first_token_took_longer_than_the_run():
  """ttft is timed in a separate call: on a short answer it can exceed the run's wall time, and
  a negative decode time must not become a negative rate."""
  from jspec.bench.speed import Run
  run = Run(new_tokens=[8, 8], wall_s=[1.0, 1.0], ttft_s=[0.5, 0.25], target_calls=[8, 8])
  assert run.summary()["decode_tokens_per_s"] == 14 / 1.25
  run = Run(new_tokens=[8], wall_s=[1.0], ttft_s=[1.1], target_calls=[8])
  assert run.summary()["decode_tokens_per_s"] is None


def test_round_time_falls_back_to_the_wall_time_when_the_decode_time_is_not_positive():
  """A negative decode time (the first token's separate call outlasting the run) must not become
  a negative time per round (nor a negative engine overhead after it)."""
  import numpy as np
  from jspec.bench.speed import _speculative_fields
  from jspec.sampling.processing import SamplingParams
  ar = {"tokens_per_s": 8.0}
  hist = np.array([1, 1, 2])
  short = Run(new_tokens=[8], wall_s=[1.0], ttft_s=[1.5], target_calls=[4], round_tokens=8,
              row_rounds=4, accept_hist=hist)
  fields = _speculative_fields(short, 2, None, ar, SamplingParams(temperature=1.0))
  assert fields["round_s"] == pytest.approx(1.0 / 4)
  timed = Run(new_tokens=[8], wall_s=[1.0], ttft_s=[0.2], target_calls=[4], round_tokens=8,
              row_rounds=4, accept_hist=hist)
  fields = _speculative_fields(timed, 2, None, ar, SamplingParams(temperature=1.0))
  assert fields["round_s"] == pytest.approx(0.8 / 4)


def test_a_method_that_does_not_report_its_target_calls_records_none():
  """transformers' assisted generation reports no calls: 0 would read as 'no forward at all'."""
  assert Run(new_tokens=[8], wall_s=[1.0], ttft_s=[0.1]).summary()["target_calls"] is None
  assert Run(new_tokens=[8, 3], wall_s=[1.0, 1.0], ttft_s=[0.1, 0.1],
             target_calls=[5, 2]).summary()["target_calls"] == 7


def test_gamma_auto_is_kept_with_jspecs_chain_records_only():
  from jspec.cli.bench import attach_gamma_auto
  choice = SimpleNamespace(rows=(4, 2), accepted_at=(3, 1))
  records = [{"method": "jspec-autoregressive"},
             {"method": "jspec-speculative", "gamma": 2},
             {"method": "jspec-speculative", "gamma": 2, "tree": "chain:2"},
             {"method": "transformers-assisted", "gamma": 2},
             {"method": "jspec-speculative", "gamma": 3}]
  attach_gamma_auto(records, 2, choice)
  assert ["gamma_auto" in r for r in records] == [False, True, False, False, False]
  assert records[1]["gamma_auto"] == {"rows": [4, 2], "accepted_at": [3, 1]}


def test_a_program_the_warm_up_missed_is_timed_again_compiled(tmp_path):
  """Prompts of one bucket near max_position_embeddings can get two cache sizes (two programs);
  the warm-up compiles one prompt per bucket, so the other would time its compile: retimed."""
  import ggufutil
  from jspec.decode import plan_cache, prompt_bucket
  from jspec.model import load
  from jspec.sampling.processing import GREEDY
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path, "llama", max_position_embeddings=100)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  model = load(str(d))
  short, long = [5] * 49, [6] * 60
  assert prompt_bucket(len(short)) == prompt_bucket(len(long))
  sizes = [plan_cache(model.cfg, [len(p)], 10)[1] for p in (short, long)]
  assert sizes[0] != sizes[1], sizes  # the premise: one bucket, two programs
  method = Method(model, 10, GREEDY, 0, measure_ttft=False)
  assert method.warm([short, long])["programs"] == 1  # one prompt per bucket warmed
  run = Run()
  for p in (short, long, long, short):
    method.time_prompt(run, p)
  assert run.retimed == 1 and run.summary()["retimed"] == 1
  assert len(run.wall_s) == 4


def test_a_run_without_rounds_records_no_block_efficiency(capsys):
  """One-token answers run no verification round: tau is undefined there, not 0."""
  import numpy as np
  from jspec.bench.speed import _speculative_fields, print_table
  from jspec.sampling.processing import SamplingParams
  run = Run(new_tokens=[1], wall_s=[0.5], ttft_s=[0.5], target_calls=[1], accept_hist=np.zeros(3,
                                                                                              int))
  fields = _speculative_fields(run, 2, None, {"tokens_per_s": 2.0}, SamplingParams(temperature=1.0))
  assert fields["block_efficiency"] is None and fields["accepted_per_round"] is None
  print_table([{"method": "jspec-speculative", **fields}])
  assert "block_efficiency" not in capsys.readouterr().out
