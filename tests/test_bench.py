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
